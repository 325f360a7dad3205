#!/usr/bin/env python3
"""Developer entry point (stdlib only; run with any ``python3``).

    python3 dev.py test [PYTEST ARGS...]
        Ensure the cached env, install this checkout's patch into it, run pytest.
    python3 dev.py side-by-side SCRIPT [ARGS...]
        Run SCRIPT once against stock sglang 0.5.23 and once against the patched
        files, each in its own process, in the same cached env.
    python3 dev.py demo [--backend nixl] [--quick] [--out DIR]
        The main job: two prefill servers, one decode and the PD router on this
        machine, one prefill frozen mid-run; stock, then patched (tools/demo_pd.py).
        Each run calibrates the load first; patched sends the rate stock chose.
        Other arguments (e.g. --rate R) go to tools/demo_pd.py.
    python3 dev.py soak [--minutes M] [--seed S] [--both] [--backend nixl]
        The chaos soak: the demo's deployment under load for M minutes (10) while
        a seeded schedule freezes, kills and restarts, and slows its prefills;
        stock, then patched with the same schedule (tools/soak_pd.py).
    python3 dev.py bench [--quick] [--only stall|fleet|admission|share|scale|mirror|serving]
        The scheduler stall benchmark (P1-P8) and the fleet-scale benchmark
        (P9-P12, P15) on real PD over loopback, and the admission benchmark
        (P14: a stuck prefill, real servers), stock and patched.
    python3 dev.py faults [--backend nixl] [--faults NAMES]
        The fault matrix on real PD over loopback, stock and patched, and its
        reliability report (test/pd_loopback/fault_matrix.py, tools/fault_report.py).
    python3 dev.py series edit DIR | series save DIR
        The patch series in patches/ as a git repository at DIR: sglang 0.5.23
        plus one commit per patch (edit), and back (save: patches/ from its
        commits, python/ and the unit tests from its tree).

The env is a venv at ``$SGLANG_PD_PATCH_CACHE/venv`` (default
``~/.cache/sglang-pd-patch``), shared by every clone on the machine. It holds the
packages pinned in ``requirements/env.txt`` and is updated (``pip install -r``)
whenever that file's sha256 differs from ``venv/.requirements.sha256``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent
REQUIREMENTS = REPO / "requirements" / "env.txt"
STAMP_NAME = ".requirements.sha256"
CACHE_ENV = "SGLANG_PD_PATCH_CACHE"
LOCK_HELD_ENV = "SGLANG_PD_PATCH_LOCK_HELD"
VARIANTS = ("stock", "patched")
UNIT_TESTS = "test/registered/unit/disaggregation"
# Real PD on loopback: prefill processes + in-process decode, both backends.
LOOPBACK_TESTS = "test/pd_loopback"
TOOL_TESTS = "tests"
PYTHON_VERSION = (3, 11)
# The patch's own tree in sglang (excluded from the variant source fingerprint).
PATCH_FILES = (
    "common/conn.py",
    "decode.py",
    "nixl/conn.py",
    "mooncake/conn.py",
    "mori/conn.py",
)


def log(msg: str) -> None:
    print(f"[dev] {msg}", flush=True)


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "sglang-pd-patch"
    return Path(os.environ.get(CACHE_ENV) or default).expanduser().resolve()


def venv_dir(cache: Path) -> Path:
    return cache / "venv"


def venv_python(cache: Path) -> Path:
    return venv_dir(cache) / "bin" / "python"


def requirements_sha() -> str:
    return hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()


def pinned_requirements() -> dict[str, str]:
    pins = {}
    for line in REQUIREMENTS.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[name.strip()] = version.strip()
    return pins


@contextlib.contextmanager
def cache_lock(cache: Path):
    """Exclusive fcntl lock on ``<cache>/.lock``; re-entrant for our children."""
    cache.mkdir(parents=True, exist_ok=True)
    if os.environ.get(LOCK_HELD_ENV) == str(cache):
        yield
        return
    with open(cache / ".lock", "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another run holding {cache / '.lock'} ...")
            start = time.monotonic()
            fcntl.flock(fh, fcntl.LOCK_EX)
            log(f"got the lock after {time.monotonic() - start:.1f} s")
        os.environ[LOCK_HELD_ENV] = str(cache)
        try:
            yield
        finally:
            os.environ.pop(LOCK_HELD_ENV, None)
            fcntl.flock(fh, fcntl.LOCK_UN)


_PROBE = """
import importlib.metadata as md, json, sys
pins = json.loads(sys.argv[1])
bad = []
for name, want in pins.items():
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        have = None
    if have != want:
        bad.append(f"{name}=={want} (found {have})")
print("; ".join(bad))
sys.exit(1 if bad else 0)
"""


def probe_env(cache: Path) -> tuple[str, str]:
    """("ok" | "outdated" | "broken", detail)."""
    python = venv_python(cache)
    if not python.exists():
        return "broken", f"{python} does not exist"
    try:
        proc = subprocess.run(
            [str(python), "-c", _PROBE, json.dumps(pinned_requirements())],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return "broken", f"{python} does not run: {exc}"
    if proc.returncode == 0:
        return "ok", ""
    if proc.returncode == 1 and proc.stdout.strip():
        return "outdated", proc.stdout.strip()
    return "broken", (proc.stderr or proc.stdout).strip()[-500:]


def _base_python() -> str:
    if sys.version_info[:2] == PYTHON_VERSION:
        return sys.executable
    name = "python%d.%d" % PYTHON_VERSION
    found = shutil.which(name)
    if not found:
        raise SystemExit(f"[dev] need {name} to create the env (sglang wheel is cp311)")
    return found


def _run(cmd: list[str], **kwargs) -> int:
    log("$ " + " ".join(str(c) for c in cmd))
    return subprocess.run(
        [str(c) for c in cmd], stdin=subprocess.DEVNULL, **kwargs
    ).returncode


def _pip_install(cache: Path) -> bool:
    cmd = [venv_python(cache), "-m", "pip", "install", "--disable-pip-version-check"]
    return _run(cmd + ["-r", REQUIREMENTS]) == 0


def _create_env(cache: Path) -> None:
    venv = venv_dir(cache)
    if venv.exists() or venv.is_symlink():
        log(f"removing unusable env {venv}")
        shutil.rmtree(venv, ignore_errors=True)
    if _run([_base_python(), "-m", "venv", venv]) != 0:
        raise SystemExit(f"[dev] cannot create a venv at {venv}")
    if not _pip_install(cache):
        raise SystemExit(f"[dev] pip install -r {REQUIREMENTS} failed in {venv}")


def ensure_env_locked(cache: Path) -> Path:
    """Make the cached env match requirements/env.txt (caller holds the lock)."""
    start = time.monotonic()
    venv = venv_dir(cache)
    stamp = venv / STAMP_NAME
    want = requirements_sha()
    state, detail = probe_env(cache)
    have = stamp.read_text().strip() if stamp.is_file() else None
    if state == "broken":
        log(f"env {venv}: missing or unusable ({detail}); building it (takes minutes)")
        with contextlib.suppress(FileNotFoundError):
            stamp.unlink()
        _create_env(cache)
    elif state == "outdated" or have != want:
        why = detail or (
            f"no stamp {stamp.name}" if have is None else "requirements/env.txt changed"
        )
        log(f"env {venv}: updating ({why})")
        with contextlib.suppress(FileNotFoundError):
            stamp.unlink()
        if not _pip_install(cache):
            log("pip install -r failed in the existing env; rebuilding it from scratch")
            _create_env(cache)
    else:
        log(f"env {venv}: up to date")
    state, detail = probe_env(cache)
    if state != "ok":
        raise SystemExit(f"[dev] env {venv} still not usable after install: {detail}")
    stamp.write_text(want + "\n")  # last: only a complete env gets the stamp
    log(f"env ready in {time.monotonic() - start:.1f} s")
    return venv_python(cache)


def tool_env(extra: dict[str, str] | None = None, path: list[Path] = ()) -> dict:
    env = dict(os.environ)
    entries = [str(p) for p in path] + [str(REPO)]
    if env.get("PYTHONPATH"):
        entries.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(entries)
    env.update(extra or {})
    return env


def manifest_version() -> str:
    data = json.loads((REPO / "sglang_pd_patch" / "manifest.json").read_text())
    return data["sglang_version"]


def install_patch_locked(python: Path, cache: Path) -> None:
    """Install this checkout's patch into the env (upgrades other builds)."""
    start = time.monotonic()
    cmd = [python, "-m", "sglang_pd_patch", "install"]
    rc = _run(cmd, env=tool_env())
    if rc == 2:  # refused: sglang files changed by something else. Our env: repair.
        log("sglang in the cached env is not as expected; reinstalling it with pip")
        pip = [python, "-m", "pip", "install", "--disable-pip-version-check"]
        fix = ["--force-reinstall", "--no-deps", f"sglang=={manifest_version()}"]
        if _run(pip + fix) == 0:
            rc = _run(cmd, env=tool_env())
    if rc != 0:
        raise SystemExit(f"[dev] installing the patch into {cache} failed (rc={rc})")
    log(f"patch installed in {time.monotonic() - start:.1f} s")


# Debian packages the real transfer engines load at run time.
SYSTEM_PACKAGES = {"libibverbs1": "libibverbs.so.1"}
# Debian packages of the commands the tests run: package -> command.
SYSTEM_COMMANDS = {"prometheus": "promtool"}


def _has_library(soname: str) -> bool:
    proc = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True)
    return proc.returncode == 0 and soname in proc.stdout


def ensure_system_packages() -> None:
    """Install the Debian packages Mooncake's engine and the tests need, when
    missing."""
    missing = [pkg for pkg, so in SYSTEM_PACKAGES.items() if not _has_library(so)]
    missing += [pkg for pkg, cmd in SYSTEM_COMMANDS.items() if not shutil.which(cmd)]
    if not missing:
        return
    command = ["apt-get", "install", "-y", "--no-install-recommends", *missing]
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        log(
            f"missing Debian packages {missing}: the tests need them; "
            f"run `sudo apt-get update && sudo {' '.join(command)}`"
        )
        return
    log(f"installing Debian packages {missing}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    if _run(["apt-get", "update", "-qq"], env=env) or _run(command, env=env):
        log(f"apt-get could not install {missing}; some tests will fail")


def cmd_test(pytest_args: list[str]) -> int:
    cache = cache_dir()
    start = time.monotonic()
    ensure_system_packages()
    with cache_lock(cache):
        python = ensure_env_locked(cache)
        install_patch_locked(python, cache)
        paths = [
            p for p in (UNIT_TESTS, LOOPBACK_TESTS, TOOL_TESTS) if (REPO / p).is_dir()
        ]
        if not (REPO / UNIT_TESTS).is_dir():
            log(f"{UNIT_TESTS}/ does not exist yet: skipped")
        test_start = time.monotonic()
        rc = _run(
            [python, "-m", "pytest", "-q", *paths, *pytest_args],
            cwd=REPO,
            # CustomTestCase retries a failed test once when SGLANG_IS_IN_CI is
            # set; a test that only passes on retry should fail here.
            env=tool_env({"SGLANG_TEST_MAX_RETRY": "0"}),
        )
    if rc == 5:
        log("pytest collected no tests: failing")
    log(
        f"pytest exit code {rc}; tests took {time.monotonic() - test_start:.1f} s, "
        f"whole command {time.monotonic() - start:.1f} s"
    )
    return rc


# --------------------------------------------------------------------------- #
# side-by-side
# --------------------------------------------------------------------------- #


def site_packages(cache: Path) -> Path:
    found = sorted(venv_dir(cache).glob("lib/python3.*/site-packages"))
    if not found:
        raise SystemExit(f"[dev] no site-packages in {venv_dir(cache)}")
    return found[-1]


def source_fingerprint(src: Path) -> str:
    """Hash of the sglang tree, ignoring bytecode and what our tool manages."""
    skip = {f"srt/disaggregation/{rel}" for rel in PATCH_FILES}
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = sorted(
            d for d in dirnames if d not in ("__pycache__", ".sglang_pd_patch")
        )
        for name in sorted(filenames):
            path = Path(dirpath) / name
            rel = path.relative_to(src).as_posix()
            if rel in skip:
                continue
            st = path.lstat()
            digest.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _copy_tree(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, symlinks=True)
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)


def _prepare_variant(
    python: Path,
    src: Path,
    variant: str,
    fingerprint: str,
    cache: Path,
    stock_files: Path | None = None,
) -> Path:
    """``<cache>/variants/<variant>`` holding an sglang/ copy in that state.
    ``stock_files``: install these files as the stock variant instead of
    restoring pristine 0.5.23 (the demo's CPU-enabled stock)."""
    vdir = cache / "variants" / variant
    dst = vdir / "sglang"
    stamp = vdir / ".source-fingerprint"
    action = ["uninstall"] if variant == "stock" else ["install"]
    if variant == "stock" and stock_files is not None:
        action = ["install", "--patched-dir", str(stock_files)]
    for attempt in (1, 2):
        fresh = False
        if (
            attempt == 2
            or not dst.is_dir()
            or (not stamp.is_file() or stamp.read_text().strip() != fingerprint)
        ):
            start = time.monotonic()
            vdir.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                stamp.unlink()
            _copy_tree(src, dst)
            stamp.write_text(fingerprint + "\n")
            fresh = True
            log(f"variant {variant}: copied {src} ({time.monotonic() - start:.1f} s)")
        proc = subprocess.run(
            [str(python), "-m", "sglang_pd_patch", *action, "--sglang-dir", str(dst)],
            env=tool_env(),
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
        )
        if proc.returncode == 0:
            log(f"variant {variant}: ready at {dst}")
            return vdir
        log(f"variant {variant}: `{action}` failed (rc={proc.returncode}):")
        print(proc.stdout + proc.stderr, flush=True)
        if fresh:
            break
    raise SystemExit(f"[dev] cannot prepare the {variant} variant in {vdir}")


# Runs in the child: check where sglang resolves (without importing it), then run
# the script as __main__, then check again what was actually imported.
_BOOT = """
import atexit, importlib.util, os, runpy, sys
vdir = os.path.realpath(os.environ["SGLANG_PD_VARIANT_DIR"]) + os.sep
def _check(path, what):
    if not os.path.realpath(path or "").startswith(vdir):
        sys.stderr.write(f"side-by-side: {what} is {path}, not under {vdir}\\n")
        os._exit(97)
spec = importlib.util.find_spec("sglang")
_check(spec and spec.origin, "sglang resolves to")
def _after():
    mod = sys.modules.get("sglang")
    if mod is not None:
        _check(getattr(mod, "__file__", None), "sglang.__file__")
atexit.register(_after)
sys.argv = sys.argv[1:]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@dataclasses.dataclass
class VariantRun:
    variant: str
    returncode: int
    output: str
    seconds: float


def side_by_side(
    script: str | os.PathLike,
    args: list[str] = (),
    cache: Path | None = None,
    echo: bool = True,
    variant_args: dict[str, list[str]] | None = None,
    stock_files: Path | None = None,
) -> dict[str, VariantRun]:
    """Run ``script`` against stock and patched sglang (in that order), each in its
    own process of the cached env's Python; returns the runs by variant name.

    Child env: ``PYTHONPATH=<variant dir>:<repo>``, ``SGLANG_PD_VARIANT`` and
    ``SGLANG_PD_VARIANT_DIR``; processes it spawns inherit them.
    """
    cache = cache or cache_dir()
    script = Path(script).resolve()
    runs = {}
    with cache_lock(cache):
        python = ensure_env_locked(cache)
        src = site_packages(cache) / "sglang"
        fingerprint = source_fingerprint(src)
        vdirs = {
            v: _prepare_variant(python, src, v, fingerprint, cache, stock_files)
            for v in VARIANTS
        }
        for variant in VARIANTS:
            env = tool_env(
                {
                    "SGLANG_PD_VARIANT": variant,
                    "SGLANG_PD_VARIANT_DIR": str(vdirs[variant]),
                    # Progress shows as it happens, not when the pipe fills.
                    "PYTHONUNBUFFERED": "1",
                },
                path=[vdirs[variant]],
            )
            if echo:
                print(f"===== {variant} =====", flush=True)
            start = time.monotonic()
            extra = (variant_args or {}).get(variant, [])
            proc = subprocess.Popen(
                [str(python), "-c", _BOOT, str(script), *map(str, args), *extra],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
            )
            lines = []
            for line in proc.stdout:
                lines.append(line)
                if echo:
                    print(f"[{variant}] {line}", end="", flush=True)
            rc = proc.wait()
            seconds = time.monotonic() - start
            runs[variant] = VariantRun(variant, rc, "".join(lines), seconds)
            if echo:
                print(f"===== {variant}: exit {rc}, {seconds:.1f} s =====", flush=True)
    return runs


# --------------------------------------------------------------------------- #
# demo
# --------------------------------------------------------------------------- #

CPU_ENABLE_PATCH = REPO / "sglang_pd_patch" / "cpu_enable.patch"


def cpu_enabled_stock_files(cache: Path) -> Path:
    """Pristine 0.5.23 files plus ONLY sglang_pd_patch/cpu_enable.patch: pristine
    0.5.23 cannot run PD on a CPU-only machine, so this is the demo's stock."""
    sys.path.insert(0, str(REPO))
    from sglang_pd_patch import core, series

    root = cache / "variants" / "stock-cpu-files"
    shutil.rmtree(root, ignore_errors=True)
    series.write_base(root, REPO)
    if _run(["git", "apply", CPU_ENABLE_PATCH], cwd=root) != 0:
        raise SystemExit(f"[dev] {CPU_ENABLE_PATCH} does not apply to sglang 0.5.23")
    return root / core.REPO_DISAGG_SUBDIR


def _run_both(script, args, variant_args, stock_files=None) -> bool:
    """``script`` (a tools/ name or a path) against stock and patched; False
    (logged) if either failed."""
    script = REPO / "tools" / script if isinstance(script, str) else script
    runs = side_by_side(
        script,
        args,
        variant_args=variant_args,
        stock_files=stock_files,
    )
    failed = [v for v, run in runs.items() if run.returncode != 0]
    if failed:
        log(f"{script.relative_to(REPO)} failed for {failed}")
    return not failed


def _compare(script, args, report_tool: str, out: Path, servers=False) -> int:
    """``script`` writes ``<out>/<variant>.json`` for stock and patched, then
    ``tools/<report_tool>`` writes ``<out>/report.md`` from the two. With
    ``servers``, the script runs real servers: its stock needs the CPU hunks."""
    start = time.monotonic()
    ensure_system_packages()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    variant_args = {v: ["--out", str(out / f"{v}.json")] for v in VARIANTS}
    stock_files = cpu_enabled_stock_files(cache_dir()) if servers else None
    if not _run_both(script, args, variant_args, stock_files=stock_files):
        return 1
    report = [venv_python(cache_dir()), REPO / "tools" / report_tool]
    report += ["--stock", out / "stock.json", "--patched", out / "patched.json"]
    if _run([*report, "--out", out / "report.md"], env=tool_env()) != 0:
        return 1
    log(f"report: {out / 'report.md'}")
    log(f"took {time.monotonic() - start:.0f} s")
    return 0


def cmd_demo(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python3 dev.py demo")
    ap.add_argument("--backend", choices=("mooncake", "nixl"), default="mooncake")
    ap.add_argument("--quick", action="store_true", help="short phases, ~4 min each")
    ap.add_argument("--out", type=Path, default=REPO / "demo-out")
    args, rest = ap.parse_known_args(argv)
    start = time.monotonic()
    ensure_system_packages()
    out = args.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    common = ["--backend", args.backend, *(["--quick"] if args.quick else []), *rest]
    variant_args = {v: ["--out", str(out / v)] for v in VARIANTS}
    # Stock runs first; patched sends the rate stock's calibration chose.
    variant_args["patched"] += ["--rate-from", str(out / "stock")]
    if not _run_both(
        "demo_pd.py",
        common,
        variant_args,
        stock_files=cpu_enabled_stock_files(cache_dir()),
    ):
        log(f"logs are in {out}")
        return 1
    python = venv_python(cache_dir())
    report = [python, REPO / "tools" / "demo_report.py", out / "stock"]
    if _run([*report, out / "patched", "--out", out], env=tool_env()) != 0:
        return 1
    log(f"report: {out / 'report.md'}, plot: {out / 'latency.png'}")
    log(f"whole demo took {time.monotonic() - start:.0f} s")
    return 0


def cmd_soak(argv: list[str]) -> int:
    """tools/soak_pd.py against stock and patched (the same fault schedule, the
    rate stock's calibration chose), then tools/soak_report.py."""
    import argparse

    ap = argparse.ArgumentParser(prog="python3 dev.py soak")
    ap.add_argument("--backend", choices=("mooncake", "nixl"), default="mooncake")
    ap.add_argument("--minutes", type=float, default=10.0, help="length of the load")
    ap.add_argument("--seed", type=int, default=1, help="seed of the fault schedule")
    ap.add_argument("--both", action="store_true", help="both prefills may be down")
    ap.add_argument("--out", type=Path, default=REPO / "soak-out")
    args, rest = ap.parse_known_args(argv)
    start = time.monotonic()
    ensure_system_packages()
    out = args.out.resolve()
    shutil.rmtree(out, ignore_errors=True)
    common = ["--backend", args.backend, "--minutes", str(args.minutes)]
    common += ["--seed", str(args.seed), *(["--both"] if args.both else []), *rest]
    variant_args = {v: ["--out", str(out / v)] for v in VARIANTS}
    variant_args["patched"] += ["--rate-from", str(out / "stock")]
    if not _run_both(
        "soak_pd.py",
        common,
        variant_args,
        stock_files=cpu_enabled_stock_files(cache_dir()),
    ):
        log(f"logs are in {out}")
        return 1
    report = [venv_python(cache_dir()), REPO / "tools" / "soak_report.py"]
    report += [out / "stock", out / "patched", "--out", out]
    if _run(report, env=tool_env()) != 0:
        return 1
    log(f"report: {out / 'report.md'}, plot: {out / 'soak.png'}")
    log(f"whole soak took {time.monotonic() - start:.0f} s")
    return 0


def cmd_bench(argv: list[str]) -> int:
    """tools/bench_stall.py against stock 0.5.23 and the patch, then the report."""
    import argparse

    ap = argparse.ArgumentParser(prog="python3 dev.py bench")
    ap.add_argument("--quick", action="store_true", help="shorter runs")
    ap.add_argument("--out", type=Path, default=REPO / "bench-out")
    ap.add_argument(
        "--only",
        choices=("stall", "fleet", "admission", "mirror", "share", "scale", "serving"),
        help="the stall bench (P1-P8), the fleet bench (P9-P12, P15), the "
        "admission bench (P14, real servers), the mirror bench (P16, sick "
        "decodes on the prefill), the share bench (P17, a prefill stuck for "
        "good, simulated) or the scale bench (P18, 64 decodes, 8 frozen, "
        "simulated engine) alone; serving: bench F (sglang.benchmark.serving "
        "through the router, real servers, two rounds), only when named",
    )
    args, rest = ap.parse_known_args(argv)
    quick = ["--quick"] if args.quick else []
    out = args.out.resolve()
    if args.only == "serving":
        return _bench_serving(out / "serving")
    if args.only in (None, "stall"):
        rc = _compare("bench_stall.py", quick + rest, "bench_report.py", out)
        if rc != 0 or args.only == "stall":
            return rc
    # The other benches write next to the stall bench's report.
    if args.only in (None, "fleet"):
        rc = _compare("bench_fleet.py", quick, "bench_fleet_report.py", out / "fleet")
        if rc != 0 or args.only == "fleet":
            return rc
    if args.only in (None, "admission"):
        rc = _compare(
            "bench_admission.py",
            quick,
            "bench_admission_report.py",
            out / "admission",
            servers=True,
        )
        if rc != 0 or args.only == "admission":
            return rc
    if args.only in (None, "share"):
        rc = _compare("bench_share.py", [], "bench_share_report.py", out / "share")
        if rc != 0 or args.only == "share":
            return rc
    if args.only in (None, "scale"):
        rc = _compare(
            "bench_transfer_scale.py",
            quick,
            "bench_transfer_scale_report.py",
            out / "scale",
        )
        if rc != 0 or args.only == "scale":
            return rc
    return _compare("bench_mirror.py", quick, "bench_mirror_report.py", out / "mirror")


def _bench_serving(out: Path, rounds: int = 2) -> int:
    """Bench F: tools/demo_pd.py --serving (sglang.benchmark.serving through the
    router, no fault), stock then patched, ``rounds`` times; every run offers
    the load the first stock run calibrated. Then tools/serving_report.py."""
    start = time.monotonic()
    ensure_system_packages()
    shutil.rmtree(out, ignore_errors=True)
    first = None
    for i in range(rounds):
        rdir = out / f"round{i + 1}"
        variant_args = {v: ["--out", str(rdir / v)] for v in VARIANTS}
        variant_args["stock"] += ["--rate-from", str(first)] if first else []
        variant_args["patched"] += ["--rate-from", str(first or rdir / "stock")]
        common = ["--serving", "--prompt-tokens", "256"]
        stock_files = cpu_enabled_stock_files(cache_dir())
        if not _run_both("demo_pd.py", common, variant_args, stock_files):
            log(f"logs are in {rdir}")
            return 1
        first = first or rdir / "stock"
    report = [venv_python(cache_dir()), REPO / "tools" / "serving_report.py", out]
    rc = _run(report, env=tool_env())
    log(f"bench F took {time.monotonic() - start:.0f} s; report: {out / 'report.md'}")
    return rc


def cmd_faults(argv: list[str]) -> int:
    """test/pd_loopback/fault_matrix.py against stock 0.5.23 and the patch, then
    tools/fault_report.py."""
    import argparse

    ap = argparse.ArgumentParser(prog="python3 dev.py faults")
    ap.add_argument("--backend", choices=("mooncake", "nixl"), default="mooncake")
    ap.add_argument("--faults", help="comma-separated fault names (default all)")
    ap.add_argument("--out", type=Path, default=REPO / "faults-out")
    args = ap.parse_args(argv)
    common = ["--backend", args.backend]
    if args.faults:
        common += ["--faults", args.faults]
    script = REPO / "test" / "pd_loopback" / "fault_matrix.py"
    return _compare(script, common, "fault_report.py", args.out.resolve())


USAGE = """usage: python3 dev.py test [PYTEST ARGS...]
       python3 dev.py side-by-side SCRIPT [ARGS...]
       python3 dev.py demo [--backend nixl] [--quick] [--out DIR]
       python3 dev.py soak [--minutes M] [--seed S] [--both] [--backend nixl] [--out DIR]
       python3 dev.py bench [--quick] [--only stall|fleet|admission|share|scale|mirror|serving] [--out DIR]
       python3 dev.py faults [--backend nixl] [--faults NAMES] [--out DIR]"""


SERIES_GIT = [
    "-c",
    "user.name=sglang-pd-patch",
    "-c",
    "user.email=sglang-pd-patch@localhost",
]
SERIES_DATE = {
    "GIT_AUTHOR_DATE": "2026-11-30T00:00:00+0000",
    "GIT_COMMITTER_DATE": "2026-11-30T00:00:00+0000",
}


def cmd_series(argv: list[str]) -> int:
    """``series edit DIR``: DIR becomes a git repository holding sglang 0.5.23's
    disaggregation files, then one commit per patch of patches/ (git am), to
    amend with git (commit --fixup, rebase -i). ``series save DIR``: patches/
    from DIR's commits (format-patch), and python/ plus the unit tests from
    DIR's tree; ``python3 dev.py test`` then checks every prefix."""
    if len(argv) != 2 or argv[0] not in ("edit", "save"):
        print(
            "usage: python3 dev.py series edit DIR | series save DIR", file=sys.stderr
        )
        return 2
    sys.path.insert(0, str(REPO))
    from sglang_pd_patch import core, series

    action, work = argv[0], Path(argv[1]).resolve()
    env = dict(os.environ, **SERIES_DATE)

    def git(*args: str) -> None:
        subprocess.run(["git", *SERIES_GIT, *args], cwd=work, env=env, check=True)

    patches = series.read_series(REPO)
    if action == "edit":
        if work.exists() and any(work.iterdir()):
            raise SystemExit(f"[dev] {work} is not empty")
        work.mkdir(parents=True, exist_ok=True)
        git("init", "-q", ".")
        series.write_base(work, REPO)
        (work / core.REPO_TEST_SUBDIR / ".keep").write_text("")
        git("add", "-A")
        git("commit", "-q", "-m", "sglang v0.5.23 disaggregation files")
        git(
            "am",
            "-q",
            "--keep-non-patch",
            "--committer-date-is-author-date",
            *map(str, patches),
        )
        log(
            f"{work}: sglang 0.5.23 + {len(patches)} commits; edit them, then "
            f"python3 dev.py series save {work}"
        )
        return 0
    out = series.series_dir(REPO)
    roots = subprocess.run(
        ["git", "rev-list", "--max-parents=0", "HEAD"],
        cwd=work,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for old in out.glob("*.patch"):
        old.unlink()
    git(
        "format-patch",
        "-q",
        "--zero-commit",
        "--no-signature",
        "--full-index",
        "-o",
        str(out),
        f"{roots[0]}..HEAD",
    )
    names = sorted(p.name for p in out.glob("*.patch"))
    (out / "series").write_text("".join(f"{n}\n" for n in names))
    for sub in (core.REPO_DISAGG_SUBDIR, core.REPO_TEST_SUBDIR):
        for rel, path in series._files(work).items():
            if rel.startswith(sub) and not rel.endswith(".keep"):
                dest = REPO / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, dest)
    log(f"wrote {len(names)} patches to {out} and the files of {work}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["series"]:
        return cmd_series(argv[1:])
    if argv[:1] == ["test"]:
        return cmd_test(argv[1:])
    if argv[:1] == ["demo"]:
        return cmd_demo(argv[1:])
    if argv[:1] == ["soak"]:
        return cmd_soak(argv[1:])
    if argv[:1] == ["bench"]:
        return cmd_bench(argv[1:])
    if argv[:1] == ["faults"]:
        return cmd_faults(argv[1:])
    if argv[:1] == ["side-by-side"] and len(argv) >= 2:
        runs = side_by_side(argv[1], argv[2:])
        return 0 if all(r.returncode == 0 for r in runs.values()) else 1
    print(USAGE, file=sys.stderr)
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
