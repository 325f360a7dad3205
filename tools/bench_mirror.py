"""Bench P16, the mirror: on the prefill, does a sick decode delay a healthy one?

One prefill and four decodes over loopback (test/pd_loopback/mirror.py), real
KV managers in every process. Decode B is healthy and gets a room every 0.5 s;
one of A1-A3 is sick meanwhile: A1 frozen after the prefill first sent to it,
A2 frozen before the prefill ever sent to it (Mooncake: the first transfer
opens its segment), A3 alive but not reading its control socket. Each sick
decode is killed after its window. Per backend and SGLANG_DISAGGREGATION_QUEUE_
SIZE, every decode's rooms are put on the same 0.5.23 queue. Writes one JSON
(``--out``) for the sglang first on PYTHONPATH; dev.py runs it for stock and
patched and tools/bench_mirror_report.py compares them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "test", "pd_loopback"))

import mirror  # noqa: E402
from decode_side import detect_variant  # noqa: E402

# (fault, sick decode, window in s): the windows cover stock's stalls (30 s
# for a frozen decode, 60 s for one frozen before the first transfer).
FAULTS = [
    ("frozen", "A1", 40.0),
    ("frozen_first_contact", "A2", 70.0),
    ("not_reading", "A3", 15.0),
]
QUICK_WINDOWS = {"frozen": 35.0, "frozen_first_contact": 65.0, "not_reading": 8.0}


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        parts = f.read().rsplit(")", 1)[1].split()
    return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")


def run_setup(backend: str, queues: int, quick: bool) -> dict:
    env = {"SGLANG_DISAGGREGATION_QUEUE_SIZE": str(queues)}
    sick_tokens, pool = 16, 4096
    if backend == "nixl":
        # On one host UCX writes into a frozen process through shared memory,
        # and the transfer succeeds; across hosts it uses TCP or RDMA. A room
        # large enough to fill the TCP window then stays pending.
        env["UCX_TLS"] = "tcp,self"
        sick_tokens, pool = 16384, 40000
    decodes = {"B": 0, "A1": 0, "A2": 0, "A3": 0}
    out = {"backend": backend, "queues": queues, "faults": []}
    t0 = time.monotonic()
    with mirror.MirrorCluster(backend, decodes, env=env, pool_tokens=pool) as c:
        out["startup_s"] = time.monotonic() - t0
        out["queue_of"] = {n: c.queue_of(n, queues) for n in decodes}
        out["log_dir"] = c.log_dir
        for fault, sick, window in FAULTS:
            if quick:
                window = QUICK_WINDOWS[fault]
            print(f"[{backend} q{queues}] {fault} ({sick}), {window:.0f} s", flush=True)
            cpu0, wall0 = cpu_seconds(c.prefill.pid), time.monotonic()
            res = mirror.run_fault(c, fault, sick, "B", window, sick_tokens=sick_tokens)
            res["prefill_cores"] = (cpu_seconds(c.prefill.pid) - cpu0) / (
                time.monotonic() - wall0
            )
            res["window_s"] = window
            res["sick_decode"] = sick
            c.decodes[sick].kill()
            print(f"    {json.dumps(res['summary'])}", flush=True)
            out["faults"].append(res)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="shorter windows")
    ap.add_argument("--backends", default="mooncake,nixl")
    args = ap.parse_args()
    variant, detected = detect_variant()
    result = {"variant": variant, "detected": detected, "setups": []}
    for backend in args.backends.split(","):
        # The patched prefill's transfer workers are QUEUE_SIZE: 2 is the
        # fewest that keep one free of a stuck decode.
        for queues in (2, 4) if backend == "mooncake" else (4,):
            result["setups"].append(run_setup(backend, queues, args.quick))
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
