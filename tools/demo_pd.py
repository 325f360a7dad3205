"""A real PD deployment on this CPU machine, one prefill frozen mid-run.

Starts what users run -- two ``python -m sglang.launch_server
--disaggregation-mode prefill``, one ``--disaggregation-mode decode`` and
``python -m sglang_router.launch_router --pd-disaggregation`` in front of them --
with a tiny randomly initialised GPT-2 built locally (``tools/tiny_model.py``).
Then a steady trickle of requests goes through the router while prefill 2 is
frozen (SIGSTOP of the process that hosts its bootstrap server) and resumed.

The trickle's rate is calibrated to the machine first, so that the run starts
from a healthy baseline: with both prefills healthy, 8 clients each send the
demo's request again as soon as the last one is answered, for 20 s; the
requests answered per second after a 4 s ramp are what this machine serves.
The run then sends half of that, rounded down to 0.25 req/s and kept within
[0.5, 2.0] req/s (2.0 is the rate of the earlier results; below 0.5 the
phases hold too few requests). A calibration during which this process itself
was stalled more than 1 s (the machine paused) is run again, at most 3 times in
all, and the least stalled one is used. ``--rate R`` skips the calibration;
``--rate-from OTHER_OUT`` calibrates (so both runs go through the same steps)
but sends the rate the other run chose: ``dev.py demo`` gives the patched run
the stock run's rate.

One variant per run: sglang is whatever ``import sglang`` finds, so put the
variant's copy first on PYTHONPATH (it is inherited by the scheduler processes
sglang spawns). The label comes from ``SGLANG_PD_VARIANT`` or, failing that, from
comparing the five patched files with this checkout.

    PYTHONPATH=/tmp/sg-stock:$REPO python tools/demo_pd.py --out out/stock
    PYTHONPATH=/tmp/sg-patched:$REPO python tools/demo_pd.py --out out/patched \
        --rate-from out/stock
    python tools/demo_report.py out/stock out/patched --out out

Writes ``result.json`` (with the calibration and the chosen rate) and every
process's log into ``--out``. Every process it starts is stopped (by process
group id, then by pid) on success, failure and Ctrl-C; a frozen process is
resumed first.
"""

from __future__ import annotations

import argparse
import atexit
import hashlib
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Dict, List, Optional

import psutil
import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # sglang_pd_patch, when run by path
from sglang_pd_patch.core import load_manifest  # noqa: E402

sys.path.insert(0, str(REPO / "tools"))
from demo_report import quantile, stalled_within  # noqa: E402
from tiny_model import ensure_tiny_gpt2  # noqa: E402

HOST = "127.0.0.1"
DISAGG = "python/sglang/srt/disaggregation"
WORDS = (
    "the decode scheduler thread never waits on the network a prefill server "
    "that hangs must not stall every request ends within its retry budget "
    "quick brown fox jumps over lazy dog key value caches move from prefill "
    "to decode"
).split()


# sglang-router settings for PD (README, "Router settings for PD"), with the
# decode's waiting timeout below the router's request timeout.
# --router-defaults runs without them. With sglang-router 0.3.2's defaults:
# - its health check runs every 60 s and needs 3 failures, so a dead prefill
#   stays in rotation for minutes;
# - its circuit breaker opens a worker after 10 consecutive 5xx, and charges a
#   failed attempt to both workers of its pair: the decode's 500s for the
#   requests of a prefill that died take the only decode out of rotation for
#   60 s ("No available decode workers"). No decode status avoids that for a
#   non-streaming request: those it retries are charged (docs/operators.md).
ROUTER_REQUEST_TIMEOUT_S = 60
ROUTER_REQUEST_TIMEOUT = ["--request-timeout-secs", str(ROUTER_REQUEST_TIMEOUT_S)]
ROUTER_PD_SETTINGS = [
    "--health-check-interval-secs", "2",
    "--health-failure-threshold", "2",
    "--health-success-threshold", "1",
    "--health-check-timeout-secs", "5",
    "--disable-circuit-breaker",
]  # fmt: skip
# The decode aborts a request whose KV has not come this long after its
# bootstrap (0.5.23's default: 300 s), below the router's request timeout: a
# prefill leg lost at the prefill's HTTP server (docs/operators.md) then comes
# back as a decode error the router retries elsewhere, instead of the router's
# own timeout, whose retry the decode rejects as a duplicate rid.
DECODE_WAITING_TIMEOUT_S = 30

# Load calibration (see the module docstring).
CALIBRATION_CLIENTS = 8  # the decode holds ~7 requests (4096 tokens / 512 reserved)
CALIBRATION_SECONDS = 20.0
CALIBRATION_RAMP_S = 4.0  # completions before this are not counted
CALIBRATION_DRAIN_S = 15.0  # then wait at most this long for the last answers
CALIBRATION_MAX_STALL_S = 1.0  # client stalls in the window that void an attempt
CALIBRATION_ATTEMPTS = 3
RATE_SHARE = 0.5  # of the measured capacity
RATE_STEP = 0.25
RATE_FLOOR = 0.5
RATE_CAP = 2.0


def log(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------
# processes


class Processes:
    """Every process this run starts, each in its own process group."""

    def __init__(self) -> None:
        self.procs: Dict[str, subprocess.Popen] = {}
        self.frozen: Optional[int] = None
        self._lock = threading.Lock()
        self._stopped = False

    def start(self, name: str, cmd: List[str], env: dict, log_path: Path):
        fh = open(log_path, "ab")
        fh.write(("$ " + " ".join(cmd) + "\n").encode())
        fh.flush()
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        fh.close()
        with self._lock:
            self.procs[name] = proc
        return proc

    def tree(self, name: str) -> List[psutil.Process]:
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return []
        try:
            root = psutil.Process(proc.pid)
            return [root] + root.children(recursive=True)
        except psutil.Error:
            return []

    def all_pids(self) -> List[int]:
        pids = []
        for name in list(self.procs):
            pids += [p.pid for p in self.tree(name)]
        return pids

    def freeze(self, pid: int, group: bool = False) -> None:
        """SIGSTOP ``pid``, or with ``group`` its whole process group."""
        self.frozen = (pid, group)
        (os.killpg if group else os.kill)(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        frozen, self.frozen = self.frozen, None
        if frozen is not None:
            pid, group = frozen
            try:
                (os.killpg if group else os.kill)(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def stop_all(self, grace: float = 15.0) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        if threading.current_thread() is threading.main_thread():
            # A second Ctrl-C must not leave half of them running.
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, signal.SIG_IGN)
        self.thaw()
        # Children first seen now, in case one left our process group.
        extra = {}
        for name in self.procs:
            for p in self.tree(name)[1:]:
                extra[p.pid] = p
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                _signal_group(proc.pid, signal.SIGCONT)
                _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs.values():
            _signal_group(proc.pid, signal.SIGKILL)
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                log(f"pid {proc.pid} did not exit after SIGKILL")
        for pid, p in extra.items():
            try:
                if p.is_running():
                    p.kill()
            except psutil.Error:
                pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def free_ports(n: int) -> List[int]:
    ports: List[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def scheduler_pid(procs: Processes, name: str) -> Optional[int]:
    """The pid of a server's scheduler process (a child of launch_server)."""
    for p in procs.tree(name)[1:]:
        try:
            if "scheduler" in p.name() or "sglang::scheduler" in " ".join(p.cmdline()):
                return p.pid
        except psutil.Error:
            continue
    return None


def listener_pid(procs: Processes, name: str, port: int) -> Optional[int]:
    for p in procs.tree(name):
        try:
            for c in p.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN and c.laddr.port == port:
                    return p.pid
        except psutil.Error:
            continue
    return None


# --------------------------------------------------------------------------
# variant


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def describe_variant() -> dict:
    import sglang

    pkg = Path(sglang.__file__).resolve().parent
    disagg = pkg / "srt" / "disaggregation"
    rels = load_manifest().rels
    shas = {rel: _sha(disagg / rel) for rel in rels}
    repo_shas = {rel: _sha(REPO / DISAGG / rel) for rel in rels}
    label = os.environ.get("SGLANG_PD_VARIANT")
    if not label:
        label = "patched" if shas == repo_shas else "stock"
    mooncake_src = (disagg / "mooncake" / "conn.py").read_text()
    cpu_enabled = "    supports_host_tensor_indices = True\n" not in mooncake_src
    return {
        "label": label,
        "sglang_dir": str(pkg),
        "sglang_version": getattr(sglang, "__version__", "?"),
        "equals_this_checkout": shas == repo_shas,
        "cpu_enabled": cpu_enabled,
        "files_sha256": shas,
    }


# --------------------------------------------------------------------------
# servers


def server_env(backend: str) -> dict:
    env = dict(os.environ)
    env["SGLANG_HOST_IP"] = HOST
    if backend == "mooncake":
        # The CPU-only Mooncake engine moves KV over TCP on 127.0.0.1.
        env["MC_FORCE_TCP"] = "1"
        env["MOONCAKE_PROTOCOL"] = "tcp"
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def server_cmd(model: Path, role: str, port: int, args, extra: List[str]):
    policy = getattr(args, "allocation_policy", "early")
    if policy != "early":
        extra = extra + ["--disaggregation-decode-allocation-policy", policy]
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model),
        "--device",
        "cpu",
        "--host",
        HOST,
        "--port",
        str(port),
        "--max-total-tokens",
        "4096",
        "--disaggregation-mode",
        role,
        "--disaggregation-transfer-backend",
        args.backend,
        "--log-level",
        "info",
        # For the per-peer series (patches 12, 13) the demo scrapes from /metrics.
        "--enable-metrics",
    ]
    return cmd + extra


def wait_healthy(urls: Dict[str, str], procs: Processes, timeout: float):
    """Wait for GET /health == 200 on every server; print progress."""
    start = time.monotonic()
    ready: Dict[str, float] = {}
    last_print = 0.0
    while len(ready) < len(urls):
        now = time.monotonic()
        if now - start > timeout:
            raise RuntimeError(f"servers not healthy after {timeout:.0f} s: {urls}")
        for name, url in urls.items():
            if name in ready:
                continue
            proc = procs.procs[name]
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode} at start")
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    ready[name] = now - start
                    log(f"{name} healthy after {ready[name]:.1f} s")
            except requests.RequestException:
                pass
        if now - last_print >= 5 and len(ready) < len(urls):
            last_print = now
            rss = sum(_rss(p) for p in procs.all_pids()) / 2**30
            waiting = ", ".join(n for n in urls if n not in ready)
            log(
                f"starting ... {now - start:.0f} s, waiting for {waiting} "
                f"(RSS of all servers {rss:.1f} GiB)"
            )
        time.sleep(0.5)
    return ready


def _rss(pid: int) -> int:
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:
        return 0


def wait_router(url: str, want: List[str], procs: Processes, timeout: float):
    """Wait until the router lists every worker URL in ``want``."""
    start = time.monotonic()
    body = None
    while time.monotonic() - start < timeout:
        if procs.procs["router"].poll() is not None:
            raise RuntimeError("router exited at start")
        try:
            r = requests.get(url + "/workers", timeout=2)
            if r.status_code == 200:
                body = r.text
                if all(w in body for w in want):
                    return time.monotonic() - start, r.json()
        except (requests.RequestException, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"router did not register {want} in {timeout:.0f} s: {body}")


# --------------------------------------------------------------------------
# load


class RequestLog:
    def __init__(self):
        self.rows: List[dict] = []
        self.lock = threading.Lock()

    def add(self, row: dict) -> None:
        with self.lock:
            self.rows.append(row)


# With --fault decode: prompts of this many tokens, so that each takes the prefill
# a while (~0.3 s here) and a decode has transfers due when it freezes.
LONG_PROMPT_TOKENS = 400
PROMPT_TOKENS: Optional[int] = None
# And this many requests at once, this long before decode 2 freezes: it has
# bootstrapped theirs (the prefill has its KV metadata) while the prefill is
# still computing them, as a decode under load always has.
FREEZE_BURST = 8
FREEZE_BURST_LEAD_S = 0.3


def one_request(url, rid, t0, timeout, out: RequestLog, rng_seed: int):
    rng = random.Random(rng_seed)
    body = {"rid": rid}
    if PROMPT_TOKENS:
        body["input_ids"] = [rng.randrange(10, 500) for _ in range(PROMPT_TOKENS)]
    else:
        body["text"] = " ".join(rng.choice(WORDS) for _ in range(rng.randint(12, 24)))
    body["sampling_params"] = {
        "max_new_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    sent = time.monotonic() - t0
    row = {"rid": rid, "t_send": sent}
    try:
        r = requests.post(url + "/generate", json=body, timeout=(5, timeout))
        row["status"] = r.status_code
        try:
            data = r.json()
        except ValueError:
            data = None
        if r.status_code == 200 and isinstance(data, dict):
            meta = data.get("meta_info") or {}
            finish = meta.get("finish_reason") or {}
            row["completion_tokens"] = meta.get("completion_tokens")
            row["finish_reason"] = finish
            if isinstance(finish, dict) and finish.get("type") == "abort":
                row["outcome"] = "aborted"
                row["error"] = str(finish.get("message"))
            else:
                row["outcome"] = "ok"
        else:
            row["outcome"] = "http_error"
            row["error"] = (r.text or "")[:400]
    except requests.Timeout:
        row["status"] = None
        row["outcome"] = "client_timeout"
        row["error"] = f"no answer within {timeout:.0f} s (client timeout)"
    except requests.RequestException as e:
        row["status"] = None
        row["outcome"] = "connection_error"
        row["error"] = str(e)[:400]
    row["t_end"] = time.monotonic() - t0
    row["latency"] = row["t_end"] - sent
    out.add(row)


def health_poller(url, t0, stop: threading.Event, rows: List[dict], interval=0.5):
    while not stop.is_set():
        start = time.monotonic()
        row = {"t": start - t0}
        try:
            r = requests.get(url + "/health", timeout=30)
            row["status"] = r.status_code
        except requests.RequestException as e:
            row["status"] = None
            row["error"] = type(e).__name__
        row["latency"] = time.monotonic() - start
        rows.append(row)
        stop.wait(max(0.0, interval - row["latency"]))


# The per-peer series (patches 12, 13) the report plots: the decode's view of each
# prefill, and the prefill's view of each decode.
PEER_SERIES = (
    "sglang:pd_prefill_held_tokens",
    "sglang:pd_prefill_held_reqs",
    "sglang:pd_prefill_fenced_tokens",
    "sglang:pd_prefill_waiting_reqs",
    "sglang:pd_prefill_state",
    "sglang:pd_prefill_fetches_in_flight",
    "sglang:pd_decode_oldest_chunk_age_seconds",
    "sglang:pd_decode_rooms_queued",
)


def scrape_peer_series(url, t0) -> List[dict]:
    """PEER_SERIES on ``url``/metrics now, as Prometheus would see them; none
    from a stock server, or a frozen one."""
    from prometheus_client.parser import text_string_to_metric_families

    start, rows = time.monotonic(), []
    try:
        text = requests.get(url + "/metrics", timeout=5).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in PEER_SERIES:
                    rows.append(
                        {"t": start - t0, "name": sample.name,
                         "labels": sample.labels, "value": sample.value}
                    )  # fmt: skip
    except (requests.RequestException, ValueError):
        pass
    return rows


def metrics_poller(url, t0, stop: threading.Event, rows: List[dict], interval=1.0):
    """Scrape ``url``/metrics every ``interval`` s for PEER_SERIES."""
    while not stop.is_set():
        start = time.monotonic()
        rows += scrape_peer_series(url, t0)
        stop.wait(max(0.0, interval - (time.monotonic() - start)))


def client_ticker(t0, stop: threading.Event, stalls: List[dict], tick=0.05):
    """Record when this client process itself could not run on time: a
    /health poll or request sent across such a gap measures the client's
    stall as much as the server's. A gap is a tick that woke > 0.25 s late."""
    last = time.monotonic()
    while not stop.wait(tick):
        now = time.monotonic()
        if now - last - tick > 0.25:
            stalls.append({"t": last - t0, "gap": now - last - tick})
        last = now


class MemorySampler(threading.Thread):
    def __init__(self, procs: Processes, interval=1.0):
        super().__init__(daemon=True)
        self.procs = procs
        self.interval = interval
        self.stop_event = threading.Event()
        self.peak_total = 0
        self.peak_pss_total = 0
        self.peak_by_name: Dict[str, int] = {}
        self.min_available = psutil.virtual_memory().available
        self._n = 0
        # CPU: pid -> CPU seconds when last seen (this process included), and
        # (monotonic time, busy CPU seconds of the machine, of this run).
        self.cpu_by_pid: Dict[int, float] = {}
        self.cpu_samples: List[tuple] = []

    def sample(self, pss: bool = False) -> None:
        total = 0
        pss_total = 0
        for p in [psutil.Process()] + [
            p for name in list(self.procs.procs) for p in self.procs.tree(name)
        ]:
            try:
                t = p.cpu_times()
                self.cpu_by_pid[p.pid] = t.user + t.system
            except psutil.Error:
                pass
        t = psutil.cpu_times()
        busy = t.user + t.nice + t.system
        busy += sum(getattr(t, k, 0.0) for k in ("irq", "softirq", "steal"))
        self.cpu_samples.append((time.monotonic(), busy, sum(self.cpu_by_pid.values())))
        # RSS counts pages shared between processes (torch, CUDA libraries)
        # once per process; PSS splits them. PSS reads smaps: every 5th sample.
        pss = pss or self._n % 5 == 0
        self._n += 1
        for name in list(self.procs.procs):
            rss = 0
            for p in self.procs.tree(name):
                try:
                    if pss:
                        info = p.memory_full_info()
                        rss += info.rss
                        pss_total += info.pss
                    else:
                        rss += p.memory_info().rss
                except psutil.Error:
                    pass
            total += rss
            self.peak_by_name[name] = max(self.peak_by_name.get(name, 0), rss)
        self.peak_total = max(self.peak_total, total)
        self.peak_pss_total = max(self.peak_pss_total, pss_total)
        self.min_available = min(self.min_available, psutil.virtual_memory().available)

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.sample()
            self.stop_event.wait(self.interval)

    def cpu_use(self, start: float, end: float) -> Optional[dict]:
        """CPU cores in use on average in [start, end] (monotonic): the whole
        machine, this run's processes, and everything else (other users)."""
        inside = [x for x in self.cpu_samples if start - 0.5 <= x[0] <= end + 1.5]
        if len(inside) < 2:
            return None
        (t1, busy1, ours1), (t2, busy2, ours2) = inside[0], inside[-1]
        wall = t2 - t1
        return {
            "seconds": wall,
            "machine_cores": (busy2 - busy1) / wall,
            "demo_cores": (ours2 - ours1) / wall,
            "other_cores": max(0.0, (busy2 - busy1) - (ours2 - ours1)) / wall,
        }


def decode_request_log(log_dir: Path, t0_wall: float):
    """From the decode's JSON request log (the decode is never frozen, so it
    logs every request it gets): rid -> bootstrap ports the router injected,
    and rid -> how the decode server ended the request."""
    ports: Dict[str, List[int]] = {}
    verdicts: Dict[str, List[dict]] = {}
    received: Dict[str, List[float]] = {}
    for path in sorted(log_dir.glob("*.log*")):
        for line in path.read_text(errors="replace").splitlines():
            start = line.find("{")
            if start < 0 or '"event": "request.' not in line:
                continue
            try:
                data = json.loads(line[start:])
            except ValueError:
                continue
            obj = data.get("obj") or {}
            rid = data.get("rid") or obj.get("rid")
            if isinstance(rid, list):
                rid = rid[0] if rid else None
            if rid is None:
                continue
            rid = str(rid)
            if data.get("event") == "request.received":
                port = obj.get("bootstrap_port")
                if isinstance(port, list):
                    port = port[0] if port else None
                if port is not None:
                    ports.setdefault(rid, []).append(int(port))
                    ts = datetime.fromisoformat(data["timestamp"]).timestamp()
                    received.setdefault(rid, []).append(ts - t0_wall)
            elif data.get("event") == "request.finished":
                meta = (data.get("out") or {}).get("meta_info") or {}
                finish = meta.get("finish_reason") or {}
                ts = datetime.fromisoformat(data["timestamp"]).timestamp()
                aborted = isinstance(finish, dict) and finish.get("type") == "abort"
                verdicts.setdefault(rid, []).append(
                    {
                        "t_end": ts - t0_wall,
                        "outcome": "aborted" if aborted else "ok",
                        "error": finish.get("message") if aborted else None,
                        "status_code": finish.get("status_code"),
                        "e2e_latency": meta.get("e2e_latency"),
                    }
                )
    return ports, verdicts, received


def attribute_decodes(
    rows: List[dict], decode_logs: Dict[str, Path], t0_wall, frozen: str
):
    """With two decodes: the decode the router picked for each request, and how
    that decode ended it. The router sends a request's decode leg when it gets
    the request, so the decode that logs it within ROUTED_WITHIN_S of the send
    got it first. A frozen decode logs a request only once it runs again, if at
    all: a request no decode logged that soon went to the frozen one."""
    logs = {name: decode_request_log(d, t0_wall) for name, d in decode_logs.items()}
    for r in rows:
        seen = sorted(
            (t, name)
            for name, (_, _, received) in logs.items()
            for t in received.get(r["rid"], [])
        )
        first = [name for t, name in seen if t - r["t_send"] < ROUTED_WITHIN_S]
        r["server"] = first[0] if first else (frozen if seen else None)
        r["router_retries"] = max(0, len(seen) - 1)
        r["decode"] = logs[r["server"]][1].get(r["rid"], []) if r["server"] else []
        r["decode_received"] = [t for t, _ in seen]


ROUTED_WITHIN_S = 5.0


def calibrate(url: str, prefix: str, seconds: float) -> dict:
    """Closed loop through the router, both prefills healthy: CALIBRATION_CLIENTS
    clients, each sends the demo's request again as soon as its last one is
    answered. Capacity = requests answered per second after the ramp."""
    reqs = RequestLog()
    t0 = time.monotonic()
    stop_at = t0 + seconds
    counter = iter(range(1_000_000))
    counter_lock = threading.Lock()

    def client():
        while time.monotonic() < stop_at:
            with counter_lock:
                i = next(counter)
            one_request(url, f"{prefix}-{i:04d}", t0, 30, reqs, 20_000 + i)

    threads = [
        threading.Thread(target=client, daemon=True) for _ in range(CALIBRATION_CLIENTS)
    ]
    stalls: List[dict] = []
    stop_ticker = threading.Event()
    ticker = threading.Thread(
        target=client_ticker, args=(t0, stop_ticker, stalls), daemon=True
    )
    ticker.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=max(0.0, stop_at + CALIBRATION_DRAIN_S - time.monotonic()))
    stop_ticker.set()
    open_clients = sum(t.is_alive() for t in threads)
    with reqs.lock:
        rows = sorted(reqs.rows, key=lambda r: r["t_send"])
    window = (CALIBRATION_RAMP_S, seconds)
    # A machine pause in the window is not the servers' capacity.
    stalled = stalled_within(window[0], window[1], stalls)
    counted = [
        r for r in rows if r["outcome"] == "ok" and window[0] <= r["t_end"] < window[1]
    ]
    lat = [r["latency"] for r in counted]
    return {
        "clients": CALIBRATION_CLIENTS,
        "seconds": seconds,
        "window": list(window),
        "sent": len(rows) + open_clients,
        "answered_ok": sum(1 for r in rows if r["outcome"] == "ok"),
        "not_ok": [r for r in rows if r["outcome"] != "ok"],
        "open_at_end": open_clients,
        "ended_s": time.monotonic() - t0,
        "counted": len(counted),
        "capacity_rps": len(counted) / (window[1] - window[0]),
        "latency_p50": quantile(lat, 0.5),
        "latency_p90": quantile(lat, 0.9),
        "latency_max": max(lat, default=None),
        "client_stalls": stalls,
        "client_stalled_s": stalled,
        "requests": rows,
        "t0_monotonic": t0,
    }


SERVING_INPUT_LEN, SERVING_OUTPUT_LEN = 256, 32
SERVING_SECONDS = 60.0  # of offered load at half the capacity
SERVING_SATURATION = (64, 8)  # prompts, at most in flight (CALIBRATION_CLIENTS)


def serving_bench(url: str, model: Path, capacity: float, out: Path) -> dict:
    """sglang's own load generator through the router, no fault: at half the
    calibrated capacity, then at saturation. Its JSONL result per phase."""
    half = max(0.25, capacity / 2)
    phases = {
        "half": (["--request-rate", f"{half:.3f}"], int(half * SERVING_SECONDS)),
        "saturation": (
            ["--request-rate", "inf", "--max-concurrency", str(SERVING_SATURATION[1])],
            SERVING_SATURATION[0],
        ),
    }
    results = {}
    for name, (rate_args, prompts) in phases.items():
        path = out / f"serving-{name}.jsonl"
        cmd = [sys.executable, "-m", "sglang.benchmark.serving",
               "--backend", "sglang", "--base-url", url,
               "--dataset-name", "random-ids", "--tokenizer", str(model),
               "--num-prompts", str(max(8, prompts)),
               "--random-input-len", str(SERVING_INPUT_LEN),
               "--random-output-len", str(SERVING_OUTPUT_LEN),
               "--random-range-ratio", "1.0", "--seed", "1",
               "--disable-tqdm", "--output-file", str(path), *rate_args]  # fmt: skip
        log(f"serving bench {name}: {' '.join(cmd[3:])}")
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        (out / f"serving-{name}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0 or not path.is_file():
            raise RuntimeError(
                f"sglang.benchmark.serving ({name}) failed, rc={proc.returncode}: "
                f"{(proc.stdout + proc.stderr)[-2000:]}"
            )
        results[name] = json.loads(path.read_text().strip().splitlines()[-1])
        r = results[name]
        log(
            f"serving bench {name}: {r['completed']} completed, "
            f"{r['request_throughput']:.2f} req/s; TTFT median "
            f"{r['median_ttft_ms']:.0f} ms, p99 {r['p99_ttft_ms']:.0f} ms; ITL "
            f"median {r['median_itl_ms']:.1f} ms, p99 {r['p99_itl_ms']:.1f} ms"
        )
    return results


def _other_run(path: Path) -> Optional[dict]:
    """The result.json of another run, for its rate; None (logged) if absent."""
    path = path / "result.json" if path.is_dir() else path
    try:
        other = json.loads(path.read_text())
        float(other["rate"]), other["variant"]["label"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        log(f"--rate-from {path}: no rate there ({e!r}); using this run's own")
        return None
    return other


def _fmt_s(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


def choose_rate(capacity: float) -> dict:
    """RATE_SHARE of the capacity, rounded down to RATE_STEP, within
    [RATE_FLOOR, RATE_CAP]; with the reason in words."""
    share = RATE_SHARE * capacity
    rate = min(RATE_CAP, max(RATE_FLOOR, math.floor(share / RATE_STEP) * RATE_STEP))
    why = (
        f"{RATE_SHARE:g} x the measured {capacity:.2f} req/s = {share:.2f} req/s, "
        f"rounded down to a multiple of {RATE_STEP:g}"
    )
    if share >= RATE_CAP:
        why += f", capped at {RATE_CAP:g} (the rate of the earlier demo results)"
    elif share < RATE_FLOOR:
        why += (
            f", raised to the floor {RATE_FLOOR:g} (fewer requests would leave the "
            "phases nearly empty)"
        )
    if rate >= capacity:
        why += "; THIS MACHINE CANNOT SUSTAIN IT, the healthy phase will queue"
    return {
        "source": "calibration",
        "rate": rate,
        "capacity_rps": capacity,
        "share": RATE_SHARE,
        "step": RATE_STEP,
        "floor": RATE_FLOOR,
        "cap": RATE_CAP,
        "why": why,
    }


# --------------------------------------------------------------------------
# main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", choices=("mooncake", "nixl"), default="mooncake")
    ap.add_argument("--out", type=Path, required=True, help="output directory")
    ap.add_argument("--freeze-seconds", type=float, default=60.0)
    ap.add_argument(
        "--rate",
        type=float,
        default=None,
        help="requests per second (default: calibrated to this machine)",
    )
    ap.add_argument(
        "--calibrate-seconds",
        type=float,
        default=CALIBRATION_SECONDS,
        help="length of the load calibration (ignored with --rate)",
    )
    ap.add_argument(
        "--rate-from",
        type=Path,
        default=None,
        help="send the rate another run chose (its result.json or out dir); "
        "this run still calibrates, to start from the same state, and reports it",
    )
    ap.add_argument(
        "--quick", action="store_true", help="short phases (10 s / 30 s / 10 s)"
    )
    ap.add_argument(
        "--fault",
        choices=("bootstrap", "scheduler", "decode"),
        default="bootstrap",
        help="what of prefill 2 is frozen: the process of its HTTP and bootstrap "
        "servers, or its scheduler process alone (both servers keep answering); "
        "decode: one prefill and two decodes instead, decode 2 frozen whole",
    )
    ap.add_argument(
        "--allocation-policy",
        choices=("early", "prefill_complete"),
        default="early",
        help="--disaggregation-decode-allocation-policy of every server",
    )
    ap.add_argument(
        "--router-defaults",
        action="store_true",
        help="run sglang-router with its defaults and the decode with sglang's "
        "waiting timeout, not ROUTER_PD_SETTINGS and DECODE_WAITING_TIMEOUT_S",
    )
    ap.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="prompts of this many token ids, not 12-24 words (--fault decode: "
        f"{LONG_PROMPT_TOKENS} by default), so that a hung prefill holds real KV",
    )
    ap.add_argument(
        "--serving",
        action="store_true",
        help="no fault: after calibrating, run sglang.benchmark.serving through "
        "the router at half the capacity and at saturation (bench F)",
    )
    ap.add_argument("--model-dir", type=Path, default=None, help="model cache dir")
    return ap.parse_args(argv)


def run(args, procs: Processes) -> dict:
    t_run = time.monotonic()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    variant = describe_variant()
    log(
        f"variant {variant['label']!r}: sglang {variant['sglang_version']} from "
        f"{variant['sglang_dir']}; backend {args.backend}"
    )
    if variant["label"] == "stock":
        log(
            "stock = pristine sglang 0.5.23 disaggregation files + ONLY the "
            "CPU-enablement hunks (sglang_pd_patch/cpu_enable.patch); pristine "
            "0.5.23 crashes on a CPU-only machine"
        )
    if not variant["cpu_enabled"]:
        raise SystemExit(
            "this sglang lacks the CPU-enablement hunks: Mooncake's prefill would "
            "take the CUDA-only index path; apply sglang_pd_patch/cpu_enable.patch"
        )
    before = 10.0 if args.quick else 20.0
    freeze = 30.0 if args.quick else args.freeze_seconds
    after = 10.0 if args.quick else 30.0
    # After the last request is sent, wait this long for open requests. The
    # router holds a request until BOTH its prefill and decode legs answer.
    drain_cap = 45.0 if args.quick else 60.0

    model = ensure_tiny_gpt2(args.model_dir)
    log(f"model: {model}")
    env = server_env(args.backend)
    p1, b1, p2, b2, dport, rport, prom = free_ports(7)
    decode_fault = args.fault == "decode"
    global PROMPT_TOKENS
    PROMPT_TOKENS = args.prompt_tokens or (LONG_PROMPT_TOKENS if decode_fault else None)
    req_log_dir = out / "decode-requests"
    prefill_extra = ["--disable-radix-cache", "--disaggregation-bootstrap-port"]

    def decode_extra(log_dir: Path) -> List[str]:
        return ["--disaggregation-decode-retraction-backup", "cpu_tensor",
                "--log-requests", "--log-requests-level", "0",
                "--log-requests-format", "json",
                "--log-requests-target", str(log_dir)]  # fmt: skip

    servers = {"prefill1": (p1, prefill_extra + [str(b1)])}
    decode_logs = {}
    port_blocks = []
    if decode_fault:
        # One prefill, two decodes; decode 2 is the sick one. Their Mooncake
        # ports are chosen so that 0.5.23 puts both decodes' rooms on the same
        # of the prefill's transfer queues (in a fleet, any two decodes share
        # one with probability 1/4).
        for name, port in (("decode1", dport), ("decode2", p2)):
            decode_logs[name] = out / f"{name}-requests"
            servers[name] = (port, decode_extra(decode_logs[name]))
        if args.backend == "mooncake":
            sys.path.insert(0, str(REPO / "test" / "pd_loopback"))
            from mirror import PortBlock

            port_blocks = [PortBlock(0), PortBlock(0)]
    else:
        servers["prefill2"] = (p2, prefill_extra + [str(b2)])
        servers["decode"] = (dport, decode_extra(req_log_dir))
        decode_logs["decode"] = req_log_dir
    urls = {}
    t_start = time.monotonic()
    for name, (port, extra) in servers.items():
        role = "prefill" if name.startswith("prefill") else "decode"
        cmd = server_cmd(model, role, port, args, extra)
        server_env_ = dict(env)
        if role == "decode" and not args.router_defaults:
            server_env_["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] = str(
                DECODE_WAITING_TIMEOUT_S
            )
        if role == "decode" and port_blocks:
            server_env_.update(port_blocks[len(urls) - 1].env())
        procs.start(name, cmd, server_env_, out / f"{name}.log")
        urls[name] = f"http://{HOST}:{port}"
    # The router starts alongside and registers the servers once they are up.
    router_url = f"http://{HOST}:{rport}"
    workers_args = (
        ["--prefill", urls["prefill1"], str(b1),
         "--decode", urls["decode1"], "--decode", urls["decode2"]]
        if decode_fault
        else ["--prefill", urls["prefill1"], str(b1),
              "--prefill", urls["prefill2"], str(b2), "--decode", urls["decode"]]
    )  # fmt: skip
    router_cmd = [
        sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
        *workers_args,
        "--host", HOST, "--port", str(rport),
        "--prometheus-host", HOST, "--prometheus-port", str(prom),
        "--policy", "round_robin",
        "--worker-startup-check-interval", "2",
    ]  # fmt: skip
    if not args.router_defaults:
        router_cmd += ROUTER_REQUEST_TIMEOUT + ROUTER_PD_SETTINGS
    procs.start("router", router_cmd, env, out / "router.log")
    log(f"started 3 servers + router (logs in {out}); waiting for /health")
    mem = MemorySampler(procs)
    mem.start()
    try:
        ready = wait_healthy(urls, procs, timeout=400)
    finally:
        for block in port_blocks:
            block.release()
    startup = time.monotonic() - t_start
    _, workers = wait_router(router_url, list(urls.values()), procs, 120)
    router_ready = time.monotonic() - t_start
    log(f"router registered its 3 workers {router_ready:.1f} s after launch")

    # Warm-up: until each prefill has served one request through the router.
    warm = RequestLog()
    t0 = time.monotonic()
    for i in range(6):
        one_request(router_url, f"warm-{i}", t0, 60, warm, 10_000 + i)
    bad = [r for r in warm.rows if r["outcome"] != "ok"]
    if bad:
        raise RuntimeError(f"warm-up requests failed: {bad}")
    time.sleep(1.0)  # the request log is written asynchronously
    if decode_fault:
        served = {
            name
            for name, log_dir in decode_logs.items()
            if any(
                r["rid"] in decode_request_log(log_dir, time.time())[0]
                for r in warm.rows
            )
        }
        if served != set(decode_logs):
            raise RuntimeError(f"warm-up did not reach both decodes (only {served})")
    else:
        ports, _, _ = decode_request_log(req_log_dir, time.time())
        warm_ports = {p for r in warm.rows for p in ports.get(r["rid"], [])}
        if warm_ports != {b1, b2}:
            raise RuntimeError(
                f"warm-up did not reach both prefills (bootstrap ports seen "
                f"{sorted(warm_ports)}, want {sorted({b1, b2})})"
            )
    log(
        f"warm-up ok, both {'decodes' if decode_fault else 'prefills'} served; latency "
        + ", ".join(f"{r['latency']:.2f}" for r in warm.rows)
        + " s"
    )

    if decode_fault:
        # The whole server: its HTTP server and its scheduler.
        frozen_pid = procs.procs["decode2"].pid
        log(f"decode2's process group is {frozen_pid}")
    elif args.fault == "scheduler":
        # Its HTTP and bootstrap servers keep answering: a hung scheduler.
        frozen_pid = scheduler_pid(procs, "prefill2")
        if frozen_pid is None:
            raise RuntimeError("no scheduler process of prefill2 found")
        log(f"prefill2's scheduler is pid {frozen_pid}")
    else:
        frozen_pid = listener_pid(procs, "prefill2", b2)
        if frozen_pid is None:
            raise RuntimeError(f"no process of prefill2 listens on bootstrap port {b2}")
        log(
            f"prefill2's bootstrap server :{b2} is hosted by pid {frozen_pid} "
            f"(the launch_server process is pid {procs.procs['prefill2'].pid})"
        )

    # The load: what this machine serves with both prefills healthy.
    calibration = None
    if args.rate is not None:
        rate = args.rate
        rate_choice = {"source": "--rate", "rate": rate, "why": "given with --rate"}
        log(f"rate {rate:g} req/s (given with --rate; no calibration)")
    else:
        log(
            f"calibrating the load: {CALIBRATION_CLIENTS} clients back to back "
            f"through the router for {args.calibrate_seconds:.0f} s, both "
            "prefills healthy"
        )
        attempts = []
        for attempt in range(CALIBRATION_ATTEMPTS):
            c = calibrate(
                router_url,
                f"calib{attempt}-{variant['label']}-{args.backend}",
                args.calibrate_seconds,
            )
            attempts.append(c)
            if c["client_stalled_s"] <= CALIBRATION_MAX_STALL_S:
                break
            log(
                f"calibration: this demo process itself was stalled "
                f"{c['client_stalled_s']:.1f} s of the counted window (the machine "
                f"paused; it measured {c['capacity_rps']:.2f} req/s), so it does "
                "not measure the servers"
                + ("; calibrating again" if attempt + 1 < CALIBRATION_ATTEMPTS else "")
            )
        calibration = c = min(attempts, key=lambda a: a["client_stalled_s"])
        c["attempts"] = [
            {
                "capacity_rps": a["capacity_rps"],
                "client_stalled_s": a["client_stalled_s"],
            }
            for a in attempts
        ]
        t_cal = c.pop("t0_monotonic")
        c["cpu"] = mem.cpu_use(t_cal + c["window"][0], t_cal + c["window"][1])
        log(
            f"calibration: {c['counted']} answered in t={c['window'][0]:.0f}-"
            f"{c['window'][1]:.0f} s = {c['capacity_rps']:.2f} req/s, latency p50 "
            f"{_fmt_s(c['latency_p50'])} / p90 {_fmt_s(c['latency_p90'])} s; "
            f"{len(c['not_ok'])} not ok, {c['open_at_end']} still open after "
            f"{c['ended_s']:.0f} s"
        )
        if c["cpu"]:
            log(
                f"calibration: CPU cores in use {c['cpu']['machine_cores']:.2f} of "
                f"{os.cpu_count()}, {c['cpu']['other_cores']:.2f} of them by "
                "processes outside this demo"
            )
        if c["answered_ok"] == 0 or len(c["not_ok"]) > c["answered_ok"]:
            raise RuntimeError(
                f"calibration failed: {c['answered_ok']} ok, {len(c['not_ok'])} not "
                f"ok: {[r.get('error') for r in c['not_ok'][:3]]}"
            )
        rate_choice = choose_rate(c["capacity_rps"])
        other = _other_run(args.rate_from) if args.rate_from else None
        if other is not None:
            theirs = (other.get("calibration") or {}).get("capacity_rps")
            theirs = "--rate" if theirs is None else f"it measured {theirs:.2f} req/s"
            label = other["variant"]["label"]
            rate_choice = {
                "source": "rate-from",
                "rate": other["rate"],
                "from": str(args.rate_from),
                "from_label": label,
                "own": rate_choice,
                "why": f"the {label} run's rate ({theirs}); this run alone would "
                f"send {rate_choice['rate']:g}",
            }
        rate = rate_choice["rate"]
        log(f"rate {rate:g} req/s: {rate_choice['why']}")
        time.sleep(2.0)  # let the servers settle before the measured run
    if args.serving:
        # Both variants offer the same load: the first run's capacity.
        capacity = (calibration or {}).get("capacity_rps") or 2 * rate
        other = _other_run(args.rate_from) if args.rate_from else None
        capacity = (other or {}).get("serving_capacity", capacity)
        mem.stop_event.set()
        return {
            "variant": variant,
            "backend": args.backend,
            "rate": rate,
            "calibration": calibration,
            "serving_capacity": capacity,
            "serving": serving_bench(router_url, model, capacity, out),
            "memory": {
                "peak_total_rss_bytes": mem.peak_total,
                "peak_total_pss_bytes": mem.peak_pss_total,
            },
        }

    # The run: a trickle of requests; prefill2 frozen in [before, before+freeze).
    reqs = RequestLog()
    health: List[dict] = []
    stop_health = threading.Event()
    t0 = time.monotonic()
    t0_wall = time.time()
    # The decode's /health, or with a sick decode, the prefill's.
    health_of = "prefill1" if decode_fault else "decode"
    hp = threading.Thread(
        target=health_poller,
        args=(urls[health_of], t0, stop_health, health),
        daemon=True,
    )
    hp.start()
    # The decode's series per prefill, or with a sick decode, the prefill's
    # per decode.
    peer_metrics: List[dict] = []
    mp = threading.Thread(
        target=metrics_poller,
        args=(urls["prefill1" if decode_fault else "decode"], t0, stop_health,
              peer_metrics),
        daemon=True,
    )  # fmt: skip
    mp.start()
    client_stalls: List[dict] = []
    ticker = threading.Thread(
        target=client_ticker,
        args=(t0, stop_health, client_stalls),
        daemon=True,
    )
    ticker.start()
    pool = ThreadPoolExecutor(max_workers=512)
    total = before + freeze + after
    interval = 1.0 / rate
    client_timeout = total + drain_cap + 5.0
    n = 0
    freeze_at = before
    thaw_at = before + freeze
    window: List[Optional[float]] = [None, None]
    frozen_name = "decode2" if decode_fault else "prefill2"
    log(
        f"sending {rate:g} req/s for {total:.0f} s; {frozen_name} frozen from "
        f"t={freeze_at:.0f} s to t={thaw_at:.0f} s"
    )
    next_progress = 10.0
    burst: List[tuple] = []
    while True:
        now = time.monotonic() - t0
        if window[0] is None and now >= freeze_at:
            procs.freeze(frozen_pid, group=decode_fault)
            window[0] = time.monotonic() - t0
            log(f"SIGSTOP pid {frozen_pid} ({frozen_name}) at t={window[0]:.1f} s")
        if window[0] is not None and window[1] is None and now >= thaw_at:
            procs.thaw()
            window[1] = time.monotonic() - t0
            log(f"SIGCONT pid {frozen_pid} ({frozen_name}) at t={window[1]:.1f} s")
        if now >= total:
            break
        if decode_fault and not burst and now >= freeze_at - FREEZE_BURST_LEAD_S:
            for k in range(FREEZE_BURST):
                rid = f"{variant['label']}-{args.backend}-burst-{k}"
                burst.append((rid, now))
                pool.submit(
                    one_request, router_url, rid, t0, client_timeout - now, reqs, -1 - k
                )
            log(f"sent {FREEZE_BURST} requests at once at t={now:.1f} s")
        if now >= n * interval:
            rid = f"{variant['label']}-{args.backend}-{n:04d}"
            timeout = client_timeout - n * interval
            pool.submit(one_request, router_url, rid, t0, timeout, reqs, n)
            n += 1
        if now >= next_progress:
            next_progress += 10.0
            with reqs.lock:
                done = list(reqs.rows)
            recent = [r["latency"] for r in done if r["t_end"] > now - 10]
            hl = [h["latency"] for h in health if h["t"] > now - 10]
            log(
                f"t={now:.0f} s: sent {n}, answered {len(done)}; last 10 s: "
                f"max latency {max(recent, default=float('nan')):.1f} s, "
                f"{health_of} /health max {max(hl, default=float('nan')):.2f} s"
            )
        time.sleep(min(0.05, max(0.0, n * interval - now)))

    log(f"load done ({n} requests); waiting up to {drain_cap:.0f} s for the rest")
    drain_deadline = time.monotonic() + drain_cap
    while time.monotonic() < drain_deadline:
        with reqs.lock:
            if len(reqs.rows) >= n + len(burst):
                break
        time.sleep(0.5)
    stop_health.set()
    hp.join(timeout=15)
    mp.join(timeout=15)
    # Which server each peer label is: a prefill by its bootstrap port, a
    # decode by its Mooncake RPC port block.
    peer_names = {f"{HOST}:{b1}": "prefill1", f"{HOST}:{b2}": "prefill2"}
    for name, block in zip(("decode1", "decode2"), port_blocks):
        for port in range(block.base, block.base + 5):
            peer_names[f"{HOST}:{port}"] = name
    pool.shutdown(wait=False, cancel_futures=True)
    t_cut = time.monotonic() - t0
    with reqs.lock:
        rows = list(reqs.rows)
    done_rids = {r["rid"] for r in rows}
    expected = [
        (f"{variant['label']}-{args.backend}-{i:04d}", i * interval) for i in range(n)
    ]
    for rid, t_send in expected + burst:
        if rid not in done_rids:
            rows.append(
                {
                    "rid": rid,
                    "t_send": t_send,
                    "t_end": None,
                    "latency": None,
                    "status": None,
                    "outcome": "open",
                    "error": f"no answer from the router by t={t_cut:.0f} s "
                    "(the demo stopped waiting)",
                }
            )
    time.sleep(1.0)  # let the decode flush its request log
    if decode_fault:
        attribute_decodes(rows, decode_logs, t0_wall, "decode2")
    else:
        ports, verdicts, received = decode_request_log(req_log_dir, t0_wall)
        by_port = {b1: "prefill1", b2: "prefill2"}
        for r in rows:
            seen = ports.get(r["rid"], [])
            r["bootstrap_ports"] = seen
            # The prefill the router picked; a router retry (to either prefill)
            # shows up as a second entry at the decode.
            r["prefill"] = r["server"] = by_port.get(seen[0]) if seen else None
            r["router_retries"] = max(0, len(seen) - 1)
            r["decode"] = verdicts.get(r["rid"], [])
            r["decode_received"] = received.get(r["rid"], [])
    rows.sort(key=lambda r: r["t_send"])
    mem.sample(pss=True)
    mem.stop_event.set()
    bounds = {
        "before": (0.0, window[0]),
        "during": (window[0], window[1]),
        "after": (window[1], total),
    }
    cpu = {ph: mem.cpu_use(t0 + a, t0 + b) for ph, (a, b) in bounds.items()}

    return {
        "variant": variant,
        "backend": args.backend,
        "rate": rate,
        "rate_choice": rate_choice,
        "calibration": calibration,
        "cpu_cores": cpu,
        "phases": {"before": before, "freeze": freeze, "after": after},
        "freeze_window": window,
        "t0_wall": t0_wall,
        "t_cut": t_cut,
        "allocation_policy": args.allocation_policy,
        "frozen": {
            "server": frozen_name,
            "kind": "decode" if decode_fault else "prefill",
            "what": args.fault,
            "pid": frozen_pid,
            "launch_pid": procs.procs[frozen_name].pid,
            "bootstrap_port": None if decode_fault else b2,
        },
        "healthy": "decode1" if decode_fault else "prefill1",
        "health_of": health_of,
        "ports": {name: port for name, (port, _) in servers.items()},
        "router": {"policy": "round_robin", "workers": workers,
                   "cmd": router_cmd, "defaults": args.router_defaults},
        "decode_waiting_timeout_s": (
            None if args.router_defaults else DECODE_WAITING_TIMEOUT_S),
        "prompt_tokens": PROMPT_TOKENS,
        "startup_s": {"servers_healthy": startup, **ready,
                      "router_registered": router_ready},
        "requests": rows,
        "warmup": warm.rows,
        "health": health,
        "peer_metrics": peer_metrics,
        "peer_names": peer_names,
        "client_stalls": client_stalls,
        "drain_cap_s": drain_cap,
        "memory": {
            "peak_total_rss_bytes": mem.peak_total,
            "peak_total_pss_bytes": mem.peak_pss_total,
            "peak_rss_bytes": mem.peak_by_name,
            "min_available_bytes": mem.min_available,
        },
        "machine": {"cpus": os.cpu_count(),
                    "mem_total_bytes": psutil.virtual_memory().total,
                    "loadavg_at_end": os.getloadavg()},
        "run_s": time.monotonic() - t_run,
    }  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    procs = Processes()
    atexit.register(procs.stop_all)

    def on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    # SIGINT too: a shell that starts us in the background leaves it ignored.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    t = time.monotonic()
    result = None
    try:
        result = run(args, procs)
    except KeyboardInterrupt:
        log("interrupted; stopping every process this run started")
        return 130
    finally:
        t_stop = time.monotonic()
        procs.stop_all()
        log(f"stopped all processes in {time.monotonic() - t_stop:.1f} s")
    result["run_s"] = time.monotonic() - t
    path = args.out / "result.json"
    path.write_text(json.dumps(result, indent=1))
    mem = result["memory"]
    log(
        f"done in {result['run_s']:.0f} s; peak memory of all servers + router: "
        f"PSS {mem['peak_total_pss_bytes'] / 2**30:.2f} GiB (RSS summed over "
        f"processes {mem['peak_total_rss_bytes'] / 2**30:.2f} GiB); results in "
        f"{path}"
    )
    if "serving" in result:
        return 0
    from demo_report import summarize_text

    print(summarize_text(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
