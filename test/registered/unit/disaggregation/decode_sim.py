"""A decode server's admission and transfer queues, driven by a fake clock.

The real DecodePreallocQueue.pop_preallocated, DecodeTransferQueue.pop_transferred
and resolve_deferred_releases run as the scheduler runs them
(process_decode_queue). What they call of 0.5.23's memory code is replaced by
a token counter (_pre_alloc, _release_request), and each prefill by a script:
when the KV of a room whose metadata it got arrives, whether it ever does,
and whether it acknowledges an ABORT. A request that gets its KV decodes for
``decode_s`` and then frees its tokens.

Several ranks (attention TP) run in lockstep on threads of their own; their
collectives (all_reduce_flags, poll_and_all_reduce) are exchanged through a
barrier, so a test is deterministic, and each rank may read its own clock.

Not a test module: the tests import it (test_decode_admission_edges.py).
"""

from __future__ import annotations

import itertools
import os
import threading
from contextlib import ExitStack
from types import SimpleNamespace
from typing import Dict, List, Optional
from unittest import mock

from sglang.srt.disaggregation import decode as decode_mod
from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.disaggregation.common.conn import KVTransferError, PrefillServerInfo
from sglang.srt.disaggregation.decode import (
    DecodePreallocQueue,
    DecodeRequest,
    DecodeTransferQueue,
)
from sglang.srt.managers.schedule_batch import FINISH_ABORT

RESERVED = 64  # num_reserved_decode_tokens


class Clock:
    """time.monotonic/time.time of one rank: the shared simulated time plus
    the rank's own offset."""

    def __init__(self, world: "World", offset: float = 0.0):
        self.world = world
        self.offset = offset

    def monotonic(self) -> float:
        return self.world.now + self.offset

    time = perf_counter = monotonic

    def sleep(self, _s: float) -> None:
        pass


class Prefill:
    """How one prefill serves the rooms it got the metadata of.

    transfer_s: seconds from the metadata to the KV's arrival; None never
    (a hung scheduler whose bootstrap server answers). acks: whether it
    acknowledges an ABORT once its transfer drained (deferred release)."""

    def __init__(self, addr: str, transfer_s: Optional[float] = 0.5, acks=True):
        self.addr = addr
        self.transfer_s = transfer_s
        self.acks = acks
        self.info = PrefillServerInfo(
            attn_tp_size=1,
            attn_cp_size=1,
            dp_size=1,
            pp_size=1,
            page_size=1,
            kv_cache_dtype=None,
            follow_bootstrap_room=False,
        )

    @property
    def stuck(self) -> bool:
        return self.transfer_s is None


class World:
    """The simulated time, the prefills, and the rooms' outcomes, shared by
    every rank (a prefill writes a room's KV to all decode ranks alike)."""

    def __init__(self, prefills: List[Prefill]):
        self.now = 0.0
        self.prefills = {p.addr: p for p in prefills}
        # room -> when the prefill got its metadata (the first rank's send).
        self.metadata_at: Dict[int, float] = {}
        self.aborted: Dict[int, float] = {}
        # Rooms whose ABORT the prefill read: sent while it was not frozen.
        self.heard = set()

    def arrived(self, room: int, prefill: Prefill) -> bool:
        sent = self.metadata_at.get(room)
        if sent is None or prefill.stuck or room in self.aborted:
            return False
        return self.now >= sent + prefill.transfer_s

    def abort_sent(self, room: int, prefill: Prefill) -> None:
        self.aborted.setdefault(room, self.now)
        if not prefill.stuck:
            self.heard.add(room)

    def acked(self, room: int, prefill: Prefill) -> bool:
        return prefill.acks and not prefill.stuck and room in self.heard


class FakeReceiver:
    """The receiver side as CommonKVReceiver behaves after init: bootstrapped
    (WaitingForInput) at once; Success when the KV arrived; Failed when
    aborted, or after the waiting timeout from send_metadata (0.5.23)."""

    supports_host_destination = False
    require_staging = False

    def __init__(self, rank: "Rank", prefill: Prefill, room: int):
        self.rank = rank
        self.world = rank.world
        self.prefill = prefill
        self.kv_mgr = rank.kv_manager
        self.bootstrap_addr = prefill.addr
        self.prefill_info = prefill.info  # set by init() from the table
        self.bootstrap_room = room
        self.bootstrap_infos = [{"rank_ip": "10.9.9.9", "rank_port": 1}]
        self.prefill_dp_rank = 0
        self.conclude_state = None
        self.abort_notified = False
        self.init_time = None
        self.sent_metadata = False

    def init(self, prefill_dp_rank: int) -> None:
        self.prefill_dp_rank = prefill_dp_rank

    def poll(self):
        if self.conclude_state is not None:
            return self.conclude_state
        if not self.sent_metadata:
            return KVPoll.WaitingForInput
        if self.world.arrived(self.bootstrap_room, self.prefill):
            self.conclude_state = KVPoll.Success
            return KVPoll.Success
        if self.rank.clock.monotonic() - self.init_time >= self.rank.waiting_timeout:
            self.kv_mgr.record_failure(
                self.bootstrap_room, "timed out in KVPoll.WaitingForInput"
            )
            self.conclude_state = KVPoll.Failed
            self.ensure_abort_notified()
            return KVPoll.Failed
        return KVPoll.Transferring

    def send_metadata(self, *args, **kwargs) -> None:
        self.sent_metadata = True
        self.init_time = self.rank.clock.monotonic()
        self.world.metadata_at.setdefault(self.bootstrap_room, self.world.now)

    def abort(self) -> None:
        if self.conclude_state != KVPoll.Failed:
            self.kv_mgr.record_failure(self.bootstrap_room, "Aborted by AbortReq.")
            self.conclude_state = KVPoll.Failed
        self.ensure_abort_notified()

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        if not self.abort_notified:
            self.abort_notified = True
            if self.sent_metadata:
                self._send_abort_notification(force_arm=force_arm)

    def _send_abort_notification(self, *, force_arm: bool = False) -> None:
        self.world.abort_sent(self.bootstrap_room, self.prefill)

    def failure_exception(self):
        self.conclude_state = KVPoll.Failed
        reason = self.kv_mgr.failure_records.pop(self.bootstrap_room, None)
        raise KVTransferError(
            self.bootstrap_room,
            reason or "Failed due to an unknown reason from another rank",
            is_from_another_rank=reason is None,
        )

    def clear(self) -> None:
        pass


class FakeKVManager:
    """What the queues read of the decode's kv manager. With deferred release
    off, a prefill acks an ABORT on reading it (Mooncake's [ABORT_ACK, room]);
    legacy_abort_ack False is NIXL's and Mori's, which send none."""

    legacy_abort_ack = True

    def __init__(self, rank: "Rank", deferred_release: bool):
        self.rank = rank
        self.world = rank.world
        self.prefill_info_table = {
            addr: p.info for addr, p in self.world.prefills.items()
        }
        self.failure_records: Dict[int, str] = {}
        self.failure_lock = threading.Lock()
        self.enable_deferred_decode_kv_release = deferred_release
        self.kv_args = SimpleNamespace(state_types=[])
        self.heartbeat_failures: Dict[str, int] = {}
        self.waiting_timeout = rank.waiting_timeout

    def record_failure(self, room: int, reason: str) -> None:
        self.failure_records[room] = reason

    def is_abort_release_safe(self, room: int, required_acks: int) -> bool:
        if required_acks == 0:
            return True
        addr = self.rank.room_prefill[room]
        drained = self.world.acked(room, self.world.prefills[addr])
        return drained and self.enable_deferred_decode_kv_release

    def abort_read_by(self, room: int) -> int:
        addr = self.rank.room_prefill[room]
        read = self.world.acked(room, self.world.prefills[addr])
        return int(read and not self.enable_deferred_decode_kv_release)

    def clear_deferred_abort_state(self, room: int) -> None:
        pass


class TokenAllocator:
    """token_to_kv_pool_allocator: page size 1, a count of free tokens."""

    page_size = 1

    def __init__(self, size: int):
        self.size = size
        self.free_tokens = size

    def available_size(self) -> int:
        return self.free_tokens

    def prealloc_fits(self, tree_cache, full, swa, *, full_budget_tokens, **_):
        return full <= full_budget_tokens

    def translate_kv_indices_for_transfer(self, indices):
        return indices


class SlotAllocator:
    """req_to_metadata_buffer_idx_allocator (and req_to_token_pool)."""

    def __init__(self, size: int):
        self.size = size
        self.free_slots = list(range(size))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, *_):
        return self.free_slots.pop(0) if self.free_slots else None

    def free(self, idx) -> None:
        self.free_slots.append(idx)


class Rows:
    """req_to_token_pool.req_to_token: only sliced, never read here."""

    def __getitem__(self, _):
        return self

    def __len__(self):
        return 0


class Rank:
    """One decode rank's real queues over fake memory, clock and prefills."""

    def __init__(
        self,
        world: World,
        *,
        tokens: int,
        slots: int,
        waiting_timeout: float,
        deferred_release: bool = True,
        release_timeout: float = 30.0,
        clock_offset: float = 0.0,
        priority: bool = False,
        decode_s: float = 1.0,
    ):
        self.world = world
        self.clock = Clock(world, clock_offset)
        self.waiting_timeout = waiting_timeout
        self.decode_s = decode_s
        self.kv_manager = FakeKVManager(self, deferred_release)
        self.allocator = TokenAllocator(tokens)
        self.room_prefill: Dict[int, str] = {}
        # Requests whose KV arrived, decoding until then: (done_at, decode_req).
        self.running: List = []
        self.served: Dict[int, float] = {}
        self.ended: Dict[int, str] = {}

        q = self.prealloc = DecodePreallocQueue.__new__(DecodePreallocQueue)
        t = self.transfer = DecodeTransferQueue.__new__(DecodeTransferQueue)
        scheduler = SimpleNamespace(
            running_batch=SimpleNamespace(reqs=[]),
            waiting_queue=[],
            enable_priority_scheduling=priority,
            schedule_low_priority_values_first=True,
            enable_lora=False,
            enable_hisparse=False,
            enable_decode_hicache=False,
            last_batch=None,
            output_streamer=SimpleNamespace(stream_output=self._stream_output),
            metrics_reporter=SimpleNamespace(enable_metrics=False),
            disagg_decode_prealloc_queue=q,
            tp_worker=SimpleNamespace(is_hybrid_swa=False),
        )
        metadata = SlotAllocator(slots)
        q.scheduler = scheduler
        q.kv_manager = self.kv_manager
        q.transfer_queue = t
        q.token_to_kv_pool_allocator = self.allocator
        q.token_to_kv_pool = SimpleNamespace(page_size=1)
        q.req_to_metadata_buffer_idx_allocator = metadata
        q.req_to_token_pool = SimpleNamespace(
            available_size=lambda: 1 << 20, req_to_token=Rows()
        )
        q.metadata_buffers = SimpleNamespace(clear_slot=lambda idx: None)
        q.tree_cache = None
        q.draft_token_to_kv_pool = None
        q.gloo_group = None
        q.tp_rank = 0
        q.pp_size = 1
        q.pp_rank = 0
        q.num_reserved_decode_tokens = RESERVED
        q.max_total_num_tokens = tokens
        q.queue = []
        q.retracted_queue = []
        q.pending_reqs = []
        q.held_rebootstrap_reqs = []
        q._prefill_dp_rank_queries = {}
        q._ensure_retry_count = {}
        q._ensure_last_attempt_time = {}
        q._ensure_retry_interval = 1.0
        q._max_ensure_retries = 15
        q._num_published_destinations = 0
        q.enable_staging = False
        q.transfer_backend = None
        for name, value in (
            # The pending path (dp ranks, routes) is not simulated: every
            # request is bootstrapped when it comes.
            ("_resolve_pending_reqs", lambda: None),
            ("_uses_swa_tail_prealloc", lambda: False),
            ("_uses_swa_reservation", lambda: False),
            ("_hicache_pending_restore_tokens", lambda: 0),
            ("_pre_alloc", self._pre_alloc),
            ("_transfer_page_indices", lambda decode_req, idx, page_size: idx),
        ):
            setattr(q, name, value)

        t.queue = []
        t.scheduler = scheduler
        t.gloo_group = None
        t.tp_rank = 0
        t.req_to_metadata_buffer_idx_allocator = metadata
        t.metadata_buffers = q.metadata_buffers
        t.tree_cache = None
        t.enable_host_receive = False
        t.enable_staging = False
        t.staging_handler = None
        t.enable_deferred_kv_release = deferred_release
        t.deferred_kv_release_timeout = release_timeout
        t._deferred_releases = []
        t._skipped_checksum_signatures = set()
        for name, value in (
            ("_release_request", self._release),
            ("_commit_transfer_to_req", lambda decode_req: None),
            ("_clean_hicache_prefetch_resources", lambda decode_req: None),
        ):
            setattr(t, name, value)

    # -- what 0.5.23's memory code does, counted in tokens ------------------
    def _pre_alloc(self, req, prefix_indices=None, prefix_len=0, total=0):
        need = DecodePreallocQueue._rebootstrap_prefill_len(req)  # with output
        assert self.allocator.free_tokens >= need, "admitted past the pool"
        self.allocator.free_tokens -= need
        req.kv.req_pool_idx = 0
        req.kv.holds_tokens = need
        return list(range(need))

    def _release(self, decode_req) -> None:
        kv = decode_req.req.kv
        self.allocator.free_tokens += kv.holds_tokens
        kv.holds_tokens = 0

    def _stream_output(self, reqs, *args, **kwargs) -> None:
        for req in reqs:
            if isinstance(req.finished_reason, FINISH_ABORT):
                self.ended.setdefault(req.bootstrap_room, req.finished_reason.message)

    # -- requests ----------------------------------------------------------
    def add(self, addr: str, room: int, prompt: int, priority: int = 0):
        """A request the router sent to ``addr``: bootstrapped at once, as a
        prefill whose bootstrap server answers makes it."""
        prefill = self.world.prefills[addr]
        host, port = addr.rsplit(":", 1)
        req = SimpleNamespace(
            rid=f"r{room}",
            bootstrap_host=host,
            bootstrap_port=int(port),
            bootstrap_room=room,
            origin_input_ids=[0] * prompt,
            output_ids=[],
            priority=priority,
            sampling_params=SimpleNamespace(max_new_tokens=8),
            finished_reason=None,
            finished_output=False,
            return_logprob=False,
            lora_id=None,
            disagg_prefill_dp_rank=None,
            kv=SimpleNamespace(holds_mamba=False, holds_kv=False, holds_tokens=0),
            time_stats=SimpleNamespace(
                set_bootstrap_done_time=lambda: None,
                set_decode_transfer_queue_entry_time=lambda: None,
            ),
        )
        self.room_prefill[room] = addr
        decode_req = DecodeRequest(
            req=req, kv_receiver=FakeReceiver(self, prefill, room)
        )
        self.prealloc.queue.append(decode_req)
        return decode_req

    def client_abort(self, room: int) -> None:
        """The client went away: the scheduler's abort of a queued request."""
        for decode_req in (*self.prealloc.queue, *self.transfer.queue):
            if decode_req.req.bootstrap_room == room:
                decode_req.kv_receiver.abort()

    # -- one scheduling cycle (process_decode_queue) -----------------------
    def cycle(self) -> None:
        self.transfer.resolve_deferred_releases()
        if hasattr(self.prealloc, "publish_peer_metrics"):  # not stock's (benches)
            self.prealloc.publish_peer_metrics()
        admitted, _ = self.prealloc.pop_preallocated()
        self.transfer.extend(admitted)
        for req in self.transfer.pop_transferred():
            self.served[req.bootstrap_room] = self.world.now
            self.running.append((self.world.now + self.decode_s, req))
        still = []
        for done_at, req in self.running:
            if self.world.now >= done_at:
                self.allocator.free_tokens += req.kv.holds_tokens
                req.kv.holds_tokens = 0
            else:
                still.append((done_at, req))
        self.running = still

    # -- what a test reads -------------------------------------------------
    def held_by(self, addr: str) -> int:
        """Tokens of the pool that ``addr``'s requests hold and that have not
        been handed to decoding: in transfer, or held after they ended."""
        entries = [r for r in self.transfer.queue] + [
            entry[0] for entry in self.transfer._deferred_releases
        ]
        return sum(
            r.req.kv.holds_tokens
            for r in entries
            if self.room_prefill[r.req.bootstrap_room] == addr
        )

    def waiting(self, addr: str) -> List[int]:
        return [
            r.req.bootstrap_room
            for r in self.prealloc.queue
            if self.room_prefill[r.req.bootstrap_room] == addr
        ]


class Collectives:
    """all_reduce_flags and poll_and_all_reduce across the ranks of a test,
    exchanged through a barrier: each rank's thread blocks until every rank
    brought its list, then all get the reduction."""

    def __init__(self, ranks: int):
        self.ranks = ranks
        self.barrier = threading.Barrier(ranks, timeout=10)
        self.lock = threading.Lock()
        self.slots: Dict[int, list] = {}
        self.calls = 0
        self.local = threading.local()

    def reduce(self, values: List[int], op_max: bool) -> List[int]:
        if not values:
            return values  # as all_reduce_flags: nothing is exchanged
        rank = getattr(self.local, "rank", 0)
        with self.lock:
            self.slots[rank] = list(values)
        self.barrier.wait()
        lists = [self.slots[r] for r in range(self.ranks)]
        assert all(
            len(x) == len(values) for x in lists
        ), f"ranks reduce lists of different lengths: {[len(x) for x in lists]}"
        out = [(max if op_max else min)(column) for column in zip(*lists)]
        self.barrier.wait()
        if rank == 0:
            self.calls += 1
        return out

    def all_reduce_flags(self, flags, group=None, op=None):
        import torch

        return self.reduce(flags, op_max=op == torch.distributed.ReduceOp.MAX)

    def poll_and_all_reduce(self, pollers, gloo_group=None, **kwargs):
        return self.reduce([p.poll() for p in pollers], op_max=False)


def patched(
    collectives: Collectives, clocks: List[Clock], waiting_timeout: float
) -> ExitStack:
    """The module globals and environment the queues read, for the duration
    of a test. ``time`` is each rank's own clock (by the calling thread)."""
    local = collectives.local

    class ThreadClock:
        def __getattr__(self, name):
            return getattr(clocks[getattr(local, "rank", 0)], name)

    stack = ExitStack()
    stack.enter_context(
        mock.patch.dict(
            os.environ,
            {"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(int(waiting_timeout))},
        )
    )
    for name, value in (
        ("time", ThreadClock()),
        ("all_reduce_flags", collectives.all_reduce_flags),
        ("poll_and_all_reduce", collectives.poll_and_all_reduce),
        ("ensure_mamba_capacity", lambda *a, **k: True),
        (
            "get_disagg",
            lambda: SimpleNamespace(
                disaggregation_decode_allocation_policy="early",
                disaggregation_decode_host_receive_threshold=1.0,
                disaggregation_decode_enable_radix_cache=False,
                disaggregation_transfer_backend="mooncake",
                disaggregation_decode_enable_offload_kvcache=False,
            ),
        ),
    ):
        stack.enter_context(mock.patch.object(decode_mod, name, value))
    return stack


def run_ranks(ranks: List[Rank], collectives: Collectives, step) -> None:
    """Run ``step(rank)`` on every rank at once, each on a thread of its own,
    and re-raise the first failure."""
    errors = []

    def body(i, rank):
        collectives.local.rank = i
        try:
            step(rank)
        except BaseException as e:  # noqa: B902 - re-raised below
            errors.append(e)
            collectives.barrier.abort()

    if len(ranks) == 1:
        body(0, ranks[0])
    else:
        threads = [
            threading.Thread(target=body, args=(i, r)) for i, r in enumerate(ranks)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]


rooms = itertools.count(1)
