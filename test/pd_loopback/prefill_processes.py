"""Prefill processes for the loopback harness, and how they are kept tidy.

``PrefillProcess`` runs one prefill (``prefill_worker.py``) in its own session;
``Blackhole`` is a listening socket that never accepts (a frozen bootstrap
server as seen from the network); ``fault_spec`` describes a bootstrap-server
fault. Every child is killed with SIGKILL on close, at interpreter exit, on
SIGTERM/SIGHUP and, via ``PR_SET_PDEATHSIG``, when the thread that started it
dies. See harness.py for the whole picture.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import itertools
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Dict, List, Optional

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

    def __init__(
        self,
        backend: str,
        model_path: str,
        log_dir: str,
        name: str,
        allocation_policy: str = "early",
    ):
        self.backend = backend
        self.allocation_policy = allocation_policy
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
        # Called with every message of id 0 after the first (mirror.py's events).
        self.on_event: Optional[Callable[[dict], None]] = None

    @property
    def addr(self) -> str:
        return f"{HOST}:{self.bootstrap_port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def command(self) -> List[str]:
        """The child's command line, less ``--ctl-fd``."""
        return [
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
            "--allocation-policy",
            self.allocation_policy,
        ]

    def start(self, env: Optional[dict] = None) -> "PrefillProcess":
        from multiprocessing.connection import Connection

        parent_sock, child_sock = socket.socketpair()
        env = pd_setup.apply_loopback_env(dict(os.environ, **(env or {})))
        cmd = self.command() + ["--ctl-fd", str(child_sock.fileno())]
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
            elif fut is None and msg.get("id") == 0 and self.on_event is not None:
                self.on_event(msg)
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
        self, room: int, num_tokens: int, timeout_s: float = 30, hold_s: float = 0.0
    ) -> concurrent.futures.Future:
        """Ask the prefill to serve ``room``: wait for the decode's metadata,
        then ``hold_s`` (its forward pass, say), write
        ``pd_setup.kv_pattern(room)`` and send it. The future resolves with
        {"status": "Success"|"Failed"|"Timeout"|"Error", ...}."""
        return self._request(
            {
                "cmd": "send",
                "room": room,
                "num_tokens": num_tokens,
                "timeout_s": timeout_s,
                "hold_s": hold_s,
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
