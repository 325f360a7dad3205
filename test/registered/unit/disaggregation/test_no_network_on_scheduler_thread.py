"""No code path of the decode scheduling cycle waits on a bootstrap server.

Besides the parallel-info fetch (test_parallel_info_nonblocking.py) and the
dp-rank query (test_prefill_dp_rank_query.py), ``CommonKVReceiver.init`` looked
the per-rank routes up inline on a ``connection_pool`` miss. Here: the
admission fast path and the route cache built the way sglang's own tests build
them, the background route setup, and one first contact end to end against a
fake bootstrap server on 127.0.0.1 with every HTTP request's thread recorded.
CPU-only, no sleeps: fetch threads are coordinated with ``threading.Event`` and
a barrier on the fetch pool (wait for every task it holds).
"""

import http.client
import json
import threading
import unittest
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor, wait
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from unittest import mock
from urllib.parse import parse_qs, urlparse

import urllib3
from sglang.srt.disaggregation import decode as decode_mod
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common import conn as conn_mod
from sglang.srt.disaggregation.common.conn import (
    CommonKVManager,
    CommonKVReceiver,
    KVTransferError,
    PrefillServerInfo,
)
from sglang.srt.disaggregation.decode import (
    DecodePreallocQueue,
    DecodeRequest,
    _bootstrap_addr,
)
from sglang.srt.environ import envs
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from test_parallel_info_nonblocking import (
    ADDR,
    PAGE_SIZE,
    PREFILL_INFO,
    FakeResponse,
    set_decode_config,
)

register_cpu_ci(est_time=15, suite="base-a-test-cpu")

_WAIT_S = 30
# Prefill dp_size 2 that does not follow the bootstrap room (so decode must
# query the dp rank), attention TP 2 against decode TP 1 (two routes each).
DP_TP_INFO = dict(PREFILL_INFO, dp_size=2, attn_tp_size=2, follow_bootstrap_room=False)


class TrackedExecutor(ThreadPoolExecutor):
    """The manager's executor, remembering every future it gave, so that
    drain() can wait for each call submitted so far (and any it submitted)."""

    def __init__(self, workers: int):
        super().__init__(max_workers=workers, thread_name_prefix="test-fetch")
        self.futures = []

    def submit(self, fn, /, *args, **kwargs):
        future = super().submit(fn, *args, **kwargs)
        self.futures.append(future)
        return future


def make_decode_manager(workers: int = 2) -> CommonKVManager:
    """A decode-mode CommonKVManager with the state the bootstrap path reads
    and a real executor of ``workers`` threads."""
    mgr = CommonKVManager.__new__(CommonKVManager)
    set_decode_config(
        mgr,
        kv_args=SimpleNamespace(page_size=PAGE_SIZE, state_types=[], engine_rank=0),
    )
    mgr.attn_cp_rank = 0
    mgr.pp_rank = 0
    mgr.enable_all_cp_ranks_for_transfer = False
    mgr.enable_staging = False
    mgr.defer_decode_allocation = False
    mgr.deferred_bootstrap = None
    mgr.connection_lock = threading.Lock()
    mgr.connection_pool = {}
    mgr.prefill_info_table = {}
    mgr.heartbeat_failures = {}
    mgr.failure_records = {}
    mgr.failure_lock = threading.Lock()
    mgr.request_status = {}
    mgr.required_prefill_response_num_table = {}
    mgr.prefill_response_tracker = {}
    mgr.addr_to_rooms_tracker = defaultdict(set)
    mgr._deferred_ack_targets = {}
    mgr._deferred_ack_poisoned_rooms = set()
    mgr._staging_outstanding = defaultdict(int)
    mgr._parallel_info_executor = TrackedExecutor(workers)
    mgr._prefill_recompute_executor = mgr._parallel_info_executor
    mgr._parallel_info_inflight = set()
    mgr._losses = defaultdict(int)
    mgr._parallel_info_fatal = None
    mgr._route_setups = {}
    mgr.session_pool = {}
    mgr.session_pool_lock = threading.Lock()
    return mgr


def fake_clock_and_manager(test: CustomTestCase, workers: int = 2):
    """A FakeClock standing for time in conn and decode, and a decode manager
    whose pool is shut down when ``test`` ends."""
    clock = FakeClock()
    for module in (conn_mod, decode_mod):
        patcher = mock.patch.object(module, "time", clock)
        patcher.start()
        test.addCleanup(patcher.stop)
    mgr = make_decode_manager(workers=workers)
    test.addCleanup(
        mgr._parallel_info_executor.shutdown, wait=False, cancel_futures=True
    )
    return clock, mgr


def drain(mgr: CommonKVManager) -> None:
    """Barrier: every fetch submitted so far, and any it submitted, ended."""
    while True:
        running = [f for f in mgr._parallel_info_executor.futures if not f.done()]
        if not running:
            return
        wait(running, timeout=_WAIT_S)


def cache_info(mgr: CommonKVManager, addr: str, info: dict = PREFILL_INFO):
    prefill_info = PrefillServerInfo(**info)
    mgr._resolve_rank_mapping(prefill_info)
    mgr.prefill_info_table[addr] = prefill_info
    return prefill_info


def make_queue(kv_manager, max_retries: int = 15) -> DecodePreallocQueue:
    queue = DecodePreallocQueue.__new__(DecodePreallocQueue)
    queue.kv_manager = kv_manager
    queue._prefill_dp_rank_queries = {}
    queue._ensure_retry_count = {}
    queue._max_ensure_retries = max_retries
    queue._ensure_last_attempt_time = {}
    queue._ensure_retry_interval = 1.0
    queue.queue = []
    queue.retracted_queue = []
    queue.pending_reqs = []
    return queue


def make_req(port: int, room: int):
    return SimpleNamespace(
        bootstrap_host="127.0.0.1",
        bootstrap_port=port,
        bootstrap_room=room,
        disagg_prefill_dp_rank=None,
    )


def route_port(dp_rank: int, tp_rank: int) -> int:
    return 20000 + 10 * dp_rank + tp_rank


class LocalHTTPServer(ThreadingHTTPServer):
    # The default backlog of 5 resets connections on a loaded host.
    request_queue_size = 128


class FakeBootstrapServer:
    """A prefill bootstrap server on 127.0.0.1 answering the three queries a
    decode makes: parallel info, per-rank route and dp ranks."""

    def __init__(self, info: dict, keep_alive: bool = False):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1" if keep_alive else "HTTP/1.0"

            def _answer(self, payload):
                body = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                query = {
                    k: int(v[0]) for k, v in parse_qs(urlparse(self.path).query).items()
                }
                if query["prefill_dp_rank"] == -1:
                    return self._answer(info)
                dp, tp = query["prefill_dp_rank"], query["target_tp_rank"]
                self._answer({"rank_ip": "127.0.0.1", "rank_port": route_port(dp, tp)})

            def do_POST(self):
                length = int(self.headers["Content-Length"])
                rooms = json.loads(self.rfile.read(length))["bootstrap_rooms"]
                self._answer({str(room): room % server.dp_size for room in rooms})

            def log_message(self, *args):
                pass

        self.dp_size = info["dp_size"]
        self.httpd = LocalHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(_WAIT_S)


class NetworkSentinel:
    """Records the thread of every HTTP request sent (requests sends through
    urllib3 and http.client) and of every TCP connect."""

    def __init__(self, test: CustomTestCase):
        self.threads = []
        for owner, name in (
            (http.client.HTTPConnection, "send"),
            (urllib3.connection.HTTPConnection, "connect"),
        ):
            original = getattr(owner, name)
            patcher = mock.patch.object(owner, name, self._wrap(original))
            patcher.start()
            test.addCleanup(patcher.stop)

    def _wrap(self, original):
        def recorded(conn, *args, **kwargs):
            self.threads.append(threading.current_thread())
            return original(conn, *args, **kwargs)

        return recorded


def patch_early_policy(test: CustomTestCase) -> None:
    disagg = SimpleNamespace(disaggregation_decode_allocation_policy="early")
    for module in (decode_mod, conn_mod):
        patcher = mock.patch.object(module, "get_disagg", return_value=disagg)
        patcher.start()
        test.addCleanup(patcher.stop)


class _Base(CustomTestCase):
    def setUp(self):
        super().setUp()
        patch_early_policy(self)
        # The ZMQ registration with the prefill ranks is out of scope here.
        patcher = mock.patch.object(
            CommonKVReceiver, "_register_kv_args", return_value=True
        )
        patcher.start()
        self.addCleanup(patcher.stop)
        self.mgr = make_decode_manager()
        self.addCleanup(
            self.mgr._parallel_info_executor.shutdown, wait=False, cancel_futures=True
        )
        self.queue = make_queue(self.mgr)

    def add(self, req) -> DecodeRequest:
        """DecodePreallocQueue.add() with the scheduler-owned pieces it does
        not exercise here (capacity check, receiver class lookup) replaced."""
        created = []

        def create(req, is_rebootstrap=False):
            receiver = CommonKVReceiver(
                self.mgr, _bootstrap_addr(req), req.bootstrap_room
            )
            created.append(DecodeRequest(req=req, kv_receiver=receiver))
            self.queue.queue.append(created[-1])
            return created[-1]

        with (
            mock.patch.object(decode_mod, "is_unadmitted_reject", return_value=False),
            mock.patch.object(
                self.queue, "_check_if_req_exceed_kv_capacity", return_value=False
            ),
            mock.patch.object(
                self.queue, "_create_receiver_and_enqueue", side_effect=create
            ),
        ):
            self.queue.add(req)
        return created[0]

    def cycle(self) -> None:
        """One scheduling cycle's bootstrap work, as the decode event loop
        does it, then let the fetches it started finish."""
        self.queue.prefetch_prefill_dp_rank_queries()
        self.queue._resolve_pending_reqs()
        for decode_req in self.queue.queue:
            decode_req.kv_receiver.poll()
        drain(self.mgr)
        # The next cycle may ask again: the retry interval has passed.
        for key in self.queue._ensure_last_attempt_time:
            self.queue._ensure_last_attempt_time[key] -= 1.0


class TestFirstContactEndToEnd(_Base):
    def test_parallel_info_dp_rank_and_routes_run_off_the_scheduler_thread(self):
        server = FakeBootstrapServer(DP_TP_INFO)
        self.addCleanup(server.stop)
        sentinel = NetworkSentinel(self)
        decode_reqs = [self.add(make_req(server.port, room)) for room in (10, 11)]
        self.assertEqual(len(self.queue.pending_reqs), 2)

        cycles = 0
        while cycles < 20 and any(
            r.kv_receiver.poll() != KVPoll.WaitingForInput for r in decode_reqs
        ):
            self.cycle()
            cycles += 1

        self.assertEqual(self.queue.pending_reqs, [])
        # Parallel info, dp ranks, routes: each needs a cycle of its own.
        self.assertGreaterEqual(cycles, 3)
        for decode_req in decode_reqs:
            receiver = decode_req.kv_receiver
            dp_rank = decode_req.req.bootstrap_room % 2
            self.assertEqual(receiver.poll(), KVPoll.WaitingForInput)
            self.assertEqual(receiver.prefill_dp_rank, dp_rank)
            self.assertEqual(
                [info["rank_port"] for info in receiver.bootstrap_infos],
                [route_port(dp_rank, 0), route_port(dp_rank, 1)],
            )
        self.assertGreater(len(sentinel.threads), 0)
        self.assertNotIn(threading.current_thread(), sentinel.threads)

    def test_warm_caches_admit_in_add_without_any_fetch(self):
        addr = "127.0.0.1:9"
        self.mgr._parallel_info_executor = mock.MagicMock()
        cache_info(self.mgr, addr)
        self.mgr.connection_pool[f"{addr}_0_0_0"] = [
            {"rank_ip": "127.0.0.1", "rank_port": 1, "pp_rank": 0, "is_dummy": False}
        ]

        decode_req = self.add(make_req(9, room=5))

        self.assertEqual(self.queue.pending_reqs, [])
        self.assertEqual(decode_req.kv_receiver.poll(), KVPoll.WaitingForInput)
        self.mgr._parallel_info_executor.submit.assert_not_called()


class TestAdmissionFastPath(CustomTestCase):
    """sglang's shape: the queue is a SimpleNamespace with no kv_manager at
    all, the real _init_receiver bound to it, then DecodePreallocQueue.add()."""

    def test_cache_hit_admits_without_touching_the_kv_manager(self):
        patch_early_policy(self)
        kv_receiver = mock.MagicMock()
        queue = SimpleNamespace(
            scheduler=mock.MagicMock(),
            token_to_kv_pool_allocator=mock.MagicMock(),
            retracted_queue=[],
            pending_reqs=[],
            _check_if_req_exceed_kv_capacity=lambda req: False,
            _create_receiver_and_enqueue=lambda req, is_rebootstrap=False: (
                SimpleNamespace(req=req, kv_receiver=kv_receiver)
            ),
            _resolve_prefill_dp_rank=lambda req: 0,
        )
        queue._init_receiver = DecodePreallocQueue._init_receiver.__get__(queue)

        with mock.patch.object(decode_mod, "is_unadmitted_reject", return_value=False):
            DecodePreallocQueue.add(queue, make_req(8998, room=1))

        kv_receiver.init.assert_called_once_with(0)
        self.assertEqual(queue.pending_reqs, [])


class CountingReceiver(CommonKVReceiver):
    """sglang's shape for the route cache: object.__new__ of a subclass whose
    lookups are counted and whose registration always succeeds."""

    def __init__(self):
        raise AssertionError("built with object.__new__")

    def _get_bootstrap_info_from_server(
        self, prefill_dp_rank, prefill_cp_rank, target_tp_rank, target_pp_rank
    ):
        self.lookups.append(
            (prefill_dp_rank, prefill_cp_rank, target_tp_rank, target_pp_rank)
        )
        return {"rank_ip": "127.0.0.1", "rank_port": 7000 + target_tp_rank}

    def _register_kv_args(self) -> bool:
        return True


class TestReceiverRouteCache(CustomTestCase):
    def setUp(self):
        super().setUp()
        self.kv_mgr = SimpleNamespace(
            connection_pool={}, connection_lock=threading.Lock(), is_mla_backend=False
        )

    def receiver(self) -> CountingReceiver:
        receiver = object.__new__(CountingReceiver)
        receiver.kv_mgr = self.kv_mgr
        receiver.bootstrap_addr = ADDR
        receiver.bootstrap_room = 1
        receiver.prefill_dp_rank = 0
        receiver.target_cp_ranks = [0]
        receiver.target_tp_rank = 0
        receiver.target_tp_ranks = [0, 1]
        receiver.target_pp_ranks = [0]
        receiver._connection_pool_entries = {}
        receiver.lookups = []
        return receiver

    def test_a_miss_looks_up_every_rank_and_a_hit_none(self):
        first, second = self.receiver(), self.receiver()

        first._setup_bootstrap_infos()
        second._setup_bootstrap_infos()

        self.assertEqual(first.lookups, [(0, 0, 0, 0), (0, 0, 1, 0)])
        self.assertEqual(second.lookups, [])
        self.assertIs(second.bootstrap_infos[0], first.bootstrap_infos[0])
        self.assertEqual([i["rank_port"] for i in first.bootstrap_infos], [7000, 7001])

    def test_after_an_invalidation_the_next_receiver_looks_up_again(self):
        first = self.receiver()
        first._setup_bootstrap_infos()

        first.invalidate_cached_bootstrap_infos()
        again = self.receiver()
        again._setup_bootstrap_infos()

        self.assertEqual(len(again.lookups), 2)
        self.assertEqual(self.kv_mgr.connection_pool, {f"{ADDR}_0_0_0": mock.ANY})

    def test_invalidation_keeps_an_entry_another_receiver_replaced(self):
        stale = self.receiver()
        stale._setup_bootstrap_infos()
        stale.invalidate_cached_bootstrap_infos()
        fresh = self.receiver()
        fresh._setup_bootstrap_infos()
        replaced = self.kv_mgr.connection_pool[f"{ADDR}_0_0_0"]

        stale._connection_pool_entries[f"{ADDR}_0_0_0"] = ["an older entry"]
        stale.invalidate_cached_bootstrap_infos()

        self.assertIs(self.kv_mgr.connection_pool[f"{ADDR}_0_0_0"], replaced)


class BlockingRoute:
    """Stands in for CommonKVReceiver._get_bootstrap_info_from_server."""

    def __init__(self, block: bool = False, answer: bool = True, on_call=None):
        self.block = block
        self.answer = answer
        self.on_call = on_call
        self.calls = []
        self.threads = []
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, receiver, dp_rank, cp_rank, tp_rank, pp_rank):
        self.calls.append((dp_rank, cp_rank, tp_rank, pp_rank))
        self.threads.append(threading.current_thread())
        if self.on_call is not None:
            self.on_call()
        if self.block:
            self.entered.set()
            if not self.release.wait(_WAIT_S):
                raise TimeoutError("fake route lookup was never released")
        if not self.answer:
            return None
        return {"rank_ip": "127.0.0.1", "rank_port": 7000 + tp_rank, "pp_rank": 0}


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def monotonic(self):
        return self.now

    def time(self):
        return self.now


class TestBackgroundRouteSetup(_Base):
    """receiver.init() on a connection_pool miss: the route lookups run on the
    fetch pool and poll() resumes init() once they have ended."""

    def setUp(self):
        super().setUp()
        cache_info(self.mgr, ADDR, dict(PREFILL_INFO, attn_tp_size=2))
        self.key = f"{ADDR}_0_0_0"

    def patch_route(self, route: BlockingRoute) -> BlockingRoute:
        def lookup(receiver, *args):
            return route(receiver, *args)

        patcher = mock.patch.object(
            CommonKVReceiver, "_get_bootstrap_info_from_server", lookup
        )
        patcher.start()
        self.addCleanup(patcher.stop)
        self.addCleanup(route.release.set)
        return route

    def receiver(self, room: int) -> CommonKVReceiver:
        return CommonKVReceiver(self.mgr, ADDR, room)

    def assert_failed_with(self, receiver, pattern: str) -> None:
        self.assertEqual(receiver.poll(), KVPoll.Failed)
        with self.assertRaisesRegex(KVTransferError, pattern):
            receiver.failure_exception()

    def test_init_returns_before_the_lookups_and_poll_finishes_it(self):
        route = self.patch_route(BlockingRoute(block=True))
        receiver = self.receiver(room=1)

        receiver.init(0)

        self.assertTrue(route.entered.wait(_WAIT_S))
        self.assertEqual(receiver.poll(), KVPoll.Bootstrapping)
        self.assertNotIn(threading.current_thread(), route.threads)
        route.release.set()
        drain(self.mgr)

        self.assertEqual(receiver.poll(), KVPoll.WaitingForInput)
        self.assertEqual(
            [i["rank_port"] for i in receiver.bootstrap_infos], [7000, 7001]
        )
        self.assertIn(self.key, self.mgr.connection_pool)

    def test_invalidated_routes_are_set_up_again_by_the_next_request(self):
        route = self.patch_route(BlockingRoute())
        first = self.receiver(room=1)
        first.init(0)
        drain(self.mgr)
        self.assertEqual(first.poll(), KVPoll.WaitingForInput)

        first.invalidate_cached_bootstrap_infos()
        self.assertEqual(self.mgr.connection_pool, {})
        second = self.receiver(room=2)
        second.init(0)
        self.assertEqual(second.poll(), KVPoll.Bootstrapping)
        drain(self.mgr)

        self.assertEqual(second.poll(), KVPoll.WaitingForInput)
        self.assertEqual(len(route.calls), 4)

    def test_receivers_of_the_same_routes_share_one_setup(self):
        route = self.patch_route(BlockingRoute(block=True))
        receivers = [self.receiver(room) for room in (1, 2, 3)]
        for receiver in receivers:
            receiver.init(0)
            self.assertEqual(receiver.poll(), KVPoll.Bootstrapping)
        route.release.set()
        drain(self.mgr)

        self.assertEqual(len(self.mgr._parallel_info_executor.futures), 1)
        self.assertEqual(len(route.calls), 2)  # attention TP 2: two ranks, once
        for receiver in receivers:
            self.assertEqual(receiver.poll(), KVPoll.WaitingForInput)

    def test_a_failed_lookup_fails_every_receiver_that_waited_for_it(self):
        route = self.patch_route(BlockingRoute(block=True, answer=False))
        waiting = [self.receiver(room) for room in (1, 2)]
        for receiver in waiting:
            receiver.init(0)
        route.release.set()
        drain(self.mgr)

        # The one it ran for with 0.5.23's cause; the others with its prefill.
        self.assert_failed_with(
            waiting[0], "Could not fetch bootstrap info for: prefill_dp_rank: 0"
        )
        self.assert_failed_with(
            waiting[1], f"Could not fetch the bootstrap info of prefill {ADDR}"
        )
        self.assertNotIn(self.key, self.mgr.connection_pool)
        # A request that comes later gets an attempt of its own.
        later = self.receiver(room=3)
        route.answer = True
        later.init(0)
        drain(self.mgr)
        self.assertEqual(later.poll(), KVPoll.WaitingForInput)

    def test_slow_lookups_that_each_answer_in_time_are_not_cut_short(self):
        clock = FakeClock()
        step = 0.9 * conn_mod.BOOTSTRAP_QUERY_TIMEOUT_S
        route = BlockingRoute()

        def slow():
            # Each lookup takes most of the bound: together, more than one.
            clock.now += step
            if len(route.calls) == 2:
                route.block = True

        route.on_call = slow
        self.patch_route(route)
        with mock.patch.object(conn_mod, "time", clock):
            receiver = self.receiver(room=1)
            receiver.init(0)
            self.assertTrue(route.entered.wait(_WAIT_S))

            # In the second lookup, past one bound in total: still waiting.
            self.assertEqual(receiver.poll(), KVPoll.Bootstrapping)
            route.release.set()
            drain(self.mgr)
            self.assertEqual(receiver.poll(), KVPoll.WaitingForInput)
        self.assertEqual(len(route.calls), 2)

    def test_a_setup_past_every_lookups_bound_fails_its_requests(self):
        clock = FakeClock()
        with mock.patch.object(conn_mod, "time", clock):
            route = self.patch_route(BlockingRoute(block=True))
            receiver = self.receiver(room=1)
            receiver.init(0)
            self.assertTrue(route.entered.wait(_WAIT_S))
            self.assertEqual(receiver.poll(), KVPoll.Bootstrapping)

            # Two lookups (attention TP 2), each bounded.
            clock.now += 2 * conn_mod.BOOTSTRAP_QUERY_TIMEOUT_S
            self.assert_failed_with(
                receiver, f"bootstrap info lookups to prefill {ADDR} have not ended"
            )
            # Its thread is the prefill's own; a late answer is a valid route.
            route.release.set()
            drain(self.mgr)
            later = self.receiver(room=2)
            later.init(0)
            self.assertEqual(later.poll(), KVPoll.WaitingForInput)

    def test_a_setup_queued_behind_others_is_bounded_from_when_it_starts(self):
        # The prefill's threads are busy with other setups of a slow but
        # answering bootstrap server: time queued is not the lookups'.
        clock, mgr = fake_clock_and_manager(self, workers=1)
        cache_info(mgr, ADDR, dict(PREFILL_INFO, attn_tp_size=2))
        route = self.patch_route(BlockingRoute(block=True))
        CommonKVReceiver(mgr, ADDR, 1).init(0)
        self.assertTrue(route.entered.wait(_WAIT_S))
        queued = CommonKVReceiver(mgr, ADDR, 2)
        queued.init(1)
        self.assertEqual(queued.poll(), KVPoll.Bootstrapping)

        clock.now += 2 * conn_mod.BOOTSTRAP_QUERY_TIMEOUT_S
        self.assertEqual(queued.poll(), KVPoll.Bootstrapping)
        route.release.set()
        drain(mgr)
        self.assertEqual(queued.poll(), KVPoll.WaitingForInput)

    def test_a_setup_queued_behind_one_that_never_ends_ends_by_the_waiting_timeout(
        self,
    ):
        # A trickling bootstrap server holds the prefill's threads for good:
        # the queued setup is bounded by the waiting timeout, then its lookups'.
        clock, mgr = fake_clock_and_manager(self, workers=1)
        cache_info(mgr, ADDR, dict(PREFILL_INFO, attn_tp_size=2))
        route = self.patch_route(BlockingRoute(block=True))
        self.addCleanup(route.release.set)
        CommonKVReceiver(mgr, ADDR, 1).init(0)
        self.assertTrue(route.entered.wait(_WAIT_S))
        queued = CommonKVReceiver(mgr, ADDR, 2)
        queued.init(1)
        waiting_timeout = envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get()
        bound = 2 * conn_mod.BOOTSTRAP_QUERY_TIMEOUT_S  # two lookups
        clock.now += waiting_timeout - 1
        self.assertEqual(queued.poll(), KVPoll.Bootstrapping)
        clock.now += bound - 1  # past the waiting timeout: the clock runs on
        self.assertEqual(queued.poll(), KVPoll.Bootstrapping)
        clock.now += 1
        self.assertEqual(queued.poll(), KVPoll.Failed)
        self.assertIn(
            "SGLANG_DISAGGREGATION_WAITING_TIMEOUT", mgr.failure_records[2]
        )

    def test_eviction_during_the_setup_caches_nothing(self):
        route = self.patch_route(BlockingRoute(block=True))
        receiver = self.receiver(room=1)
        receiver.init(0)
        self.assertTrue(route.entered.wait(_WAIT_S))

        self.mgr._handle_node_failure(ADDR)
        route.release.set()
        drain(self.mgr)

        self.assertNotIn(self.key, self.mgr.connection_pool)
        self.assert_failed_with(receiver, "Lost connection with prefill instance")

    def test_a_failure_during_the_setup_is_reported_at_once(self):
        # The heartbeat fails the prefill while its lookups hang: poll() says
        # so now, not once the setup ends or outlives its bound.
        route = self.patch_route(BlockingRoute(block=True))
        receiver = self.receiver(room=1)
        receiver.init(0)
        self.assertTrue(route.entered.wait(_WAIT_S))
        self.assertEqual(receiver.poll(), KVPoll.Bootstrapping)

        self.mgr._handle_node_failure(ADDR)

        self.assert_failed_with(receiver, "Lost connection with prefill instance")
        route.release.set()
        drain(self.mgr)
        self.assertEqual(receiver.poll(), KVPoll.Failed)

    def test_an_unexpected_error_fails_the_requests_not_the_decode(self):
        def broken(receiver, *args):
            raise KeyError("rank_ip")

        with mock.patch.object(
            CommonKVReceiver, "_get_bootstrap_info_from_server", broken
        ):
            receiver = self.receiver(room=1)
            with self.assertLogs(conn_mod.logger, "ERROR") as logs:
                receiver.init(0)
                drain(self.mgr)

        self.assertIn("Traceback", "\n".join(logs.output))
        self.assert_failed_with(
            receiver, f"Could not fetch the bootstrap info of prefill {ADDR}"
        )
        self.assertIsNone(self.mgr._parallel_info_fatal)


class TestMalformedRoute(CustomTestCase):
    def lookup(self, body):
        response = mock.MagicMock(status_code=200, text=json.dumps(body))
        response.json.return_value = body
        receiver = CommonKVReceiver.__new__(CommonKVReceiver)
        receiver.bootstrap_addr = ADDR
        session = SimpleNamespace(get=lambda *args, **kwargs: response)
        with mock.patch.object(conn_mod, "_get_bootstrap_session", return_value=session):
            return receiver._get_bootstrap_info_from_server(0, 0, 0, 0)

    def test_a_malformed_route_is_a_failed_lookup_not_a_cached_route(self):
        # init() reads rank_ip / rank_port on the scheduler thread: a route
        # without them must never be cached.
        for body in ({}, ["x"], {"rank_ip": "h", "rank_port": "x"}, {"rank_ip": "h"}):
            with self.subTest(body=body):
                self.assertIsNone(self.lookup(body))
        self.assertEqual(
            self.lookup({"rank_ip": "h", "rank_port": 7}),
            {"rank_ip": "h", "rank_port": 7, "pp_rank": 0},
        )



class TestParallelInfoOffTheSchedulerThread(CustomTestCase):
    """What sglang's synchronous tests of try_ensure_parallel_info check (the
    rank mapping stored on PrefillServerInfo, a layout mismatch rejected),
    now that the answer lands on a later call."""

    def fetch(self, info: dict, **decode):
        mgr = make_decode_manager()
        self.addCleanup(mgr._parallel_info_executor.shutdown, wait=False)
        for name, value in decode.items():
            setattr(mgr, name, value)
        get = mock.Mock(return_value=FakeResponse(200, info))
        with mock.patch.object(conn_mod.requests, "get", get):
            self.assertFalse(mgr.try_ensure_parallel_info(ADDR))
            drain(mgr)
            return mgr

    def test_prefill_cp4_tp4_maps_each_decode_tp_rank_to_its_rank_on_cp_rank_0(self):
        info = dict(PREFILL_INFO, attn_tp_size=4, attn_cp_size=4)
        for engine_rank in range(4):
            kv_args = SimpleNamespace(
                page_size=PAGE_SIZE, state_types=[], engine_rank=engine_rank
            )
            mgr = self.fetch(info, attn_tp_size=4, kv_args=kv_args)
            self.assertTrue(mgr.try_ensure_parallel_info(ADDR))
            mapped = mgr.prefill_info_table[ADDR]
            self.assertEqual(mapped.target_tp_rank, engine_rank)
            self.assertEqual(mapped.target_tp_ranks, [engine_rank])
            self.assertEqual(mapped.target_cp_ranks, [0])
            self.assertEqual(mapped.target_pp_ranks, [0])
            self.assertEqual(mapped.required_prefill_response_num, 1)

    def test_every_decode_dp_replica_pulls_from_cp_rank_0(self):
        info = dict(PREFILL_INFO, attn_cp_size=4, dp_size=4)
        for engine_rank in range(4):
            kv_args = SimpleNamespace(
                page_size=PAGE_SIZE, state_types=[], engine_rank=engine_rank
            )
            mgr = self.fetch(info, kv_args=kv_args)
            self.assertTrue(mgr.try_ensure_parallel_info(ADDR))
            self.assertEqual(mgr.prefill_info_table[ADDR].target_cp_ranks, [0])

    def test_a_layout_mismatch_is_rejected_on_the_next_call(self):
        mgr = self.fetch(dict(PREFILL_INFO, kv_layout="paged"), kv_layout="flat")

        self.assertNotIn(ADDR, mgr.prefill_info_table)
        with self.assertRaisesRegex(RuntimeError, "KV layout mismatch"):
            mgr.try_ensure_parallel_info(ADDR)


if __name__ == "__main__":
    unittest.main()
