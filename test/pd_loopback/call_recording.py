"""What the decode scheduler thread does during one timed call.

``_Recorded`` times a ``DecodeSide.step()`` or ``add()`` and collects, for the
calling thread only: the HTTP requests it sends (the interpreter's
``http.client.send`` audit event), the ZMQ sends and connects it makes (pyzmq's
``Socket.send`` / ``send_multipart`` / ``connect``, wrapped), and the threads it
starts. ``HTTP`` (``HttpLog``) logs every HTTP request of this process from any
thread, with the most in flight at once per prefill and kind.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple
from urllib.parse import urlsplit


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
    # ZMQ socket operations ("send", "send_multipart", "connect") this thread
    # made during the call
    zmq: Tuple[str, ...] = ()


# HTTP requests made by the scheduler thread, seen through the interpreter's
# "http.client.send" audit event: raised for every request that requests /
# urllib3 sends, over a new or a pooled keep-alive connection alike (libzmq
# and the transfer engines are not seen). Audit hooks cannot be removed, so
# one is installed per process and is a no-op outside a recorded call.
_RECORDING: Optional[Tuple[int, list, list, list]] = None
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
        _install_zmq_hook()
        HTTP.install()
        _AUDIT_INSTALLED = True


def _install_zmq_hook() -> None:
    # libzmq raises no audit event; wrap pyzmq's socket methods instead (a
    # PUSH send to a peer that stopped reading blocks once SNDHWM messages
    # are queued, a connect can be slow to set up).
    import zmq

    for name in ("send", "send_multipart", "connect"):
        original = getattr(zmq.Socket, name)

        def recorded(sock, *args, _name=name, _original=original, **kwargs):
            rec = _RECORDING
            if rec is not None and threading.get_ident() == rec[0]:
                rec[3].append(_name)
            return _original(sock, *args, **kwargs)

        setattr(zmq.Socket, name, recorded)


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
    """Every HTTP request this process sends through urllib3 (so requests)
    or the patch's bootstrap client, from any thread: its kind, port, thread and duration, and the most ever
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
            with log.track(int(pool.port), _http_kind(method, url)):
                return original(pool, method, url, *args, **kwargs)

        urllib3.connectionpool.HTTPConnectionPool.urlopen = urlopen

        # The patch's own keep-alive client for bootstrap queries and probes
        # (http.client, not urllib3); stock has none.
        from sglang.srt.disaggregation.common import conn

        bootstrap_http = getattr(conn, "_BootstrapHTTP", None)
        if bootstrap_http is not None:
            original_request = bootstrap_http.request

            def request(client, method, url, **kwargs):
                parts = urlsplit(url)
                kind = _http_kind(method, f"{parts.path}?{parts.query}")
                with log.track(int(parts.port), kind):
                    return original_request(client, method, url, **kwargs)

            bootstrap_http.request = request

    @contextlib.contextmanager
    def track(self, port: int, kind: str):
        """Count one request to ``port`` of ``kind`` while it runs."""
        key = (port, kind)
        with self.lock:
            self.current[key] = self.current.get(key, 0) + 1
            self.peak[key] = max(self.peak.get(key, 0), self.current[key])
            t0 = time.perf_counter()
            self.first.setdefault(key[0], t0)
        error = None
        try:
            yield
        except BaseException as e:
            error = type(e).__name__
            raise
        finally:
            with self.lock:
                self.current[key] -= 1
                self.records.append(
                    (
                        t0,
                        time.perf_counter(),
                        key[0],
                        key[1],
                        threading.current_thread().name,
                        error,
                    )
                )

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


class _Recorded:
    """Times a call on the current thread and collects its HTTP requests."""

    def __enter__(self):
        global _RECORDING
        self.http: list = []
        self.threads: list = []
        self.zmq: list = []
        _RECORDING = (threading.get_ident(), self.http, self.threads, self.zmq)
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
            self.t0,
            self.t1 - self.t0,
            self.cpu,
            tuple(self.http),
            len(self.threads),
            tuple(self.zmq),
        )
