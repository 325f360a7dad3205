from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import re
import threading
import time
from collections import defaultdict, deque
from contextlib import nullcontext
from typing import (
    Callable,
    Dict,
    List,
    Literal,
    NamedTuple,
    Optional,
    Set,
    Tuple,
    Union,
)

import msgspec
import numpy as np
import numpy.typing as npt
import requests
import torch.distributed as dist
import zmq
from aiohttp import web

from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
    KVPoll,
    KVTransferDestination,
    KVTransferMetric,
    StateType,
)
from sglang.srt.disaggregation.common.bootstrap import (
    BootstrapNotification,
    DeferredBootstrap,
)
from sglang.srt.disaggregation.pp_consensus_store import PPConsensusStore
from sglang.srt.disaggregation.utils import (
    DisaggregationMode,
    filter_kv_indices_for_cp_rank,
    filter_kv_indices_for_shard_rank,
    get_dsv41_spec_layout,
)
from sglang.srt.environ import envs
from sglang.srt.mem_cache.page_interleave import get_kv_shard_group
from sglang.srt.observability.trace import TraceNullContext, TraceReqContext
from sglang.srt.runtime_context import (
    get_device,
    get_disagg,
    get_observability,
    get_parallel,
    get_schedule,
    get_serving,
    linear_attn_tp_size,
    max_prefill_buffer_tokens,
)
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.common import ceil_align
from sglang.srt.utils.network import (
    NetworkAddress,
    get_local_ip_auto,
    get_zmq_socket_on_host,
)

logger = logging.getLogger(__name__)

ABORT_TAG = b"ABORT"
ABORT_ACK_TAG = b"ABORT_ACK"
# requests' timeout=5 bounds each read, not the total: a query running this long
# (a peer that trickles) is given up, and counted as a failed attempt.
BOOTSTRAP_QUERY_TIMEOUT_S = 10
# Threads per prefill for the decode's calls to it, besides its heartbeat probe's.
PREFILL_THREADS = 2
# A heartbeat probe (timeout=(2, 3)) not answered this long is a miss.
HEARTBEAT_PROBE_TIMEOUT_S = 5


class _PrefillThreads:
    """The decode's threads for its calls to prefill servers: a call whose first
    argument is a bootstrap_addr runs on at most ``per_prefill`` threads of that
    prefill, so one that hangs or trickles holds only its own. Other calls go to
    ``shared``, 0.5.23's executor. Daemon threads, ended after ``idle_s`` idle:
    none waits on a prefill at teardown or exit, nor outlives one gone."""

    def __init__(self, shared, per_prefill: int = PREFILL_THREADS, idle_s=60.0):
        self._shared = shared
        self._per_prefill = per_prefill
        self._idle_s = idle_s
        self._lock = threading.Lock()
        self._stopped = False
        # bootstrap_addr -> its queued calls, its threads and how many idle.
        self._tasks: Dict[str, deque] = {}
        self._threads: Dict[str, int] = {}
        self._idle: Dict[str, int] = {}
        self._wake: Dict[str, threading.Condition] = {}

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        if not args or not isinstance(args[0], str):
            return self._shared.submit(fn, *args, **kwargs)
        addr = args[0]
        future = concurrent.futures.Future()
        with self._lock:
            if self._stopped:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if addr not in self._tasks:
                self._tasks[addr] = deque()
                self._threads[addr] = self._idle[addr] = 0
                self._wake[addr] = threading.Condition(self._lock)
            self._tasks[addr].append((future, fn, args, kwargs))
            # An idle thread takes one queued call, and it is counted idle
            # until it wakes: start another while more are queued than idle.
            if (
                len(self._tasks[addr]) <= self._idle[addr]
                or self._threads[addr] >= self._per_prefill
            ):
                self._wake[addr].notify()
                return future
            self._threads[addr] += 1
        thread = threading.Thread(
            target=self._work, args=(addr,), name=f"pd-prefill-{addr}", daemon=True
        )
        try:
            thread.start()
        except RuntimeError as e:  # out of threads: this call fails, not decode
            with self._lock:
                self._threads[addr] -= 1
                task = self._tasks[addr][-1] if self._tasks[addr] else None
                taken = task is None or task[0] is not future
                if not taken:
                    self._tasks[addr].pop()
            if not taken and future.set_running_or_notify_cancel():
                future.set_exception(e)
        return future

    def _work(self, addr: str) -> None:
        while True:
            with self._lock:
                tasks = self._tasks[addr]
                if not tasks and not self._stopped:
                    self._idle[addr] += 1
                    self._wake[addr].wait(self._idle_s)
                    self._idle[addr] -= 1
                if not tasks:
                    self._threads[addr] -= 1
                    if self._threads[addr] == 0:
                        for table in (self._tasks, self._threads, self._idle):
                            del table[addr]
                        del self._wake[addr]
                    return
                future, fn, args, kwargs = tasks.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as e:
                    future.set_exception(e)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """As ThreadPoolExecutor's, but never waits on a prefill."""
        with self._lock:
            self._stopped = True
            for addr, tasks in self._tasks.items():
                if cancel_futures:
                    for future, *_ in tasks:
                        future.cancel()
                    tasks.clear()
                self._wake[addr].notify_all()
        self._shared.shutdown(wait=False, cancel_futures=cancel_futures)


def _as_they_end(probes: Dict[str, concurrent.futures.Future], timeout: float):
    """(bootstrap_addr, probe) as each ends, then those running after timeout."""
    addr_of = {probe: addr for addr, probe in probes.items()}
    try:
        for probe in concurrent.futures.as_completed(addr_of, timeout):
            yield addr_of.pop(probe), probe
    except concurrent.futures.TimeoutError:
        pass
    yield from ((addr, probe) for probe, addr in addr_of.items())


# Reuse a keep-alive session per bootstrap_addr for decode-side bootstrap queries
# so we don't open a fresh TCP connection per query (that churns short-lived
# sockets and can exhaust ephemeral ports under high concurrency). Thread-local
# because requests.Session is not safe for concurrent cross-thread use.
_bootstrap_sessions = threading.local()


def _get_bootstrap_session(bootstrap_addr: str) -> requests.Session:
    sessions = getattr(_bootstrap_sessions, "by_addr", None)
    if sessions is None:
        sessions = {}
        _bootstrap_sessions.by_addr = sessions
    session = sessions.get(bootstrap_addr)
    if session is None:
        # Not evicted: the number of bootstrap_addr is bounded (one per prefill
        # server). Bootstrap is http-only, so only http:// is mounted.
        session = requests.Session()
        session.mount(
            "http://", requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=1)
        )
        sessions[bootstrap_addr] = session
    return session


# Destinations remembered as contacted: past it, the oldest is probed again.
_MAX_CONTACTED_DESTINATIONS = 4096


class _TransferScheduler:
    """The prefill's KV chunks, a FIFO per destination (the decode ranks a
    room goes to), served by the backend's transfer workers, whose number is
    fixed at startup (SGLANG_DISAGGREGATION_QUEUE_SIZE, as in 0.5.23). A
    worker's get() takes the next chunk of the destination that has waited
    longest, and no other worker takes that destination's chunks until this
    one asks for its next. A room's chunks thus go out in order, one at a
    time, and a decode that stops answering holds one worker (with DP
    attention, one per dp rank it has rooms of), with its rooms queued behind
    it; the other workers serve the other decodes.
    ``first_contact(destination)`` runs on the worker before a destination's
    first chunk, and again after ``forget`` of one of its members."""

    def __init__(self, first_contact: Optional[Callable[[tuple], None]] = None):
        self._first_contact = first_contact
        self._lock = threading.Lock()
        self._ready = threading.Condition(self._lock)
        self._chunks: Dict[tuple, deque] = {}
        # Destinations with chunks and no worker on them, oldest first.
        self._turns: deque = deque()
        self._contacted: Dict[tuple, None] = {}  # oldest first
        self._stopped = False
        # For /metrics: when the chunk each busy destination's worker sends was
        # queued, its queued chunks by room, and rooms failed by (destination,
        # kind).
        self._sending: Dict[tuple, float] = {}
        self._rooms: Dict[tuple, Dict[int, int]] = {}
        self._failed: Dict[Tuple[tuple, str], int] = defaultdict(int)
        self._failed_at: Dict[tuple, float] = {}

    def put(self, destination: tuple, chunk) -> None:
        with self._lock:
            chunks = self._chunks.get(destination)
            if chunks is None:
                chunks = self._chunks[destination] = deque()
                self._rooms[destination] = defaultdict(int)
                self._turns.append(destination)
                self._ready.notify()
            chunks.append((time.monotonic(), chunk))
            self._rooms[destination][getattr(chunk, "room", None)] += 1

    def note_failed(self, destination: tuple, kind: str) -> None:
        with self._lock:
            self._failed[destination, kind] += 1
            self._failed_at[destination] = time.monotonic()

    def metric_rows(self, labels: Dict[str, str], name=",".join) -> list:
        """Rows for _PeerMetrics; ``name(destination)`` is its ``decode`` label."""
        now, rows = time.monotonic(), []
        with self._lock:
            for destination, at in list(self._failed_at.items()):
                # A decode with nothing queued a minute after its last failure:
                # its series go, of every kind.
                if destination not in self._chunks and now - at >= 60:
                    del self._failed_at[destination]
            for key in [k for k in self._failed if k[0] not in self._failed_at]:
                del self._failed[key]
            # Written from 0 while it has chunks queued: a counter's first
            # sample is not seen by rate() and increase().
            for destination in self._failed_at.keys() | self._chunks.keys():
                for kind in ("session", "transfer"):
                    peer = {**labels, "decode": name(destination), "kind": kind}
                    n = self._failed.get((destination, kind), 0)
                    rows.append(("sglang:pd_decode_rooms_failed", peer, n))
            for destination, chunks in self._chunks.items():
                peer = {**labels, "decode": name(destination)}
                sending = self._sending.get(destination)
                oldest = chunks[0][0] if sending is None else sending
                queued = len(self._rooms[destination])
                rows += [
                    ("sglang:pd_decode_rooms_queued", peer, queued),
                    ("sglang:pd_decode_rooms_in_flight", peer, sending is not None),
                    ("sglang:pd_decode_oldest_chunk_age_seconds", peer, now - oldest),
                ]
            busy = len(self._sending)
        return rows + [("sglang:pd_transfer_workers_busy", labels, busy)]

    def forget(self, member) -> None:
        """The destinations with ``member`` (a decode that failed) get a first
        contact again on their next chunk: it may have restarted."""
        with self._lock:
            for destination in [d for d in self._contacted if member in d]:
                del self._contacted[destination]

    def worker_queue(self) -> "_WorkerQueue":
        """The queue one transfer worker runs on: transfer_worker(queue, ...)."""
        return _WorkerQueue(self)

    def shutdown(self) -> None:
        """Each worker's next get() returns None, which stops it."""
        with self._lock:
            self._stopped = True
            self._ready.notify_all()


class _Inbox(NamedTuple):
    scheduler: _TransferScheduler
    destination: tuple

    def put(self, chunk) -> None:
        self.scheduler.put(self.destination, chunk)


class _WorkerQueue:
    def __init__(self, scheduler: _TransferScheduler):
        self._scheduler = scheduler
        # The destination this worker is on: its last chunk's.
        self._destination: Optional[tuple] = None

    def get(self):
        scheduler = self._scheduler
        with scheduler._lock:
            self._leave()
            while not scheduler._turns and not scheduler._stopped:
                scheduler._ready.wait()
            if scheduler._stopped:
                return None
            destination = self._destination = scheduler._turns.popleft()
            queued_at, chunk = scheduler._chunks[destination].popleft()
            scheduler._sending[destination] = queued_at
            rooms, room = scheduler._rooms[destination], getattr(chunk, "room", None)
            rooms[room] -= 1
            if not rooms[room]:
                del rooms[room]
            first = destination not in scheduler._contacted
            if first:
                scheduler._contacted[destination] = None
                if len(scheduler._contacted) > _MAX_CONTACTED_DESTINATIONS:
                    del scheduler._contacted[next(iter(scheduler._contacted))]
        if first and scheduler._first_contact is not None:
            scheduler._first_contact(destination)
        return chunk

    def _leave(self) -> None:
        done, self._destination = self._destination, None
        self._scheduler._sending.pop(done, None)
        if done is not None and self._scheduler._chunks[done]:
            self._scheduler._turns.append(done)
            self._scheduler._ready.notify()
        elif done is not None:
            del self._scheduler._chunks[done]
            del self._scheduler._rooms[done]


def _run_transfer_worker(transfer_worker, queue, *args) -> None:
    """A transfer worker's thread. One that dies leaves its destination to the
    other workers, which would never take that decode's chunks again."""
    try:
        transfer_worker(queue, *args)
    finally:
        if isinstance(queue, _WorkerQueue):
            with queue._scheduler._lock:
                queue._leave()


# Per-peer series for /metrics (--enable-metrics): name -> (type, help).
PD_PEER_METRICS = {
    "sglang:pd_prefill_held_tokens": (
        "gauge",
        "Decode KV tokens in this prefill's share: the prompts and reserved decode "
        "headroom of its requests whose KV has not arrived, fenced ones included.",
    ),
    "sglang:pd_prefill_held_reqs": (
        "gauge",
        "Requests to this prefill holding decode KV and a metadata slot.",
    ),
    "sglang:pd_prefill_fenced_tokens": (
        "gauge",
        "Held tokens past the release timeout: the prefill may still write them.",
    ),
    "sglang:pd_prefill_waiting_reqs": (
        "gauge",
        "Requests to this prefill waiting for decode KV.",
    ),
    "sglang:pd_prefill_state": (
        "gauge",
        "0 answering, 1 missed a heartbeat or not reached yet, 2 held at its share, "
        "3 failed.",
    ),
    "sglang:pd_prefill_seconds_since_transfer": (
        "gauge",
        "Seconds since a transfer from this prefill to the decode last ended.",
    ),
    "sglang:pd_prefill_fetches_in_flight": (
        "gauge",
        "Bootstrap queries from the decode to this prefill running now.",
    ),
    "sglang:pd_prefill_failures": (
        "counter",
        "Requests to this prefill failed on the decode, by kind: bootstrap, "
        "transfer, heartbeat, timeout.",
    ),
    "sglang:pd_decode_rooms_queued": (
        "gauge",
        "Rooms queued on the prefill for this decode destination.",
    ),
    "sglang:pd_decode_rooms_in_flight": (
        "gauge",
        "Rooms a prefill transfer worker is sending to this decode now.",
    ),
    "sglang:pd_decode_oldest_chunk_age_seconds": (
        "gauge",
        "Age of the oldest KV chunk for this decode not yet sent.",
    ),
    "sglang:pd_decode_rooms_failed": (
        "counter",
        "Rooms failed to this decode, by kind: session (known failed), transfer.",
    ),
    "sglang:pd_transfer_workers_busy": (
        "gauge",
        "Transfer workers of the prefill sending now.",
    ),
}


def _scheduler_metric_labels(engine_type: str) -> Optional[Dict[str, str]]:
    """This scheduler's labels on sglang's own metrics, or None where it exports
    none (SchedulerMetricsCollector.init_new's rule): the series of DP replicas
    and PP stages never collide, and attention-TP ranks write them once."""
    from sglang.srt.runtime_context import (
        get_disagg,
        get_observability,
        get_parallel,
        get_serving,
    )

    observability, parallel = get_observability(), get_parallel()
    if not observability.enable_metrics or not (
        (parallel.attn_tp_rank == 0 and parallel.attn_cp_rank == 0)
        or observability.enable_metrics_for_all_schedulers
    ):
        return None
    labels = {
        "model_name": get_serving().served_model_name,
        # sglang's, which stays "dynamic" across role flips.
        "engine_type": "dynamic" if get_disagg().enable_pd_role_switch else engine_type,
        "tp_rank": parallel.tp_rank,
        "pp_rank": parallel.pp_rank,
        "moe_ep_rank": parallel.moe_ep_rank,
    }
    if parallel.dp_rank is not None:
        labels["dp_rank"] = parallel.dp_rank
    labels.update(observability.extra_metric_labels or {})
    return {name: str(value) for name, value in labels.items()}


class _PeerMetrics:
    """Writes a process's per-peer series for sglang's /metrics. sglang runs
    prometheus_client in multiprocess mode, where a series once written stays
    until its process exits; so they are written whole every ``interval`` s,
    a file per type in PROMETHEUS_MULTIPROC_DIR replaced atomically, and a
    peer gone is gone from the next file. ``rows()`` runs on this object's own
    thread and returns [(name, labels, value)], labels starting with
    ``labels`` (the scheduler's)."""

    rows: list = []  # what rows() returns without one: set by the decode

    def __init__(self, rows: Optional[Callable], directory: str, labels, interval=1):
        tag = f"{os.getpid()}pd{id(self)}"  # no "_": the collector splits on it
        self._paths = {
            "gauge": os.path.join(directory, f"gauge_livemostrecent_{tag}.db"),
            "counter": os.path.join(directory, f"counter_{tag}.db"),
        }
        self._rows, self._interval = rows or (lambda: self.rows), interval
        self.labels: Dict[str, str] = labels
        # The decode's scheduler thread's, for the rows it builds.
        self.served_at: Dict[str, float] = {}
        self.failures: Dict[Tuple[str, str], int] = defaultdict(int)
        self.gone: Dict[str, float] = {}  # since when a failed prefill is gone
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pd-peer-metrics")
        self._thread.daemon = True
        self._thread.start()

    @classmethod
    def start(cls, engine_type: str, rows) -> Optional["_PeerMetrics"]:
        """With --enable-metrics, on the ranks that write sglang's scheduler
        metrics, in a scheduler process."""
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        try:
            labels = _scheduler_metric_labels(engine_type) if directory else None
        except (ValueError, RuntimeError):  # context not published: no scheduler
            labels = None
        if labels is None:
            return None
        cls._remove_stale(directory)
        return cls(rows, directory, labels)

    @staticmethod
    def _remove_stale(directory: str) -> None:
        """Removes the files of schedulers that died without teardown, whose
        series would stay while the directory does (a user-set one outlives
        the server). A live one rewrites its files every second; a pid says
        nothing (a restarted container's scheduler often gets the same)."""
        ours = re.compile(r"(gauge_livemostrecent|counter)_\d+pd\d+\.db(\.tmp)?")
        for name in os.listdir(directory):
            path = os.path.join(directory, name)
            with contextlib.suppress(OSError):
                if ours.fullmatch(name) and time.time() - os.path.getmtime(path) > 60:
                    os.unlink(path)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.write()
            except Exception:
                logger.exception("Could not write the PD per-peer metrics")
        # Emptied, not removed: a /metrics that listed the files reads them.
        with contextlib.suppress(Exception):
            self.write(rows=[])

    def write(self, rows=None) -> None:
        from prometheus_client.mmap_dict import MmapedDict, mmap_key

        samples = {"gauge": {}, "counter": {}}
        for name, labels, value in self._rows() if rows is None else rows:
            typ, help_text = PD_PEER_METRICS[name]
            sample = f"{name}_total" if typ == "counter" else name
            key = mmap_key(name, sample, list(labels), list(labels.values()), help_text)
            samples[typ][key] = value
        now = time.time()
        for typ, values in samples.items():
            tmp = f"{self._paths[typ]}.tmp"  # not *.db: never read half-written
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            mmap = MmapedDict(tmp)
            try:
                for key, value in values.items():
                    mmap.write_value(key, value, now)
            finally:
                mmap.close()
            os.replace(tmp, self._paths[typ])

    def close(self) -> None:
        """Stops the thread, which then writes the files empty."""
        self._stop.set()


class KVTransferError(Exception):
    def __init__(
        self,
        bootstrap_room: int,
        failure_reason: str,
        is_from_another_rank: bool = False,
    ):
        super().__init__(failure_reason)
        self.bootstrap_room = bootstrap_room
        self.failure_reason = failure_reason
        self.is_from_another_rank = is_from_another_rank

    def __str__(self):
        return f"KVTransferError(bootstrap_room={self.bootstrap_room}): {self.failure_reason}"


@dataclasses.dataclass
class PrefillServerInfo:
    # Topology fields (fetched from bootstrap server)
    attn_tp_size: int
    attn_cp_size: int
    dp_size: int
    pp_size: int
    page_size: Optional[int]
    kv_cache_dtype: Optional[str]
    follow_bootstrap_room: bool
    enable_dsa_cache_layer_split: bool = False
    dsv41_spec_layout: Optional[dict] = None
    kv_layout: Optional[str] = None
    decode_allocation_policy: str = "early"
    # Each prefill shard-group rank owns a subset of logical KV pages.
    enable_kv_cache_sharding: bool = False

    # PD true-retraction rebootstrap: the prefill's HTTP API port. The decode
    # already knows the prefill host (the bootstrap_addr host), so it can POST
    # /generate to http://{bootstrap_host}:{prefill_http_port} to trigger a KV
    # recompute -- no router-injected pd_rebootstrap_prefill_url needed.
    prefill_http_port: Optional[int] = None

    # Pre-computed rank mapping (set by try_ensure_parallel_info on decode side)
    target_tp_rank: Optional[int] = None
    target_tp_ranks: Optional[List[int]] = None
    target_cp_ranks: Optional[List[int]] = None
    target_pp_ranks: Optional[List[int]] = None
    required_dst_info_num: Optional[int] = None
    required_prefill_response_num: Optional[int] = None

    def __post_init__(self):
        self.attn_tp_size = int(self.attn_tp_size)
        self.attn_cp_size = int(self.attn_cp_size)
        self.dp_size = int(self.dp_size)
        self.pp_size = int(self.pp_size)
        self.page_size = int(self.page_size) if self.page_size is not None else None
        self.kv_cache_dtype = (
            str(self.kv_cache_dtype) if self.kv_cache_dtype is not None else None
        )
        self.follow_bootstrap_room = bool(self.follow_bootstrap_room)
        self.enable_dsa_cache_layer_split = bool(self.enable_dsa_cache_layer_split)
        self.prefill_http_port = (
            int(self.prefill_http_port) if self.prefill_http_port is not None else None
        )


@dataclasses.dataclass
class PrefillRankInfo:
    rank_ip: str
    rank_port: int

    def __post_init__(self):
        self.rank_ip = str(self.rank_ip)
        self.rank_port = int(self.rank_port)


def _is_prefill_rank_info(bootstrap_info) -> bool:
    if not isinstance(bootstrap_info, dict):
        return False
    try:
        PrefillRankInfo(bootstrap_info["rank_ip"], bootstrap_info["rank_port"])
    except (KeyError, TypeError, ValueError):
        return False
    return True


class AckTarget(NamedTuple):
    ip: str
    port: int
    generation: int


class AbortNotification(msgspec.Struct, frozen=True):
    room: int
    decode_ip: Optional[str] = None
    decode_port: Optional[int] = None
    generation: Optional[int] = None

    @classmethod
    def from_zmq(cls, msg: List[bytes]) -> Optional[AbortNotification]:
        if len(msg) < 2:
            logger.warning("Malformed ABORT message: too few frames (%d)", len(msg))
            return None

        try:
            room = int(msg[1].decode("ascii"))
        except (ValueError, UnicodeDecodeError):
            logger.warning("Malformed ABORT message: invalid room field %r", msg[1])
            return None

        if len(msg) < 4:
            return cls(room=room)

        try:
            decode_ip = msg[2].decode("ascii")
            decode_port = int(msg[3].decode("ascii"))
        except (ValueError, UnicodeDecodeError):
            logger.warning("Malformed ABORT message: invalid return address")
            return cls(room=room)

        generation = None
        if len(msg) >= 5:
            try:
                generation = int(msg[4].decode("ascii"))
            except (ValueError, UnicodeDecodeError):
                logger.warning("Malformed ABORT message: invalid generation")
        return cls(
            room=room,
            decode_ip=decode_ip,
            decode_port=decode_port,
            generation=generation,
        )

    def to_zmq(self) -> List[bytes]:
        frames = [ABORT_TAG, str(self.room).encode("ascii")]
        if self.decode_ip is not None and self.decode_port is not None:
            frames.extend(
                [
                    self.decode_ip.encode("ascii"),
                    str(self.decode_port).encode("ascii"),
                ]
            )
            if self.generation is not None:
                frames.append(str(self.generation).encode("ascii"))
        return frames

    def deferred_ack_target(self) -> Optional[AckTarget]:
        if self.decode_ip is None or self.decode_port is None:
            return None
        if self.generation is None:
            # Normal for a decode that did not arm (e.g. a prealloc abort before
            # metadata was published): it does not wait for an ACK. An older
            # decode that does wait falls back to its release timeout.
            logger.debug(
                "Generation-less ABORT for room %s; no deferred ACK", self.room
            )
            return None
        return AckTarget(self.decode_ip, self.decode_port, self.generation)


class AbortAck(msgspec.Struct, frozen=True):
    room: int
    prefill_rank: int
    generation: Optional[int] = None

    @classmethod
    def from_zmq(cls, msg: List[bytes]) -> Optional[AbortAck]:
        if len(msg) < 3:
            logger.warning("Incomplete ABORT_ACK received")
            return None
        try:
            return cls(
                room=int(msg[1].decode("ascii")),
                prefill_rank=int(msg[2].decode("ascii")),
                generation=(int(msg[3].decode("ascii")) if len(msg) >= 4 else None),
            )
        except (ValueError, UnicodeDecodeError):
            logger.warning("Malformed ABORT_ACK received")
            return None

    def to_zmq(self) -> List[bytes]:
        frames = [
            ABORT_ACK_TAG,
            str(self.room).encode("ascii"),
            str(self.prefill_rank).encode("ascii"),
        ]
        if self.generation is not None:
            frames.append(str(self.generation).encode("ascii"))
        return frames


class DeferredAbortAckState(msgspec.Struct):
    generation: int
    prefill_ranks: Set[int]
    read: int = 0  # ACKs of prefill ranks with deferred release off (no rank)


class CommonKVManager(BaseKVManager):
    defer_decode_allocation: bool = False
    # Its prefill acks an ABORT with deferred release off ([ABORT_ACK, room]).
    legacy_abort_ack: bool = False
    deferred_bootstrap: Optional[DeferredBootstrap] = None
    _staging_ctx = None
    # Prefill side: what serves the KV transfers, in place of 0.5.23's
    # queues a room's chunks were hashed to (see _transfer_queue).
    _transfer_scheduler: Optional[_TransferScheduler] = None
    peer_metrics: Optional[_PeerMetrics] = None  # with --enable-metrics

    # Wire layout of the prefill->decode terminal status message. The legacy
    # layout (mooncake, and ascend which inherits it) is three untagged frames
    # ``[room, status, prefill_rank]``; backends whose control socket also
    # carries tagged messages prefix a tag frame and may append a reason:
    # ``[tag, room, status, prefill_rank, reason]``.
    kv_status_msg_tag: Optional[bytes] = None
    kv_status_msg_carries_reason: bool = False
    sender_trace_module: Optional[str] = None
    # Sender reports transfer_latency_s (first enqueue -> Success). Otherwise
    # the metric keeps its last-chunk fallback, so dashboards do not move.
    reports_transfer_latency: bool = False
    # Set by teardown() to stop the worker threads, decode listener included.
    _stopped: bool = False
    # Bad decode control messages: how many, and when one was last logged.
    BAD_DECODE_MSG_LOG_INTERVAL_S = 30.0
    _bad_decode_msgs: int = 0
    _bad_decode_msg_logged_at: float = float("-inf")

    kv_layout: Optional[str] = None
    dsv41_spec_layout: Optional[dict] = None

    # Logical-page KV sharding (PD prefill only): this rank's slot in the
    # shard group. Each rank owns a subset of logical KV pages.
    kv_shard_rank: int = 0
    kv_shard_size: int = 1

    # Used by decode when the prefill reported Failed without a reason frame.
    DEFAULT_PREFILL_FAILURE_REASON = (
        "Failed to get kvcache from prefill instance, it might be dead"
    )

    def __init__(
        self,
        args: KVArgs,
        disaggregation_mode: DisaggregationMode,
        server_args: ServerArgs,
        is_mla_backend: Optional[bool] = False,
    ):
        self.kv_args = args
        self.kv_cache_dtype_str = args.kv_cache_dtype_str
        self.kv_layout = args.kv_layout
        self.dsv41_spec_layout = get_dsv41_spec_layout(args)
        self.kv_item_lens_sum = sum(args.kv_item_lens)
        self.state_item_lens_sum = sum(x for comp in args.state_item_lens for x in comp)
        self.is_mla_backend = is_mla_backend
        # Per-sender fan-out of a KV copy onto N decode destinations
        # (MLA under Prefill-CP + Decode-TP, or decode_tp > prefill_tp).
        # MLA is resolved lazily at bootstrap (see resolve_kv_replica_factor);
        # MHA never replicates, so it stays pinned at 1.
        self._kv_replica_factor: Optional[int] = None if is_mla_backend else 1
        self.is_hybrid_mla_backend = getattr(args, "is_hybrid_mla_backend", False)
        self.disaggregation_mode = disaggregation_mode
        self.server_args = server_args
        self.enable_deferred_decode_kv_release = (
            envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.get()
            and self.supports_deferred_decode_kv_release
        )
        self._dcp_pack_buffers = None
        self._dcp_pack_max_tokens: Optional[int] = None
        # for p/d multi node infer
        self.bootstrap_host = get_serving().host
        self.bootstrap_port = get_disagg().disaggregation_bootstrap_port
        self.dist_init_addr = get_parallel().dist_init_addr
        parallel = get_parallel()
        self.attn_tp_size = parallel.attn_tp_size
        self.attn_tp_rank = parallel.attn_tp_rank
        self.attn_cp_size = parallel.attn_cp_size
        self.attn_cp_rank = parallel.attn_cp_rank
        # The TP width the transferred state is laid out over, which decode
        # pairs with: attention TP, or the TP group under CP-TP group sharing,
        # where the GDN heads are partitioned over it and QSA/PLE state is whole
        # on every rank. KV heads keep following attention TP.
        self.state_tp_size = linear_attn_tp_size()
        self.dcp_size = parallel.attn_dcp_size
        self.dcp_rank = parallel.attn_dcp_rank
        self.attn_dp_size = parallel.attn_dp_size
        self.attn_dp_rank = parallel.attn_dp_rank
        self.system_dp_size = get_parallel().dp_size
        self.system_dp_rank = (
            self.kv_args.system_dp_rank if self.kv_args.system_dp_rank else 0
        )
        self.pp_size = get_parallel().pp_size
        self.pp_rank = self.kv_args.pp_rank
        self.local_ip = get_local_ip_auto()
        if get_parallel().enable_kv_cache_sharding:
            kv_shard_group = get_kv_shard_group(is_mla_backend)
            self.kv_shard_rank = kv_shard_group.rank_in_group
            self.kv_shard_size = kv_shard_group.world_size
        cp_sharded_prefill = self.attn_cp_size > 1 and (
            self.is_hybrid_mla_backend or get_parallel().enable_dsa_cache_layer_split
        )

        hybrid_decode_pulls_all_ranks = (
            self.is_hybrid_mla_backend
            and disaggregation_mode == DisaggregationMode.DECODE
        )
        # CP-TP group sharing: CP rank r holds every KV head, the CP-replicated
        # state and linear-attention head shard r. It transfers as TP rank r of
        # a CP-1 prefill (see register_to_bootstrap), not as a CP replica.
        cp_tp_group_sharing = parallel.enable_cp_tp_group_sharing
        self.enable_all_cp_ranks_for_transfer = not cp_tp_group_sharing and (
            envs.SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER.get()
            or cp_sharded_prefill
            or hybrid_decode_pulls_all_ranks
            # No sharded rank holds a full page, so every CP rank sends.
            or self.kv_shard_size > 1
        )

        # bind zmq socket
        self._zmq_ctx = zmq.Context()
        # Raise libzmq's per-context socket cap because this manager caches two
        # sockets per decode endpoint, so large fleets can exceed the default.
        self._zmq_ctx.set(
            zmq.MAX_SOCKETS, envs.SGLANG_DISAGGREGATION_ZMQ_MAX_SOCKETS.get()
        )
        self.rank_port, self.server_socket = get_zmq_socket_on_host(
            self._zmq_ctx, zmq.PULL, host=self.local_ip
        )
        logger.debug(f"kv manager bind to {self.local_ip}:{self.rank_port}")

        self.request_status: Union[Dict[int, KVPoll], PPConsensusStore] = {}
        self._socket_cache: Dict[str, zmq.Socket] = {}
        self._monitor_cache: Dict[str, zmq.Socket] = {}
        self._socket_send_locks: Dict[str, threading.Lock] = {}
        self._socket_lock = threading.Lock()
        self.failure_records: Dict[int, str] = {}
        self.failure_lock = threading.Lock()
        self._staging_outstanding: Dict[int, int] = defaultdict(int)
        self._deferred_ack_targets: Dict[int, Dict[Tuple[str, int], AckTarget]] = {}
        # A poisoned room has a permanently outstanding transfer whose backend
        # can no longer prove quiescent. A new room lifecycle clears this state.
        self._deferred_ack_poisoned_rooms: Set[int] = set()
        self.defer_decode_allocation = (
            get_disagg().disaggregation_decode_allocation_policy == "prefill_complete"
        )
        self.deferred_bootstrap = None
        if self.defer_decode_allocation:
            if any(state != StateType.DSA for state in args.state_types):
                raise ValueError(
                    "prefill_complete currently supports full-attention and DSA KV pools only"
                )
            if disaggregation_mode == DisaggregationMode.PREFILL:
                self.deferred_bootstrap = DeferredBootstrap(
                    envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get()
                    + envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get()
                )

        self.peer_metrics = _PeerMetrics.start(
            self.disaggregation_mode.value,
            (
                self._peer_metric_rows
                if self.disaggregation_mode == DisaggregationMode.PREFILL
                else None  # the decode's scheduler sets peer_metrics.rows
            ),
        )
        if self.disaggregation_mode == DisaggregationMode.PREFILL:
            # When SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER is True, all CP ranks
            # participate in KV transfer; Otherwise only CP rank 0 sends.
            self.is_dummy_cp_rank = (
                not self.enable_all_cp_ranks_for_transfer
                and not cp_tp_group_sharing
                and self.attn_cp_size > 1
                and self.attn_cp_rank != 0
            )
            # Sync the leader's bootstrap port to every rank before
            # registering: in multi-node prefill, registration targets
            # `dist_init_addr` (rank 0) but each rank's local port may
            # differ when the launcher auto-reserves a free port per host.
            self.bootstrap_port = self._sync_bootstrap_port_across_nodes(
                self.bootstrap_port
            )
            self.register_to_bootstrap()
            self.transfer_infos = {}
            self.req_to_decode_prefix_len: Dict[int, int] = {}
            self.decode_kv_args_table = {}
            self.pp_group = get_parallel().pp_group
            if self.pp_size > 1:
                self.request_status = PPConsensusStore(
                    self.pp_size, self.pp_rank, self.pp_group
                )
            # If a timeout happens on the prefill side, it means prefill instances
            # fail to receive the KV indices from the decode instance of this request.
            # These timeout requests should be aborted to release the tree cache.
            self.bootstrap_timeout = envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get()
        elif self.disaggregation_mode == DisaggregationMode.DECODE:
            self.enable_staging: bool = False
            self._staging_handler = None
            self.connection_pool: Dict[str, Dict[str, Union[str, int]]] = {}
            self.connection_lock = threading.Lock()
            self.required_prefill_response_num_table: Dict[int, int] = {}
            self.prefill_info_table: Dict[str, PrefillServerInfo] = {}
            self.heartbeat_failures: Dict[str, int] = {}
            self.session_pool: Dict = defaultdict(requests.Session)
            self.session_pool_lock = threading.Lock()
            self.addr_to_rooms_tracker: Dict[str, Set[int]] = defaultdict(set)
            self.prefill_response_tracker: Dict[int, Set[int]] = {}
            # Deferred KV release: room -> current generation and ranks that
            # ACKed. The generation rejects an old request's late ACK after room
            # reuse.
            self._deferred_abort_ack_tracker: Dict[int, DeferredAbortAckState] = {}
            self._deferred_abort_generation = 0
            # Heartbeat interval should be at least 2 seconds
            self.heartbeat_interval = max(
                envs.SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL.get(), 2.0
            )
            # Heartbeat failure should be at least 1
            self.max_failures = max(
                envs.SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE.get(), 1
            )
            # Event used to signal the heartbeat checker thread to exit
            # during teardown (e.g. runtime P<->D role switch).
            self._heartbeat_shutdown = threading.Event()
            # If a timeout happens on the decode side, it means decode instances
            # fail to receive the KV Cache transfer done signal after bootstrapping.
            # These timeout requests should be aborted to release the tree cache.
            self.waiting_timeout = envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get()
            # PD true-retraction rebootstrap: a shared executor + per-thread HTTP
            # sessions used to drive the original prefill worker's ``/generate``
            # endpoint so it recomputes a retracted request's prefix KV under the
            # current weights. Created lazily on first use so deployments that
            # never retract pay nothing.
            self._prefill_recompute_executor: Optional[
                Union[concurrent.futures.ThreadPoolExecutor, _PrefillThreads]
            ] = None
            self._prefill_recompute_executor_lock = threading.Lock()
            self._prefill_recompute_sessions = threading.local()
            # The decode's calls to prefill servers, off the scheduler thread and
            # each on its prefill's own threads; the rebootstrap executor too.
            workers = envs.SGLANG_DISAGGREGATION_THREAD_POOL_SIZE.get()
            self._parallel_info_executor = _PrefillThreads(
                shared=concurrent.futures.ThreadPoolExecutor(
                    max_workers=max(1, workers if workers is not None else 16),
                    thread_name_prefix="pd-rebootstrap-prefill",
                )
            )
            self._prefill_recompute_executor = self._parallel_info_executor
            # Addrs with a parallel-info fetch outstanding, under connection_lock.
            self._parallel_info_inflight: Set[str] = set()
            # Heartbeat failures by prefill: a fetch that saw one publishes nothing.
            self._losses: Dict[str, int] = defaultdict(int)
            # A config mismatch found on the fetch thread, re-raised on the
            # scheduler thread by raise_parallel_info_error().
            self._parallel_info_fatal: Optional[BaseException] = None
            # Background route setups (see setup_bootstrap_routes), by
            # (bootstrap_addr, prefill_dp_rank), under connection_lock.
            self._route_setups: Dict[Tuple[str, int], concurrent.futures.Future] = {}
        else:
            raise ValueError(
                f"Unsupported DisaggregationMode: {self.disaggregation_mode}"
            )

    def prepare_send_state_indices(
        self, state_indices: Optional[List]
    ) -> Optional[List]:
        return state_indices

    def _should_skip_cp_replicated_state_transfer(self) -> bool:
        """Whether this prefill rank should omit CP-replicated state.

        Prefill CP materializes global token order before writing state pools, so
        every CP rank holds the same state. When all CP ranks transfer their KV
        shards, only rank 0 needs to send that state. Cache layer split is the
        exception because each CP rank owns different state layers. Page-sharded
        DSA indexer state likewise needs every owner; Mooncake filters its page
        lists before transfer instead of suppressing whole ranks.
        """
        return (
            self.attn_cp_size > 1
            and self.attn_cp_rank != 0
            and not get_parallel().enable_dsa_cache_layer_split
            and not get_parallel().enable_cp_tp_group_sharing
            and getattr(self, "kv_shard_size", 1) <= 1
        )

    def requires_dcp_relayout(self, dst_dcp_size: int, dst_dcp_rank: int) -> bool:
        if self.dcp_size == dst_dcp_size:
            if self.dcp_rank != dst_dcp_rank:
                raise RuntimeError(
                    "PD peers must connect matching DCP ranks, got "
                    f"prefill={self.dcp_rank}, decode={dst_dcp_rank}"
                )
            return False

        if (
            self.dcp_size == 1
            and dst_dcp_size > 1
            and (self.is_mla_backend or self.is_hybrid_mla_backend)
        ):
            return True

        raise RuntimeError(
            f"Unsupported PD DCP topology: {self.dcp_size} -> {dst_dcp_size}"
        )

    def prepare_dcp_token_item_lens(
        self, dst_page_item_lens: List[Optional[int]], dst_dcp_size: int
    ) -> List[int]:
        page_size = self.kv_args.page_size
        num_draft = self.kv_args.num_draft_entries
        num_entries = len(self.kv_args.kv_item_lens)
        if len(dst_page_item_lens) != num_entries:
            raise RuntimeError(
                "PD DCP requires the decode to register one KV entry per "
                f"prefill entry: src={num_entries} (draft={num_draft}), "
                f"dst={len(dst_page_item_lens)}"
            )
        src_token_lens = [
            item_len // page_size for item_len in self.kv_args.kv_item_lens
        ]
        for i, dst_item_len in enumerate(dst_page_item_lens):
            if dst_item_len is None:
                continue
            dst_page_scale = page_size * (
                dst_dcp_size if i >= num_entries - num_draft else 1
            )
            if dst_item_len // dst_page_scale != src_token_lens[i]:
                raise RuntimeError(
                    "PD DCP source/destination KV geometry differs at entry "
                    f"{i}: src token bytes={src_token_lens[i]}, "
                    f"dst token bytes={dst_item_len // dst_page_scale} "
                    f"(dst item_len={dst_item_len}, page scale={dst_page_scale})"
                )
        return src_token_lens

    def _register_staging_memory(self, ptr: int, size: int) -> None:
        raise NotImplementedError(
            f"{type(self).__name__} does not support staging memory registration"
        )

    def _init_dcp_pack_buffers_once(
        self, dcp_size: int, *, include_draft: bool = False
    ) -> None:
        if self._dcp_pack_buffers is not None:
            return
        if not self.kv_args.kv_item_lens:
            return
        from sglang.srt.disaggregation.common.dcp_pack import init_dcp_pack_buffers

        max_tokens = max_prefill_buffer_tokens() or get_schedule().max_prefill_tokens
        max_tokens = ceil_align(max_tokens, self.kv_args.page_size)
        self._dcp_pack_buffers = init_dcp_pack_buffers(
            self._register_staging_memory,
            self.kv_args,
            len(self.transfer_queues),
            dcp_size,
            max_tokens,
            device_type=get_device().device,
            include_draft=include_draft,
        )
        self._dcp_pack_max_tokens = max_tokens

    def check_status(self, bootstrap_room: int) -> KVPoll:
        return self.request_status[bootstrap_room]

    def check_status_pp_consensus(self, bootstrap_room: int) -> KVPoll:
        statuses = self.request_status.collect(bootstrap_room)
        if any(status is None for status in statuses):
            return KVPoll.Bootstrapping
        return min(statuses)

    def check_peer_aux_buffer_count(self, peer: str, num_remote: int) -> None:
        """Aux (metadata) buffers pair up positionally, so a peer that
        registered a different number of them gets only the leading ones, and
        those line up only if the missing buffer is the last. Say so once per
        registration; the senders stop at the shorter list."""
        num_local = len(self.kv_args.aux_data_ptrs)
        if num_remote != num_local:
            logger.error(
                "Decode %s registered %d metadata buffers but this prefill has %d; "
                "only the first %d are transferred, and misaligned if the extra "
                "buffer is not the last. An optional metadata buffer is enabled on "
                "one engine only: --disaggregation-enable-kv-checksum, "
                "SGLANG_ENABLE_DISAGG_SAMPLING_MASK, or the DSA top-k buffer.",
                peer,
                num_remote,
                num_local,
                min(num_remote, num_local),
            )

    def build_receiver_registration_message(self) -> List[bytes]:
        raise NotImplementedError

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
        raise NotImplementedError

    def update_status(self, bootstrap_room: int, status: KVPoll):
        current = self.request_status.get(bootstrap_room)
        if current is None:
            # The room does not exist yet, or clear() already popped it. Only a
            # request's opening status may create it: Bootstrapping normally, or
            # WaitingForInput for a dummy CP rank (see CommonKVSender.__init__).
            # Anything else would resurrect a concluded room and pollute a later
            # request that reuses the same bootstrap_room.
            if status in (KVPoll.Bootstrapping, KVPoll.WaitingForInput):
                # A new room lifecycle drops deferred-ACK state left by the
                # previous request that used this bootstrap_room.
                self._deferred_ack_targets.pop(bootstrap_room, None)
                self._deferred_ack_poisoned_rooms.discard(bootstrap_room)
                self._staging_outstanding.pop(bootstrap_room, None)
                self.request_status[bootstrap_room] = status
            return
        if status == KVPoll.Failed:
            self.request_status[bootstrap_room] = KVPoll.Failed
            if self.deferred_bootstrap is not None:
                self._notify_bootstrap(
                    bootstrap_room, self.deferred_bootstrap.fail(bootstrap_room)
                )
            return
        if current == KVPoll.Failed:
            # Failed is terminal. It also sorts lowest, so the max() below would
            # happily promote it back to Transferring or Success.
            return
        self.request_status[bootstrap_room] = max(current, status)

    def _notify_bootstrap(self, room: int, notification: BootstrapNotification) -> None:
        if notification is None:
            return
        endpoint, failed = notification
        # Use the normal status channel; readiness does not authorize writes.
        # No room-table lock is held while sending to a potentially dead peer.
        self.send_kv_status_message(
            targets=[endpoint],
            bootstrap_room=room,
            status=KVPoll.Failed if failed else KVPoll.WaitingForInput,
            failure_reason="Prefill bootstrap failed" if failed else None,
        )

    def _handle_bootstrap_message(self, msg: List[bytes]) -> bool:
        if self.deferred_bootstrap is None or not msg:
            return False
        if msg[0] not in (b"BOOTSTRAP", b"ABORT"):
            return False
        try:
            room = int(msg[1])
            endpoint = (msg[2].decode("ascii"), int(msg[3]))
        except (IndexError, ValueError, UnicodeDecodeError):
            logger.warning("Dropping malformed bootstrap control message")
            return True
        if msg[0] == b"BOOTSTRAP":
            self._notify_bootstrap(
                room, self.deferred_bootstrap.register(room, endpoint)
            )
            return True
        # Retain cancellation even if it beats source creation. Let the backend
        # process ABORT normally as well, including ACK/draining after allocation.
        self.deferred_bootstrap.fail(room)
        if room in self.request_status and self.request_status[room] != KVPoll.Success:
            self.update_status(room, KVPoll.Failed)
        return False

    def record_failure(self, bootstrap_room: int, failure_reason: str):
        with self.failure_lock:
            self.failure_records[bootstrap_room] = failure_reason

    def _room_notify_targets(self, bootstrap_room: int) -> List[Tuple[str, int]]:
        infos = self.transfer_infos.get(bootstrap_room)
        if not infos:
            return []
        # Every non-dummy endpoint, not just the one a caller failed on: the
        # others never receive the room's remaining chunks either.
        targets: List[Tuple[str, int]] = []
        # Snapshot: the control thread can register a late peer for this room
        # while we walk it, and iterating the live view would then raise.
        for info in list(infos.values()):
            if info.is_dummy:
                continue
            target = (info.endpoint, info.dst_port)
            if target not in targets:
                targets.append(target)
        return targets

    def _encode_kv_status_message(
        self,
        *,
        bootstrap_room: int,
        status: KVPoll,
        failure_reason: Optional[str],
    ) -> List[bytes]:
        parts = [
            str(bootstrap_room).encode("ascii"),
            str(int(status)).encode("ascii"),
            str(self._prefill_unique_rank()).encode("ascii"),
        ]
        if self.kv_status_msg_carries_reason:
            parts.append((failure_reason or "").encode("utf-8"))
        if self.kv_status_msg_tag is not None:
            parts.insert(0, self.kv_status_msg_tag)
        return parts

    def parse_kv_status_message(
        self, msg: List[bytes]
    ) -> Optional[Tuple[int, int, int, Optional[str]]]:
        """Decode a prefill status message, or None when it is not one."""
        if self.kv_status_msg_tag is not None:
            if not msg or msg[0] != self.kv_status_msg_tag:
                return None
            msg = msg[1:]
        if len(msg) < 3:
            logger.warning(
                "Dropping malformed prefill status message with %d frames", len(msg)
            )
            return None
        try:
            bootstrap_room = int(msg[0].decode("ascii"))
            status = int(msg[1].decode("ascii"))
            prefill_rank = int(msg[2].decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            logger.warning("Dropping unparsable prefill status message")
            return None
        failure_reason = (
            msg[3].decode("utf-8", errors="replace")
            if len(msg) > 3 and msg[3]
            else None
        )
        return bootstrap_room, status, prefill_rank, failure_reason

    def send_kv_status_message(
        self,
        *,
        targets: List[Tuple[str, int]],
        bootstrap_room: int,
        status: KVPoll,
        failure_reason: Optional[str] = None,
    ) -> None:
        """Push bootstrap readiness or transfer status to decode endpoints."""
        if not targets:
            return
        parts = self._encode_kv_status_message(
            bootstrap_room=bootstrap_room,
            status=status,
            failure_reason=failure_reason,
        )
        for endpoint, dst_port in targets:
            na = NetworkAddress(endpoint, dst_port)
            try:
                self._send_multipart_locked(na.to_tcp(), parts, is_ipv6=na.is_ipv6)
            except Exception as e:
                logger.warning(
                    f"Failed to sync status {status} of room {bootstrap_room} to "
                    f"{na.to_host_port_str()}: {e}"
                )

    def send_chunk_ready(
        self,
        *,
        room: int,
        chunk_idx: int,
        page_start: int,
        num_pages: int,
        writer_id: str,
        targets: List[Tuple[str, int]],
    ) -> None:
        """Notify decode that a staging chunk RDMA is complete (every chunk;
        scatter is arrival-driven)."""
        parts = [
            b"CHUNK_READY",
            str(room).encode("ascii"),
            str(chunk_idx).encode("ascii"),
            str(page_start).encode("ascii"),
            str(num_pages).encode("ascii"),
            writer_id.encode("ascii"),
            str(self._prefill_unique_rank()).encode("ascii"),
        ]
        for endpoint, port in targets:
            na = NetworkAddress(endpoint, port)
            self._send_multipart_locked(na.to_tcp(), parts, is_ipv6=na.is_ipv6)

    def handle_chunk_ready(self, msg: List[bytes]) -> bool:
        if not msg or msg[0] != b"CHUNK_READY":
            return False
        try:
            room, chunk_idx, page_start, num_pages = (
                int(part.decode("ascii")) for part in msg[1:5]
            )
            writer_id = msg[5].decode("ascii")
        except (IndexError, ValueError, UnicodeDecodeError):
            logger.warning("Dropping malformed CHUNK_READY message")
            return True
        if room not in self.request_status:
            return True
        handler = self._staging_handler
        if handler is None:
            logger.warning("CHUNK_READY for room %s without a staging handler", room)
            return True
        handler.handle_chunk_arrived(room, chunk_idx, page_start, num_pages, writer_id)
        return True

    def conclude_transfer(
        self,
        *,
        bootstrap_room: int,
        status: KVPoll,
        targets: Optional[List[Tuple[str, int]]] = None,
        failure_reason: Optional[str] = None,
    ) -> Optional[KVPoll]:
        """Returns the status emitted, or None for a cleared room.

        Runs more than once for a room when a staging chunk is deferred past the
        last one. ``targets`` defaults to the room's non-dummy decode endpoints.
        """
        if bootstrap_room not in self.request_status:
            # The sender already cleared this room. Concluding now would
            # re-create it in request_status and leave a failure record that a
            # request reusing this bootstrap_room would adopt as its own.
            return None
        if status == KVPoll.Success:
            with self.failure_lock:
                recorded = self.failure_records.get(bootstrap_room)
            if recorded is not None:
                status = KVPoll.Failed
                failure_reason = recorded
            elif self.request_status.get(bootstrap_room) == KVPoll.Failed:
                status = KVPoll.Failed
                failure_reason = (
                    failure_reason or "Room marked Failed before the transfer ended"
                )
        if status == KVPoll.Failed:
            with self.failure_lock:
                # Keep the first root cause; later callers see the symptom.
                failure_reason = self.failure_records.setdefault(
                    bootstrap_room, failure_reason or "KV transfer failed"
                )
            # Not upstream's MagicMock(spec=...) managers: theirs is a Mock.
            if isinstance(getattr(self, "peer_metrics", None), _PeerMetrics):
                infos = self.transfer_infos.get(bootstrap_room)
                self._note_room_failed(bootstrap_room, failure_reason, infos)

        if targets is None:
            targets = self._room_notify_targets(bootstrap_room)
        self.update_status(bootstrap_room, status)
        if status == KVPoll.Success and self.deferred_bootstrap is not None:
            # Success permits decode to reuse the room after true retraction.
            # Publish it from sender.clear(), after worker and scheduler cleanup.
            return status
        self.send_kv_status_message(
            targets=targets,
            bootstrap_room=bootstrap_room,
            status=status,
            failure_reason=failure_reason,
        )
        return status

    def conclude_failure(
        self,
        *,
        bootstrap_room: int,
        failure_reason: str,
        targets: Optional[List[Tuple[str, int]]] = None,
    ) -> Optional[KVPoll]:
        """Record the reason, mark the room Failed and tell decode."""
        return self.conclude_transfer(
            bootstrap_room=bootstrap_room,
            status=KVPoll.Failed,
            targets=targets,
            failure_reason=failure_reason,
        )

    def apply_prefill_status(
        self,
        *,
        bootstrap_room: int,
        status: int,
        prefill_rank: int,
        failure_reason: Optional[str] = None,
    ) -> None:
        """Decode-side handling of one prefill rank's bootstrap/transfer status."""
        if bootstrap_room not in self.request_status:
            # The room concluded and was cleared. Recording a failure now would
            # leave an entry that a later request reusing this bootstrap_room
            # would pick up as its own root cause.
            logger.debug("Dropping late status for cleared room %s", bootstrap_room)
            return
        if status == KVPoll.WaitingForInput and self.defer_decode_allocation:
            # The policy currently requires one authoritative prefill rank.
            # Do not mix this notification into the transfer-success counter.
            self.update_status(bootstrap_room, KVPoll.WaitingForInput)
            return
        if status == KVPoll.Success:
            completed_ranks = self.prefill_response_tracker.get(bootstrap_room)
            if completed_ranks is None:
                return
            expected_response_num = self.required_prefill_response_num_table.get(
                bootstrap_room
            )
            completed_ranks.add(prefill_rank)
            if expected_response_num is None:
                logger.warning(
                    "No expected prefill response count for room %s, prefill rank %s",
                    bootstrap_room,
                    prefill_rank,
                )
                return
            if len(completed_ranks) < expected_response_num:
                return
            # Tell the staging handler no more chunks are coming, before any
            # poller can see Success.
            if self.enable_staging and self._staging_handler is not None:
                handler = self._staging_handler
                if handler.is_staging_room(bootstrap_room):
                    handler.submit_last_scatter_async(bootstrap_room)
            self.update_status(bootstrap_room, KVPoll.Success)
            return
        if status == KVPoll.Failed:
            self.record_failure(
                bootstrap_room, failure_reason or self.DEFAULT_PREFILL_FAILURE_REASON
            )
            self.update_status(bootstrap_room, KVPoll.Failed)
            return
        logger.warning(
            "Ignoring non-terminal status %s for room %s from prefill rank %s",
            status,
            bootstrap_room,
            prefill_rank,
        )

    def decode_message_handlers(self) -> Dict[bytes, Callable[[List[bytes]], object]]:
        """Decode control messages by their tag frame. A backend adds its own
        (aux data, staging requests) to these; the KV status message is matched
        by parse_kv_status_message instead, as it may be untagged."""
        return {
            b"CHUNK_READY": self.handle_chunk_ready,
            ABORT_ACK_TAG: self.handle_abort_ack_message,
        }

    def handle_decode_message(
        self,
        msg: List[bytes],
        handlers: Dict[bytes, Callable[[List[bytes]], object]],
    ) -> None:
        """Apply one prefill->decode control message. Never raises: the listener
        must outlive a bad message, or every later status for this decode
        instance is lost and its requests hang until they time out."""
        try:
            handler = handlers.get(msg[0]) if msg else None
            if handler is not None:
                handler(msg)
                return
            parsed = self.parse_kv_status_message(msg)
            if parsed is None:
                self._report_bad_decode_message("Dropped an unrecognized", msg)
                return
            room, status, prefill_rank, reason = parsed
            self.apply_prefill_status(
                bootstrap_room=room,
                status=status,
                prefill_rank=prefill_rank,
                failure_reason=reason,
            )
        except Exception:
            self._report_bad_decode_message("Failed to handle a", msg, exc_info=True)

    def _report_bad_decode_message(
        self, what: str, msg: List[bytes], exc_info: bool = False
    ) -> None:
        # Tag and size only: payloads can be large; a bad peer must not flood logs.
        self._bad_decode_msgs += 1
        now = time.monotonic()
        if now - self._bad_decode_msg_logged_at < self.BAD_DECODE_MSG_LOG_INTERVAL_S:
            return
        self._bad_decode_msg_logged_at = now
        logger.warning(
            "%s decode control message (tag %r, %d frames, %d bytes); %d bad "
            "message(s) so far, logged at most every %.0f s. The listener goes "
            "on. Check that prefill and decode run the same SGLang version, "
            "transfer backend and staging settings.",
            what,
            msg[0][:32] if msg else b"",
            len(msg),
            sum(len(frame) for frame in msg),
            self._bad_decode_msgs,
            self.BAD_DECODE_MSG_LOG_INTERVAL_S,
            exc_info=exc_info,
        )

    def _start_decode_listener_thread(self) -> threading.Thread:
        """Start the decode thread that applies prefill control messages from
        server_socket. teardown() stops it by setting _stopped, which recv
        observes when --enable-pd-role-switch makes it poll (_make_worker_recv)."""
        recv = self._make_worker_recv(self.server_socket)
        handlers = self.decode_message_handlers()

        def decode_listener_thread():
            while not self._stopped:
                try:
                    msg = recv()
                except zmq.ZMQError:
                    if not self._stopped:
                        logger.exception(
                            "Decode control listener stopped: server_socket failed. "
                            "Prefill KV status is no longer received, so transfers "
                            "to this decode instance time out; restart it."
                        )
                    return
                if msg is not None:
                    self.handle_decode_message(msg, handlers)

        t = threading.Thread(
            target=decode_listener_thread, name="pd-decode-listener", daemon=True
        )
        t.start()
        return t

    def register_deferred_abort_room(self, bootstrap_room: int) -> int:
        """Arm a new generation for a held room and return its wire id."""
        self._deferred_abort_generation += 1
        generation = self._deferred_abort_generation
        self._deferred_abort_ack_tracker[bootstrap_room] = DeferredAbortAckState(
            generation=generation,
            prefill_ranks=set(),
        )
        return generation

    def note_abort_ack(
        self, bootstrap_room: int, prefill_rank: int, generation: int
    ) -> None:
        """Record an ACK only for the generation currently holding the room."""
        state = self._deferred_abort_ack_tracker.get(bootstrap_room)
        if state is not None and state.generation == generation:
            state.prefill_ranks.add(prefill_rank)

    def handle_abort_ack_message(self, msg: List[bytes]) -> bool:
        """Consume an ABORT_ACK and record it for an armed decode room."""
        if not msg or msg[0] != ABORT_ACK_TAG:
            return False
        # With deferred release off too: decode.py fences pages until it.
        if len(msg) == 2 and msg[1].isdigit():
            # A prefill with deferred release off acks on reading the ABORT (no
            # rank): a chunk may still be in flight, so it ends a fence at the deadline.
            state = self._deferred_abort_ack_tracker.get(int(msg[1]))
            if state is not None:
                state.read += 1
            return True
        ack = AbortAck.from_zmq(msg)
        if ack is None:
            return True
        if ack.generation is None:
            logger.warning_once(
                "Generation-less ABORT_ACK received; ignoring it. "
                "Mixed SGLang versions may wait for the KV release timeout."
            )
            return True
        self.note_abort_ack(ack.room, ack.prefill_rank, ack.generation)
        return True

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        """True once every prefill rank that could still write these pages has acked."""
        state = self._deferred_abort_ack_tracker.get(bootstrap_room)
        acks = state.prefill_ranks if state is not None else ()
        return len(acks) >= required_acks

    def abort_read_by(self, bootstrap_room: int) -> int:
        state = self._deferred_abort_ack_tracker.get(bootstrap_room)
        return state.read if state is not None else 0

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        self._deferred_abort_ack_tracker.pop(bootstrap_room, None)

    def _prefill_unique_rank(self) -> int:
        """Stable per-sender id, matching what the transfer worker syncs on Success."""
        return (
            self.attn_tp_rank * (self.pp_size * self.attn_cp_size)
            + self.pp_rank * self.attn_cp_size
            + self.attn_cp_rank
        )

    def _send_abort_ack(self, room: int, target: AckTarget) -> None:
        """Best-effort ack that this rank's transfer for an aborted room drained."""
        try:
            na = NetworkAddress(target.ip, target.port)
            self._send_multipart_locked(
                na.to_tcp(),
                AbortAck(room, self._prefill_unique_rank(), target.generation).to_zmq(),
                is_ipv6=na.is_ipv6,
            )
        except Exception as e:
            logger.debug(f"Failed to send drained ABORT_ACK for room {room}: {e}")

    def _maybe_ack_drained_abort(self, room: int) -> None:
        """Send the deferred ack once an aborted room's chunks have drained
        (outstanding == 0). pop() makes it fire at most once."""
        if self._staging_outstanding.get(room, 0) > 0:
            return
        if room in self._deferred_ack_poisoned_rooms:
            # A target registered concurrently with the poison must not fire.
            self._deferred_ack_targets.pop(room, None)
            return
        self._send_abort_acks(room, self._deferred_ack_targets.pop(room, None))

    def _send_abort_acks(
        self, room: int, targets: Optional[Dict[Tuple[str, int], AckTarget]]
    ) -> None:
        # With prefill TP < decode TP several decode ranks share one room and
        # each sends its own ABORT; fan the ACK out to every one of them.
        for target in (targets or {}).values():
            self._send_abort_ack(room, target)

    def register_deferred_ack_target(self, room: int, target: AckTarget) -> None:
        """Hold this generation's ACK until the room's transfer drains.

        Targets are kept per decode endpoint, so each decode rank that aborted
        the room gets an ACK for its own latest generation. Active-room callers
        must mark the room Failed before registering so no new chunk can be
        accepted after the ACK is sent.
        """
        if room in self._deferred_ack_poisoned_rooms:
            return
        # Replace instead of mutating in place: a concurrent drain pops the dict
        # and iterates it. If the pop wins, the caller's immediate
        # _maybe_ack_drained_abort retry re-sends the merged set, and a
        # duplicate ACK is harmless because decode records ACKs in a set.
        targets = dict(self._deferred_ack_targets.get(room, ()))
        targets[(target.ip, target.port)] = target
        self._deferred_ack_targets[room] = targets

    def poison_deferred_ack_room(self, room: int) -> None:
        """Drop an ACK target when the backend cannot prove the room drained."""
        self._deferred_ack_targets.pop(room, None)
        self._deferred_ack_poisoned_rooms.add(room)

    def get_kv_replica_factor(self) -> int:
        if self._kv_replica_factor is None:
            logger.warning_once(
                "get_kv_replica_factor called before resolve_kv_replica_factor; "
                "assuming 1, but the metrics may be inaccurate."
            )
            return 1
        return self._kv_replica_factor

    def resolve_kv_replica_factor(self, transfer_infos: Dict) -> None:
        if not self.is_mla_backend:
            # Only MLA replicates its KV across decode ranks; non-MLA head slices are
            # disjoint and stay pinned at the factor of 1 set in __init__.
            return

        info = next(iter(transfer_infos.values()), None)
        if info is None or info.required_dst_info_num is None:
            logger.warning_once(
                "resolve_kv_replica_factor: no decode destinations available; "
                "KV transfer metrics may be inaccurate."
            )
            return
        self._kv_replica_factor = info.required_dst_info_num

    def _make_worker_recv(self, socket, timeout_ms: int = 500):
        """Build the blocking multipart recv used by a worker thread.

        Plain blocking recv unless role switching is enabled: teardown flips a
        stop flag that a blocked recv can never observe, so in that mode poll
        with a timeout and return None when it expires. Deployments without
        --enable-pd-role-switch keep the original blocking recv and pay nothing.
        Deferred allocation consumes endpoint registration here, before backend
        metadata handling; ABORT still reaches the backend's drain/ACK handler.
        """
        if self.deferred_bootstrap is not None:

            def recv_bootstrap():
                msg = socket.recv_multipart()
                return None if self._handle_bootstrap_message(msg) else msg

            return recv_bootstrap
        if not self.server_args.enable_pd_role_switch:
            return socket.recv_multipart

        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)

        def recv():
            return socket.recv_multipart() if poller.poll(timeout_ms) else None

        return recv

    def _ensure_prefill_recompute_executor(
        self,
    ) -> Union[concurrent.futures.ThreadPoolExecutor, _PrefillThreads]:
        """Lazily create the shared executor that drives PD-retract rebootstrap
        ``/generate`` calls. One executor per (decode) kv manager, shared across
        all receivers."""
        executor = self._prefill_recompute_executor
        if executor is not None:
            return executor
        with self._prefill_recompute_executor_lock:
            if self._prefill_recompute_executor is None:
                workers = envs.SGLANG_DISAGGREGATION_THREAD_POOL_SIZE.get()
                if workers is None:
                    workers = 16
                self._prefill_recompute_executor = (
                    concurrent.futures.ThreadPoolExecutor(
                        max_workers=max(1, workers),
                        thread_name_prefix="pd-rebootstrap-prefill",
                    )
                )
            return self._prefill_recompute_executor

    def _get_prefill_recompute_session(self) -> requests.Session:
        """Per-thread ``requests.Session`` for the rebootstrap executor threads
        (``requests.Session`` is not safe for concurrent cross-thread use)."""
        session = getattr(self._prefill_recompute_sessions, "session", None)
        if session is None:
            session = requests.Session()
            self._prefill_recompute_sessions.session = session
        return session

    def _resolve_rebootstrap_prefill_url(
        self, kv_receiver: CommonKVReceiver
    ) -> Optional[str]:
        """Derive the prefill ``/generate`` base URL for a PD true-retraction
        rebootstrap from bootstrap info.

        The decode already knows the prefill host (the ``bootstrap_addr`` host,
        which the router/client set to the prefill's HTTP host), and the prefill
        self-registers its HTTP API port in ``PrefillServerInfo`` at bootstrap
        registration. Combining them yields ``http://{host}:{prefill_http_port}``
        with no router-injected ``pd_rebootstrap_prefill_url``.
        """
        prefill_info = self.prefill_info_table.get(kv_receiver.bootstrap_addr)
        if prefill_info is None or prefill_info.prefill_http_port is None:
            return None
        host = NetworkAddress.parse(kv_receiver.bootstrap_addr).host
        return NetworkAddress(host, prefill_info.prefill_http_port).to_url()

    def submit_prefill_recompute(
        self, kv_receiver: CommonKVReceiver, payload: dict
    ) -> None:
        """Dispatch a PD true-retraction rebootstrap ``/generate`` to the
        original prefill worker so it recomputes the retracted request's prefix
        KV under the current weights and transfers it back over the
        already-bootstrapped channel.

        The target prefill ``/generate`` URL is derived from bootstrap info (the
        prefill self-registered its HTTP port), not from a router-injected field.

        Non-blocking from the scheduler's perspective: the HTTP POST runs on the
        shared executor. Any failure (unresolved URL, HTTP error, exception) is
        surfaced through the standard ``KVPoll.Failed`` path via
        ``kv_receiver.abort()`` so the scheduler's existing transfer-failure
        handling streams the aborted request back to the client. ``payload`` is
        prebuilt by the decode scheduler (``Req.build_rebootstrap_payload``) so
        HTTP/sampling concerns stay on the kv manager.

        The decode scheduler broadcasts each retracted request to every rank in
        its attention TP/CP group and every PP stage, so all of them reach this
        call and would each POST an identical ``/generate`` -- making the prefill
        worker recompute the same request once per decode rank. The ``/generate``
        is a server-level call: the prefill frontend fans it out to its own
        workers and transfers the recomputed KV back to *all* decode ranks, so
        exactly one decode rank must issue it. Elect the same leader the request
        receiver uses (attn-tp/attn-cp group leader, first PP stage); the other
        ranks still bootstrap and receive their KV shard as usual, and on failure
        the leader-only abort matches the leader-only output streaming (other
        ranks fall back to the per-request waiting-timeout safety net).
        """
        if self.attn_tp_rank != 0 or self.attn_cp_rank != 0 or self.pp_rank != 0:
            return
        prefill_url = self._resolve_rebootstrap_prefill_url(kv_receiver)
        if not prefill_url:
            logger.error(
                "PD retract rebootstrap could not resolve the prefill /generate "
                "URL from bootstrap info (rid=%s bootstrap_room=%s bootstrap_addr=%s).",
                payload.get("rid"),
                payload.get("bootstrap_room"),
                kv_receiver.bootstrap_addr,
            )
            self._fail_prefill_recompute(
                kv_receiver,
                "PD retract rebootstrap could not resolve the prefill /generate "
                "URL from bootstrap info.",
            )
            return
        self._ensure_prefill_recompute_executor().submit(
            self._run_prefill_recompute, kv_receiver, prefill_url, payload
        )

    def _fail_prefill_recompute(
        self, kv_receiver: CommonKVReceiver, reason: str
    ) -> None:
        """Fail a rebootstrap request via the standard ``KVPoll.Failed`` path.

        ``abort()`` transitions the receiver to Failed and notifies the prefill
        worker to release its orphaned bootstrap entry, but records a generic
        reason; we overwrite it with a descriptive one so the eventual
        ``failure_exception`` (and the client-facing abort message) explains that
        the rebootstrap ``/generate`` failed rather than reporting a spurious
        ``AbortReq``.
        """
        with kv_receiver._lifecycle_lock:
            if self.defer_decode_allocation and (
                not kv_receiver._owns_bootstrap_room
                or kv_receiver.conclude_state == KVPoll.Success
                or self.request_status.get(kv_receiver.bootstrap_room) == KVPoll.Success
            ):
                # The HTTP response can arrive after KV transfer has succeeded.
                # Serialize errors with polling/retirement so an old callback
                # cannot leave a failure record for a reused room.
                return
            kv_receiver.abort()
            self.record_failure(kv_receiver.bootstrap_room, reason)

    def _run_prefill_recompute(
        self, kv_receiver: CommonKVReceiver, prefill_url: str, payload: dict
    ) -> None:
        rid = payload.get("rid")
        try:
            response = self._get_prefill_recompute_session().post(
                prefill_url.rstrip("/") + "/generate",
                json=payload,
                timeout=self.waiting_timeout,
            )
            if response.status_code >= 400:
                logger.error(
                    "PD rebootstrap prefill failed for rid=%s status=%s body=%s",
                    rid,
                    response.status_code,
                    response.text[:512],
                )
                self._fail_prefill_recompute(
                    kv_receiver,
                    f"PD retract rebootstrap /generate failed for rid={rid} "
                    f"(status={response.status_code}).",
                )
        except Exception:
            logger.exception("PD rebootstrap prefill request failed for rid=%s", rid)
            self._fail_prefill_recompute(
                kv_receiver,
                f"PD retract rebootstrap /generate request errored for rid={rid}.",
            )

    def has_parallel_info(self, bootstrap_addr: str) -> bool:
        return bootstrap_addr in self.prefill_info_table

    def abandon_parallel_info_fetch(self, bootstrap_addr: str) -> None:
        """Stop waiting for a fetch that outlived BOOTSTRAP_QUERY_TIMEOUT_S, so
        that the next attempt can start; it publishes nothing if it ends."""
        with self.connection_lock:
            self._parallel_info_inflight.discard(bootstrap_addr)

    def parallel_info_fetch_in_flight(self, bootstrap_addr: str) -> bool:
        # Unlocked: a stale answer costs a cycle, or a call the locked re-check rejects.
        return bootstrap_addr in self._parallel_info_inflight

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """Non-blocking: True if the prefill parallel info is cached. Otherwise
        submits at most one background fetch per addr and returns False;
        callers retry on a later scheduling cycle."""
        self.raise_parallel_info_error()
        if bootstrap_addr in self.prefill_info_table:
            return True
        with self.connection_lock:
            # A fetch may have published since the unlocked check above.
            if bootstrap_addr in self.prefill_info_table:
                return True
            if bootstrap_addr in self._parallel_info_inflight:
                return False
            self._parallel_info_inflight.add(bootstrap_addr)
        self._parallel_info_executor.submit(self._publish_parallel_info, bootstrap_addr)
        return False

    def raise_parallel_info_error(self) -> None:
        """Re-raise on the calling thread a config mismatch found by a
        background fetch: it is fatal, as it was when the fetch ran inline."""
        if self._parallel_info_fatal is not None:
            raise self._parallel_info_fatal

    def _fetch_parallel_info(self, bootstrap_addr: str) -> Optional[PrefillServerInfo]:
        try:
            url = (
                f"http://{bootstrap_addr}/route?"
                f"prefill_dp_rank={-1}&prefill_cp_rank={-1}&"
                f"target_tp_rank={-1}&target_pp_rank={-1}"
            )
            response = requests.get(url, timeout=5)
            if response.status_code == 200:
                data = response.json()
                return PrefillServerInfo(**data)
            else:
                logger.error(
                    f"Failed to get prefill server info: {response.status_code}, {response.text}"
                )
                return None
        except Exception as e:
            logger.error(f"Error fetching prefill server info from bootstrap: {e}")
            return None

    def _check_parallel_info(self, info: PrefillServerInfo) -> None:
        if info.page_size is not None and info.page_size != self.kv_args.page_size:
            raise RuntimeError(
                f"Page size mismatch: prefill server has page_size={info.page_size}, "
                f"but decode server has page_size={self.kv_args.page_size}. "
                f"Both servers must use the same --page-size value."
            )

        if (
            info.kv_cache_dtype is not None
            and info.kv_cache_dtype != self.kv_cache_dtype_str
        ):
            raise RuntimeError(
                f"KV cache dtype mismatch: prefill server has kv_cache_dtype={info.kv_cache_dtype}, "
                f"but decode server has kv_cache_dtype={self.kv_cache_dtype_str}. "
                f"Both servers must use the same --kv-cache-dtype value."
            )

        if (
            StateType.MINIMAX_INDEX_K in getattr(self.kv_args, "state_types", ())
            and info.attn_tp_size != self.attn_tp_size
        ):
            # MiniMax main KV pages are head-major page rows and its index state
            # is replicated per rank; neither can be resliced by attention head.
            raise RuntimeError(
                "MiniMax sparse PD requires matching attention TP sizes: "
                f"prefill={info.attn_tp_size}, decode={self.attn_tp_size}."
            )

        if (
            info.kv_layout is not None
            and self.kv_layout is not None
            and info.kv_layout != self.kv_layout
        ):
            raise RuntimeError(
                f"KV layout mismatch: prefill server has kv_layout={info.kv_layout}, "
                f"but decode server has kv_layout={self.kv_layout}. Both servers "
                f"must use the same --dsv4-attn-backend and SGLANG_DSV4_KV_LAYOUT."
            )

        local_layout = self.dsv41_spec_layout
        if local_layout is not None or info.dsv41_spec_layout is not None:
            if local_layout != info.dsv41_spec_layout:
                mismatched_fields = sorted(
                    key
                    for key in (local_layout or {}).keys()
                    | (info.dsv41_spec_layout or {}).keys()
                    if (local_layout or {}).get(key)
                    != (info.dsv41_spec_layout or {}).get(key)
                )
                raise RuntimeError(
                    "DeepSeek-V4.1 DSpark PD layout mismatch "
                    f"({', '.join(mismatched_fields)}): both servers must "
                    "enable DSpark with the same block size and target/draft KV "
                    "layout. Upgrade both servers together."
                )

            decode_tp_size_aligns_prefill_world_size = (
                info.attn_cp_size > 1
                and (self.is_mla_backend or self.is_hybrid_mla_backend)
                and self.attn_cp_size == 1
                and info.attn_tp_size * info.attn_cp_size == self.attn_tp_size
            )
            if (
                info.attn_tp_size != self.attn_tp_size
                and not decode_tp_size_aligns_prefill_world_size
            ):
                raise RuntimeError(
                    "DeepSeek-V4.1 DSpark PD requires the same TP size on both "
                    "servers (including prefill CP ranks for MLA)"
                )

        # Every send path rejects head-sharded MXFP8 block scales across
        # attention TP sizes, so each request would fail at its first transfer.
        if (
            info.attn_tp_size != self.attn_tp_size
            and not self.is_mla_backend
            and not self.is_hybrid_mla_backend
        ):
            block_scale_states = [
                st
                for st in getattr(self.kv_args, "state_types", None) or []
                if st in (StateType.BLOCK_SCALE, StateType.BLOCK_SCALE_SWA)
            ]
            if block_scale_states:
                raise RuntimeError(
                    "PD Disaggregation does NOT support different attention TP "
                    "sizes with MXFP8 KV cache: prefill attn_tp_size="
                    f"{info.attn_tp_size}, decode attn_tp_size={self.attn_tp_size}, "
                    f"state types {[st.value for st in block_scale_states]}."
                )

        if self.dcp_size > 1:
            if not (self.is_mla_backend or self.is_hybrid_mla_backend):
                raise RuntimeError(
                    "PD decode DCP requires an MLA or hybrid-MLA KV pool."
                )
            if info.attn_cp_size != 1:
                raise RuntimeError(
                    "PD decode DCP currently requires prefill attention CP=1, "
                    f"got {info.attn_cp_size}."
                )
            if info.enable_kv_cache_sharding:
                raise RuntimeError(
                    "PD decode DCP does not support a prefill with "
                    "--enable-kv-cache-sharding."
                )

    def _publish_parallel_info(self, bootstrap_addr: str) -> None:
        """Fetch-executor body: fetch, check and cache the parallel info of
        ``bootstrap_addr``, and clear its in-flight marker in every outcome."""
        info = None
        failures = getattr(self, "_losses", {}).get(bootstrap_addr)
        try:
            info = self._fetch_parallel_info(bootstrap_addr)
            if info is not None:
                self._check_parallel_info(info)
                self._resolve_rank_mapping(info)
        except Exception as e:
            # Fatal on the scheduler thread, as inline (raise_parallel_info_error).
            logger.error(
                f"Prefill server [{bootstrap_addr}] is incompatible with this "
                f"decode server: {e}"
            )
            self._parallel_info_fatal = e
            info = None
        finally:
            with self.connection_lock:
                # Not if given up, or if the heartbeat failed it meanwhile: stale.
                if (
                    info is not None
                    and bootstrap_addr in self._parallel_info_inflight
                    and getattr(self, "_losses", {}).get(bootstrap_addr) == failures
                ):
                    self.prefill_info_table[bootstrap_addr] = info
                self._parallel_info_inflight.discard(bootstrap_addr)
        if info is not None:
            logger.debug(f"Prefill parallel info for [{bootstrap_addr}]: {info}")

    def setup_bootstrap_routes(
        self, receiver: CommonKVReceiver
    ) -> concurrent.futures.Future:
        """Run ``receiver._setup_bootstrap_infos()`` off the scheduler thread,
        one per (prefill, dp rank) at a time, which other receivers share. The
        future gives whether the routes are cached now."""
        key = (receiver.bootstrap_addr, receiver.prefill_dp_rank)
        with self.connection_lock:
            setup = self._route_setups.get(key)
            if setup is None:
                setup = self._parallel_info_executor.submit(
                    self._setup_bootstrap_routes, receiver.bootstrap_addr, receiver
                )
                self._route_setups[key] = setup
        return setup

    def _setup_bootstrap_routes(
        self, bootstrap_addr: str, receiver: CommonKVReceiver
    ) -> bool:
        info = self.prefill_info_table.get(bootstrap_addr)
        try:
            receiver._setup_bootstrap_infos()
        except Exception:
            logger.exception(f"Bootstrap route setup for [{bootstrap_addr}] failed")
        finally:
            with self.connection_lock:
                self._route_setups.pop((bootstrap_addr, receiver.prefill_dp_rank), None)
                # The heartbeat may have failed this prefill meanwhile.
                stale = self.prefill_info_table.get(bootstrap_addr) is not info
        if stale:
            receiver.invalidate_cached_bootstrap_infos()
        if receiver.bootstrap_room not in self.request_status:
            # Its request ended meanwhile: nobody reads a failure recorded here.
            with self.failure_lock:
                self.failure_records.pop(receiver.bootstrap_room, None)
        return not stale and receiver._bootstrap_infos_cached()

    def _stop_bootstrap_fetches(self) -> None:
        """Teardown never waits on a prefill: queued bootstrap queries are
        cancelled, running ones end by their own timeout, and the heartbeat
        thread is woken to stop. Reads with getattr, as 0.5.23's teardown()
        does: a manager may have been built without __init__."""
        executor = getattr(self, "_parallel_info_executor", None)
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
        heartbeat_shutdown = getattr(self, "_heartbeat_shutdown", None)
        if heartbeat_shutdown is not None:
            heartbeat_shutdown.set()

    def _resolve_rank_mapping(self, info: PrefillServerInfo) -> None:
        """Compute TP/CP/PP rank mapping and store on the PrefillServerInfo object.
        Deterministic for a given (bootstrap_addr, decode engine) pair."""
        # TP rank mapping
        # Only MLA shards across attn-TP, so non-MLA never reads the sharding flag.
        if (
            self.is_mla_backend
            and info.enable_kv_cache_sharding
            and info.attn_cp_size == 1
        ):
            # MLA KV sharded across prefill attn-TP: every decode rank pulls
            # from all prefill TP ranks (None marks them all as real senders).
            assert self.attn_tp_size == info.attn_tp_size, (
                "MLA KV cache sharding requires equal prefill/decode attn TP "
                f"sizes, got prefill={info.attn_tp_size} decode={self.attn_tp_size}"
            )
            target_tp_rank = None
            target_tp_ranks = list(range(info.attn_tp_size))
            required_dst_info_num = self.attn_tp_size
            required_prefill_response_num = info.attn_tp_size
        elif self.attn_tp_size == info.attn_tp_size:
            target_tp_rank = self.kv_args.engine_rank % self.attn_tp_size
            required_dst_info_num = 1
            required_prefill_response_num = 1
            target_tp_ranks = [target_tp_rank]
        elif self.attn_tp_size > info.attn_tp_size:
            if not self.is_mla_backend and not self.is_hybrid_mla_backend:
                logger.warning_once(
                    "Performance is NOT guaranteed when using different TP sizes for non-MLA models. "
                )
            target_tp_rank = (self.kv_args.engine_rank % self.attn_tp_size) // (
                self.attn_tp_size // info.attn_tp_size
            )
            required_dst_info_num = self.attn_tp_size // info.attn_tp_size
            required_prefill_response_num = 1
            target_tp_ranks = [target_tp_rank]
        else:
            if not self.is_mla_backend and not self.is_hybrid_mla_backend:
                logger.warning_once(
                    "Performance is NOT guaranteed when using different TP sizes for non-MLA models. "
                )
            # For non-MLA models, one decode rank needs to retrieve KVCache from multiple prefill ranks
            target_tp_ranks = list(
                range(
                    (self.kv_args.engine_rank % self.attn_tp_size)
                    * (info.attn_tp_size // self.attn_tp_size),
                    (self.kv_args.engine_rank % self.attn_tp_size + 1)
                    * (info.attn_tp_size // self.attn_tp_size),
                )
            )
            # For MLA models, we can retrieve KVCache from only one prefill rank, but we still need to maintain
            # multiple connections in the connection pool and have to send dummy requests to other prefill ranks,
            # or the KVPoll will never be set correctly
            target_tp_rank = target_tp_ranks[0]
            required_dst_info_num = 1
            if self.is_mla_backend:
                required_prefill_response_num = 1
            else:
                required_prefill_response_num = info.attn_tp_size // self.attn_tp_size

        # CP rank mapping — decode cp size should be equal to 1
        assert self.attn_cp_size == 1, (
            f"Decode cp size ({self.attn_cp_size}) should be equal to 1",
        )
        if self.attn_cp_size == info.attn_cp_size:
            assert info.attn_cp_size == 1, (
                f"When prefill cp size is 1, attn cp size should be 1, but got {self.attn_cp_size}",
            )
            target_cp_ranks = [self.attn_cp_rank]
        else:
            target_cp_ranks = list(range(info.attn_cp_size))
            pull_from_all_cp_ranks = (
                self.enable_all_cp_ranks_for_transfer
                or info.enable_dsa_cache_layer_split
                or info.enable_kv_cache_sharding
            )
            if not pull_from_all_cp_ranks:
                # Only retrieve from prefill CP rank 0 when not using all ranks
                target_cp_ranks = target_cp_ranks[:1]
                required_prefill_response_num *= 1
            else:
                required_prefill_response_num *= info.attn_cp_size // self.attn_cp_size

        # PP rank mapping — decode pp size should be equal to prefill pp size or 1
        assert self.pp_size == info.pp_size or self.pp_size == 1, (
            f"Decode pp size ({self.pp_size}) should be equal to prefill pp size ({info.pp_size}) or 1",
        )
        if info.pp_size == self.pp_size:
            target_pp_ranks = [self.pp_rank]
        else:
            target_pp_ranks = list(range(info.pp_size))
            required_prefill_response_num *= info.pp_size // self.pp_size

        info.target_tp_rank = target_tp_rank
        info.target_tp_ranks = target_tp_ranks
        info.target_cp_ranks = target_cp_ranks
        info.target_pp_ranks = target_pp_ranks
        info.required_dst_info_num = required_dst_info_num
        info.required_prefill_response_num = required_prefill_response_num

    def _sync_bootstrap_port_across_nodes(self, local_port: int) -> int:
        """Broadcast world-rank-0's bootstrap port to all prefill ranks.

        Required for multi-node prefill when the launcher auto-reserves a
        free port per host (e.g. Dynamo's
        `_reserve_disaggregation_bootstrap_port`): without sync, non-leader
        ranks register to `<leader_ip>:<their_local_port>`, hit
        `Connection refused`, and the leader's `prefill_port_table` ends
        up missing rows.
        """
        if not self.dist_init_addr or get_parallel().nnodes == 1:
            return local_port

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "torch.distributed must be initialised before "
                "CommonKVManager registers to the bootstrap server in "
                "multi-node prefill mode."
            )

        world_group = get_parallel().world_group
        synced_port = world_group.broadcast_object(local_port, src=0)
        if synced_port != local_port:
            logger.info(
                f"Synced disaggregation bootstrap port from leader: "
                f"local={local_port} -> leader={synced_port} "
                f"(world_rank={world_group.rank_in_group})"
            )
        return synced_port

    def register_to_bootstrap(self):
        """Register prefill server info to bootstrap server via HTTP PUT."""
        if self.dist_init_addr:
            # Multi-node case: bootstrap server's host is dist_init_addr
            host = NetworkAddress.parse(self.dist_init_addr).resolved().host
        else:
            # Single-node case: bootstrap server's host is the same as http server's host
            host = self.bootstrap_host
            # A wildcard bind address (0.0.0.0 / ::) is not a valid HTTP Host
            # and can't be connected to; rewrite it to the same-family loopback,
            # which the wildcard listener also binds.  (self.local_ip is wrong
            # here — it can resolve to a different family than the listener,
            # e.g. IPv6 while the server is bound to 0.0.0.0.)
            host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)

        bootstrap_na = NetworkAddress(host, self.bootstrap_port)
        url = f"{bootstrap_na.to_url()}/route"
        attn_tp = (self.attn_tp_size, self.attn_tp_rank)
        attn_cp = (self.attn_cp_size, self.attn_cp_rank)
        if get_parallel().enable_cp_tp_group_sharing:
            # Decode pairs its TP rank r with this CP rank r (see __init__).
            attn_tp, attn_cp = attn_cp, (1, 0)
        payload = {
            "attn_tp_size": attn_tp[0],
            "attn_tp_rank": attn_tp[1],
            "attn_cp_size": attn_cp[0],
            "attn_cp_rank": attn_cp[1],
            "attn_dp_size": self.attn_dp_size,
            "attn_dp_rank": self.attn_dp_rank,
            "pp_size": self.pp_size,
            "pp_rank": self.pp_rank,
            "system_dp_size": self.system_dp_size,
            "system_dp_rank": self.system_dp_rank,
            "rank_ip": self.local_ip,
            "rank_port": self.rank_port,
            "page_size": self.kv_args.page_size,
            "kv_cache_dtype": self.kv_cache_dtype_str,
            "kv_layout": self.kv_layout,
            "dsv41_spec_layout": self.dsv41_spec_layout,
            "load_balance_method": get_parallel().load_balance_method,
            "enable_dsa_cache_layer_split": get_parallel().enable_dsa_cache_layer_split,
            "enable_kv_cache_sharding": get_parallel().enable_kv_cache_sharding,
            # Self-register the HTTP API port so the decode can derive the PD
            # retract rebootstrap /generate URL from bootstrap info instead of a
            # router-injected pd_rebootstrap_prefill_url.
            "prefill_http_port": get_serving().port,
        }

        payload["decode_allocation_policy"] = (
            get_disagg().disaggregation_decode_allocation_policy
        )

        if envs.SGLANG_RUST_SERVER.get() and self.attn_dp_size > 1:
            topology_rows = get_parallel().world_group.all_gather_object(payload)
            # Every scheduler contributes a topology row. Only the scheduler
            # ranks that own a Rust listener populate their local registry.
            if self.kv_args.rust_http_port is None:
                return
            registry_host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(
                self.bootstrap_host, self.bootstrap_host
            )
            registry = NetworkAddress(registry_host, self.kv_args.rust_http_port)
            url = f"{registry.to_url()}/route"
            for topology_row in topology_rows:
                registry_row = {
                    **topology_row,
                    "prefill_http_port": self.kv_args.rust_http_port,
                }
                self._register_topology_row(url, registry_row)
            return

        self._register_topology_row(url, payload)

    def _register_topology_row(self, url: str, payload: Dict) -> None:
        max_retries, initial_delay, max_delay = 5, 1.0, 30.0
        for attempt in range(max_retries):
            try:
                response = requests.put(url, json=payload, timeout=5)
                if response.status_code == 200:
                    logger.debug("Prefill successfully registered to bootstrap server.")
                    return
                logger.warning(
                    f"Prefill register attempt {attempt + 1}/{max_retries} failed: status {response.status_code}"
                )
            except Exception as e:
                # Walk to root cause to skip misleading urllib3 wrapper messages
                cause = e
                while cause.__cause__ is not None:
                    cause = cause.__cause__
                logger.warning(
                    f"Prefill register attempt {attempt + 1}/{max_retries} failed: {cause}"
                )
            if attempt == max_retries - 1:
                break
            delay = min(initial_delay * (2**attempt), max_delay) * (
                0.75 + 0.25 * (time.monotonic() % 1)
            )
            time.sleep(delay)
        logger.error(
            f"Prefill instance failed to register to bootstrap server after {max_retries} retries"
        )

    def _connect(self, endpoint: str, is_ipv6: bool = False):
        with self._socket_lock:
            sock = self._socket_cache.get(endpoint)
            if sock is not None:
                monitor = self._monitor_cache.get(endpoint)
                disconnected = False
                if monitor is not None:
                    try:
                        monitor.recv_multipart(zmq.NOBLOCK)
                        disconnected = True
                    except zmq.Again:
                        pass
                    except zmq.ZMQError:
                        disconnected = True
                if not disconnected:
                    return sock
                sock.close(linger=0)
                if monitor is not None:
                    monitor.close()
                self._socket_cache.pop(endpoint, None)
                self._monitor_cache.pop(endpoint, None)

            sock = self._zmq_ctx.socket(zmq.PUSH)
            if is_ipv6:
                sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt(zmq.RECONNECT_IVL, -1)
            sock.setsockopt(
                zmq.SNDTIMEO,
                envs.SGLANG_DISAGGREGATION_ZMQ_SEND_TIMEOUT.get() * 1000
                if self.defer_decode_allocation
                else 30000,
            )
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
            sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 30)
            sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 5)
            sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
            sock.connect(endpoint)
            self._socket_cache[endpoint] = sock
            self._monitor_cache[endpoint] = sock.get_monitor_socket(
                zmq.EVENT_DISCONNECTED
            )
            self._socket_send_locks.setdefault(endpoint, threading.Lock())
            return sock

    def _send_multipart_locked(
        self, endpoint: str, parts: List[bytes], is_ipv6: bool = False
    ):
        # Cached sockets are shared across sender threads and zmq sockets are
        # not thread-safe; serialize sends per endpoint.
        sock = self._connect(endpoint, is_ipv6=is_ipv6)
        with self._socket_send_locks[endpoint]:
            # Never waits (up to SNDTIMEO, 30 s, once a stuck decode left SNDHWM
            # messages unread): it raises zmq.Again to the caller instead.
            sock.send_multipart(parts, flags=zmq.NOBLOCK)

    def _transfer_queue(self, queues: list, shard_idx: int, room: int):
        """Where ``room``'s chunk goes: its destination's FIFO on the
        _TransferScheduler, or 0.5.23's ``queues[shard_idx]`` without one."""
        if self._transfer_scheduler is None:
            return queues[shard_idx]
        destination = self._destination_of(self.transfer_infos[room])
        return _Inbox(self._transfer_scheduler, destination)

    @staticmethod
    def _destination_of(infos) -> tuple:
        return tuple(sorted(map(str, infos)))

    def _note_room_failed(self, room: int, reason: str, infos) -> None:
        """Counts it for /metrics (pruned when written): once a room, and not a
        room its decode aborted (it marked it Failed)."""
        scheduler = self._transfer_scheduler
        if scheduler and infos and self.request_status.get(room) != KVPoll.Failed:
            kind = "session" if "is not alive" in reason else "transfer"
            scheduler.note_failed(self._destination_of(infos), kind)

    def _decode_name(self, destination: tuple) -> str:
        return ",".join(destination)

    def _peer_metric_rows(self) -> list:
        scheduler, labels = self._transfer_scheduler, self.peer_metrics.labels
        return scheduler.metric_rows(labels, self._decode_name) if scheduler else []

    def get_mha_kv_ptrs_with_pp(
        self, src_kv_ptrs: List[int], dst_kv_ptrs: List[int]
    ) -> Tuple[List[int], List[int], List[int], List[int], int]:
        start_layer = self.kv_args.prefill_start_layer
        num_kv_layers = len(src_kv_ptrs) // 2
        end_layer = start_layer + num_kv_layers
        dst_num_total_layers = len(dst_kv_ptrs) // 2
        src_k_ptrs = src_kv_ptrs[:num_kv_layers]
        src_v_ptrs = src_kv_ptrs[num_kv_layers:]
        if num_kv_layers == dst_num_total_layers:
            dst_k_ptrs = dst_kv_ptrs[:dst_num_total_layers]
            dst_v_ptrs = dst_kv_ptrs[dst_num_total_layers:]
        elif (
            num_kv_layers < dst_num_total_layers
            and dst_num_total_layers % num_kv_layers != 0
        ):
            # Case: Decode has draft model KV while Prefill is deployed without speculative decoding
            # dst_kv_ptrs layout: [K_main..., V_main..., draft_K..., draft_V...]
            multiplier_ratio = dst_num_total_layers // num_kv_layers
            dst_k_ptrs = dst_kv_ptrs[start_layer:end_layer]
            v_ptr_offset = num_kv_layers * multiplier_ratio
            dst_v_ptrs = dst_kv_ptrs[
                v_ptr_offset + start_layer : v_ptr_offset + end_layer
            ]
        else:
            # Decode pp size should be equal to prefill pp size or 1
            dst_k_ptrs = dst_kv_ptrs[start_layer:end_layer]
            dst_v_ptrs = dst_kv_ptrs[
                dst_num_total_layers + start_layer : dst_num_total_layers + end_layer
            ]
        layers_current_pp_stage = len(src_k_ptrs)
        return src_k_ptrs, src_v_ptrs, dst_k_ptrs, dst_v_ptrs, layers_current_pp_stage

    def _get_mha_head_slice_blocks(
        self,
        src_ptrs: List[int],
        src_item_lens: List[int],
        dst_ptrs: List[int],
        dst_item_lens: List[int],
        src_page_indices: npt.NDArray[np.int32],
        dst_page_indices: npt.NDArray[np.int32],
        dst_attn_tp_size: int,
        dst_tp_rank: int,
    ) -> List[Tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], int]]:
        # SWA state has no layer ids and its pool starts every PP stage at layer
        # 0, so a prefill stage's entries cannot be paired with the decode layers.
        if self.pp_size > 1:
            raise RuntimeError(
                "PD Disaggregation does NOT support PD different TP sizes for "
                "non-MLA SWA hybrid models with pipeline parallelism yet."
            )
        # The addresses below assume NHD pages [page_size, heads, head_dim]; HND
        # and vectorized_5d pages have the same size in another element order.
        if self.kv_args.swa_kv_cache_layout != "nhd":
            raise RuntimeError(
                "Head-sliced PD transfer needs the NHD KV cache layout, got "
                f"{self.kv_args.swa_kv_cache_layout}"
            )
        from sglang.srt.disaggregation.common.staging_buffer import (
            compute_head_slice_params,
            resolve_total_kv_heads,
        )

        src_k_ptrs, src_v_ptrs, dst_k_ptrs, dst_v_ptrs, num_layers = (
            self.get_mha_kv_ptrs_with_pp(src_ptrs, dst_ptrs)
        )
        _, _, dst_k_lens, dst_v_lens, _ = self.get_mha_kv_ptrs_with_pp(
            src_item_lens, dst_item_lens
        )
        entries = list(
            zip(
                src_k_ptrs + src_v_ptrs,
                dst_k_ptrs + dst_v_ptrs,
                src_item_lens,
                dst_k_lens + dst_v_lens,
            )
        )
        # A single page-envelope region (unified memory) has no per-layer K/V
        # split to slice heads from.
        if len(entries) != len(src_ptrs) or 2 * num_layers != len(src_ptrs):
            raise RuntimeError(
                "Head-sliced PD transfer needs matching per-layer K/V buffers: "
                f"prefill has {len(src_ptrs)} entries, decode has {len(dst_ptrs)}"
            )
        if len(src_page_indices) != len(dst_page_indices):
            raise RuntimeError(
                "Head-sliced PD transfer page count mismatch: "
                f"prefill={len(src_page_indices)}, decode={len(dst_page_indices)}"
            )

        total_kv_heads = resolve_total_kv_heads(self.kv_args, self.attn_tp_size)
        src_head_start, num_heads, dst_head_start, _ = compute_head_slice_params(
            src_attn_tp_size=self.attn_tp_size,
            dst_attn_tp_size=dst_attn_tp_size,
            src_tp_rank=self.kv_args.engine_rank,
            dst_tp_rank=dst_tp_rank,
            total_kv_heads=total_kv_heads,
        )
        src_heads = max(1, total_kv_heads // self.attn_tp_size)
        dst_heads = max(1, total_kv_heads // dst_attn_tp_size)
        page_size = self.kv_args.page_size
        tokens = np.arange(page_size, dtype=np.uint64)
        src_pages = np.asarray(src_page_indices, dtype=np.uint64)[:, None]
        dst_pages = np.asarray(dst_page_indices, dtype=np.uint64)[:, None]

        blocks = []
        for src_ptr, dst_ptr, src_item_len, dst_item_len in entries:
            head_len = src_item_len // (page_size * src_heads)
            # Both peers must hold whole heads of one size, or this state is
            # sharded differently from total_kv_head_num.
            if (
                head_len * page_size * src_heads != src_item_len
                or head_len * page_size * dst_heads != dst_item_len
            ):
                raise RuntimeError(
                    f"KV item lengths (prefill={src_item_len}, decode={dst_item_len}) "
                    f"do not split into {src_heads} and {dst_heads} heads of "
                    f"{total_kv_heads} total with page_size={page_size}"
                )
            # Each page item is [page_size, heads, head_dim]: one block per token.
            src_addrs = (
                np.uint64(src_ptr)
                + src_pages * np.uint64(src_item_len)
                + tokens * np.uint64(src_heads * head_len)
                + np.uint64(src_head_start * head_len)
            )
            dst_addrs = (
                np.uint64(dst_ptr)
                + dst_pages * np.uint64(dst_item_len)
                + tokens * np.uint64(dst_heads * head_len)
                + np.uint64(dst_head_start * head_len)
            )
            blocks.append((src_addrs.ravel(), dst_addrs.ravel(), num_heads * head_len))
        return blocks

    def get_mla_kv_ptrs_with_pp(
        self,
        src_kv_ptrs: List[int],
        dst_kv_ptrs: List[int],
        state_type: Optional[StateType] = None,
    ) -> Tuple[List[int], List[int], int]:
        # Fast path: both sides use exactly the same PP layout
        if len(src_kv_ptrs) == len(dst_kv_ptrs):
            return src_kv_ptrs, dst_kv_ptrs, len(src_kv_ptrs)

        mla_ratios = getattr(self.kv_args, "mla_compression_ratios", None)
        if mla_ratios:
            # Compressed-MLA pointers are grouped by buffer type;
            # each group needs its own PP-stage slice.
            sliced_src_kv_ptrs, sliced_dst_kv_ptrs = self._mla_slice_ptrs_for_pp(
                src_kv_ptrs, dst_kv_ptrs, mla_ratios, state_type
            )
            return (
                sliced_src_kv_ptrs,
                sliced_dst_kv_ptrs,
                len(sliced_src_kv_ptrs),
            )

        # Regular MLA PP slicing
        # Decode pp size should be equal to prefill pp size or 1
        num_draft = (
            getattr(self.kv_args, "num_draft_entries", 0) if state_type is None else 0
        )
        start_layer, end_layer = self._mla_kv_entry_span_with_pp(
            len(src_kv_ptrs) - num_draft
        )
        sliced_dst_kv_ptrs = dst_kv_ptrs[start_layer:end_layer]
        if num_draft:
            # Draft entries follow the target's global layer range on both peers.
            sliced_dst_kv_ptrs += dst_kv_ptrs[-num_draft:]
        return src_kv_ptrs, sliced_dst_kv_ptrs, len(src_kv_ptrs)

    def _mla_kv_entry_span_with_pp(self, n_src: int) -> Tuple[int, int]:
        # A plain MLA pool registers one region per layer ascending, addressed as
        # layer_id - start_layer, so this stage occupies [start, start + n_src) of a
        # peer that registered the whole model. Pointer view: get_mla_kv_ptrs_with_pp.
        start_layer = self.kv_args.prefill_start_layer
        return start_layer, start_layer + n_src

    def _mla_slice_ptrs_for_pp(
        self,
        src_kv_ptrs: List[int],
        dst_kv_ptrs: List[int],
        mla_ratios: List[int],
        state_type: Optional[StateType] = None,
    ) -> Tuple[List[int], List[int]]:
        # Match the pool's flat buffer order, with layers grouped by ratio:
        # KV: [C4 KV, C4 indexer KV, C128 KV].
        # SWA state: [SWA KV, C4 compressor state, C4 indexer state].
        # DSV4_REQUEST_STATE: [C128 compressor state]; SWA_RING: [SWA rings].
        # Prefill src is stage-local; decode dst may cover the full model.
        start_layer = self.kv_args.prefill_start_layer
        end_layer = self.kv_args.prefill_end_layer
        assert end_layer is not None, (
            "KVArgs.prefill_end_layer must be set when using compressed-MLA PD with PP"
        )

        c4_full = sum(1 for r in mla_ratios if r == 4)
        c128_full = sum(1 for r in mla_ratios if r == 128)
        kv_layout_len = 2 * c4_full + c128_full

        # A DSV4 two-pool peer registers a rope group beside each KV group and
        # doubles the ring, and the switch that turns that on is read per
        # process. Mixed peers would fall into the cuts below, match whichever
        # side is shorter, and then index past the other one once per request.
        if state_type in (StateType.SWA, StateType.DSV4_REQUEST_STATE):
            single_pool_len = two_pool_len = None
        elif state_type == StateType.SWA_RING:
            single_pool_len, two_pool_len = len(mla_ratios), 2 * len(mla_ratios)
        else:
            single_pool_len, two_pool_len = kv_layout_len, 3 * c4_full + 2 * c128_full
        peer_lens = {len(src_kv_ptrs), len(dst_kv_ptrs)}
        if single_pool_len is not None and peer_lens == {single_pool_len, two_pool_len}:
            raise ValueError(
                "PD peers disagree on the compressed-MLA KV layout: prefill "
                f"registered {len(src_kv_ptrs)} regions, decode "
                f"{len(dst_kv_ptrs)} ({single_pool_len} is one pool per layer, "
                f"{two_pool_len} is the fp8 two-pool). "
                "SGLANG_DSV4_UNIFIED_KV_FP8 must be set the same on both sides."
            )

        c4_off_s = sum(1 for r in mla_ratios[:start_layer] if r == 4)
        c4_off_e = sum(1 for r in mla_ratios[:end_layer] if r == 4)
        c128_off_s = sum(1 for r in mla_ratios[:start_layer] if r == 128)
        c128_off_e = sum(1 for r in mla_ratios[:end_layer] if r == 128)

        if state_type == StateType.DSV4_REQUEST_STATE:
            return src_kv_ptrs, list(dst_kv_ptrs[c128_off_s:c128_off_e])

        if state_type == StateType.SWA_RING:
            swa_s = min(start_layer, len(dst_kv_ptrs))
            swa_e = min(end_layer, len(dst_kv_ptrs))
            return src_kv_ptrs, list(dst_kv_ptrs[swa_s:swa_e])

        if (
            state_type
            not in (StateType.SWA, StateType.SWA_RING, StateType.DSV4_REQUEST_STATE)
            and len(dst_kv_ptrs) == kv_layout_len
        ):
            sliced_dst = (
                list(dst_kv_ptrs[c4_off_s:c4_off_e])
                + list(dst_kv_ptrs[c4_full + c4_off_s : c4_full + c4_off_e])
                + list(dst_kv_ptrs[2 * c4_full + c128_off_s : 2 * c4_full + c128_off_e])
            )
            return src_kv_ptrs, sliced_dst

        # SWA may omit nextn entries present in mla_ratios; use its buffer count.
        # C128 state ships separately as DSV4_REQUEST_STATE.
        swa_L = len(dst_kv_ptrs) - 2 * c4_full
        if swa_L < 0 or swa_L > len(mla_ratios):
            raise ValueError(
                f"Unexpected compressed-MLA dst_kv_ptrs length "
                f"{len(dst_kv_ptrs)}; expected either {kv_layout_len} "
                f"(kv_data) or swa_L + {2 * c4_full} "
                f"(state_data) given compression_ratios "
                f"(c4={c4_full}, c128={c128_full}, "
                f"total={len(mla_ratios)})."
            )

        swa_s = min(start_layer, swa_L)
        swa_e = min(end_layer, swa_L)
        compress_section_start = swa_L
        indexer_section_start = swa_L + c4_full
        sliced_dst = (
            list(dst_kv_ptrs[swa_s:swa_e])
            + list(
                dst_kv_ptrs[
                    compress_section_start + c4_off_s : compress_section_start
                    + c4_off_e
                ]
            )
            + list(
                dst_kv_ptrs[
                    indexer_section_start + c4_off_s : indexer_section_start + c4_off_e
                ]
            )
        )

        return src_kv_ptrs, sliced_dst

    def _start_heartbeat_checker_thread(self) -> threading.Thread:
        """Start the heartbeat checker thread for Decode worker.

        Returns the thread object so callers can track/join it during teardown.
        """

        def heartbeat_checker():
            # Each prefill is probed on a thread of its own (not behind the
            # decode's calls to it), all at once, and judged when its probe ends;
            # one not answered by HEARTBEAT_PROBE_TIMEOUT_S misses. Rounds start
            # every interval: a hung prefill delays no other's verdict.
            probe_threads = _PrefillThreads(
                concurrent.futures.ThreadPoolExecutor(max_workers=1), per_prefill=1
            )
            probes: Dict[str, concurrent.futures.Future] = {}
            round_at = time.monotonic()
            while not self._heartbeat_shutdown.wait(
                max(0.0, round_at + self.heartbeat_interval - time.monotonic())
            ):
                round_at = time.monotonic()
                with self.connection_lock:
                    addresses = list(self.prefill_info_table.keys())
                for bootstrap_addr in addresses:
                    if bootstrap_addr not in probes:
                        probes[bootstrap_addr] = probe_threads.submit(
                            self._probe_prefill_health, bootstrap_addr
                        )
                for bootstrap_addr, probe in _as_they_end(
                    probes, HEARTBEAT_PROBE_TIMEOUT_S
                ):
                    if self._heartbeat_shutdown.is_set():
                        break
                    if probe.done():
                        del probes[bootstrap_addr]
                    ended = probe.done() and not probe.cancelled()
                    if ended and not probe.exception() and probe.result():
                        self.heartbeat_failures[bootstrap_addr] = 0
                        self._on_heartbeat_success(bootstrap_addr)
                        continue
                    # A probe still running (it stays: none queues behind it), or
                    # whose thread could not start (at the thread limit), misses.
                    logger.info(f"Attempting to reconnect to {bootstrap_addr}...")
                    self.heartbeat_failures[bootstrap_addr] = (
                        self.heartbeat_failures.get(bootstrap_addr, 0) + 1
                    )
                    if (
                        self.heartbeat_failures.get(bootstrap_addr, 0)
                        >= self.max_failures
                    ):
                        probes.pop(bootstrap_addr, None)
                        self._handle_node_failure(bootstrap_addr)
                        with self.session_pool_lock:
                            if bootstrap_addr in self.session_pool:
                                del self.session_pool[bootstrap_addr]
            probe_threads.shutdown(wait=False, cancel_futures=True)

        t = threading.Thread(
            target=heartbeat_checker,
            name="HeartbeatChecker",
            daemon=True,
        )
        t.start()
        return t

    def _probe_prefill_health(self, bootstrap_addr: str) -> bool:
        """One heartbeat probe: whether GET /health answered 200. Probes of one
        prefill never overlap (heartbeat_checker), so its session is used by
        one thread at a time."""
        try:
            with self.session_pool_lock:
                session = self.session_pool[bootstrap_addr]
            response = session.get(
                f"http://{bootstrap_addr}/health",
                timeout=(2, 3),
                headers={"Connection": "keep-alive"},
            )
            return response.status_code == 200
        except Exception:
            return False

    def _on_heartbeat_success(self, bootstrap_addr: str):
        """Hook called on successful heartbeat. Override for backend-specific cleanup."""
        pass

    def _handle_node_failure(self, failed_bootstrap_addr: str):
        """Handle failure of a prefill node."""
        with self.connection_lock:
            # Keys are "{addr}_{dp}_{cp}_{tp}": match the separator too, or the
            # failure of host:80 would evict host:8080's routes.
            key_prefix = f"{failed_bootstrap_addr}_"
            keys_to_remove = [
                k for k in self.connection_pool if k.startswith(key_prefix)
            ]
            # Collect TCP endpoints from cached bootstrap_infos before deletion
            stale_endpoints = set()
            for k in keys_to_remove:
                for info in self.connection_pool[k]:
                    ip = info.get("rank_ip")
                    port = info.get("rank_port")
                    if ip and port:
                        na = NetworkAddress(ip, int(port))
                        stale_endpoints.add(na.to_tcp())
            for k in keys_to_remove:
                del self.connection_pool[k]
            self.prefill_info_table.pop(failed_bootstrap_addr, None)
            # A fetch still running for it publishes nothing (it may predate this).
            self._parallel_info_inflight.discard(failed_bootstrap_addr)
            getattr(self, "_losses", defaultdict(int))[failed_bootstrap_addr] += 1
            # A prefill that a later request reaches again starts with no
            # misses; a kept count would drop it at its first missed heartbeat.
            self.heartbeat_failures.pop(failed_bootstrap_addr, None)

            possible_affected_rooms = list(
                self.addr_to_rooms_tracker.get(failed_bootstrap_addr, [])
            )
            self.addr_to_rooms_tracker.pop(failed_bootstrap_addr, None)

        for endpoint in stale_endpoints:
            CommonKVReceiver.disconnect_endpoint(endpoint)

        affected_rooms = []
        for room in possible_affected_rooms:
            if (
                room in self.request_status
                and self.check_status(room) != KVPoll.Success
            ):
                self.record_failure(
                    room,
                    f"Lost connection with prefill instance (bootstrap_addr: {failed_bootstrap_addr})",
                )
                self.update_status(room, KVPoll.Failed)
                affected_rooms.append(room)

        logger.error(
            f"Lost connection with prefill instance (bootstrap_addr: {failed_bootstrap_addr}), "
            f"{len(affected_rooms)} requests affected"
        )


class CommonKVSender(BaseKVSender):
    def __init__(
        self,
        mgr: CommonKVManager,
        bootstrap_addr: str,
        bootstrap_room: int,
        req_has_disagg_prefill_dp_rank: bool = False,
    ):
        self.kv_mgr = mgr
        self.bootstrap_room = bootstrap_room
        self.aux_index = None
        self.bootstrap_server_url = bootstrap_addr
        self.conclude_state: Optional[KVPoll] = None
        self._transfer_metric = KVTransferMetric()
        self._transfer_num_kv_indices = 0
        self._transfer_num_state_indices = 0
        self._transfer_start_time: Optional[float] = None
        self._early_send_wait_event: Optional[object] = None
        self.trace_ctx = TraceNullContext()
        if self.kv_mgr.sender_trace_module and get_observability().enable_trace:
            self.trace_ctx = TraceReqContext(
                rid=str(hex(self.bootstrap_room)),
                bootstrap_room=self.bootstrap_room,
                role="Sender",
                module_name=self.kv_mgr.sender_trace_module,
            )
            if not self.trace_ctx.tracing_enable:
                self.trace_ctx = TraceNullContext()
        self.trace_ctx.trace_req_start()
        # inner state
        self.curr_idx = 0
        self.init_time: Optional[float] = None
        self._prefill_complete_time: Optional[float] = None
        self._owns_bootstrap_room = True
        if mgr.deferred_bootstrap is not None:
            room_state = mgr.deferred_bootstrap.open(bootstrap_room, self)
            self._owns_bootstrap_room = room_state is not None
            mgr.update_status(bootstrap_room, KVPoll.Bootstrapping)
            if room_state is None or room_state.failed:
                mgr.record_failure(
                    bootstrap_room, "Duplicate or cancelled bootstrap room"
                )
                mgr.update_status(bootstrap_room, KVPoll.Failed)
                self.conclude_state = KVPoll.Failed
                return
        if self.kv_mgr.is_dummy_cp_rank:
            # Non-authoritative CP ranks are dummy participants.
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.WaitingForInput)
            return

        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Bootstrapping)
        if get_parallel().num_dp_ranks > 1 and not req_has_disagg_prefill_dp_rank:
            if (
                get_parallel().load_balance_method != "follow_bootstrap_room"
                or envs.SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK.get()
            ):
                self._register_prefill_dp_rank()
            elif (
                self.kv_mgr.attn_dp_rank
                != self.bootstrap_room % get_parallel().num_dp_ranks
            ):
                # follow_bootstrap_room was overridden by external routed_dp_rank
                self.kv_mgr.record_failure(
                    self.bootstrap_room,
                    f"follow_bootstrap_room conflict: dispatched to dp_rank "
                    f"{self.kv_mgr.attn_dp_rank} but bootstrap_room "
                    f"{self.bootstrap_room} implies dp_rank "
                    f"{self.bootstrap_room % get_parallel().num_dp_ranks}. "
                    f"Set SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK=1 "
                    f"to allow mixed routing.",
                )
                self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
                return
        # Bootstrap timeout clock starts after the registration above.
        self.init_time = time.time()

    def _register_prefill_dp_rank(self):
        """Register this request's prefill dp_rank to the bootstrap server."""
        url = f"http://{self.bootstrap_server_url}/register_dp_rank"
        payload = {
            "bootstrap_room": self.bootstrap_room,
            "dp_rank": self.kv_mgr.attn_dp_rank,
        }
        try:
            response = requests.post(url, json=payload, timeout=5)
            if response.status_code != 200:
                logger.error(
                    f"Failed to register prefill dp_rank: {response.status_code}, {response.text}"
                )
        except Exception as e:
            logger.error(f"Failed to register prefill dp_rank: {e}")

    def init(self, num_kv_indices: int, aux_index: Optional[int] = None):
        self.num_kv_indices = num_kv_indices
        self.aux_index = aux_index
        logger.debug(
            f"CommonKVSender init with num_kv_indices: {num_kv_indices} and aux_index: {aux_index}"
        )

    def mark_prefill_complete(self) -> None:
        if self.kv_mgr.deferred_bootstrap is None:
            return
        # Give decode admission a fresh budget, excluding prefill queue/compute.
        if self._prefill_complete_time is None:
            self._prefill_complete_time = time.time()
            self.kv_mgr._notify_bootstrap(
                self.bootstrap_room,
                self.kv_mgr.deferred_bootstrap.complete(self.bootstrap_room, self),
            )

    def pop_decode_prefix_len(self) -> int:
        return self.kv_mgr.req_to_decode_prefix_len.pop(self.bootstrap_room, 0)

    def get_max_transfer_tokens(self) -> Optional[int]:
        if self.kv_mgr._dcp_pack_max_tokens is None:
            return None
        for peer, info in self.kv_mgr.transfer_infos.get(
            self.bootstrap_room, {}
        ).items():
            if (
                not info.is_dummy
                and self.kv_mgr.decode_kv_args_table[peer].requires_dcp_relayout
            ):
                return self.kv_mgr._dcp_pack_max_tokens
        return None

    def should_send_kv_chunk(self, num_pages: int, last_chunk: bool) -> bool:
        return num_pages > 0 or last_chunk

    def get_transfer_metric(self) -> KVTransferMetric:
        total_bytes = self._transfer_num_kv_indices * self.kv_mgr.kv_item_lens_sum
        total_bytes += (
            self._transfer_num_state_indices * self.kv_mgr.state_item_lens_sum
        )
        # Pinned to 1 for MHA (disjoint slices); only MLA replication makes it > 1.
        total_bytes *= self.kv_mgr.get_kv_replica_factor()
        self._transfer_metric.transfer_total_bytes = total_bytes
        return self._transfer_metric

    def _record_transfer_indices(
        self,
        kv_indices: npt.NDArray[np.int32],
        state_indices: Optional[List],
    ):
        self._transfer_num_kv_indices += len(kv_indices)
        if state_indices:
            for component_indices in state_indices:
                if component_indices is not None:
                    self._transfer_num_state_indices += len(component_indices)

    def _prepare_send_indices(
        self,
        kv_indices: npt.NDArray[np.int32],
        state_indices: Optional[List] = None,
    ) -> Tuple[npt.NDArray[np.int32], slice, bool, bool]:
        """Common pre-processing for send(): index tracking and CP-rank handling.

        Returns:
            (kv_indices, index_slice, is_last_chunk, should_skip)
            If should_skip is True, the caller should return immediately.
        """
        index_slice = slice(self.curr_idx, self.curr_idx + len(kv_indices))
        self.curr_idx += len(kv_indices)
        is_last_chunk = self.curr_idx == self.num_kv_indices

        if self.kv_mgr.kv_shard_size > 1:
            kv_indices, index_slice = filter_kv_indices_for_shard_rank(
                kv_indices=kv_indices,
                index_slice=index_slice,
                shard_rank=self.kv_mgr.kv_shard_rank,
                shard_size=self.kv_mgr.kv_shard_size,
            )
            # Like the scheduler, skip a non-final chunk with nothing to send.
            if len(kv_indices) == 0 and not is_last_chunk:
                return kv_indices, index_slice, is_last_chunk, True
        elif (
            self.kv_mgr.enable_all_cp_ranks_for_transfer
            and not get_parallel().enable_dsa_cache_layer_split
        ):
            kv_indices, index_slice = filter_kv_indices_for_cp_rank(
                self.kv_mgr,
                kv_indices,
                index_slice,
                total_pages=self.num_kv_indices,
            )
        elif self.kv_mgr.is_dummy_cp_rank:
            if not is_last_chunk:
                return kv_indices, index_slice, is_last_chunk, True
            else:
                self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Success)
                return kv_indices, index_slice, is_last_chunk, True

        return kv_indices, index_slice, is_last_chunk, False

    def send(
        self,
        kv_indices: npt.NDArray[np.int32],
        state_indices: Optional[List] = None,
        num_kv_tokens: Optional[int] = None,
        indices_event: Optional[object] = None,
    ):
        if self.conclude_state in (KVPoll.Success, KVPoll.Failed):
            return

        kv_indices, index_slice, is_last_chunk, should_skip = (
            self._prepare_send_indices(kv_indices, state_indices)
        )
        if should_skip:
            return

        state_indices = self.kv_mgr.prepare_send_state_indices(state_indices)
        if self._transfer_start_time is None and (
            len(kv_indices) > 0 or state_indices is not None
        ):
            self._transfer_start_time = time.perf_counter()

        # The early-send event belongs to exactly one chunk; the Mooncake and
        # Mori workers synchronize on it before reading source KV.
        wait_event = self._early_send_wait_event
        self._early_send_wait_event = None
        self.kv_mgr.add_transfer_request(
            self.bootstrap_room,
            kv_indices,
            index_slice,
            is_last_chunk,
            aux_index=self.aux_index if is_last_chunk else None,
            state_indices=state_indices if is_last_chunk else None,
            num_kv_tokens=num_kv_tokens,
            wait_event=wait_event,
            indices_event=indices_event,
            trace_ctx=self.trace_ctx.copy_for_thread(),
        )
        self._record_transfer_indices(kv_indices, state_indices)

    def poll(self) -> KVPoll:
        return self._poll_with_status(self.kv_mgr.check_status)

    def poll_pp_consensus(self) -> KVPoll:
        return self._poll_with_status(self.kv_mgr.check_status_pp_consensus)

    def _poll_with_status(self, check_status) -> KVPoll:
        if self.conclude_state is not None:
            return self.conclude_state

        if self.bootstrap_room in self.kv_mgr.request_status:
            status = check_status(self.bootstrap_room)
        else:
            status = KVPoll.Failed
        # Hold Success until all staging chunks transferred. With deferred
        # allocation also wait for worker cleanup (the zero entry is only
        # removed after cleanup), before permitting the room to be reused.
        if status == KVPoll.Success and (
            self.kv_mgr._staging_outstanding.get(self.bootstrap_room, 0) > 0
            or (
                self.kv_mgr.defer_decode_allocation
                and self.bootstrap_room in self.kv_mgr._staging_outstanding
            )
        ):
            return KVPoll.Transferring
        if status == KVPoll.Bootstrapping:
            timeout_status = self._check_bootstrap_timeout()
            if timeout_status is not None:
                status = timeout_status
        if status in (KVPoll.Success, KVPoll.Failed):
            self.conclude_state = status
            if (
                status == KVPoll.Success
                and self.kv_mgr.reports_transfer_latency
                and self._transfer_start_time is not None
            ):
                self._transfer_metric.transfer_latency_s = (
                    time.perf_counter() - self._transfer_start_time
                )
            self.trace_ctx.trace_req_finish()
        return status

    def _check_bootstrap_timeout(self) -> Optional[KVPoll]:
        start = (
            self._prefill_complete_time
            if self.kv_mgr.defer_decode_allocation
            else self.init_time
        )
        if start is None:
            return None
        elapsed = time.time() - start
        if elapsed < self.kv_mgr.bootstrap_timeout:
            return None
        logger.warning_once(
            "Some requests timed out when bootstrapping, "
            "which means prefill instances fail to receive the KV indices from the decode instance of this request. "
            "If a greater mean TTFT is acceptable, you can 'export SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT=600' (10 minutes) to relax the timeout condition. "
        )
        self.kv_mgr.record_failure(
            self.bootstrap_room,
            f"Request {self.bootstrap_room} timed out after {elapsed:.1f}s "
            f"in KVPoll.Bootstrapping",
        )
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        return KVPoll.Failed

    def clear(self) -> None:
        notification = None
        if self.kv_mgr.deferred_bootstrap is not None:
            if not self._owns_bootstrap_room:
                return
            notification = self.kv_mgr.deferred_bootstrap.close(
                self.bootstrap_room,
                self,
                success=self.kv_mgr.request_status.get(self.bootstrap_room)
                == KVPoll.Success,
            )
            self._owns_bootstrap_room = False
        if self.conclude_state is None:
            status = self.kv_mgr.request_status.get(self.bootstrap_room)
            if status in (KVPoll.Success, KVPoll.Failed):
                self.conclude_state = status
        self.kv_mgr.request_status.pop(self.bootstrap_room, None)
        self.kv_mgr.req_to_decode_prefix_len.pop(self.bootstrap_room, None)
        self.kv_mgr.transfer_infos.pop(self.bootstrap_room, None)
        # A sender can be cleared while a counted transfer is still writing:
        # keep the target for the worker, or ACK now if nothing is in flight.
        self.kv_mgr._maybe_ack_drained_abort(self.bootstrap_room)
        staging_ctx = self.kv_mgr._staging_ctx
        if staging_ctx is not None:
            staging_ctx.prefetched_rooms.discard(self.bootstrap_room)
            for key in list(staging_ctx.prefetch_requested):
                if key[0] == self.bootstrap_room:
                    staging_ctx.prefetch_requested.discard(key)
        if notification is not None:
            endpoint, failed = notification
            self.kv_mgr.send_kv_status_message(
                targets=[endpoint],
                bootstrap_room=self.bootstrap_room,
                status=KVPoll.Failed if failed else KVPoll.Success,
                failure_reason="Prefill bootstrap failed" if failed else None,
            )

    def failure_exception(self):
        self.conclude_state = KVPoll.Failed
        self.clear()
        with self.kv_mgr.failure_lock:
            failure_reason = self.kv_mgr.failure_records.pop(self.bootstrap_room, None)
        self.trace_ctx.trace_req_finish()
        raise KVTransferError(
            self.bootstrap_room,
            failure_reason or "Failed due to an unknown reason from another rank",
            is_from_another_rank=failure_reason is None,
        )

    def abort(self):
        if self.kv_mgr.deferred_bootstrap is not None and not self._owns_bootstrap_room:
            return
        self.kv_mgr.record_failure(
            self.bootstrap_room,
            "Aborted by AbortReq.",
        )
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        self.conclude_state = KVPoll.Failed
        self.trace_ctx.abort(abort_info={"reason": "Aborted"})
        self.trace_ctx.trace_req_finish()


class CommonKVReceiver(BaseKVReceiver):
    _prefill_wait_start: Optional[float] = None
    # init()'s pending setup_bootstrap_routes(): poll() goes on once it ended.
    _route_setup: Optional[concurrent.futures.Future] = None
    _route_setup_at: float = 0.0
    _route_queued_at: float = 0.0
    _owns_bootstrap_room: bool = True
    _lifecycle_lock = nullcontext()

    _ctx = zmq.Context()
    _ctx.set(zmq.MAX_SOCKETS, envs.SGLANG_DISAGGREGATION_ZMQ_MAX_SOCKETS.get())
    _socket_cache = {}
    _socket_locks = {}
    _global_lock = threading.Lock()

    def __init__(
        self,
        mgr: CommonKVManager,
        bootstrap_addr: str,
        bootstrap_room: Optional[int] = None,
    ):
        self.bootstrap_room = bootstrap_room
        self.bootstrap_addr = bootstrap_addr
        self.kv_mgr = mgr
        if mgr.defer_decode_allocation:
            self._lifecycle_lock = threading.RLock()
        self.conclude_state: Optional[KVPoll] = None
        self.require_staging: bool = False
        self.init_time: Optional[float] = None
        self._prefill_wait_start: Optional[float] = None
        self.abort_notified: bool = False
        self._abort_generation: Optional[int] = None
        self._connection_pool_entries: Dict[str, List[Dict]] = {}
        self._owns_bootstrap_room = not (
            mgr.defer_decode_allocation and bootstrap_room in mgr.request_status
        )
        if not self._owns_bootstrap_room:
            mgr.record_failure(bootstrap_room, "Duplicate decode bootstrap room")
            mgr.update_status(bootstrap_room, KVPoll.Failed)
            self.conclude_state = KVPoll.Failed
            return
        self.kv_mgr.addr_to_rooms_tracker[self.bootstrap_addr].add(self.bootstrap_room)
        self.kv_mgr.prefill_response_tracker.setdefault(self.bootstrap_room, set())
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Bootstrapping)

    def init(self, prefill_dp_rank: int):
        if self.conclude_state == KVPoll.Failed:
            return
        if self.bootstrap_addr not in self.kv_mgr.prefill_info_table:
            self.kv_mgr.record_failure(
                self.bootstrap_room,
                f"Prefill server with bootstrap_addr: {self.bootstrap_addr} is healthy before, but now it is down. Request (bootstrap_room: {self.bootstrap_room}) has been marked as failed.",
            )
            self.conclude_state = KVPoll.Failed
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            return

        # Read pre-computed rank mapping from prefill_info (computed in try_ensure_parallel_info)
        self.prefill_info = self.kv_mgr.prefill_info_table[self.bootstrap_addr]
        info = self.prefill_info
        policy = get_disagg().disaggregation_decode_allocation_policy
        reason = None
        if info.decode_allocation_policy != policy:
            reason = (
                "Disaggregation decode allocation policy mismatch: "
                f"prefill={info.decode_allocation_policy}, decode={policy}. "
                "Set --disaggregation-decode-allocation-policy identically on both roles."
            )
        elif policy == "prefill_complete" and (
            info.attn_tp_size != 1 or info.attn_cp_size != 1 or info.pp_size != 1
        ):
            reason = "prefill_complete requires peer attention TP1/CP1/PP1"
        if reason is not None:
            self.kv_mgr.record_failure(self.bootstrap_room, reason)
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            self.conclude_state = KVPoll.Failed
            return
        self.target_tp_rank = self.prefill_info.target_tp_rank
        self.target_tp_ranks = self.prefill_info.target_tp_ranks
        self.target_cp_ranks = self.prefill_info.target_cp_ranks
        self.target_pp_ranks = self.prefill_info.target_pp_ranks
        self.required_dst_info_num = self.prefill_info.required_dst_info_num
        self.required_prefill_response_num = (
            self.prefill_info.required_prefill_response_num
        )

        self.kv_mgr.required_prefill_response_num_table[self.bootstrap_room] = (
            self.required_prefill_response_num
        )

        if self.kv_mgr.enable_staging:
            self.require_staging = (
                self.prefill_info.attn_tp_size != 0
                and self.prefill_info.attn_tp_size != self.kv_mgr.attn_tp_size
            )

        self.prefill_dp_rank = prefill_dp_rank
        if not self._bootstrap_infos_cached():
            # A connection_pool miss asks the prefill for each rank: off this thread.
            self._route_setup = self.kv_mgr.setup_bootstrap_routes(self)
            self._route_setup_at = self._route_queued_at = time.monotonic()
            return
        self._setup_bootstrap_infos()
        if self.conclude_state == KVPoll.Failed:
            return
        if policy == "early":
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.WaitingForInput)
            return
        self._prefill_wait_start = time.time()
        try:
            for info in self.bootstrap_infos:
                sock, lock = self._connect_to_bootstrap_server(info)
                with lock:
                    # Never waits: see _send_bootstrap_message.
                    sock.send_multipart(
                        [
                            b"BOOTSTRAP",
                            str(self.bootstrap_room).encode("ascii"),
                            self.kv_mgr.local_ip.encode("ascii"),
                            str(self.kv_mgr.rank_port).encode("ascii"),
                        ],
                        flags=zmq.NOBLOCK,
                    )
        except zmq.ZMQError:
            self.abort()

    def poll(self) -> KVPoll:
        with self._lifecycle_lock:
            return self._poll()

    def _poll(self) -> KVPoll:
        if self.conclude_state is not None:
            return self.conclude_state
        if (
            self._route_setup is not None
            # A failure meanwhile (the heartbeat's) is reported at once.
            and self.kv_mgr.check_status(self.bootstrap_room) != KVPoll.Failed
            and not self._resume_init()
        ):
            return KVPoll.Bootstrapping
        status = self.kv_mgr.check_status(self.bootstrap_room)
        if status in (KVPoll.Success, KVPoll.Failed):
            self.conclude_state = status
        elif status == KVPoll.Bootstrapping and self._prefill_wait_start is not None:
            if time.time() - self._prefill_wait_start >= self.kv_mgr.waiting_timeout:
                self.abort()
                self.kv_mgr.record_failure(
                    self.bootstrap_room, "Timed out waiting for prefill completion"
                )
                return KVPoll.Failed
        elif status == KVPoll.WaitingForInput:
            # Observe readiness before evaluating the old compute deadline.
            # send_metadata starts the transfer timeout using this same clock.
            if self._prefill_wait_start is not None:
                self._prefill_wait_start = None
                self.init_time = time.time()
            timeout = self._check_waiting_timeout()
            if timeout is not None:
                return timeout
        return status

    def _bootstrap_infos_cached(self) -> bool:
        with self.kv_mgr.connection_lock:
            return all(
                f"{self.bootstrap_addr}_{self.prefill_dp_rank}_{target_cp_rank}_{self.target_tp_rank}"
                in self.kv_mgr.connection_pool
                for target_cp_rank in self.target_cp_ranks
            )

    def _resume_init(self) -> bool:
        """Go on with init() once its route setup has ended; False while it
        runs. Never waits: a setup that outlives every lookup's bound (a peer
        that trickles) fails the request."""
        setup = self._route_setup
        # Queued, its lookups' bound starts when they do (within the timeout).
        waited = time.monotonic() - self._route_queued_at
        waiting_timeout = envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get()
        if not setup.running() and waited < waiting_timeout:
            self._route_setup_at = time.monotonic()
        cp, tp, pp = self.target_cp_ranks, self.target_tp_ranks, self.target_pp_ranks
        bound = BOOTSTRAP_QUERY_TIMEOUT_S * max(1, len(cp) * len(tp) * len(pp))
        if setup.done():
            cached = not setup.cancelled() and setup.result()
            reason = (
                f"Could not fetch the bootstrap info of prefill {self.bootstrap_addr} "
                f"(prefill_dp_rank {self.prefill_dp_rank}); the decode log has the "
                f"error of each lookup."
            )
        elif time.monotonic() - self._route_setup_at < bound:
            return False
        else:
            cached = False
            reason = (
                f"The bootstrap info lookups to prefill {self.bootstrap_addr} have "
                f"not ended {bound} s after they started, or could not start within "
                f"SGLANG_DISAGGREGATION_WAITING_TIMEOUT: check its bootstrap server "
                f"and the network to it."
            )
        self._route_setup = None
        if cached:
            self.init(self.prefill_dp_rank)
        elif self.kv_mgr.request_status.get(self.bootstrap_room) != KVPoll.Failed:
            # Not if it failed meanwhile: that cause is the one to keep.
            self.kv_mgr.record_failure(self.bootstrap_room, reason)
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        return True

    def _setup_bootstrap_infos(self):
        all_bootstrap_infos = []
        # NOTE: key distinguished by bootstrap_addr, prefill_dp_rank, prefill_cp_rank, and target_tp_rank
        for target_cp_rank in self.target_cp_ranks:
            bootstrap_key = f"{self.bootstrap_addr}_{self.prefill_dp_rank}_{target_cp_rank}_{self.target_tp_rank}"

            with self.kv_mgr.connection_lock:
                cached_bootstrap_infos = self.kv_mgr.connection_pool.get(bootstrap_key)

            if cached_bootstrap_infos is None:
                bootstrap_infos = []
                for target_tp_rank in self.target_tp_ranks:
                    # Enable higher PP ranks to be bootstrapped earlier to make PP PD requests bootstrap more robust
                    for target_pp_rank in reversed(self.target_pp_ranks):
                        bootstrap_info = self._get_bootstrap_info_from_server(
                            self.prefill_dp_rank,
                            target_cp_rank,
                            target_tp_rank,
                            target_pp_rank,
                        )
                        if bootstrap_info is not None:
                            if self.kv_mgr.is_mla_backend:
                                # For MLA: target_tp_rank is the selected real rank, others are dummy ranks
                                bootstrap_info["is_dummy"] = not bool(
                                    target_tp_rank == self.target_tp_rank
                                    or self.target_tp_rank is None
                                )
                            else:
                                # For non-MLA: all target_tp_ranks are selected real ranks
                                bootstrap_info["is_dummy"] = False
                            logger.debug(
                                f"Fetched bootstrap info: {bootstrap_info} for DP {self.prefill_dp_rank} CP {target_cp_rank} TP {target_tp_rank} PP {target_pp_rank}"
                            )
                            bootstrap_infos.append(bootstrap_info)
                        else:
                            self.kv_mgr.record_failure(
                                self.bootstrap_room,
                                f"Could not fetch bootstrap info for: prefill_dp_rank: {self.prefill_dp_rank} prefill_cp_rank: {target_cp_rank} target_tp_rank: {target_tp_rank} and target_pp_rank {target_pp_rank}",
                            )
                            self.conclude_state = KVPoll.Failed
                            self.kv_mgr.update_status(
                                self.bootstrap_room, KVPoll.Failed
                            )
                            self.bootstrap_infos = None
                            self.invalidate_cached_bootstrap_infos()
                            return

                self.bootstrap_infos = bootstrap_infos
                self._connection_pool_entries[bootstrap_key] = self.bootstrap_infos

                # Register kv_args only once to prefill KVManager according to the info fetched
                # from the bootstrap server. Do this before caching in connection_pool so a failed
                # registration does not leave a stale entry that later requests would reuse.
                if not self._register_kv_args():
                    self.invalidate_cached_bootstrap_infos()
                    return

                with self.kv_mgr.connection_lock:
                    cached_bootstrap_infos = self.kv_mgr.connection_pool.setdefault(
                        bootstrap_key, self.bootstrap_infos
                    )

                if cached_bootstrap_infos is not self.bootstrap_infos:
                    self.bootstrap_infos = cached_bootstrap_infos
            else:
                self.bootstrap_infos = cached_bootstrap_infos

            self._connection_pool_entries[bootstrap_key] = self.bootstrap_infos

            assert len(self.bootstrap_infos) > 0
            all_bootstrap_infos.extend(self.bootstrap_infos)

        self.bootstrap_infos = all_bootstrap_infos

    def invalidate_cached_bootstrap_infos(self) -> None:
        with self.kv_mgr.connection_lock:
            for bootstrap_key, bootstrap_infos in self._connection_pool_entries.items():
                if self.kv_mgr.connection_pool.get(bootstrap_key) is bootstrap_infos:
                    del self.kv_mgr.connection_pool[bootstrap_key]
            self._connection_pool_entries.clear()

    def _get_bootstrap_info_from_server(
        self, prefill_dp_rank, prefill_cp_rank, target_tp_rank, target_pp_rank
    ):
        """Fetch the bootstrap info from the bootstrap server."""
        try:
            url = f"http://{self.bootstrap_addr}/route?prefill_dp_rank={prefill_dp_rank}&prefill_cp_rank={prefill_cp_rank}&target_tp_rank={target_tp_rank}&target_pp_rank={target_pp_rank}"
            response = _get_bootstrap_session(self.bootstrap_addr).get(url, timeout=5)
            if response.status_code == 200:
                bootstrap_info = response.json()
                # Checked here: init() would raise on the scheduler thread.
                if not _is_prefill_rank_info(bootstrap_info):
                    logger.error(
                        f"Malformed bootstrap info from {self.bootstrap_addr}: "
                        f"{response.text[:200]}"
                    )
                    return None
                bootstrap_info["pp_rank"] = int(target_pp_rank)
                return bootstrap_info
            else:
                logger.error(
                    f"Failed to get prefill server info: {response.status_code}, {response.text}"
                )
                return None
        except Exception as e:
            logger.error(f"Error fetching prefill info from bootstrap: {e}")
            return None

    @staticmethod
    def query_prefill_dp_ranks(
        bootstrap_addr: str, bootstrap_rooms: List[int]
    ) -> Dict[str, int]:
        """Batch query prefill dp_ranks for given bootstrap_rooms."""
        try:
            url = f"http://{bootstrap_addr}/query_dp_ranks"
            response = _get_bootstrap_session(bootstrap_addr).post(
                url,
                json={"bootstrap_rooms": bootstrap_rooms},
                timeout=5,
            )
            if response.status_code == 200:
                room_to_rank = response.json()
                # Read on the scheduler thread: a malformed answer must not raise.
                if isinstance(room_to_rank, dict) and all(
                    isinstance(rank, int) for rank in room_to_rank.values()
                ):
                    return room_to_rank
                logger.error(
                    f"Malformed dp_ranks answer from {bootstrap_addr}: "
                    f"{response.text[:200]}"
                )
                return {}
            else:
                logger.error(
                    f"Failed to query dp_ranks: {response.status_code}, {response.text}"
                )
                return {}
        except Exception as e:
            logger.error(f"Error querying dp_ranks from bootstrap: {e}")
            return {}

    @classmethod
    def _connect(cls, endpoint: str, is_ipv6: bool = False):
        with cls._global_lock:
            if endpoint not in cls._socket_cache:
                sock = cls._ctx.socket(zmq.PUSH)
                if is_ipv6:
                    sock.setsockopt(zmq.IPV6, 1)
                sock.setsockopt(zmq.LINGER, 0)
                # Bound send so a dead peer cannot block the scheduler forever.
                sock.setsockopt(
                    zmq.SNDTIMEO,
                    envs.SGLANG_DISAGGREGATION_ZMQ_SEND_TIMEOUT.get() * 1000,
                )
                sock.connect(endpoint)
                cls._socket_cache[endpoint] = sock
                cls._socket_locks[endpoint] = threading.Lock()
            return cls._socket_cache[endpoint], cls._socket_locks[endpoint]

    @classmethod
    def disconnect_endpoint(cls, endpoint: str):
        with cls._global_lock:
            sock = cls._socket_cache.pop(endpoint, None)
            lock = cls._socket_locks.pop(endpoint, None)
        if sock:
            if lock:
                with lock:
                    sock.close()
            else:
                sock.close()
            logger.debug(f"Disconnected stale ZMQ PUSH socket (receiver): {endpoint}")

    @classmethod
    def close_all_sockets(cls):
        """Close all cached PUSH sockets on role switch, keeping ``_ctx`` reusable."""
        with cls._global_lock:
            entries = list(cls._socket_cache.items())
            locks = cls._socket_locks.copy()
            cls._socket_cache.clear()
            cls._socket_locks.clear()

        # Close outside _global_lock: _connect drops it before the per-endpoint lock.
        for endpoint, sock in entries:
            lock = locks.get(endpoint)
            try:
                if lock:
                    with lock:
                        sock.close(linger=0)
                else:
                    sock.close(linger=0)
            except Exception:
                logger.exception(
                    f"Failed to close ZMQ PUSH socket (receiver): {endpoint}"
                )
        if entries:
            logger.debug(f"Closed {len(entries)} receiver ZMQ PUSH socket(s)")

    @classmethod
    def _connect_to_bootstrap_server(cls, bootstrap_info: dict):
        ip_address = bootstrap_info["rank_ip"]
        port = bootstrap_info["rank_port"]
        na = NetworkAddress(ip_address, port)
        sock, lock = cls._connect(na.to_tcp(), is_ipv6=na.is_ipv6)
        return sock, lock

    def _register_kv_args(self) -> bool:
        if self.bootstrap_infos is None:
            return False
        if not self.bootstrap_infos:
            return True

        message = self.kv_mgr.build_receiver_registration_message()
        for bootstrap_info in self.bootstrap_infos:
            if not self._send_bootstrap_message(
                bootstrap_info=bootstrap_info,
                message=message,
                operation="_register_kv_args",
            ):
                return False
        return True

    def _send_bootstrap_message(
        self,
        *,
        bootstrap_info: dict,
        message: List[bytes],
        operation: Literal["_register_kv_args", "send_metadata"],
    ) -> bool:
        try:
            sock, lock = self._connect_to_bootstrap_server(bootstrap_info)
            with lock:
                # Never waits: a send blocks only once the socket holds
                # SNDHWM messages the prefill has not read, i.e. it is stuck,
                # and then up to SNDTIMEO on the scheduler thread.
                sock.send_multipart(message, flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self.kv_mgr.record_failure(
                self.bootstrap_room,
                f"{operation} to prefill {bootstrap_info.get('rank_ip')}:{bootstrap_info.get('rank_port')} failed"
                + (
                    ": it does not read what this decode sends (its queue is full)"
                    if isinstance(e, zmq.Again)
                    else f": {e}"
                ),
            )
            self.conclude_state = KVPoll.Failed
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            return False
        return True

    def send_metadata(
        self,
        kv_indices: npt.NDArray[np.int32],
        aux_index: Optional[int] = None,
        state_indices: Optional[List] = None,
        decode_prefix_len: Optional[int] = None,
        destination: KVTransferDestination = KVTransferDestination.DEVICE,
        device_kv_indices: Optional[npt.NDArray[np.int32]] = None,
    ):
        if self.bootstrap_infos is None:
            self.kv_mgr.record_failure(
                self.bootstrap_room,
                f"Could not fetch prefill parallel info from bootstrap_addr: {self.bootstrap_addr}",
            )
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            return
        if destination != KVTransferDestination.DEVICE:
            raise NotImplementedError("Host KV destinations are not supported")

        self.chunk_staging_infos = []
        if (
            self.kv_mgr.enable_staging
            and self.kv_mgr._staging_ctx.allocator is not None
        ):
            self.kv_mgr.register_staging_room_bootstrap(
                self.bootstrap_room, self.bootstrap_infos, self
            )

        for bootstrap_info in self.bootstrap_infos:
            message = self.kv_mgr.build_receiver_metadata_message(
                bootstrap_room=self.bootstrap_room,
                required_dst_info_num=self.required_dst_info_num,
                kv_indices=kv_indices,
                aux_index=aux_index,
                state_indices=state_indices,
                decode_prefix_len=decode_prefix_len,
                is_dummy=bootstrap_info["is_dummy"],
                device_kv_indices=device_kv_indices,
            )
            if not self._send_bootstrap_message(
                bootstrap_info=bootstrap_info,
                message=message,
                operation="send_metadata",
            ):
                self.invalidate_cached_bootstrap_infos()
                return

        self.init_time = time.time()

    def _check_waiting_timeout(self) -> Optional[KVPoll]:
        if self.init_time is None:
            return None
        elapsed = time.time() - self.init_time
        if elapsed < self.kv_mgr.waiting_timeout:
            return None
        logger.warning_once(
            "Some requests fail to receive KV Cache transfer done signal after bootstrapping. "
            "If a greater mean TTFT is acceptable, you can 'export SGLANG_DISAGGREGATION_WAITING_TIMEOUT=600' (10 minutes) to relax the timeout condition. "
        )
        self.kv_mgr.record_failure(
            self.bootstrap_room,
            f"Request {self.bootstrap_room} timed out after {elapsed:.1f}s "
            f"in KVPoll.WaitingForInput for prefill "
            f"{getattr(self, 'bootstrap_addr', None)}",
        )
        self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
        self.invalidate_cached_bootstrap_infos()
        if (
            not self.abort_notified
            and hasattr(self, "bootstrap_infos")
            and self.bootstrap_infos is not None
        ):
            self._send_abort_notification()
            self.abort_notified = True
        return KVPoll.Failed

    def clear(self) -> None:
        with self._lifecycle_lock:
            self._clear()

    def _clear(self) -> None:
        if not self._owns_bootstrap_room:
            return
        if (
            self.kv_mgr.defer_decode_allocation
            and self.kv_mgr.request_status.get(self.bootstrap_room) != KVPoll.Success
            and not self.abort_notified
            and getattr(self, "bootstrap_infos", None) is not None
        ):
            # Preserve the recorded root cause; this is cleanup, not a new abort.
            self._send_abort_notification()
            self.abort_notified = True
        if self.conclude_state is None:
            status = self.kv_mgr.request_status.get(self.bootstrap_room)
            self.conclude_state = (
                status if status in (KVPoll.Success, KVPoll.Failed) else KVPoll.Failed
            )
        self.kv_mgr.request_status.pop(self.bootstrap_room, None)
        self.kv_mgr.required_prefill_response_num_table.pop(self.bootstrap_room, None)
        self.kv_mgr.prefill_response_tracker.pop(self.bootstrap_room, None)
        self.kv_mgr.addr_to_rooms_tracker[self.bootstrap_addr].discard(
            self.bootstrap_room
        )
        # A failure recorded for this room and never read (an abort) goes with it.
        with self.kv_mgr.failure_lock:
            self.kv_mgr.failure_records.pop(self.bootstrap_room, None)
        if self.kv_mgr.defer_decode_allocation:
            self._owns_bootstrap_room = False

    def failure_exception(self):
        self.conclude_state = KVPoll.Failed
        with self.kv_mgr.failure_lock:
            failure_reason = self.kv_mgr.failure_records.pop(self.bootstrap_room, None)
        self.clear()
        raise KVTransferError(
            self.bootstrap_room,
            failure_reason or "Failed due to an unknown reason from another rank",
            is_from_another_rank=failure_reason is None,
        )

    def abort(self):
        if not self._owns_bootstrap_room:
            self.conclude_state = KVPoll.Failed
            return
        if self.conclude_state != KVPoll.Failed:
            self.kv_mgr.record_failure(self.bootstrap_room, "Aborted by AbortReq.")
            self.kv_mgr.update_status(self.bootstrap_room, KVPoll.Failed)
            self.conclude_state = KVPoll.Failed
        self.ensure_abort_notified()

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """Notify the prefill ranks (and arm drain-ack accounting) exactly once.
        Unlike abort(), does not overwrite the recorded root cause -- callable
        for an already-Failed room whose failure decode did not initiate."""
        if (
            not self.abort_notified
            and hasattr(self, "bootstrap_infos")
            and self.bootstrap_infos is not None
        ):
            self._send_abort_notification(force_arm=force_arm)
            self.abort_notified = True

    def _send_abort_notification(self, *, force_arm: bool = False):
        # Both abort() and the waiting timeout reach here. Once metadata is
        # published (init_time set) prefill may be writing, so arm the ACK
        # tracker before the ABORT goes out and an immediate ACK can land.
        # Prealloc-queue receivers (init_time None) never enter the
        # deferred-release flow that would clean the tracker up, so they stay
        # unarmed -- except on a partial publish, where init_time is still None
        # but earlier ranks already hold destinations; those callers defer and
        # pass force_arm.
        # force_arm with deferred release off too: decode.py's fences.
        if force_arm or (
            self.kv_mgr.enable_deferred_decode_kv_release and self.init_time is not None
        ):
            self._abort_generation = self.kv_mgr.register_deferred_abort_room(
                self.bootstrap_room
            )
        for bootstrap_info in self.bootstrap_infos:
            # Best-effort notification to prefill side that this request was aborted.
            try:
                sock, lock = self._connect_to_bootstrap_server(bootstrap_info)
                with lock:
                    # Never waits: see _send_bootstrap_message.
                    sock.send_multipart(
                        AbortNotification(
                            room=self.bootstrap_room,
                            decode_ip=self.kv_mgr.local_ip,
                            decode_port=self.kv_mgr.rank_port,
                            generation=self._abort_generation,
                        ).to_zmq(),
                        flags=zmq.NOBLOCK,
                    )
                logger.debug(
                    f"Sent abort notification for room {self.bootstrap_room} "
                    f"to {bootstrap_info.get('rank_ip', 'unknown')}:{bootstrap_info.get('rank_port', 'unknown')}"
                )
            except Exception as e:
                logger.debug(
                    f"Failed to send abort notification for room {self.bootstrap_room}: {e}"
                )


class CommonKVBootstrapServer(BaseKVBootstrapServer):
    def __init__(self, host: str, port: int):
        self.host = host
        self.port = port
        self.app = web.Application()
        self.store = dict()
        self.lock = asyncio.Lock()
        # The event loop only keeps weak references to tasks, so a long-lived
        # task needs a strong reference to survive garbage collection.
        self._background_tasks: Set[asyncio.Task] = set()
        self._setup_routes()
        self.pp_size = None
        self.attn_tp_size = None
        self.attn_cp_size = None
        self.dp_size = None
        self.page_size = None
        self.kv_cache_dtype: Optional[str] = None
        self.kv_layout: Optional[str] = None
        self.dsv41_spec_layout: Optional[dict] = None
        self.follow_bootstrap_room: Optional[bool] = None
        self.enable_dsa_cache_layer_split: Optional[bool] = None
        self.enable_kv_cache_sharding: Optional[bool] = None
        self.prefill_http_port: Optional[int] = None
        self.decode_allocation_policy = "early"
        self.prefill_port_table: Dict[
            int, Dict[int, Dict[int, Dict[int, PrefillRankInfo]]]
        ] = {}
        self.room_to_dp_rank: Dict[int, Dict[str, Union[int, float]]] = {}
        self._registered_count = 0
        self.entry_cleanup_interval = (
            envs.SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL.get()
        )

        # Start bootstrap server
        self.thread = threading.Thread(target=self._run_server, daemon=True)
        self.run()

    def run(self):
        self.thread.start()

    def _is_ready(self) -> bool:
        if (
            self.attn_tp_size is None
            or self.attn_cp_size is None
            or self.pp_size is None
            or self.dp_size is None
        ):
            return False
        expected = self.dp_size * self.attn_cp_size * self.attn_tp_size * self.pp_size
        logger.debug(
            f"Expected {expected} prefill servers to be registered, {self._registered_count} registered so far"
        )
        return self._registered_count >= expected

    def _setup_routes(self):
        self.app.router.add_route("*", "/route", self._handle_route)
        self.app.router.add_post("/register_dp_rank", self._handle_register_dp_rank)
        self.app.router.add_post("/query_dp_ranks", self._handle_query_dp_ranks)
        self.app.router.add_get("/health", self._handle_health_check)

    async def _handle_health_check(self, request):
        return web.Response(text="OK", status=200)

    async def _handle_route(self, request: web.Request):
        method = request.method
        if method == "PUT":
            return await self._handle_route_put(request)
        elif method == "GET":
            return await self._handle_route_get(request)
        else:
            return web.Response(
                text="Method not allowed", status=405, content_type="application/json"
            )

    async def _handle_route_put(self, request: web.Request):
        data = await request.json()
        attn_tp_size = data["attn_tp_size"]
        attn_tp_rank = data["attn_tp_rank"]
        attn_cp_size = data["attn_cp_size"]
        attn_cp_rank = data["attn_cp_rank"]
        attn_dp_size = data["attn_dp_size"]
        attn_dp_rank = data["attn_dp_rank"]
        pp_size = data["pp_size"]
        pp_rank = data["pp_rank"]
        system_dp_size = data["system_dp_size"]
        system_dp_rank = data["system_dp_rank"]
        rank_ip = data["rank_ip"]
        rank_port = int(data["rank_port"])
        page_size = int(data["page_size"])
        kv_cache_dtype = data["kv_cache_dtype"]
        kv_layout = data.get("kv_layout")
        prefill_http_port = data.get("prefill_http_port")
        dsv41_spec_layout = data.get("dsv41_spec_layout")

        if self._registered_count and self.dsv41_spec_layout != dsv41_spec_layout:
            return web.Response(
                text="DeepSeek-V4.1 DSpark PD layout differs across prefill ranks",
                status=400,
            )
        policy = data.get("decode_allocation_policy", "early")
        if self._registered_count and self.decode_allocation_policy != policy:
            return web.Response(
                text="Inconsistent prefill allocation policies", status=400
            )
        self.dsv41_spec_layout = dsv41_spec_layout
        self.decode_allocation_policy = policy

        if self.attn_tp_size is None:
            self.attn_tp_size = attn_tp_size

        if self.attn_cp_size is None:
            self.attn_cp_size = attn_cp_size

        if self.dp_size is None:
            self.dp_size = attn_dp_size if system_dp_size == 1 else system_dp_size

        if self.pp_size is None:
            self.pp_size = pp_size

        if self.page_size is None and page_size is not None:
            self.page_size = page_size

        if self.kv_cache_dtype is None and kv_cache_dtype is not None:
            self.kv_cache_dtype = kv_cache_dtype

        if self.kv_layout is None and kv_layout is not None:
            self.kv_layout = kv_layout

        if self.prefill_http_port is None and prefill_http_port is not None:
            self.prefill_http_port = int(prefill_http_port)

        if self.follow_bootstrap_room is None:
            load_balance_method = data.get(
                "load_balance_method", "follow_bootstrap_room"
            )
            self.follow_bootstrap_room = load_balance_method == "follow_bootstrap_room"

        if self.enable_dsa_cache_layer_split is None:
            self.enable_dsa_cache_layer_split = bool(
                data.get("enable_dsa_cache_layer_split", False)
            )

        if self.enable_kv_cache_sharding is None:
            self.enable_kv_cache_sharding = bool(
                data.get("enable_kv_cache_sharding", False)
            )

        if system_dp_size == 1:
            dp_group = attn_dp_rank
        else:
            dp_group = system_dp_rank

        # Add lock to make sure thread-safe
        async with self.lock:
            dp_group_table = self.prefill_port_table.setdefault(dp_group, {})
            cp_group_table = dp_group_table.setdefault(attn_cp_rank, {})
            tp_group_table = cp_group_table.setdefault(attn_tp_rank, {})

            tp_group_table[pp_rank] = PrefillRankInfo(
                rank_ip=rank_ip,
                rank_port=rank_port,
            )

            self._registered_count += 1

        expected = self.dp_size * self.attn_cp_size * self.attn_tp_size * self.pp_size
        logger.debug(
            f"Register prefill bootstrap: DP{dp_group} CP{attn_cp_rank} TP{attn_tp_rank} PP{pp_rank} with rank_ip: {rank_ip} and rank_port: {rank_port}"
            f" ({self._registered_count}/{expected} registered)"
        )

        return web.Response(text="OK", status=200)

    async def _handle_route_get(self, request: web.Request):
        prefill_dp_rank = request.query.get("prefill_dp_rank")
        prefill_cp_rank = request.query.get("prefill_cp_rank")
        target_tp_rank = request.query.get("target_tp_rank")
        target_pp_rank = request.query.get("target_pp_rank")
        if (
            not prefill_dp_rank
            or not prefill_cp_rank
            or not target_tp_rank
            or not target_pp_rank
        ):
            return web.Response(text="Missing inputs for bootstrap server.", status=400)

        if (
            int(prefill_dp_rank) == -1
            and int(prefill_cp_rank) == -1
            and int(target_tp_rank) == -1
            and int(target_pp_rank) == -1
        ):
            if not self._is_ready():
                return web.Response(
                    text=f"Prefill server not fully registered yet"
                    f" ({self._registered_count} workers registered).",
                    status=503,
                )
            info = PrefillServerInfo(
                attn_tp_size=self.attn_tp_size,
                attn_cp_size=self.attn_cp_size,
                dp_size=self.dp_size,
                pp_size=self.pp_size,
                page_size=self.page_size,
                kv_cache_dtype=self.kv_cache_dtype,
                kv_layout=self.kv_layout,
                dsv41_spec_layout=self.dsv41_spec_layout,
                follow_bootstrap_room=(
                    self.follow_bootstrap_room
                    if self.follow_bootstrap_room is not None
                    else True
                ),
                enable_dsa_cache_layer_split=bool(self.enable_dsa_cache_layer_split),
                enable_kv_cache_sharding=bool(self.enable_kv_cache_sharding),
                prefill_http_port=self.prefill_http_port,
                decode_allocation_policy=self.decode_allocation_policy,
            )
            payload = dataclasses.asdict(info)
            if info.dsv41_spec_layout is None:
                payload.pop("dsv41_spec_layout")
            if info.kv_layout is None:
                payload.pop("kv_layout")
            return web.json_response(payload, status=200)

        if not self._is_ready():
            return web.Response(
                text=f"Prefill server not fully registered yet"
                f" ({self._registered_count} workers registered).",
                status=503,
            )

        # Find corresponding prefill info
        try:
            async with self.lock:
                bootstrap_info = self.prefill_port_table[int(prefill_dp_rank)][
                    int(prefill_cp_rank)
                ][int(target_tp_rank)][int(target_pp_rank)]
        except KeyError:
            return web.Response(
                text=f"Bootstrap info not found for dp_rank={prefill_dp_rank} cp_rank={prefill_cp_rank} "
                f"tp_rank={target_tp_rank} pp_rank={target_pp_rank}",
                status=404,
            )

        return web.json_response(dataclasses.asdict(bootstrap_info), status=200)

    async def _handle_register_dp_rank(self, request: web.Request):
        data = await request.json()
        bootstrap_room = int(data["bootstrap_room"])
        dp_rank = int(data["dp_rank"])
        async with self.lock:
            self.room_to_dp_rank[bootstrap_room] = {
                "dp_rank": dp_rank,
                "timestamp": time.time(),
            }
        logger.debug(f"Registered dp_rank={dp_rank} for {bootstrap_room=}")
        return web.Response(text="OK", status=200)

    async def _handle_query_dp_ranks(self, request: web.Request):
        data = await request.json()
        bootstrap_rooms = data["bootstrap_rooms"]
        result = {}
        async with self.lock:
            for room in bootstrap_rooms:
                room_int = int(room)
                if room_int in self.room_to_dp_rank:
                    result[str(room_int)] = self.room_to_dp_rank[room_int]["dp_rank"]
        return web.json_response(result, status=200)

    async def _cleanup_expired_entries(self):
        """Remove entries older than cleanup interval from room_to_dp_rank."""
        while True:
            await asyncio.sleep(self.entry_cleanup_interval)
            current_time = time.time()
            async with self.lock:
                expired_keys = [
                    key
                    for key, value in self.room_to_dp_rank.items()
                    if current_time - value["timestamp"] > self.entry_cleanup_interval
                ]
                for key in expired_keys:
                    del self.room_to_dp_rank[key]
            if expired_keys:
                logger.debug(
                    f"Cleaned up {len(expired_keys)} expired entries from room_to_dp_rank"
                )

    def _run_server(self):
        try:
            # Event Loop
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)

            cleanup_task = self._loop.create_task(self._cleanup_expired_entries())
            self._background_tasks.add(cleanup_task)
            cleanup_task.add_done_callback(self._background_tasks.discard)

            access_log = None
            if logging.getLogger(__name__).getEffectiveLevel() <= logging.DEBUG:
                access_log = self.app.logger

            self._runner = web.AppRunner(self.app, access_log=access_log)
            self._loop.run_until_complete(self._runner.setup())

            site = web.TCPSite(self._runner, host=self.host, port=self.port)
            self._loop.run_until_complete(site.start())
            logger.info(
                f"CommonKVBootstrapServer started successfully on {self.host}:{self.port}"
            )
            self._loop.run_forever()
        except Exception as e:
            logger.error(f"Server error: {str(e)}", exc_info=True)
        finally:
            # Cleanup
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

    def close(self):
        """Shutdown"""
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            logger.info("Stopping server loop...")

        if self.thread.is_alive():
            self.thread.join(timeout=2)
            logger.info("Server thread stopped")

    def poll(self) -> KVPoll: ...
