"""A decode process of the mirror cluster (mirror.py): decode_side.DecodeSide (a
real DECODE-mode KV manager and DecodePreallocQueue) stepped every --period
seconds on its main thread, driven over a control connection.

Started by ``mirror.MirrorCluster``; not a test module. Events (id 0) to the
driver: ``metadata`` (the receiver sent its KV metadata: the prefill may send)
and ``done`` (Success or Failed, with whether the KV arrived intact).
Commands: ``request`` (room, addr, num_tokens), ``stop_reading`` /
``resume_reading`` (a gate in front of the KV manager's control socket: its
listener blocks before the next receive while the process runs), ``state``.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pd_setup  # noqa: E402
import prefill_worker  # noqa: E402

READ_GATE = threading.Event()
READ_GATE.set()
GATED = {"sock": None}


def install_read_gate() -> None:
    """The manager's control socket (GATED["sock"]) waits on READ_GATE before
    every receive."""
    import zmq

    original = zmq.Socket.recv_multipart

    def gated(sock, *args, **kwargs):
        if sock is GATED["sock"]:
            READ_GATE.wait()
        return original(sock, *args, **kwargs)

    zmq.Socket.recv_multipart = gated


def pin_rank_port_residue(residue: int) -> None:
    """NIXL puts a room on queue (decode rank port) % SGLANG_DISAGGREGATION_
    QUEUE_SIZE in 0.5.23: bind the rank port to a random port with this
    residue mod 4 (the port choice only)."""
    import random

    import zmq

    original = zmq.Socket.bind_to_random_port

    def bind(sock, addr, min_port=49152, max_port=65536, max_tries=100):
        for _ in range(max_tries):
            port = (random.randrange(min_port, max_port - 4) & ~3) + residue
            try:
                sock.bind(f"{addr}:{port}")
            except zmq.ZMQError:
                continue
            zmq.Socket.bind_to_random_port = original
            return port
        return original(sock, addr, min_port, max_port, max_tries)

    zmq.Socket.bind_to_random_port = bind


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True, choices=["mooncake", "nixl"])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--ctl-fd", type=int, required=True)
    parser.add_argument("--period", type=float, default=0.005)
    parser.add_argument("--pool-tokens", type=int, default=pd_setup.POOL_TOKENS)
    parser.add_argument("--rank-port-residue", type=int, default=None)
    args = parser.parse_args()

    prefill_worker._die_with_parent()
    pd_setup.apply_loopback_env()
    pd_setup.POOL_TOKENS = args.pool_tokens
    from multiprocessing.connection import Connection

    conn = Connection(args.ctl_fd)
    lock = threading.Lock()

    def send(msg: dict) -> None:
        with lock:
            conn.send(msg)

    try:
        import torch  # noqa: F401

        install_read_gate()
        if args.rank_port_residue is not None:
            pin_rank_port_residue(args.rank_port_residue)
        from decode_side import DecodeSide

        ds = DecodeSide(args.backend, args.model_path)
        mgr = ds.kv_manager
        GATED["sock"] = mgr.server_socket
        session = mgr.get_session_id() if args.backend == "mooncake" else mgr.agent.name
    except BaseException:
        send({"id": 0, "event": "error", "error": traceback.format_exc()})
        return 1
    send(
        {
            "id": 0,
            "event": "ready",
            "pid": os.getpid(),
            "session_id": session,
            "rank_port": mgr.rank_port,
        }
    )

    by_room = {}
    while True:
        while conn.poll(0):
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                os._exit(0)
            cmd = msg.get("cmd")
            out = {"ok": True}
            try:
                if cmd == "request":
                    t = ds.add(
                        msg["addr"],
                        num_tokens=int(msg["num_tokens"]),
                        room=int(msg["room"]),
                    )
                    by_room[t.room] = [t, False]
                elif cmd == "stop_reading":
                    READ_GATE.clear()
                elif cmd == "resume_reading":
                    READ_GATE.set()
                elif cmd == "state":
                    out.update(
                        threads=threading.active_count(),
                        unfinished=sum(1 for t in ds.tracked if not t.finished),
                    )
                else:
                    out = {"ok": False, "error": f"unknown command {cmd!r}"}
            except Exception:
                out = {"ok": False, "error": traceback.format_exc()}
            out["id"] = msg["id"]
            send(out)
        try:
            ds.step()
        except Exception:
            send({"id": 0, "event": "step_error", "error": traceback.format_exc()})
            time.sleep(0.5)
        # Bounded: drop the per-call records and the finished requests.
        del ds.cycles[:-100]
        del ds.adds[:-100]
        for room, entry in list(by_room.items()):
            t, reported = entry
            if t.t_metadata is not None and not reported:
                entry[1] = True
                send(
                    {"id": 0, "event": "metadata", "room": room, "t": time.monotonic()}
                )
            if t.finished:
                send(
                    {
                        "id": 0,
                        "event": "done",
                        "room": room,
                        "t": time.monotonic(),
                        "state": t.state,
                        "error": t.error,
                        "kv_ok": t.kv_ok,
                    }
                )
                del by_room[room]
        if len(ds.tracked) > 200:
            ds.tracked = [t for t in ds.tracked if not t.finished]
        time.sleep(args.period)


if __name__ == "__main__":
    sys.exit(main())
