"""The decode instance of the loopback harness, in this process: a real
DECODE-mode KV manager and ``DecodePreallocQueue`` (see harness.py)."""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import random
import time
from array import array
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple
from types import SimpleNamespace

import pd_setup
from call_recording import Cycle, _install_audit_hook, _Recorded
from prefill_processes import free_port
from scheduler_stub import (
    _make_queue_class,
    _SchedulerStub,
    _SingleRankGroup,
    _TimestampedDict,
)


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


def detect_variant() -> Tuple[str, str]:
    """(label, detected) of the sglang under test: detected is "patched" when
    CommonKVManager has has_parallel_info(), else "stock"; the label is
    SGLANG_PD_VARIANT when set, else the detected name."""
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    detected = "patched" if hasattr(CommonKVManager, "has_parallel_info") else "stock"
    return os.environ.get("SGLANG_PD_VARIANT") or detected, detected


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
        from sglang.srt.runtime_context import get_parallel

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
            transfer_queue=SimpleNamespace(
                queue=[], _deferred_releases=[], enable_staging=False, _served={}
            ),
            tree_cache=None,
            gpu_id=0,
            bootstrap_port=self.server_args.disaggregation_bootstrap_port,
            max_total_num_tokens=pd_setup.POOL_TOKENS,
            # _prealloc reserves no decode headroom: the patched admission's
            # share (see _prealloc) then counts the tokens it allocates.
            num_reserved_decode_tokens=0,
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
        # (Tracked, what the share counts of it) of the requests in quarantine.
        self.quarantined: List[Tuple[Tracked, SimpleNamespace]] = []
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
            if getattr(self.kv_manager, "peer_metrics", None) is not None:
                # With --enable-metrics, as process_decode_queue (patched).
                self.queue.publish_peer_metrics()
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
            # and may still write them (e.g. once resumed); real decode fences
            # them too, in the prefill's share, until the prefill is declared
            # failed (forget_prefill), which is when they go back here.
            self.quarantined_tokens += t.num_tokens
            receiver = t.decode_req.kv_receiver
            fenced = SimpleNamespace(
                req=t.decode_req.req,
                host_staged=False,
                served_before=getattr(t.decode_req, "served_before", 0),
                kv_receiver=SimpleNamespace(
                    bootstrap_addr=getattr(receiver, "bootstrap_addr", None),
                    prefill_dp_rank=getattr(receiver, "prefill_dp_rank", None),
                ),
            )
            self.quarantined.append((t, fenced))

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
        ``_send_kv_metadata`` do. With the patch, pop_preallocated's share
        check comes first (a request of a prefill at its share is skipped, not
        a break), on the harness's own transfers."""
        import torch
        from sglang.srt.mem_cache.common import kv_to_page_indices

        queue = self.queue
        shares, skipped, now = None, set(), time.monotonic()
        patched = hasattr(queue, "_cycle_shares")
        if patched:
            queue.transfer_queue.queue = [t.decode_req for t in self.transferring]
            # (decode_req, start, deadline, metadata slot, acks), held past
            # the deadline: fenced.
            queue.transfer_queue._deferred_releases = [
                (fenced, 0.0, 0.0, None, 0) for _, fenced in self.quarantined
            ]
        moved = []
        for decode_req in queue.queue:
            if not decode_req.waiting_for_input:
                continue
            t = self._by_decode_req.get(id(decode_req))
            if t is None:
                continue
            if patched and shares is None:  # once, if one may be admitted
                shares = queue._cycle_shares(now)
            held = patched and shares.stalled  # as pop_preallocated: else none is
            if held and queue._held_at_share(decode_req, shares, skipped, now):
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
            if patched:
                queue._note_admitted(decode_req, shares)
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
                # As DecodeTransferQueue._note_served counts it.
                served = getattr(self.queue.transfer_queue, "_served", None)
                if served is not None:
                    key = (receiver.bootstrap_addr, receiver.prefill_dp_rank)
                    served[key] = served.get(key, 0) + 1
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

    def timed(self, fn: Callable[[], object]) -> Cycle:
        """Run ``fn`` as a scheduling call of its own (timed and recorded like
        ``step()``), e.g. the aborts a scheduling cycle makes."""
        with _Recorded() as rec:
            fn()
        cycle = rec.cycle()
        self.cycles.append(cycle)
        return cycle

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
        kept = []
        for t, fenced in self.quarantined:
            if fenced.kv_receiver.bootstrap_addr == addr:
                self._release(t)
            else:
                kept.append((t, fenced))
        self.quarantined = kept
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
