"""The export is a git-style diff that `git apply` accepts on a pristine tree."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pd_patch_util import REPO, git, write_tree

from sglang_pd_patch import core, export

DISAGG = core.REPO_DISAGG_SUBDIR
TESTS = core.REPO_TEST_SUBDIR


def upstream_tree(tmp_path: Path, files: dict[str, bytes]) -> Path:
    """A git repo laid out like an sglang checkout, holding ``files``."""
    repo = tmp_path / "upstream"
    write_tree(repo, files)
    (repo / "README.md").write_text("sglang\n")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")
    return repo


def apply(repo: Path, diff: bytes, tmp_path: Path) -> None:
    patch = tmp_path / "export.diff"
    patch.write_bytes(diff)
    for args in (["apply", "--check"], ["apply"]):
        proc = subprocess.run(
            ["git", "-C", str(repo), *args, str(patch)], capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr + diff.decode(errors="replace")[:3000]


def edited(pristine: dict[str, bytes]) -> dict[str, bytes]:
    """Patched files with edits in the middle, at both ends, deletions, a lost
    final newline, and one file left unchanged."""
    decode = pristine["decode.py"].split(b"\n")
    decode[10] = b"# changed line 11"
    del decode[100:106]
    decode.insert(500, b"# inserted\n# lines")
    mooncake = pristine["mooncake/conn.py"].split(b"\n")
    mooncake[0] = b"# first line changed"
    return {
        "decode.py": b"\n".join(decode) + b"# appended\n",
        "common/conn.py": pristine["common/conn.py"].rstrip(b"\n"),
        "nixl/conn.py": pristine["nixl/conn.py"],
        "mooncake/conn.py": b"\n".join(mooncake[:-40]) + b"\n",
        "mori/conn.py": b"\n".join(pristine["mori/conn.py"].split(b"\n")[:3]) + b"\nx",
    }


def fake_checkout(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """A checkout-like dir holding only the unit tests (new files in the diff)."""
    checkout = tmp_path / "checkout"
    tests = {
        f"{TESTS}/__init__.py": b"",
        f"{TESTS}/test_decode_unit.py": b"def test_x():\n    assert True\n",
        f"{TESTS}/helpers/no_newline.py": b"VALUE = 1",
        f"{TESTS}/data.txt": b"crlf line\r\nlast\r\n",
    }
    write_tree(checkout, tests)
    junk = {
        f"{TESTS}/__pycache__/x.cpython-311.pyc": b"\0junk",
        f"{TESTS}/.hypothesis/examples/x": b"junk",
    }
    write_tree(checkout, junk)
    return checkout, tests


def git_history(checkout: Path, pristine: dict[str, bytes], later: dict[str, bytes]):
    """Root commit with the pristine files, then a commit with other content."""
    git(checkout, "init", "-q")
    for files in (pristine, later):
        write_tree(checkout, {f"{DISAGG}/{r}": d for r, d in files.items()})
        git(checkout, "add", "-A")
        git(checkout, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")


@pytest.mark.parametrize("pristine_from", ["target", "backup", "git"])
def test_export_applies_on_pristine_tree(
    tmp_path, sglang_dir, pristine, pristine_from, out
):
    patched = edited(pristine)
    patched_dir = write_tree(tmp_path / "patched", patched)
    checkout, tests = fake_checkout(tmp_path)
    source_dir = sglang_dir
    if pristine_from == "backup":
        assert core.install(sglang_dir, patched_dir, out=out) == 0
    elif pristine_from == "git":
        source_dir = None
        git_history(checkout, pristine, patched)
    diff = export.build_export(source_dir, patched_dir, checkout=checkout)

    text = diff.decode()
    assert f"diff --git a/{DISAGG}/nixl/conn.py" not in text  # unchanged: skipped
    assert text.count("\\ No newline at end of file") == 3
    assert f"--- /dev/null\n+++ b/{TESTS}/test_decode_unit.py\n" in text
    assert "__pycache__" not in text and ".hypothesis" not in text

    repo = upstream_tree(tmp_path, {f"{DISAGG}/{r}": d for r, d in pristine.items()})
    apply(repo, diff, tmp_path)
    for rel, data in patched.items():
        assert (repo / DISAGG / rel).read_bytes() == data, rel
    for path, data in tests.items():
        assert (repo / path).read_bytes() == data, path
    # The result is what `git diff` of the applied tree says it is.
    git(repo, "add", "-A")
    names = git(repo, "diff", "--cached", "--name-status").decode().split("\n")
    assert f"A\t{TESTS}/__init__.py" in names
    assert f"M\t{DISAGG}/decode.py" in names


def test_export_rejects_wrong_pristine(tmp_path, sglang_dir, pristine):
    core.target_path(sglang_dir, "decode.py").write_bytes(b"not pristine\n")
    patched_dir = write_tree(tmp_path / "patched", pristine)
    with pytest.raises(core.PatchError, match="pristine sglang bytes of decode.py"):
        export.build_export(sglang_dir, patched_dir, checkout=None)


def test_export_cli_real_checkout(tmp_path, pristine):
    """`python -m sglang_pd_patch export` of this very checkout applies on v0.5.23
    files and reproduces the checkout's patched files and unit tests."""
    proc = subprocess.run(
        [sys.executable, "-S", "-m", "sglang_pd_patch", "export"],
        cwd=REPO,
        capture_output=True,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr.decode()
    repo = upstream_tree(tmp_path, {f"{DISAGG}/{r}": d for r, d in pristine.items()})
    if proc.stdout:
        apply(repo, proc.stdout, tmp_path)
    for rel in pristine:
        assert (repo / DISAGG / rel).read_bytes() == (REPO / DISAGG / rel).read_bytes()
    for path, file in export.collect_test_files(REPO):
        assert (repo / path).read_bytes() == file.read_bytes()


def _random_text(rng: random.Random, n: int) -> list[bytes]:
    words = [b"", b"x = 1", b"    pass", b"def f():", b"# c", b"return y", b"\r"]
    return [rng.choice(words) + b"%d" % rng.randrange(4) for _ in range(n)]


def test_random_edits_round_trip(tmp_path):
    """Many random edits (including missing final newlines, empty files, CRLF)
    in one diff: `git apply` reproduces every new file exactly."""
    rng = random.Random(1234)
    old_files, new_files, parts = {}, {}, []
    for i in range(60):
        lines = _random_text(rng, rng.randrange(0, 40))
        new = list(lines)
        for _ in range(rng.randrange(1, 6)):
            pos = rng.randrange(len(new) + 1)
            op = rng.choice(["ins", "del", "mod"])
            if op == "ins" or not new:
                new[pos:pos] = _random_text(rng, rng.randrange(1, 4))
            elif op == "del":
                del new[pos : pos + rng.randrange(1, 4)]
            else:
                new[min(pos, len(new) - 1)] = b"changed%d" % i
        old = b"\n".join(lines) + rng.choice([b"\n", b""]) if lines else b""
        new_b = b"\n".join(new) + rng.choice([b"\n", b""]) if new else b""
        path = f"d/f{i}.py"
        old_files[path], new_files[path] = old, new_b
        parts.append(export.file_diff(path, old, new_b))
    for i, data in enumerate([b"", b"one", b"one\n", b"a\nb"]):
        new_files[f"n/new{i}.py"] = data
        parts.append(export.new_file_diff(f"n/new{i}.py", data))
    repo = upstream_tree(tmp_path, old_files)
    apply(repo, b"".join(parts), tmp_path)
    for path, data in new_files.items():
        assert (repo / path).read_bytes() == data, path


def git_diff_no_index(tmp_path: Path, path: str, old: bytes | None, new: bytes) -> str:
    """What `git diff` prints for the same change (minus the index line)."""
    work = tmp_path / "gitdiff"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    git(work, "init", "-q")
    if old is not None:
        write_tree(work, {path: old})
        git(work, "add", "-A")
        git(work, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    write_tree(work, {path: new})
    git(work, "add", "-A")
    text = git(work, "diff", "--cached", "--no-color", "--full-index").decode()
    return text


@pytest.mark.parametrize(
    "old,new",
    [
        # (digits: git prints no function-name context after the @@ for them)
        (b"1\n2\n3\n4\n5\n6\n7\n8\n", b"1\n2\n3\n4\n55\n6\n7\n8\n"),
        (b"1\n2\n3\n4\n5\n6\n7\n8\n", b"1\n2\n3\n4\n5\n6\n7\n8"),
        (b"1\n2\n3\n4\n5\n6\n7\n8", b"1\n2\n3\n4\n5\n6\n7\n8\n9\n"),
        (b"1\n2\n3\n4\n5\n6\n7\n8\n9\n", b"1\n2\n3\n4\nx\ny\n5\n6\n7\n8\n9\n"),
        (b"1\n2\n3\n4\n5\n6\n7\n8\n9\n", b"2\n3\n4\n5\n6\n7\n8\n9\n"),
        (b"", b"first\n"),
        (None, b"one\ntwo\n"),
        (None, b"no newline"),
        (None, b""),
    ],
)
def test_same_text_as_git_diff(tmp_path, old, new):
    """On changes with only one minimal diff, the output is byte-for-byte what
    `git diff --full-index` prints."""
    path = "python/pkg/mod.py"
    if old is None:
        ours = export.new_file_diff(path, new)
    else:
        ours = export.file_diff(path, old, new)
    assert ours.decode() == git_diff_no_index(tmp_path, path, old, new)
