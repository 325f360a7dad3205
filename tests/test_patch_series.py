"""The patch series in patches/: every prefix applies at sglang 0.5.23 and the
unit tests its last patch touches pass there (a prefix whose last patch touches
none imports the five patched modules); the whole series gives the checkout's
files, the same as the single-diff export; export --series refuses a dirty or
drifted tree.

Runs in the cached env (python3 dev.py test): the 0.5.23 files come from the
checkout's root commit, and each prefix's sglang is a copy of the env's, with
the five disaggregation files of that prefix. The whole unit-test directory runs
once, on the checkout's files, in the same pytest run (dev.py test collects
it), so a later patch that breaks an earlier one's tests fails there.
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
DISAGG = Path("sglang", "srt", "disaggregation")
MODULES = [
    ".".join(DISAGG.parts + Path(rel).with_suffix("").parts)
    for rel in core.load_manifest().files
]
# mori is AMD only: stubbed, as the unit tests do, unless it is installed; any
# name mori/conn.py imports from it is a class.
IMPORT_CHECK = """
import importlib, importlib.util, sys, types

def stub_name(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (), {})

if importlib.util.find_spec("mori") is None:
    for name in ("mori", "mori.cpp", "mori.io"):
        sys.modules[name] = types.ModuleType(name)
        sys.modules[name].__getattr__ = stub_name
    sys.modules["mori"].cpp = sys.modules["mori.cpp"]
    sys.modules["mori"].io = sys.modules["mori.io"]
for module in sys.argv[1:]:
    importlib.import_module(module)
"""


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    """A copy of the env's sglang package, its five files swapped per prefix."""
    import sglang

    root = tmp_path_factory.mktemp("series-variant")
    # With the env's .pyc files (copy2 keeps the mtimes they are checked
    # against): a prefix's process need not compile sglang again, the more so
    # under PYTHONDONTWRITEBYTECODE.
    shutil.copytree(Path(sglang.__file__).parent, root / "sglang")
    return root


def own_tests(patch: Path, tree: Path) -> list[str]:
    """The unit test files ``patch`` adds or changes (not those it deletes)."""
    return [
        rel
        for rel in series.touched(patch)
        if rel.startswith(core.REPO_TEST_SUBDIR + "/")
        and Path(rel).name.startswith("test_")
        and rel.endswith(".py")
        and (tree / rel).is_file()
    ]


@pytest.mark.parametrize(
    "upto", range(1, len(PATCHES) + 1), ids=[p.stem for p in PATCHES]
)
def test_each_prefix_applies_and_its_unit_tests_pass(upto, variant, tmp_path):
    applied = series.build_tree(tmp_path, REPO, upto=upto)
    assert [p.name for p in applied] == [p.name for p in PATCHES[:upto]]
    for rel in core.load_manifest().files:
        target = variant / DISAGG / rel
        shutil.copyfile(tmp_path / core.REPO_DISAGG_SUBDIR / rel, target)
        # A .pyc of the previous prefix's file would pass for this one's if
        # both have the same size and mtime second.
        for pyc in (target.parent / "__pycache__").glob(f"{target.stem}.*.pyc"):
            pyc.unlink()
    env = dict(os.environ, PYTHONPATH=str(variant), SGLANG_TEST_MAX_RETRY="0")
    tests = own_tests(PATCHES[upto - 1], tmp_path)
    if tests:
        # Just this patch's own tests (and the helpers they import): the whole
        # directory runs on the checkout's files in the main pytest run.
        cmd = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:warnings"]
        cmd += tests
    else:
        cmd = ["-c", IMPORT_CHECK, *MODULES]
    proc = subprocess.run(
        [sys.executable, *cmd],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    ran = " ".join(tests) or "import " + " ".join(MODULES)
    out = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, f"{PATCHES[upto - 1].name}: {ran}\n{out}"


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
