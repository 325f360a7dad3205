"""Report of bench P18 (tools/bench_transfer_scale.py): stock and patched.

    python3 tools/bench_transfer_scale_report.py --stock stock.json \\
        --patched patched.json --out report.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def ms(x) -> str:
    return "-" if x is None else f"{x * 1000:.0f} ms" if x < 10 else f"{x:.1f} s"


def outcome(o: dict) -> str:
    return ", ".join(f"{n} {k}" for k, n in sorted(o.items())) or "-"


def goals(r: dict) -> list[tuple[str, bool, str]]:
    a, d = r["alone"], r["during"]
    served = r["outcomes"].get("healthy", {}).get("served", 0)
    cycle = r["interval_s"]
    return [
        (
            f"healthy p90 within one cycle ({cycle} s) of alone",
            d["p90"] is not None and d["p90"] <= a["p90"] + cycle,
            f"{ms(d['p90'])} against {ms(a['p90'])}",
        ),
        (
            "every healthy room served",
            served == d["sent"],
            f"{served} of {d['sent']}",
        ),
        (
            "transfer threads at most the worker count",
            r["threads"]["peak"] <= r["workers"],
            f"peak {r['threads']['peak']}",
        ),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stock", type=Path, required=True)
    ap.add_argument("--patched", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    variants = {
        "stock 0.5.23": json.loads(args.stock.read_text())["runs"],
        "patched": json.loads(args.patched.read_text())["runs"],
    }
    first = variants["patched"][0]
    lines = [
        "# Bench P18: one prefill, "
        f"{first['destinations']} decodes, {first['frozen']} frozen",
        "",
        "The prefill's real Mooncake transfer path (`add_transfer_request`, "
        "`transfer_worker`) over a simulated engine that behaves as "
        "`docs/results/mirror-study/engine-api.md` measured Mooncake's TCP "
        "transport (a transfer to a frozen decode fails after 30 s; a first "
        "transfer to a decode frozen before any holds the engine's segment lock "
        "~60 s). Half the frozen decodes freeze before the prefill's first "
        f"transfer to them, half after. Each healthy decode gets a room every "
        f"{first['interval_s']} s for {first['window_s']:.0f} s; a healthy "
        f"transfer takes {first['transfer_ms']:.0f} ms. Workers is "
        "`SGLANG_DISAGGREGATION_QUEUE_SIZE` (default 4): 0.5.23's queues, or "
        "the patch's transfer workers. Threads are the transfer threads the "
        "prefill runs (the simulated engine calls run on them).",
        "",
    ]
    for i, patched in enumerate(variants["patched"]):
        stock = variants["stock 0.5.23"][i]
        k = patched["workers"]
        lines += [f"## {k} workers", "", "| goal | stock 0.5.23 | patched |"]
        lines += ["|---|---|---|"]
        for (name, s_ok, s_txt), (_, p_ok, p_txt) in zip(goals(stock), goals(patched)):
            lines.append(
                f"| {name} | {'met' if s_ok else 'not met'}: {s_txt} "
                f"| {'met' if p_ok else 'not met'}: {p_txt} |"
            )
        lines += ["", "| | stock 0.5.23 | patched |", "|---|---|---|"]
        for label, get in (
            ("healthy alone p50 / p90", lambda r: f"{ms(r['alone']['p50'])} / {ms(r['alone']['p90'])}"),
            (
                "healthy during p50 / p90 / max",
                lambda r: " / ".join(ms(r["during"][q]) for q in ("p50", "p90", "max")),
            ),
            ("healthy rooms", lambda r: outcome(r["outcomes"].get("healthy", {}))),
            (
                "frozen before first contact",
                lambda r: outcome(r["outcomes"].get("frozen before first contact", {})),
            ),
            (
                "frozen after its first transfer",
                lambda r: outcome(r["outcomes"].get("frozen after its first transfer", {})),
            ),
            ("frozen rooms ended after (s)", lambda r: ", ".join(map(str, r["sick_ended_after_s"])) or "-"),
            ("transfer threads before / peak", lambda r: f"{r['threads']['before']} / {r['threads']['peak']}"),
            ("bench process CPU in the window", lambda r: f"{r['cpu_s']} s"),
        ):
            lines.append(f"| {label} | {get(stock)} | {get(patched)} |")
        lines.append("")
    lines += [
        "`open` is a room with no outcome when the bench stopped waiting "
        "(the window plus 120 s for the healthy rooms). With more decodes frozen "
        "at the same moment than workers, every worker waits out one frozen "
        "decode's bound before the next frozen decodes are found, so the "
        "healthy rooms wait about one bound per `workers` frozen decodes: the "
        "patch absorbs up to `workers - 1` decodes sick at once.",
        "",
    ]
    args.out.write_text("\n".join(lines))
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
