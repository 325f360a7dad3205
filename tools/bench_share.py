"""Bench P17: a prefill stuck for good, for ten simulated minutes.

One decode (the real DecodePreallocQueue and DecodeTransferQueue over the
simulated clock and memory of test/registered/unit/disaggregation/decode_sim.py)
gets one request a second from a healthy prefill and one a second from a
prefill whose scheduler hangs for good while its bootstrap server answers.
Sampled every 10 simulated seconds: the tokens the stuck prefill holds (in
transfer, or held after its requests ended), the pool's free tokens, and the
latency (arrival to KV) of the healthy prefill's requests, as p50/p90 per
minute.

Runs against whichever sglang is first on the path; ``python3 dev.py bench
--only share`` runs it on stock 0.5.23 and on the patch, then
tools/bench_share_report.py writes the report.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "test" / "registered" / "unit" / "disaggregation"))

import decode_sim  # noqa: E402
from decode_sim import Collectives, Prefill, Rank, World, patched  # noqa: E402

HEALTHY, STUCK = "10.0.0.1:8998", "10.0.0.2:8998"


def run(
    minutes: float,
    tokens: int,
    prompt: int,
    waiting_timeout: float,
    transfer_s: float,
    dt: float = 0.25,
) -> dict:
    world = World([Prefill(HEALTHY, transfer_s), Prefill(STUCK, None, acks=False)])
    collectives = Collectives(1)
    rank = Rank(
        world, tokens=tokens, slots=1024, waiting_timeout=waiting_timeout
    )
    sent = {}
    samples = []
    with patched(collectives, [rank.clock], waiting_timeout):
        steps = int(minutes * 60 / dt)
        for step in range(1, steps + 1):
            world.now = round(step * dt, 6)
            if step % int(1 / dt) == 0:
                for addr in (HEALTHY, STUCK):
                    room = next(decode_sim.rooms)
                    rank.add(addr, room, prompt)
                    if addr == HEALTHY:
                        sent[room] = world.now
            rank.cycle()
            if step % int(10 / dt) == 0:
                samples.append(
                    {
                        "t": world.now,
                        "stuck_held": rank.held_by(STUCK),
                        "free": rank.allocator.available_size(),
                        "healthy_waiting": len(rank.waiting(HEALTHY)),
                        "stuck_waiting": len(rank.waiting(STUCK)),
                    }
                )
    latency = {
        room: rank.served[room] - t for room, t in sent.items() if room in rank.served
    }
    minutes_out = []
    for minute in range(int(minutes)):
        window = [
            latency[room]
            for room, t in sent.items()
            if room in latency and minute * 60 <= t < (minute + 1) * 60
        ]
        unserved = [
            room
            for room, t in sent.items()
            if minute * 60 <= t < (minute + 1) * 60 and room not in latency
        ]
        q = statistics.quantiles(window, n=10) if len(window) >= 2 else [0] * 9
        minutes_out.append(
            {
                "minute": minute + 1,
                "served": len(window),
                "unserved": len(unserved),
                "p50": q[4],
                "p90": q[8],
            }
        )
    return {
        "variant": os.environ.get("SGLANG_PD_VARIANT", "unknown"),
        "minutes": minutes,
        "tokens": tokens,
        "prompt": prompt,
        "reserved": decode_sim.RESERVED,
        "waiting_timeout": waiting_timeout,
        "healthy_transfer_s": transfer_s,
        "samples": samples,
        "per_minute": minutes_out,
        "stuck_ended": sum(
            1 for room, addr in rank.room_prefill.items()
            if addr == STUCK and room in rank.ended
        ),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="result JSON file")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--prompt", type=int, default=400)
    ap.add_argument("--waiting-timeout", type=float, default=30.0)
    ap.add_argument("--transfer-s", type=float, default=0.5)
    args = ap.parse_args(argv)
    result = run(
        args.minutes, args.tokens, args.prompt, args.waiting_timeout, args.transfer_s
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    last = result["samples"][-1]
    print(
        f"[{result['variant']}] after {args.minutes:g} min: stuck holds "
        f"{last['stuck_held']} of {args.tokens} tokens, free {last['free']}; "
        f"healthy p90 by minute: "
        f"{[round(m['p90'], 2) for m in result['per_minute']]}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
