"""Merge ``tools/demo_pd.py`` results into a markdown report and a PNG plot.

    python tools/demo_report.py OUT/stock OUT/patched --out OUT

Each positional argument is a ``result.json`` or a directory holding one. Writes
``report.md`` and ``latency.png`` into ``--out`` and prints the markdown. The
report starts with each run's rate and how it was chosen (the calibration's
measured capacity, or ``--rate``) and the CPU that other processes on the
machine used meanwhile.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from pathlib import Path
from typing import Dict, List, Optional

PHASES = ("before", "during", "after")


def load(path: Path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / "result.json"
    return json.loads(path.read_text())


def phase_of(t: float, window) -> str:
    start, end = window
    if t < start:
        return "before"
    if end is None or t < end:
        return "during"
    return "after"


def quantile(values: List[float], q: float) -> Optional[float]:
    if not values:
        return None
    values = sorted(values)
    pos = q * (len(values) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def _fmt(x: Optional[float], digits=2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def server(r: dict) -> Optional[str]:
    """The server of the frozen kind the router picked for a request (older
    results name only the prefill)."""
    return r.get("server", r.get("prefill"))


def healthy_of(result: dict) -> str:
    return result.get("healthy") or result.get("healthy_prefill", "prefill1")


def kind_of(result: dict) -> str:
    """What was frozen: a prefill, or (--fault decode) a decode."""
    return result["frozen"].get("kind", "prefill")


def health_of(result: dict) -> List[dict]:
    """The /health polls: the decode's, or with a frozen decode the prefill's."""
    return result.get("health", result.get("decode_health"))


def health_server(result: dict) -> str:
    return result.get("health_of", "decode")


def summarize(result: dict) -> dict:
    window = result["freeze_window"]
    healthy = healthy_of(result)
    frozen = result["frozen"]["server"]
    s: Dict[str, dict] = {"healthy": {}, "frozen": {}}
    for ph in PHASES:
        rows = [
            r
            for r in result["requests"]
            if server(r) == healthy and phase_of(r["t_send"], window) == ph
        ]
        ok = [r["latency"] for r in rows if r["outcome"] == "ok"]
        s["healthy"][ph] = {
            "n": len(rows),
            "not_ok": len(rows) - len(ok),
            "p50": quantile(ok, 0.5),
            "p90": quantile(ok, 0.9),
            "max": max(ok) if ok else None,
        }
    # Requests routed to the frozen prefill while it was frozen, plus the ones
    # it had in flight when it was stopped.
    hit = [
        r
        for r in result["requests"]
        if server(r) == frozen
        and r["t_send"] < (window[1] if window[1] is not None else math.inf)
        and (r["t_end"] is None or r["t_end"] > window[0])
    ]
    errors = Counter(r.get("error") for r in hit if r["outcome"] != "ok")
    lat = [r["latency"] for r in hit if r["latency"] is not None]
    # The decode server's own verdict on the request as routed to prefill2
    # (the first one it logged; a router retry is a new request there).
    verdicts = [r["decode"][0] if r.get("decode") else None for r in hit]
    ended = [v for v in verdicts if v is not None]
    d_ends = [v["t_end"] - window[0] for v in ended]
    d_errors = Counter(_generic(v["error"]) for v in ended if v["outcome"] != "ok")
    s["frozen"] = {
        "n": len(hit),
        "outcomes": dict(Counter(r["outcome"] for r in hit)),
        "statuses": dict(Counter(str(r.get("status")) for r in hit)),
        "latency_min": min(lat, default=None),
        "latency_max": max(lat, default=None),
        "errors": errors.most_common(),
        "router_retries": sum(1 for r in hit if r.get("router_retries")),
        "decode_outcomes": dict(Counter(v["outcome"] for v in ended)),
        "decode_open": len(verdicts) - len(ended),
        "decode_end_min": min(d_ends, default=None),
        "decode_end_max": max(d_ends, default=None),
        "decode_errors": d_errors.most_common(),
    }
    s["unattributed"] = sum(1 for r in result["requests"] if server(r) is None)
    polls = [h for h in health_of(result) if phase_of(h["t"], window) == "during"]
    lat = [h["latency"] for h in polls]
    # Older results have no client stalls recorded: treat them as none.
    stalls = result.get("client_stalls")
    own = [client_stall_in(h, stalls or []) for h in polls]
    worst = max(range(len(polls)), key=lambda i: lat[i]) if polls else None
    during_stalls = [
        c["gap"] for c in stalls or [] if phase_of(c["t"], window) == "during"
    ]
    s["health"] = {
        "n": len(polls),
        "p50": quantile(lat, 0.5),
        "max": max(lat) if lat else None,
        "over_1s": sum(1 for x in lat if x > 1.0),
        "failed": sum(1 for h in polls if h.get("status") != 200),
        "recorded_client_stalls": stalls is not None,
        "client_stall_in_max": own[worst] if worst is not None else None,
        "max_less_client_stall": max((x - o for x, o in zip(lat, own)), default=None),
        "client_stalls": len(during_stalls),
        "client_stall_max": max(during_stalls, default=None),
    }
    all_lat = [h["latency"] for h in health_of(result)]
    s["health_all_max"] = max(all_lat) if all_lat else None
    return s


def stalled_within(start: float, end: float, stalls: List[dict]) -> float:
    """Seconds of [start, end] during which the demo client itself was stalled
    (tools/demo_pd.py client_ticker)."""
    return sum(
        max(0.0, min(end, c["t"] + c["gap"]) - max(start, c["t"])) for c in stalls
    )


def client_stall_in(poll: dict, stalls: List[dict]) -> float:
    """Seconds of a /health poll that were the client's stall, not the decode
    server's time."""
    return stalled_within(poll["t"], poll["t"] + poll["latency"], stalls)


def _generic(msg: Optional[str]) -> str:
    """An error text with the per-request ids cut out, for counting."""
    import re

    msg = msg or ""
    msg = re.sub(r"rid='[^']*'", "rid=...", msg)
    msg = re.sub(r"bootstrap_room=\d+", "bootstrap_room=...", msg)
    return msg


def label(result: dict) -> str:
    router = result.get("router", {})
    settings = ", router defaults" if router.get("defaults") else ""
    policy = result.get("allocation_policy", "early")
    if policy != "early":
        settings += f", {policy}"
    return f"{result['variant']['label']} ({result['backend']}{settings})"


def load_table(results: List[dict]) -> List[str]:
    """The rate each run sent, how it was chosen (tools/demo_pd.py calibrates
    it unless it was given with --rate), and how busy the machine was."""
    out = [
        "Load: requests per second sent through the router and how the rate was "
        "chosen (calibration: clients back to back through the router, both "
        "prefills healthy, before the run); CPU cores used by processes outside "
        "the demo on this machine, during the calibration and before the freeze\n",
        "| variant | rate (req/s) | calibration: served (req/s) | calibration "
        "latency p50 / p90 (s) | other processes' CPU (cores) | how the rate was "
        "chosen |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        choice = r.get("rate_choice") or {"why": "fixed (before calibration existed)"}
        c = r.get("calibration")
        served = lat = "-"
        if c:
            served = (
                f"{c['capacity_rps']:.2f} ({c['counted']} in "
                f"{c['window'][1] - c['window'][0]:.0f} s, {c['clients']} clients)"
            )
            if len(c.get("attempts", [])) > 1:
                served += "; attempts, req/s (client stalled s): " + ", ".join(
                    f"{a['capacity_rps']:.2f} ({a['client_stalled_s']:.1f})"
                    for a in c["attempts"]
                )
            lat = f"{_fmt(c['latency_p50'])} / {_fmt(c['latency_p90'])}"
        other = [
            (c or {}).get("cpu"),
            (r.get("cpu_cores") or {}).get("before"),
        ]
        other = " / ".join(_fmt(x and x["other_cores"]) for x in other)
        out.append(
            f"| {label(r)} | {r['rate']:g} | {served} | {lat} | {other} "
            f"| {choice['why']} |"
        )
    if len({r["rate"] for r in results}) > 1:
        out.append("")
        out.append(
            "The runs sent different rates (each chose its own; `dev.py demo` "
            "gives the patched run the stock run's rate, `--rate R` runs both at R)."
        )
    out.append("")
    return out


# What the demo is run to show (README, issues 13, 14 and 16).
HEALTH_MAX_S = 2.5  # decode /health during the freeze (a stall was ~8 s)
P90_RATIO_MAX = 1.5  # healthy p90 during the freeze / before it
P50_BEFORE_MAX_S = 2.0  # a healthy baseline before the freeze
ANSWERED_AFTER_RESUME_S = 15.0  # every request to the frozen prefill answered


def goals(result: dict, s: dict) -> List[tuple]:
    """(goal, value, met) of one run."""
    window = result["freeze_window"]
    before, during = s["healthy"]["before"], s["healthy"]["during"]
    ratio = (
        during["p90"] / before["p90"]
        if during["p90"] is not None and before["p90"]
        else None
    )
    open_at_end = sum(1 for r in result["requests"] if r["outcome"] == "open")
    # The other prefill is healthy throughout: it could serve every request.
    failed = Counter(
        f"{r['outcome']} {r.get('status') or ''}".strip()
        for r in result["requests"]
        if r["outcome"] not in ("ok", "open")
    )
    frozen = [
        r
        for r in result["requests"]
        if server(r) == result["frozen"]["server"] and r["t_send"] < window[1]
    ]
    due = window[1] + ANSWERED_AFTER_RESUME_S
    late = sum(1 for r in frozen if r["t_end"] is None or r["t_end"] > due)
    health = s["health"]["max"]
    kind = kind_of(result)
    return [
        (
            f"healthy p50 before the freeze < {P50_BEFORE_MAX_S:g} s",
            _fmt(before["p50"]),
            before["p50"] is not None and before["p50"] < P50_BEFORE_MAX_S,
        ),
        (
            f"{health_server(result)} /health max during the freeze < "
            f"{HEALTH_MAX_S:g} s",
            _fmt(health, 3) + _stall_note(s["health"]),
            health is not None and health < HEALTH_MAX_S,
        ),
        (
            f"healthy p90 during / before the freeze <= {P90_RATIO_MAX:g}",
            _fmt(ratio),
            ratio is not None and ratio <= P90_RATIO_MAX,
        ),
        (
            f"requests to the frozen {kind} without an answer "
            f"{ANSWERED_AFTER_RESUME_S:g} s after the resume",
            f"{late} of {len(frozen)}",
            late == 0,
        ),
        (
            f"no request fails while a {kind} could serve it (after the "
            "router's retries)",
            f"{sum(failed.values())} of {len(result['requests'])}"
            + (
                " (" + ", ".join(f"{k}: {v}" for k, v in failed.most_common()) + ")"
                if failed
                else ""
            ),
            not failed,
        ),
        (
            "client requests still open when the demo stopped",
            str(open_at_end),
            open_at_end == 0,
        ),
    ]


def _stall_note(h: dict) -> str:
    own = h.get("client_stall_in_max")
    if not own or own < 0.05:
        return ""
    return f" ({own:.2f} s of it the demo client's own stall)"


def goals_table(results: List[dict], sums: List[dict]) -> List[str]:
    rows = {label(r): goals(r, s) for r, s in zip(results, sums)}
    names = [g for g, _, _ in next(iter(rows.values()))]
    out = [
        "Goals (met / not met, per variant)\n",
        "| goal | " + " | ".join(rows) + " |",
        "|---|" + "---|" * len(rows),
    ]
    for i, name in enumerate(names):
        cells = []
        for run in rows.values():
            _, value, met = run[i]
            cells.append(
                value + ("" if met is None else (" met" if met else " **not met**"))
            )
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    out.append("")
    return out


def tables(results: List[dict]) -> str:
    sums = [summarize(r) for r in results]
    out = goals_table(results, sums) + load_table(results)
    kind, healthy = kind_of(results[0]), healthy_of(results[0])
    frozen, polled = results[0]["frozen"]["server"], health_server(results[0])
    out.append(
        f"Healthy {kind} ({healthy}): latency of successful requests, seconds, "
        "by send time (p50 / p90 / max, n)\n"
    )
    out.append("| variant | before freeze | during freeze | after resume |")
    out.append("|---|---|---|---|")
    for r, s in zip(results, sums):
        cells = []
        for ph in PHASES:
            h = s["healthy"][ph]
            cell = (
                f"{_fmt(h['p50'])} / {_fmt(h['p90'])} / {_fmt(h['max'])} "
                f"(n={h['n']})"
            )
            if h["not_ok"]:
                cell += f", {h['not_ok']} not ok"
            cells.append(cell)
        out.append(f"| {label(r)} | " + " | ".join(cells) + " |")
    out.append("")
    out.append(
        f"Requests routed to the frozen {kind} ({frozen}) while it was frozen "
        "(or in flight when it was stopped): how the DECODE SERVER ended them "
        "(from its request log)\n"
    )
    out.append(
        "| variant | n | decode: admitted / aborted / still open "
        "| ended, s after freeze start (min-max) | decode error text |"
    )
    out.append("|---|---|---|---|---|")
    for r, s in zip(results, sums):
        f = s["frozen"]
        d = f["decode_outcomes"]
        errs = "<br>".join(f"{n}x `{e[:220]}`" for e, n in f["decode_errors"]) or "none"
        out.append(
            f"| {label(r)} | {f['n']} | {d.get('ok', 0)} / {d.get('aborted', 0)}"
            f" / {f['decode_open']} | {_fmt(f['decode_end_min'], 1)} - "
            f"{_fmt(f['decode_end_max'], 1)} | {errs} |"
        )
    out.append("")
    out.append(
        "The same requests as the client saw them through the router "
        "(the router answers only when both its prefill and decode legs have)\n"
    )
    out.append(
        "| variant | client outcome | HTTP status | latency min-max (s) "
        "| retried by router | client error text |"
    )
    out.append("|---|---|---|---|---|---|")
    for r, s in zip(results, sums):
        f = s["frozen"]
        errs = (
            "<br>".join(f"{n}x `{_generic(e)[:200]}`" for e, n in f["errors"]) or "none"
        )
        out.append(
            f"| {label(r)} | "
            + ", ".join(f"{k}: {v}" for k, v in sorted(f["outcomes"].items()))
            + " | "
            + ", ".join(f"{k}: {v}" for k, v in sorted(f["statuses"].items()))
            + f" | {_fmt(f['latency_min'], 1)} - {_fmt(f['latency_max'], 1)}"
            + f" | {f['router_retries']} | {errs} |"
        )
    out.append("")
    out.append(
        f"{polled} server `GET /health` latency while {frozen} was frozen (the "
        "handler runs a 1-token probe and checks every 1 s, so ~1.0 s is healthy)\n"
    )
    out.append(
        "| variant | polls | p50 (s) | max (s) | > 1 s | failed/timed out "
        "| demo client stalls > 0.25 s (longest) | max less the client's stall (s) |"
    )
    out.append("|---|---|---|---|---|---|---|---|")
    for r, s in zip(results, sums):
        h = s["health"]
        if h["recorded_client_stalls"]:
            stalls = f"{h['client_stalls']} ({_fmt(h['client_stall_max'], 2)} s)"
            less = _fmt(h["max_less_client_stall"], 3)
        else:
            stalls = less = "not recorded"
        out.append(
            f"| {label(r)} | {h['n']} | {_fmt(h['p50'], 3)} | {_fmt(h['max'], 3)} "
            f"| {h['over_1s']} | {h['failed']} | {stalls} | {less} |"
        )
    out.append("")
    out.append(
        "A demo client stall is a gap in which the demo process itself did not "
        "run (its 50 ms ticker woke more than 0.25 s late): a /health poll that "
        "spans one measures this machine as much as the decode server. The goal "
        "above is judged on the raw figure.\n"
    )
    for r in results:
        long = [c for c in r.get("client_stalls") or [] if c["gap"] > 1.0]
        if long:
            out.append(
                f"- {label(r)}: the demo client stalled over 1 s at "
                + ", ".join(f"t={c['t']:.1f} s ({c['gap']:.1f} s)" for c in long)
                + "; every figure that spans these moments includes them."
            )
    out.append("")
    out.append(
        "| variant | servers healthy (s) | router ready (s) | run (s) "
        "| peak memory, all processes: PSS (RSS sum) GiB | load avg at end |"
    )
    out.append("|---|---|---|---|---|---|")
    for r in results:
        rss = r["memory"]["peak_total_rss_bytes"] / 2**30
        pss = r["memory"].get("peak_total_pss_bytes", 0) / 2**30
        load = r.get("machine", {}).get("loadavg_at_end") or [None]
        out.append(
            f"| {label(r)} | {r['startup_s']['servers_healthy']:.0f} | "
            f"{r['startup_s']['router_registered']:.0f} | {r['run_s']:.0f} | "
            f"{pss:.2f} ({rss:.2f}) | {_fmt(load[0], 1)} |"
        )
    notes = []
    for r, s in zip(results, sums):
        if s["unattributed"]:
            notes.append(
                f"{label(r)}: {s['unattributed']} request(s) never reached a "
                f"decode server's request log, so their {kind} is unknown."
            )
        if r["variant"]["label"] == "stock":
            notes.append(
                f"{label(r)}: stock = pristine sglang 0.5.23 disaggregation files "
                "plus ONLY the CPU-enablement hunks "
                "(`sglang_pd_patch/cpu_enable.patch`); pristine 0.5.23 crashes on "
                "a CPU-only machine."
            )
    if notes:
        out.append("")
        out += [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"


def summarize_text(result: dict) -> str:
    window = result["freeze_window"]
    head = (
        f"{label(result)}: {result['frozen']['server']} frozen "
        f"t={window[0]:.1f}-{window[1]:.1f} s, "
        f"{len(result['requests'])} requests at {result['rate']:g}/s"
    )
    choice = result.get("rate_choice")
    if choice:
        head += f" ({choice['why']})"
    return head + "\n\n" + tables([result])


def plot(results: List[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    peers = any(r.get("peer_metrics") for r in results)
    fig, axes = plt.subplots(
        3 if peers else 2,
        n,
        figsize=(6.5 * n, 10 if peers else 7.5),
        squeeze=False,
        sharey="row",
        sharex="col",
        gridspec_kw={"height_ratios": [3, 1.3, 1.6] if peers else [3, 1.3]},
    )
    for col, r in enumerate(results):
        healthy, frozen, kind = healthy_of(r), r["frozen"]["server"], kind_of(r)
        colors = {healthy: "tab:blue", frozen: "tab:red", None: "tab:gray"}
        names = {
            healthy: f"healthy {healthy}",
            frozen: f"frozen {frozen}",
            None: f"{kind} unknown",
        }
        w = r["freeze_window"]
        ax, hx = axes[0][col], axes[1][col]
        for a in (ax, hx):
            a.axvspan(w[0], w[1], color="tab:orange", alpha=0.15, lw=0)
            a.grid(True, which="both", alpha=0.3)
        t_cut = r.get("t_cut")
        for pf in (healthy, frozen, None):
            rows = [x for x in r["requests"] if server(x) == pf]
            groups = {
                "ok": [x for x in rows if x["outcome"] == "ok"],
                "retried": [],
                "failed": [
                    x
                    for x in rows
                    if x["outcome"] not in ("ok", "open") and x["latency"]
                ],
                "open": [x for x in rows if x["outcome"] == "open"],
            }
            groups["retried"] = [x for x in groups["ok"] if x.get("router_retries")]
            groups["ok"] = [x for x in groups["ok"] if not x.get("router_retries")]
            style = {
                "ok": dict(s=14, marker="o"),
                "retried": dict(s=30, marker="o", facecolors="none"),
                "failed": dict(s=40, marker="x"),
                "open": dict(s=40, marker="^"),
            }
            what = {
                "ok": "",
                "retried": ", retried by the router",
                "failed": ", failed",
                "open": ", no answer when the demo stopped",
            }
            for key, xs in groups.items():
                if not xs:
                    continue
                ys = [
                    x["latency"] if x["latency"] is not None else t_cut - x["t_send"]
                    for x in xs
                ]
                kw = dict(style[key])
                if key == "retried":
                    kw["edgecolors"] = colors[pf]
                else:
                    kw["color"] = colors[pf]
                ax.scatter(
                    [x["t_send"] for x in xs], ys, label=names[pf] + what[key], **kw
                )
        ax.set_yscale("log")
        ax.set_title(
            f"{label(r)}, {r['rate']:g} req/s: request latency through the router"
        )
        ax.set_ylabel("latency (s), by send time")
        ax.legend(loc="upper right", fontsize=7, framealpha=0.85)
        h = health_of(r)
        hx.plot([x["t"] for x in h], [x["latency"] for x in h], ".", ms=3)
        hx.set_yscale("log")
        hx.set_ylabel(f"{health_server(r)} GET /health (s)")
        hx.set_xlabel(f"time since load start (s); shaded: {frozen} SIGSTOPped")
        if peers:
            plot_peers(axes[2][col], r, colors, w)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def with_gaps(points, gap_s: float = 3.0) -> list:
    """``points`` with a NaN where a series was absent for more than ``gap_s``
    (scraped every second): a peer gone and back is not drawn as a line."""
    out = []
    for t, v in sorted(points):
        if out and t - out[-1][0] > gap_s:
            out.append((t, float("nan")))
        out.append((t, v))
    return out


def plot_peers(ax, r: dict, colors: dict, window) -> None:
    """The sick peer's series scraped from /metrics during the run (patches 12, 13):
    what each prefill holds of the decode's KV, or with a sick decode, the
    age of the prefill's oldest chunk for each decode."""
    ax.axvspan(window[0], window[1], color="tab:orange", alpha=0.15, lw=0)
    ax.grid(True, alpha=0.3)
    decode_view = r["frozen"].get("what") != "decode"
    name, peer_label = (
        ("sglang:pd_prefill_held_tokens", "prefill")
        if decode_view
        else ("sglang:pd_decode_oldest_chunk_age_seconds", "decode")
    )
    lines: dict = {}
    for x in r.get("peer_metrics") or []:
        if x["name"] == name:
            peer = r.get("peer_names", {}).get(x["labels"][peer_label])
            lines.setdefault(peer, []).append((x["t"], x["value"]))
    for peer, points in sorted(lines.items(), key=lambda kv: str(kv[0])):
        points = with_gaps(points)
        ax.plot(
            *zip(*points),
            ".-",
            ms=2,
            lw=1,
            color=colors.get(peer, "tab:gray"),
            label=f"{peer or 'unknown'}",
        )
    if not lines:
        ax.text(0.5, 0.5, "no per-peer series (stock 0.5.23)", ha="center",
                va="center", transform=ax.transAxes)  # fmt: skip
    else:
        ax.legend(loc="upper right", fontsize=7, framealpha=0.85)
    server = "decode" if decode_view else "prefill1"
    what = "KV tokens held, per prefill" if decode_view else "oldest chunk age (s)"
    ax.set_ylabel(f"{server} /metrics:\n{what}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    results = [load(p) for p in args.results]
    args.out.mkdir(parents=True, exist_ok=True)
    what = {r["frozen"].get("what", "bootstrap") for r in results}
    frozen = (
        "one prefill's scheduler frozen (its HTTP and bootstrap servers answer)"
        if what == {"scheduler"}
        else (
            "one prefill, two decodes, one decode frozen"
            if what == {"decode"}
            else "one prefill frozen"
        )
    )
    md = f"# PD demo: {frozen}, " + " vs ".join(map(label, results))
    md += "\n\n" + tables(results)
    md += "\n![latency](latency.png)\n"
    (args.out / "report.md").write_text(md)
    plot(results, args.out / "latency.png")
    print(md)
    print(f"wrote {args.out / 'report.md'} and {args.out / 'latency.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
