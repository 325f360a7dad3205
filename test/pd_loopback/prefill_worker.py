"""One loopback prefill instance: a real bootstrap server and a real PREFILL-mode
KV manager in one process, driven by the harness over a control connection.

Started by ``harness.PrefillProcess`` as ``python prefill_worker.py ...``; not a
test module. The process hosts:

- the backend's bootstrap server class (``get_kv_class(backend,
  KVClassType.BOOTSTRAP_SERVER)``), unmodified except for one aiohttp
  middleware that injects faults when the harness asks for them (delay or an
  HTTP error status on decode-facing requests);
- a PREFILL-mode ``MooncakeKVManager`` / ``NixlKVManager`` that registers with
  that bootstrap server exactly as a prefill scheduler does;
- for each ``send`` command, a real ``KVSender`` that waits for the decode's
  metadata, writes a known pattern into the prefill KV pool and sends it.

SIGSTOP freezes all of it at once, which is the "hung prefill" under test.
Control messages are picklable dicts over a ``multiprocessing.connection``
wrapped around an inherited socket; every reply carries the request ``id``.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import signal
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pd_setup  # noqa: E402

# Read by the aiohttp middleware on the server's event loop; replaced whole
# by the control thread, so a reader never sees a half-written spec.
# Fault specs (see PrefillProcess.set_faults); the first that applies wins.
_FAULTS = []


def _die_with_parent() -> None:
    # Belt and braces next to the harness's own cleanup: if the harness is
    # SIGKILLed, the kernel takes this process down too.
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() == 1:
        os._exit(1)


def _fault_applies(spec: dict, request) -> bool:
    if spec.get("mode", "none") == "none":
        return False
    if request.method not in spec.get("methods", ("GET", "POST")):
        return False
    paths = spec.get("paths")
    if paths and request.path not in paths:
        return False
    kind = spec.get("route_kind")
    if kind is not None and request.path == "/route":
        is_info = request.query.get("prefill_dp_rank") == "-1"
        if (kind == "info") != is_info:
            return False
    return True


def _make_bootstrap_server(backend: str, port: int):
    from aiohttp import web
    from sglang.srt.disaggregation.utils import (
        KVClassType,
        TransferBackend,
        get_kv_class,
    )

    server_class = get_kv_class(TransferBackend(backend), KVClassType.BOOTSTRAP_SERVER)

    @web.middleware
    async def fault_middleware(request, handler):
        spec = next((f for f in _FAULTS if _fault_applies(f, request)), None)
        if spec is None:
            return await handler(request)
        if spec.get("delay_s"):
            await asyncio.sleep(float(spec["delay_s"]))
        if spec["mode"] == "status":
            return web.Response(
                status=int(spec["status"]), text="injected by pd_loopback"
            )
        elif spec["mode"] == "body":
            # A 200 answer with this body instead of the real one.
            return web.Response(
                status=200, text=spec["body"], content_type="application/json"
            )
        elif spec["mode"] == "patch_json":
            # The real answer with some fields replaced.
            response = await handler(request)
            data = json.loads(response.text)
            data.update(spec["fields"])
            return web.json_response(data)
        elif spec["mode"] == "dp_rank_zero":
            # Answers /query_dp_ranks as a prefill whose every room is on
            # dp rank 0 (this process is that rank).
            rooms = (await request.json())["bootstrap_rooms"]
            return web.json_response({str(room): 0 for room in rooms})
        return await handler(request)

    class FaultInjectingBootstrapServer(server_class):
        def _setup_routes(self):
            super()._setup_routes()
            # Runs in __init__ before the server thread starts, i.e. before
            # the application is frozen.
            self.app.middlewares.append(fault_middleware)

    return FaultInjectingBootstrapServer(host=pd_setup.HOST, port=port)


def _wait_port(port: int, timeout_s: float) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex((pd_setup.HOST, port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"bootstrap server did not listen on {port}")


class Worker:
    def __init__(self, args, conn):
        self.args = args
        self.conn = conn
        self.reply_lock = threading.Lock()
        self.alloc_lock = threading.Lock()

    def reply(self, msg: dict) -> None:
        with self.reply_lock:
            self.conn.send(msg)

    def event(self, kind: str, **fields) -> None:
        """A point of a send's timeline; mirror_prefill.py reports them."""

    def setup(self) -> None:
        a = self.args
        self.server_args = pd_setup.make_server_args(
            mode="prefill",
            backend=a.backend,
            model_path=a.model_path,
            port=a.port,
            bootstrap_port=a.bootstrap_port,
            disaggregation_decode_allocation_policy=a.allocation_policy,
        )
        pd_setup.publish_process(self.server_args)
        self.bootstrap_server = _make_bootstrap_server(a.backend, a.bootstrap_port)
        _wait_port(a.bootstrap_port, 30)
        (
            self.pool,
            self.metadata_buffers,
            self.allocator,
            self.metadata_allocator,
        ) = pd_setup.make_kv_buffers(self.server_args)
        self.manager = pd_setup.make_prefill_manager(
            a.backend, self.server_args, self.pool, self.metadata_buffers
        )

    # -- commands ---------------------------------------------------------

    def cmd_fault(self, msg: dict) -> dict:
        global _FAULTS
        specs = msg["specs"] if "specs" in msg else [msg["spec"]]
        specs = [dict(spec) for spec in specs if spec["mode"] != "none"]
        for spec in specs:
            if "methods" in spec:
                spec["methods"] = tuple(spec["methods"])
        _FAULTS = specs
        return {"ok": True}

    def cmd_ping(self, msg: dict) -> dict:
        return {"ok": True}

    def cmd_send(self, msg: dict) -> None:
        threading.Thread(
            target=self._send_job, args=(msg,), name=f"send-{msg['room']}", daemon=True
        ).start()

    def _send_job(self, msg: dict) -> None:
        try:
            result = self._send(int(msg["room"]), int(msg["num_tokens"]), msg)
        except Exception:
            result = {"status": "Error", "error": traceback.format_exc()}
        result["id"] = msg["id"]
        self.reply(result)

    def _send(self, room: int, num_tokens: int, msg: dict) -> dict:
        import torch
        from sglang.srt.disaggregation.base import KVPoll
        from sglang.srt.disaggregation.utils import (
            KVClassType,
            TransferBackend,
            get_kv_class,
        )
        from sglang.srt.mem_cache.common import kv_to_page_indices

        deadline = time.monotonic() + float(msg.get("timeout_s", 60))
        sender_class = get_kv_class(
            TransferBackend(self.args.backend), KVClassType.SENDER
        )
        sender = sender_class(
            mgr=self.manager,
            bootstrap_addr=f"{pd_setup.HOST}:{self.args.bootstrap_port}",
            bootstrap_room=room,
        )

        def wait_for(states) -> int:
            while time.monotonic() < deadline:
                state = sender.poll()
                if state in states:
                    return state
                time.sleep(0.002)
            return -1

        def failure() -> str:
            try:
                sender.failure_exception()
            except Exception as e:
                return str(e)
            return "failed without an exception"

        deferred = self.args.allocation_policy == "prefill_complete"
        if deferred:
            # The forward pass runs first; only then may the decode allocate.
            time.sleep(float(msg.get("hold_s", 0.0)))
            sender.mark_prefill_complete()
        state = wait_for((KVPoll.WaitingForInput, KVPoll.Failed))
        if state != KVPoll.WaitingForInput:
            if state == -1:
                sender.abort()
                return {"status": "Timeout", "error": "decode never bootstrapped"}
            return {"status": "Failed", "error": failure()}
        self.event("waiting", room=room)
        if not deferred:
            # The decode has sent its metadata; this stands for the forward pass.
            time.sleep(float(msg.get("hold_s", 0.0)))

        with self.alloc_lock:
            token_indices = self.allocator.alloc(num_tokens)
            aux_index = self.metadata_allocator.alloc()
        try:
            pattern = pd_setup.kv_pattern(room, num_tokens)
            for layer in range(pd_setup.NUM_LAYERS):
                self.pool.k_buffer[layer][token_indices] = pattern[layer, 0]
                self.pool.v_buffer[layer][token_indices] = pattern[layer, 1]
            self.metadata_buffers.output_ids[aux_index][0] = room % 100_000
            # int32, as the rows of req_to_token that the scheduler reads.
            page_indices = kv_to_page_indices(
                token_indices.to(torch.int32), pd_setup.PAGE_SIZE
            )
            sender.init(len(page_indices), aux_index)
            self.event("sent", room=room, t_send=time.monotonic())
            sender.send(page_indices, None, num_kv_tokens=num_tokens)
            state = wait_for((KVPoll.Success, KVPoll.Failed))
        finally:
            with self.alloc_lock:
                self.allocator.free(token_indices)
                self.metadata_allocator.free(aux_index)
            if deferred:
                # prefill_complete: the decode hears of Success only from the
                # sender's clear(), which the prefill scheduler calls.
                sender.clear()
        if state == KVPoll.Success:
            return {"status": "Success"}
        if state == -1:
            return {"status": "Timeout", "error": "transfer did not finish"}
        return {"status": "Failed", "error": failure()}

    def serve(self) -> None:
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):
                return
            cmd = msg.get("cmd")
            if cmd == "stop":
                self.reply({"id": msg["id"], "ok": True})
                return
            if cmd == "send":
                self.cmd_send(msg)
                continue
            handler = getattr(self, f"cmd_{cmd}", None)
            try:
                if handler is not None:
                    out = handler(msg)
                else:
                    out = {"ok": False, "error": f"unknown command {cmd!r}"}
            except Exception:
                out = {"ok": False, "error": traceback.format_exc()}
            out["id"] = msg["id"]
            self.reply(out)


def main(worker_class=None) -> int:
    """``worker_class``: a Worker subclass (mirror_prefill.py's)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True, choices=["mooncake", "nixl"])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bootstrap-port", type=int, required=True)
    parser.add_argument("--ctl-fd", type=int, required=True)
    parser.add_argument(
        "--allocation-policy", default="early", choices=["early", "prefill_complete"]
    )
    parser.add_argument("--pool-tokens", type=int, default=pd_setup.POOL_TOKENS)
    args = parser.parse_args()

    _die_with_parent()
    pd_setup.apply_loopback_env()
    pd_setup.POOL_TOKENS = args.pool_tokens
    from multiprocessing.connection import Connection

    conn = Connection(args.ctl_fd)
    worker = (worker_class or Worker)(args, conn)
    try:
        worker.setup()
    except BaseException:
        conn.send({"id": 0, "event": "error", "error": traceback.format_exc()})
        return 1
    conn.send({"id": 0, "event": "ready", "pid": os.getpid()})
    worker.serve()
    # Threads of the KV manager and the bootstrap server are not joinable in
    # a bounded time; the harness owns this process, so leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
