"""Fault matrix on real PD over loopback: nothing stalls, nothing is lost.

Three real prefill processes (``prefill0`` gets the fault, ``prefill1`` and
``prefill2`` stay healthy) and the real decode manager plus
DecodePreallocQueue in this process (harness.py). Each run applies one fault,
before first contact with the faulty prefill or after its info was cached,
spreads requests over the three prefills, drives decode scheduling calls until
every request has ended (or a hard cap), and records:

- the longest decode scheduling call (``step()`` or ``add()``), the HTTP
  requests the scheduler thread itself sent to the faulty prefill and the ZMQ
  sends and connects it made;
- requests: admitted, transferred, failed (by message), pending at the end;
- the most HTTP requests in flight at once to the faulty bootstrap server,
  per kind ("info", "route", "dp_ranks", "health"), from any thread;
- threads alive at the start and the end of the run;
- fault-specific figures (stale republish, teardown and exit times, ...).

Used by test_fault_matrix.py (assertions on the patched behaviour) and by
``python3 dev.py faults`` (every fault on stock and patched, then
tools/fault_report.py). By hand, against one variant:

    PYTHONPATH=<variant dir>:<repo> python3 test/pd_loopback/fault_matrix.py \\
        --out patched.json [--backend mooncake] [--faults frozen,slow_over]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
import mirror  # noqa: E402

# The loopback cases' small retry budget (2 attempts, 0.2 s apart) and fast
# heartbeat (every 2 s, evict after 2 misses).
from loopback_cases import (  # noqa: E402
    ENSURE_RETRY_INTERVAL_S,
    HEARTBEAT_DETECT_S,
    HEARTBEAT_ENV,
    HTTP_TIMEOUT_S,
    MAX_ENSURE_RETRIES,
    FastFailCluster,
)

# No run waits longer than this for its requests to end.
RUN_CAP_S = 90.0
NUM_TOKENS = 16
BIG_BODY_BYTES = 8 << 20

FIRST, CACHED = "first contact", "info cached"


@dataclasses.dataclass
class Fault:
    name: str
    title: str
    phase: str
    body: Callable[["Run"], None]
    # --disaggregation-decode-allocation-policy of every server in the run.
    policy: str = "early"


class Run:
    """One fault run: the window of requests, cycles and threads it owns."""

    def __init__(self, matrix: "Matrix", fault: Fault):
        self.m = matrix
        self.fault = fault
        self.d = matrix.cluster.decode
        self.faulty = matrix.faulty
        self.healthy = matrix.healthy
        self.extra: Dict[str, object] = {}
        self.fatal: Optional[str] = None
        self.requests: List[harness.Tracked] = []
        # Addr the faulty requests go to (a closed port for port_closed).
        self.target = self.faulty.addr
        self.faulty_addrs = {self.faulty.addr}

    # -- driving ----------------------------------------------------------

    def request(
        self, prefill, n: int = 1, hold_s: float = 0.0, num_tokens: int = NUM_TOKENS
    ) -> List[harness.Tracked]:
        out = []
        for _ in range(n):
            target = prefill if prefill is not None else self.target
            out.append(self.m.cluster.request(target, num_tokens, hold_s=hold_s))
        self.requests.extend(out)
        return out

    def spread(self, n_faulty: int = 2, n_healthy: int = 1) -> None:
        if n_faulty:
            self.request(
                self.faulty if self.target == self.faulty.addr else None, n_faulty
            )
        for p in self.healthy:
            self.request(p, n_healthy)

    def cycles(self, until: Callable[[], bool], timeout_s: float) -> bool:
        """Scheduling calls until ``until()``; a raise from the scheduling
        call is the decode crashing (recorded, and the run stops driving)."""
        if self.fatal is not None:
            return False
        try:
            return self.d.run(until, timeout_s=timeout_s)
        except Exception as e:
            self.fatal = f"{type(e).__name__}: {e}"
            return False

    def for_s(self, seconds: float) -> None:
        self.cycles(lambda: False, seconds)

    def all_done(self) -> bool:
        return all(t.finished for t in self.requests)

    def finish(self, timeout_s: float = RUN_CAP_S) -> None:
        self.cycles(self.all_done, timeout_s)

    def settle_fetches(self, kind: Optional[str] = None) -> None:
        """Cycles until no HTTP request to the faulty prefill (of ``kind``)
        is in flight: a fetch left from the fault has returned."""
        port = self.faulty.bootstrap_port
        self.cycles(lambda: harness.HTTP.in_flight(port, kind) == 0, 15)


class Matrix:
    """A cluster of 3 prefills and the decode side, shared by every run of
    its allocation policy. A run of another policy goes to a child process:
    the decode's runtime context, the policy included, is process-wide."""

    def __init__(self, backend: str = "mooncake", policy: str = "early"):
        self.backend = backend
        self.policy = policy
        self.cluster: Optional[harness.Cluster] = None

    def __enter__(self) -> "Matrix":
        self.cluster = FastFailCluster(self.backend, 3, self.policy).__enter__()
        self.faulty = self.cluster.prefills[0]
        self.healthy = self.cluster.prefills[1:]
        return self

    def __exit__(self, *exc) -> None:
        if self.cluster is not None:
            self.cluster.close()

    # -- one run ------------------------------------------------------------

    def reset(self) -> None:
        """Every prefill up and fault-free, no request left, and the decode
        back to first contact with all of them."""
        d = self.cluster.decode
        for p in self.cluster.prefills:
            if not p.alive():
                p.restart().wait_ready()
            if p.frozen:
                p.resume()
            p.clear_fault()
        d.abort_all("left over by the previous fault run")
        # A fatal config mismatch stops a real decode server; here the next
        # run goes on with the same one.
        if getattr(d.kv_manager, "_parallel_info_fatal", None) is not None:
            d.kv_manager._parallel_info_fatal = None
        d.run(
            lambda: all(
                harness.HTTP.in_flight(p.bootstrap_port) == 0
                for p in self.cluster.prefills
            ),
            timeout_s=2 * HTTP_TIMEOUT_S + 2,
        )
        for p in self.cluster.prefills:
            d.forget_prefill(p.addr)
            d.kv_manager.heartbeat_failures.pop(p.addr, None)

    def warm(self, run: Run) -> None:
        """One transfer from the faulty prefill: its info and routes cached."""
        first = self.cluster.request(self.faulty, NUM_TOKENS)
        self.cluster.decode.run(lambda: first.finished, timeout_s=30)
        if first.state != "success":
            raise RuntimeError(f"warm-up transfer failed: {first.error}")

    def run(self, fault: Fault) -> dict:
        if fault.policy != self.policy:
            return self._run_in_child(fault)
        self.reset()
        run = Run(self, fault)
        if fault.phase == CACHED:
            self.warm(run)
        d = self.cluster.decode
        threads_start = _threads()
        harness.HTTP.reset_peaks()
        n_cycles, n_adds = len(d.cycles), len(d.adds)
        t0 = time.perf_counter()
        try:
            fault.body(run)
        finally:
            for p in self.cluster.prefills:
                if p.frozen:
                    p.resume()
        run.finish()
        t1 = time.perf_counter()
        calls = d.cycles[n_cycles:] + d.adds[n_adds:]
        threads_end = _threads()
        return summarize(run, calls, t0, t1, threads_start, threads_end)

    def _run_in_child(self, fault: Fault, timeout_s: float = 300) -> dict:
        with tempfile.TemporaryDirectory(prefix="pd_faults_") as tmp:
            out = os.path.join(tmp, "runs.json")
            cmd = [
                sys.executable,
                "-W",
                "ignore",
                os.path.abspath(__file__),
                "--backend",
                self.backend,
                "--allocation-policy",
                fault.policy,
                "--faults",
                fault.name,
                "--out",
                out,
            ]
            proc = subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
            try:
                log, _ = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                harness._kill_group(proc)
                log, _ = proc.communicate()
            if proc.returncode != 0 or not os.path.exists(out):
                raise RuntimeError(
                    f"the {fault.policy} fault run exited with {proc.returncode}:"
                    f"\n{log[-4000:]}"
                )
            with open(out) as f:
                runs = json.load(f)["runs"]
        for r in runs:
            if (r["title"], r["phase"]) == (fault.title, fault.phase):
                return r
        raise RuntimeError(f"the {fault.policy} fault run has no {fault.title!r}")


def _threads() -> Dict[str, bool]:
    """name -> daemon, of the threads alive now."""
    return {t.name: t.daemon for t in threading.enumerate()}


def _normalize(message: str) -> str:
    # One row per kind of failure, not per port or room; the cause only, not
    # the "Decode handshake failed for request ..." wrapper.
    message = re.sub(r"127\.0\.0\.1:\d+", "<addr>", message or "")
    message = re.sub(r"\b\d{6,}\b", "<n>", message)
    message = message.split("): ", 1)[-1] if "Error(" in message else message
    return message[:160]


def summarize(run: Run, calls, t0, t1, threads_start, threads_end) -> dict:
    faulty_addrs = run.faulty_addrs
    faulty_ports = {int(a.rsplit(":", 1)[1]) for a in faulty_addrs}
    faulty = [t for t in run.requests if t.addr in faulty_addrs]
    healthy = [t for t in run.requests if t.addr not in faulty_addrs]
    failures: Dict[str, int] = {}
    for t in run.requests:
        if t.state == "failed":
            key = _normalize(t.error)
            failures[key] = failures.get(key, 0) + 1
    worst = max(calls, key=lambda c: c.duration, default=None)
    peaks: Dict[str, int] = {}
    for port in faulty_ports:
        for kind, n in harness.HTTP.peaks(port).items():
            peaks[kind] = max(peaks.get(kind, 0), n)
    new_threads = sorted(set(threads_end) - set(threads_start))
    return {
        "fault": run.fault.name,
        "title": run.fault.title,
        "phase": run.fault.phase,
        "policy": run.fault.policy,
        "duration_s": round(t1 - t0, 2),
        "longest_call_s": round(worst.duration, 4) if worst else None,
        "longest_call_cpu_s": round(worst.cpu, 4) if worst else None,
        "calls": len(calls),
        "scheduler_http_to_faulty": sum(
            1 for c in calls for (_, port) in c.http if port in faulty_ports
        ),
        "scheduler_threads_started": sum(c.threads_started for c in calls),
        # ZMQ sends and connects made by the scheduler thread itself
        "scheduler_zmq_ops": sum(len(c.zmq) for c in calls),
        "requests": len(run.requests),
        "admitted": sum(1 for t in run.requests if t.t_admitted is not None),
        "transferred": sum(1 for t in run.requests if t.state == "success"),
        "failed": sum(1 for t in run.requests if t.state == "failed"),
        "pending_end": sum(1 for t in run.requests if not t.finished),
        "faulty_longest_request_s": round(
            max((t.t_done - t.t_add for t in faulty if t.finished), default=0.0), 2
        ),
        "faulty": _counts(faulty),
        "healthy": _counts(healthy),
        "failures": failures,
        "max_in_flight": peaks,
        "threads_start": len(threads_start),
        "threads_end": len(threads_end),
        "new_non_daemon_threads": [n for n in new_threads if not threads_end[n]],
        "fatal": run.fatal,
        "extra": run.extra,
    }


def _counts(reqs: List[harness.Tracked]) -> dict:
    return {
        "total": len(reqs),
        "transferred": sum(1 for t in reqs if t.state == "success"),
        "failed": sum(1 for t in reqs if t.state == "failed"),
        "pending": sum(1 for t in reqs if not t.finished),
        "kv_ok": all(t.kv_ok for t in reqs if t.state == "success"),
    }


# ---------------------------------------------------------------------------
# The faults
# ---------------------------------------------------------------------------


def port_closed_first(run: Run) -> None:
    # Nothing listens on this port: every connect is refused at once.
    run.target = f"{harness.HOST}:{harness.free_port()}"
    run.faulty_addrs.add(run.target)
    run.spread()
    run.finish()
    run.target = run.faulty.addr
    run.request(run.faulty)


def port_closed_cached(run: Run) -> None:
    # The prefill dies after its info and routes were cached: its bootstrap
    # port refuses and its ZMQ peer is gone; the heartbeat finds out.
    run.faulty.kill()
    run.spread()
    run.finish()


def frozen(run: Run) -> None:
    run.faulty.freeze()
    run.spread()
    run.finish()
    run.faulty.resume()
    run.settle_fetches()
    run.request(run.faulty)


def frozen_in_flight(run: Run) -> None:
    # The whole prefill stops after the handshake of its requests, before
    # their KV: the decode has sent their metadata and waits; the heartbeat
    # fails them, and their ABORTs go to the frozen prefill.
    held = run.request(run.faulty, n=3, hold_s=HEARTBEAT_DETECT_S + 10)
    run.cycles(lambda: all(t.t_metadata is not None for t in held), 30)
    run.extra["in_flight_at_freeze"] = sum(t.state == "transferring" for t in held)
    run.faulty.freeze()
    run.spread(n_faulty=1)
    run.finish()
    run.faulty.resume()
    run.settle_fetches()
    after = run.request(run.faulty)
    run.cycles(lambda: after[0].finished, 30)
    run.extra["served_after_resume"] = after[0].state == "success"


def slow(delay_s: float) -> Callable[[Run], None]:
    def body(run: Run) -> None:
        # The bootstrap queries, not /health: the heartbeat's probe reads for
        # 3 s (0.5.23's), so a /health this slow fails it after two misses,
        # and whether the requests finished first was a race.
        run.faulty.set_fault(
            "delay", delay_s=delay_s, paths=["/route", "/query_dp_ranks"]
        )
        run.spread()
        run.finish()
        run.faulty.clear_fault()
        run.settle_fetches()
        run.request(run.faulty)

    return body


def status_then_healthy(run: Run) -> None:
    # 500 then 503 on every bootstrap query, then healthy again; requests
    # keep coming through all three stretches.
    for status in (500, 503):
        run.faulty.set_fault(
            "status", status=status, paths=["/route", "/query_dp_ranks"]
        )
        run.spread(n_faulty=1)
        run.for_s(0.5)
    run.faulty.clear_fault()
    run.spread(n_faulty=1)
    run.finish()


def malformed(body: str = "", fields: Optional[dict] = None, route_kind="info"):
    def apply(run: Run) -> None:
        mode = "patch_json" if fields else "body"
        run.faulty.set_fault(
            mode, body=body, fields=fields, paths=["/route"], route_kind=route_kind
        )
        run.spread()
        run.finish()
        # Retried, not cached: once the answers are good again, it works.
        run.faulty.clear_fault()
        after = run.request(run.faulty)
        run.cycles(lambda: after[0].finished, 30)
        run.extra["served_after_fix"] = after[0].state == "success"

    return apply


def config_mismatch(fields: dict) -> Callable[[Run], None]:
    def body(run: Run) -> None:
        run.faulty.set_fault(
            "patch_json", fields=fields, paths=["/route"], route_kind="info"
        )
        run.spread(n_faulty=1)
        run.finish(timeout_s=20)
        run.extra["fatal_expected"] = True

    return body


def flapping(run: Run) -> None:
    # Down (503 on every path, /health included) and up every few cycles,
    # for ~4 s, with new requests all the while.
    deadline = time.monotonic() + 4.0
    toggles = 0
    while time.monotonic() < deadline and run.fatal is None:
        if toggles % 2 == 0:
            run.faulty.set_fault("status", status=503)
        else:
            run.faulty.clear_fault()
        toggles += 1
        run.spread(n_faulty=1, n_healthy=0)
        run.cycles(lambda: False, 0.25)
    run.faulty.clear_fault()
    for p in run.healthy:
        run.request(p)
    run.extra["toggles"] = toggles
    run.finish()


def eviction_during_fetch(run: Run) -> None:
    # The parallel-info fetch hangs for 2 s; meanwhile the heartbeat marks
    # the prefill failed (its own thread, as in production).
    d = run.d
    port = run.faulty.bootstrap_port
    run.faulty.set_fault("delay", delay_s=2.0, paths=["/route"], route_kind="info")
    table = d.kv_manager.prefill_info_table
    evicted = threading.Event()
    t_evict = []

    def heartbeat_eviction():
        deadline = time.monotonic() + 20
        while harness.HTTP.in_flight(port, "info") == 0:
            if time.monotonic() > deadline:
                return
            time.sleep(0.005)
        t_evict.append(time.perf_counter())
        d.kv_manager._handle_node_failure(run.faulty.addr)
        evicted.set()

    thread = threading.Thread(target=heartbeat_eviction, daemon=True)
    thread.start()
    run.spread(n_faulty=1)
    run.cycles(evicted.is_set, 20)
    run.faulty.clear_fault()
    run.finish()
    thread.join(5)
    # The verdict needs the fetch that was in flight to have returned.
    run.settle_fetches("info")
    run.request(run.faulty)
    run.finish()
    if not t_evict:
        run.extra["stale_republished"] = None
        return
    t_e = t_evict[0]
    published = table.set_times.get(run.faulty.addr)
    fresh_ends = [
        r[1]
        for r in list(harness.HTTP.records)
        if r[2] == port and r[3] == "info" and r[0] > t_e and r[5] is None
    ]
    # Stale: the info was (re)published after the eviction before any fetch
    # started after the eviction had returned.
    run.extra["stale_republished"] = bool(
        published is not None
        and published > t_e
        and (not fresh_ends or published < min(fresh_ends))
    )


def restart_same_port(run: Run) -> None:
    # Killed with requests pending, restarted on the same ports (a new KV
    # manager: new ZMQ rank ports); requests made after the restart must be
    # served by the same decode.
    run.spread()
    run.faulty.kill()
    t_kill = time.perf_counter()
    run.spread(n_healthy=0)
    run.faulty.restart()
    ready = threading.Event()
    threading.Thread(
        target=lambda: (run.faulty.wait_ready(), ready.set()), daemon=True
    ).start()
    run.cycles(ready.is_set, 120)
    run.extra["restart_s"] = round(time.perf_counter() - t_kill, 1)
    run.finish()
    # New requests after the restart, until one is served (bounded).
    served = None
    deadline = time.monotonic() + HEARTBEAT_DETECT_S + 30
    attempts = 0
    while time.monotonic() < deadline and run.fatal is None:
        attempts += 1
        after = run.request(run.faulty)[0]
        run.cycles(lambda: after.finished, 30)
        if after.state == "success":
            served = time.perf_counter() - t_kill
            break
        run.cycles(lambda: False, 1.0)
    run.extra["after_restart_attempts"] = attempts
    run.extra["served_after_restart"] = served is not None


def teardown_frozen(run: Run) -> None:
    """In a child process (its interpreter exit is what is measured): a
    decode with fetches in flight to the frozen prefill tears down."""
    run.faulty.freeze()
    env = dict(os.environ)
    env.update(HEARTBEAT_ENV)
    cmd = [
        sys.executable,
        "-W",
        "ignore",
        os.path.abspath(__file__),
        "--teardown-child",
        run.faulty.addr,
        "--backend",
        run.m.backend,
    ]
    t_start = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
        start_new_session=True,
    )
    report, lines, t_reported = None, [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("TEARDOWN "):
                report = json.loads(line[len("TEARDOWN ") :])
                t_reported = time.perf_counter()
        rc = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        harness._kill_group(proc)
        rc = None
    t_exit = time.perf_counter()
    run.faulty.resume()
    run.extra["child_rc"] = rc
    if report is None:
        run.extra["child_output"] = "".join(lines[-20:])
        run.fatal = "teardown child did not report"
        return
    run.extra.update(report)
    run.extra["exit_after_teardown_s"] = round(t_exit - t_reported, 2)
    run.extra["child_total_s"] = round(t_exit - t_start, 1)


def teardown_child(addr: str, backend: str) -> int:
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    model_path = harness.pd_setup.ensure_tiny_model()
    d = harness.DecodeSide(
        backend,
        model_path,
        max_ensure_retries=MAX_ENSURE_RETRIES,
        ensure_retry_interval=ENSURE_RETRY_INTERVAL_S,
        # teardown() is the role switch's; without this flag the listener
        # blocks in recv and teardown's join waits its 3 s out.
        server_args={"enable_pd_role_switch": True},
    )
    port = int(addr.rsplit(":", 1)[1])
    for _ in range(2):
        d.add(addr, NUM_TOKENS)
    # The scheduler thread tears down at its first chance after a fetch to
    # the frozen prefill has started (stock: after its inline fetch returns).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        d.step()
        if harness.HTTP.first_start(port) is not None:
            break
        time.sleep(0.005)
    t_asked = harness.HTTP.first_start(port)
    mgr = d.kv_manager
    t0 = time.perf_counter()
    try:
        mgr.teardown()
        how = "teardown()"
    except Exception as e:
        # 0.5.23's NIXL manager has no role-switch teardown.
        how = f"teardown() raised {type(e).__name__}: {e}"
    t1 = time.perf_counter()
    blocking = sorted(
        t.name
        for t in threading.enumerate()
        if not t.daemon and t is not threading.main_thread()
    )
    in_fetch = harness.HTTP.in_flight(port)
    report = {
        "teardown": how,
        "teardown_s": round(t1 - t0, 3),
        "asked_to_done_s": round(t1 - t_asked, 3) if t_asked else None,
        "fetches_in_flight_at_teardown": in_fetch,
        "non_daemon_threads_after_teardown": blocking,
        "has_fetch_pool": hasattr(CommonKVManager, "_stop_bootstrap_fetches"),
    }
    print("TEARDOWN " + json.dumps(report), flush=True)
    # Then a plain interpreter exit, timed by the parent.
    return 0


# Row 11: the decode's waiting timeout (0.5.23's SGLANG_DISAGGREGATION_WAITING_
# TIMEOUT, 300 s), which ends the requests of a prefill that makes no progress,
# shortened to fit the run.
STUCK_WAITING_TIMEOUT_S = 6
# Eight requests this big fill the decode's pool.
BIG_TOKENS = harness.pd_setup.POOL_TOKENS // 8


@contextlib.contextmanager
def stuck_prefill_bounds(decode):
    saved = os.environ.get("SGLANG_DISAGGREGATION_WAITING_TIMEOUT")
    os.environ["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] = str(STUCK_WAITING_TIMEOUT_S)
    # The receivers read it from their manager, set at its start.
    saved_manager = decode.kv_manager.waiting_timeout
    decode.kv_manager.waiting_timeout = STUCK_WAITING_TIMEOUT_S
    try:
        yield
    finally:
        decode.kv_manager.waiting_timeout = saved_manager
        if saved is None:
            os.environ.pop("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", None)
        else:
            os.environ["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] = saved


def _frozen_scheduler_rounds(run: Run):
    """Six rounds of four requests to the frozen prefill and one per healthy
    prefill (three times what the decode's pool holds), with a pause between
    rounds in which no healthy request waits. Returns (healthy, frozen)."""
    healthy = []
    for _ in range(6):
        run.request(None, n=4, num_tokens=BIG_TOKENS)
        for p in run.healthy:
            healthy += run.request(p, num_tokens=BIG_TOKENS)
        run.cycles(lambda: all(t.finished for t in healthy), 5)
        run.for_s(0.2)
    frozen = [t for t in run.requests if t not in healthy]
    run.extra["stuck_held_most"] = sum(t.t_metadata is not None for t in frozen)
    run.extra["healthy_total"] = len(healthy)
    return healthy, frozen


def scheduler_frozen(run: Run) -> None:
    # The prefill's scheduler hangs and its bootstrap server answers (the
    # harness never asks it to send): the decode's handshake for its requests
    # succeeds and their KV never comes.
    with stuck_prefill_bounds(run.d):
        healthy, stuck = _frozen_scheduler_rounds(run)
        run.finish()
    first_end = min((t.t_done for t in stuck if t.finished), default=None)
    run.extra["healthy_served_while_stuck_held"] = sum(
        t.state == "success" and (first_end is None or t.t_done < first_end)
        for t in healthy
    )


def scheduler_frozen_prefill_complete(run: Run) -> None:
    # Row 11 under prefill_complete: the frozen prefill never completes a
    # prefill, so the decode allocates nothing for its requests. After the
    # resume it completes them in order and every one is served.
    healthy, frozen = _frozen_scheduler_rounds(run)
    run.extra["healthy_served_while_stuck_held"] = sum(
        t.state == "success" for t in healthy
    )
    for t in frozen:
        t.prefill_job = run.faulty.send_kv(t.room, t.num_tokens)
    run.finish()
    run.extra["served_after_resume"] = sum(t.state == "success" for t in frozen)


FAULTS: List[Fault] = [
    Fault("port_closed", "1. bootstrap port closed", FIRST, port_closed_first),
    Fault(
        "port_closed",
        "1. bootstrap port closed (prefill killed)",
        CACHED,
        port_closed_cached,
    ),
    Fault("frozen", "2. prefill frozen (SIGSTOP)", FIRST, frozen),
    Fault("frozen", "2. prefill frozen (SIGSTOP)", CACHED, frozen),
    Fault(
        "frozen_in_flight",
        "2. prefill frozen after the handshake, requests in flight",
        CACHED,
        frozen_in_flight,
    ),
    Fault("slow_under", "3. slow: 4.5 s, under the 5 s timeout", FIRST, slow(4.5)),
    Fault("slow_over", "3. slow: 5.5 s, over the 5 s timeout", FIRST, slow(5.5)),
    Fault("status", "4. HTTP 500, 503, then healthy", FIRST, status_then_healthy),
    Fault(
        "malformed_text",
        "5. malformed: not JSON (parallel info)",
        FIRST,
        malformed(body="<html>bad gateway</html>"),
    ),
    Fault(
        "malformed_missing",
        "5. malformed: JSON missing fields (parallel info)",
        FIRST,
        malformed(body="{}"),
    ),
    Fault(
        "malformed_types",
        "5. malformed: fields of the wrong type (parallel info)",
        FIRST,
        malformed(fields={"attn_tp_size": "two", "dp_size": [1]}),
    ),
    Fault(
        "malformed_big",
        "5. malformed: 8 MiB body (parallel info)",
        FIRST,
        malformed(fields={"padding": "x" * BIG_BODY_BYTES}),
    ),
    Fault(
        "malformed_route_text",
        "5. malformed: not JSON (per-rank route)",
        FIRST,
        malformed(body="<html>bad gateway</html>", route_kind="rank"),
    ),
    Fault(
        "malformed_route_missing",
        "5. malformed: JSON missing fields (per-rank route)",
        FIRST,
        malformed(body="{}", route_kind="rank"),
    ),
    Fault(
        "mismatch_page",
        "6. config mismatch: page size",
        FIRST,
        config_mismatch({"page_size": 999}),
    ),
    Fault(
        "mismatch_dtype",
        "6. config mismatch: KV dtype",
        FIRST,
        config_mismatch({"kv_cache_dtype": "fp8_e5m2"}),
    ),
    Fault("flapping", "7. flapping: 503 / healthy every ~0.25 s", FIRST, flapping),
    Fault("flapping", "7. flapping: 503 / healthy every ~0.25 s", CACHED, flapping),
    Fault(
        "eviction",
        "8. heartbeat eviction during the info fetch",
        FIRST,
        eviction_during_fetch,
    ),
    Fault(
        "restart",
        "9. killed and restarted on the same port",
        FIRST,
        restart_same_port,
    ),
    Fault(
        "restart", "9. killed and restarted on the same port", CACHED, restart_same_port
    ),
    Fault(
        "teardown",
        "10. teardown with fetches in flight to a frozen prefill",
        FIRST,
        teardown_frozen,
    ),
    Fault(
        "scheduler_frozen",
        "11. scheduler frozen, bootstrap alive: its KV never comes",
        FIRST,
        scheduler_frozen,
    ),
    Fault(
        "scheduler_frozen",
        "11. scheduler frozen, bootstrap alive (prefill_complete)",
        FIRST,
        scheduler_frozen_prefill_complete,
        policy="prefill_complete",
    ),
]


def run_mirror_rows(backend: str, rows: list) -> List[dict]:
    """Rows 12-14, sick decodes on the prefill: one prefill and four decodes
    (mirror.py), one row per sick decode, killed after its row."""
    runs = []
    with mirror.MirrorCluster(backend, mirror.ROW_DECODES, env=mirror.ROW_ENV) as c:
        for name, title, fault, sick, knob, bound_s in rows:
            print(f"[faults] {title} ...", flush=True)
            try:
                r = mirror.run_fault(c, fault, sick, "B", mirror.ROW_WINDOW_S)
                r = {k: r[k] for k in ("summary", "during", "sick", "alone")}
            except Exception as e:
                r = {"error": f"{type(e).__name__}: {e}"}
            r.update(
                fault=name,
                title=title,
                knob=knob,
                bound_s=bound_s,
                decode=c.decodes[sick].ready_info()["session_id"],
                rank=f"{mirror.HOST}:{c.decodes[sick].ready_info()['rank_port']}",
            )
            c.decodes[sick].kill()
            print(f"[faults]   {json.dumps(r.get('summary') or r)}", flush=True)
            runs.append(r)
    return runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the runs here (JSON)")
    parser.add_argument("--backend", default="mooncake")
    parser.add_argument("--faults", help="comma-separated fault names (default all)")
    parser.add_argument(
        "--allocation-policy",
        choices=("early", "prefill_complete"),
        help="only the runs of this policy (default: every run, each policy's "
        "but early's in a child process)",
    )
    parser.add_argument("--teardown-child", metavar="ADDR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.teardown_child:
        return teardown_child(args.teardown_child, args.backend)
    wanted = set(args.faults.split(",")) if args.faults else None
    faults = [
        f
        for f in FAULTS
        if (wanted is None or f.name in wanted)
        and args.allocation_policy in (None, f.policy)
    ]
    variant, _ = harness.detect_variant()
    runs = []
    harness.install_signal_handlers()
    # Rows 12-14 alone need no decode-side cluster.
    matrix = (
        Matrix(args.backend, args.allocation_policy or "early")
        if faults
        else contextlib.nullcontext()
    )
    with matrix as m:
        for fault in faults:
            print(f"[faults] {variant}: {fault.title} ({fault.phase}) ...", flush=True)
            t0 = time.monotonic()
            try:
                result = m.run(fault)
            except Exception as e:
                result = {
                    "fault": fault.name,
                    "title": fault.title,
                    "phase": fault.phase,
                    "error": f"{type(e).__name__}: {e}",
                }
            runs.append(result)
            print(
                f"[faults]   {time.monotonic() - t0:.0f} s: "
                + json.dumps({k: v for k, v in result.items() if k != "title"}),
                flush=True,
            )
    rows = [
        row
        for row in mirror.ROWS
        if (wanted is None or row[0] in wanted) and args.allocation_policy is None
    ]
    mirror_runs = run_mirror_rows(args.backend, rows) if rows else []
    out = {
        "variant": variant,
        "backend": args.backend,
        "runs": runs,
        "mirror_runs": mirror_runs,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
