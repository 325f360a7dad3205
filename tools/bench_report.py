"""Markdown report and stall plot from two tools/bench_stall.py results.

    python3 tools/bench_report.py --stock stock.json --patched patched.json \\
        --out report.md [--png report.png]

Writes the markdown report (goal check, P1-P6 tables with min / median / max
over repeats) and a PNG: per-cycle decode scheduler stall over time, stock and
patched on one log-scale figure, one panel per number of frozen prefills.
Needs only the standard library and matplotlib.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

GOAL_MAX_S = 0.010
GOAL_P99_S = 0.001
GOAL_P3_RATIO = 1.10


def load(path):
    with open(path) as f:
        doc = json.load(f)
    if doc.get("schema") != 1:
        raise SystemExit(f"{path}: unknown schema {doc.get('schema')!r}")
    return doc


def ms(x):
    if x is None:
        return "-"
    if x >= 1.0:
        return f"{x:.2f} s"
    if x >= 0.01:
        return f"{x * 1e3:.1f} ms"
    return f"{x * 1e3:.3f} ms"


def trio(s, fmt=ms):
    """min / median / max of a spread dict."""
    if not s:
        return "-"
    if s.get("n", 0) == 1:
        return fmt(s["median"])
    return f"{fmt(s['min'])} / {fmt(s['median'])} / {fmt(s['max'])}"


def ns(x):
    return f"{x:.0f} ns"


def mark(ok):
    if ok is None:
        return "n/a"
    return "met" if ok else "**missed**"


def spread(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    values = sorted(values)
    n = len(values)
    mid = values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2
    return {"min": values[0], "median": mid, "max": values[-1], "n": n}


def max_without_http(doc, k):
    """Per run, the slowest cycle among those that sent no HTTP request from
    the scheduler thread (cycles are [start, duration, cpu, http])."""
    return spread(
        [
            max((c[1] for c in r["cycles"] if c[3] == 0), default=None)
            for r in doc["results"]["frozen"]
            if r["k"] == k
        ]
    )


def k_values(doc):
    return sorted(int(k) for k in doc["summary"]["P2"])


def goal_rows(stock, patched):
    rows = []
    sp, pp = stock["summary"], patched["summary"]
    for k in k_values(patched):
        p2 = pp["P2"][str(k)]
        s2 = sp["P2"].get(str(k))
        name = "P1" if k == 1 else f"P2 K={k}"
        worst_max = p2["max_s"]["max"] if p2["max_s"] else None
        worst_p99 = p2["p99_s"]["max"] if p2["p99_s"] else None
        stock_max = trio(s2["max_s"]) if s2 else "-"
        rows.append(
            (
                f"{name}: max stall <= {ms(GOAL_MAX_S)}",
                trio(p2["max_s"]),
                stock_max,
                mark(worst_max is not None and worst_max <= GOAL_MAX_S),
            )
        )
        no_http = max_without_http(patched, k)
        rows.append(
            (
                f"{name}: max stall <= {ms(GOAL_MAX_S)}, cycles that sent no "
                "HTTP from the scheduler thread",
                trio(no_http),
                trio(max_without_http(stock, k)),
                mark(no_http is not None and no_http["max"] <= GOAL_MAX_S),
            )
        )
        rows.append(
            (
                f"{name}: p99 stall <= {ms(GOAL_P99_S)}",
                trio(p2["p99_s"]),
                trio(s2["p99_s"]) if s2 else "-",
                mark(worst_p99 is not None and worst_p99 <= GOAL_P99_S),
            )
        )
    ratio = p3_ratio(stock, patched, "try_ensure_ns", "min")
    rows.append(
        (
            f"P3: cached try_ensure_parallel_info patched/stock <= {GOAL_P3_RATIO}",
            f"{ratio:.2f} (fastest runs); "
            f"{p3_ratio(stock, patched, 'try_ensure_ns', 'min', normalized=True):.2f}"
            " normalized by the reference",
            "1.00",
            mark(ratio <= GOAL_P3_RATIO),
        )
    )
    worst_missed, worst_after, admitted_all = 0, 0.0, True
    for k in k_values(patched):
        p4 = pp["P4"][str(k)]
        admitted_all &= p4["admitted"] == p4["runs"]
        if p4.get("missed_cycles"):
            worst_missed = max(worst_missed, p4["missed_cycles"]["max"])
        if p4["admit_after_landing_s"]:
            worst_after = max(worst_after, p4["admit_after_landing_s"]["max"])
    rows.append(
        (
            "P4: healthy request admitted by the first cycle after its fetch "
            "landed, for every K",
            f"cycles missed: {worst_missed:.0f} (worst), admitted "
            f"{ms(worst_after)} after landing (worst)",
            "see P4",
            mark(admitted_all and worst_missed == 0),
        )
    )
    return rows


def p3_ratio(stock, patched, key, stat, normalized=False):
    s = stock["summary"]["P3"][key][stat]
    p = patched["summary"]["P3"][key][stat]
    if normalized:
        s /= stock["summary"]["P3"]["reference_ns"][stat]
        p /= patched["summary"]["P3"]["reference_ns"][stat]
    return p / s if s else float("nan")


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def describe(doc):
    c = doc["config"]
    h = doc["host"]
    return (
        f"- **{doc['variant']}** (detected: {doc['variant_detected']}), "
        f"sglang {doc.get('sglang_version')} from `{doc['sglang_path']}`, "
        f"backend {doc['backend']}, {'quick' if doc['quick'] else 'full'} run: "
        f"repeats {c['repeats']} (frozen scenarios: "
        f"{doc['summary']['P2'][str(k_values(doc)[0])]['max_s']['n']}), "
        f"scenario duration {c['duration_s']} s, cycle period {c['period_ms']} ms, "
        f"retry budget {c['max_ensure_retries']} x {c['ensure_retry_interval_s']} s; "
        f"{h['nproc']} CPUs, load average {h['loadavg_before'][0]:.1f} -> "
        f"{h['loadavg_after'][0]:.1f}; took {doc['elapsed_s']:.0f} s "
        f"(cluster start {doc['setup_s']:.0f} s)."
    )


def report(stock, patched, png_name):
    sp, pp = stock["summary"], patched["summary"]
    ks = sorted(set(k_values(stock)) | set(k_values(patched)))
    lines = [
        "# Decode scheduler stall: stock vs patched",
        "",
        "Real PD on 127.0.0.1 (test/pd_loopback harness): real prefill "
        "processes and bootstrap servers, the real decode KV manager and "
        "DecodePreallocQueue in the bench process. A *cycle* is one "
        "`DecodeSide.step()` (`_resolve_pending_reqs` + "
        "`_update_handshake_waiters` + metadata/transfer polling), run every "
        "cycle period. Values are min / median / max over repeats (one value "
        "when there was one run).",
        "",
        describe(stock),
        describe(patched),
        "",
        "## Goals",
        "",
        table(
            ["goal", "patched", "stock", "patched vs goal"], goal_rows(stock, patched)
        ),
        "",
        f"![per-cycle stall]({png_name})",
        "",
        "## P1 / P2: cycle stall with K frozen prefills (first contact)",
        "",
        "K = 1 is a SIGSTOPped prefill process; K > 1 adds K-1 listeners that "
        "never accept (the same TCP behaviour). `HTTP` counts requests the "
        "scheduler thread sent to a frozen bootstrap server; *max w/o HTTP* "
        "leaves out the cycles in which the scheduler thread sent any HTTP "
        "request (0 on patched: the per-rank `/route` lookups run in the "
        "background too, see P5). The CPU columns "
        "are the scheduler thread's own CPU time per cycle: a cycle that took "
        "much longer than its CPU time was waiting (network, GIL, or a CPU "
        "taken by other processes on a shared host). *Fetch threads started*: "
        "fetch-pool workers the scenario had to start (patched; "
        "`ThreadPoolExecutor` would start them lazily inside `submit()`, i.e. "
        "on the scheduler thread, so the pool starts them all with the "
        "manager). Stock's scenarios are cut after the first cycle that ends "
        "past the scenario duration, so stock *done* below can be missing.",
        "",
    ]
    rows = []
    for k in ks:
        for name, doc in (("stock", stock), ("patched", patched)):
            p2 = doc["summary"]["P2"].get(str(k))
            if not p2:
                continue
            rows.append(
                (
                    k,
                    name,
                    trio(p2["max_s"]),
                    trio(max_without_http(doc, k)),
                    trio(p2["p99_s"]),
                    trio(p2.get("p99_cpu_s")),
                    trio(p2.get("worst_cpu_s")),
                    trio(p2["cycles"], fmt=lambda x: f"{x:.0f}"),
                    trio(p2["http_to_frozen"], fmt=lambda x: f"{x:.0f}"),
                    trio(p2.get("fetch_threads_started"), fmt=lambda x: f"{x:.0f}"),
                )
            )
    lines.append(
        table(
            [
                "K",
                "variant",
                "max",
                "max w/o HTTP",
                "p99",
                "p99 of CPU time",
                "CPU of the max cycle",
                "cycles",
                "HTTP",
                "fetch threads started",
            ],
            rows,
        )
    )
    lines += [
        "",
        "## P3: steady state on a cached prefill addr",
        "",
    ]
    rows = []
    for key, label in (
        ("reference_ns", "reference: bound method, `addr in table`"),
        ("try_ensure_ns", "`try_ensure_parallel_info(addr)`"),
        ("ensure_prefill_info_ns", "`_ensure_prefill_info({addr: [req]})`"),
    ):
        rows.append(
            (
                label,
                trio(sp["P3"][key], fmt=ns),
                trio(pp["P3"][key], fmt=ns),
                f"{p3_ratio(stock, patched, key, 'min'):.2f} / "
                f"{p3_ratio(stock, patched, key, 'median'):.2f} / "
                f"{p3_ratio(stock, patched, key, 'min', normalized=True):.2f}",
            )
        )
    lines.append(
        table(
            [
                "call",
                "stock",
                "patched",
                "patched/stock: min / median / min normalized by reference",
            ],
            rows,
        )
    )
    lines += [
        "",
        "The two variants run in separate processes at different times on a "
        "shared host; the reference row shows how much the host's speed "
        "moved between them, and the last ratio divides it out. The "
        "scheduler's steady-state path is the last row: patched "
        "`_ensure_prefill_info` answers from `has_parallel_info()` before "
        "reaching `try_ensure_parallel_info`; a request whose prefill is "
        "cached does not reach either, `add()` admits it from the cache.",
        "",
        "## P4: healthy prefill's first request while K prefills are frozen",
        "",
        "Time from `add()` to the end of the cycle that initialised its "
        "receiver (*admit*); when its parallel info landed in "
        "`prefill_info_table` (*landed*); the difference; *cycles missed*: "
        "whole cycles that ran after the info landed without admitting the "
        "request (0: admitted by the first cycle that could see it); and "
        "until its KV arrived (*done*).",
        "",
    ]
    rows = []
    for k in ks:
        for name, doc in (("stock", stock), ("patched", patched)):
            p4 = doc["summary"]["P4"].get(str(k))
            if not p4:
                continue
            rows.append(
                (
                    k,
                    name,
                    trio(p4["admit_s"]),
                    trio(p4["landed_s"]),
                    trio(p4["admit_after_landing_s"]),
                    trio(p4.get("missed_cycles"), fmt=lambda x: f"{x:.0f}"),
                    trio(p4["done_s"]),
                    f"{p4['admitted']}/{p4['runs']}",
                )
            )
    lines.append(
        table(
            [
                "K",
                "variant",
                "admit",
                "landed",
                "admit - landed",
                "cycles missed",
                "done",
                "admitted",
            ],
            rows,
        )
    )
    lines += slow_query_table(
        stock,
        patched,
        "P5",
        "slow per-rank `/route` lookup",
        "The healthy prefill's bootstrap server answers the per-rank lookups "
        "of `CommonKVReceiver.init` -> `_get_bootstrap_info_from_server` "
        "after a delay; the parallel-info query is not delayed.",
    )
    lines += slow_query_table(
        stock,
        patched,
        "P6",
        "slow dp-rank query",
        "The healthy prefill reports dp_size 2 without follow_bootstrap_room, "
        "so the decode asks its `/query_dp_ranks` which rank holds each room "
        "(0.5.23: `prefetched_future.result()` or the synchronous "
        "`query_prefill_dp_ranks` in `_resolve_pending_reqs`); the answer "
        "comes after a delay. The prefill process is dp rank 0.",
    )
    lines += [
        "",
        "## P7: cycles from `add()` to receiver init, fast prefill",
        "",
        "One request to the healthy prefill at first contact, nothing slow: "
        "the scheduling cycles from its `add()` until its handshake is done "
        "(receiver initialised, KV metadata sent), and the time. Stock does "
        "the parallel-info fetch, the dp-rank query and the route lookups "
        "inline in one cycle; patched starts each in the background and uses "
        "its answer in the first cycle after it landed (the dp-rank query is "
        "prefetched before request intake, so an answer that lands by the "
        "consume point is used in that cycle).",
        "",
    ]
    rows = []
    for case, label in (
        ("dp_followed", "dp rank followed"),
        ("dp_query", "dp rank queried"),
    ):
        for name, doc in (("stock", stock), ("patched", patched)):
            p7 = (doc["summary"].get("P7") or {}).get(case)
            if not p7 or not p7["cycles_to_init"]:
                continue
            rows.append(
                (
                    label,
                    name,
                    trio(p7["cycles_to_init"], fmt=lambda x: f"{x:.0f}"),
                    trio(p7["init_s"]),
                    p7["failed"],
                )
            )
    lines.append(table(["case", "variant", "cycles", "time", "failed"], rows))
    lines += [
        "",
        "## P8: K requests in flight to a prefill that stops",
        "",
        "K requests to one prefill had their KV metadata sent, their KV not yet, "
        "when its whole process was SIGSTOPped; a healthy prefill's request is "
        "served, then one scheduling call aborts the K requests, which sends "
        "their ABORTs to the stopped prefill. Longest call from the freeze on, "
        "and the ZMQ sends and connects made by the scheduler thread itself "
        "(patched: a sender thread makes them). A PUSH socket queues up to "
        "SNDHWM (1000) messages for a peer that does not read before a send "
        "blocks, so stock does not stall here either: it sends inline.",
        "",
    ]
    rows = []
    for name, doc in (("stock", stock), ("patched", patched)):
        for r in doc["summary"].get("P8") or []:
            rows.append(
                (
                    r["k"],
                    name,
                    r["in_flight"],
                    ms(r["max_s"]),
                    r["scheduler_zmq_ops"],
                    r["healthy_state"],
                )
            )
    lines.append(
        table(
            [
                "K",
                "variant",
                "in flight at the freeze",
                "longest call",
                "scheduler-thread ZMQ ops",
                "healthy request",
            ],
            rows,
        )
    )
    lines.append("")
    return "\n".join(lines)


def slow_query_table(stock, patched, key: str, title: str, text: str) -> list:
    """A P5 / P6 section: one request while one kind of query is slow; the
    request's add() and every cycle until it ended."""
    rows = []
    for name, doc in (("stock", stock), ("patched", patched)):
        for r in doc["summary"].get(key) or []:
            rows.append(
                (
                    name,
                    ms(r["delay_s"]),
                    ms(r.get("max_s")),
                    ms(r.get("p99_s")),
                    r["scheduler_http"],
                    r["state"],
                )
            )
    header = ["variant", "delay", "max call", "p99 call", "scheduler-thread HTTP"]
    return ["", f"## {key}: {title}", "", text, "", table(header + ["request"], rows)]


def plot(stock, patched, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = sorted(set(k_values(stock)) & set(k_values(patched)))
    panels = [k for k in (ks[0], ks[-1]) if k in ks]
    panels = sorted(set(panels))
    fig, axes = plt.subplots(
        1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False
    )
    colors = {"stock": "tab:red", "patched": "tab:blue"}
    for ax, k in zip(axes[0], panels):
        for name, doc in (("stock", stock), ("patched", patched)):
            runs = [r for r in doc["results"]["frozen"] if r["k"] == k]
            for i, r in enumerate(runs):
                xs = [c[0] for c in r["cycles"]]
                ys = [max(c[1], 1e-6) for c in r["cycles"]]
                # Each call as a segment over the time it held the scheduler.
                ax.hlines(
                    ys,
                    xs,
                    [x + y for x, y in zip(xs, ys)],
                    color=colors[name],
                    alpha=0.5,
                    linewidth=2,
                )
                ax.plot(
                    xs,
                    ys,
                    ".",
                    markersize=3 if name == "patched" else 7,
                    alpha=0.5,
                    color=colors[name],
                    label=f"{name}" if i == 0 else None,
                )
        ax.axhline(GOAL_MAX_S, color="gray", linestyle="--", linewidth=0.8)
        ax.axhline(GOAL_P99_S, color="gray", linestyle=":", linewidth=0.8)
        ax.set_yscale("log")
        ax.set_xlabel("time since the requests arrived (s)")
        ax.set_ylabel("decode scheduling call duration (s)")
        title = "1 frozen prefill (P1)" if k == 1 else f"{k} frozen prefills (P2)"
        ax.set_title(f"{title}, {patched['backend']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="center right")
    fig.suptitle("Per-cycle scheduler stall, first contact with frozen prefills")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stock", required=True)
    parser.add_argument("--patched", required=True)
    parser.add_argument("--out", required=True, help="markdown report path")
    parser.add_argument(
        "--png", default=None, help="plot path (default: next to --out)"
    )
    args = parser.parse_args(argv)
    stock, patched = load(args.stock), load(args.patched)
    png = args.png or os.path.splitext(args.out)[0] + ".png"
    plot(stock, patched, png)
    rel = os.path.relpath(png, os.path.dirname(os.path.abspath(args.out)) or ".")
    with open(args.out, "w") as f:
        f.write(report(stock, patched, rel))
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
