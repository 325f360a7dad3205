"""Reliability report of the fault matrix: stock 0.5.23 vs the patch.

    python3 tools/fault_report.py --stock stock.json --patched patched.json \\
        --out report.md

Inputs are written by test/pd_loopback/fault_matrix.py (``python3 dev.py
faults`` runs both and this). One row per fault run, the patched figure
first, then stock's; a second table lists, per run, what broke the promise
(a scheduling call >= 0.5 s, a request still pending, more than one fetch in
flight per kind, an unclear or missing error, a crash, stale info, ...).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

CALL_BOUND_S = 0.5
CLEAR = {
    "A": "Could not fetch prefill parallel info from <addr> after N attempts. "
    "Check that the prefill server is up and that its bootstrap server is "
    "reachable from this decode server; the decode log has the error of each "
    "attempt.",
    "B": "Could not fetch bootstrap info from <addr> for: prefill_dp_rank: 0 "
    "prefill_cp_rank: 0 target_tp_rank: 0 and target_pp_rank 0",
    "C": "Lost connection with prefill instance (bootstrap_addr: <addr>)",
    "D": "Prefill <addr> (dp rank 0) has served none of the requests this decode "
    "sent it since it last served one, and they hold its share of this decode's KV "
    "(N tokens): this request waited N s for it "
    "(SGLANG_DISAGGREGATION_WAITING_TIMEOUT) and ends so that it can be retried on "
    "another prefill.",
    "E": "Could not fetch the bootstrap info of prefill <addr> (prefill_dp_rank 0); "
    "the decode log has the error of each lookup.",
    "F": "Request <n> timed out after N s in KVPoll.WaitingForInput for prefill "
    "<addr>",
    "G": "The bootstrap info lookups to prefill <addr> have not ended N s after "
    "they started, ...",
    "H": "Prefill <addr> has not registered bootstrap_room <n> in the N s since "
    "the decode first asked for its dp rank ...",
}
# A message is clear when it says what failed and names the prefill; each is
# recognised by a part no other message has.
PREFIXES = {
    "A": "Could not fetch prefill parallel info",
    "B": "Could not fetch bootstrap info",
    "C": "Lost connection with prefill instance",
    "D": "has served none of the requests this decode sent it",
    "E": "Could not fetch the bootstrap info of prefill",
    "F": "in KVPoll.WaitingForInput for prefill",
    "G": "The bootstrap info lookups to prefill",
    "H": "has not registered bootstrap_room",
}
KINDS = ("info", "route", "dp_ranks", "health")


def code(message: str, others: dict) -> str:
    for key, part in PREFIXES.items():
        if part in message:
            return key
    if message not in others:
        others[message] = f"X{len(others) + 1}"
    return others[message]


def key(run: dict) -> tuple:
    return (run["title"], run["phase"])


def violations(run: dict) -> list:
    """What in this run breaks the promise; empty when it holds."""
    if "error" in run:
        return [f"run did not complete: {run['error']}"]
    out = []
    mismatch = run["fault"].startswith("mismatch")
    if run.get("longest_call_s") is not None and run["longest_call_s"] >= CALL_BOUND_S:
        out.append(f"scheduling call stalled {run['longest_call_s']:.2f} s")
    if run.get("scheduler_http_to_faulty"):
        out.append(
            f"{run['scheduler_http_to_faulty']} HTTP request(s) from the scheduler thread"
        )
    if run.get("fatal") and not mismatch:
        out.append(f"decode scheduler raised: {run['fatal'][:120]}")
    if mismatch and not (run.get("fatal") or "").startswith("RuntimeError"):
        out.append("config mismatch not fatal")
    if run.get("pending_end") and not mismatch:
        out.append(f"{run['pending_end']} request(s) still pending")
    if not mismatch and run["healthy"]["failed"]:
        out.append(f"{run['healthy']['failed']} healthy-prefill request(s) failed")
    busiest = {k: n for k, n in run["max_in_flight"].items() if n > 1}
    if busiest:
        out.append(f"fetches in flight at once: {busiest}")
    unclear = [m for m in run["failures"] if not any(p in m for p in PREFIXES.values())]
    if unclear:
        out.append("unclear error: " + "; ".join(f"{m[:80]!r}" for m in unclear))
    extra = run.get("extra", {})
    if "healthy_total" in extra:
        served, total = extra["healthy_served_while_stuck_held"], extra["healthy_total"]
        if served < total:
            out.append(
                f"{total - served} of {total} healthy request(s) not served while "
                "the stuck prefill's requests were waiting"
            )
    left = extra.get("non_daemon_threads_after_teardown")
    if left:
        out.append(f"non-daemon threads left after teardown: {left}")
    if run["new_non_daemon_threads"]:
        out.append(f"non-daemon threads left: {run['new_non_daemon_threads']}")
    extra = run.get("extra", {})
    if extra.get("stale_republished"):
        out.append("stale info republished after the eviction")
    if extra.get("served_after_fix") is False:
        out.append("not served once the answers were good again")
    if extra.get("served_after_restart") is False:
        out.append("not served after the restart")
    if run["fault"] == "teardown":
        if extra.get("teardown", "").startswith("teardown() raised"):
            out.append(extra["teardown"][:120])
        asked = extra.get("asked_to_done_s")
        if asked is not None and asked >= CALL_BOUND_S:
            out.append(f"teardown came {asked:.1f} s after it was due")
    return out


def fmt_calls(run):
    if run is None or "error" in run:
        return "-"
    s = run.get("longest_call_s")
    if s is None:
        return "-"
    return f"{s * 1000:.1f} ms" if s < 1 else f"**{s:.2f} s**"


def fmt_counts(run):
    if run is None or "error" in run:
        return "-"
    return "{admitted} · {transferred} · {failed} · {pending_end}".format(**run)


def fmt_failures(run, others):
    if run is None or "error" in run:
        return "-"
    parts = [f"{n}×{code(m, others)}" for m, n in sorted(run["failures"].items())]
    if run.get("fatal"):
        parts.append("raised " + run["fatal"].split(":")[0])
    return ", ".join(parts) or "none"


def fmt_inflight(run):
    if run is None or "error" in run:
        return "-"
    return "/".join(str(run["max_in_flight"].get(k, 0)) for k in KINDS)


def fmt_threads(run):
    if run is None or "error" in run:
        return "-"
    return f"{run['threads_start']}→{run['threads_end']}"


def fmt_notes(run):
    if run is None or "error" in run:
        return (run or {}).get("error", "-")[:80]
    extra = run.get("extra", {})
    notes = []
    if "stale_republished" in extra:
        notes.append(
            f"stale republish: {'yes' if extra['stale_republished'] else 'no'}"
        )
    if "served_after_fix" in extra:
        notes.append(
            f"served once fixed: {'yes' if extra['served_after_fix'] else 'no'}"
        )
    if "served_after_restart" in extra:
        notes.append(
            f"served after restart: {'yes' if extra['served_after_restart'] else 'no'}"
        )
    if run["fault"] == "teardown" and extra.get("teardown", "").startswith(
        "teardown() raised"
    ):
        notes.append(extra["teardown"][:80])
    elif run["fault"] == "teardown" and "teardown_s" in extra:
        notes.append(
            f"teardown {extra['teardown_s']:.2f} s, {extra['asked_to_done_s']:.2f} s "
            f"after due, {extra['fetches_in_flight_at_teardown']} fetch(es) in "
            f"flight; non-daemon threads left "
            f"{len(extra['non_daemon_threads_after_teardown'])}; exit "
            f"{extra.get('exit_after_teardown_s')} s after teardown"
        )
    if "toggles" in extra:
        notes.append(f"{extra['toggles']} toggles")
    if "healthy_total" in extra:
        notes.append(
            f"healthy served meanwhile: {extra['healthy_served_while_stuck_held']} "
            f"of {extra['healthy_total']}; its requests that got KV: "
            f"{extra['stuck_held_most']}"
        )
    if "served_after_resume" in extra:
        notes.append(
            f"its requests served after the resume: {extra['served_after_resume']}"
        )
    return "; ".join(notes)


# Rows 12-14: a healthy decode's transfer takes milliseconds on loopback; one
# behind a stuck decode 30-60 s. A sick decode's rooms end within their bound
# plus the prefill's hold (1 s) and slack.
MIRROR_HEALTHY_BOUND_S = 1.0
MIRROR_SLACK_S = 4.0


def mirror_violations(run: Optional[dict]) -> list:
    if run is None:
        return ["not run"]
    if "error" in run:
        return [run["error"]]
    out = []
    during = run["during"]
    late = [d["latency"] for d in during if d["latency"] is not None]
    if len(late) < len(during):
        out.append(
            f"{len(during) - len(late)} of the healthy decode's rooms not served"
        )
    if late and max(late) >= MIRROR_HEALTHY_BOUND_S:
        out.append(f"the healthy decode's transfer took {max(late):.1f} s")
    if run["knob"] is not None:
        for room in run["sick"]:
            ended = room["ended_after"]
            if room["pstatus"] != "Failed" or ended is None:
                out.append(f"a sick decode's room {room['pstatus'] or 'never ended'}")
            elif ended >= run["bound_s"] + MIRROR_SLACK_S:
                out.append(f"a sick decode's room ended after {ended:.0f} s")
            elif not any(
                name in (room["perror"] or "")
                for name in (run["decode"], run.get("rank", run["decode"]))
            ):
                out.append("its error does not name the decode")
    return sorted(set(out))


def fmt_mirror(run: Optional[dict]) -> str:
    if run is None or "error" in run:
        return "-"
    summary = run["summary"]
    ended = [r["ended_after"] for r in run["sick"]]
    sick = ", ".join(
        f"{r['pstatus'] or 'open'} at {'-' if e is None else f'{e:.1f} s'}"
        for r, e in zip(run["sick"], ended)
    )
    worst = summary["during_max"] or 0
    worst = f"{1e3 * worst:.0f} ms" if worst < 1 else f"{worst:.1f} s"
    return (
        f"{worst} max, {summary['during_served']} of {summary['during_sent']} "
        f"served; A's: {sick}"
    )


def render_mirror(stock: dict, patched: dict) -> list:
    s_runs = {r["fault"]: r for r in stock.get("mirror_runs", [])}
    p_runs = {r["fault"]: r for r in patched.get("mirror_runs", [])}
    if not p_runs and not s_runs:
        return []
    lines = [
        "",
        "## Sick decodes, on the prefill (rows 12-14)",
        "",
        "One real prefill process and four decode processes (test/pd_loopback/"
        "mirror.py). Decode B gets a room every 0.5 s for "
        f"6 s while sick decode A has two rooms pending; every decode's rooms on "
        "the one 0.5.23 queue (`SGLANG_DISAGGREGATION_QUEUE_SIZE=1`); patched "
        "bounds shortened to 3 s (KV transfer) and 2 s (first contact). Each "
        "cell: B's transfers, and how A's rooms ended on the prefill (seconds "
        "after the fault).",
        "",
        "| fault | patched | stock 0.5.23 | breaks the promise: patched \\| stock |",
        "|---|---|---|---|",
    ]
    for name in list(p_runs) + [n for n in s_runs if n not in p_runs]:
        p, s = p_runs.get(name), s_runs.get(name)
        title = (p or s)["title"]
        pv = "; ".join(mirror_violations(p)) or "holds"
        sv = "; ".join(mirror_violations(s)) or "holds"
        lines.append(f"| {title} | {fmt_mirror(p)} | {fmt_mirror(s)} | {pv} \\| {sv} |")
    return lines


def render(stock: dict, patched: dict) -> str:
    s_runs = {key(r): r for r in stock["runs"]}
    p_runs = {key(r): r for r in patched["runs"]}
    order = [key(r) for r in patched["runs"]] + [k for k in s_runs if k not in p_runs]
    others: dict = {}
    both = lambda f, k: f"{f(p_runs.get(k))} \\| {f(s_runs.get(k))}"  # noqa: E731
    lines = [
        "# Fault matrix: stock 0.5.23 vs patched",
        "",
        f"Backend {patched['backend']}; three real prefill processes (one faulty, "
        "two healthy) and the real decode manager and pending-resolution path "
        "(test/pd_loopback). Retry budget 2 attempts 0.2 s apart; heartbeat "
        "every 2 s, eviction after 2 misses. Each cell: **patched \\| stock**.",
        "",
        "Columns: longest decode scheduling call; requests admitted · "
        "transferred · failed · pending at the end; failures by message "
        "(legend below); most HTTP requests in flight at once to the faulty "
        "bootstrap server per kind (info / route / dp_ranks / health, any "
        "thread); threads alive at start→end.",
        "",
        "| fault | phase | longest call | adm · xfer · fail · pending "
        "| failed with | max in flight | threads | notes (patched \\| stock) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for k in order:
        title, phase = k
        p, s = p_runs.get(k), s_runs.get(k)
        lines.append(
            f"| {title} | {phase} | {both(fmt_calls, k)} | {both(fmt_counts, k)} "
            f"| {fmt_failures(p, others)} \\| {fmt_failures(s, others)} "
            f"| {both(fmt_inflight, k)} | {both(fmt_threads, k)} "
            f"| {fmt_notes(p)} \\| {fmt_notes(s)} |"
        )
    lines += ["", "Failure messages:", ""]
    for c, text in CLEAR.items():
        lines.append(f"- {c}: `{text}`")
    for text, c in others.items():
        lines.append(f"- {c}: `{text}`")
    lines += [
        "",
        "## What breaks the promise, per run",
        "",
        "| fault | phase | patched | stock 0.5.23 |",
        "|---|---|---|---|",
    ]
    for k in order:
        pv = violations(p_runs[k]) if k in p_runs else ["not run"]
        sv = violations(s_runs[k]) if k in s_runs else ["not run"]
        lines.append(
            f"| {k[0]} | {k[1]} | {'; '.join(pv) or 'holds'} "
            f"| {'; '.join(sv) or 'holds'} |"
        )
    lines += render_mirror(stock, patched)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stock", required=True)
    ap.add_argument("--patched", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    try:
        with open(args.stock) as f:
            stock = json.load(f)
        with open(args.patched) as f:
            patched = json.load(f)
    except (OSError, ValueError) as e:
        print(f"fault_report: cannot read the runs: {e}", file=sys.stderr)
        return 1
    text = render(stock, patched)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
