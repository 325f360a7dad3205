"""Markdown report and plot from two tools/bench_admission.py results (P14).

    python3 tools/bench_admission_report.py --stock stock.json \\
        --patched patched.json --out report.md

Writes report.md and admission.png next to it. Needs only the standard library
and matplotlib.
"""

from __future__ import annotations

from report_cli import compare_main

# The healthy prefill's p90 at every multiple, against its own at 0x ("flat").
GOAL_P14 = 1.5


def sec(x):
    return "-" if x is None else f"{x:.2f}"


def flatness(doc):
    """Worst healthy p90 over the rounds with a stuck prefill, over 0x's."""
    rounds = {r["multiple"]: r for r in doc["rounds"]}
    base = (rounds.get(0) or {}).get("healthy", {}).get("p90")
    worst = max(
        (r["healthy"]["p90"] or float("inf") for m, r in rounds.items() if m),
        default=None,
    )
    if not base or worst is None:
        return None
    return worst / base


def report(stock, patched, png) -> str:
    pool = patched["pool_requests"]
    lines = [
        "# P14: a healthy prefill's admission against requests routed to a "
        "stuck prefill",
        "",
        f"Real servers ({patched['backend']}, tools/bench_admission.py): two "
        "prefills and one decode, no router. In each round prefill 2's scheduler "
        f"process is SIGSTOPped for {patched['rounds'][0]['window_s']:.0f} s (its "
        "HTTP and bootstrap servers answer); "
        f"{patched['healthy_clients']} clients send requests through prefill 1 "
        "back to back, and N requests are routed to prefill 2 over the first "
        f"half, N = 0, 1x, 4x and 16x what the decode's pool holds (~{pool} "
        "requests: 4096 tokens over each request's prompt and 512 tokens of "
        "reserved decode headroom). Then prefill 2 resumes. The decode's "
        "waiting timeout is "
        f"{patched['decode_waiting_timeout_s']} s (README's setting).",
        "",
        "Goal: flat, the healthy prefill's p90 in every round <= "
        f"{GOAL_P14:g}x its p90 with nothing stuck.",
        "",
        "| variant | worst p90 / p90 at 0x | goal |",
        "|---|---|---|",
    ]
    for name, doc in (("stock", stock), ("patched", patched)):
        f = flatness(doc)
        met = f is not None and f <= GOAL_P14
        lines.append(f"| {name} | {sec(f)} | {'met' if met else '**not met**'} |")
    lines += [
        "",
        "Healthy prefill's requests (latency at the decode, s: admission, the KV "
        "transfer and 8 tokens), the stuck prefill's, and the decode's own "
        "stats lines during the freeze (its KV held by transfers that have not "
        "arrived, as a share of the pool; requests waiting for KV; transfers)",
        "",
        "| N routed to the stuck prefill | variant | healthy n | p50 | p90 | max "
        "| healthy errors | stuck: served / n | stuck errors | decode: "
        "pre-allocated usage max | #prealloc-req max | #transfer-req max |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(patched["rounds"]):
        for name, doc in (("stock", stock), ("patched", patched)):
            x = doc["rounds"][i]
            h, s, st = x["healthy"], x["stuck"], x["decode_state_during_freeze"]
            lines.append(
                f"| {x['n_stuck']} ({x['multiple']}x) | {name} | {h['n']} | "
                f"{sec(h['p50'])} | {sec(h['p90'])} | {sec(h['max'])} | "
                f"{len(h['errors'])} kinds | {s['ok']} / {s['n']} | "
                + ("<br>".join(e[:160] for e in s["errors"]) or "none")
                + f" | {st['max_preallocated_usage']} | {st['max_prealloc_req']} "
                f"| {st['max_transfer_req']} |"
            )
    lines += [
        "",
        "Before the rounds, nothing frozen: time to first token, streamed from "
        "the decode, of requests with a long prompt sent one at a time "
        "(the first one left out), s",
        "",
        "| variant | allocation policy | prompt tokens | TTFT p50 | p90 | n |",
        "|---|---|---|---|---|---|",
    ]
    for name, doc in (("stock", stock), ("patched", patched)):
        t = doc.get("ttft") or {}
        lines.append(
            f"| {name} | {doc.get('allocation_policy', 'early')} | "
            f"{t.get('prompt_tokens', '-')} | {sec(t.get('p50'))} | "
            f"{sec(t.get('p90'))} | {t.get('ok', 0)} of {t.get('n', 0)} |"
        )
    lines += ["", f"![P14]({png})", ""]
    return "\n".join(lines)


def plot(stock, patched, png) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, doc, style in (("stock", stock, "--"), ("patched", patched, "-")):
        xs = [r["multiple"] for r in doc["rounds"]]
        for key, marker in (("p90", "o"), ("max", "^")):
            ys = [r["healthy"][key] for r in doc["rounds"]]
            ax.plot(xs, ys, style, marker=marker, label=f"{name} {key}")
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xticks([r["multiple"] for r in patched["rounds"]])
    ax.set_xticklabels([f"{r['multiple']}x" for r in patched["rounds"]])
    ax.set_xlabel("requests routed to the stuck prefill (x the decode's pool)")
    ax.set_ylabel("healthy prefill's request latency (s)")
    ax.set_title("P14: healthy admission with a stuck prefill")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> int:
    return compare_main(argv, "admission.png", plot, report)


if __name__ == "__main__":
    raise SystemExit(main())
