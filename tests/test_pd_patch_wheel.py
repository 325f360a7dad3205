"""The wheel ships the patched files and the installed tool finds them."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
from pd_patch_util import REPO

from sglang_pd_patch import core


def _can_build_offline() -> bool:
    if importlib.util.find_spec("pip") is None:
        return False
    try:
        setuptools = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return False
    major, minor = (int(x) for x in setuptools.split(".")[:2])
    # bdist_wheel is part of setuptools since 70.1; before, it needs `wheel`.
    return (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None


pytestmark = pytest.mark.skipif(
    not _can_build_offline(),
    reason="needs pip and setuptools>=70.1 (or wheel) to build the wheel offline",
)

FIND = """
import json, sys
from sglang_pd_patch import core
d = core.find_patched_dir()
print(json.dumps({"dir": str(d), "checkout": str(core.find_checkout()),
                  "manifest": core.load_manifest().sglang_version}))
"""


def test_wheel_ships_patched_files(tmp_path, manifest):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("sglang_pd_patch", "python"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    dist = tmp_path / "dist"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", dist, src],
        check=True,
        cwd=tmp_path,
    )
    (wheel,) = dist.glob("sglang_pd_patch-0.1.0-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(n for n in names if n.endswith("entry_points.txt"))
        assert (
            "sglang-pd-patch = sglang_pd_patch.cli:main"
            in zf.read(entry_points).decode()
        )
        metadata = zf.read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "Requires-Dist: sglang==0.5.23" in metadata
    assert "sglang_pd_patch/manifest.json" in names
    for rel in manifest.rels:
        assert f"sglang_pd_patch/_patched/{rel}" in names

    target = tmp_path / "installed"
    subprocess.run(
        pip + ["install", "--no-deps", "--target", target, wheel], check=True
    )
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(target)}
    proc = subprocess.run(
        [sys.executable, "-c", FIND],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    patched = target / "sglang_pd_patch" / "_patched"
    assert found == {"dir": str(patched), "checkout": "None", "manifest": "0.5.23"}
    for rel in manifest.rels:
        repo_file = REPO / core.REPO_DISAGG_SUBDIR / rel
        assert (patched / rel).read_bytes() == repo_file.read_bytes(), rel
