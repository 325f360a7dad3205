"""Install, verify and remove the patched disaggregation files in an sglang tree.

Stdlib only, and sglang is never imported: the target package directory is found
with ``importlib.util.find_spec`` (which does not execute it) or given explicitly.

Every file is judged by its content (sha256):

* ``stock``: the pristine sglang 0.5.23 bytes (from the manifest);
* ``patched``: the bytes shipped with this build of the patch;
* ``patched (other build)``: bytes recorded in our state file by an earlier install
  (another build of this patch, e.g. an older version or another checkout);
* ``modified by someone else``: anything else, including a missing file.

Crash safety: a backup of the stock bytes and the state file (which records the
patched sha256 of every file) are written before any target file is replaced, and
every write is a temp file + fsync + ``os.replace``. So whenever the process stops,
each file is either stock or a recorded patched build, never half written.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Callable, Iterable

PROG = "sglang-pd-patch"
TOOL_VERSION = "0.1.0"
STATE_DIRNAME = ".sglang_pd_patch"
STATE_FILENAME = "state.json"
BACKUP_DIRNAME = "backup"
TMP_SUFFIX = ".sglang-pd-patch.tmp"
# Inside the sglang package directory.
DISAGG_SUBDIR = "srt/disaggregation"
# Inside an sglang source checkout (and in the exported diff).
REPO_DISAGG_SUBDIR = "python/sglang/srt/disaggregation"
REPO_TEST_SUBDIR = "test/registered/unit/disaggregation"
# Directory with patched files laid out as <rel>; overrides the built-in source.
PATCHED_DIR_ENV = "SGLANG_PD_PATCH_PATCHED_DIR"

STOCK = "stock"
PATCHED = "patched"
OTHER = "patched (other build)"
MODIFIED = "modified by someone else"

EXIT_OK = 0
EXIT_PARTIAL = 1
EXIT_REFUSED = 2
EXIT_TOOL_ERROR = 3

PACKAGE_DIR = Path(__file__).resolve().parent

Out = Callable[[str], None]


class PatchError(Exception):
    """A problem that stops a command; ``str(err)`` says what to do."""

    def __init__(self, message: str, code: int = EXIT_TOOL_ERROR):
        super().__init__(message)
        self.code = code


# --------------------------------------------------------------------------- #
# Manifest, patched-file source, target discovery
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class Manifest:
    sglang_version: str
    wheel: str
    files: dict[str, str]  # rel -> pristine sha256

    @property
    def rels(self) -> list[str]:
        return list(self.files)


def load_manifest() -> Manifest:
    data = json.loads((PACKAGE_DIR / "manifest.json").read_text(encoding="utf-8"))
    return Manifest(
        sglang_version=data["sglang_version"],
        wheel=data["wheel"],
        files={rel: info["sha256"] for rel, info in data["files"].items()},
    )


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str | None:
    try:
        return sha256_bytes(path.read_bytes())
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        return None


def find_checkout() -> Path | None:
    """The repository root when running from a source checkout, else None."""
    root = PACKAGE_DIR.parent
    if (root / REPO_DISAGG_SUBDIR).is_dir() and (root / "pyproject.toml").is_file():
        return root
    return None


def find_patched_dir(override: str | os.PathLike | None = None) -> Path:
    """Directory holding the patched files as ``<rel>`` (e.g. ``nixl/conn.py``).

    In order: ``override``, ``$SGLANG_PD_PATCH_PATCHED_DIR``, the checkout's
    ``python/sglang/srt/disaggregation``, the copies shipped in the wheel
    (``sglang_pd_patch/_patched``).
    """
    if override is None:
        override = os.environ.get(PATCHED_DIR_ENV) or None
    if override is not None:
        path = Path(override)
        if not path.is_dir():
            raise PatchError(f"patched-files directory not found: {path}")
        return path
    checkout = find_checkout()
    if checkout is not None:
        return checkout / REPO_DISAGG_SUBDIR
    shipped = PACKAGE_DIR / "_patched"
    if shipped.is_dir():
        return shipped
    raise PatchError(
        "cannot find the patched files: not a source checkout and no "
        f"{shipped} (broken install of {PROG}?)"
    )


@dataclasses.dataclass(frozen=True)
class PatchSource:
    directory: Path
    files: dict[str, bytes]  # rel -> patched bytes

    def sha(self, rel: str) -> str:
        return sha256_bytes(self.files[rel])

    @property
    def shas(self) -> dict[str, str]:
        return {rel: self.sha(rel) for rel in self.files}

    @property
    def build_id(self) -> str:
        return build_id(self.shas)


def build_id(shas: dict[str, str]) -> str:
    text = "".join(f"{rel}:{shas[rel]}\n" for rel in sorted(shas))
    return sha256_bytes(text.encode())[:12]


def load_patch_source(
    manifest: Manifest, patched_dir: str | os.PathLike | None = None
) -> PatchSource:
    directory = find_patched_dir(patched_dir)
    files = {}
    for rel in manifest.rels:
        path = directory / rel
        if not path.is_file():
            raise PatchError(f"patched file missing from the patch source: {path}")
        files[rel] = path.read_bytes()
    return PatchSource(directory=directory, files=files)


def find_sglang_dir(explicit: str | os.PathLike | None = None) -> Path:
    """The ``sglang`` package directory to act on (never imports sglang)."""
    if explicit is not None:
        path = Path(explicit)
        if not (path / "__init__.py").is_file() and not (path / "srt").is_dir():
            raise PatchError(
                f"{path} does not look like an sglang package directory "
                "(expected __init__.py and srt/)",
                EXIT_REFUSED,
            )
        return path.resolve()
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise PatchError(
            "sglang is not installed in this Python interpreter; install "
            "sglang==0.5.23 or pass --sglang-dir DIR",
            EXIT_REFUSED,
        )
    return Path(list(spec.submodule_search_locations)[0]).resolve()


def read_sglang_version(sglang_dir: Path) -> str | None:
    """The version string assigned in ``<sglang>/_version.py``, or None."""
    try:
        tree = ast.parse((sglang_dir / "_version.py").read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {t.id for t in targets if isinstance(t, ast.Name)}
            if names & {"__version__", "version"} and isinstance(
                node.value, ast.Constant
            ):
                if isinstance(node.value.value, str):
                    return node.value.value
    return None


# --------------------------------------------------------------------------- #
# State of a target tree
# --------------------------------------------------------------------------- #


def state_dir(sglang_dir: Path) -> Path:
    return sglang_dir / STATE_DIRNAME


def backup_path(sglang_dir: Path, rel: str) -> Path:
    return state_dir(sglang_dir) / BACKUP_DIRNAME / rel


def target_path(sglang_dir: Path, rel: str) -> Path:
    return sglang_dir / DISAGG_SUBDIR / rel


def read_state(sglang_dir: Path) -> tuple[dict, str | None]:
    """(state, warning). A missing state file is an empty state."""
    path = state_dir(sglang_dir) / STATE_FILENAME
    empty = {"tool": PROG, "format": 1, "builds": {}}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return empty, None
    except (OSError, ValueError) as exc:
        return empty, f"warning: cannot read {path} ({exc}); ignoring it"
    if not isinstance(data, dict) or not isinstance(data.get("builds"), dict):
        return empty, f"warning: unexpected content in {path}; ignoring it"
    return data, None


@dataclasses.dataclass
class FileReport:
    rel: str
    path: Path
    pristine_sha: str
    patched_sha: str
    found_sha: str | None  # None: missing
    state: str
    other_build: str | None = None  # build id when state == OTHER

    @property
    def at_target(self) -> bool:
        return self.found_sha == self.patched_sha

    @property
    def is_stock(self) -> bool:
        return self.found_sha == self.pristine_sha

    def describe(self) -> str:
        if self.state == STOCK and self.at_target:
            return f"{STOCK} (this build of the patch leaves it unchanged)"
        if self.state == OTHER:
            return f"{OTHER}: {self.other_build}"
        if self.state == MODIFIED and self.found_sha is None:
            return f"{MODIFIED} (file missing)"
        return self.state


@dataclasses.dataclass
class Report:
    sglang_dir: Path
    manifest: Manifest
    source: PatchSource
    version: str | None
    files: list[FileReport]
    state: dict
    warnings: list[str]

    @property
    def version_ok(self) -> bool:
        return self.version == self.manifest.sglang_version

    @property
    def modified(self) -> list[FileReport]:
        return [f for f in self.files if f.state == MODIFIED]

    def other_build_complete(self) -> str | None:
        """Build id if every file matches one recorded other build exactly."""
        for bid, info in self.state.get("builds", {}).items():
            shas = info.get("files", {}) if isinstance(info, dict) else {}
            if bid == self.source.build_id:
                continue
            if all(shas.get(f.rel) == f.found_sha for f in self.files):
                return bid
        return None

    def verdict(self) -> tuple[str, int]:
        if not self.version_ok:
            found = self.version or "unknown (no readable _version.py)"
            return (
                f"wrong sglang version {found}: this patch is for exactly "
                f"sglang {self.manifest.sglang_version}; {REINSTALL_HINT}",
                EXIT_REFUSED,
            )
        if self.modified:
            names = ", ".join(f.rel for f in self.modified)
            return (
                f"modified: {names} changed by someone else; to get back to "
                f"stock sglang {self.manifest.sglang_version}: "
                f"{reinstall_cmd(self.manifest)}, then `{PROG} install`",
                EXIT_REFUSED,
            )
        if all(f.at_target for f in self.files):
            if all(f.is_stock for f in self.files):
                return (
                    "installed (this build of the patch is identical to stock "
                    f"sglang {self.manifest.sglang_version}: nothing to change)",
                    EXIT_OK,
                )
            return "installed", EXIT_OK
        if all(f.is_stock for f in self.files):
            return "not installed", EXIT_OK
        other = self.other_build_complete()
        if other is not None:
            return (
                f"installed (other build {other}): run `{PROG} install` to "
                f"upgrade to build {self.source.build_id} or `{PROG} uninstall` "
                "to revert",
                EXIT_OK,
            )
        return (
            f"partially installed: run `{PROG} install` to finish or "
            f"`{PROG} uninstall` to revert",
            EXIT_PARTIAL,
        )


def reinstall_cmd(manifest: Manifest) -> str:
    return f"pip install --force-reinstall --no-deps sglang=={manifest.sglang_version}"


REINSTALL_HINT = (
    "install that version (pip install --force-reinstall --no-deps "
    "sglang==0.5.23) or use a build of this patch made for your version"
)


def inspect(sglang_dir: Path, manifest: Manifest, source: PatchSource) -> Report:
    state, warning = read_state(sglang_dir)
    warnings = [warning] if warning else []
    recorded: dict[str, dict[str, str]] = {}  # rel -> sha -> build id
    for bid, info in state.get("builds", {}).items():
        if not isinstance(info, dict) or not isinstance(info.get("files"), dict):
            continue
        for rel, sha in info["files"].items():
            recorded.setdefault(rel, {}).setdefault(sha, bid)
    files = []
    for rel, pristine in manifest.files.items():
        path = target_path(sglang_dir, rel)
        found = sha256_file(path)
        patched = source.sha(rel)
        other = None
        if found == pristine:
            st = STOCK
        elif found == patched:
            st = PATCHED
        elif found is not None and found in recorded.get(rel, {}):
            st = OTHER
            other = recorded[rel][found]
        else:
            st = MODIFIED
        files.append(FileReport(rel, path, pristine, patched, found, st, other))
    return Report(
        sglang_dir=sglang_dir,
        manifest=manifest,
        source=source,
        version=read_sglang_version(sglang_dir),
        files=files,
        state=state,
        warnings=warnings,
    )


def check_backup(sglang_dir: Path, f: FileReport) -> str | None:
    """None when the backup of ``f`` holds the pristine bytes, else the problem."""
    path = backup_path(sglang_dir, f.rel)
    found = sha256_file(path)
    if found is None:
        return f"backup of {f.rel} is missing ({path})"
    if found != f.pristine_sha:
        return (
            f"backup of {f.rel} is corrupt ({path}): expected sha256 "
            f"{f.pristine_sha}, found {found}"
        )
    return None


# --------------------------------------------------------------------------- #
# Safe file operations
# --------------------------------------------------------------------------- #


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write(path: Path, data: bytes, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` via temp file + fsync + os.replace."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if mode is None:
        try:
            mode = stat.S_IMODE(path.stat().st_mode)
        except FileNotFoundError:
            mode = 0o644
    fd, tmp = tempfile.mkstemp(
        dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX
    )
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def remove_stale_pyc(path: Path) -> list[Path]:
    removed = []
    cache = path.parent / "__pycache__"
    for pyc in sorted(cache.glob(f"{path.stem}.cpython-*.pyc")):
        with contextlib.suppress(FileNotFoundError):
            pyc.unlink()
            removed.append(pyc)
    return removed


def sweep_temp_files(dirs: Iterable[Path]) -> None:
    """Remove temp files left by a process killed in the middle of a write."""
    for directory in set(dirs):
        if directory.is_dir():
            for tmp in directory.glob(f".*{TMP_SUFFIX}"):
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()


def _touched_dirs(sglang_dir: Path, manifest: Manifest) -> list[Path]:
    dirs = []
    for rel in manifest.rels:
        dirs.append(target_path(sglang_dir, rel).parent)
        dirs.append(backup_path(sglang_dir, rel).parent)
    dirs.append(state_dir(sglang_dir))
    return dirs


def write_state(sglang_dir: Path, state: dict) -> None:
    data = json.dumps(state, indent=2, sort_keys=True) + "\n"
    atomic_write(state_dir(sglang_dir) / STATE_FILENAME, data.encode(), 0o644)


# --------------------------------------------------------------------------- #
# Commands
# --------------------------------------------------------------------------- #


def _prepare(
    sglang_dir: str | os.PathLike | None, patched_dir: str | os.PathLike | None
) -> Report:
    manifest = load_manifest()
    source = load_patch_source(manifest, patched_dir)
    return inspect(find_sglang_dir(sglang_dir), manifest, source)


def _print_header(report: Report, out: Out) -> None:
    out(f"sglang: {report.sglang_dir}")
    want = report.manifest.sglang_version
    if report.version_ok:
        out(f"version: {report.version} (ok: this patch is for sglang {want})")
    else:
        found = report.version or "unknown (no readable _version.py)"
        out(f"version: {found} (WRONG: this patch is for exactly sglang {want})")
    out(
        f"patch: {PROG} {TOOL_VERSION}, build {report.source.build_id}, "
        f"files from {report.source.directory}"
    )
    for warning in report.warnings:
        out(warning)


def _print_files(report: Report, out: Out) -> None:
    width = max(len(f.rel) for f in report.files)
    for f in report.files:
        out(f"  {f.rel:<{width}}  {f.describe()}")


def _refusal(report: Report, action: str) -> str | None:
    """Why ``action`` must not touch this tree (wrong version, foreign edits)."""
    m = report.manifest
    lines = []
    if not report.version_ok:
        found = report.version or "unknown (no readable _version.py)"
        lines.append(
            f"sglang version found: {found} (in {report.sglang_dir / '_version.py'})"
            f"; this patch is for exactly sglang {m.sglang_version}."
        )
        lines.append(
            f"To fix: {reinstall_cmd(m)}, or use a build of {PROG} made for "
            f"sglang {found}."
        )
    for f in report.modified:
        lines.append(f"{f.rel}: {MODIFIED} ({f.path})")
        lines.append(f"  expected sha256 (stock): {f.pristine_sha}")
        if f.patched_sha != f.pristine_sha:
            lines.append(f"   or sha256 (this patch): {f.patched_sha}")
        lines.append(f"             found sha256: {f.found_sha or '(file missing)'}")
    if report.modified:
        lines.append(
            f"To fix: {reinstall_cmd(m)} (restores stock sglang files; "
            f"local edits to them are lost), then run `{PROG} {action}` again."
        )
    if not lines:
        return None
    return "\n".join([f"{action} refused, nothing was changed:"] + lines)


def status(
    sglang_dir: str | os.PathLike | None = None,
    patched_dir: str | os.PathLike | None = None,
    out: Out = print,
) -> int:
    report = _prepare(sglang_dir, patched_dir)
    _print_header(report, out)
    _print_files(report, out)
    verdict, code = report.verdict()
    if code == EXIT_OK and not all(f.is_stock for f in report.files):
        problems = [
            p
            for f in report.files
            if not f.is_stock
            for p in [check_backup(report.sglang_dir, f)]
            if p
        ]
        if problems:
            verdict += f"; WARNING: {'; '.join(problems)} (uninstall is impossible: "
            verdict += f"{reinstall_cmd(report.manifest)})"
            code = EXIT_PARTIAL
    elif (
        all(f.is_stock for f in report.files)
        and state_dir(report.sglang_dir).exists()
        and not all(f.at_target for f in report.files)
    ):
        verdict += f" (leftover {STATE_DIRNAME}/: `{PROG} uninstall` removes it)"
    out(f"verdict: {verdict}")
    return code


def _checked_report(sglang_dir, patched_dir, action: str, out: Out):
    """The report of the target tree, or None (after saying why) when ``action``
    must change nothing: wrong version or a file modified by someone else."""
    report = _prepare(sglang_dir, patched_dir)
    _print_header(report, out)
    refusal = _refusal(report, action)
    if refusal:
        _print_files(report, out)
        out(refusal)
        return None
    return report


def install(
    sglang_dir: str | os.PathLike | None = None,
    patched_dir: str | os.PathLike | None = None,
    dry_run: bool = False,
    out: Out = print,
    after_file: Callable[[str], None] | None = None,
) -> int:
    """Install the patched files. ``after_file(rel)`` runs after each replaced file
    (a test hook: raising from it simulates an interruption)."""
    report = _checked_report(sglang_dir, patched_dir, "install", out)
    if report is None:
        return EXIT_REFUSED
    root = report.sglang_dir
    todo = [f for f in report.files if not f.at_target]
    if not todo:
        _print_files(report, out)
        out("already installed: nothing to do")
        return EXIT_OK
    # Files that stay non-stock (or become so) need a usable backup for uninstall.
    problems = [
        p for f in report.files if not f.is_stock for p in [check_backup(root, f)] if p
    ]
    if problems:
        out("install refused, nothing was changed:")
        for p in problems:
            out(f"  {p}")
        out(
            f"Without the stock bytes the patch could not be uninstalled. To fix: "
            f"{reinstall_cmd(report.manifest)}, then run `{PROG} install` again."
        )
        return EXIT_REFUSED

    to_backup = [f for f in todo if f.is_stock and check_backup(root, f) is not None]
    if dry_run:
        for f in to_backup:
            out(f"would back up {f.rel} (stock) -> {backup_path(root, f.rel)}")
        out(f"would record build {report.source.build_id} in {state_dir(root)}")
        for f in todo:
            out(f"would replace {f.rel}: {f.describe()} -> {PATCHED}")
        out("dry run: nothing was changed")
        return EXIT_OK

    sweep_temp_files(_touched_dirs(root, report.manifest))
    # 1. backups of the stock bytes (verified against the manifest).
    for f in to_backup:
        data = f.path.read_bytes()
        if sha256_bytes(data) != f.pristine_sha:  # changed under our feet
            raise PatchError(f"{f.path} changed during install; run it again")
        mode = stat.S_IMODE(f.path.stat().st_mode)
        atomic_write(backup_path(root, f.rel), data, mode)
        out(f"backed up {f.rel} -> {backup_path(root, f.rel)}")
    # 2. record the patched shas before any target is replaced.
    state = dict(report.state)
    builds = dict(state.get("builds", {}))
    bid = report.source.build_id
    builds[bid] = {"version": TOOL_VERSION, "files": report.source.shas}
    state.update(
        tool=PROG,
        format=1,
        sglang_version=report.manifest.sglang_version,
        builds=builds,
        installing=bid,
    )
    write_state(root, state)
    # 3. replace the targets one by one.
    for f in todo:
        atomic_write(f.path, report.source.files[f.rel])
        remove_stale_pyc(f.path)
        out(f"replaced {f.rel}: {f.describe()} -> {PATCHED}")
        if after_file is not None:
            after_file(f.rel)
    # Every file now holds this build: older builds need no recognizing any more.
    state.pop("installing", None)
    state.update(installed=bid, builds={bid: builds[bid]})
    write_state(root, state)
    out(f"installed build {bid} into {root}")
    return EXIT_OK


def uninstall(
    sglang_dir: str | os.PathLike | None = None,
    patched_dir: str | os.PathLike | None = None,
    dry_run: bool = False,
    out: Out = print,
    after_file: Callable[[str], None] | None = None,
) -> int:
    report = _checked_report(sglang_dir, patched_dir, "uninstall", out)
    if report is None:
        return EXIT_REFUSED
    root = report.sglang_dir
    todo = [f for f in report.files if not f.is_stock]
    sdir = state_dir(root)
    if not todo:
        _print_files(report, out)
        if sdir.exists():
            if dry_run:
                out(f"would remove leftover {sdir}")
                out("dry run: nothing was changed")
            else:
                shutil.rmtree(sdir)
                out(f"files already stock; removed leftover {sdir}")
            return EXIT_OK
        out("nothing to do: all files are stock")
        return EXIT_OK
    problems = [p for f in todo for p in [check_backup(root, f)] if p]
    if problems:
        out("uninstall refused, nothing was changed:")
        for p in problems:
            out(f"  {p}")
        out(
            f"The stock bytes cannot be restored from the backup. To get back to "
            f"stock sglang {report.manifest.sglang_version}: "
            f"{reinstall_cmd(report.manifest)}, then run `{PROG} uninstall` "
            f"again to remove {sdir}."
        )
        return EXIT_REFUSED
    if dry_run:
        for f in todo:
            out(f"would restore {f.rel}: {f.describe()} -> {STOCK} (from backup)")
        out(f"would remove {sdir}")
        out("dry run: nothing was changed")
        return EXIT_OK
    sweep_temp_files(_touched_dirs(root, report.manifest))
    for f in todo:
        data = backup_path(root, f.rel).read_bytes()
        if sha256_bytes(data) != f.pristine_sha:
            raise PatchError(f"backup of {f.rel} changed during uninstall")
        atomic_write(f.path, data)
        remove_stale_pyc(f.path)
        out(f"restored {f.rel}: {f.describe()} -> {STOCK}")
        if after_file is not None:
            after_file(f.rel)
    shutil.rmtree(sdir)
    out(f"uninstalled: {root} is stock sglang {report.manifest.sglang_version}")
    return EXIT_OK
