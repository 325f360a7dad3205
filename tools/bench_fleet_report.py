"""Markdown report and plot from two tools/bench_fleet.py results.

    python3 tools/bench_fleet_report.py --stock stock.json --patched patched.json \\
        --out report.md

Writes report.md (the goals, then P9-P12 and the decode's threads and fds) and
fleet.png next to it. Needs only the standard library and matplotlib.
"""

from __future__ import annotations

import os

from report_cli import compare_main

GOAL_P9_S = 0.010  # healthy request at K = 64
GOAL_P10_MS = 1.0  # p99 at N = 5,000
GOAL_P11 = 1.05  # patched / stock CPU per admitted request
GOAL_P12_S = 20.0  # K = 32 declared failed
GOAL_P12B_S = 1.0  # one death among 31 frozen, against alone


def sec(x):
    if x is None:
        return "-"
    return f"{x:.2f} s" if x >= 1 else f"{x * 1e3:.1f} ms"


def p9_row(doc, k, sick, cached):
    for r in doc.get("p9", []):
        if r["k"] == k and r["sick"] == sick and r["cached"] == cached:
            return r
    return None


def goals(stock, patched):
    rows = []
    for name, doc in (("stock", stock), ("patched", patched)):
        cells = []
        for cached in (True, False):
            r = p9_row(doc, 64, "frozen", cached)
            mode = "cached" if cached else "first contact"
            if r is None:
                continue
            if r["admit_s"] is None:
                cells.append(f"not met ({mode}): not admitted")
            else:
                v = r["admit_s"]
                base = p9_row(doc, 0, "frozen", cached)
                extra = (
                    f", K = 0: {sec(base['admit_s'])}"
                    if base and base["admit_s"]
                    else ""
                )
                cells.append(
                    f"{'met' if v <= GOAL_P9_S else 'not met'} ({mode}): "
                    f"{sec(v)}{extra}"
                )
        p9 = (
            "; ".join(cells)
            if cells
            else "not run (stock blocks 5 s per frozen prefill per cycle)"
        )
        p10 = next((x for x in doc.get("p10", []) if x["n"] == 5000), None)
        p10 = (
            "not run (each cycle blocks on the frozen prefills' fetches)"
            if p10 is None
            else f"{'met' if p10['p99_ms'] <= GOAL_P10_MS else 'not met'}: "
            f"p99 {p10['p99_ms']:.3f} ms (CPU p99 "
            f"{p10.get('cpu_p99_ms', float('nan')):.3f} ms)"
        )
        p12 = next((x for x in doc.get("p12", []) if x["k"] == 32), None)
        if p12 is None:
            p12 = "not run"
        elif p12["last_s"] is None:
            p12 = f"not met: {p12['declared']} of 32 within {p12['cap_s']:.0f} s"
        else:
            p12 = (
                f"{'met' if p12['last_s'] <= GOAL_P12_S else 'not met'}: "
                f"{p12['last_s']:.1f} s"
            )
        rows.append((name, p9, p10, p12, p12b_goal(doc)))
    s11, p11 = stock["p11"]["cpu_per_request_ms"], patched["p11"]["cpu_per_request_ms"]
    ratio = p11 / s11 if s11 else float("inf")
    out = [
        "| goal | stock 0.5.23 | patched |",
        "|---|---|---|",
        f"| P9: healthy request admitted <= 10 ms with K = 64 frozen prefills "
        f"| {rows[0][1]} | {rows[1][1]} |",
        f"| P10: pending path p99 <= 1 ms at N = 5,000 | {rows[0][2]} | {rows[1][2]} |",
        f"| P11: scheduler CPU per admitted request <= 1.05x stock | "
        f"{s11:.2f} ms (reference) | {'met' if ratio <= GOAL_P11 else 'not met'}: "
        f"{p11:.2f} ms, {ratio:.3f}x |",
        f"| P12: K = 32 frozen prefills declared failed within 20 s "
        f"| {rows[0][3]} | {rows[1][3]} |",
        f"| P12b: one prefill's death declared among 31 frozen within 1 s of "
        f"alone | {rows[0][4]} | {rows[1][4]} |",
        f"| P15: 1,000 prefill addresses come and go; threads, fds and tables "
        f"back to idle | not run (stock has no table log) | {p15_goal(patched)} |",
    ]
    return out


def p12b_row(doc, death, others):
    return next(
        (
            r
            for r in doc.get("p12b", [])
            if r["death"] == death and r["others"] == others
        ),
        None,
    )


def p12b_goal(doc):
    cells = []
    for death in ("refuse", "freeze"):
        alone, among = p12b_row(doc, death, 0), p12b_row(doc, death, 31)
        if alone is None or among is None:
            continue
        if alone["declared_s"] is None or among["declared_s"] is None:
            cells.append(f"not met ({death}): not declared")
            continue
        gap = among["declared_s"] - alone["declared_s"]
        cells.append(
            f"{'met' if abs(gap) <= GOAL_P12B_S else 'not met'} ({death}): "
            f"{among['declared_s']:.1f} s against {alone['declared_s']:.1f} s"
        )
    return "; ".join(cells) if cells else "not run"


def p15_goal(doc):
    r = doc.get("p15")
    if r is None:
        return "not run"
    grown = {k: v for k, v in r["state_after"].items() if v > r["state_before"][k]}
    threads = r["after"]["threads"] - r["before"]["threads"]
    fds = r["after"]["fds"] - r["before"]["fds"]
    met = not grown and threads <= 0 and fds <= 0
    return (
        f"{'met' if met else 'not met'}: threads {threads:+d}, fds {fds:+d}, "
        f"tables grown: {', '.join(grown) or 'none'}"
    )


def report(stock, patched, png_name):
    lines = [
        "# Fleet scale: one decode, many prefills (python3 tools/bench_fleet.py)",
        "",
        f"Stock run {stock.get('date')}, patched run {patched.get('date')}"
        f"{' (--quick)' if patched.get('quick') else ''}. Real decode manager "
        "(Mooncake) and pending path in-process, one healthy prefill process, "
        "sick prefills on 127.0.0.1: frozen (listen, never accept) or "
        "trickling (one byte every 2 s). Cycles every 5 ms.",
        "",
        "## Goals",
        "",
        *goals(stock, patched),
        "",
        f"![fleet]({png_name})",
        "",
        "## P9: healthy request, add() until its dp rank is resolved",
        "",
        "The healthy prefill poses as dp rank 0 of 2 without "
        "follow_bootstrap_room, so each request needs a /query_dp_ranks; every "
        "sick prefill has one pending request. Stock: one cycle, K <= 4 (each "
        "frozen prefill blocks that cycle 5 s); '-' is not admitted in it. Patched: "
        "median of 3 runs.",
        "",
        "| sick | K | healthy info | stock | patched |",
        "|---|---|---|---|---|",
    ]
    keys = sorted(
        {(r["sick"], r["k"], r["cached"]) for d in (stock, patched) for r in d["p9"]},
        key=lambda t: (t[0], not t[2], t[1]),
    )
    for sick, k, cached in keys:
        s, p = p9_row(stock, k, sick, cached), p9_row(patched, k, sick, cached)
        lines.append(
            f"| {sick} | {k} | {'cached' if cached else 'first contact'} | "
            f"{sec(s['admit_s']) if s else 'not run'} | "
            f"{sec(p['admit_s']) if p else 'not run'} |"
        )
    lines += [
        "",
        "## P10: pending path per cycle, 64 frozen prefills",
        "",
        "prefetch_prefill_dp_rank_queries() + _resolve_pending_reqs(), N "
        "requests pending whose parallel info has not landed. Patched only: on "
        "stock each such cycle blocks on the fetches (5 s per frozen prefill).",
        "",
        "Wall time includes waits for the GIL while other threads of the "
        "process run (up to the 5 ms switch interval; 64 frozen prefills keep "
        "up to 150 threads); CPU time is the scheduler thread's own work.",
        "",
        "| N | cycles | p50 | p99 | max | CPU p50 | CPU p99 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in patched.get("p10", []):
        lines.append(
            f"| {r['n']} | {r['cycles']} | {r['p50_ms']:.3f} ms | "
            f"{r['p99_ms']:.3f} ms | {r['max_ms']:.3f} ms | "
            f"{r.get('cpu_p50_ms', float('nan')):.3f} ms | "
            f"{r.get('cpu_p99_ms', float('nan')):.3f} ms |"
        )
    lines += [
        "",
        "## P11: scheduler-thread CPU per admitted request, healthy, no faults",
        "",
        "The same 400 cycles (5 ms apart) with a request every 4th cycle, less "
        "400 without requests, per request admitted; median of 5. Per-peer "
        f"metrics (patch 12) {'on' if patched.get('metrics') else 'off'}.",
        "",
        "| | requests served | CPU per request |",
        "|---|---|---|",
    ]
    for name, doc in (("stock", stock), ("patched", patched)):
        r = doc["p11"]
        lines.append(
            f"| {name} | {r['succeeded']} of {r['requests']} | "
            f"{r['cpu_per_request_ms']:.2f} ms |"
        )
    lines += [
        "",
        "## P12: time to declare K frozen prefills failed (interval 5 s, 2 failures)",
        "",
        "| K | stock | patched |",
        "|---|---|---|",
    ]
    for k in sorted({r["k"] for d in (stock, patched) for r in d["p12"]}):
        cells = []
        for doc in (stock, patched):
            r = next((x for x in doc["p12"] if x["k"] == k), None)
            if r is None:
                cells.append("not run")
            elif r["last_s"] is None:
                cells.append(f"{r['declared']} of {k} within {r['cap_s']:.0f} s")
            else:
                cells.append(f"{r['first_s']:.1f}-{r['last_s']:.1f} s")
        lines.append(f"| {k} | {cells[0]} | {cells[1]} |")
    if any(d.get("p12b") for d in (stock, patched)):
        lines += [
            "",
            "## P12b: one prefill's death, alone and among 31 frozen prefills",
            "",
            "Seconds from its death to its declaration (interval 5 s, 2 "
            "failures). 'refuse': it is killed, connections are refused; "
            "'freeze': it takes connections in and answers nothing. The 31 "
            "others froze 2 s before.",
            "",
            "| death | others frozen | stock | patched |",
            "|---|---|---|---|",
        ]
        for death in ("refuse", "freeze"):
            for others in (0, 31):
                cells = []
                for doc in (stock, patched):
                    r = p12b_row(doc, death, others)
                    cells.append(
                        "not run"
                        if r is None
                        else (
                            f"{r['declared_s']:.1f} s"
                            if r["declared_s"] is not None
                            else "not declared in 60 s"
                        )
                    )
                lines.append(f"| {death} | {others} | {cells[0]} | {cells[1]} |")
    res = patched.get("resources")
    if res:
        lines += [
            "",
            f"## The decode's threads and open fds, {res['k']} frozen prefills "
            "(patched)",
            "",
            "Each frozen prefill has one pending request for 12 s (its fetches "
            "go overdue and are retried); then they are gone (closed, requests "
            "aborted, evicted). Lane threads started in this scenario end after "
            "2 s idle (60 s by default); 'before' includes idle lanes of earlier "
            "scenarios.",
            "",
            "| | before | peak | after they are gone |",
            "|---|---|---|---|",
            f"| threads | {res['before']['threads']} | {res['peak']['threads']} | "
            f"{res['after']['threads']} |",
            f"| open fds | {res['before']['fds']} | {res['peak']['fds']} | "
            f"{res['after']['fds']} |",
        ]
    p15 = patched.get("p15")
    if p15:
        keys = sorted(p15["state_after"])
        lines += [
            "",
            f"## P15: {p15['total']:,} prefill addresses come and go (patched)",
            "",
            f"{p15['wave']} at a time, {p15['churn_s']:.0f} s in all: each "
            "answers the bootstrap queries of one request, then is killed and "
            "declared failed (heartbeat every 2 s; lane threads and keep-alive "
            "connections end after 2 s idle, orphaned rooms are kept 5 s). "
            "'Idle' is measured 62 s after the last of a run of waves (a "
            "prefill's heartbeat probe thread ends 60 s after its last probe), the "
            f"baseline after the first {p15['wave']}.",
            "",
            "| | idle, baseline | peak | idle, after all |",
            "|---|---|---|---|",
            f"| threads | {p15['before']['threads']} | {p15['peak']['threads']} | "
            f"{p15['after']['threads']} |",
            f"| open fds | {p15['before']['fds']} | {p15['peak']['fds']} | "
            f"{p15['after']['fds']} |",
            *[
                f"| {k} | {p15['state_before'][k]} | | {p15['state_after'][k]} |"
                for k in keys
            ],
        ]
        if p15.get("series"):
            lines.append(
                f"| prefills with series on /metrics (--metrics; the healthy one "
                f"excluded after) | | {p15['series']['peak']} | "
                f"{p15['series']['left']} (a minute after the last went) |"
            )
    return "\n".join(lines) + "\n"


def plot(stock, patched, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    for name, doc, style in (("stock", stock, "o--"), ("patched", patched, "o-")):
        for cached in (True, False):
            pts = [
                (r["k"], r["admit_s"])
                for r in doc["p9"]
                if r["sick"] == "frozen" and r["cached"] == cached and r["admit_s"]
            ]
            if pts:
                xs, ys = zip(*sorted(pts))
                label = f"{name}, {'cached' if cached else 'first contact'}"
                ax.plot(xs, [y * 1e3 for y in ys], style, label=label)
    ax.set_yscale("log")
    ax.set_xlabel("frozen prefills K")
    ax.set_ylabel("healthy request admitted after (ms)")
    ax.set_title("P9")
    ax.legend(fontsize=8)
    ax = axes[1]
    p10 = patched.get("p10", [])
    if p10:
        ns = [str(r["n"]) for r in p10]
        ax.bar([i - 0.2 for i in range(len(ns))], [r["p50_ms"] for r in p10], 0.4)
        ax.bar([i + 0.2 for i in range(len(ns))], [r["p99_ms"] for r in p10], 0.4)
        ax.set_xticks(range(len(ns)), ns)
        ax.legend(["p50", "p99"], fontsize=8)
    ax.axhline(GOAL_P10_MS, color="grey", linestyle=":")
    ax.set_xlabel("pending requests N (64 frozen prefills)")
    ax.set_ylabel("pending path per cycle (ms), patched")
    ax.set_title("P10")
    ax = axes[2]
    for i, (name, doc) in enumerate((("stock", stock), ("patched", patched))):
        rs = sorted(doc["p12"], key=lambda r: r["k"])
        ax.bar(
            [j + (i - 0.5) * 0.4 for j in range(len(rs))],
            [r["last_s"] if r["last_s"] is not None else r["cap_s"] for r in rs],
            0.4,
            label=name + " (cap = not all declared)",
        )
        ax.set_xticks(range(len(rs)), [str(r["k"]) for r in rs])
    ax.axhline(GOAL_P12_S, color="grey", linestyle=":")
    ax.set_xlabel("prefills frozen at once K")
    ax.set_ylabel("all declared failed after (s)")
    ax.set_title("P12")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> int:
    return compare_main(argv, "fleet.png", plot, report)


if __name__ == "__main__":
    raise SystemExit(main())
