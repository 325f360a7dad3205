"""Helpers for the tests of the sglang-pd-patch tool (stdlib only)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from sglang_pd_patch import core  # noqa: E402

VERSION_PY = "__version__ = version = '{}'\n__version_tuple__ = version_tuple = ()\n"


def git(cwd: Path, *args: str) -> bytes:
    return subprocess.run(
        ["git", "-C", str(cwd), *args], check=True, capture_output=True
    ).stdout


def write_tree(base: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        path = base / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return base


def make_patched(tmp_path: Path, pristine: dict[str, bytes], tag: str) -> Path:
    return write_tree(
        tmp_path / f"patched-{tag}",
        {
            rel: data + f"# sglang-pd-patch test build {tag}\n".encode()
            for rel, data in pristine.items()
        },
    )


def read_files(sglang_dir: Path, rels) -> dict[str, bytes]:
    return {rel: core.target_path(sglang_dir, rel).read_bytes() for rel in rels}


def snapshot(root: Path) -> dict[str, tuple]:
    """Every file and dir under root with (inode, mtime_ns, mode, content)."""
    snap = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            data = path.read_bytes() if path.is_file() else None
            snap[str(path.relative_to(root))] = (
                st.st_ino,
                st.st_mtime_ns,
                st.st_mode,
                data,
            )
    return snap


class Out:
    """Collects the lines a command prints."""

    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        self.lines.append(line)

    @property
    def text(self) -> str:
        return "\n".join(self.lines)
