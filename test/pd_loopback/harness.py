"""Real prefill/decode disaggregation on 127.0.0.1, for tests and the stall bench.

What runs for real
------------------
- N prefill processes (``prefill_worker.py``), each hosting the backend's real
  bootstrap server and a real PREFILL-mode ``MooncakeKVManager`` /
  ``NixlKVManager``, sending KV through the real ``KVSender`` API.
- In this process, the DECODE side: a real DECODE-mode KV manager (with its
  heartbeat and listener threads) and a real ``DecodePreallocQueue`` whose
  ``add()``, ``_resolve_pending_reqs()`` (with ``_ensure_prefill_info`` and
  ``_init_receiver``) and ``_update_handshake_waiters()`` are the 0.5.23 /
  patched code, unmodified. KV moves over the backend's TCP transport into a
  CPU ``MHATokenToKVPool`` and is compared byte for byte.

What is replaced (scheduler-owned pieces the pending-resolution path does not
exercise)
----------------------------------------------------------------------------
- The ``Scheduler`` passed to ``DecodePreallocQueue.__init__`` is
  ``_SchedulerStub``: server args, a TP worker that is not hybrid-SWA, metrics
  off, an output streamer that drops output, a random seed.
- ``DecodePreallocQueue._init_kv_manager`` is overridden (``_LoopbackPreallocQueue``)
  to return a manager built by ``pd_setup.make_decode_manager``, which builds
  ``KVArgs`` field by field as the real method does; the only deviation is
  NIXL memory registered as DRAM. The rest of ``__init__`` is the real one.
- ``get_parallel().attn_tp_group`` is stated as a one-rank group
  (``_SingleRankGroup``, ``size() == 1``), so the poll all-reduce in
  ``_update_handshake_waiters`` is the identity, as on a TP=1 decode. No
  torch.distributed group exists.
- No ``req_to_token_pool``, tree cache, running batch or ``DecodeTransferQueue``:
  ``DecodeSide.step()`` does what ``pop_preallocated()`` and
  ``pop_transferred()`` would do for the requests it owns: allocate KV slots
  from a real ``TokenToKVPoolAllocator`` and a metadata slot, call
  ``kv_receiver.send_metadata``, poll the receiver, drop aborted requests from
  ``queue``/``pending_reqs``. ``step()`` is the "decode scheduling call" whose
  duration the tests bound and the bench reports; ``add()`` calls are timed
  too. Both record the HTTP requests the calling (scheduler) thread sends,
  through the interpreter's ``http.client.send`` audit event.
- ``kv_manager.prefill_info_table`` is swapped for a dict subclass that
  timestamps insertions (observation only: when a fetch landed).

Faults: ``PrefillProcess.freeze()`` / ``resume()`` / ``kill()`` send SIGSTOP /
SIGCONT / SIGKILL; ``PrefillProcess.set_fault()`` makes that prefill's
bootstrap server delay or answer an HTTP error on decode-facing requests (an
aiohttp middleware inside the prefill process, see ``prefill_worker.py``).
``Blackhole`` is a listening socket that never accepts: a frozen bootstrap
server as seen from the network, costing no process.

Setup requirements
------------------
- Python packages (in the project venv): ``sglang==0.5.23``,
  ``mooncake-transfer-engine-non-cuda``, ``nixl``.
- Debian package ``libibverbs1`` (brings ``libnl-3-200``, ``libnl-route-3-200``):
  the Mooncake transfer engine loads it even for its TCP transport.
- The environment of ``pd_setup.LOOPBACK_ENV`` (``MC_FORCE_TCP=1
  MOONCAKE_PROTOCOL=tcp SGLANG_HOST_IP=127.0.0.1``) and, unless already set,
  ``UCX_MODULES=^efa`` (see ``pd_setup``: without it a process that ran NIXL
  segfaults at exit when Debian's ``ibverbs-providers`` is installed);
  ``apply_loopback_env()`` sets them, and this module does so at import time,
  before sglang, Mooncake or UCX are loaded.
- The sglang under test comes from ``PYTHONPATH`` (a variant directory); the
  prefill processes inherit it.
- Only 127.0.0.1 is used. Each prefill costs ~10 s of CPU to start (sglang
  import) and ~1.3 GB RSS, most of it shared library pages (three processes
  add ~2.5 GB to the host's used memory).

Process hygiene: every prefill runs in its own session (process group) and is
killed with SIGKILL on ``close()``, at interpreter exit (``atexit``), on
SIGTERM/SIGHUP (turned into ``SystemExit`` so ``finally`` blocks run) and, via
``PR_SET_PDEATHSIG``, when the thread that started it dies. Start prefills from
the main thread.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import itertools
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import pd_setup  # noqa: E402

pd_setup.apply_loopback_env()

WORKER = os.path.join(HERE, "prefill_worker.py")
HOST = pd_setup.HOST

# ---------------------------------------------------------------------------
# Process hygiene
# ---------------------------------------------------------------------------

_LIVE: Dict[int, subprocess.Popen] = {}
_LIVE_LOCK = threading.Lock()


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        # The child leads its own process group (start_new_session), so this
        # reaches it and anything it started, and nothing else. SIGKILL also
        # ends a SIGSTOPped process.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    with _LIVE_LOCK:
        _LIVE.pop(proc.pid, None)


def kill_all_children() -> None:
    with _LIVE_LOCK:
        procs = list(_LIVE.values())
    for proc in procs:
        _kill_group(proc)


atexit.register(kill_all_children)

_HANDLERS_INSTALLED = False


def install_signal_handlers() -> None:
    """Turn SIGTERM/SIGHUP into SystemExit in the main thread, so context
    managers and ``finally`` blocks stop the prefills. Leaves handlers someone
    else installed alone. Ctrl-C already raises KeyboardInterrupt."""
    global _HANDLERS_INSTALLED
    if _HANDLERS_INSTALLED or threading.current_thread() is not threading.main_thread():
        return

    def handler(signum, frame):
        kill_all_children()
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            signal.signal(sig, handler)
    _HANDLERS_INSTALLED = True


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _proc_state(pid: int) -> Optional[str]:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


# ---------------------------------------------------------------------------
# Prefill side
# ---------------------------------------------------------------------------


class PrefillProcess:
    """One prefill instance in its own process; see ``prefill_worker.py``."""

    _ids = itertools.count(1)

    def __init__(self, backend: str, model_path: str, log_dir: str, name: str):
        self.backend = backend
        self.model_path = model_path
        self.name = name
        self.bootstrap_port = free_port()
        self.port = free_port()
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.proc: Optional[subprocess.Popen] = None
        self.frozen = False
        self._conn = None
        self._pending: Dict[int, concurrent.futures.Future] = {}
        self._pending_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self._pending[0] = self._ready

    @property
    def addr(self) -> str:
        return f"{HOST}:{self.bootstrap_port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self) -> "PrefillProcess":
        from multiprocessing.connection import Connection

        parent_sock, child_sock = socket.socketpair()
        env = pd_setup.apply_loopback_env(dict(os.environ))
        cmd = [
            sys.executable,
            "-W",
            "ignore",
            WORKER,
            "--backend",
            self.backend,
            "--model-path",
            self.model_path,
            "--port",
            str(self.port),
            "--bootstrap-port",
            str(self.bootstrap_port),
            "--ctl-fd",
            str(child_sock.fileno()),
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                pass_fds=(child_sock.fileno(),),
                start_new_session=True,
                close_fds=True,
            )
        with _LIVE_LOCK:
            _LIVE[self.proc.pid] = self.proc
        child_sock.close()
        self._conn = Connection(parent_sock.detach())
        self._reader_thread = threading.Thread(
            target=self._reader, name=f"{self.name}-ctl", daemon=True
        )
        self._reader_thread.start()
        return self

    def _reader(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            with self._pending_lock:
                fut = self._pending.pop(msg.get("id"), None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        with self._pending_lock:
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(RuntimeError(f"{self.name} exited"))

    def wait_ready(self, timeout_s: float = 120) -> None:
        try:
            msg = self._ready.result(timeout=timeout_s)
        except Exception as e:
            raise RuntimeError(
                f"{self.name} did not start: {e}\n{self.log_tail()}"
            ) from None
        if msg.get("event") != "ready":
            raise RuntimeError(f"{self.name} failed to start:\n{msg.get('error')}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def _request(self, msg: dict) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        msg = dict(msg, id=next(self._ids))
        with self._pending_lock:
            self._pending[msg["id"]] = fut
        try:
            with self._send_lock:
                self._conn.send(msg)
        except OSError as e:
            with self._pending_lock:
                self._pending.pop(msg["id"], None)
            fut.set_exception(RuntimeError(f"{self.name}: {e}"))
        return fut

    def call(self, msg: dict, timeout_s: float = 10) -> dict:
        if self.frozen:
            raise RuntimeError(f"{self.name} is frozen; resume it first")
        out = self._request(msg).result(timeout=timeout_s)
        if not out.get("ok", False):
            raise RuntimeError(f"{self.name}: {out.get('error')}")
        return out

    def set_fault(self, mode: str, **options) -> None:
        """One fault on this prefill's bootstrap server, replacing any other;
        ``mode`` and ``options`` as for ``fault_spec()``."""
        self.set_faults(fault_spec(mode, **options))

    def set_faults(self, *specs: dict) -> None:
        """Several faults at once (``fault_spec()``); the first that applies
        to a request wins."""
        self.call({"cmd": "fault", "specs": list(specs)})

    def clear_fault(self) -> None:
        self.set_fault("none")

    def send_kv(
        self, room: int, num_tokens: int, timeout_s: float = 30
    ) -> concurrent.futures.Future:
        """Ask the prefill to serve ``room``: wait for the decode's metadata,
        write ``pd_setup.kv_pattern(room)`` and send it. The future resolves
        with {"status": "Success"|"Failed"|"Timeout"|"Error", ...}."""
        return self._request(
            {
                "cmd": "send",
                "room": room,
                "num_tokens": num_tokens,
                "timeout_s": timeout_s,
            }
        )

    def freeze(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)
        self._wait_state(lambda s: s in ("T", "t"), "stop")
        self.frozen = True

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)
        self._wait_state(lambda s: s not in ("T", "t"), "continue")
        self.frozen = False

    def _wait_state(self, ok: Callable[[str], bool], what: str) -> None:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            state = _proc_state(self.pid)
            if state is None or ok(state):
                return
            time.sleep(0.005)
        raise RuntimeError(f"{self.name} did not {what}")

    def kill(self) -> None:
        if self.proc is not None:
            _kill_group(self.proc)
        self.frozen = False

    def restart(self) -> "PrefillProcess":
        """Kill this prefill and start a new process on the same ports (a new
        KV manager, so new ZMQ rank ports). Call wait_ready() afterwards."""
        self.kill()
        # The old reader fails what is pending on EOF; let it finish first.
        self._reader_thread.join(10)
        self._conn.close()
        self._ready = concurrent.futures.Future()
        with self._pending_lock:
            self._pending = {0: self._ready}
        return self.start()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def fault_spec(
    mode: str,
    *,
    delay_s: float = 0.0,
    status: int = 503,
    body: str = "",
    fields: Optional[dict] = None,
    paths: Optional[List[str]] = None,
    route_kind: Optional[str] = None,
) -> dict:
    """A fault for PrefillProcess.set_faults. ``mode``: "none", "delay"
    (sleep ``delay_s`` then answer), "status" (answer ``status``), "body"
    (answer 200 with ``body``), "patch_json" (the real answer with ``fields``
    replaced) or "dp_rank_zero" (answer /query_dp_ranks with rank 0 for every
    room); every mode waits ``delay_s`` first. Applies to decode-facing
    GET/POST requests on ``paths`` (default all); ``route_kind`` narrows
    ``/route`` to the parallel-info query ("info") or the per-rank lookups
    ("rank")."""
    return {
        "mode": mode,
        "delay_s": delay_s,
        "status": status,
        "body": body,
        "fields": fields or {},
        "paths": paths,
        "route_kind": route_kind,
    }


class Blackhole:
    """A listening socket that never accepts. TCP connects complete in the
    kernel backlog and reads then wait for ever, which is what a SIGSTOPped
    bootstrap server looks like to the decode. ``close()`` resets the queued
    connections, so outstanding reads fail at once."""

    def __init__(self, backlog: int = 128):
        self.sock = socket.socket()
        self.sock.bind((HOST, 0))
        self.sock.listen(backlog)
        self.port = self.sock.getsockname()[1]

    @property
    def addr(self) -> str:
        return f"{HOST}:{self.port}"

    def close(self) -> None:
        self.sock.close()


# ---------------------------------------------------------------------------
# Decode side
# ---------------------------------------------------------------------------


class _SingleRankGroup:
    """Stands for the attention-TP CPU group of a TP=1 decode: one rank, so
    ``all_reduce_flags`` returns its input."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


class _SchedulerStub:
    """The attributes of ``Scheduler`` that ``DecodePreallocQueue.__init__``,
    ``add()``, ``_resolve_pending_reqs()`` and ``_update_handshake_waiters()``
    read. Anything else raises AttributeError, which is how a new dependency
    would show up."""

    def __init__(self, server_args):
        from types import SimpleNamespace

        self.server_args = server_args
        self.tp_worker = SimpleNamespace(
            is_hybrid_swa=False,
            model_runner=SimpleNamespace(kv_cache_dtype_str="auto"),
        )
        self.model_config = SimpleNamespace(num_hidden_layers=pd_setup.NUM_LAYERS)
        self.random_seed = 0
        self.enable_hisparse = False
        self.kv_checksum_computer = None
        self.metrics_reporter = SimpleNamespace(enable_metrics=False)
        self.output_streamer = SimpleNamespace(stream_output=lambda *a, **k: None)

    def retire_unadmitted_request(self, req) -> None:
        raise AssertionError(f"harness request {req.rid} was rejected at intake")


class _TimestampedDict(dict):
    """``prefill_info_table`` that remembers when each key was last set."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.set_times: Dict[str, float] = {}

    def __setitem__(self, key, value):
        self.set_times[key] = time.perf_counter()
        super().__setitem__(key, value)


def _make_queue_class():
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    class _LoopbackPreallocQueue(DecodePreallocQueue):
        """The real queue; only the KV manager factory is replaced."""

        def __init__(self, *, prebuilt_kv_manager, **kwargs):
            self._prebuilt_kv_manager = prebuilt_kv_manager
            super().__init__(**kwargs)

        def _init_kv_manager(self):
            return self._prebuilt_kv_manager

    return _LoopbackPreallocQueue


@dataclass
class Tracked:
    """A decode request driven by the harness, with its timeline
    (``time.perf_counter()`` seconds)."""

    room: int
    addr: str
    num_tokens: int
    req: object
    t_add: float
    prefill_job: Optional[concurrent.futures.Future] = None
    decode_req: object = None
    state: str = "pending"  # pending, admitted, transferring, success, failed
    t_admitted: Optional[float] = None
    t_metadata: Optional[float] = None
    t_done: Optional[float] = None
    error: Optional[str] = None
    kv_ok: Optional[bool] = None
    aux_ok: Optional[bool] = None
    kv_indices: object = None
    metadata_index: Optional[int] = None

    @property
    def finished(self) -> bool:
        return self.state in ("success", "failed")


@dataclass
class Cycle:
    """One timed call on the scheduler thread (a ``step()`` or an ``add()``)."""

    start: float  # perf_counter at entry
    duration: float
    cpu: float = 0.0  # this thread's CPU time during the call
    # (host, port) of every HTTP request this thread sent during the call
    http: Tuple[Tuple[str, int], ...] = ()
    # threads this thread started during the call
    threads_started: int = 0


# HTTP requests made by the scheduler thread, seen through the interpreter's
# "http.client.send" audit event: raised for every request that requests /
# urllib3 sends, over a new or a pooled keep-alive connection alike (libzmq
# and the transfer engines are not seen). Audit hooks cannot be removed, so
# one is installed per process and is a no-op outside a recorded call.
_RECORDING: Optional[Tuple[int, list, list]] = None
_AUDIT_INSTALLED = False
_REQUEST_LINE_STARTS = (b"GET ", b"POST ", b"PUT ", b"DELETE ", b"HEAD ", b"PATCH ")


def _audit_hook(event, args):
    if event == "http.client.send":
        rec = _RECORDING
        if rec is not None and threading.get_ident() == rec[0]:
            conn, data = args
            # One event per request: the block holding the request line
            # (a body may follow in further sends).
            if isinstance(data, (bytes, bytearray)) and data.startswith(
                _REQUEST_LINE_STARTS
            ):
                rec[1].append((str(conn.host), int(conn.port)))


def _install_audit_hook() -> None:
    global _AUDIT_INSTALLED
    if not _AUDIT_INSTALLED:
        sys.addaudithook(_audit_hook)
        _install_thread_start_hook()
        HTTP.install()
        _AUDIT_INSTALLED = True


def _install_thread_start_hook() -> None:
    # There is no audit event for a thread start; wrap Thread.start instead.
    original = threading.Thread.start

    def start(thread):
        rec = _RECORDING
        if rec is not None and threading.get_ident() == rec[0]:
            rec[2].append(thread.name)
        return original(thread)

    threading.Thread.start = start


def _http_kind(method: str, url: str) -> str:
    path, _, query = url.partition("?")
    if path.endswith("/route"):
        return "info" if "prefill_dp_rank=-1" in query else "route"
    if path.endswith("/query_dp_ranks"):
        return "dp_ranks"
    return path.rsplit("/", 1)[-1] or method


class HttpLog:
    """Every HTTP request this process sends through urllib3 (so requests),
    from any thread: its kind, port, thread and duration, and the most ever
    in flight at once per (port, kind). Kinds: "info" (parallel info),
    "route" (per-rank lookup), "dp_ranks", and the last path segment of
    anything else (e.g. "health")."""

    def __init__(self):
        self.lock = threading.Lock()
        self.current: Dict[Tuple[int, str], int] = {}
        self.peak: Dict[Tuple[int, str], int] = {}
        # (start, end, port, kind, thread name, error or None)
        self.records: List[tuple] = []
        self.first: Dict[int, float] = {}
        self._installed = False

    def install(self) -> None:
        import urllib3

        if self._installed:
            return
        self._installed = True
        original = urllib3.connectionpool.HTTPConnectionPool.urlopen
        log = self

        def urlopen(pool, method, url, *args, **kwargs):
            key = (int(pool.port), _http_kind(method, url))
            with log.lock:
                log.current[key] = log.current.get(key, 0) + 1
                log.peak[key] = max(log.peak.get(key, 0), log.current[key])
                t0 = time.perf_counter()
                log.first.setdefault(key[0], t0)
            error = None
            try:
                return original(pool, method, url, *args, **kwargs)
            except BaseException as e:
                error = type(e).__name__
                raise
            finally:
                with log.lock:
                    log.current[key] -= 1
                    log.records.append(
                        (
                            t0,
                            time.perf_counter(),
                            key[0],
                            key[1],
                            threading.current_thread().name,
                            error,
                        )
                    )

        urllib3.connectionpool.HTTPConnectionPool.urlopen = urlopen

    def reset_peaks(self) -> None:
        with self.lock:
            self.peak = dict(self.current)

    def peaks(self, port: Optional[int] = None) -> Dict[str, int]:
        """Most requests in flight at once since reset_peaks(), by kind."""
        with self.lock:
            return {
                kind: n
                for (p, kind), n in self.peak.items()
                if port is None or p == port
            }

    def first_start(self, port: int) -> Optional[float]:
        """When the first request to ``port`` started, if any."""
        return self.first.get(port)

    def in_flight(self, port: int, kind: Optional[str] = None) -> int:
        with self.lock:
            return sum(
                n
                for (p, k), n in self.current.items()
                if p == port and (kind is None or k == kind)
            )


HTTP = HttpLog()


def detect_variant() -> Tuple[str, str]:
    """(label, detected) of the sglang under test: detected is "patched" when
    CommonKVManager has has_parallel_info(), else "stock"; the label is
    SGLANG_PD_VARIANT when set, else the detected name."""
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    detected = "patched" if hasattr(CommonKVManager, "has_parallel_info") else "stock"
    return os.environ.get("SGLANG_PD_VARIANT") or detected, detected


class _Recorded:
    """Times a call on the current thread and collects its HTTP requests."""

    def __enter__(self):
        global _RECORDING
        self.http: list = []
        self.threads: list = []
        _RECORDING = (threading.get_ident(), self.http, self.threads)
        self.cpu0 = time.thread_time()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        global _RECORDING
        self.t1 = time.perf_counter()
        self.cpu = time.thread_time() - self.cpu0
        _RECORDING = None
        return False

    def cycle(self) -> Cycle:
        return Cycle(
            self.t0, self.t1 - self.t0, self.cpu, tuple(self.http), len(self.threads)
        )


class DecodeSide:
    """The decode instance, in this process. One at a time per process: it
    publishes the process-wide runtime context."""

    def __init__(
        self,
        backend: str,
        model_path: str,
        *,
        max_ensure_retries: Optional[int] = None,
        ensure_retry_interval: Optional[float] = None,
        server_args: Optional[dict] = None,
    ):
        import torch  # noqa: F401  (sglang expects torch imported first)
        from sglang.srt.disaggregation.utils import TransferBackend
        from sglang.srt.runtime_context import get_disagg, get_parallel

        self.backend = backend
        self.server_args = pd_setup.make_server_args(
            mode="decode",
            backend=backend,
            model_path=model_path,
            port=free_port(),
            bootstrap_port=free_port(),
            **(server_args or {}),
        )
        pd_setup.publish_process(self.server_args)
        from types import SimpleNamespace

        get_parallel().override_permanently(
            attn_tp_group=SimpleNamespace(cpu_group=_SingleRankGroup())
        )
        (
            self.pool,
            self.metadata_buffers,
            self.allocator,
            self.metadata_allocator,
        ) = pd_setup.make_kv_buffers(self.server_args)
        self.kv_manager = pd_setup.make_decode_manager(
            backend, self.server_args, self.pool, self.metadata_buffers
        )
        with self.kv_manager.connection_lock:
            self.kv_manager.prefill_info_table = _TimestampedDict(
                self.kv_manager.prefill_info_table
            )
        self.scheduler = _SchedulerStub(self.server_args)
        queue_class = _make_queue_class()
        self.queue = queue_class(
            prebuilt_kv_manager=self.kv_manager,
            req_to_token_pool=None,
            token_to_kv_pool_allocator=self.allocator,
            draft_token_to_kv_pool=None,
            req_to_metadata_buffer_idx_allocator=self.metadata_allocator,
            metadata_buffers=self.metadata_buffers,
            scheduler=self.scheduler,
            transfer_queue=SimpleNamespace(queue=[], enable_staging=False),
            tree_cache=None,
            gpu_id=0,
            bootstrap_port=self.server_args.disaggregation_bootstrap_port,
            max_total_num_tokens=pd_setup.POOL_TOKENS,
            num_reserved_decode_tokens=get_disagg().num_reserved_decode_tokens,
            transfer_backend=TransferBackend(backend),
        )
        if max_ensure_retries is not None:
            self.queue._max_ensure_retries = max_ensure_retries
        if ensure_retry_interval is not None:
            self.queue._ensure_retry_interval = ensure_retry_interval
        self.tracked: List[Tracked] = []
        self.transferring: List[Tracked] = []
        self.cycles: List[Cycle] = []
        self.adds: List[Cycle] = []
        self.quarantined_tokens = 0
        _install_audit_hook()
        self._by_decode_req: Dict[int, Tracked] = {}
        self._rooms = itertools.count(random.randrange(1 << 40, 1 << 50))
        self._closed = False

    # -- requests ---------------------------------------------------------

    def new_room(self) -> int:
        return next(self._rooms)

    def make_req(self, addr: str, room: int, num_tokens: int):
        from sglang.srt.disaggregation.utils import DisaggregationMode
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        host, port = addr.rsplit(":", 1)
        return Req(
            rid=f"pdl-{room}",
            origin_input_text="",
            origin_input_ids=array("q", [2 + i % 500 for i in range(num_tokens)]),
            sampling_params=SamplingParams(max_new_tokens=4),
            bootstrap_host=host,
            bootstrap_port=int(port),
            bootstrap_room=room,
            disagg_mode=DisaggregationMode.DECODE,
        )

    def add(
        self, addr: str, num_tokens: int = 16, room: Optional[int] = None
    ) -> Tracked:
        """``DecodePreallocQueue.add()`` for a new request routed to ``addr``.
        Returns once add() returns; the request is then pending or admitted."""
        room = self.new_room() if room is None else room
        req = self.make_req(addr, room, num_tokens)
        t = Tracked(
            room=room,
            addr=addr,
            num_tokens=num_tokens,
            req=req,
            t_add=time.perf_counter(),
        )
        before = len(self.queue.queue)
        with _Recorded() as rec:
            self.queue.add(req)
        self.adds.append(rec.cycle())
        assert len(self.queue.queue) == before + 1, "add() did not enqueue"
        t.decode_req = self.queue.queue[-1]
        self._by_decode_req[id(t.decode_req)] = t
        self.tracked.append(t)
        if not any(r is t.decode_req for r in self.queue.pending_reqs):
            t.state = "admitted"
            t.t_admitted = time.perf_counter()
        return t

    # -- the scheduling call ----------------------------------------------

    def step(self) -> Cycle:
        """One decode scheduling call over the prealloc path, timed, with the
        HTTP requests it sent from this thread."""
        pending_before = {id(r) for r in self.queue.pending_reqs}
        with _Recorded() as rec:
            # As the decode event loop: prefetch before intake, consume later.
            self.queue.prefetch_prefill_dp_rank_queries()
            self.queue._resolve_pending_reqs()
            self.queue._update_handshake_waiters()
            pending_after = {id(r) for r in self.queue.pending_reqs}
            self._drop_failed()
            self._prealloc()
            self._poll_transfers()
        t1 = rec.t1
        # Left pending_reqs in this call: its receiver was initialised (or it
        # was aborted, which _drop_failed has recorded by now).
        for key in pending_before - pending_after:
            t = self._by_decode_req.get(key)
            if t is None or t.t_admitted is not None:
                continue
            if t.state == "failed" and t.t_done is not None:
                continue
            t.t_admitted = t1
            if t.state == "pending":
                t.state = "admitted"
        cycle = rec.cycle()
        self.cycles.append(cycle)
        return cycle

    def _fail(self, t: Tracked, message: str, now: float) -> None:
        t.state = "failed"
        t.error = message
        t.t_done = now
        if t.t_metadata is None:
            self._release(t)
        else:
            # The prefill holds these KV and metadata slots as its destination
            # and may still write them (e.g. once resumed); real decode defers
            # such a release too. Keep them out of the allocators for good.
            self.quarantined_tokens += t.num_tokens
            t.kv_indices = None
            t.metadata_index = None

    def _release(self, t: Tracked) -> None:
        if t.kv_indices is not None:
            self.allocator.free(t.kv_indices)
            t.kv_indices = None
        if t.metadata_index is not None:
            self.metadata_allocator.free(t.metadata_index)
            t.metadata_index = None

    def _drop_failed(self) -> None:
        """What ``pop_preallocated`` does with aborted requests: clear the
        receiver and drop them from ``queue`` and ``pending_reqs``."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        failed = []
        for decode_req in self.queue.queue:
            if isinstance(decode_req.req.finished_reason, FINISH_ABORT):
                failed.append(decode_req)
        if not failed:
            return
        now = time.perf_counter()
        ids = {id(r) for r in failed}
        for decode_req in failed:
            if decode_req.kv_receiver is not None:
                decode_req.kv_receiver.clear()
                decode_req.kv_receiver = None
            t = self._by_decode_req.get(id(decode_req))
            if t is not None and not t.finished:
                self._fail(t, decode_req.req.finished_reason.message, now)
        self.queue.queue = [r for r in self.queue.queue if id(r) not in ids]
        self.queue.pending_reqs = [
            r for r in self.queue.pending_reqs if id(r) not in ids
        ]

    def _prealloc(self) -> None:
        """For requests whose handshake is done: allocate KV and a metadata
        slot and publish them with ``send_metadata``, as ``_pre_alloc`` /
        ``_send_kv_metadata`` do."""
        import torch
        from sglang.srt.mem_cache.common import kv_to_page_indices

        moved = []
        for decode_req in self.queue.queue:
            if not decode_req.waiting_for_input:
                continue
            t = self._by_decode_req.get(id(decode_req))
            if t is None:
                continue
            kv_indices = self.allocator.alloc(t.num_tokens)
            if kv_indices is None or self.metadata_allocator.available_size() <= 0:
                if kv_indices is not None:
                    self.allocator.free(kv_indices)
                break
            t.kv_indices = kv_indices
            t.metadata_index = self.metadata_allocator.alloc()
            decode_req.metadata_buffer_index = t.metadata_index
            # int32, as the rows of req_to_token that the real path reads.
            page_indices = kv_to_page_indices(
                kv_indices.to(torch.int32), pd_setup.PAGE_SIZE
            )
            decode_req.kv_receiver.send_metadata(page_indices, t.metadata_index)
            t.state = "transferring"
            t.t_metadata = time.perf_counter()
            moved.append(decode_req)
            self.transferring.append(t)
        if moved:
            ids = {id(r) for r in moved}
            self.queue.queue = [r for r in self.queue.queue if id(r) not in ids]

    def _poll_transfers(self) -> None:
        from sglang.srt.disaggregation.base import KVPoll

        still = []
        for t in self.transferring:
            receiver = t.decode_req.kv_receiver
            state = receiver.poll()
            now = time.perf_counter()
            if state == KVPoll.Success:
                t.kv_ok, t.aux_ok = self._check_kv(t)
                t.state = "success"
                t.t_done = now
                receiver.clear()
                self._release(t)
            elif state == KVPoll.Failed:
                try:
                    receiver.failure_exception()
                    message = "failed without an exception"
                except Exception as e:
                    message = str(e)
                self._fail(t, message, now)
            else:
                still.append(t)
        self.transferring = still

    def _check_kv(self, t: Tracked) -> Tuple[bool, bool]:
        import torch

        expected = pd_setup.kv_pattern(t.room, t.num_tokens)
        kv_ok = True
        for layer in range(pd_setup.NUM_LAYERS):
            k = self.pool.k_buffer[layer][t.kv_indices]
            v = self.pool.v_buffer[layer][t.kv_indices]
            kv_ok &= torch.equal(k, expected[layer, 0])
            kv_ok &= torch.equal(v, expected[layer, 1])
        aux = int(self.metadata_buffers.output_ids[t.metadata_index][0])
        return bool(kv_ok), aux == t.room % 100_000

    # -- driving ----------------------------------------------------------

    def run(
        self,
        until: Callable[[], bool],
        timeout_s: float,
        period_s: float = 0.005,
    ) -> bool:
        """Call ``step()`` every ``period_s`` (the stand-in for a decode
        forward) until ``until()`` or ``timeout_s``. Returns ``until()``."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.step()
            if until():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(period_s)

    def run_for(self, seconds: float, period_s: float = 0.005) -> None:
        self.run(lambda: False, seconds, period_s)

    def abort_all(self, reason: str = "aborted by the harness") -> int:
        """Abort every unfinished request (receiver ``abort()`` + ``clear()``)
        and drop it from the queue; returns how many there were."""
        now = time.perf_counter()
        left = [t for t in self.tracked if not t.finished]
        ids = {id(t.decode_req) for t in left}
        for t in left:
            receiver = t.decode_req.kv_receiver
            if receiver is not None:
                receiver.abort()
                receiver.clear()
                t.decode_req.kv_receiver = None
            self._fail(t, reason, now)
        self.queue.queue = [r for r in self.queue.queue if id(r) not in ids]
        self.queue.pending_reqs = [
            r for r in self.queue.pending_reqs if id(r) not in ids
        ]
        self.transferring = [t for t in self.transferring if not t.finished]
        return len(left)

    def forget_prefill(self, addr: str) -> None:
        """Bring ``addr`` back to first contact: the real heartbeat-failure
        eviction (``_handle_node_failure``), plus the queue's retry state."""
        self.kv_manager._handle_node_failure(addr)
        # Stock has no _clear_ensure_state(); both variants have the dicts.
        self.queue._ensure_retry_count.pop(addr, None)
        self.queue._ensure_last_attempt_time.pop(addr, None)

    def fetch_in_flight(self, addr: str) -> bool:
        inflight = getattr(self.kv_manager, "_parallel_info_inflight", None)
        return inflight is not None and addr in inflight

    def max_cycle(self, since: float = 0.0) -> float:
        return max((c.duration for c in self.cycles if c.start >= since), default=0.0)

    def scheduler_http(
        self, port: Optional[int] = None, since: float = 0.0, until: float = None
    ) -> List[Tuple[float, Tuple[str, int]]]:
        """(call start, address) of HTTP requests sent from inside ``step()``
        or ``add()`` between ``since`` and ``until``, optionally to ``port``."""
        out = []
        for c in self.cycles + self.adds:
            if c.start < since or (until is not None and c.start > until):
                continue
            for address in c.http:
                if port is None or address[1] == port:
                    out.append((c.start, address))
        return sorted(out)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        mgr = self.kv_manager
        executor = getattr(mgr, "_parallel_info_executor", None)
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        shutdown = getattr(mgr, "_heartbeat_shutdown", None)
        if shutdown is not None:
            shutdown.set()


# ---------------------------------------------------------------------------
# A whole loopback deployment
# ---------------------------------------------------------------------------


class Cluster:
    """N prefill processes plus the in-process decode side, as a context
    manager that stops everything it started on exit, success or not."""

    def __init__(
        self,
        backend: str,
        num_prefills: int,
        *,
        decode_kwargs: Optional[dict] = None,
        log_dir: Optional[str] = None,
    ):
        self.backend = backend
        self.model_path = pd_setup.ensure_tiny_model()
        self._own_log_dir = log_dir is None
        self.log_dir = log_dir or tempfile.mkdtemp(prefix=f"pd_loopback_{backend}_")
        self.prefills: List[PrefillProcess] = [
            PrefillProcess(backend, self.model_path, self.log_dir, f"prefill{i}")
            for i in range(num_prefills)
        ]
        self.blackholes: List[Blackhole] = []
        self.decode: Optional[DecodeSide] = None
        self._decode_kwargs = decode_kwargs or {}

    def __enter__(self) -> "Cluster":
        install_signal_handlers()
        try:
            for p in self.prefills:
                p.start()
            # The decode side imports sglang while the prefills do the same.
            self.decode = DecodeSide(
                self.backend, self.model_path, **self._decode_kwargs
            )
            for p in self.prefills:
                p.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add_blackhole(self) -> Blackhole:
        b = Blackhole()
        self.blackholes.append(b)
        return b

    def request(
        self, target, num_tokens: int = 16, send_timeout_s: float = 30
    ) -> Tracked:
        """A new request routed to ``target`` (a PrefillProcess or an addr):
        the prefill is asked to serve it, then the decode ``add()``s it."""
        addr = target.addr if hasattr(target, "addr") else target
        room = self.decode.new_room()
        job = None
        if isinstance(target, PrefillProcess):
            job = target.send_kv(room, num_tokens, timeout_s=send_timeout_s)
        t = self.decode.add(addr, num_tokens=num_tokens, room=room)
        t.prefill_job = job
        return t

    def close(self) -> None:
        try:
            if self.decode is not None:
                self.decode.close()
        finally:
            for p in self.prefills:
                p.kill()
            for b in self.blackholes:
                b.close()
            if self._own_log_dir and not os.environ.get("PD_LOOPBACK_KEEP_LOGS"):
                shutil.rmtree(self.log_dir, ignore_errors=True)


def percentile(values: List[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)
