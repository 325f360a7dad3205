"""Merge ``tools/soak_pd.py`` results into a markdown report and a PNG plot.

    python tools/soak_report.py OUT/stock OUT/patched --out OUT

Each positional argument is a ``result.json`` or a directory holding one.
Writes ``report.md`` and ``soak.png`` into ``--out`` and prints the markdown.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_report import (  # noqa: E402
    _generic,
    client_stall_in,
    label,
    load,
    quantile,
    with_gaps,
)
from soak_pd import DOWN_KINDS, FAILED_METRICS, GAUGES, PREFILLS  # noqa: E402

HEALTH_GOAL_S = 2.5
# After a fault ends, its /health polls are looked at this much longer: the
# decode catches up then.
FAULT_TAIL_S = 5.0
# Growth bounds, end of the run against right after warm-up (decode, all
# processes). Threads: each prefill's threads on the decode (at most 2 each,
# they end after 60 s idle) and the rebootstrap executor's, plus some.
THREADS_BOUND = 16
FDS_BOUND = 32
RSS_BOUND = 0.10
# Decode tables that must be empty at the end (idle server), and those that are
# bounded by the deployment: at most this many entries.
TABLES_EMPTY = (
    "pending_reqs",
    "pending_prefills",
    "ensure_retry_count",
    "ensure_last_attempt_time",
    "held_rebootstrap_reqs",
    "rooms_tracked",
    "orphaned_rooms",
    "fetches_in_flight",
    "request_status",
    "control_msgs_queued",
)
# The per-prefill series that must be 0 at the end, by the name above.
PEER_EMPTY = {
    "sglang:pd_prefill_held_reqs": "held_reqs",
    "sglang:pd_prefill_fenced_tokens": "fenced_tokens",
    "sglang:pd_prefill_waiting_reqs": "waiting_reqs",
    "sglang:pd_prefill_fetches_in_flight": "fetches_in_flight",
}
TABLES_EMPTY += tuple(PEER_EMPTY.values())
TABLES_BOUNDED = {
    "prefills": 2,
    "route_cache": 2,
    "heartbeat_failures": 2,
    "fetch_threads": 14,
}


def _f(x: Optional[float], digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def fault_windows(r: dict) -> List[dict]:
    """Each fault as it ran: start, end (a restart ends when it is healthy)."""
    out = []
    for f in r["faults"]:
        if "t_start" not in f:
            continue
        out.append(dict(f, end=f.get("t_end", r["t_cut"])))
    return out


def down_at(windows: List[dict], prefill: str, t: float) -> bool:
    return any(
        w["target"] == prefill
        and w["kind"] in DOWN_KINDS
        and w["t_start"] <= t < w["end"]
        for w in windows
    )


def faulted_at(windows: List[dict], prefill: str, t: float) -> bool:
    return any(w["target"] == prefill and w["t_start"] <= t < w["end"] for w in windows)


def served_by(row: dict) -> Optional[str]:
    """The prefill of the router's last attempt, the one that served an ok row."""
    prefills = row.get("prefills") or []
    return prefills[-1] if prefills else None


def summarize(r: dict) -> dict:
    windows = fault_windows(r)
    rows = r["requests"]
    stalls = r["client_stalls"]
    s: Dict = {"windows": windows}
    s["outcomes"] = Counter(x["outcome"] for x in rows)
    s["n"] = len(rows)
    s["open"] = [x for x in rows if x["outcome"] == "open"]
    errors = [x for x in rows if x["outcome"] not in ("ok", "open")]
    s["errors"] = Counter(
        (x["outcome"], x.get("status"), _generic(x.get("error"))[:160]) for x in errors
    )
    # An error is excused only when no prefill could serve: both down when sent.
    s["unexcused"] = [
        x for x in errors if not all(down_at(windows, p, x["t_send"]) for p in PREFILLS)
    ]
    s["router_retried_ok"] = sum(
        1 for x in rows if x["outcome"] == "ok" and x.get("router_retries")
    )

    # Judged on the polls sent while the load ran and the soak waited for open
    # requests; the few sent after (while it samples the decode) are shown.
    all_health = r["decode_health"]
    health = [h for h in all_health if h["t"] <= r["t_cut"]]
    after = [h["latency"] for h in all_health if h["t"] > r["t_cut"]]
    s["health_after_max"] = max(after, default=None)
    less = [h["latency"] - client_stall_in(h, stalls) for h in health]
    s["health_max"] = max((h["latency"] for h in health), default=None)
    s["health_max_less"] = max(less, default=None)
    s["health_failed"] = sum(1 for h in health if h.get("status") != 200)
    per_fault = []
    for w in windows:
        idx = [
            i
            for i, h in enumerate(health)
            if w["t_start"] <= h["t"] < w["end"] + FAULT_TAIL_S
        ]
        per_fault.append(
            {
                "fault": w,
                "polls": len(idx),
                "max": max((health[i]["latency"] for i in idx), default=None),
                "max_less": max((less[i] for i in idx), default=None),
                "failed": sum(1 for i in idx if health[i].get("status") != 200),
            }
        )
    s["health_per_fault"] = per_fault

    # Latency of a prefill while it is up and the other one is faulted,
    # against times when nothing is faulted.
    lat = {"fault_free": [], "other_faulted": []}
    for x in rows:
        if x["outcome"] != "ok" or x.get("router_retries"):
            continue
        p = served_by(x)
        if p not in PREFILLS:
            continue
        other = PREFILLS[1 - PREFILLS.index(p)]
        t = x["t_send"]
        if faulted_at(windows, p, t):
            continue
        if faulted_at(windows, other, t):
            lat["other_faulted"].append(x["latency"])
        elif not any(w["t_start"] <= t < w["end"] for w in windows):
            lat["fault_free"].append(x["latency"])
    s["latency"] = {
        k: {"n": len(v), "p50": quantile(v, 0.5), "p90": quantile(v, 0.9)}
        for k, v in lat.items()
    }

    restarts = []
    for w in windows:
        if w["kind"] != "kill_restart":
            continue
        healthy = w.get("t_end")
        served = [
            x
            for x in rows
            if x["outcome"] == "ok"
            and served_by(x) == w["target"]
            and x["t_send"] > w["t_start"]
        ]
        first = min(served, key=lambda x: x["t_end"]) if served else None
        restarts.append(
            {
                "fault": w,
                "down_s": None if healthy is None else healthy - w["t_start"],
                "first_served_s": (
                    None
                    if first is None or healthy is None
                    else first["t_end"] - healthy
                ),
                "served_after": len(served),
            }
        )
    s["restarts"] = restarts

    res = r["resources"]
    warm, end = res["warm"], res["end"]
    s["growth"] = {
        "threads": end["threads"] - warm["threads"],
        "fds": end["fds"] - warm["fds"],
        "rss": end["rss"] / warm["rss"] - 1 if warm["rss"] else None,
    }

    state = (r.get("decode_state") or {}).get("last")
    if state is None and r.get("peer_end"):
        # The rebuilt decode logs no tables: its per-prefill series on
        # /metrics (patch 12) at the end, summed over the prefills.
        state = Counter()
        for x in r["peer_end"]:
            if x["name"] in PEER_EMPTY:
                state[PEER_EMPTY[x["name"]]] += x["value"]
    s["state"] = state
    if state is not None:
        s["tables_bad"] = {k: state[k] for k in TABLES_EMPTY if state.get(k)}
        s["tables_bad"].update(
            {
                k: state[k]
                for k, bound in TABLES_BOUNDED.items()
                if state.get(k, 0) > bound
            }
        )

    m0 = (r.get("metrics") or {}).get("start") or {}
    m1 = (r.get("metrics") or {}).get("end") or {}
    failed_delta = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in FAILED_METRICS}
    aborts = [
        v
        for x in rows
        for v in x.get("decode") or []
        if v["outcome"] == "aborted" and v["t_end"] >= 0
    ]
    lines = r.get("decode_failure_lines") or {}
    # Every decode attempt but a request's last ok (or still open) one failed:
    # the client sees it as an error, or as a retry of the router.
    client_failed = sum(
        max(0, len(x.get("decode_received") or []) - (x["outcome"] in ("ok", "open")))
        for x in rows
    )
    s["metrics"] = {
        "lines": lines,
        "client_failed_attempts": client_failed,
        "available": bool(m1),
        "failed_delta": failed_delta,
        "failed_total": sum(failed_delta.values()),
        "gauges_end": {k: m1.get(k) for k in GAUGES},
        "decode_aborts": len(aborts),
        "decode_aborts_by_text": Counter(_generic(v.get("error"))[:90] for v in aborts),
        "client_errors_with_abort": sum(
            1
            for x in errors
            if any(v["outcome"] == "aborted" for v in x.get("decode") or [])
        ),
    }
    return s


def goals(r: dict, s: dict) -> List[tuple]:
    g = []
    n_open = len(s["open"])
    g.append(("no request still open at the end", f"{n_open} of {s['n']}", n_open == 0))
    n_bad = len(s["unexcused"])
    g.append(
        (
            "no request fails while a prefill could serve it (after the router's retries)",
            f"{n_bad} of {s['n']} failed",
            n_bad == 0,
        )
    )
    hm = s["health_max_less"]
    fig = f"{_f(hm, 3)} s (raw {_f(s['health_max'], 3)})"
    if s["health_failed"]:
        fig += f"; {s['health_failed']} polls failed"
    if s["health_after_max"] is not None:
        fig += f"; after the drain {_f(s['health_after_max'], 3)} s"
    g.append(
        (
            f"decode /health max < {HEALTH_GOAL_S} s, less the client's stalls",
            fig,
            hm is not None and hm < HEALTH_GOAL_S and s["health_failed"] == 0,
        )
    )
    gr = s["growth"]
    ok = (
        gr["threads"] <= THREADS_BOUND
        and gr["fds"] <= FDS_BOUND
        and gr["rss"] is not None
        and abs(gr["rss"]) <= RSS_BOUND
    )
    fig = (
        f"threads {gr['threads']:+d} (bound +{THREADS_BOUND}), fds {gr['fds']:+d} "
        f"(bound +{FDS_BOUND}), RSS {100 * gr['rss']:+.1f}% (bound 10%)"
    )
    if s["state"] is None:
        # Stock exposes no tables: judged on the rest.
        fig += "; tables: not exposed"
    elif s["tables_bad"]:
        fig += f"; tables not drained: {s['tables_bad']}"
        ok = False
    else:
        fig += "; tables drained"
    g.append(("no growth: threads, fds, RSS, decode tables", fig, ok))
    rs = s["restarts"]
    if not rs:
        g.append(
            (
                "a restarted prefill serves again, decode not restarted",
                "no restart in the schedule",
                False,
            )
        )
    else:
        figs, ok = [], r["starts"].get("decode") == 1
        for x in rs:
            if x["first_served_s"] is None:
                figs.append(f"{x['fault']['target']}: never")
                ok = False
            else:
                figs.append(
                    f"{x['fault']['target']}: {x['first_served_s']:.1f} s after healthy"
                )
        g.append(
            (
                "a restarted prefill serves again, decode not restarted",
                "; ".join(figs),
                ok,
            )
        )
    m = s["metrics"]
    if not m["available"]:
        g.append(("metrics agree with the client's view", "no /metrics", False))
    else:
        gauges = m["gauges_end"]
        d, lines = m["failed_delta"], m["lines"]
        agree = (
            d[FAILED_METRICS[0]] == lines.get("handshake")
            and d[FAILED_METRICS[1]] == lines.get("transfer")
            and m["failed_total"] == m["client_failed_attempts"]
            and all((v or 0) == 0 for v in gauges.values())
            and n_open == 0
        )
        fig = (
            f"failed counters +{m['failed_total']:.0f} (decode log "
            f"{sum(lines.values())}), failed attempts the client saw "
            f"{m['client_failed_attempts']}; queue gauges at the end "
            + "/".join(_f(v, 0) for v in gauges.values())
            + f" with {n_open} open"
        )
        g.append(("metrics agree with the client's view", fig, agree))
    return g


def goals_table(results: List[dict], sums: List[dict]) -> List[str]:
    per = [goals(r, s) for r, s in zip(results, sums)]
    lines = ["| goal | " + " | ".join(label(r) for r in results) + " |"]
    lines.append("|---" * (len(results) + 1) + "|")
    for i, (name, _, _) in enumerate(per[0]):
        cells = []
        for g in per:
            _, fig, ok = g[i]
            cells.append(f"{fig} {'met' if ok else '**not met**'}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def fault_desc(f: dict) -> str:
    what = f["kind"]
    if f["kind"] == "slow":
        what += f" {f['stop_ms']}/{f['period_ms']} ms"
    return f"#{f['id']} {f['target']} {what}"


def tables(results: List[dict]) -> str:
    sums = [summarize(r) for r in results]
    out = []
    r0 = results[0]
    out.append(
        f"{r0['minutes']:g} minutes of load, seed {r0['seed']}"
        + (", both prefills may be down at once" if r0.get("both") else "")
        + ". Goals (met / not met, per variant):"
    )
    out.append("")
    out += goals_table(results, sums)
    out.append("")
    out.append("Load and deployment")
    out.append("")
    out.append("| variant | rate (req/s) | how chosen | requests | router | run (s) |")
    out.append("|---|---|---|---|---|---|")
    for r, s in zip(results, sums):
        rc = r["rate_choice"]
        how = rc.get("why") or rc.get("source")
        if rc.get("source") == "rate-from":
            how = f"the {rc['from_label']} run's rate"
        router = (
            "defaults" if r["router"].get("defaults", True) else "PD settings (README)"
        )
        out.append(
            f"| {label(r)} | {r['rate']:g} | {how} | {s['n']} | {router} | "
            f"{r['run_s']:.0f} |"
        )
    out.append("")
    out.append(
        "Fault schedule as it ran (seconds since the load started; a restart "
        "ends when the prefill's /health answers)"
    )
    out.append("")
    out.append(
        "| fault | planned start | " + " | ".join(label(r) for r in results) + " |"
    )
    out.append("|---" * (len(results) + 2) + "|")
    for f in r0["schedule"]:
        cells = []
        for s in sums:
            w = next((w for w in s["windows"] if w["id"] == f["id"]), None)
            cells.append("-" if w is None else f"{w['t_start']:.1f} - {w['end']:.1f}")
        out.append(
            f"| {fault_desc(f)} | {f['start']:.1f} | " + " | ".join(cells) + " |"
        )
    out.append("")
    out.append("How every request ended (client through the router)")
    out.append("")
    out.append(
        "| variant | outcomes | ok after a router retry | errors: outcome, HTTP status, text |"
    )
    out.append("|---|---|---|---|")
    for r, s in zip(results, sums):
        oc = ", ".join(f"{k}: {v}" for k, v in sorted(s["outcomes"].items()))
        errs = (
            "<br>".join(
                f"{n}x {o} {st}: `{t}`" for (o, st, t), n in s["errors"].most_common(6)
            )
            or "none"
        )
        out.append(f"| {label(r)} | {oc} | {s['router_retried_ok']} | {errs} |")
    out.append("")
    out.append(
        "Decode `GET /health` per fault (polls from the fault's start to "
        f"{FAULT_TAIL_S:g} s after its end): max, and max less the client's own "
        "stalls (s)"
    )
    out.append("")
    out.append("| fault | " + " | ".join(label(r) for r in results) + " |")
    out.append("|---" * (len(results) + 1) + "|")
    for f in r0["schedule"]:
        cells = []
        for s in sums:
            h = next(
                (h for h in s["health_per_fault"] if h["fault"]["id"] == f["id"]), None
            )
            if h is None or not h["polls"]:
                cells.append("-")
                continue
            c = f"{_f(h['max'], 3)} / {_f(h['max_less'], 3)} ({h['polls']} polls"
            c += f", {h['failed']} failed)" if h["failed"] else ")"
            cells.append(c)
        out.append(f"| {fault_desc(f)} | " + " | ".join(cells) + " |")
    out.append("")
    out.append(
        "A prefill's latency while it is up and the other one is faulted, "
        "against fault-free times (ok requests the router did not retry; s)"
    )
    out.append("")
    out.append(
        "| variant | fault-free p50 / p90 (n) | other prefill faulted p50 / p90 (n) | p90 ratio |"
    )
    out.append("|---|---|---|---|")
    for r, s in zip(results, sums):
        a, b = s["latency"]["fault_free"], s["latency"]["other_faulted"]
        ratio = b["p90"] / a["p90"] if a["p90"] and b["p90"] else None
        out.append(
            f"| {label(r)} | {_f(a['p50'])} / {_f(a['p90'])} ({a['n']}) | "
            f"{_f(b['p50'])} / {_f(b['p90'])} ({b['n']}) | {_f(ratio)} |"
        )
    out.append("")
    out.append(
        "Restarts: SIGKILL of the prefill's process group, the same command on the same ports"
    )
    out.append("")
    out.append(
        "| variant | fault | down (kill to /health) s | first served through the router, s after healthy | its requests served after the kill |"
    )
    out.append("|---|---|---|---|---|")
    for r, s in zip(results, sums):
        for x in s["restarts"]:
            out.append(
                f"| {label(r)} | {fault_desc(x['fault'])} | {_f(x['down_s'], 1)} | "
                f"{_f(x['first_served_s'], 1) if x['first_served_s'] is not None else 'never'} | "
                f"{x['served_after']} |"
            )
    out.append("")
    out.append(
        "Decode resources (all its processes), right after warm-up and at the end "
        "(after the drain)"
    )
    out.append("")
    out.append("| variant | threads | open fds | RSS (GiB) | scheduler threads / fds |")
    out.append("|---|---|---|---|---|")
    for r in results:
        w, e = r["resources"]["warm"], r["resources"]["end"]
        out.append(
            f"| {label(r)} | {w['threads']} -> {e['threads']} | {w['fds']} -> {e['fds']} | "
            f"{w['rss'] / 2**30:.2f} -> {e['rss'] / 2**30:.2f} | "
            f"{w.get('scheduler_threads')}/{w.get('scheduler_fds')} -> "
            f"{e.get('scheduler_threads')}/{e.get('scheduler_fds')} |"
        )
    out.append("")
    out.append(
        "Decode tables at the end: its last `PD decode state` log line (earlier "
        "builds), or its per-prefill series on /metrics summed over the "
        "prefills (patch 12; stock exposes neither)"
    )
    out.append("")
    for r, s in zip(results, sums):
        st = s["state"]
        if st is None:
            out.append(f"- {label(r)}: not exposed")
        else:
            out.append(f"- {label(r)}: " + ", ".join(f"{k} {v}" for k, v in st.items()))
    out.append("")
    out.append(
        "sglang's own metrics on the decode (`--enable-metrics`), against the client's view"
    )
    out.append("")
    out.append(
        "| variant | bootstrap failed (+) / decode log | transfer failed (+) / decode log "
        "| failed decode attempts the client saw | of them in the request log "
        "| client errors after a decode abort | ok after a router retry "
        "| prealloc / transfer queue at the end |"
    )
    out.append("|---|---|---|---|---|---|---|---|")
    for r, s in zip(results, sums):
        m = s["metrics"]
        d, lines = m["failed_delta"], m["lines"]
        out.append(
            f"| {label(r)} | {d[FAILED_METRICS[0]]:.0f} / {lines.get('handshake', '-')} | "
            f"{d[FAILED_METRICS[1]]:.0f} / {lines.get('transfer', '-')} | "
            f"{m['client_failed_attempts']} | "
            f"{m['decode_aborts']} | {m['client_errors_with_abort']} | "
            f"{s['router_retried_ok']} | "
            + " / ".join(_f(v, 0) for v in m["gauges_end"].values())
            + " |"
        )
    out.append("")
    for r, s in zip(results, sums):
        texts = s["metrics"]["decode_aborts_by_text"].most_common(4)
        if texts:
            out.append(
                f"- {label(r)} decode abort texts: "
                + "; ".join(f"{n}x `{t}`" for t, n in texts)
            )
        if r.get("fault_errors"):
            out.append(f"- {label(r)}: fault runner errors: {r['fault_errors']}")
        big = [c for c in r["client_stalls"] if c["gap"] > 1.0]
        if big:
            out.append(
                f"- {label(r)}: the soak client stalled over 1 s at "
                + ", ".join(f"t={c['t']:.0f} s ({c['gap']:.1f} s)" for c in big[:8])
            )
    return "\n".join(out) + "\n"


KIND_COLORS = {
    "bootstrap_freeze": "tab:orange",
    "scheduler_freeze": "tab:purple",
    "kill_restart": "tab:red",
    "slow": "tab:olive",
}


def plot(results: List[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = len(results)
    fig, axes = plt.subplots(
        4,
        n,
        figsize=(7.5 * n, 12.5),
        squeeze=False,
        sharex="col",
        sharey="row",
        gridspec_kw={"height_ratios": [3, 1.3, 1.3, 1.3]},
    )
    colors = {"prefill1": "tab:blue", "prefill2": "tab:green", None: "tab:gray"}
    for col, r in enumerate(results):
        ax, hx, rx, px = (axes[i][col] for i in range(4))
        windows = fault_windows(r)
        for w in windows:
            # prefill1's faults in the lower half of the band, prefill2's upper.
            lo, hi = (0.0, 0.5) if w["target"] == "prefill1" else (0.5, 1.0)
            for a in (ax, hx, rx, px):
                a.axvspan(
                    w["t_start"], w["end"], ymin=lo, ymax=hi,
                    color=KIND_COLORS[w["kind"]], alpha=0.18, lw=0,
                )  # fmt: skip
        for a in (ax, hx, rx, px):
            a.grid(True, alpha=0.3)
        plot_held(px, r, colors)
        t_cut = r["t_cut"]
        for pf in ("prefill1", "prefill2", None):
            rows = [x for x in r["requests"] if served_by(x) == pf]
            ok = [x for x in rows if x["outcome"] == "ok"]
            bad = [x for x in rows if x["outcome"] not in ("ok", "open")]
            opn = [x for x in rows if x["outcome"] == "open"]
            name = pf or "no prefill seen"
            if ok:
                ax.scatter([x["t_send"] for x in ok], [x["latency"] for x in ok],
                           s=10, color=colors[pf], label=f"{name}: ok")  # fmt: skip
            if bad:
                ax.scatter([x["t_send"] for x in bad], [x["latency"] for x in bad],
                           s=30, marker="x", color=colors[pf],
                           label=f"{name}: error")  # fmt: skip
            if opn:
                ax.scatter([x["t_send"] for x in opn],
                           [t_cut - x["t_send"] for x in opn], s=30, marker="^",
                           color=colors[pf], label=f"{name}: open at the end")  # fmt: skip
        ax.set_yscale("log")
        ax.set_ylabel("latency (s), by send time;\ncolour: prefill that served")
        ax.set_title(f"{label(r)}, {r['rate']:g} req/s through the router")
        handles, labels_ = ax.get_legend_handles_labels()
        handles += [Patch(color=c, alpha=0.3) for c in KIND_COLORS.values()]
        labels_ += [f"fault: {k}" for k in KIND_COLORS]
        ax.legend(handles, labels_, loc="upper right", fontsize=7, framealpha=0.85)
        h = r["decode_health"]
        hx.plot([x["t"] for x in h], [x["latency"] for x in h], ".", ms=3)
        hx.axhline(HEALTH_GOAL_S, color="tab:red", lw=0.8, ls="--")
        hx.set_yscale("log")
        hx.set_ylabel("decode GET /health (s)")
        series = r["resources"]["series"]
        ts = [x["t"] for x in series]
        rx.plot(ts, [x["threads"] for x in series], label="threads")
        rx.plot(ts, [x["fds"] for x in series], label="open fds")
        rx.set_ylabel("decode threads / fds")
        r2 = rx.twinx()
        r2.plot(ts, [x["rss"] / 2**30 for x in series], color="tab:brown", label="RSS")
        r2.set_ylabel("RSS (GiB)")
        lines = rx.get_legend_handles_labels()
        l2 = r2.get_legend_handles_labels()
        rx.legend(lines[0] + l2[0], lines[1] + l2[1], loc="lower right", fontsize=7)
        px.set_xlabel(
            "time since the load started (s); shaded: faults, prefill1 lower half, "
            "prefill2 upper half"
        )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_held(ax, r: dict, colors: dict) -> None:
    """What each prefill holds of the decode's KV, scraped from the decode's
    /metrics during the run (patch 12; stock has none)."""
    lines: dict = {}
    for x in r.get("peer_metrics") or []:
        if x["name"] == "sglang:pd_prefill_held_tokens":
            peer = (r.get("peer_names") or {}).get(x["labels"].get("prefill"))
            lines.setdefault(peer, []).append((x["t"], x["value"]))
    for peer, points in sorted(lines.items(), key=lambda kv: str(kv[0])):
        ax.plot(*zip(*with_gaps(points)), ".-", ms=2, lw=1, color=colors.get(peer, "tab:gray"),
                label=peer or "other")  # fmt: skip
    if lines:
        ax.legend(loc="upper right", fontsize=7, framealpha=0.85)
    else:
        ax.text(0.5, 0.5, "no per-peer series (stock 0.5.23)", ha="center",
                va="center", transform=ax.transAxes)  # fmt: skip
    ax.set_ylabel("decode /metrics:\nKV tokens held, per prefill")


def summarize_text(r: dict) -> str:
    s = summarize(r)
    return "\n".join(
        f"  {'met' if ok else 'NOT MET'}: {name}: {fig}"
        for name, fig, ok in goals(r, s)
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    results = [load(p) for p in args.results]
    args.out.mkdir(parents=True, exist_ok=True)
    md = "# PD chaos soak: " + " vs ".join(map(label, results)) + "\n\n"
    md += tables(results)
    md += "\n![soak](soak.png)\n"
    (args.out / "report.md").write_text(md)
    plot(results, args.out / "soak.png")
    print(md)
    print(f"wrote {args.out / 'report.md'} and {args.out / 'soak.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
