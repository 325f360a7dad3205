from __future__ import annotations

import dataclasses
import logging
import os
import struct
import threading
import time
import uuid
from queue import Full, Queue
from typing import Dict, List, Optional, Tuple

import msgspec
import numpy as np
import numpy.typing as npt
import zmq
from mori.cpp import TransferStatus
from mori.io import (
    BackendType,
    EngineDesc,
    IOEngine,
    IOEngineConfig,
    MemoryDesc,
    MemoryLocationType,
    PollCqMode,
    RdmaBackendConfig,
    StatusCode,
)

from sglang.srt.disaggregation.base.conn import KVArgs, KVPoll
from sglang.srt.disaggregation.common.conn import (
    ABORT_TAG,
    AbortNotification,
    AckTarget,
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
    _run_transfer_worker,
    _TransferScheduler,
)
from sglang.srt.disaggregation.common.utils import (
    AuxDataCodec,
    FastQueue,
    TransferKVChunk,
    build_dcp_token_transfer_plan,
    group_concurrent_contiguous,
    pack_int_lists,
    unpack_int_lists,
)
from sglang.srt.disaggregation.utils import (
    DisaggregationMode,
    build_transfer_entry_pairs,
    compute_mamba_state_slice_byte_blocks,
    is_elided_entry,
    resolve_dcp_dst_entry_indices,
)
from sglang.srt.environ import envs
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.common import run_with_deadline
from sglang.srt.utils.network import NetworkAddress, get_local_ip_auto

logger = logging.getLogger(__name__)
MORI_GUARD = b"MoriMsgGuard"


def _normalize_state_indices_per_component(
    state_indices: Optional[List],
) -> Optional[List[Optional[npt.NDArray[np.int32]]]]:
    if state_indices is None:
        return None
    out: List[Optional[npt.NDArray[np.int32]]] = []
    for entry in state_indices:
        if entry is None:
            out.append(None)
        else:
            out.append(np.asarray(entry, dtype=np.int32).ravel())
    return out


def _pack_state_indices(
    state_indices: Optional[List[Optional[npt.NDArray[np.int32]]]],
) -> bytes:
    if not state_indices:
        return b""
    lists = [(arr.tolist() if arr is not None else []) for arr in state_indices]
    return pack_int_lists(lists, "i")


def _unpack_state_indices(buf: bytes) -> List[npt.NDArray[np.int32]]:
    if not buf:
        return []
    return [np.asarray(lst, dtype=np.int32) for lst in unpack_int_lists(buf, "i")]


def _pack_mem_desc_list(mems: List[MemoryDesc]) -> bytes:
    if not mems:
        return b""
    packed_descs = [mem.pack() for mem in mems]
    return msgspec.msgpack.encode(packed_descs)


def _unpack_mem_desc_list(blob: bytes) -> List[MemoryDesc]:
    if not blob:
        return []
    desc_blobs = msgspec.msgpack.decode(blob)
    return [MemoryDesc.unpack(b) for b in desc_blobs]


def _pack_mem_desc_lists(mems_per_comp: List[List[MemoryDesc]]) -> bytes:
    if not mems_per_comp:
        return b""
    return msgspec.msgpack.encode(
        [
            [None if mem is None else mem.pack() for mem in comp]
            for comp in mems_per_comp
        ]
    )


def _unpack_mem_desc_lists(blob: bytes) -> List[List[MemoryDesc]]:
    if not blob:
        return []
    nested = msgspec.msgpack.decode(blob)
    return [
        [None if b is None else MemoryDesc.unpack(b) for b in comp] for comp in nested
    ]


@dataclasses.dataclass
class TransferInfo:
    room: int
    endpoint: str
    dst_port: int
    engine_key: str
    dst_kv_indices: npt.NDArray[np.int32]
    dst_aux_index: int
    dst_state_indices: List[npt.NDArray[np.int32]]
    required_dst_info_num: int
    is_dummy: bool
    # Number of tokens decode already holds in its radix cache; prefill should
    # only send pages beyond this prefix. None means the receiver did not
    # populate this field (older receiver or radix-cache feature off) -> treat
    # as 0 (no prefix hit, full send) for backward compatibility.
    decode_prefix_len: Optional[int] = None

    @classmethod
    def from_zmq(cls, payload: List[bytes]) -> TransferInfo:
        room = int(payload[0].decode("ascii"))
        endpoint = payload[1].decode("ascii")
        dst_port = int(payload[2].decode("ascii"))
        engine_key = payload[3].decode("ascii")

        if payload[4]:
            dst_kv_indices = np.frombuffer(payload[4], dtype=np.int32)
        else:
            dst_kv_indices = np.array([], dtype=np.int32)

        if payload[5]:
            dst_aux_index = int(payload[5].decode("ascii"))
        else:
            dst_aux_index = -1

        if len(payload) > 6 and payload[6]:
            dst_state_indices = _unpack_state_indices(payload[6])
        else:
            dst_state_indices = []

        required_dst_info_num = (
            int(payload[7].decode("ascii")) if len(payload) > 7 else 1
        )

        if len(payload) > 8 and payload[8]:
            decode_prefix_len: Optional[int] = int(payload[8].decode("ascii"))
        else:
            decode_prefix_len = None

        # A transfer is "dummy" only when the receiver does not need any
        # kv/aux/state delivered. When decode_prefix_len > 0 and the delta is
        # exactly zero (full prefix hit), dst_kv_indices is empty but aux is
        # still needed -> not dummy.
        is_dummy = (
            dst_kv_indices.size == 0 and dst_aux_index < 0 and not decode_prefix_len
        )
        return cls(
            room=room,
            endpoint=endpoint,
            dst_port=dst_port,
            engine_key=engine_key,
            dst_kv_indices=dst_kv_indices,
            dst_aux_index=dst_aux_index,
            dst_state_indices=dst_state_indices,
            required_dst_info_num=required_dst_info_num,
            is_dummy=is_dummy,
            decode_prefix_len=decode_prefix_len,
        )


@dataclasses.dataclass
class KVArgsRegisterInfo:
    endpoint: str
    dst_port: int
    engine_desc: EngineDesc
    dst_kv_mem_descs: List[MemoryDesc]
    dst_aux_mem_descs: List[MemoryDesc]
    dst_state_mem_descs: List[List[MemoryDesc]]
    gpu_id: int
    decode_tp_size: int
    decode_tp_rank: int
    dst_kv_item_len: int
    dst_state_item_lens: List[List[int]]
    dst_state_dim_per_tensor: List[List[int]]
    dst_dcp_size: int = 1
    dst_dcp_rank: int = 0
    dst_state_layer_ids: List[List[int]] = dataclasses.field(default_factory=list)
    dst_kv_layer_ids: List[int] = dataclasses.field(default_factory=list)
    requires_dcp_relayout: bool = False
    dcp_token_item_lens: Optional[List[int]] = None

    @property
    def engine_key(self) -> str:
        return self.engine_desc.key

    @classmethod
    def from_zmq(cls, payload: List[bytes]) -> KVArgsRegisterInfo:
        endpoint = payload[1].decode("ascii")
        dst_port = int(payload[2].decode("ascii"))
        engine_desc = EngineDesc.unpack(payload[3])
        dst_kv_mem_descs = _unpack_mem_desc_list(payload[4])
        dst_aux_mem_descs = _unpack_mem_desc_list(payload[5])
        dst_state_mem_descs = _unpack_mem_desc_lists(payload[6])
        gpu_id = int(payload[7].decode("ascii"))
        decode_tp_size = int(payload[8].decode("ascii"))
        decode_tp_rank = int(payload[9].decode("ascii"))
        dst_kv_item_len = int(payload[10].decode("ascii"))
        dst_state_item_lens = (
            unpack_int_lists(payload[11], "I")
            if len(payload) > 11 and payload[11]
            else []
        )
        dst_state_dim_per_tensor = (
            unpack_int_lists(payload[12], "I")
            if len(payload) > 12 and payload[12]
            else []
        )
        dst_dcp_size = (
            int(payload[13].decode("ascii")) if len(payload) > 13 and payload[13] else 1
        )
        dst_dcp_rank = (
            int(payload[14].decode("ascii")) if len(payload) > 14 and payload[14] else 0
        )
        dst_state_layer_ids = (
            unpack_int_lists(payload[15], "I")
            if len(payload) > 15 and payload[15]
            else []
        )
        dst_kv_layer_ids = (
            list(struct.unpack(f"<{len(payload[16]) // 4}I", payload[16]))
            if len(payload) > 16 and payload[16]
            else []
        )
        return cls(
            endpoint=endpoint,
            dst_port=dst_port,
            engine_desc=engine_desc,
            dst_kv_mem_descs=dst_kv_mem_descs,
            dst_aux_mem_descs=dst_aux_mem_descs,
            dst_state_mem_descs=dst_state_mem_descs,
            gpu_id=gpu_id,
            decode_tp_size=decode_tp_size,
            decode_tp_rank=decode_tp_rank,
            dst_kv_item_len=dst_kv_item_len,
            dst_state_item_lens=dst_state_item_lens,
            dst_state_dim_per_tensor=dst_state_dim_per_tensor,
            dst_dcp_size=dst_dcp_size,
            dst_dcp_rank=dst_dcp_rank,
            dst_state_layer_ids=dst_state_layer_ids,
            dst_kv_layer_ids=dst_kv_layer_ids,
        )


@dataclasses.dataclass
class TPSliceConfig:
    page_size: int
    src_item_len: int
    dst_item_len: int
    bytes_per_token_src: int
    bytes_per_token_dst: int
    src_head_slice_offset: int
    dst_head_slice_offset: int
    heads_bytes_per_token_to_send: int


@dataclasses.dataclass(frozen=True)
class GroupedIndexPlan:
    src_starts: List[int]
    dst_starts: List[int]
    counts: List[int]

    @classmethod
    def from_groups(
        cls, src_groups: List[List[int]], dst_groups: List[List[int]]
    ) -> GroupedIndexPlan:
        if len(src_groups) != len(dst_groups):
            raise ValueError("Source and destination groups must have the same length")
        return cls(
            src_starts=[int(group[0]) for group in src_groups],
            dst_starts=[int(group[0]) for group in dst_groups],
            counts=[len(group) for group in src_groups],
        )

    @classmethod
    def from_indices(
        cls,
        src_indices: npt.NDArray[np.int64],
        dst_indices: npt.NDArray[np.int64],
    ) -> GroupedIndexPlan:
        if src_indices.size != dst_indices.size:
            raise ValueError("Source and destination indices must have the same length")
        if src_indices.size == 0:
            return cls([], [], [])
        breaks = (
            np.flatnonzero((np.diff(src_indices) != 1) | (np.diff(dst_indices) != 1))
            + 1
        )
        starts = np.concatenate(([0], breaks))
        ends = np.concatenate((breaks, [src_indices.size]))
        return cls(
            src_starts=src_indices[starts].tolist(),
            dst_starts=dst_indices[starts].tolist(),
            counts=(ends - starts).tolist(),
        )

    def materialize(self, item_len: int) -> BatchTransferPlan:
        return BatchTransferPlan(
            local_offsets=[start * item_len for start in self.src_starts],
            remote_offsets=[start * item_len for start in self.dst_starts],
            sizes=[count * item_len for count in self.counts],
        )


@dataclasses.dataclass(frozen=True)
class BatchTransferPlan:
    local_offsets: List[int]
    remote_offsets: List[int]
    sizes: List[int]

    def empty(self) -> bool:
        return not self.sizes


@dataclasses.dataclass(frozen=True)
class TransferTarget:
    info: TransferInfo
    peer_info: KVArgsRegisterInfo


class _MoriTransferSubmissionError(RuntimeError):
    def __init__(self, message: str, statuses: List[TransferStatus]):
        super().__init__(message)
        self.statuses = statuses


class _SubmissionLocal(threading.local):
    """Per-thread sink for statuses issued by a submission still in progress.

    `statuses` is None outside a tracked submission, so a leaf that records
    into it is a no-op on threads that are not submitting.
    """

    statuses: Optional[List[TransferStatus]] = None


class MoriKVManager(CommonKVManager):
    AUX_DATA_HEADER = b"AUX_DATA"
    # Implements teardown() below, so runtime PD role switching is supported.
    supports_role_switch = True
    # The ABORT ack is held until the transfer worker or drainer quiesces the room.
    supports_deferred_decode_kv_release = True

    # The bootstrap socket carries several message kinds, so the status message
    # is tagged. Mori has always shipped the failure reason with it.
    kv_status_msg_tag = MORI_GUARD
    kv_status_msg_carries_reason = True

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: ServerArgs,
        is_mla_backend: Optional[bool] = False,
    ):
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self.engine = self._init_engine()
        self.engine_desc = self.engine.get_engine_desc()
        self.kv_mem_descs: List[MemoryDesc] = []
        self.aux_mem_descs: List[MemoryDesc] = []
        self.state_mem_descs: List[List[Optional[MemoryDesc]]] = []
        self.transfer_lock = threading.Lock()
        self._submission_local = _SubmissionLocal()
        self._zmq_ctx = zmq.Context()
        self._socket_local = threading.local()
        # Set by teardown() to make worker threads exit (PoC: P<->D role switch).
        self._stopped = False
        self._worker_threads: List[threading.Thread] = []
        self._send_aux_rdma = envs.SGLANG_MORI_SEND_AUX_RDMA.get()
        self._register_local_buffers()
        if self.disaggregation_mode == DisaggregationMode.PREFILL:
            self._num_shards = max(1, envs.SGLANG_MORI_TRANSFER_SHARDS.get())
            self._transfer_queues: List[FastQueue] = [
                FastQueue() for _ in range(self._num_shards)
            ]
            self._wait_poll_ms = envs.SGLANG_MORI_WAIT_POLL_MS.get()
            self._transfer_timeout_ms = envs.SGLANG_MORI_TRANSFER_TIMEOUT_MS.get()
            self._abort_ack_lock = threading.Lock()
            if self.enable_deferred_decode_kv_release:
                # Unbounded: a transfer worker never waits on a put, however
                # many chunks a stuck decode leaves its drainers waiting on.
                self._drain_queue: Queue[
                    Optional[Tuple[TransferKVChunk, List[TransferStatus]]]
                ] = Queue()
            # Chunks queue by decode destination (see _TransferScheduler), not
            # by room: a decode that stops answering holds one worker.
            self._transfer_scheduler = _TransferScheduler()
            for shard, _ in enumerate(self._transfer_queues):
                queue = self._transfer_scheduler.worker_queue()
                # Track the thread so teardown() can join it: otherwise every
                # P->D->P flip that re-enters PREFILL leaks _num_shards threads
                # (each parked forever in FastQueue.get()).
                t = threading.Thread(
                    target=_run_transfer_worker,
                    args=(self._transfer_worker, queue),
                    daemon=True,
                    name=(
                        f"mori-xfer-dp{self.system_dp_rank}-"
                        f"tp{self.attn_tp_rank}-s{shard}"
                    ),
                )
                t.start()
                self._worker_threads.append(t)
                if self.enable_deferred_decode_kv_release:
                    t = threading.Thread(
                        target=self._drain_worker,
                        daemon=True,
                        name=(
                            f"mori-drain-dp{self.system_dp_rank}-"
                            f"tp{self.attn_tp_rank}-s{shard}"
                        ),
                    )
                    t.start()
                    self._worker_threads.append(t)
            self._start_bootstrap_thread()
        elif self.disaggregation_mode == DisaggregationMode.DECODE:
            self._worker_threads.append(self._start_decode_listener_thread())
            self._start_heartbeat_checker_thread()

    def _init_engine(self) -> IOEngine:
        if self.kv_args.ib_device:
            os.environ["MORI_RDMA_DEVICES"] = self.kv_args.ib_device

        self.local_ip = get_local_ip_auto()
        config = IOEngineConfig(host=self.local_ip, port=0)

        engine_key = (
            f"io-{self.disaggregation_mode.value}-"
            f"dp{self.system_dp_rank}-tp{self.attn_tp_rank}-"
            f"pid{os.getpid()}-{self.local_ip}-"
            f"{uuid.uuid4().hex[:8]}"
        )

        engine = run_with_deadline(
            lambda: IOEngine(engine_key, config),
            timeout_s=envs.SGLANG_DISAGGREGATION_ENGINE_INIT_TIMEOUT.get(),
            what=f"Mori IOEngine({engine_key!r}, host={self.local_ip!r})",
        )
        poll_mode = PollCqMode.POLLING

        qp_per_transfer = envs.SGLANG_MORI_QP_PER_TRANSFER.get()
        post_batch_size = envs.SGLANG_MORI_POST_BATCH_SIZE.get()
        num_worker_threads = envs.SGLANG_MORI_NUM_WORKERS.get()

        rdma_cfg = RdmaBackendConfig(
            qp_per_transfer,
            post_batch_size,
            num_worker_threads,
            poll_mode,
            False,
        )
        engine.create_backend(BackendType.RDMA, rdma_cfg)
        actual_port = engine.get_engine_desc().port
        assert actual_port > 0, f"Failed to bind port for engine {engine_key}"
        logger.debug(
            "Initialized Mori IOEngine %s at %s:%s (qp_per_transfer=%s, workers=%s, poll_mode=%s)",
            engine_key,
            self.local_ip,
            actual_port,
            qp_per_transfer,
            num_worker_threads,
            poll_mode.name,
        )
        return engine

    def _register_local_buffers(self) -> None:
        for ptr, length in zip(self.kv_args.kv_data_ptrs, self.kv_args.kv_data_lens):
            mem_desc = self.engine.register_memory(
                ptr,
                length,
                self.kv_args.gpu_id,
                MemoryLocationType.GPU,
            )
            self.kv_mem_descs.append(mem_desc)
        for ptr, length in zip(self.kv_args.aux_data_ptrs, self.kv_args.aux_data_lens):
            desc = self.engine.register_memory(
                ptr,
                length,
                -1,
                MemoryLocationType.CPU,
            )
            self.aux_mem_descs.append(desc)
        for component_ptrs, component_lens in zip(
            self.kv_args.state_data_ptrs,
            getattr(self.kv_args, "state_data_lens", []),
        ):
            component_descs: List[Optional[MemoryDesc]] = []
            for ptr, length in zip(component_ptrs, component_lens):
                if length == 0:
                    # Elided DSA index-K; ibv_reg_mr would abort on size 0.
                    # Keep the slot so descs stay index-aligned.
                    component_descs.append(None)
                    continue
                desc = self.engine.register_memory(
                    ptr,
                    length,
                    self.kv_args.gpu_id,
                    MemoryLocationType.GPU,
                )
                component_descs.append(desc)
            self.state_mem_descs.append(component_descs)

    def _transfer_worker(self, queue: FastQueue) -> None:
        while True:
            kv_chunk = queue.get()
            # teardown() pushes a None sentinel to unblock get() and stop the
            # worker: FastQueue.get() blocks indefinitely, so checking _stopped
            # alone can never wake a parked worker during a role switch.
            if kv_chunk is None:
                break
            self._mark_transfer_started(kv_chunk)
            try:
                is_quiescent = self._process_transfer_chunk(kv_chunk)
            except _MoriTransferSubmissionError as exc:
                logger.exception(
                    "Mori transfer submission failed for room %s",
                    kv_chunk.room,
                )
                self._handle_submission_failure(kv_chunk, exc)
                continue
            except Exception as exc:
                failure_reason = f"transfer worker raised: {exc!r}"
                try:
                    logger.exception(
                        "Mori transfer worker failed for room %s",
                        kv_chunk.room,
                    )
                except Exception:
                    pass
                try:
                    self.conclude_failure(
                        bootstrap_room=kv_chunk.room, failure_reason=failure_reason
                    )
                except Exception:
                    try:
                        logger.exception(
                            "Mori transfer worker failover failed for room %s",
                            kv_chunk.room,
                        )
                    except Exception:
                        pass
                self._mark_transfer_quiescent(kv_chunk)
                continue

            if is_quiescent:
                self._mark_transfer_quiescent(kv_chunk)

    def _handle_submission_failure(
        self, kv_chunk: TransferKVChunk, exc: _MoriTransferSubmissionError
    ) -> None:
        failure_reason = str(exc)
        if exc.statuses:
            self._enqueue_transfer_drain(kv_chunk, exc.statuses, failure_reason)
            return
        self._mark_transfer_quiescent(kv_chunk)
        self.conclude_failure(
            bootstrap_room=kv_chunk.room, failure_reason=failure_reason
        )

    def _mark_transfer_started(self, kv_chunk: TransferKVChunk) -> None:
        if not self.enable_deferred_decode_kv_release:
            return
        with self._abort_ack_lock:
            self._staging_outstanding[kv_chunk.room] += 1

    def _mark_transfer_quiescent(self, kv_chunk: TransferKVChunk) -> None:
        if not self.enable_deferred_decode_kv_release:
            return

        room = kv_chunk.room
        targets = None
        with self._abort_ack_lock:
            self._staging_outstanding[room] -= 1
            if self._staging_outstanding[room] <= 0:
                self._staging_outstanding.pop(room)
                if room not in self._deferred_ack_poisoned_rooms:
                    targets = self._deferred_ack_targets.pop(room, None)
        self._send_abort_acks(room, targets)

    def _poison_failed_transfer(
        self, room: int, statuses: List[TransferStatus]
    ) -> None:
        # Failed() makes no claim on what the write still puts into the decode's
        # pages, so the room never acks and decode falls back to its timeout.
        if self.enable_deferred_decode_kv_release and any(
            status.Failed() for status in statuses
        ):
            with self._abort_ack_lock:
                self.poison_deferred_ack_room(room)

    def _process_transfer_chunk(self, kv_chunk: TransferKVChunk) -> bool:
        room = kv_chunk.room
        if self._should_skip_transfer(room):
            return True

        if kv_chunk.wait_event is not None:
            kv_chunk.wait_event.synchronize()

        if self._should_skip_transfer(room):
            return True

        statuses = self._submit_transfer_chunk(kv_chunk)

        if self._should_skip_transfer(room):
            if not self.enable_deferred_decode_kv_release:
                return True
            # Aborted after submit: the writes must still quiesce before the ACK,
            # but that wait belongs to the drainer, not this shard worker.
            self._enqueue_transfer_drain(kv_chunk, statuses, None)
            return False

        failure_reason, is_quiescent = self._wait_for_chunk_completion(
            kv_chunk, statuses
        )
        if not is_quiescent:
            # The drainer now owns the decrement.
            return False
        self._poison_failed_transfer(room, statuses)
        if self._should_skip_transfer(room):
            return True
        if failure_reason is not None:
            self.conclude_failure(bootstrap_room=room, failure_reason=failure_reason)
            return True

        if kv_chunk.is_last_chunk:
            # conclude_transfer downgrades to Failed when a failure was recorded
            # while this chunk was in flight, and applies the same status locally
            # and on the wire.
            self.conclude_transfer(bootstrap_room=room, status=KVPoll.Success)
        return True

    def _wait_for_chunk_completion(
        self, kv_chunk: TransferKVChunk, statuses: List[TransferStatus]
    ) -> Tuple[Optional[str], bool]:
        try:
            failure_reason = self._wait_transfer_completion(statuses)
            is_quiescent = not self.enable_deferred_decode_kv_release or not any(
                status.InProgress() for status in statuses
            )
        except Exception as exc:
            if not self.enable_deferred_decode_kv_release:
                raise
            failure_reason = f"Transfer completion failed: {exc!r}"
            is_quiescent = False

        if not is_quiescent:
            self._enqueue_transfer_drain(kv_chunk, statuses, failure_reason)
        return failure_reason, is_quiescent

    def _submit_transfer_chunk(self, kv_chunk: TransferKVChunk) -> List[TransferStatus]:
        if not self.enable_deferred_decode_kv_release:
            return self._submit_kv_transfer(
                kv_chunk.room,
                kv_chunk.prefill_kv_indices,
                kv_chunk.index_slice,
                kv_chunk.is_last_chunk,
                aux_index=kv_chunk.prefill_aux_index,
                state_indices=kv_chunk.state_indices,
                num_kv_tokens=kv_chunk.num_kv_tokens,
            )

        self._submission_local.statuses = []
        try:
            return self._submit_kv_transfer(
                kv_chunk.room,
                kv_chunk.prefill_kv_indices,
                kv_chunk.index_slice,
                kv_chunk.is_last_chunk,
                aux_index=kv_chunk.prefill_aux_index,
                state_indices=kv_chunk.state_indices,
                num_kv_tokens=kv_chunk.num_kv_tokens,
            )
        except Exception as exc:
            raise _MoriTransferSubmissionError(
                f"Transfer submission failed: {exc}",
                list(self._submission_local.statuses),
            ) from exc
        finally:
            self._submission_local.statuses = None

    def _enqueue_transfer_drain(
        self,
        kv_chunk: TransferKVChunk,
        statuses: List[TransferStatus],
        failure_reason: Optional[str],
    ) -> None:
        # Conclude before the handoff so decode hears now and later chunks skip;
        # only the ACK waits for the drain.
        if failure_reason is not None:
            self.conclude_failure(
                bootstrap_room=kv_chunk.room, failure_reason=failure_reason
            )
        self._drain_queue.put((kv_chunk, statuses))

    def _drain_worker(self) -> None:
        while True:
            item = self._drain_queue.get()
            # teardown() pushes a None sentinel, as for the transfer workers.
            if item is None:
                break
            kv_chunk, statuses = item
            while True:
                try:
                    self._drain_transfer_statuses(kv_chunk, statuses)
                    break
                except Exception:
                    logger.exception(
                        "Mori transfer drainer failed for room %s; retrying",
                        kv_chunk.room,
                    )
                    time.sleep(max(self._wait_poll_ms, 1) / 1000)

    def _drain_transfer_statuses(
        self, kv_chunk: TransferKVChunk, statuses: List[TransferStatus]
    ) -> None:
        for status in statuses:
            if status.InProgress():
                status.Wait()
        self._poison_failed_transfer(kv_chunk.room, statuses)
        self._mark_transfer_quiescent(kv_chunk)

    def _should_skip_transfer(self, room: int) -> bool:
        # Single read: clear() may pop the room concurrently.
        status = self.request_status.get(room)
        if status is None or status == KVPoll.Failed:
            logger.debug(
                "Skipping chunk for room %s because it has already failed or been aborted",
                room,
            )
            return True
        return False

    def _wait_transfer_completion(
        self, statuses: List[TransferStatus]
    ) -> Optional[str]:
        if not statuses:
            return None

        start = time.perf_counter()
        sla_ms = self._transfer_timeout_ms

        while True:
            rc = self.engine.wait_all(statuses, timeout_ms=self._wait_poll_ms)
            if rc != StatusCode.IN_PROGRESS:
                if rc == StatusCode.SUCCESS:
                    return None
                return self._collect_transfer_failure_reason(statuses)
            if sla_ms > 0 and (time.perf_counter() - start) * 1000 >= sla_ms:
                return f"KV transfer exceeded SLA {sla_ms}ms"

    @staticmethod
    def _collect_transfer_failure_reason(statuses: List[TransferStatus]) -> str:
        for status in statuses:
            if status.Failed():
                return f"KV transfer failed: {status.Message()}"
        return "KV transfer failed due to unknown reason"

    def prepare_send_state_indices(
        self, state_indices: Optional[List]
    ) -> Optional[List]:
        if self._should_skip_cp_replicated_state_transfer():
            return None
        return _normalize_state_indices_per_component(state_indices)

    def add_transfer_request(
        self,
        bootstrap_room: int,
        kv_indices: npt.NDArray[np.int32],
        index_slice: slice,
        is_last_chunk: bool,
        aux_index: Optional[int] = None,
        state_indices: Optional[List] = None,
        num_kv_tokens: Optional[int] = None,
        *,
        wait_event: Optional[object] = None,
        indices_event: Optional[object] = None,
        trace_ctx=None,
    ) -> None:
        assert self.disaggregation_mode == DisaggregationMode.PREFILL
        assert not is_last_chunk or (is_last_chunk and aux_index is not None)

        if (
            bootstrap_room not in self.request_status
            or self.check_status(bootstrap_room) == KVPoll.Failed
        ):
            logger.debug(
                "Request with bootstrap_room=%s already failed", bootstrap_room
            )
            return

        if bootstrap_room not in self.transfer_infos:
            return

        shard_idx = bootstrap_room % self._num_shards
        self._transfer_queue(self._transfer_queues, shard_idx, bootstrap_room).put(
            TransferKVChunk(
                room=bootstrap_room,
                prefill_kv_indices=kv_indices,
                index_slice=index_slice,
                is_last_chunk=is_last_chunk,
                prefill_aux_index=aux_index,
                state_indices=state_indices,
                num_kv_tokens=num_kv_tokens,
                wait_event=wait_event,
            )
        )

    def _connect_threadsafe(self, endpoint: str, is_ipv6: bool = False):
        """Thread-local ZMQ socket cache with shared Context.

        Each worker thread gets its own PUSH socket (ZMQ sockets are not
        thread-safe), but all sockets share a single process-level Context
        to avoid creating excessive I/O threads and TCP connections.
        """
        cache = getattr(self._socket_local, "socket_cache", None)
        if cache is None:
            cache = {}
            self._socket_local.socket_cache = cache
        if endpoint not in cache:
            sock = self._zmq_ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.SNDTIMEO, 5000)
            sock.setsockopt(zmq.LINGER, 0)
            if is_ipv6:
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(endpoint)
            cache[endpoint] = sock
        return cache[endpoint]

    def _handle_register_message(self, payload: List[bytes]) -> None:
        try:
            register_info = KVArgsRegisterInfo.from_zmq(payload)
            self._add_remote_peer(register_info)
        except Exception:
            logger.exception("Failed to register remote peer")

    def _handle_transfer_message(self, payload: List[bytes]) -> None:
        try:
            transfer_info = TransferInfo.from_zmq(payload)
            with self.transfer_lock:
                # Accept metadata when room is not yet created (None) or
                # in Bootstrapping. Reject for active/terminal states where
                # the worker may already be using transfer_infos.
                # None is allowed because metadata can arrive from decode
                # before the prefill scheduler creates the MoriKVSender.
                current = self.request_status.get(transfer_info.room)
                if current is not None and current != KVPoll.Bootstrapping:
                    logger.debug(
                        "Ignoring stale transfer info for room %s (status=%s)",
                        transfer_info.room,
                        current,
                    )
                    return
                infos = self.transfer_infos.setdefault(transfer_info.room, {})
                infos[transfer_info.engine_key] = transfer_info

                if len(infos) >= transfer_info.required_dst_info_num:
                    self.resolve_kv_replica_factor(infos)
                    # All decode peers reported their dst metadata; pick a
                    # non-None decode_prefix_len if any peer set it (they
                    # should all agree, but be defensive). 0 means "no
                    # prefix hit", which is the same as "feature off".
                    chosen_prefix_len = next(
                        (
                            info.decode_prefix_len
                            for info in infos.values()
                            if info.decode_prefix_len is not None
                        ),
                        0,
                    )
                    self.req_to_decode_prefix_len[transfer_info.room] = (
                        chosen_prefix_len
                    )
                    if chosen_prefix_len > 0:
                        # Surface incremental KV transfer at INFO so it's
                        # visible without bumping the global log level.
                        logger.info(
                            "MoriKV incremental: room=%s prefix_len=%s peers=%s",
                            transfer_info.room,
                            chosen_prefix_len,
                            len(infos),
                        )
                    else:
                        logger.debug(
                            "Bootstrap room %s got enough transfer info (%s), "
                            "decode_prefix_len=0",
                            transfer_info.room,
                            len(infos),
                        )
                    self.update_status(transfer_info.room, KVPoll.WaitingForInput)
        except Exception:
            logger.exception("Failed to parse transfer info message")

    def _validate_message(self, msg: List[bytes]) -> Optional[List[bytes]]:
        if not msg or msg[0] != MORI_GUARD:
            logger.warning("Received malformed bootstrap message")
            return None
        payload = msg[1:]
        if not payload:
            return None
        return payload

    def _handle_abort_message(self, msg: List[bytes]) -> None:
        """Handle ABORT and defer its ACK until this rank's writes drain."""
        notification = AbortNotification.from_zmq(msg)
        if notification is None:
            return
        bootstrap_room = notification.room

        with self.transfer_lock:
            current = self.request_status.get(bootstrap_room)
            room_active = current is not None and current != KVPoll.Success
            if room_active and current != KVPoll.Failed:
                self.update_status(bootstrap_room, KVPoll.Failed)

        if room_active:
            logger.debug("Room %s marked Failed via ABORT from decode", bootstrap_room)
        else:
            logger.debug(
                "ABORT for room %s is already complete or not tracked",
                bootstrap_room,
            )

        self._arm_abort_ack(bootstrap_room, notification)

    def _arm_abort_ack(
        self,
        bootstrap_room: int,
        notification: AbortNotification,
    ) -> None:
        if not self.enable_deferred_decode_kv_release:
            return
        ack_target: Optional[AckTarget] = notification.deferred_ack_target()
        if ack_target is None:
            return

        with self._abort_ack_lock:
            if bootstrap_room in self._deferred_ack_poisoned_rooms:
                return
            if self._staging_outstanding.get(bootstrap_room, 0) > 0:
                self.register_deferred_ack_target(bootstrap_room, ack_target)
                return
        self._send_abort_ack(bootstrap_room, ack_target)

    def _start_bootstrap_thread(self) -> None:
        recv = self._make_worker_recv(self.server_socket)

        def bootstrap_worker():
            while not self._stopped:
                try:
                    msg = recv()
                    if msg is None:
                        continue

                    tag = msg[0]
                    if tag == ABORT_TAG:
                        self._handle_abort_message(msg)
                        continue

                    payload = self._validate_message(msg)
                    if payload is None:
                        continue
                    room = payload[0].decode("ascii")

                    if room == "None":
                        self._handle_register_message(payload)
                    else:
                        self._handle_transfer_message(payload)
                except Exception:
                    if self._stopped:
                        break
                    logger.exception("Bootstrap worker failed")

        t = threading.Thread(target=bootstrap_worker, daemon=True)
        t.start()
        self._worker_threads.append(t)

    def decode_message_handlers(self):
        handlers = super().decode_message_handlers()
        handlers[MoriKVManager.AUX_DATA_HEADER] = self._handle_aux_data
        return handlers

    def teardown(self) -> None:
        """Stop worker threads and release transport resources so this
        KVManager can be discarded during a P<->D role switch.

        The KV cache pool memory is owned by the scheduler and is NOT freed
        here; only mori-side registrations / sockets / engine are released.
        """
        self._stopped = True
        if self.disaggregation_mode == DisaggregationMode.DECODE:
            self._stop_bootstrap_fetches()
        if self._transfer_scheduler is not None:
            self._transfer_scheduler.shutdown()
        if self.peer_metrics is not None:
            self.peer_metrics.close()
        # Transfer workers (PREFILL role) park in FastQueue.get(), which has no
        # timeout; push a None sentinel per shard to wake and stop them so the
        # join below returns instead of leaking the thread.
        for queue in getattr(self, "_transfer_queues", []):
            try:
                queue.put(None)
            except Exception:
                logger.exception("Failed to signal mori transfer worker on teardown")
        # Drain workers park in Queue.get() the same way. A full queue means a
        # drainer is stuck in status.Wait(); its join below times out.
        if (
            self.disaggregation_mode == DisaggregationMode.PREFILL
            and self.enable_deferred_decode_kv_release
        ):
            for _ in range(self._num_shards):
                try:
                    self._drain_queue.put_nowait(None)
                except Full:
                    break
        # Join workers before touching their sockets: ZMQ sockets aren't
        # thread-safe, so don't close server_socket while a worker may poll it.
        for t in self._worker_threads:
            t.join(timeout=3.0)
        self._worker_threads = []
        # Drop the queues so their buffered tasks/senders are released too.
        self._transfer_queues = []
        try:
            self.server_socket.close(linger=0)
        except Exception:
            logger.exception("Failed to close mori server_socket during teardown")
        # destroy() force-closes every socket in the context (incl. per-thread
        # cached PUSH sockets); plain term() would block waiting on them.
        try:
            self._zmq_ctx.destroy(linger=0)
        except Exception:
            logger.exception("Failed to destroy mori zmq context during teardown")
        # Deregister RDMA memory and drop the IOEngine reference.
        try:
            for descs in (self.kv_mem_descs, self.aux_mem_descs):
                for desc in descs:
                    try:
                        self.engine.deregister_memory(desc)
                    except Exception:
                        pass
            for component_descs in self.state_mem_descs:
                for desc in component_descs:
                    if desc is None:
                        continue
                    try:
                        self.engine.deregister_memory(desc)
                    except Exception:
                        pass
        finally:
            self.kv_mem_descs = []
            self.aux_mem_descs = []
            self.state_mem_descs = []
            self.engine = None
        logger.info(
            "MoriKVManager torn down (was role=%s)", self.disaggregation_mode.value
        )

    def _add_remote_peer(self, register_info: KVArgsRegisterInfo) -> None:
        engine_key = register_info.engine_key
        if engine_key in self.decode_kv_args_table:
            logger.debug("Remote peer %s already registered. Skipping.", engine_key)
            return
        register_info.requires_dcp_relayout = self.requires_dcp_relayout(
            register_info.dst_dcp_size, register_info.dst_dcp_rank
        )
        if register_info.requires_dcp_relayout:
            num_entries = len(self.kv_args.kv_item_lens)
            num_draft = self.kv_args.num_draft_entries
            # The wire format registers only the target page item length.
            dst_item_lens = [register_info.dst_kv_item_len] * (
                num_entries - num_draft
            ) + [None] * num_draft
            register_info.dcp_token_item_lens = self.prepare_dcp_token_item_lens(
                dst_item_lens, register_info.dst_dcp_size
            )
        self.engine.register_remote_engine(register_info.engine_desc)
        if self.disaggregation_mode == DisaggregationMode.PREFILL:
            self.check_peer_aux_buffer_count(
                engine_key, len(register_info.dst_aux_mem_descs)
            )
        self.decode_kv_args_table[engine_key] = register_info
        logger.debug(
            "Registered decode peer %s (%s:%s)",
            engine_key,
            register_info.endpoint,
            register_info.dst_port,
        )

    def _get_mha_mem_desc_slices(
        self,
        dst_mem_descs: List[MemoryDesc],
        dst_kv_layer_ids: Optional[List[int]] = None,
    ) -> tuple[
        List[MemoryDesc], List[MemoryDesc], List[MemoryDesc], List[MemoryDesc], int
    ]:
        src_descs = self.kv_mem_descs
        if not src_descs:
            raise RuntimeError("KV memory descriptors are empty on prefill side")

        num_local_layers = len(src_descs) // 2
        src_k_descs = src_descs[:num_local_layers]
        src_v_descs = src_descs[num_local_layers:]

        # Both peers expose the same PP-local layout. Their descriptor indices
        # are already aligned, so applying the Prefill rank's global layer
        # offset would incorrectly index into a local list.
        if len(src_descs) == len(dst_mem_descs):
            dst_k_descs = dst_mem_descs[:num_local_layers]
            dst_v_descs = dst_mem_descs[num_local_layers:]
            return (
                src_k_descs,
                src_v_descs,
                dst_k_descs,
                dst_v_descs,
                num_local_layers,
            )

        src_layer_ids = getattr(self.kv_args, "kv_layer_ids", None) or []
        if src_layer_ids or dst_kv_layer_ids:
            dst_indices = resolve_dcp_dst_entry_indices(
                src_layer_ids,
                dst_kv_layer_ids or [],
                len(src_descs),
                len(dst_mem_descs),
            )
            dst_k_descs = [
                dst_mem_descs[dst_indices[i]] for i in range(num_local_layers)
            ]
            dst_v_descs = [
                dst_mem_descs[dst_indices[num_local_layers + i]]
                for i in range(num_local_layers)
            ]
            return (
                src_k_descs,
                src_v_descs,
                dst_k_descs,
                dst_v_descs,
                num_local_layers,
            )

        start_layer = self.kv_args.prefill_start_layer
        end_layer = start_layer + num_local_layers
        dst_total_layers = len(dst_mem_descs) // 2
        if len(dst_mem_descs) < 2 or end_layer > dst_total_layers:
            raise ValueError(
                "Destination KV descriptors do not match prefill pp configuration"
            )
        dst_k_descs = dst_mem_descs[start_layer:end_layer]
        if (
            num_local_layers < dst_total_layers
            and dst_total_layers % num_local_layers != 0
        ):
            # Decode has draft-model KV while Prefill has target-model KV only:
            # [K_main..., V_main..., draft_K..., draft_V...].
            multiplier_ratio = dst_total_layers // num_local_layers
            dst_v_offset = num_local_layers * multiplier_ratio
        else:
            dst_v_offset = dst_total_layers
        dst_v_descs = dst_mem_descs[
            dst_v_offset + start_layer : dst_v_offset + end_layer
        ]
        return src_k_descs, src_v_descs, dst_k_descs, dst_v_descs, num_local_layers

    def _get_mla_mem_desc_slices(
        self,
        dst_mem_descs: List[MemoryDesc],
        dst_kv_layer_ids: Optional[List[int]] = None,
    ) -> tuple[List[MemoryDesc], List[MemoryDesc], int]:
        src_descs = self.kv_mem_descs
        num_local_layers = len(src_descs)
        # Same-PP peers register matching local descriptor lists.
        if len(src_descs) == len(dst_mem_descs):
            return src_descs, dst_mem_descs, num_local_layers

        src_layer_ids = getattr(self.kv_args, "kv_layer_ids", None) or []
        if src_layer_ids or dst_kv_layer_ids:
            dst_indices = resolve_dcp_dst_entry_indices(
                src_layer_ids,
                dst_kv_layer_ids or [],
                num_local_layers,
                len(dst_mem_descs),
            )
            return (
                src_descs,
                [dst_mem_descs[i] for i in dst_indices],
                num_local_layers,
            )

        start_layer = self.kv_args.prefill_start_layer
        end_layer = start_layer + num_local_layers
        if end_layer > len(dst_mem_descs):
            raise ValueError(
                "Destination MLA KV descriptors do not match prefill pp configuration"
            )
        dst_slice = dst_mem_descs[start_layer:end_layer]
        return src_descs, dst_slice, num_local_layers

    def _submit_batch_transfer_plan(
        self,
        src_desc: MemoryDesc,
        dst_desc: MemoryDesc,
        plan: BatchTransferPlan,
    ) -> List[TransferStatus]:
        if plan.empty():
            return []

        transfer_uid = self.engine.allocate_transfer_uid()

        statuses = self.engine.batch_write(
            [src_desc],
            [plan.local_offsets],
            [dst_desc],
            [plan.remote_offsets],
            [plan.sizes],
            [transfer_uid],
        )
        self._record_submitted_statuses(statuses)
        return statuses

    def _record_submitted_statuses(self, statuses: List[TransferStatus]) -> None:
        active_statuses = self._submission_local.statuses
        if active_statuses is not None:
            active_statuses.extend(statuses)

    def _build_contiguous_transfer_plan(
        self, grouped_plan: GroupedIndexPlan, item_len: int
    ) -> BatchTransferPlan:
        # Reuse grouped indices across all layers/tensors that share the same item length.
        return grouped_plan.materialize(item_len)

    def _build_tp_slice_config(self, peer_info: KVArgsRegisterInfo) -> TPSliceConfig:
        from sglang.srt.disaggregation.common.staging_buffer import (
            compute_head_slice_params,
        )

        page_size = self.kv_args.page_size

        src_item_len = self.kv_args.kv_item_lens[0]
        dst_item_len = peer_info.dst_kv_item_len

        bytes_per_token_src = src_item_len // page_size
        bytes_per_token_dst = dst_item_len // page_size

        prefill_tp_size = self.attn_tp_size
        decode_tp_size = peer_info.decode_tp_size

        total_kv_heads = getattr(self.kv_args, "total_kv_head_num", 0)
        if total_kv_heads <= 0:
            total_kv_heads = self.kv_args.kv_head_num * prefill_tp_size

        dst_heads_per_rank = max(1, total_kv_heads // decode_tp_size)

        bytes_per_head_slice = bytes_per_token_dst // dst_heads_per_rank
        if bytes_per_head_slice == 0:
            raise ValueError("Head slice size evaluates to zero")

        src_head_start, num_heads_to_send, dst_head_start, _ = (
            compute_head_slice_params(
                prefill_tp_size,
                decode_tp_size,
                self.kv_args.engine_rank,
                peer_info.decode_tp_rank,
                total_kv_heads,
            )
        )

        src_head_slice_offset = src_head_start * bytes_per_head_slice
        dst_head_slice_offset = dst_head_start * bytes_per_head_slice
        heads_bytes_per_token = num_heads_to_send * bytes_per_head_slice

        if heads_bytes_per_token > bytes_per_token_dst:
            raise ValueError(
                "Slice size exceeds destination token capacity for TP slice transfer"
            )

        return TPSliceConfig(
            page_size=page_size,
            src_item_len=src_item_len,
            dst_item_len=dst_item_len,
            bytes_per_token_src=bytes_per_token_src,
            bytes_per_token_dst=bytes_per_token_dst,
            src_head_slice_offset=src_head_slice_offset,
            dst_head_slice_offset=dst_head_slice_offset,
            heads_bytes_per_token_to_send=heads_bytes_per_token,
        )

    def _build_tp_slice_transfer_plan(
        self,
        kv_indices: npt.NDArray[np.int32],
        dst_indices: npt.NDArray[np.int32],
        tp_cfg: TPSliceConfig,
    ) -> BatchTransferPlan:
        if kv_indices.size == 0 or dst_indices.size == 0:
            return BatchTransferPlan([], [], [])

        limit = min(kv_indices.size, dst_indices.size)
        if not limit:
            return BatchTransferPlan([], [], [])

        src_pages = kv_indices[:limit].astype(np.int64)
        dst_pages = dst_indices[:limit].astype(np.int64)
        token_slots = np.arange(tp_cfg.page_size, dtype=np.int64)

        src_page_bases = src_pages * tp_cfg.src_item_len
        dst_page_bases = dst_pages * tp_cfg.dst_item_len

        src_token_offsets = token_slots * tp_cfg.bytes_per_token_src
        dst_token_offsets = token_slots * tp_cfg.bytes_per_token_dst

        local_offsets = (
            (
                src_page_bases[:, np.newaxis]
                + src_token_offsets
                + tp_cfg.src_head_slice_offset
            )
            .flatten()
            .tolist()
        )
        remote_offsets = (
            (
                dst_page_bases[:, np.newaxis]
                + dst_token_offsets
                + tp_cfg.dst_head_slice_offset
            )
            .flatten()
            .tolist()
        )

        num_transfers = limit * tp_cfg.page_size
        sizes = [tp_cfg.heads_bytes_per_token_to_send] * num_transfers

        if not local_offsets:
            return BatchTransferPlan([], [], [])

        return BatchTransferPlan(
            local_offsets=local_offsets,
            remote_offsets=remote_offsets,
            sizes=sizes,
        )

    def send_kvcache(
        self,
        peer_info: KVArgsRegisterInfo,
        prefill_kv_indices: npt.NDArray[np.int32],
        dst_kv_indices: npt.NDArray[np.int32],
    ) -> List[TransferStatus]:
        grouped_plan = GroupedIndexPlan.from_groups(
            *group_concurrent_contiguous(
                prefill_kv_indices,
                dst_kv_indices,
            )
        )
        statuses: List[TransferStatus] = []
        kv_item_len = self.kv_args.kv_item_lens[0]

        if self.is_mla_backend or self.is_hybrid_mla_backend:
            src_descs, dst_descs, layers_current_pp_stage = (
                self._get_mla_mem_desc_slices(
                    peer_info.dst_kv_mem_descs, peer_info.dst_kv_layer_ids
                )
            )
            for layer_id in range(layers_current_pp_stage):
                layer_plan = self._build_contiguous_transfer_plan(
                    grouped_plan, self.kv_args.kv_item_lens[layer_id]
                )
                statuses.extend(
                    self._submit_batch_transfer_plan(
                        src_descs[layer_id],
                        dst_descs[layer_id],
                        layer_plan,
                    )
                )
            return statuses

        (
            src_k_descs,
            src_v_descs,
            dst_k_descs,
            dst_v_descs,
            layers_current_pp_stage,
        ) = self._get_mha_mem_desc_slices(
            peer_info.dst_kv_mem_descs, peer_info.dst_kv_layer_ids
        )

        if peer_info.decode_tp_size != self.attn_tp_size:
            tp_cfg = self._build_tp_slice_config(peer_info)
            slice_plan = self._build_tp_slice_transfer_plan(
                prefill_kv_indices, dst_kv_indices, tp_cfg
            )
            for layer_id in range(layers_current_pp_stage):
                statuses.extend(
                    self._submit_batch_transfer_plan(
                        src_k_descs[layer_id],
                        dst_k_descs[layer_id],
                        slice_plan,
                    )
                )
                statuses.extend(
                    self._submit_batch_transfer_plan(
                        src_v_descs[layer_id],
                        dst_v_descs[layer_id],
                        slice_plan,
                    )
                )
            return statuses

        layer_plan = self._build_contiguous_transfer_plan(grouped_plan, kv_item_len)
        for layer_id in range(layers_current_pp_stage):
            statuses.extend(
                self._submit_batch_transfer_plan(
                    src_k_descs[layer_id],
                    dst_k_descs[layer_id],
                    layer_plan,
                )
            )
            statuses.extend(
                self._submit_batch_transfer_plan(
                    src_v_descs[layer_id],
                    dst_v_descs[layer_id],
                    layer_plan,
                )
            )
        return statuses

    def send_kvcache_dcp(
        self,
        peer_info: KVArgsRegisterInfo,
        prefill_kv_indices: npt.NDArray[np.int32],
        dst_kv_indices: npt.NDArray[np.int32],
        *,
        src_page_offset: int,
        decode_prefix_len: int,
        num_kv_tokens: Optional[int],
    ) -> List[TransferStatus]:
        if num_kv_tokens is None:
            raise ValueError("PD DCP transfer requires num_kv_tokens")

        plan = build_dcp_token_transfer_plan(
            prefill_kv_indices,
            dst_kv_indices,
            physical_page_size=self.kv_args.page_size,
            dcp_size=peer_info.dst_dcp_size,
            dcp_rank=peer_info.dst_dcp_rank,
            src_page_offset=src_page_offset,
            decode_prefix_len=decode_prefix_len,
            num_kv_tokens=num_kv_tokens,
        )
        target_plan = GroupedIndexPlan.from_indices(
            plan.target_src_token_indices, plan.target_dst_token_indices
        )
        num_draft = self.kv_args.num_draft_entries
        num_target = len(self.kv_args.kv_item_lens) - num_draft
        draft_plan = (
            GroupedIndexPlan.from_indices(
                plan.draft_src_token_indices, plan.draft_dst_token_indices
            )
            if num_draft
            else None
        )
        token_item_lens = peer_info.dcp_token_item_lens
        if token_item_lens is None:
            raise RuntimeError("Missing Mori DCP token item lengths")

        # DCP relayout supports MLA and hybrid MLA, both with latent KV entries.
        src_descs, dst_descs, num_layers = self._get_mla_mem_desc_slices(
            peer_info.dst_kv_mem_descs, peer_info.dst_kv_layer_ids
        )
        desc_pairs = zip(src_descs[:num_layers], dst_descs[:num_layers])

        statuses: List[TransferStatus] = []
        plan_cache: Dict[tuple[bool, int], BatchTransferPlan] = {}
        for entry_idx, (src_desc, dst_desc) in enumerate(desc_pairs):
            item_len = token_item_lens[entry_idx]
            is_draft = entry_idx >= num_target
            cache_key = (is_draft, item_len)
            if cache_key not in plan_cache:
                grouped_plan = draft_plan if is_draft else target_plan
                plan_cache[cache_key] = grouped_plan.materialize(item_len)
            transfer_plan = plan_cache[cache_key]
            statuses.extend(
                self._submit_batch_transfer_plan(src_desc, dst_desc, transfer_plan)
            )
        return statuses

    def send_aux(
        self,
        peer_info: KVArgsRegisterInfo,
        prefill_aux_index: int,
        dst_aux_index: int,
        room: int,
    ) -> List[TransferStatus]:
        if self._send_aux_rdma:
            return self.send_aux_rdma(peer_info, prefill_aux_index, dst_aux_index, room)
        return self.send_aux_tcp(peer_info, prefill_aux_index, dst_aux_index, room)

    def send_aux_rdma(
        self,
        peer_info: KVArgsRegisterInfo,
        prefill_aux_index: int,
        dst_aux_index: int,
        room: int,
    ) -> List[TransferStatus]:
        if not self.aux_mem_descs or len(self.aux_mem_descs) != len(
            peer_info.dst_aux_mem_descs
        ):
            return self.send_aux_tcp(peer_info, prefill_aux_index, dst_aux_index, room)

        src_descs: List[MemoryDesc] = []
        dst_descs: List[MemoryDesc] = []
        local_offsets: List[List[int]] = []
        remote_offsets: List[List[int]] = []
        sizes: List[List[int]] = []
        uids = []
        for i in range(len(self.aux_mem_descs)):
            item_len = self.kv_args.aux_item_lens[i]
            src_descs.append(self.aux_mem_descs[i])
            dst_descs.append(peer_info.dst_aux_mem_descs[i])
            local_offsets.append([prefill_aux_index * item_len])
            remote_offsets.append([dst_aux_index * item_len])
            sizes.append([item_len])
            uids.append(self.engine.allocate_transfer_uid())
        statuses = list(
            self.engine.batch_write(
                src_descs, local_offsets, dst_descs, remote_offsets, sizes, uids
            )
        )
        self._record_submitted_statuses(statuses)
        return statuses

    def send_aux_tcp(
        self,
        peer_info: KVArgsRegisterInfo,
        prefill_aux_index: int,
        dst_aux_index: int,
        room: int,
    ) -> List[TransferStatus]:
        # Stop at the shorter list; see check_peer_aux_buffer_count.
        num_bufs = min(
            len(self.kv_args.aux_data_ptrs), len(peer_info.dst_aux_mem_descs)
        )
        for i in range(num_bufs):
            length = self.kv_args.aux_item_lens[i]
            src_addr = self.kv_args.aux_data_ptrs[i] + length * prefill_aux_index
            data = AuxDataCodec.serialize_data_from_buffer(src_addr, length)
            self._send_aux_data_to_endpoint(
                remote=peer_info.endpoint,
                dst_port=peer_info.dst_port,
                room=room,
                buffer_index=i,
                aux_index=dst_aux_index,
                data=data,
            )
        return []  # TCP path has no TransferStatus to poll

    def _send_aux_data_to_endpoint(
        self, remote, dst_port, room, buffer_index, aux_index, data
    ):
        na = NetworkAddress(remote, dst_port)
        socket = self._connect_threadsafe(na.to_tcp(), is_ipv6=na.is_ipv6)
        socket.send_multipart(
            [
                MoriKVManager.AUX_DATA_HEADER,
                str(room).encode("ascii"),
                str(buffer_index).encode("ascii"),
                str(aux_index).encode("ascii"),
                struct.pack(">I", len(data)),
                data,
            ]
        )

    def send_state(
        self,
        peer_info: KVArgsRegisterInfo,
        src_state_indices: List[npt.NDArray[np.int32]],
        dst_state_indices: List[npt.NDArray[np.int32]],
    ) -> List[TransferStatus]:
        # Guard: no local state tensors -> no-op (e.g. SWA layers=0 on this PP rank)
        if not self.state_mem_descs:
            return []

        state_types = self.kv_args.state_types
        if not state_types:
            raise RuntimeError(
                "PD state transfer failed: kv_args.state_types is empty but "
                "state_indices were provided"
            )

        if len(peer_info.dst_state_mem_descs) != len(self.state_mem_descs):
            raise RuntimeError(
                f"PD state transfer failed: state component count mismatch "
                f"(local={len(self.state_mem_descs)}, "
                f"remote={len(peer_info.dst_state_mem_descs)})"
            )

        src_state_item_lens = self.kv_args.state_item_lens
        src_state_dim_per_tensor = self.kv_args.state_dim_per_tensor

        statuses: List[TransferStatus] = []
        for i, st in enumerate(state_types):
            src_indices = src_state_indices[i] if i < len(src_state_indices) else None
            dst_indices = dst_state_indices[i] if i < len(dst_state_indices) else None
            if src_indices is None or src_indices.size == 0:
                continue
            if dst_indices is None or dst_indices.size == 0:
                continue

            src_descs = self.state_mem_descs[i]
            dst_descs = peer_info.dst_state_mem_descs[i]
            src_lens = src_state_item_lens[i] if i < len(src_state_item_lens) else []
            dst_lens = (
                peer_info.dst_state_item_lens[i]
                if i < len(peer_info.dst_state_item_lens)
                else []
            )
            src_dims = (
                src_state_dim_per_tensor[i] if i < len(src_state_dim_per_tensor) else []
            )
            dst_dims = (
                peer_info.dst_state_dim_per_tensor[i]
                if i < len(peer_info.dst_state_dim_per_tensor)
                else []
            )
            src_layer_ids = (
                self.kv_args.state_layer_ids[i]
                if i < len(self.kv_args.state_layer_ids)
                else []
            )
            dst_layer_ids = (
                peer_info.dst_state_layer_ids[i]
                if i < len(peer_info.dst_state_layer_ids)
                else []
            )

            if st == "mamba":
                if peer_info.decode_tp_size != self.state_tp_size and 0 in src_dims:
                    raise RuntimeError(
                        "Replicated Mamba PD state transfer currently requires "
                        "matching prefill/decode attention TP sizes"
                    )
                statuses.extend(
                    self._send_mamba_state(
                        peer_info,
                        src_indices,
                        dst_indices,
                        src_descs,
                        dst_descs,
                        src_lens,
                        dst_lens,
                        src_dims,
                        dst_dims,
                        self.kv_args.state_conv_shard_groups[i],
                        self.kv_args.state_slice_outer_counts[i],
                        src_layer_ids,
                        dst_layer_ids,
                    )
                )
            elif st in (
                "swa",
                "dsa",
                "qsa_pending",
                "qsa_compressed",
                "swa_ring",
                "c128_state",
                "minimax_index_k",
                "minimax_dense_kv",
            ):
                statuses.extend(
                    self._send_swa_dsa_state(
                        peer_info,
                        src_indices,
                        dst_indices,
                        src_descs,
                        src_lens,
                        dst_descs,
                        dst_lens,
                        st,
                        src_layer_ids,
                        dst_layer_ids,
                    )
                )
            else:
                raise RuntimeError(f"PD state transfer failed: unknown state_type={st}")

        return statuses

    def _send_mamba_state(
        self,
        peer_info: KVArgsRegisterInfo,
        src_state_indices: npt.NDArray[np.int32],
        dst_state_indices: npt.NDArray[np.int32],
        src_state_mem_descs: List[MemoryDesc],
        dst_state_mem_descs: List[MemoryDesc],
        src_state_item_lens: List[int],
        dst_state_item_lens: List[int],
        src_state_dim_per_tensor: List[int],
        dst_state_dim_per_tensor: List[int],
        src_state_conv_shard_groups: List[Optional[List[int]]],
        src_state_slice_outer_counts: List[int],
        src_layer_ids: List[int],
        dst_layer_ids: List[int],
    ) -> List[TransferStatus]:
        if src_state_indices.size != 1 or dst_state_indices.size != 1:
            raise RuntimeError(
                f"PD state transfer failed: mamba requires single state index, "
                f"got src={src_state_indices.size}, dst={dst_state_indices.size}"
            )

        tp_mismatch = peer_info.decode_tp_size != self.state_tp_size

        # If dim info missing, silently degrade to whole-item copy (Mooncake compat)
        if tp_mismatch and (
            not src_state_dim_per_tensor or not dst_state_dim_per_tensor
        ):
            tp_mismatch = False

        if tp_mismatch:
            logger.warning_once(
                "Using Mamba state slice transfer for different TP sizes between prefill and decode. "
                f"Prefill attn_tp_size={self.state_tp_size}, Decode attn_tp_size={peer_info.decode_tp_size}. "
                "Performance may be affected."
            )

        src_idx = int(src_state_indices[0])
        dst_idx = int(dst_state_indices[0])
        statuses: List[TransferStatus] = []

        local_tp_rank = self.kv_args.engine_rank % self.state_tp_size
        dst_tp_rank = peer_info.decode_tp_rank % peer_info.decode_tp_size

        pairs = build_transfer_entry_pairs(
            src_layer_ids,
            dst_layer_ids,
            len(src_state_mem_descs),
            len(dst_state_mem_descs),
            allow_positional_fallback=self.pp_size == 1,
        )
        for i, j in pairs:
            src_desc = src_state_mem_descs[i]
            dst_desc = dst_state_mem_descs[j]
            src_item_len = src_state_item_lens[i]

            if not tp_mismatch:
                # same-TP: whole item copy
                blocks = [
                    (src_idx * src_item_len, dst_idx * src_item_len, src_item_len)
                ]
            else:
                dst_item_len = dst_state_item_lens[j]
                src_dim = src_state_dim_per_tensor[i]
                dst_dim = dst_state_dim_per_tensor[j]
                conv_shard_groups = (
                    src_state_conv_shard_groups[i]
                    if i < len(src_state_conv_shard_groups)
                    else None
                )
                outer_count = (
                    src_state_slice_outer_counts[i]
                    if i < len(src_state_slice_outer_counts)
                    else 1
                )
                blocks = [
                    (
                        src_idx * src_item_len + src_offset,
                        dst_idx * dst_item_len + dst_offset,
                        size,
                    )
                    for src_offset, dst_offset, size in compute_mamba_state_slice_byte_blocks(
                        src_item_len=src_item_len,
                        dst_item_len=dst_item_len,
                        src_dim=src_dim,
                        dst_dim=dst_dim,
                        outer_count=outer_count,
                        src_attn_tp_size=self.state_tp_size,
                        dst_attn_tp_size=peer_info.decode_tp_size,
                        dst_tp_rank_in_group=dst_tp_rank,
                        local_tp_rank_in_group=local_tp_rank,
                        conv_shard_groups=conv_shard_groups,
                    )
                ]

            for src_offset, dst_offset, size in blocks:
                transfer_uid = self.engine.allocate_transfer_uid()
                batch_statuses = self.engine.batch_write(
                    [src_desc],
                    [[src_offset]],
                    [dst_desc],
                    [[dst_offset]],
                    [[size]],
                    [transfer_uid],
                )
                self._record_submitted_statuses(batch_statuses)
                statuses.extend(batch_statuses)

        return statuses

    def _send_swa_dsa_state(
        self,
        peer_info: KVArgsRegisterInfo,
        src_state_indices: npt.NDArray[np.int32],
        dst_state_indices: npt.NDArray[np.int32],
        src_state_mem_descs: List[MemoryDesc],
        src_state_item_lens: List[int],
        dst_state_mem_descs: List[MemoryDesc],
        dst_state_item_lens: List[int],
        state_type: str,
        src_layer_ids: List[int],
        dst_layer_ids: List[int],
    ) -> List[TransferStatus]:
        # TP mismatch check for non-MLA SWA
        if (
            state_type == "swa"
            and not self.is_mla_backend
            and peer_info.decode_tp_size != self.attn_tp_size
        ):
            raise RuntimeError(
                f"PD state transfer does not support TP-mismatched non-MLA SWA models "
                f"(prefill_tp_size={self.attn_tp_size}, decode_tp_size={peer_info.decode_tp_size})"
            )
        if state_type in (
            "qsa_pending",
            "qsa_compressed",
            "minimax_index_k",
            "minimax_dense_kv",
        ):
            if self.pp_size is not None and self.pp_size > 1:
                # MORI registration does not exchange state_layer_ids. Compact
                # sparse-state lists therefore cannot be paired safely across
                # pipeline stages until that metadata is added to its protocol.
                raise RuntimeError(
                    f"MORI PD disaggregation requires PP=1 for {state_type}; "
                    "PP>1 needs peer state_layer_ids for global-layer descriptor "
                    "pairing."
                )
            # QSA state is whole on every rank, so it pairs by state TP.
            src_tp_size = (
                self.state_tp_size
                if state_type in ("qsa_pending", "qsa_compressed")
                else self.attn_tp_size
            )
            if peer_info.decode_tp_size != src_tp_size:
                raise RuntimeError(
                    f"PD disagg: heterogeneous TP not supported for {state_type} yet."
                )

        common_len = min(src_state_indices.size, dst_state_indices.size)
        if (
            state_type == "c128_state"
            and common_len == 0
            and src_state_indices.size == 0
            and dst_state_indices.size == 0
        ):
            return []
        if common_len == 0 and max(src_state_indices.size, dst_state_indices.size) > 0:
            raise RuntimeError(
                f"No overlapping state indices for state_type={state_type}"
            )
        if src_state_indices.size != dst_state_indices.size:
            # These components are position- or request-indexed: truncating
            # silently misaligns rows and corrupts KV. Paged swa/dsa tolerate
            # a 1-page drift -> keep truncation.
            if state_type in (
                "qsa_pending",
                "qsa_compressed",
                "swa_ring",
                "c128_state",
                "minimax_dense_kv",
            ):
                raise RuntimeError(
                    f"{state_type.upper()} state index length mismatch: "
                    f"src={src_state_indices.size}, dst={dst_state_indices.size}"
                )
            logger.warning(
                "State index length mismatch for %s: src=%d dst=%d; truncating to common prefix=%d",
                state_type,
                src_state_indices.size,
                dst_state_indices.size,
                common_len,
            )
            src_state_indices = src_state_indices[:common_len]
            dst_state_indices = dst_state_indices[:common_len]

        # Group contiguous indices and issue per-tensor transfers
        grouped_plan = GroupedIndexPlan.from_groups(
            *group_concurrent_contiguous(src_state_indices, dst_state_indices)
        )

        statuses: List[TransferStatus] = []
        pairs = build_transfer_entry_pairs(
            src_layer_ids,
            dst_layer_ids,
            len(src_state_mem_descs),
            len(dst_state_mem_descs),
            allow_positional_fallback=self.pp_size == 1,
        )
        for i, j in pairs:
            src_desc = src_state_mem_descs[i]
            dst_desc = dst_state_mem_descs[j]
            state_item_len = src_state_item_lens[i]
            if is_elided_entry(state_item_len, dst_state_item_lens, j):
                # DSA index-K elision gives every shared-topk layer a 0-row
                # buffer; either peer eliding it means nothing moves, and the
                # descriptor describes an empty allocation. Skipping keeps the
                # index alignment with state_mem_descs that registration relies on.
                continue

            statuses.extend(
                self._submit_batch_transfer_plan(
                    src_desc,
                    dst_desc,
                    self._build_contiguous_transfer_plan(grouped_plan, state_item_len),
                )
            )

        return statuses

    def _handle_aux_data(self, msg: List[bytes]):
        """Handle AUX_DATA messages received by the decode thread (legacy TCP path)."""
        room = int(msg[1].decode("ascii"))
        buffer_index = int(msg[2].decode("ascii"))
        aux_index = int(msg[3].decode("ascii"))
        data_length = struct.unpack(">I", msg[4])[0]
        data = msg[5]

        if len(data) != data_length:
            logger.error(f"AUX_DATA length mismatch for bootstrap_room {room}")
            return

        AuxDataCodec.deserialize_data_to_buffer(
            self.kv_args, buffer_index, aux_index, data
        )

    def _submit_kv_transfer(
        self,
        bootstrap_room: int,
        kv_indices: npt.NDArray[np.int32],
        index_slice: slice,
        is_last_chunk: bool,
        aux_index: Optional[int] = None,
        state_indices: Optional[List[npt.NDArray[np.int32]]] = None,
        num_kv_tokens: Optional[int] = None,
    ) -> List[TransferStatus]:
        assert self.disaggregation_mode == DisaggregationMode.PREFILL

        if (
            bootstrap_room not in self.request_status
            or self.request_status.get(bootstrap_room) == KVPoll.Failed
        ):
            return []

        targets: List[TransferTarget] = []
        with self.transfer_lock:
            current = self.request_status.get(bootstrap_room)
            if current is None or current == KVPoll.Failed:
                return []

            transfer_infos = self.transfer_infos.get(bootstrap_room)
            if not transfer_infos:
                raise RuntimeError(
                    f"No transfer info found for bootstrap_room={bootstrap_room}"
                )

            self.update_status(bootstrap_room, KVPoll.Transferring)
            for info in transfer_infos.values():
                peer_info = self.decode_kv_args_table.get(info.engine_key)
                if not peer_info:
                    raise RuntimeError(
                        f"Peer info missing for engine {info.engine_key}"
                    )
                targets.append(TransferTarget(info=info, peer_info=peer_info))

        result_statuses: List[TransferStatus] = []
        for target in targets:
            info = target.info
            peer_info = target.peer_info

            if not info.is_dummy:
                if peer_info.requires_dcp_relayout:
                    result_statuses.extend(
                        self.send_kvcache_dcp(
                            peer_info,
                            kv_indices,
                            info.dst_kv_indices,
                            src_page_offset=index_slice.start or 0,
                            decode_prefix_len=info.decode_prefix_len or 0,
                            num_kv_tokens=num_kv_tokens,
                        )
                    )
                else:
                    result_statuses.extend(
                        self.send_kvcache(
                            peer_info,
                            kv_indices,
                            info.dst_kv_indices[index_slice],
                        )
                    )

            if (
                is_last_chunk
                and state_indices is not None
                and not info.is_dummy
                and self.state_mem_descs
            ):
                result_statuses.extend(
                    self.send_state(peer_info, state_indices, info.dst_state_indices)
                )

            if (
                is_last_chunk
                and aux_index is not None
                and info.dst_aux_index >= 0
                and self.pp_group.is_last_rank
            ):
                result_statuses.extend(
                    self.send_aux(
                        peer_info, aux_index, info.dst_aux_index, bootstrap_room
                    )
                )

        return result_statuses

    def build_receiver_registration_message(self) -> List[bytes]:
        engine_desc_blob = self.engine_desc.pack()
        packed_kv_descs = _pack_mem_desc_list(self.kv_mem_descs)
        packed_aux_descs = _pack_mem_desc_list(self.aux_mem_descs)
        packed_state_descs = _pack_mem_desc_lists(self.state_mem_descs)
        gpu_id = str(self.kv_args.gpu_id).encode("ascii")
        decode_tp_size = str(self.attn_tp_size).encode("ascii")
        decode_tp_rank = str(self.kv_args.engine_rank).encode("ascii")
        kv_item_len = str(self.kv_args.kv_item_lens[0]).encode("ascii")
        packed_state_item_lens = pack_int_lists(self.kv_args.state_item_lens, "I")
        packed_state_dim_per_tensor = pack_int_lists(
            self.kv_args.state_dim_per_tensor, "I"
        )
        packed_state_layer_ids = pack_int_lists(self.kv_args.state_layer_ids, "I")
        packed_kv_layer_ids = struct.pack(
            f"<{len(self.kv_args.kv_layer_ids)}I",
            *self.kv_args.kv_layer_ids,
        )
        dcp_size = str(self.dcp_size).encode("ascii")
        dcp_rank = str(self.dcp_rank).encode("ascii")

        return [
            MORI_GUARD,
            "None".encode("ascii"),
            self.local_ip.encode("ascii"),
            str(self.rank_port).encode("ascii"),
            engine_desc_blob,
            packed_kv_descs,
            packed_aux_descs,
            packed_state_descs,
            gpu_id,
            decode_tp_size,
            decode_tp_rank,
            kv_item_len,
            packed_state_item_lens,
            packed_state_dim_per_tensor,
            dcp_size,
            dcp_rank,
            packed_state_layer_ids,
            packed_kv_layer_ids,
        ]

    def build_receiver_metadata_message(
        self,
        *,
        bootstrap_room: int,
        required_dst_info_num: int,
        kv_indices: npt.NDArray[np.int32],
        aux_index: Optional[int],
        state_indices: Optional[List],
        decode_prefix_len: Optional[int],
        is_dummy: bool,
        device_kv_indices: Optional[npt.NDArray[np.int32]] = None,
    ) -> List[bytes]:
        if is_dummy:
            kv_indices_bytes = aux_bytes = state_bytes = b""
        else:
            kv_indices_bytes = (
                np.asarray(kv_indices, dtype=np.int32).tobytes()
                if kv_indices.size
                else b""
            )
            aux_bytes = str(aux_index).encode("ascii") if aux_index is not None else b""
            normalized_state = _normalize_state_indices_per_component(state_indices)
            state_bytes = (
                _pack_state_indices(normalized_state)
                if normalized_state is not None
                else b""
            )
        decode_prefix_bytes = (
            str(int(decode_prefix_len)).encode("ascii")
            if decode_prefix_len is not None and decode_prefix_len > 0
            else b""
        )
        return [
            MORI_GUARD,
            str(bootstrap_room).encode("ascii"),
            self.local_ip.encode("ascii"),
            str(self.rank_port).encode("ascii"),
            self.engine_desc.key.encode("ascii"),
            kv_indices_bytes,
            aux_bytes,
            state_bytes,
            str(required_dst_info_num).encode("ascii"),
            decode_prefix_bytes,
        ]


class MoriKVSender(CommonKVSender):
    def clear(self) -> None:
        if self.kv_mgr.enable_deferred_decode_kv_release:
            with self.kv_mgr._abort_ack_lock:
                super().clear()
        else:
            super().clear()


class MoriKVReceiver(CommonKVReceiver):
    pass


class MoriKVBootstrapServer(CommonKVBootstrapServer):
    pass
