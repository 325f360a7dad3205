"""The patch as an ordered series, one concern per patch, for forks.

The series lives in the checkout's ``patches/``: ``patches/series`` lists the
``git format-patch`` files in order. Applied with ``git apply`` (or ``git am``)
at sglang v0.5.23, in order, the patches give byte for byte the checkout's
``python/sglang/srt/disaggregation/`` files and its unit tests under
``test/registered/unit/disaggregation/``; ``check()`` proves it and
``tests/test_patch_series.py`` runs, at every prefix, the unit tests that its
last patch touches (``touched()``). Editing the patch means editing the series
too: ``python3 dev.py series edit DIR`` makes a git repository with one commit
per patch, ``python3 dev.py series save DIR`` writes it back (patches and
files).
"""

from __future__ import annotations

import filecmp
import shutil
import subprocess
import tempfile
from pathlib import Path

from . import core, export

SERIES_SUBDIR = "patches"


def series_dir(checkout: Path) -> Path:
    return checkout / SERIES_SUBDIR


def read_series(checkout: Path) -> list[Path]:
    """The patch files, in order."""
    directory = series_dir(checkout)
    try:
        names = (directory / "series").read_text(encoding="utf-8").split()
    except OSError as err:
        raise core.PatchError(f"no patch series in {directory}: {err}") from err
    paths = [directory / name for name in names]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing or not paths:
        raise core.PatchError(
            f"{directory / 'series'} lists missing patches: {missing or 'none'}"
        )
    return paths


def touched(patch: Path) -> list[str]:
    """The repository paths ``patch`` adds, changes or deletes, in its order:
    the new side of its ``diff --git a/OLD b/NEW`` lines."""
    prefix = "diff --git a/"
    # The message ends at the first "---" line (as for git am); a line of it
    # that quotes a diff header is not a file of the patch.
    message, sep, diff = patch.read_text(encoding="utf-8").partition("\n---\n")
    diff = diff if sep else message
    return [
        line[len(prefix) :].rpartition(" b/")[2]
        for line in diff.splitlines()
        if line.startswith(prefix)
    ]


def _git(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            ["git", *args], cwd=cwd, capture_output=True, text=True, check=False
        )
    except OSError as err:
        raise core.PatchError(f"git is needed for the patch series: {err}") from err


def write_base(dest: Path, checkout: Path, sglang_dir: Path | None = None) -> None:
    """The five disaggregation files of sglang 0.5.23 (checked by sha256) at
    their sglang repository paths under ``dest``, and an empty test dir."""
    manifest = core.load_manifest()
    for rel, sha in manifest.files.items():
        data, _ = export.pristine_bytes(rel, sha, sglang_dir, checkout)
        path = dest / core.REPO_DISAGG_SUBDIR / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (dest / core.REPO_TEST_SUBDIR).mkdir(parents=True, exist_ok=True)


def apply(dest: Path, patch: Path) -> None:
    proc = _git(dest, "apply", "--whitespace=nowarn", str(patch))
    if proc.returncode != 0:
        raise core.PatchError(
            f"{patch.name} does not apply on the series before it: "
            f"{proc.stderr.strip()}"
        )


def build_tree(
    dest: Path,
    checkout: Path,
    upto: int | None = None,
    sglang_dir: Path | None = None,
) -> list[Path]:
    """sglang 0.5.23 plus the first ``upto`` patches (all by default) in
    ``dest``; returns the patches applied."""
    patches = read_series(checkout)[:upto]
    write_base(dest, checkout, sglang_dir)
    for patch in patches:
        apply(dest, patch)
    return patches


def _files(root: Path) -> dict[str, Path]:
    out = {}
    for sub in (core.REPO_DISAGG_SUBDIR, core.REPO_TEST_SUBDIR):
        base = root / sub
        if not base.is_dir():
            continue
        for path in base.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                out[path.relative_to(root).as_posix()] = path
    return out


def compare(built: Path, checkout: Path) -> list[str]:
    """Paths that differ between a built tree and the checkout (patched files
    and unit tests)."""
    ours = {
        rel: path
        for rel, path in _files(checkout).items()
        if not rel.startswith(core.REPO_DISAGG_SUBDIR)
        or rel[len(core.REPO_DISAGG_SUBDIR) + 1 :] in core.load_manifest().files
    }
    theirs = _files(built)
    differ = sorted(set(ours) ^ set(theirs))
    differ += sorted(
        rel
        for rel in set(ours) & set(theirs)
        if not filecmp.cmp(ours[rel], theirs[rel], shallow=False)
    )
    return differ


def check(checkout: Path, sglang_dir: Path | None = None) -> list[Path]:
    """Raise PatchError unless the whole series applies at sglang 0.5.23 and
    gives the checkout's files; returns the patches."""
    with tempfile.TemporaryDirectory(prefix="pd-series-") as tmp:
        patches = build_tree(Path(tmp), checkout, sglang_dir=sglang_dir)
        differ = compare(Path(tmp), checkout)
    if differ:
        raise core.PatchError(
            f"the patch series in {series_dir(checkout)} has drifted from the "
            f"checkout; these files differ: {', '.join(differ)}. Update the series "
            f"(python3 dev.py series edit DIR, amend, python3 dev.py series save "
            f"DIR) or the files."
        )
    return patches


def dirty(checkout: Path) -> list[str]:
    """Uncommitted changes to the patch, its tests or the series."""
    proc = _git(
        checkout,
        "status",
        "--porcelain",
        "--",
        core.REPO_DISAGG_SUBDIR,
        core.REPO_TEST_SUBDIR,
        SERIES_SUBDIR,
    )
    if proc.returncode != 0:
        raise core.PatchError(
            f"cannot tell whether {checkout} has uncommitted changes: "
            f"{proc.stderr.strip()}"
        )
    return [line[3:] for line in proc.stdout.splitlines()]


def export_series(out: Path, checkout: Path, sglang_dir: Path | None = None) -> list[Path]:
    """Write ``out/series`` and the patches, after checking that the
    checkout is clean and that the series gives its files."""
    changed = dirty(checkout)
    if changed:
        raise core.PatchError(
            f"uncommitted changes in {checkout}: {', '.join(changed)}; commit them "
            f"(and keep {SERIES_SUBDIR}/ in step) before exporting the series"
        )
    patches = check(checkout, sglang_dir)
    out.mkdir(parents=True, exist_ok=True)
    for patch in patches:
        shutil.copyfile(patch, out / patch.name)
    (out / "series").write_text("".join(f"{p.name}\n" for p in patches))
    return patches
