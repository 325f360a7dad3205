"""Bench P18: one prefill, 64 decode destinations, 8 of them frozen.

The prefill's real Mooncake transfer path (MooncakeKVManager.add_transfer_request
and transfer_worker, with 0.5.23's queues on stock and the transfer scheduler
on the patch, 4 workers each as SGLANG_DISAGGREGATION_QUEUE_SIZE defaults to)
over a simulated engine that behaves as docs/results/mirror-study/engine-api.md
measured Mooncake's TCP transport:

- a transfer to a healthy decode takes ``--transfer-ms``;
- a transfer to a decode frozen after its first transfer returns -1 after
  MC_TRANSFER_TIMEOUT (30 s) (the real sync write spins a core meanwhile;
  here it waits);
- the first transfer to a decode frozen before any transfer to it opens its
  segment under the engine's lock, which it holds ~60 s: every other transfer
  waits for that lock; ``send_probe`` takes no lock, and to such a decode
  returns -102 after ~60 s.

Half the frozen decodes freeze before the prefill's first transfer to them,
half after. Every healthy destination gets a room every ``--interval-s``; one
room to each first, alone, for the baseline. Reported: the healthy rooms'
latency (add_transfer_request to Success) alone and during, the prefill's
threads, and every room's outcome.

    PYTHONPATH=<variant>:$REPO python3 tools/bench_transfer_scale.py --out r.json

or ``python3 dev.py bench --only scale`` for both variants and the report
(tools/bench_transfer_scale_report.py).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "test" / "registered" / "unit" / "disaggregation"))

import numpy as np  # noqa: E402

import test_decode_status_listener  # noqa: E402,F401  (stubs mori)
from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402
from sglang.srt.disaggregation.common import conn as conn_mod  # noqa: E402
from sglang.srt.disaggregation.common.utils import FastQueue  # noqa: E402
from sglang.srt.disaggregation.mooncake.conn import (  # noqa: E402
    MooncakeKVManager,
    TransferInfo,
)
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402

SYNC_TIMEOUT_S = 30.0  # MC_TRANSFER_TIMEOUT
HANDSHAKE_S = 60.0  # a cold frozen peer's handshake (engine-api.md 3a, 3c)


class Engine:
    """The simulated engine: see the module docstring."""

    def __init__(self, transfer_s: float):
        self.transfer_s = transfer_s
        self.segment_lock = threading.Lock()
        self.opened = set()
        self.frozen = set()
        self.thawed = threading.Event()

    def send_probe(self, session):
        if session in self.frozen and session not in self.opened:
            self.thawed.wait(HANDSHAKE_S)
            return -102
        return 0

    def transfer(self, session) -> int:
        # Opening a segment takes the engine's lock; a cold frozen peer's
        # handshake holds it.
        with self.segment_lock:
            if session not in self.opened:
                if session in self.frozen:
                    self.thawed.wait(HANDSHAKE_S)
                    return -1
                self.opened.add(session)
        if session in self.frozen:
            # The real sync write spins a core meanwhile, outside the GIL; here
            # it waits, so that Python threads do not stand for that CPU.
            self.thawed.wait(SYNC_TIMEOUT_S)
            return -1
        time.sleep(self.transfer_s)
        return 0


def make_prefill(engine: Engine, workers: int):
    mgr = MooncakeKVManager.__new__(MooncakeKVManager)
    mgr.disaggregation_mode = DisaggregationMode.PREFILL
    mgr.enable_trace = False
    mgr.enable_staging = False
    mgr.enable_deferred_decode_kv_release = False
    mgr.deferred_bootstrap = None
    mgr.is_mla_backend = True
    mgr.kv_args = SimpleNamespace(kv_data_ptrs=[1])
    mgr.request_status = {}
    mgr.transfer_infos = {}
    mgr.req_to_decode_prefix_len = {}
    mgr.decode_kv_args_table = {}
    mgr.session_lock = threading.Lock()
    mgr.failed_sessions = set()
    mgr.session_failures = defaultdict(int)
    mgr.failed_session_probes = {}
    mgr.state_layout_rejections = {}
    mgr.failure_lock = threading.Lock()
    mgr.failure_records = {}
    mgr._staging_outstanding = defaultdict(int)
    mgr._deferred_ack_targets = {}
    mgr._deferred_ack_poisoned_rooms = set()
    mgr.engine = engine
    mgr._get_dsa_cache_transfer_skip_flags = lambda info: (False, False)
    mgr.send_aux = lambda req, aux_index, dst_aux_ptrs: 0
    mgr.send_kvcache = lambda session, *args, **kwargs: engine.transfer(session)
    mgr.ended = queue.Queue()

    def send_kv_status_message(*, targets, bootstrap_room, status, **kwargs):
        mgr.ended.put((bootstrap_room, status, time.monotonic()))

    mgr.send_kv_status_message = send_kv_status_message
    mgr.transfer_queues = [FastQueue() for _ in range(workers)]
    scheduler_class = getattr(conn_mod, "_TransferScheduler", None)
    if scheduler_class is not None:
        # As the patched __init__ starts them.
        mgr._transfer_scheduler = scheduler_class(
            first_contact=mgr._probe_before_first_transfer
        )
        worker_queues = [mgr._transfer_scheduler.worker_queue() for _ in range(workers)]
    else:
        worker_queues = mgr.transfer_queues
    for q in worker_queues:
        threading.Thread(target=mgr.transfer_worker, args=(q, None), daemon=True).start()
    return mgr


def add_room(mgr, room: int, session: str) -> None:
    port = int(session.rsplit(":", 1)[1])
    mgr.request_status[room] = KVPoll.WaitingForInput
    mgr.decode_kv_args_table[session] = SimpleNamespace(
        requires_dcp_relayout=False,
        dst_kv_ptrs=[2],
        dst_aux_ptrs=[3],
        dst_kv_layer_ids=None,
        dst_kv_item_len=None,
        dst_attn_tp_size=1,
    )
    mgr.transfer_infos[room] = {
        session: TransferInfo(
            room=room,
            endpoint="127.0.0.1",
            dst_port=port,
            mooncake_session_id=session,
            dst_kv_indices=np.arange(4, dtype=np.int32),
            dst_aux_index=0,
            dst_state_indices=[],
            required_dst_info_num=1,
            is_dummy=False,
        )
    }
    mgr.add_transfer_request(room, np.arange(4, dtype=np.int32), slice(0, 4), True, 0)


def run(args) -> dict:
    engine = Engine(args.transfer_ms / 1000)
    threads_base = threading.active_count()  # the bench's, and earlier runs'
    mgr = make_prefill(engine, args.workers)
    sessions = [f"127.0.0.1:{20000 + 4 * i}" for i in range(args.destinations)]
    frozen = sessions[: args.frozen]
    before_contact = set(frozen[: args.frozen // 2])
    healthy = [s for s in sessions if s not in frozen]
    added = {}
    rooms = iter(range(1, 10**9))

    def add(session):
        room = next(rooms)
        added[room] = (session, time.monotonic())
        add_room(mgr, room, session)
        return room

    ended = {}

    def collect(until_rooms, timeout):
        deadline = time.monotonic() + timeout
        while not until_rooms <= ended.keys() and time.monotonic() < deadline:
            try:
                room, status, t = mgr.ended.get(timeout=0.5)
            except queue.Empty:
                continue
            ended[room] = (status, t)

    # Every decode not frozen before first contact gets a first transfer.
    warm = {add(s) for s in sessions if s not in before_contact}
    collect(warm, 60)
    alone = {add(s) for s in healthy}
    collect(alone, 60)
    threads_before = threading.active_count()
    cpu_before = time.process_time()
    engine.frozen.update(frozen)
    t_fault = time.monotonic()
    sick = {add(s) for s in frozen}
    during = set()
    peak_threads = threads_before
    while time.monotonic() < t_fault + args.window_s:
        for s in healthy:
            during.add(add(s))
        time.sleep(args.interval_s)
        peak_threads = max(peak_threads, threading.active_count())
    collect(during, 120)
    collect(sick, HANDSHAKE_S + SYNC_TIMEOUT_S + 30)
    cpu_s = time.process_time() - cpu_before
    engine.thawed.set()

    def latency(room):
        status, t = ended.get(room, (None, None))
        return t - added[room][1] if status == KVPoll.Success else None

    def pct(xs, q):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None

    alone_lat = [x for x in map(latency, alone) if x is not None]
    during_lat = [x for x in map(latency, during) if x is not None]
    outcome = defaultdict(lambda: defaultdict(int))
    for room in sick | during:
        kind = (
            "frozen before first contact"
            if added[room][0] in before_contact
            else "frozen after its first transfer"
            if added[room][0] in frozen
            else "healthy"
        )
        status = ended.get(room, (None,))[0]
        name = {KVPoll.Success: "served", KVPoll.Failed: "failed"}.get(status, "open")
        outcome[kind][name] += 1
    return {
        "variant": os.environ.get("SGLANG_PD_VARIANT", "unknown"),
        "workers": args.workers,
        "destinations": args.destinations,
        "frozen": args.frozen,
        "window_s": args.window_s,
        "interval_s": args.interval_s,
        "transfer_ms": args.transfer_ms,
        "alone": {"n": len(alone_lat), "p50": pct(alone_lat, 0.5), "p90": pct(alone_lat, 0.9)},
        "during": {
            "n": len(during_lat),
            "sent": len(during),
            "p50": pct(during_lat, 0.5),
            "p90": pct(during_lat, 0.9),
            "max": max(during_lat) if during_lat else None,
        },
        "threads": {
            "before": threads_before - threads_base,
            "peak": peak_threads - threads_base,
        },
        # Python-side CPU only: the simulated engine waits where the real
        # sync write spins, one core per transfer in flight (at most workers).
        "cpu_s": round(cpu_s, 2),
        "outcomes": {k: dict(v) for k, v in outcome.items()},
        "sick_ended_after_s": sorted(
            round(ended[r][1] - t_fault, 1) for r in sick if r in ended
        ),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--workers",
        default="4,8,16",
        help="comma-separated transfer worker counts (SGLANG_DISAGGREGATION_"
        "QUEUE_SIZE), one run each: 4 is the default, 8 the frozen, 16 more",
    )
    ap.add_argument("--destinations", type=int, default=64)
    ap.add_argument("--frozen", type=int, default=8)
    ap.add_argument("--window-s", type=float, default=20.0)
    ap.add_argument("--interval-s", type=float, default=0.5)
    ap.add_argument("--transfer-ms", type=float, default=5.0)
    ap.add_argument("--quick", action="store_true", help="a 10 s window")
    args = ap.parse_args(argv)
    if args.quick:
        args.window_s = 10.0
    runs = []
    for workers in map(int, args.workers.split(",")):
        result = run(argparse.Namespace(**{**vars(args), "workers": workers}))
        keys = ("workers", "alone", "during", "threads", "outcomes")
        print(json.dumps({k: result[k] for k in keys}), flush=True)
        runs.append(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": runs}, indent=1))
    os._exit(0)  # frozen transfers may still spin on daemon threads


if __name__ == "__main__":
    sys.exit(main())
