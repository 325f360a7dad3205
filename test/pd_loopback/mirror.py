"""The mirror cluster: one prefill and several decodes on 127.0.0.1, each in its
own process with a real KV manager, to see on the prefill whether a sick
decode delays a healthy one.

- the prefill is ``mirror_prefill.py``: a real bootstrap server and a real
  PREFILL-mode ``MooncakeKVManager`` / ``NixlKVManager``; each ``request``
  makes a real ``KVSender`` that sends a known KV pattern once the decode's
  metadata arrives;
- each decode is ``mirror_decode.py``: a real DECODE-mode manager and
  ``DecodePreallocQueue`` (decode_side.DecodeSide), stepped every 5 ms, which
  checks the KV it receives byte for byte.

A decode can be frozen (SIGSTOP) or made to stop reading its control socket.
Every room has a timeline in ``time.monotonic()`` (system-wide on Linux):
``t_send`` (the prefill called ``sender.send()``), ``t_done`` (the decode's
receiver reached Success or Failed). ``run_fault`` runs one fault on a sick
decode while a healthy one gets a room every ``interval`` seconds; the fault
rows (test_mirror.py) and bench P16 (tools/bench_mirror.py) share it.

To control which 0.5.23 queue a decode's rooms go to (the sum of its session
ports modulo SGLANG_DISAGGREGATION_QUEUE_SIZE), a Mooncake decode's RPC port
is drawn from a range with a chosen residue mod 4 (``PortBlock``) and a NIXL
decode's rank port is bound with one (``--rank-port-residue``).
"""

from __future__ import annotations

import itertools
import os
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import pd_setup  # noqa: E402
from prefill_processes import (  # noqa: E402
    HOST,
    PrefillProcess,
    free_port,
    install_signal_handlers,
)

FAULTS = ("frozen", "frozen_first_contact", "not_reading")

# The fault matrix's sick-decode rows (12-14; test_mirror.py and
# fault_matrix.py): every decode's rooms on the same one of two 0.5.23
# queues, so that stock's healthy decode waits 30-60 s, and the patched
# prefill's two transfer workers: one for the sick decode, one for the rest.
# Mooncake's own bound on a transfer (MC_TRANSFER_TIMEOUT, 30 s) shortened
# to keep the rows short; a decode frozen before the first transfer to it
# fails when the probe before that transfer gives up (~60 s, not settable).
ROW_TRANSFER_TIMEOUT_S = 3
ROW_PROBE_TIMEOUT_S = 62
ROW_ENV = {
    "SGLANG_DISAGGREGATION_QUEUE_SIZE": "2",
    "MC_TRANSFER_TIMEOUT": str(ROW_TRANSFER_TIMEOUT_S),
}
ROW_WINDOW_S = 6.0
ROW_DECODES = {"B": 0, "A1": 0, "A2": 0, "A3": 0}
# (name, title, fault, sick decode, what its rooms fail with, its bound)
ROWS = [
    (
        "decode_frozen",
        "12. decode frozen (SIGSTOP) after the first transfer to it",
        "frozen",
        "A1",
        "Failed to send kv chunk",
        ROW_TRANSFER_TIMEOUT_S,
    ),
    (
        "decode_frozen_first_contact",
        "13. decode frozen before the first transfer to it",
        "frozen_first_contact",
        "A2",
        "is not alive",
        ROW_PROBE_TIMEOUT_S,
    ),
    (
        "decode_not_reading",
        "14. decode not reading its control socket",
        "not_reading",
        "A3",
        None,
        None,
    ),
]


class MirrorChild(PrefillProcess):
    """A mirror process (the prefill or a decode) with PrefillProcess's
    hygiene and control connection."""

    def __init__(
        self, script: str, args: List[str], backend: str, log_dir: str, name: str
    ):
        super().__init__(backend, "", log_dir, name)
        self.script = os.path.join(HERE, script)
        self.args = args

    def command(self) -> List[str]:
        return [sys.executable, "-W", "ignore", self.script] + self.args

    def ready_info(self) -> dict:
        return self._ready.result(timeout=0)


class PortBlock:
    """A Mooncake decode's RPC port, hence its session id and its 0.5.23
    queue, with a chosen residue mod 4: the engine draws its RPC port (and its
    TCP data port) from [MC_MIN_RPC_PORT, MC_MAX_RPC_PORT]; the range [P, P+4]
    with P+1..P+3 held by listening sockets until the engine is up leaves P or
    P+4."""

    def __init__(self, residue: int):
        for _ in range(200):
            base = (random.randrange(20000, 30000) & ~3) + residue
            socks = []
            try:
                for port in range(base, base + 5):
                    s = socket.socket()
                    socks.append(s)
                    s.bind((HOST, port))
            except OSError:
                for s in socks:
                    s.close()
                continue
            socks[0].close()
            socks[4].close()
            for s in socks[1:4]:
                s.listen(1)
            self.base, self.socks = base, socks[1:4]
            return
        raise RuntimeError("no free port range for a Mooncake decode")

    def env(self) -> dict:
        return {
            "MC_MIN_RPC_PORT": str(self.base),
            "MC_MAX_RPC_PORT": str(self.base + 4),
        }

    def release(self) -> None:
        for s in self.socks:
            s.close()
        self.socks = []


class MirrorCluster:
    """One prefill and the named decodes; ``residues[name]`` pins a decode's
    0.5.23 queue (mod 4). ``env`` goes to every process."""

    def __init__(
        self,
        backend: str,
        decodes: Dict[str, Optional[int]],
        env: Optional[dict] = None,
        log_dir: Optional[str] = None,
        pool_tokens: int = 4096,
    ):
        install_signal_handlers()
        self.backend = backend
        self.env = dict(env or {})
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="pd-mirror-")
        os.makedirs(self.log_dir, exist_ok=True)
        model = pd_setup.ensure_tiny_model()
        self.bootstrap_port = free_port()
        self.prefill = MirrorChild(
            "mirror_prefill.py",
            [
                "--backend",
                backend,
                "--model-path",
                model,
                "--port",
                str(free_port()),
                "--bootstrap-port",
                str(self.bootstrap_port),
                "--pool-tokens",
                str(pool_tokens),
            ],
            backend,
            self.log_dir,
            "prefill",
        )
        self.decodes: Dict[str, MirrorChild] = {}
        self._blocks: Dict[str, PortBlock] = {}
        self._decode_env: Dict[str, dict] = {}
        for name, residue in decodes.items():
            args = [
                "--backend",
                backend,
                "--model-path",
                model,
                "--pool-tokens",
                str(pool_tokens),
            ]
            denv = {}
            if residue is not None and backend == "mooncake":
                self._blocks[name] = PortBlock(residue)
                denv = self._blocks[name].env()
            elif residue is not None:
                args += ["--rank-port-residue", str(residue)]
            self._decode_env[name] = denv
            self.decodes[name] = MirrorChild(
                "mirror_decode.py", args, backend, self.log_dir, name
            )
        self.rooms: Dict[int, dict] = {}
        self.cond = threading.Condition()
        self._room_ids = itertools.count(random.randrange(1 << 40, 1 << 44))

    def __enter__(self) -> "MirrorCluster":
        try:
            self.prefill.on_event = self._on_event
            self.prefill.start(self.env)
            for name, child in self.decodes.items():
                child.on_event = self._on_event
                child.start(dict(self.env, **self._decode_env[name]))
            self.prefill.wait_ready(180)
            for child in self.decodes.values():
                child.wait_ready(180)
        except BaseException:
            self.close()
            raise
        finally:
            for block in self._blocks.values():
                block.release()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for block in self._blocks.values():
            block.release()
        for child in list(self.decodes.values()) + [self.prefill]:
            if child.proc is not None:
                child.kill()

    @property
    def addr(self) -> str:
        return f"{HOST}:{self.bootstrap_port}"

    def queue_of(self, name: str, queues: int) -> int:
        """The 0.5.23 queue of a decode's rooms."""
        info = self.decodes[name].ready_info()
        if self.backend == "mooncake":
            return int(info["session_id"].rsplit(":", 1)[1]) % queues
        return int(info["rank_port"]) % queues

    def state(self) -> dict:
        return self.prefill.call({"cmd": "state"})

    # -- rooms --------------------------------------------------------------

    def _on_event(self, msg: dict) -> None:
        with self.cond:
            room = self.rooms.get(msg.get("room"))
            if room is not None:
                event = msg.get("event")
                if event == "sent":
                    room["t_send"] = msg["t_send"]
                elif event == "waiting":
                    room["t_waiting"] = msg["t"] if "t" in msg else time.monotonic()
                elif event == "done":
                    room.update(
                        t_done=msg["t"],
                        state=msg["state"],
                        error=msg.get("error"),
                        kv_ok=msg.get("kv_ok"),
                    )
            self.cond.notify_all()

    def _on_prefill_done(self, room_id: int, fut) -> None:
        try:
            out = fut.result()
        except Exception as e:
            out = {"status": "Error", "error": repr(e)}
        with self.cond:
            self.rooms[room_id].update(
                t_pdone=time.monotonic(),
                pstatus=out.get("status"),
                perror=out.get("error"),
            )
            self.cond.notify_all()

    def request(
        self,
        decode: str,
        num_tokens: int = 16,
        hold_s: float = 0.0,
        timeout_s: float = 150,
    ) -> int:
        room = next(self._room_ids)
        with self.cond:
            self.rooms[room] = {
                "room": room,
                "decode": decode,
                "t_req": time.monotonic(),
            }
        fut = self.prefill._request(
            {
                "cmd": "send",
                "room": room,
                "num_tokens": num_tokens,
                "hold_s": hold_s,
                "timeout_s": timeout_s,
            }
        )
        fut.add_done_callback(lambda f, r=room: self._on_prefill_done(r, f))
        self.decodes[decode].call(
            {
                "cmd": "request",
                "room": room,
                "addr": self.addr,
                "num_tokens": num_tokens,
            }
        )
        return room

    def ended(self, room: int) -> bool:
        """The prefill's room ended, and the decode's too unless it failed
        (a frozen decode's receiver ends only once it runs)."""
        r = self.rooms[room]
        return "pstatus" in r and ("state" in r or r["pstatus"] != "Success")

    def wait(self, pred, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while not pred():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.5))
        return True

    def wait_rooms(self, rooms: List[int], timeout_s: float) -> bool:
        return self.wait(lambda: all(self.ended(r) for r in rooms), timeout_s)

    def latency(self, room: int) -> Optional[float]:
        """From the prefill's send() to the decode's Success."""
        r = self.rooms[room]
        if "t_send" in r and r.get("state") == "success":
            return r["t_done"] - r["t_send"]
        return None


def run_fault(
    cluster: MirrorCluster,
    fault: str,
    sick: str,
    healthy: str,
    window_s: float,
    interval_s: float = 0.5,
    baseline: int = 10,
    sick_rooms: int = 2,
    sick_tokens: int = 16,
) -> dict:
    """One fault on decode ``sick`` while ``healthy`` gets a room every
    ``interval_s`` for ``window_s``; returns the healthy decode's latencies
    alone and during the fault, and how the sick decode's rooms ended.

    - ``frozen``: the sick decode got a room first (the prefill has reached
      it), then is frozen after its next rooms' metadata reached the prefill
      and before the prefill sends them;
    - ``frozen_first_contact``: the same, but the prefill never sent to it
      before (Mooncake: the engine has not opened its segment);
    - ``not_reading``: the sick decode runs but its control socket is not
      read, so it hears of no room's end.
    """
    assert fault in FAULTS, fault
    c = cluster
    out = {"fault": fault}
    warm = [c.request(healthy)]
    if fault != "frozen_first_contact":
        warm.append(c.request(sick))
    c.wait_rooms(warm, 60)
    alone = []
    for _ in range(baseline):
        room = c.request(healthy)
        c.wait_rooms([room], 60)
        alone.append(room)
    state_before = c.state()
    if fault == "not_reading":
        c.decodes[sick].call({"cmd": "stop_reading"})
    sick_ids = [
        c.request(sick, num_tokens=sick_tokens, hold_s=1.0, timeout_s=400)
        for _ in range(sick_rooms)
    ]
    if fault != "not_reading":
        assert c.wait(
            lambda: all("t_waiting" in c.rooms[r] for r in sick_ids), 30
        ), "the sick decode's metadata did not reach the prefill"
        c.decodes[sick].freeze()
    t_fault = time.monotonic()
    during = []
    states = []
    k = 0
    while time.monotonic() < t_fault + window_s:
        target = t_fault + 0.5 + k * interval_s
        time.sleep(max(0.0, target - time.monotonic()))
        during.append(c.request(healthy, timeout_s=400))
        k += 1
        if k % int(max(1, 5 / interval_s)) == 0:
            states.append(dict(c.state(), t=time.monotonic() - t_fault))
    c.wait_rooms(during, 120)
    c.wait(lambda: all("pstatus" in c.rooms[r] for r in sick_ids), 120)
    out["state_end"] = c.state()
    out["state_before"] = state_before
    out["states"] = states
    out["alone"] = [c.latency(r) for r in alone]
    out["during"] = [
        {
            "t": c.rooms[r].get("t_send", c.rooms[r]["t_req"]) - t_fault,
            "latency": c.latency(r),
            "state": c.rooms[r].get("state"),
            "kv_ok": c.rooms[r].get("kv_ok"),
            "pstatus": c.rooms[r].get("pstatus"),
        }
        for r in during
    ]
    out["sick"] = [
        {
            "pstatus": c.rooms[r].get("pstatus"),
            "perror": c.rooms[r].get("perror"),
            "ended_after": (
                (c.rooms[r]["t_pdone"] - t_fault) if "t_pdone" in c.rooms[r] else None
            ),
        }
        for r in sick_ids
    ]
    lat = [d["latency"] for d in out["during"] if d["latency"] is not None]
    base = [x for x in out["alone"] if x is not None]
    out["summary"] = {
        "alone_median": statistics.median(base) if base else None,
        "alone_max": max(base) if base else None,
        "during_median": statistics.median(lat) if lat else None,
        "during_max": max(lat) if lat else None,
        "during_served": len(lat),
        "during_sent": len(during),
    }
    return out
