"""P11 in the simulation: the scheduler work a healthy request adds to the
decode's queues, counted without the noise of real servers.

The real DecodePreallocQueue and DecodeTransferQueue run over the simulated
clock, memory and prefill of test/registered/unit/disaggregation/decode_sim.py:
one healthy prefill whose transfers take 0.5 s, a cycle every 0.25 simulated
seconds. Per request: (the cycles with a request every 4th cycle, less the same
cycles without requests) / requests admitted, counted two ways:

- Python bytecode instructions executed in the cycles (sys.settrace opcode
  events): the same count on every run of the same code, whatever else the
  machine does;
- the thread's CPU time, median of ``--repeats`` pairs of runs.

Real receivers, ZMQ and the model cost the same in both variants and are not
in it: fleet bench P11 (tools/bench_fleet.py) measures the whole request.
``--metrics`` gives the kv manager a _PeerMetrics (per-peer series built once a
simulated second), as --enable-metrics does.

Runs against whichever sglang is first on the path: ``python3 dev.py
side-by-side tools/bench_cycle_cost.py --metrics --out DIR/{variant}.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "test" / "registered" / "unit" / "disaggregation"))

import decode_sim  # noqa: E402
from decode_sim import Collectives, Prefill, Rank, World, patched  # noqa: E402

HEALTHY = "10.0.0.1:8998"
DT = 0.25


class _Opcodes:
    """A trace function counting the bytecode instructions executed."""

    def __init__(self):
        self.count = 0

    def __call__(self, frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            self.count += 1
        return self


def _rank(metrics: bool):
    world = World([Prefill(HEALTHY, 0.5)])
    collectives = Collectives(1)
    rank = Rank(world, tokens=65536, slots=1024, waiting_timeout=300.0)
    if metrics:
        try:
            from sglang.srt.disaggregation.common.conn import _PeerMetrics
        except ImportError:  # stock: no per-peer metrics
            return world, collectives, rank
        kv = rank.kv_manager
        # What the rows read of a real kv manager and queue.
        kv._route_setups = {}
        kv.parallel_info_fetch_in_flight = lambda addr: 0
        rank.prealloc._prefill_dp_rank_queries = {}
        kv.peer_metrics = _PeerMetrics(None, tempfile.mkdtemp(), {"tp_rank": "0"})
    return world, collectives, rank


def _run(with_requests: bool, metrics: bool, count_opcodes: bool, cycles=400):
    world, collectives, rank = _rank(metrics)

    def step(add: bool) -> None:
        world.now = round(world.now + DT, 6)
        if add:
            room = next(decode_sim.rooms)
            added.append(room)
            rank.add(HEALTHY, room, 400)

    added, opcodes, cpu = [], _Opcodes(), 0.0
    with patched(collectives, [rank.clock], 300.0):
        for i in range(60):  # warm up: ten requests served, then idle
            step(i < 40 and i % 4 == 0)
            rank.cycle()
        added.clear()
        for i in range(cycles):
            step(with_requests and i % 4 == 0)
            if count_opcodes:
                sys.settrace(opcodes)
                rank.cycle()
                sys.settrace(None)
            else:
                start = time.thread_time()
                rank.cycle()
                cpu += time.thread_time() - start
        for _ in range(20):
            step(False)
            rank.cycle()
    admitted = sum(room in world.metadata_at for room in added)
    served = sum(room in rank.served for room in added)
    return opcodes.count, cpu, admitted, served


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="result JSON ({variant} expands)")
    ap.add_argument("--metrics", action="store_true", help="per-peer metrics on")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    variant = os.environ.get("SGLANG_PD_VARIANT", "unknown")
    busy, _, admitted, served = _run(True, args.metrics, True)
    idle, _, _, _ = _run(False, args.metrics, True)
    cpu = []
    for _ in range(args.repeats):
        busy_cpu, idle_cpu = _run(True, args.metrics, False), _run(
            False, args.metrics, False
        )
        cpu.append((busy_cpu[1] - idle_cpu[1]) / busy_cpu[2] * 1e6)
    result = {
        "variant": variant,
        "metrics": args.metrics,
        "requests_admitted": admitted,
        "requests_served": served,
        "opcodes_per_request": (busy - idle) / admitted,
        "cpu_us_per_request": statistics.median(cpu),
        "cpu_us_runs": cpu,
    }
    out = Path(args.out.format(variant=variant))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(
        f"[{variant}] per request: {result['opcodes_per_request']:.0f} bytecode "
        f"instructions, {result['cpu_us_per_request']:.1f} us CPU (median of "
        f"{args.repeats}); {served} of {admitted} admitted served"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
