"""Export the patch as one ``git diff``-style unified diff, built with difflib.

Paths are relative to the root of an sglang source checkout, so forks can apply it
with ``git apply`` at tag v0.5.23:

* ``python/sglang/srt/disaggregation/<rel>``: pristine -> patched (files that equal
  the pristine bytes are skipped);
* every file under the checkout's ``test/registered/unit/disaggregation/``: new
  files.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import subprocess
from pathlib import Path

from . import core

ZERO_OID = "0" * 40
NO_NEWLINE = b"\\ No newline at end of file\n"
SKIP_DIRS = {"__pycache__"}
SKIP_SUFFIXES = (".pyc", ".pyo")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def split_lines(data: bytes) -> list[bytes]:
    """Lines with their b"\\n"; the last one lacks it when the data does."""
    parts = data.split(b"\n")
    lines = [part + b"\n" for part in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


def _range(start: int, stop: int) -> str:
    begin, length = start + 1, stop - start
    if length == 1:
        return f"{begin}"
    if length == 0:
        begin -= 1
    return f"{begin},{length}"


def _emit(prefix: bytes, line: bytes) -> bytes:
    if line.endswith(b"\n"):
        return prefix + line
    return prefix + line + b"\n" + NO_NEWLINE


def hunks(old: bytes, new: bytes, context: int = 3) -> bytes:
    a, b = split_lines(old), split_lines(new)
    if a == b:
        return b""
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    out = []
    for group in matcher.get_grouped_opcodes(context):
        i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
        out.append(f"@@ -{_range(i1, i2)} +{_range(j1, j2)} @@\n".encode())
        for tag, ai1, ai2, bj1, bj2 in group:
            if tag == "equal":
                out.extend(_emit(b" ", line) for line in a[ai1:ai2])
                continue
            if tag in ("replace", "delete"):
                out.extend(_emit(b"-", line) for line in a[ai1:ai2])
            if tag in ("replace", "insert"):
                out.extend(_emit(b"+", line) for line in b[bj1:bj2])
    return b"".join(out)


def _check_path(path: str) -> None:
    if not path.isascii() or any(c in path for c in ' \t\n"\\'):
        raise core.PatchError(f"unsupported file name in the export: {path!r}")


def _check_text(path: str, data: bytes) -> None:
    if b"\0" in data:
        raise core.PatchError(f"binary file not supported in the export: {path}")


def file_diff(path: str, old: bytes, new: bytes, mode: str = "100644") -> bytes:
    """Diff of a modified file (empty when the contents are equal)."""
    _check_path(path)
    _check_text(path, old)
    _check_text(path, new)
    body = hunks(old, new)
    if not body:
        return b""
    head = (
        f"diff --git a/{path} b/{path}\n"
        f"index {git_blob_id(old)}..{git_blob_id(new)} {mode}\n"
        f"--- a/{path}\n"
        f"+++ b/{path}\n"
    )
    return head.encode() + body


def new_file_diff(path: str, data: bytes, mode: str = "100644") -> bytes:
    _check_path(path)
    _check_text(path, data)
    head = (
        f"diff --git a/{path} b/{path}\n"
        f"new file mode {mode}\n"
        f"index {ZERO_OID}..{git_blob_id(data)}\n"
    )
    if not data:
        return head.encode()
    return (head + f"--- /dev/null\n+++ b/{path}\n").encode() + hunks(b"", data)


def _git(checkout: Path, *args: str) -> bytes | None:
    try:
        proc = subprocess.run(
            ["git", "-C", str(checkout), *args],
            capture_output=True,
            check=False,
        )
    except OSError:
        return None
    return proc.stdout if proc.returncode == 0 else None


def pristine_bytes(
    rel: str, sha: str, sglang_dir: Path | None, checkout: Path | None
) -> tuple[bytes, str]:
    """(pristine bytes of ``rel``, where they came from), verified against ``sha``.

    Tried in order: the backup in the target sglang, the target's own file, the
    root commit of the checkout (``git show``).
    """
    tried = []
    if sglang_dir is not None:
        for path in (
            core.backup_path(sglang_dir, rel),
            core.target_path(sglang_dir, rel),
        ):
            try:
                data = path.read_bytes()
            except OSError:
                tried.append(f"{path}: missing")
                continue
            if core.sha256_bytes(data) == sha:
                return data, str(path)
            tried.append(f"{path}: sha256 differs")
    if checkout is not None:
        roots = _git(checkout, "rev-list", "--max-parents=0", "HEAD")
        for root in (roots or b"").decode().split():
            spec = f"{root}:{core.REPO_DISAGG_SUBDIR}/{rel}"
            data = _git(checkout, "show", spec)
            if data is not None and core.sha256_bytes(data) == sha:
                return data, f"git show {spec}"
            tried.append(f"git show {spec}: " + ("sha256 differs" if data else "n/a"))
        if roots is None:
            tried.append(f"git in {checkout}: not available")
    raise core.PatchError(
        f"cannot find the pristine sglang bytes of {rel} (sha256 {sha}); tried: "
        + "; ".join(tried or ["nothing (no --sglang-dir and no checkout)"])
    )


def collect_test_files(checkout: Path | None) -> list[tuple[str, Path]]:
    """(repo path, file) of every file under the checkout's test directory."""
    if checkout is None:
        return []
    base = checkout / core.REPO_TEST_SUBDIR
    found = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(
            d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".")
        )
        for name in sorted(filenames):
            if name.endswith(SKIP_SUFFIXES) or name.startswith("."):
                continue
            path = Path(dirpath) / name
            found.append((path.relative_to(checkout).as_posix(), path))
    return sorted(found)


def build_export(
    sglang_dir: Path | None = None,
    patched_dir: str | os.PathLike | None = None,
    checkout: Path | None | bool = True,
) -> bytes:
    """The whole patch as bytes. ``checkout=True`` means the one we run from."""
    manifest = core.load_manifest()
    source = core.load_patch_source(manifest, patched_dir)
    if checkout is True:
        checkout = core.find_checkout()
    parts = []
    for rel in sorted(manifest.rels, key=lambda r: f"{core.REPO_DISAGG_SUBDIR}/{r}"):
        old, _ = pristine_bytes(rel, manifest.files[rel], sglang_dir, checkout or None)
        path = f"{core.REPO_DISAGG_SUBDIR}/{rel}"
        parts.append(file_diff(path, old, source.files[rel]))
    for path, file in collect_test_files(checkout or None):
        mode = "100755" if os.access(file, os.X_OK) else "100644"
        parts.append(new_file_diff(path, file.read_bytes(), mode))
    return b"".join(parts)
