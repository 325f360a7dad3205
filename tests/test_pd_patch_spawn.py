"""A process started the way sglang starts its schedulers imports the patched file."""

from __future__ import annotations

import json
import multiprocessing
import runpy

from sglang_pd_patch import core

CHILD = """
import hashlib, importlib.util, json, sys
spec = importlib.util.find_spec("sglang.srt.disaggregation.decode")
data = open(spec.origin, "rb").read()
json.dump(
    {"origin": spec.origin, "sha256": hashlib.sha256(data).hexdigest(),
     "sys_path0": sys.path[0]},
    open(RESULT, "w"),
)
"""


def test_spawned_process_imports_patched_decode(
    tmp_path, sglang_dir, patched_dir, monkeypatch, out
):
    assert core.install(sglang_dir, patched_dir, out=out) == 0
    site = sglang_dir.parent
    script, result = tmp_path / "child.py", tmp_path / "result.json"
    script.write_text(CHILD)
    monkeypatch.syspath_prepend(str(site))  # the temp copy first on sys.path
    # sglang's launch starts its scheduler processes this way.
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(
        target=runpy.run_path,
        args=(str(script),),
        kwargs={"init_globals": {"RESULT": str(result)}, "run_name": "__main__"},
    )
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0
    got = json.loads(result.read_text())
    decode = core.target_path(sglang_dir, "decode.py")
    assert got["origin"] == str(decode)
    assert got["sha256"] == core.sha256_bytes((patched_dir / "decode.py").read_bytes())
    assert got["sha256"] != core.load_manifest().files["decode.py"]
