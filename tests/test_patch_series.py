"""The patch series in patches/: every prefix applies at sglang 0.5.23 and its
unit tests pass there; the whole series gives the checkout's files, the same
as the single-diff export; export --series refuses a dirty or drifted tree.

Runs in the cached env (python3 dev.py test): the 0.5.23 files come from the
checkout's root commit, and each prefix's sglang is a copy of the env's, with
the five disaggregation files of that prefix.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from pd_patch_util import REPO

from sglang_pd_patch import core, export, series

PATCHES = series.read_series(REPO)


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    """A copy of the env's sglang package, its five files swapped per prefix."""
    import sglang

    root = tmp_path_factory.mktemp("series-variant")
    shutil.copytree(
        Path(sglang.__file__).parent,
        root / "sglang",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return root


@pytest.mark.parametrize("upto", range(1, len(PATCHES) + 1))
def test_each_prefix_applies_and_its_unit_tests_pass(upto, variant, tmp_path):
    applied = series.build_tree(tmp_path, REPO, upto=upto)
    assert [p.name for p in applied] == [p.name for p in PATCHES[:upto]]
    for rel in core.load_manifest().files:
        shutil.copyfile(
            tmp_path / core.REPO_DISAGG_SUBDIR / rel,
            variant / "sglang" / "srt" / "disaggregation" / rel,
        )
    env = dict(os.environ, PYTHONPATH=str(variant), SGLANG_TEST_MAX_RETRY="0")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        + ["-p", "no:warnings", core.REPO_TEST_SUBDIR],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, f"{PATCHES[upto - 1].name}:\n{proc.stdout[-4000:]}"


def test_the_series_gives_the_checkouts_files_and_the_single_diff(tmp_path):
    assert series.check(REPO) == PATCHES
    # The single-diff export, applied at 0.5.23, gives the same tree.
    single = tmp_path / "single"
    series.write_base(single, REPO)
    diff = tmp_path / "all.diff"
    diff.write_bytes(export.build_export(checkout=REPO))
    series.apply(single, diff)
    assert series.compare(single, REPO) == []


def test_each_patch_says_what_and_why():
    for patch in PATCHES:
        text = patch.read_text(encoding="utf-8")
        head, _, _ = text.partition("\n---\n")
        assert "Subject: [PATCH" in head, patch.name
        body = head.split("\n\n", 1)[1]
        assert len(body.split()) > 40, f"{patch.name}: say what it changes and why"


def clone(tmp_path: Path) -> Path:
    dest = tmp_path / "checkout"
    subprocess.run(
        ["git", "clone", "-q", str(REPO), str(dest)], check=True, capture_output=True
    )
    # The clone lacks what this checkout has not committed yet.
    for sub in (core.REPO_DISAGG_SUBDIR, core.REPO_TEST_SUBDIR, series.SERIES_SUBDIR):
        shutil.rmtree(dest / sub, ignore_errors=True)
        shutil.copytree(REPO / sub, dest / sub)
    for args in (["add", "-A"], ["commit", "-q", "--allow-empty", "-m", "wip"]):
        subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
            cwd=dest,
            check=True,
            capture_output=True,
        )
    return dest


def test_export_series_refuses_a_dirty_tree(tmp_path):
    checkout = clone(tmp_path)
    with open(checkout / core.REPO_DISAGG_SUBDIR / "decode.py", "a") as f:
        f.write("\n")
    with pytest.raises(core.PatchError, match="uncommitted changes"):
        series.export_series(tmp_path / "out", checkout)
    assert not (tmp_path / "out").exists()


def test_export_series_refuses_a_drifted_tree(tmp_path):
    checkout = clone(tmp_path)
    with open(checkout / core.REPO_DISAGG_SUBDIR / "decode.py", "a") as f:
        f.write("\n")
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "x"],
        cwd=checkout,
        check=True,
    )
    with pytest.raises(core.PatchError, match="drifted.*decode.py"):
        series.export_series(tmp_path / "out", checkout)


def test_export_series_writes_the_series(tmp_path):
    checkout = clone(tmp_path)
    written = series.export_series(tmp_path / "out", checkout)
    assert [p.name for p in written] == [p.name for p in PATCHES]
    listed = (tmp_path / "out" / "series").read_text().split()
    assert listed == [p.name for p in PATCHES]
    for patch in PATCHES:
        assert (tmp_path / "out" / patch.name).read_bytes() == patch.read_bytes()
