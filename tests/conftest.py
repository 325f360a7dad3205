"""Fixtures for the tests of the sglang-pd-patch tool (stdlib + pytest only).

The tests act on a temporary sglang package directory: ``sglang/`` with
``_version.py`` and the five pristine files (taken from the repo's root commit,
verified against the manifest), and take the "patched" files from a temporary
directory, since the repo's own patched files may still equal the pristine ones.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pd_patch_util import REPO, VERSION_PY, Out, core, git, make_patched, write_tree


@pytest.fixture(scope="session")
def manifest() -> core.Manifest:
    return core.load_manifest()


@pytest.fixture(scope="session")
def pristine(manifest) -> dict[str, bytes]:
    """rel -> pristine bytes, from the repo's root commit, sha-verified."""
    root = git(REPO, "rev-list", "--max-parents=0", "HEAD").decode().split()[0]
    files = {}
    for rel, sha in manifest.files.items():
        data = git(REPO, "show", f"{root}:{core.REPO_DISAGG_SUBDIR}/{rel}")
        assert core.sha256_bytes(data) == sha, rel
        files[rel] = data
    return files


@pytest.fixture
def sglang_dir(tmp_path, pristine) -> Path:
    """A fake sglang 0.5.23 package dir: tmp/site/sglang."""
    root = tmp_path / "site" / "sglang"
    disagg = root / core.DISAGG_SUBDIR
    write_tree(disagg, pristine)
    for init in ("", "srt", "srt/disaggregation"):
        (root / init / "__init__.py").touch()
    for sub in ("common", "nixl", "mooncake", "mori"):
        (disagg / sub / "__init__.py").touch()
    (root / "_version.py").write_text(VERSION_PY.format("0.5.23"))
    os.chmod(disagg / "decode.py", 0o664)
    (disagg / "__pycache__").mkdir()
    (disagg / "__pycache__" / "decode.cpython-311.pyc").write_bytes(b"stale")
    (disagg / "__pycache__" / "decode_hicache_mixin.cpython-311.pyc").write_bytes(b"x")
    return root


@pytest.fixture
def patched_dir(tmp_path, pristine) -> Path:
    return make_patched(tmp_path, pristine, "A")


@pytest.fixture
def other_patched_dir(tmp_path, pristine) -> Path:
    return make_patched(tmp_path, pristine, "B")


@pytest.fixture
def out() -> Out:
    return Out()
