"""Chaos soak: the demo's deployment under load, its prefills faulted for minutes.

The deployment is ``tools/demo_pd.py``'s: two prefills, one decode (with
``--enable-metrics``) and sglang-router in front. After the same warm-up and
load calibration, requests go through the router open loop at half of the
measured capacity while a seeded schedule of faults hits the prefills:

- ``bootstrap_freeze``: SIGSTOP of the process hosting the prefill's bootstrap
  server (its HTTP server too), 5-40 s;
- ``scheduler_freeze``: SIGSTOP of the prefill's scheduler process alone; its
  HTTP and bootstrap servers keep answering, 5-40 s;
- ``kill_restart``: SIGKILL of the prefill's process group, then the same
  command again on the same ports; down until its ``/health`` answers;
- ``slow``: SIGSTOP/SIGCONT of the prefill's process group, ``stop_ms`` of
  every ``period_ms``, 20-60 s;

with quiet gaps between them. Both prefills are faulted, never both down at
once (a ``slow`` prefill is not down) unless ``--both``. The schedule is a pure
function of ``--minutes``, ``--seed`` and ``--both``: it is printed, and stock
and patched get the same one. If a restarted prefill is not back when the
schedule's next down fault of the other prefill is due, that fault waits for it
(logged, and recorded with its real times).

    PYTHONPATH=<variant>:$REPO python tools/soak_pd.py --out OUT/stock
    PYTHONPATH=<variant>:$REPO python tools/soak_pd.py --out OUT/patched \
        --rate-from OUT/stock
    python tools/soak_report.py OUT/stock OUT/patched --out OUT

``--rate-from`` sends the other run's rate without calibrating again. Writes
``result.json`` and every process's log into ``--out``; every process it
started is stopped on success, failure and Ctrl-C, stopped processes resumed
first.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import random
import re
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional

import psutil
import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo_pd  # noqa: E402
from demo_pd import (  # noqa: E402
    CALIBRATION_ATTEMPTS,
    CALIBRATION_MAX_STALL_S,
    CALIBRATION_SECONDS,
    DECODE_WAITING_TIMEOUT_S,
    HOST,
    ROUTER_PD_SETTINGS,
    ROUTER_REQUEST_TIMEOUT,
    ROUTER_REQUEST_TIMEOUT_S,
    MemorySampler,
    Processes,
    RequestLog,
    calibrate,
    choose_rate,
    client_ticker,
    decode_request_log,
    describe_variant,
    free_ports,
    health_poller,
    listener_pid,
    metrics_poller,
    scheduler_pid,
    scrape_peer_series,
    one_request,
    server_cmd,
    server_env,
    wait_healthy,
    wait_router,
)
from tiny_model import ensure_tiny_gpt2  # noqa: E402

PREFILLS = ("prefill1", "prefill2")
DOWN_KINDS = ("bootstrap_freeze", "scheduler_freeze", "kill_restart")
KINDS = DOWN_KINDS + ("slow",)

# Schedule shape (seconds).
LEAD_S = 10.0  # fault-free before the first fault
TAIL_S = 15.0  # fault-free at the end, before the load stops
GAP_S = (5.0, 20.0)  # quiet between two faults
FREEZE_S = (5.0, 40.0)
SLOW_S = (20.0, 60.0)
SLOW_STOP_MS = (100, 300)
SLOW_PERIOD_MS = 500
# What a restart is planned to take: the other prefill's next down fault is
# scheduled after it (and waits longer if the restart does).
RESTART_RESERVE_S = 140.0
# A restart still not back when the load's time is up: the load goes on until
# it is, and RESTART_SERVE_S more for the router to send it requests; at most
# RESTART_MAX_S after the kill.
RESTART_SERVE_S = 20.0
RESTART_MAX_S = 300.0

CLIENT_TIMEOUT_S = 150.0
# After the load stops: wait this long for open requests.
DRAIN_S = ROUTER_REQUEST_TIMEOUT_S + 15.0
# After the drain, let the decode go idle before the last resource sample
# (fetch lane threads end after 60 s idle; they are counted as they are).
SETTLE_S = 5.0
METRICS_EVERY_S = 10.0
STATE_LOG_INTERVAL_S = 5  # SGLANG_LOG_SCHEDULER_STATUS_INTERVAL on the decode


def log(msg: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------
# the schedule


def make_schedule(minutes: float, seed: int, both: bool = False) -> List[dict]:
    """Faults by start time. Pure: same arguments, same schedule."""
    rng = random.Random(seed)
    total = minutes * 60.0
    end = total - TAIL_S
    faults: List[dict] = []
    # A restart takes the longest to see through: the first fault is one, and
    # each kind comes once before any comes twice.
    order = ["kill_restart"] + rng.sample(
        ["bootstrap_freeze", "scheduler_freeze", "slow"], 3
    )
    target = rng.choice(PREFILLS)
    t = LEAD_S
    while True:
        kind = order.pop(0) if order else rng.choice(KINDS)
        if kind == "kill_restart":
            dur = RESTART_RESERVE_S
        elif kind == "slow":
            dur = rng.uniform(*SLOW_S)
        else:
            dur = rng.uniform(*FREEZE_S)
        if t + dur > end:
            # The longest kinds may not fit; a freeze of at most FREEZE_S might.
            if kind == "kill_restart":
                kind = "bootstrap_freeze"
            dur = min(dur, FREEZE_S[1], end - t)
            if dur < FREEZE_S[0]:
                break
        fault = {"kind": kind, "target": target, "start": round(t, 1)}
        fault["duration"] = round(dur, 1)
        if kind == "slow":
            fault["stop_ms"] = rng.randint(*SLOW_STOP_MS)
            fault["period_ms"] = SLOW_PERIOD_MS
        faults.append(fault)
        other = PREFILLS[1 - PREFILLS.index(target)]
        # Overlap: while this prefill is down, slow the other (it stays up);
        # with --both, freeze it instead.
        if kind in DOWN_KINDS and dur >= 25.0 and rng.random() < 0.6:
            at = t + rng.uniform(3.0, dur - 20.0)
            if both:
                o = {"kind": "bootstrap_freeze", "target": other}
                o["duration"] = round(min(rng.uniform(*FREEZE_S), end - at), 1)
            else:
                o = {"kind": "slow", "target": other}
                o["duration"] = round(min(rng.uniform(*SLOW_S), end - at), 1)
                o["stop_ms"] = rng.randint(*SLOW_STOP_MS)
                o["period_ms"] = SLOW_PERIOD_MS
            o["start"] = round(at, 1)
            o["overlaps"] = len(faults) - 1
            if o["duration"] >= FREEZE_S[0]:
                faults.append(o)
        busy_until = max(f["start"] + f["duration"] for f in faults)
        t = busy_until + rng.uniform(*GAP_S)
        if rng.random() < 0.7:
            target = other
    faults.sort(key=lambda f: f["start"])
    for i, f in enumerate(faults):
        f["id"] = i
    return faults


def format_schedule(faults: List[dict]) -> str:
    lines = []
    for f in faults:
        what = f["kind"]
        if f["kind"] == "slow":
            what += f" ({f['stop_ms']} ms stopped of every {f['period_ms']} ms)"
        if f["kind"] == "kill_restart":
            dur = f"restart, {f['duration']:.0f} s reserved"
        else:
            dur = f"{f['duration']:.1f} s"
        lines.append(
            f"  #{f['id']}: t={f['start']:6.1f} s  {f['target']}  {what}, {dur}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------
# the deployment


class SoakProcesses(Processes):
    """demo_pd.Processes that keeps a killed server's old Popen to reap it."""

    def __init__(self) -> None:
        super().__init__()
        self.old: List = []

    def start(self, name, cmd, env, log_path):
        old = self.procs.get(name)
        if old is not None:
            self.old.append(old)
        return super().start(name, cmd, env, log_path)

    def stop_all(self, grace: float = 15.0) -> None:
        for proc in self.old:
            demo_pd._signal_group(proc.pid, signal.SIGKILL)
        super().stop_all(grace)


class Deployment:
    def __init__(self, args, procs: SoakProcesses, out: Path):
        self.args = args
        self.procs = procs
        self.out = out
        self.model = ensure_tiny_gpt2(args.model_dir)
        self.env = server_env(args.backend)
        ports = free_ports(7)
        p1, b1, p2, b2, dport, rport, prom = ports
        self.ports = {"prefill1": (p1, b1), "prefill2": (p2, b2), "decode": dport}
        self.router_port, self.prom_port = rport, prom
        self.req_log_dir = out / "decode-requests"
        self.urls = {
            "prefill1": f"http://{HOST}:{p1}",
            "prefill2": f"http://{HOST}:{p2}",
            "decode": f"http://{HOST}:{dport}",
        }
        self.router_url = f"http://{HOST}:{rport}"
        self.cmds: Dict[str, List[str]] = {}
        self.starts: Dict[str, int] = {}

    def server_args(self, name: str) -> List[str]:
        if name == "decode":
            return [
                "--disaggregation-decode-retraction-backup", "cpu_tensor",
                "--enable-metrics",
                "--log-requests", "--log-requests-level", "0",
                "--log-requests-format", "json",
                "--log-requests-target", str(self.req_log_dir),
            ]  # fmt: skip
        return [
            "--disable-radix-cache",
            "--disaggregation-bootstrap-port",
            str(self.ports[name][1]),
        ]

    def start_server(self, name: str) -> None:
        role = "decode" if name == "decode" else "prefill"
        port = self.ports[name] if name == "decode" else self.ports[name][0]
        cmd = server_cmd(self.model, role, port, self.args, self.server_args(name))
        env = dict(self.env)
        if name == "decode":
            env["SGLANG_LOG_SCHEDULER_STATUS_INTERVAL"] = str(STATE_LOG_INTERVAL_S)
            if not self.args.router_defaults:
                env["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] = str(
                    DECODE_WAITING_TIMEOUT_S
                )
        self.cmds[name] = cmd
        self.starts[name] = self.starts.get(name, 0) + 1
        self.procs.start(name, cmd, env, self.out / f"{name}.log")

    def start(self) -> dict:
        t_start = time.monotonic()
        for name in ("prefill1", "prefill2", "decode"):
            self.start_server(name)
        (p1, b1), (p2, b2) = self.ports["prefill1"], self.ports["prefill2"]
        self.router_cmd = [
            sys.executable, "-m", "sglang_router.launch_router",
            "--pd-disaggregation",
            "--prefill", self.urls["prefill1"], str(b1),
            "--prefill", self.urls["prefill2"], str(b2),
            "--decode", self.urls["decode"],
            "--host", HOST, "--port", str(self.router_port),
            "--prometheus-host", HOST, "--prometheus-port", str(self.prom_port),
            "--policy", "round_robin",
            "--worker-startup-check-interval", "2",
            *ROUTER_REQUEST_TIMEOUT,
        ]  # fmt: skip
        if not self.args.router_defaults:
            self.router_cmd += ROUTER_PD_SETTINGS
        self.procs.start("router", self.router_cmd, self.env, self.out / "router.log")
        log(f"started 3 servers + router (logs in {self.out}); waiting for /health")
        ready = wait_healthy(self.urls, self.procs, timeout=400)
        wait_router(self.router_url, list(self.urls.values()), self.procs, 120)
        return {"servers_healthy": time.monotonic() - t_start, **ready}

    def kill(self, name: str) -> None:
        proc = self.procs.procs[name]
        demo_pd._signal_group(proc.pid, signal.SIGCONT)
        demo_pd._signal_group(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=20)
        except Exception:
            pass
        # Every process of the group gone, so the ports are free again.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)

    def healthy(self, name: str) -> bool:
        try:
            r = requests.get(self.urls[name] + "/health", timeout=2)
            return r.status_code == 200
        except requests.RequestException:
            return False


# --------------------------------------------------------------------------
# faults


class FaultRunner(threading.Thread):
    """Runs the schedule against the deployment; records what it did when."""

    def __init__(self, dep: Deployment, faults: List[dict], t0: float, both: bool):
        super().__init__(daemon=True)
        self.dep = dep
        self.faults = [dict(f) for f in faults]
        self.t0 = t0
        self.both = both
        self.stop = threading.Event()  # no new faults
        self.abort = threading.Event()  # end the running ones too
        self.events: List[dict] = []
        self.down: Dict[str, Optional[int]] = {p: None for p in PREFILLS}
        self.lock = threading.Lock()
        self.workers: List[threading.Thread] = []
        self.errors: List[str] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    def event(self, fault: dict, what: str, **kw) -> None:
        row = {"t": self.now(), "fault": fault["id"], "what": what, **kw}
        self.events.append(row)
        extra = "".join(f", {k}={v}" for k, v in kw.items())
        log(f"t={row['t']:.1f} s fault #{fault['id']} {fault['target']}: {what}{extra}")

    def run(self) -> None:
        for fault in self.faults:
            if self.stop.wait(max(0.0, fault["start"] - self.now())):
                return
            target = fault["target"]
            other = PREFILLS[1 - PREFILLS.index(target)]
            if fault["kind"] in DOWN_KINDS or self.down[target] is not None:
                # Never both down (unless --both), never two faults on one
                # prefill at once: wait for the prefill(s) to be back.
                waited = self.now()
                while not self.stop.is_set():
                    with self.lock:
                        busy = self.down[target] is not None or (
                            not self.both
                            and fault["kind"] in DOWN_KINDS
                            and self.down[other] is not None
                        )
                    if not busy:
                        break
                    self.stop.wait(0.5)
                if self.stop.is_set():
                    return
                if self.now() - waited > 1.0:
                    self.event(fault, "deferred", by_s=round(self.now() - waited, 1))
            if fault["kind"] in DOWN_KINDS:
                with self.lock:
                    self.down[target] = fault["id"]
            w = threading.Thread(target=self._run_one, args=(fault,), daemon=True)
            w.start()
            self.workers.append(w)

    def _run_one(self, fault: dict) -> None:
        try:
            getattr(self, "_" + fault["kind"])(fault)
        except Exception as e:  # recorded; the soak goes on
            self.errors.append(f"fault #{fault['id']}: {e!r}")
            log(f"fault #{fault['id']} failed: {e!r}")
        finally:
            with self.lock:
                if self.down[fault["target"]] == fault["id"]:
                    self.down[fault["target"]] = None

    def _freeze(self, fault: dict, pid: Optional[int], what: str) -> None:
        if pid is None:
            raise RuntimeError(f"no {what} process found")
        fault["pid"] = pid
        os.kill(pid, signal.SIGSTOP)
        fault["t_start"] = self.now()
        self.event(fault, f"SIGSTOP {what}", pid=pid)
        self.stop.wait(fault["duration"])
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        fault["t_end"] = self.now()
        self.event(fault, f"SIGCONT {what}", pid=pid)

    def _bootstrap_freeze(self, fault: dict) -> None:
        port = self.dep.ports[fault["target"]][1]
        pid = listener_pid(self.dep.procs, fault["target"], port)
        self._freeze(fault, pid, f"bootstrap host :{port}")

    def _scheduler_freeze(self, fault: dict) -> None:
        pid = scheduler_pid(self.dep.procs, fault["target"])
        self._freeze(fault, pid, "scheduler")

    def _slow(self, fault: dict) -> None:
        pgid = self.dep.procs.procs[fault["target"]].pid
        stop_s = fault["stop_ms"] / 1000.0
        period = fault["period_ms"] / 1000.0
        fault["t_start"] = self.now()
        self.event(fault, f"slow: SIGSTOP/SIGCONT of process group {pgid}")
        end = time.monotonic() + fault["duration"]
        while time.monotonic() < end and not self.stop.is_set():
            demo_pd._signal_group(pgid, signal.SIGSTOP)
            time.sleep(stop_s)
            demo_pd._signal_group(pgid, signal.SIGCONT)
            time.sleep(max(0.0, period - stop_s))
        demo_pd._signal_group(pgid, signal.SIGCONT)
        fault["t_end"] = self.now()
        self.event(fault, "slow: ended")

    def _kill_restart(self, fault: dict) -> None:
        name = fault["target"]
        pgid = self.dep.procs.procs[name].pid
        fault["t_start"] = self.now()
        self.dep.kill(name)
        self.event(fault, f"SIGKILL process group {pgid}")
        self.dep.start_server(name)
        fault["t_relaunch"] = self.now()
        self.event(fault, "relaunched on the same ports")
        # Not cut short when the schedule ends: the load goes on until the
        # restarted prefill is back (see run()).
        deadline = time.monotonic() + RESTART_MAX_S
        while time.monotonic() < deadline and not self.abort.is_set():
            if self.dep.procs.procs[name].poll() is not None:
                raise RuntimeError(f"{name} exited at restart")
            if self.dep.healthy(name):
                fault["t_end"] = self.now()
                self.event(fault, "healthy again")
                return
            time.sleep(0.5)
        raise RuntimeError(
            f"{name} not healthy {RESTART_MAX_S:.0f} s after its restart"
        )

    def restarting(self) -> List[dict]:
        """Restarts not back yet, or back less than RESTART_SERVE_S ago."""
        return [
            f
            for f in self.faults
            if f["kind"] == "kill_restart"
            and "t_start" in f
            and (f.get("t_end") is None or self.now() < f["t_end"] + RESTART_SERVE_S)
            and not any(e.startswith(f"fault #{f['id']}:") for e in self.errors)
        ]


# --------------------------------------------------------------------------
# samplers


class ResourceSampler(threading.Thread):
    """The decode's threads, open fds and RSS (all its processes), and the
    scheduler process's alone, every ``interval`` seconds."""

    def __init__(self, procs: Processes, t0: float, interval: float = 2.0):
        super().__init__(daemon=True)
        self.procs, self.t0, self.interval = procs, t0, interval
        self.rows: List[dict] = []
        self.stop = threading.Event()

    def sample(self) -> dict:
        row = {"t": time.monotonic() - self.t0, "threads": 0, "fds": 0, "rss": 0}
        for p in self.procs.tree("decode"):
            try:
                with p.oneshot():
                    threads, fds = p.num_threads(), p.num_fds()
                    rss = p.memory_info().rss
                    sched = "scheduler" in p.name()
            except psutil.Error:
                continue
            row["threads"] += threads
            row["fds"] += fds
            row["rss"] += rss
            if sched:
                row["scheduler_threads"] = threads
                row["scheduler_fds"] = fds
        self.rows.append(row)
        return row

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            self.sample()


FAILED_METRICS = (
    "sglang:num_bootstrap_failed_reqs_total",
    "sglang:num_transfer_failed_reqs_total",
)
GAUGES = (
    "sglang:num_decode_prealloc_queue_reqs",
    "sglang:num_decode_transfer_queue_reqs",
)
METRICS = FAILED_METRICS + GAUGES


def scrape_metrics(url: str) -> Optional[Dict[str, float]]:
    """The decode's /metrics, the METRICS families summed over their labels."""
    try:
        r = requests.get(url + "/metrics", timeout=5)
        if r.status_code != 200:
            return None
    except requests.RequestException:
        return None
    got: Dict[str, float] = {}
    for line in r.text.splitlines():
        if line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)", line)
        if m and m.group(1) in METRICS:
            got[m.group(1)] = got.get(m.group(1), 0.0) + float(m.group(3))
    return got


class MetricsPoller(threading.Thread):
    def __init__(self, url: str, t0: float, interval: float = METRICS_EVERY_S):
        super().__init__(daemon=True)
        self.url, self.t0, self.interval = url, t0, interval
        self.rows: List[dict] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            got = scrape_metrics(self.url)
            if got is not None:
                self.rows.append({"t": time.monotonic() - self.t0, **got})


STATE_LINE = re.compile(r"PD decode state: (\{.*\})")
FAILURE_LINE = re.compile(
    r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\] Decode (handshake|transfer) failed "
)


def read_decode_log(log_path: Path, t0_wall: float) -> tuple:
    """From the decode's log: its ``PD decode state`` lines (the patch logs one
    when its tables change, at most every SGLANG_LOG_SCHEDULER_STATUS_INTERVAL;
    stock logs none), and how many requests it failed since ``t0_wall`` by
    kind: the lines that go with sglang:num_{bootstrap,transfer}_failed_reqs_total
    (the request log misses those the router cancelled)."""
    from datetime import datetime

    states: List[dict] = []
    failures = {"handshake": 0, "transfer": 0}
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return states, failures
    for line in text.splitlines():
        m = STATE_LINE.search(line)
        if m:
            try:
                states.append(json.loads(m.group(1)))
            except ValueError:
                pass
            continue
        m = FAILURE_LINE.match(line)
        if m:
            ts = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
            if ts >= int(t0_wall):
                failures[m.group(2)] += 1
    return states, failures


# --------------------------------------------------------------------------
# main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("mooncake", "nixl"), default="mooncake")
    ap.add_argument("--out", type=Path, required=True, help="output directory")
    ap.add_argument("--minutes", type=float, default=10.0, help="length of the load")
    ap.add_argument("--seed", type=int, default=1, help="seed of the fault schedule")
    ap.add_argument(
        "--both",
        action="store_true",
        help="allow both prefills down at once (a client error is then excused "
        "only while both are down)",
    )
    ap.add_argument(
        "--router-defaults",
        action="store_true",
        help="run sglang-router with its defaults, not ROUTER_PD_SETTINGS",
    )
    ap.add_argument("--rate", type=float, default=None, help="req/s; no calibration")
    ap.add_argument(
        "--rate-from",
        type=Path,
        default=None,
        help="send the rate another run chose (its result.json or out dir)",
    )
    ap.add_argument("--model-dir", type=Path, default=None, help="model cache dir")
    ap.add_argument(
        "--print-schedule",
        action="store_true",
        help="print the fault schedule and exit",
    )
    return ap.parse_args(argv)


def choose_load(args, dep: Deployment, variant: dict) -> tuple:
    if args.rate is not None:
        return args.rate, {"source": "--rate", "rate": args.rate}, None
    if args.rate_from is not None:
        path = args.rate_from
        path = path / "result.json" if path.is_dir() else path
        other = json.loads(path.read_text())
        rate = float(other["rate"])
        label = other["variant"]["label"]
        log(f"rate {rate:g} req/s: the {label} run's (--rate-from {path})")
        return rate, {"source": "rate-from", "rate": rate, "from_label": label}, None
    log("calibrating the load: clients back to back through the router")
    attempts = []
    # At most 2 attempts (the demo: 3), to keep a short soak short.
    for attempt in range(min(2, CALIBRATION_ATTEMPTS)):
        c = calibrate(
            dep.router_url, f"calib{attempt}-{variant['label']}", CALIBRATION_SECONDS
        )
        c.pop("t0_monotonic", None)
        attempts.append(c)
        if c["client_stalled_s"] <= CALIBRATION_MAX_STALL_S:
            break
        log(f"calibration stalled {c['client_stalled_s']:.1f} s; again")
    c = min(attempts, key=lambda a: a["client_stalled_s"])
    if c["answered_ok"] == 0:
        raise RuntimeError(f"calibration failed: {c['not_ok'][:3]}")
    choice = choose_rate(c["capacity_rps"])
    log(
        f"calibration: {c['capacity_rps']:.2f} req/s; rate {choice['rate']:g}: {choice['why']}"
    )
    c.pop("requests", None)
    return choice["rate"], choice, c


def run(args, procs: SoakProcesses) -> dict:
    t_run = time.monotonic()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    variant = describe_variant()
    log(f"variant {variant['label']!r} from {variant['sglang_dir']}; {args.backend}")
    if not variant["cpu_enabled"]:
        raise SystemExit("this sglang lacks the CPU-enablement hunks")
    schedule = make_schedule(args.minutes, args.seed, args.both)
    log(
        f"fault schedule (seed {args.seed}, {args.minutes:g} min"
        + (", both may be down" if args.both else "")
        + "):\n"
        + format_schedule(schedule)
    )
    dep = Deployment(args, procs, out)
    mem = MemorySampler(procs)
    mem.start()
    startup = dep.start()
    log(f"all healthy and registered {startup['servers_healthy']:.0f} s after launch")

    warm = RequestLog()
    tw = time.monotonic()
    for i in range(6):
        one_request(dep.router_url, f"warm-{i}", tw, 60, warm, 10_000 + i)
    bad = [r for r in warm.rows if r["outcome"] != "ok"]
    if bad:
        raise RuntimeError(f"warm-up requests failed: {bad}")
    rate, rate_choice, calibration = choose_load(args, dep, variant)
    time.sleep(2.0)

    t0 = time.monotonic()
    t0_wall = time.time()
    res = ResourceSampler(procs, t0)
    warm_resources = res.sample()
    metrics_start = scrape_metrics(dep.urls["decode"])
    res.start()
    metrics = MetricsPoller(dep.urls["decode"], t0)
    metrics.start()
    health: List[dict] = []
    stop = threading.Event()
    # The decode's per-prefill series (patch 12), for the report's plot.
    peer_metrics: List[dict] = []
    threading.Thread(
        target=metrics_poller,
        args=(dep.urls["decode"], t0, stop, peer_metrics),
        daemon=True,
    ).start()
    threading.Thread(
        target=health_poller, args=(dep.urls["decode"], t0, stop, health), daemon=True
    ).start()
    stalls: List[dict] = []
    threading.Thread(target=client_ticker, args=(t0, stop, stalls), daemon=True).start()
    faults = FaultRunner(dep, schedule, t0, args.both)
    faults.start()

    reqs = RequestLog()
    pool = ThreadPoolExecutor(max_workers=512)
    total = args.minutes * 60.0
    interval = 1.0 / rate
    prefix = f"soak-{variant['label']}"
    n = 0
    next_progress = 30.0
    log(f"sending {rate:g} req/s for {total:.0f} s")
    extended = False
    while True:
        now = time.monotonic() - t0
        if now >= total:
            faults.stop.set()
            back = faults.restarting()
            if not back:
                break
            if not extended:
                extended = True
                log(
                    "the load goes on until the restart of "
                    + ", ".join(f["target"] for f in back)
                    + f" is back and {RESTART_SERVE_S:.0f} s more"
                )
        if now >= n * interval:
            pool.submit(
                one_request, dep.router_url, f"{prefix}-{n:05d}", t0,
                CLIENT_TIMEOUT_S, reqs, n,
            )  # fmt: skip
            n += 1
        if now >= next_progress:
            next_progress += 30.0
            with reqs.lock:
                done = list(reqs.rows)
            bad = sum(1 for r in done if r["outcome"] != "ok")
            hl = [h["latency"] for h in health if h["t"] > now - 30]
            log(
                f"t={now:.0f} s: sent {n}, answered {len(done)} ({bad} not ok); "
                f"decode /health max (last 30 s) {max(hl, default=float('nan')):.2f} s"
            )
        time.sleep(min(0.05, max(0.0, n * interval - now)))
    faults.stop.set()
    faults.abort.set()
    for w in faults.workers:
        w.join(timeout=30)
    total = time.monotonic() - t0
    log(f"load done ({n} requests); waiting up to {DRAIN_S:.0f} s for the rest")
    deadline = time.monotonic() + DRAIN_S
    while time.monotonic() < deadline:
        with reqs.lock:
            if len(reqs.rows) >= n:
                break
        time.sleep(0.5)
    t_cut = time.monotonic() - t0
    pool.shutdown(wait=False, cancel_futures=True)
    time.sleep(SETTLE_S)
    stop.set()
    end_resources = res.sample()
    res.stop.set()
    metrics.stop.set()
    metrics_end = scrape_metrics(dep.urls["decode"])

    with reqs.lock:
        rows = list(reqs.rows)
    done = {r["rid"] for r in rows}
    for i in range(n):
        rid = f"{prefix}-{i:05d}"
        if rid not in done:
            rows.append({
                "rid": rid, "t_send": i * interval, "t_end": None, "latency": None,
                "status": None, "outcome": "open",
                "error": f"no answer by t={t_cut:.0f} s (the soak stopped waiting)",
            })  # fmt: skip
    time.sleep(1.0)
    ports, verdicts, received = decode_request_log(dep.req_log_dir, t0_wall)
    by_port = {dep.ports[p][1]: p for p in PREFILLS}
    for r in rows:
        seen = ports.get(r["rid"], [])
        r["bootstrap_ports"] = seen
        r["prefill"] = by_port.get(seen[0]) if seen else None
        r["prefills"] = [by_port.get(p) for p in seen]
        r["router_retries"] = max(0, len(seen) - 1)
        r["decode"] = verdicts.get(r["rid"], [])
        r["decode_received"] = received.get(r["rid"], [])
    rows.sort(key=lambda r: r["t_send"])
    # Give the decode one more state log interval, then read its last line.
    time.sleep(STATE_LOG_INTERVAL_S + 1)
    states, failures = read_decode_log(out / "decode.log", t0_wall)
    peer_end = scrape_peer_series(dep.urls["decode"], t0)  # idle by now
    mem.stop_event.set()
    return {
        "variant": variant,
        "backend": args.backend,
        "minutes": args.minutes,
        "seed": args.seed,
        "both": args.both,
        "schedule": schedule,
        "faults": faults.faults,
        "fault_events": faults.events,
        "fault_errors": faults.errors,
        "rate": rate,
        "rate_choice": rate_choice,
        "calibration": calibration,
        "t_cut": t_cut,
        "total_s": total,
        "ports": dep.ports,
        "router": {"cmd": dep.router_cmd, "request_timeout_s": ROUTER_REQUEST_TIMEOUT_S,
                   "defaults": args.router_defaults},
        "client_timeout_s": CLIENT_TIMEOUT_S,
        "starts": dep.starts,
        "startup_s": startup,
        "requests": rows,
        "decode_health": health,
        "client_stalls": stalls,
        "resources": {"warm": warm_resources, "end": end_resources, "series": res.rows},
        "metrics": {"start": metrics_start, "end": metrics_end, "series": metrics.rows},
        "decode_failure_lines": failures,
        "peer_metrics": peer_metrics,
        "peer_end": peer_end,
        "peer_names": {
            f"{HOST}:{dep.ports[p][1]}": p for p in PREFILLS
        },
        "t0_wall": t0_wall,
        "decode_waiting_timeout_s": None if args.router_defaults else DECODE_WAITING_TIMEOUT_S,
        "decode_state": {"last": states[-1] if states else None, "lines": len(states),
                         "series": states[-200:]},
        "memory_peak_total_rss": mem.peak_total,
        "run_s": time.monotonic() - t_run,
    }  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.print_schedule:
        print(format_schedule(make_schedule(args.minutes, args.seed, args.both)))
        return 0
    procs = SoakProcesses()
    atexit.register(procs.stop_all)

    def on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        result = run(args, procs)
    except KeyboardInterrupt:
        log("interrupted; stopping every process this run started")
        return 130
    finally:
        procs.stop_all()
    path = args.out / "result.json"
    path.write_text(json.dumps(result, indent=1))
    log(f"done in {result['run_s']:.0f} s; results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
