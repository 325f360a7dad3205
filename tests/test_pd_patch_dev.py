"""dev.py: cached-env decisions and side-by-side runs, on a small fake cache."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pd_patch_util import REPO

from sglang_pd_patch import core


@pytest.fixture(scope="module")
def dev():
    spec = importlib.util.spec_from_file_location("pd_patch_dev", REPO / "dev.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses need it
    spec.loader.exec_module(module)
    return module


def fake_env(dev, cache: Path, sglang_dir: Path | None = None) -> Path:
    """A tiny venv (no pip) whose metadata claims the pinned packages."""
    venv = cache / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True
    )
    site = next(venv.glob("lib/python3.*/site-packages"))
    for name, version in dev.pinned_requirements().items():
        # Dist-info dirs use the normalized name (PEP 427), or "sglang-router"
        # would read as package "sglang" at version "router-0.3.2".
        normalized = name.replace("-", "_")
        info = site / f"{normalized}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        )
    if sglang_dir is not None:
        shutil.copytree(sglang_dir, site / "sglang")
    return venv


class Calls(list):
    pip_ok: list[bool]


@pytest.fixture
def calls(dev, monkeypatch):
    """Record (and fake) pip installs and env creation."""
    log = Calls()

    def pip_install(cache):
        log.append("pip")
        return pip_ok.pop(0) if pip_ok else True

    def create_env(cache):
        log.append("create")
        shutil.rmtree(cache / "venv", ignore_errors=True)
        fake_env(dev, cache)

    pip_ok: list[bool] = []
    monkeypatch.setattr(dev, "_pip_install", pip_install)
    monkeypatch.setattr(dev, "_create_env", create_env)
    log.pip_ok = pip_ok
    return log


def test_env_up_to_date_does_nothing(dev, tmp_path, calls):
    cache = tmp_path / "cache"
    fake_env(dev, cache)
    (cache / "venv" / dev.STAMP_NAME).write_text(dev.requirements_sha() + "\n")
    assert dev.ensure_env_locked(cache) == cache / "venv" / "bin" / "python"
    assert calls == []


def test_env_stamp_differs_runs_pip_then_stamps(dev, tmp_path, calls):
    cache = tmp_path / "cache"
    venv = fake_env(dev, cache)
    (venv / dev.STAMP_NAME).write_text("old\n")
    dev.ensure_env_locked(cache)
    assert calls == ["pip"]
    assert (venv / dev.STAMP_NAME).read_text().strip() == dev.requirements_sha()


def test_env_pip_failure_rebuilds(dev, tmp_path, calls):
    cache = tmp_path / "cache"
    fake_env(dev, cache)
    calls.pip_ok.append(False)
    dev.ensure_env_locked(cache)
    assert calls == ["pip", "create"]


def test_env_missing_is_created(dev, tmp_path, calls):
    cache = tmp_path / "cache"
    dev.ensure_env_locked(cache)
    assert calls == ["create"]
    assert (cache / "venv" / dev.STAMP_NAME).is_file()


def test_env_wrong_package_version_runs_pip(dev, tmp_path, calls, monkeypatch):
    cache = tmp_path / "cache"
    venv = fake_env(dev, cache)
    (venv / dev.STAMP_NAME).write_text(dev.requirements_sha() + "\n")
    pins = dict(dev.pinned_requirements(), pytest="0.0.1")
    monkeypatch.setattr(dev, "pinned_requirements", lambda: pins)
    with pytest.raises(SystemExit, match="still not usable"):
        dev.ensure_env_locked(cache)  # the fake pip cannot fix it
    assert calls == ["pip"]
    assert not (venv / dev.STAMP_NAME).exists()


SCRIPT = """
import hashlib, importlib.util, multiprocessing, os, sys

def origin():
    spec = importlib.util.find_spec("sglang.srt.disaggregation.decode")
    sha = hashlib.sha256(open(spec.origin, "rb").read()).hexdigest()
    return f"{os.environ['SGLANG_PD_VARIANT']} {spec.origin} {sha}"

if __name__ == "__main__":
    print("main", origin(), sys.argv[1:])
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        print("spawned", pool.apply(origin))
"""


def test_side_by_side(
    dev, tmp_path, sglang_dir, patched_dir, pristine, monkeypatch, capsys
):
    cache = tmp_path / "cache"
    venv = fake_env(dev, cache, sglang_dir)
    (venv / dev.STAMP_NAME).write_text(dev.requirements_sha() + "\n")
    monkeypatch.setenv(core.PATCHED_DIR_ENV, str(patched_dir))
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)

    runs = dev.side_by_side(script, ["--flag", "1"], cache=cache, echo=False)
    want = {
        "stock": core.sha256_bytes(pristine["decode.py"]),
        "patched": core.sha256_bytes((patched_dir / "decode.py").read_bytes()),
    }
    assert want["stock"] != want["patched"]
    for variant, run in runs.items():
        assert run.returncode == 0, run.output
        origin = (
            cache / "variants" / variant / "sglang" / core.DISAGG_SUBDIR / "decode.py"
        )
        lines = run.output.splitlines()
        assert lines[0] == f"main {variant} {origin} {want[variant]} ['--flag', '1']"
        assert lines[1] == f"spawned {variant} {origin} {want[variant]}"
    assert "copied" in capsys.readouterr().out

    # second run reuses the copies; a change in the source tree refreshes them
    dev.side_by_side(script, [], cache=cache, echo=False)
    assert "copied" not in capsys.readouterr().out
    (next(venv.glob("lib/python3.*/site-packages")) / "sglang" / "new.py").write_text(
        ""
    )
    runs = dev.side_by_side(script, [], cache=cache, echo=True)
    text = capsys.readouterr().out
    assert text.count("copied") == 2
    assert "[patched] main patched" in text and "===== stock =====" in text
    assert (cache / "variants" / "patched" / "sglang" / "new.py").exists()


def test_side_by_side_child_checks_its_sglang(dev, tmp_path, sglang_dir, monkeypatch):
    """If sglang resolves elsewhere than the variant copy, the run fails."""
    cache = tmp_path / "cache"
    venv = fake_env(dev, cache, sglang_dir)
    (venv / dev.STAMP_NAME).write_text(dev.requirements_sha() + "\n")
    monkeypatch.setenv(core.PATCHED_DIR_ENV, str(sglang_dir / core.DISAGG_SUBDIR))
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(sglang_dir, elsewhere / "sglang")
    script = tmp_path / "script.py"
    script.write_text(
        "import sys\nsys.path.insert(0, %r)\nimport sglang\n" % str(elsewhere)
    )
    runs = dev.side_by_side(script, [], cache=cache, echo=False)
    for run in runs.values():
        assert run.returncode == 97, run.output
        assert "not under" in run.output
