"""install / uninstall / status on a temporary sglang package directory."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import stat
import subprocess
import sys

import pytest
from pd_patch_util import REPO, VERSION_PY, make_patched, read_files, snapshot

from sglang_pd_patch import core

RC_OK, RC_PARTIAL, RC_REFUSED = 0, 1, 2


def status_of(sglang_dir, patched_dir, out):
    out.lines.clear()
    rc = core.status(sglang_dir, patched_dir, out=out)
    verdict = [line for line in out.lines if line.startswith("verdict: ")]
    assert len(verdict) == 1, out.text
    return rc, verdict[0]


def assert_each_stock_or_patched(sglang_dir, pristine, patched):
    for rel, data in read_files(sglang_dir, pristine).items():
        assert data in (pristine[rel], patched[rel]), rel


@pytest.fixture
def patched(patched_dir, pristine):
    return {rel: (patched_dir / rel).read_bytes() for rel in pristine}


def test_clean_install(sglang_dir, patched_dir, pristine, patched, out):
    disagg = sglang_dir / core.DISAGG_SUBDIR
    assert core.install(sglang_dir, patched_dir, out=out) == RC_OK, out.text
    assert read_files(sglang_dir, pristine) == patched
    for rel, data in pristine.items():
        assert core.backup_path(sglang_dir, rel).read_bytes() == data
    # file mode kept, stale bytecode of the replaced module removed, others kept
    assert stat.S_IMODE((disagg / "decode.py").stat().st_mode) == 0o664
    assert not (disagg / "__pycache__" / "decode.cpython-311.pyc").exists()
    assert (disagg / "__pycache__" / "decode_hicache_mixin.cpython-311.pyc").exists()
    # no temp files left behind
    assert not list(sglang_dir.rglob(f"*{core.TMP_SUFFIX}"))
    state = json.loads((core.state_dir(sglang_dir) / "state.json").read_text())
    build = core.build_id({rel: core.sha256_bytes(d) for rel, d in patched.items()})
    assert state["installed"] == build
    assert state["builds"][build]["files"]["decode.py"] == core.sha256_bytes(
        patched["decode.py"]
    )
    rc, verdict = status_of(sglang_dir, patched_dir, out)
    assert (rc, verdict) == (RC_OK, "verdict: installed")
    assert sum(line.endswith(f"  {core.PATCHED}") for line in out.lines) == 5


def test_status_on_stock(sglang_dir, patched_dir, out):
    rc, verdict = status_of(sglang_dir, patched_dir, out)
    assert (rc, verdict) == (RC_OK, "verdict: not installed")
    assert "version: 0.5.23 (ok" in out.text


def test_second_install_is_a_no_op(sglang_dir, patched_dir, out):
    assert core.install(sglang_dir, patched_dir, out=out) == RC_OK
    before = snapshot(sglang_dir)
    out.lines.clear()
    assert core.install(sglang_dir, patched_dir, out=out) == RC_OK
    assert "already installed" in out.text
    assert snapshot(sglang_dir) == before


def test_uninstall_restores_exact_bytes(sglang_dir, patched_dir, pristine, out):
    before = {
        p: s[2:] for p, s in snapshot(sglang_dir).items() if "__pycache__" not in p
    }
    assert core.install(sglang_dir, patched_dir, out=out) == RC_OK
    assert core.uninstall(sglang_dir, patched_dir, out=out) == RC_OK, out.text
    assert read_files(sglang_dir, pristine) == pristine
    assert not core.state_dir(sglang_dir).exists()
    after = {
        p: s[2:] for p, s in snapshot(sglang_dir).items() if "__pycache__" not in p
    }
    assert after == before  # same bytes and modes, nothing else left
    assert status_of(sglang_dir, patched_dir, out) == (RC_OK, "verdict: not installed")
    # idempotent
    out.lines.clear()
    snap = snapshot(sglang_dir)
    assert core.uninstall(sglang_dir, patched_dir, out=out) == RC_OK
    assert "nothing to do" in out.text
    assert snapshot(sglang_dir) == snap


@pytest.mark.parametrize("command", ["install", "uninstall", "status"])
def test_wrong_version_refused(sglang_dir, patched_dir, out, command):
    if command == "uninstall":
        assert core.install(sglang_dir, patched_dir, out=out) == RC_OK
    (sglang_dir / "_version.py").write_text(VERSION_PY.format("0.5.22"))
    before = snapshot(sglang_dir)
    out.lines.clear()
    rc = getattr(core, command)(sglang_dir, patched_dir, out=out)
    assert rc == RC_REFUSED
    assert snapshot(sglang_dir) == before
    assert "0.5.22" in out.text
    assert "pip install --force-reinstall --no-deps sglang==0.5.23" in out.text


@pytest.mark.parametrize("installed_first", [False, True])
@pytest.mark.parametrize("command", ["install", "uninstall"])
def test_foreign_modified_file_refused(
    sglang_dir, patched_dir, pristine, out, command, installed_first
):
    if installed_first:
        assert core.install(sglang_dir, patched_dir, out=out) == RC_OK
    target = core.target_path(sglang_dir, "nixl/conn.py")
    target.write_bytes(target.read_bytes().replace(b"import", b"import  ", 1))
    found = core.sha256_bytes(target.read_bytes())
    before = snapshot(sglang_dir)
    out.lines.clear()
    assert getattr(core, command)(sglang_dir, patched_dir, out=out) == RC_REFUSED
    assert snapshot(sglang_dir) == before
    text = out.text
    assert f"nixl/conn.py: {core.MODIFIED}" in text
    assert (
        pristine["nixl/conn.py"] and core.load_manifest().files["nixl/conn.py"] in text
    )
    assert found in text
    assert "nothing was changed" in text
    assert "pip install --force-reinstall --no-deps sglang==0.5.23" in text
    rc, verdict = status_of(sglang_dir, patched_dir, out)
    assert rc == RC_REFUSED and verdict.startswith("verdict: modified")


def test_missing_file_is_foreign(sglang_dir, patched_dir, out):
    core.target_path(sglang_dir, "mori/conn.py").unlink()
    before = snapshot(sglang_dir)
    assert core.install(sglang_dir, patched_dir, out=out) == RC_REFUSED
    assert "(file missing)" in out.text
    assert snapshot(sglang_dir) == before


def _interrupt_after(n):
    calls = []

    def hook(rel):
        calls.append(rel)
        if len(calls) == n:
            raise KeyboardInterrupt

    return hook


@pytest.mark.parametrize("finish_with", ["uninstall", "install"])
def test_interrupted_install(
    sglang_dir, patched_dir, pristine, patched, out, finish_with
):
    with pytest.raises(KeyboardInterrupt):
        core.install(sglang_dir, patched_dir, out=out, after_file=_interrupt_after(1))
    files = read_files(sglang_dir, pristine)
    assert sum(files[r] == patched[r] for r in files) == 1
    assert sum(files[r] == pristine[r] for r in files) == 4
    rc, verdict = status_of(sglang_dir, patched_dir, out)
    assert rc == RC_PARTIAL
    assert verdict.startswith("verdict: partially installed")
    assert getattr(core, finish_with)(sglang_dir, patched_dir, out=out) == RC_OK
    want = pristine if finish_with == "uninstall" else patched
    assert read_files(sglang_dir, pristine) == want
    expected = "not installed" if finish_with == "uninstall" else "installed"
    assert status_of(sglang_dir, patched_dir, out) == (RC_OK, f"verdict: {expected}")


def _replace_count(sglang_dir, patched_dir, action, monkeypatch, out):
    calls = []
    real = os.replace
    monkeypatch.setattr(core.os, "replace", lambda a, b: (calls.append(b), real(a, b)))
    assert action(sglang_dir, patched_dir, out=out) == RC_OK
    monkeypatch.setattr(core.os, "replace", real)
    return len(calls)


@pytest.mark.parametrize("upgrade", [False, True])
def test_interrupt_at_every_write(
    tmp_path,
    sglang_dir,
    patched_dir,
    other_patched_dir,
    pristine,
    patched,
    out,
    monkeypatch,
    upgrade,
):
    """Stop an install of build A (over stock, or over build B) at each of its
    atomic replaces, after the temp file is written: every file is still stock or
    a recorded build, and status, uninstall and install see that, both with this
    build of the tool and with another one (C, e.g. another checkout)."""
    if upgrade:
        assert core.install(sglang_dir, other_patched_dir, out=out) == RC_OK
    other = {r: (other_patched_dir / r).read_bytes() for r in pristine}
    third_dir = make_patched(tmp_path, pristine, "C")
    third = {r: (third_dir / r).read_bytes() for r in pristine}
    probe = tmp_path / "probe" / "sglang"
    shutil.copytree(sglang_dir, probe)
    total = _replace_count(probe, patched_dir, core.install, monkeypatch, out)
    # backups (5, only when starting from stock) + state + 5 files + state
    assert total == (7 if upgrade else 12)
    real = os.replace
    for n in range(total):
        for finish, tool_dir in itertools.product(
            (core.uninstall, core.install), (patched_dir, third_dir)
        ):
            tree = tmp_path / f"t{n}-{finish.__name__}-{tool_dir.name}" / "sglang"
            shutil.copytree(sglang_dir, tree)
            calls = []

            def failing(a, b):
                calls.append(b)
                if len(calls) > n:
                    raise KeyboardInterrupt  # the temp file is already written
                return real(a, b)

            monkeypatch.setattr(core.os, "replace", failing)
            with pytest.raises(KeyboardInterrupt):
                core.install(tree, patched_dir, out=out)
            monkeypatch.setattr(core.os, "replace", real)
            assert len(calls) == n + 1
            assert not list(tree.rglob(f"*{core.TMP_SUFFIX}"))
            for rel, data in read_files(tree, pristine).items():
                assert data in (pristine[rel], patched[rel], other[rel]), (n, rel)
            rc, verdict = status_of(tree, tool_dir, out)
            assert rc in (RC_OK, RC_PARTIAL), (n, verdict)
            assert "modified" not in verdict, (n, out.text)
            assert finish(tree, tool_dir, out=out) == RC_OK, (n, out.text)
            if finish is core.uninstall:
                assert read_files(tree, pristine) == pristine, n
                assert not core.state_dir(tree).exists()
            else:
                want = patched if tool_dir == patched_dir else third
                assert read_files(tree, pristine) == want, n


def test_dry_run_changes_nothing(sglang_dir, patched_dir, other_patched_dir, out):
    before = snapshot(sglang_dir)
    assert core.install(sglang_dir, patched_dir, dry_run=True, out=out) == RC_OK
    assert "would replace decode.py" in out.text
    assert snapshot(sglang_dir) == before
    assert core.uninstall(sglang_dir, patched_dir, dry_run=True, out=out) == RC_OK
    assert snapshot(sglang_dir) == before
    assert core.install(sglang_dir, other_patched_dir, out=out) == RC_OK
    installed = snapshot(sglang_dir)
    for action in (core.install, core.uninstall):
        out.lines.clear()
        assert action(sglang_dir, patched_dir, dry_run=True, out=out) == RC_OK
        assert "dry run: nothing was changed" in out.text
        assert snapshot(sglang_dir) == installed


def test_dry_run_cli(sglang_dir, patched_dir):
    before = snapshot(sglang_dir)
    for command in ("install", "uninstall"):
        proc = subprocess.run(
            [sys.executable, "-m", "sglang_pd_patch", command, "--dry-run"]
            + ["--sglang-dir", str(sglang_dir), "--patched-dir", str(patched_dir)],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "would replace" in proc.stdout or "nothing to do" in proc.stdout
    assert snapshot(sglang_dir) == before


def test_other_build_is_upgraded(
    sglang_dir, patched_dir, other_patched_dir, pristine, patched, out
):
    assert core.install(sglang_dir, other_patched_dir, out=out) == RC_OK
    rc, verdict = status_of(sglang_dir, patched_dir, out)
    assert rc == RC_OK and verdict.startswith("verdict: installed (other build")
    assert sum(core.OTHER in line for line in out.lines) == 5
    backups = {r: core.backup_path(sglang_dir, r).stat().st_ino for r in pristine}
    assert core.install(sglang_dir, patched_dir, out=out) == RC_OK
    assert read_files(sglang_dir, pristine) == patched
    # backups from the first install are kept as they are
    assert {
        r: core.backup_path(sglang_dir, r).stat().st_ino for r in pristine
    } == backups
    assert status_of(sglang_dir, patched_dir, out) == (RC_OK, "verdict: installed")
    assert core.uninstall(sglang_dir, patched_dir, out=out) == RC_OK
    assert read_files(sglang_dir, pristine) == pristine


def test_other_build_unknown_without_state(
    sglang_dir, patched_dir, other_patched_dir, out
):
    """Bytes of another build count as ours only if our state file records them."""
    assert core.install(sglang_dir, other_patched_dir, out=out) == RC_OK
    (core.state_dir(sglang_dir) / "state.json").unlink()
    before = snapshot(sglang_dir)
    assert core.install(sglang_dir, patched_dir, out=out) == RC_REFUSED
    assert snapshot(sglang_dir) == before


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_uninstall_refuses_without_good_backup(
    sglang_dir, patched_dir, pristine, out, damage
):
    assert core.install(sglang_dir, patched_dir, out=out) == RC_OK
    backup = core.backup_path(sglang_dir, "decode.py")
    if damage == "missing":
        backup.unlink()
    else:
        backup.write_bytes(b"garbage\n")
    before = snapshot(sglang_dir)
    out.lines.clear()
    assert core.uninstall(sglang_dir, patched_dir, out=out) == RC_REFUSED
    assert snapshot(sglang_dir) == before
    assert f"backup of decode.py is {damage}" in out.text
    assert "pip install --force-reinstall --no-deps sglang==0.5.23" in out.text
    rc, _ = status_of(sglang_dir, patched_dir, out)
    assert rc != RC_OK


def test_pip_reinstall_then_uninstall_cleans_up(sglang_dir, patched_dir, pristine, out):
    """After `pip install --force-reinstall sglang` the files are stock again and
    only our state dir is left: status says so, uninstall removes it."""
    assert core.install(sglang_dir, patched_dir, out=out) == RC_OK
    for rel, data in pristine.items():
        core.target_path(sglang_dir, rel).write_bytes(data)
    rc, verdict = status_of(sglang_dir, patched_dir, out)
    assert rc == RC_OK and "leftover" in verdict
    assert core.uninstall(sglang_dir, patched_dir, out=out) == RC_OK
    assert not core.state_dir(sglang_dir).exists()


def test_cli_status_exit_codes(sglang_dir, patched_dir, out):
    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "sglang_pd_patch", *args]
            + ["--sglang-dir", str(sglang_dir), "--patched-dir", str(patched_dir)],
            cwd=REPO,
            capture_output=True,
            text=True,
        )

    assert cli("status").returncode == RC_OK
    with pytest.raises(KeyboardInterrupt):
        core.install(sglang_dir, patched_dir, out=out, after_file=_interrupt_after(2))
    proc = cli("status")
    assert proc.returncode == RC_PARTIAL
    assert "partially installed" in proc.stdout
    assert cli("install").returncode == RC_OK
    proc = cli("status")
    assert (proc.returncode, proc.stdout.splitlines()[-1]) == (0, "verdict: installed")


def test_cli_without_sglang_says_what_to_do(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-S", "-m", "sglang_pd_patch", "status"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == RC_REFUSED
    assert "--sglang-dir" in proc.stderr
