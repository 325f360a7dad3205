"""Bench F's report: sglang.benchmark.serving through the router, no fault,
stock and patched in alternation (dev.py bench --only serving).

    python tools/serving_report.py OUT   (OUT/round*/{stock,patched}/result.json)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

METRICS = (
    ("median_ttft_ms", "TTFT median (ms)"),
    ("p99_ttft_ms", "TTFT p99 (ms)"),
    ("median_itl_ms", "ITL median (ms)"),
    ("p99_itl_ms", "ITL p99 (ms)"),
    ("request_throughput", "throughput (req/s)"),
)
GOAL = 1.05


def load(out: Path) -> list[dict]:
    rounds = []
    for rdir in sorted(out.glob("round*")):
        runs = {
            v: json.loads((rdir / v / "result.json").read_text())
            for v in ("stock", "patched")
        }
        rounds.append(runs)
    if not rounds:
        raise SystemExit(f"no round*/stock|patched/result.json under {out}")
    return rounds


def report(out: Path) -> str:
    rounds = load(out)
    lines = [
        "# Bench F: sglang's load generator through the router, no fault",
        "",
        "`python3 dev.py bench --only serving`: the demo's deployment (2 prefills, 1 "
        "decode, the router with README's settings), `python -m "
        "sglang.benchmark.serving --backend sglang --dataset-name random-ids`, "
        "256-token prompts, 32 new tokens; at half the capacity the first run "
        "calibrated, then at saturation (8 in flight). Stock, then patched, in "
        f"{len(rounds)} rounds. Goal: patched within {GOAL}x of stock "
        "(throughput: at least 1/1.05x), on the median over rounds.",
        "",
    ]
    verdicts = []
    for phase in ("half", "saturation"):
        lines += [
            f"## {phase}",
            "",
            "| metric | "
            + " | ".join(
                f"round {i + 1} stock | round {i + 1} patched"
                for i in range(len(rounds))
            )
            + " | patched / stock (median of rounds) |",
            "|---" * (2 + 2 * len(rounds)) + "|",
        ]
        for key, label in METRICS:
            cells, ratios = [], []
            for runs in rounds:
                s = runs["stock"]["serving"][phase][key]
                p = runs["patched"]["serving"][phase][key]
                cells += [f"{s:.2f}", f"{p:.2f}"]
                ratios.append(p / s if s else float("nan"))
            ratio = statistics.median(ratios)
            ok = ratio >= 1 / GOAL if key == "request_throughput" else ratio <= GOAL
            verdicts.append((phase, label, ratio, ok))
            lines.append(
                f"| {label} | "
                + " | ".join(cells)
                + f" | {ratio:.2f} {'met' if ok else 'NOT met'} |"
            )
        completed = [
            (
                r["stock"]["serving"][phase]["completed"],
                r["patched"]["serving"][phase]["completed"],
            )
            for r in rounds
        ]
        lines += ["", f"Completed (stock, patched) per round: {completed}.", ""]
    caps = [r["stock"].get("serving_capacity") for r in rounds]
    lines += [f"Capacity the half rate was taken from, per round (req/s): {caps}.", ""]
    missed = [
        f"{phase} {label} ({ratio:.2f})"
        for phase, label, ratio, ok in verdicts
        if not ok
    ]
    lines.append("Missed: " + ", ".join(missed) + "." if missed else "Every goal met.")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    text = report(out)
    (out / "report.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
