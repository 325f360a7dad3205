"""sglang_pd_patch/cpu_enable.patch: the demo's "stock" variant.

Stock for the demo is pristine sglang 0.5.23 plus ONLY the CPU-enablement hunks.
This checks that the patch (a) applies cleanly to the pristine files of the
repo's root commit and (b) adds nothing that the full patched files lack, so the
two cannot drift apart. Needs git and the repo's history (the root commit).
"""

from __future__ import annotations

import difflib
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PATCH = REPO / "sglang_pd_patch" / "cpu_enable.patch"
DISAGG = "python/sglang/srt/disaggregation/"
HUNK = re.compile(r"^@@ -\d+(?:,\d+)? \+\d+(?:,\d+)? @@")


def git(*args: str, cwd: Path = REPO, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, check=False, **kw
    )


def root_commit() -> str:
    out = git("rev-list", "--max-parents=0", "HEAD")
    assert out.returncode == 0, out.stderr
    return out.stdout.split()[-1]


def patched_paths() -> list[str]:
    paths = []
    for line in PATCH.read_text().splitlines():
        if line.startswith("+++ b/"):
            paths.append(line[len("+++ b/") :])
    return paths


def hunks(text: str) -> dict[str, list[list[str]]]:
    """path -> hunks, each the list of lines after its @@ header."""
    out: dict[str, list[list[str]]] = {}
    path = None
    for line in text.splitlines():
        if line.startswith("+++ b/"):
            path = line[len("+++ b/") :]
            out[path] = []
        elif path and HUNK.match(line):
            out[path].append([])
        elif path and out[path] and line[:1] in (" ", "+", "-", "\\"):
            out[path][-1].append(line)
    return out


@pytest.fixture
def pristine_tree(tmp_path) -> Path:
    """A git work tree holding the pristine files the patch touches."""
    root = root_commit()
    tree = tmp_path / "pristine"
    tree.mkdir()
    assert git("init", "-q", ".", cwd=tree).returncode == 0
    for rel in patched_paths():
        show = git("show", f"{root}:{rel}")
        assert show.returncode == 0, f"{rel} is not in the root commit"
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(show.stdout)
    return tree


def test_patch_touches_only_the_patched_files():
    paths = patched_paths()
    assert paths, "the patch is empty"
    for rel in paths:
        assert rel.startswith(DISAGG), rel
        assert (REPO / rel).is_file(), rel


def test_applies_cleanly_with_git_apply(pristine_tree):
    check = git("apply", "--check", str(PATCH), cwd=pristine_tree)
    assert check.returncode == 0, check.stderr
    assert git("apply", str(PATCH), cwd=pristine_tree).returncode == 0
    again = git("apply", "--check", str(PATCH), cwd=pristine_tree)
    assert again.returncode != 0, "the patch applies twice: it changes nothing"


@pytest.mark.skipif(shutil.which("patch") is None, reason="no patch(1)")
def test_applies_cleanly_with_patch_p1(pristine_tree):
    out = subprocess.run(
        ["patch", "-p1", "--dry-run", "--fuzz=0", "-i", str(PATCH)],
        cwd=pristine_tree,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_hunk_is_in_the_full_patched_files():
    """Each run of lines a hunk adds appears, contiguously, in the repo's
    patched file."""
    for rel, file_hunks in hunks(PATCH.read_text()).items():
        full = (REPO / rel).read_text().splitlines()
        for hunk in file_hunks:
            runs: list[list[str]] = [[]]
            for ln in hunk:
                if ln[:1] == "+":
                    runs[-1].append(ln[1:])
                elif runs[-1]:
                    runs.append([])
            runs = [r for r in runs if r]
            assert runs, f"{rel}: a hunk that adds nothing"
            for run in runs:
                assert _contains(full, run), (
                    f"{rel}: lines of cpu_enable.patch missing from the full "
                    "patched file:\n" + "\n".join(run)
                )


def test_adds_nothing_the_full_patch_does_not_add(pristine_tree):
    """Relative to the same pristine file, the lines the CPU patch adds are a
    subset of the lines the full patch adds."""
    assert git("apply", str(PATCH), cwd=pristine_tree).returncode == 0
    root = root_commit()
    for rel in patched_paths():
        base = git("show", f"{root}:{rel}").stdout.splitlines()
        cpu = (pristine_tree / rel).read_text().splitlines()
        full = (REPO / rel).read_text().splitlines()
        full_added = set(_added(base, full))
        missing = [ln for ln in _added(base, cpu) if ln not in full_added]
        assert not missing, f"{rel}: lines only in cpu_enable.patch: {missing}"


def _contains(lines: list[str], run: list[str]) -> bool:
    n = len(run)
    return any(lines[i : i + n] == run for i in range(len(lines) - n + 1))


def _added(a: list[str], b: list[str]) -> list[str]:
    return [
        ln[1:]
        for ln in difflib.unified_diff(a, b, lineterm="", n=0)
        if ln.startswith("+") and not ln.startswith("+++")
    ]
