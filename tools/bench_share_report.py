"""Report of bench P17 (tools/bench_share.py): stock and patched, side by side.

    python3 tools/bench_share_report.py --stock stock.json --patched patched.json \
        --out report.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def plot(runs: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (held, lat) = plt.subplots(1, 2, figsize=(11, 3.8))
    for name, r in runs.items():
        t = [s["t"] / 60 for s in r["samples"]]
        held.plot(t, [s["stuck_held"] for s in r["samples"]], label=f"{name}: stuck holds")
        held.plot(
            t, [r["tokens"] - s["free"] for s in r["samples"]], "--", label=f"{name}: pool used"
        )
        lat.plot(
            [m["minute"] for m in r["per_minute"]],
            [m["p90"] for m in r["per_minute"]],
            marker="o",
            label=name,
        )
    any_run = next(iter(runs.values()))
    held.axhline(any_run["tokens"] / 2, color="grey", lw=0.8, label="half the pool")
    held.set_xlabel("minutes")
    held.set_ylabel("tokens")
    held.legend(fontsize=7)
    lat.set_xlabel("minute")
    lat.set_ylabel("healthy prefill's p90 (s)")
    lat.set_yscale("log")
    lat.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stock", type=Path, required=True)
    ap.add_argument("--patched", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    runs = {"stock": load(args.stock), "patched": load(args.patched)}
    r0 = runs["patched"]
    share = r0["tokens"] // 2
    lines = [
        "# Bench P17: a prefill stuck for good, ten simulated minutes",
        "",
        f"One decode ({r0['tokens']} tokens of KV, {r0['reserved']} of headroom per "
        f"request), the real DecodePreallocQueue and DecodeTransferQueue over the "
        f"simulated clock of test/registered/unit/disaggregation/decode_sim.py. "
        f"A healthy prefill (KV {r0['healthy_transfer_s']} s after the metadata) "
        f"and a prefill whose scheduler hangs for good each get a "
        f"{r0['prompt']}-token request a second; "
        f"SGLANG_DISAGGREGATION_WAITING_TIMEOUT={r0['waiting_timeout']:g} (README's).",
        "",
        "## Goals",
        "",
        "| goal | stock 0.5.23 | patched |",
        "|---|---|---|",
    ]

    def at_end(r):
        return r["samples"][-1]

    cells = []
    for name in ("stock", "patched"):
        r = runs[name]
        free_share = (r["tokens"] - at_end(r)["stuck_held"]) / r["tokens"]
        ok = at_end(r)["stuck_held"] <= share
        cells.append(
            f"{'met' if ok else 'not met'}: holds {at_end(r)['stuck_held']}, "
            f"{100 * free_share:.0f}% of the pool not held by it"
        )
    lines.append(f"| the stuck prefill holds at most its share ({share} tokens) after 10 min | {cells[0]} | {cells[1]} |")
    cells = []
    for name in ("stock", "patched"):
        r = runs[name]
        p90 = [m["p90"] for m in r["per_minute"]]
        unserved = sum(m["unserved"] for m in r["per_minute"])
        flat = max(p90) <= 1.5 * min(p90) and unserved == 0
        cells.append(
            f"{'met' if flat else 'not met'}: p90 {min(p90):.2f}-{max(p90):.2f} s, "
            f"{unserved} not served"
        )
    lines.append(f"| the healthy prefill's p90 flat (max within 1.5x of min, all served) | {cells[0]} | {cells[1]} |")
    lines += ["", "![share](share.png)", "", "## Per minute: the healthy prefill's requests", ""]
    lines.append("| minute | stock served | stock p50 / p90 | patched served | patched p50 / p90 |")
    lines.append("|---|---|---|---|---|")
    for a, b in zip(runs["stock"]["per_minute"], runs["patched"]["per_minute"]):
        lines.append(
            f"| {a['minute']} | {a['served']} (+{a['unserved']} not) | "
            f"{a['p50']:.2f} / {a['p90']:.2f} s | {b['served']} (+{b['unserved']} not) | "
            f"{b['p50']:.2f} / {b['p90']:.2f} s |"
        )
    lines += ["", "## Every minute: what the stuck prefill holds, and the pool", ""]
    lines.append("| t | stock: stuck holds / free / its waiting | patched: stuck holds / free / its waiting |")
    lines.append("|---|---|---|")
    for a, b in zip(runs["stock"]["samples"], runs["patched"]["samples"]):
        if int(a["t"]) % 60:
            continue
        lines.append(
            f"| {a['t']:.0f} s | {a['stuck_held']} / {a['free']} / {a['stuck_waiting']} | "
            f"{b['stuck_held']} / {b['free']} / {b['stuck_waiting']} |"
        )
    args.out.write_text("\n".join(lines) + "\n")
    plot(runs, args.out.parent / "share.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
