"""No code path of the decode scheduling cycle waits on a socket.

Besides the parallel-info fetch (test_parallel_info_nonblocking.py), the cycle
used to make the dp-rank query and the per-rank ``/route`` lookups of
``CommonKVReceiver.init`` inline. CPU-only, no sleeps: fetch threads are
coordinated with ``threading.Event`` and a single-worker executor barrier, and
the one real HTTP server is a fake bootstrap server on 127.0.0.1.
"""

import json
import threading
import unittest
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from unittest import mock
from urllib.parse import parse_qs, urlparse

import urllib3
from sglang.srt.disaggregation import decode as decode_mod
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common import conn as conn_mod
from sglang.srt.disaggregation.common.conn import CommonKVReceiver
from sglang.srt.disaggregation.decode import DecodeRequest, _bootstrap_addr
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from test_parallel_info_nonblocking import (
    ADDR,
    PREFILL_INFO,
    FakeGet,
    FakeResponse,
)
from test_parallel_info_nonblocking import _Base as _FetchTestBase
from test_parallel_info_nonblocking import drain, make_manager, make_queue

register_cpu_ci(est_time=20, suite="base-a-test-cpu")

_WAIT_S = 30
# Prefill dp_size 2 that does not follow the bootstrap room (so decode must
# query the dp rank), attention TP 2 against decode TP 1 (two routes each).
DP_TP_INFO = dict(PREFILL_INFO, dp_size=2, attn_tp_size=2, follow_bootstrap_room=False)


def route_port(dp_rank: int, tp_rank: int) -> int:
    return 20000 + 10 * dp_rank + tp_rank


class FakeBootstrapServer:
    """A prefill bootstrap server on 127.0.0.1 answering the three queries a
    decode makes: parallel info, per-rank route and dp ranks."""

    def __init__(self, info: dict):
        server = self

        class Handler(BaseHTTPRequestHandler):
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
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(_WAIT_S)


class NetworkSentinel:
    """Records the thread of every HTTP connect and request urllib3 makes."""

    def __init__(self, test: CustomTestCase):
        self.threads = []
        for name in ("connect", "request"):
            original = getattr(urllib3.connection.HTTPConnection, name)
            patcher = mock.patch.object(
                urllib3.connection.HTTPConnection, name, self._wrap(original)
            )
            patcher.start()
            test.addCleanup(patcher.stop)

    def _wrap(self, original):
        def recorded(conn, *args, **kwargs):
            self.threads.append(threading.current_thread())
            return original(conn, *args, **kwargs)

        return recorded


def make_req(port: int, room: int):
    return SimpleNamespace(
        bootstrap_host="127.0.0.1",
        bootstrap_port=port,
        bootstrap_room=room,
        disagg_prefill_dp_rank=None,
    )


class _Base(_FetchTestBase):
    def setUp(self):
        super().setUp()
        disagg = SimpleNamespace(disaggregation_decode_allocation_policy="early")
        for patcher in (
            mock.patch.object(decode_mod, "get_disagg", return_value=disagg),
            mock.patch.object(conn_mod, "get_disagg", return_value=disagg),
            # The ZMQ registration is bounded by SNDTIMEO and out of scope here.
            mock.patch.object(CommonKVReceiver, "_register_kv_args", return_value=True),
        ):
            patcher.start()
            self.addCleanup(patcher.stop)
        self.queue = make_queue(self.mgr)
        self.queue.pending_reqs = []
        self.queue.queue = []

    def add(self, req) -> DecodeRequest:
        """DecodePreallocQueue.add() with the scheduler-owned pieces it does
        not exercise here (capacity check, receiver class lookup) replaced."""
        created = []

        def create(req, is_rebootstrap=False):
            receiver = CommonKVReceiver(
                self.mgr, _bootstrap_addr(req), req.bootstrap_room
            )
            created.append(DecodeRequest(req=req, kv_receiver=receiver))
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

    def cycle(self):
        """One scheduling cycle's pending resolution, then let the fetches
        it started finish before the next one."""
        self.queue._resolve_pending_reqs()
        drain(self.mgr)
        self.clock.now += 0.1


class TestSchedulerThreadMakesNoNetworkCall(_Base):
    def test_first_contact_dp_rank_and_routes_run_off_the_scheduler_thread(self):
        server = FakeBootstrapServer(DP_TP_INFO)
        self.addCleanup(server.stop)
        sentinel = NetworkSentinel(self)
        decode_reqs = [self.add(make_req(server.port, room)) for room in (10, 11)]
        self.assertEqual(len(self.queue.pending_reqs), 2)

        cycles = 0
        while self.queue.pending_reqs and cycles < 20:
            self.cycle()
            cycles += 1

        self.assertEqual(self.queue.pending_reqs, [])
        # Parallel info, then dp ranks, then routes: each lands in a later cycle.
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
        addr = f"127.0.0.1:{9}"
        self.mgr._parallel_info_executor = mock.MagicMock()
        info = conn_mod.PrefillServerInfo(**PREFILL_INFO)
        self.mgr._resolve_rank_mapping(info)
        self.mgr.prefill_info_table[addr] = info
        self.mgr.connection_pool[f"{addr}_0_0_0"] = [
            {"rank_ip": "127.0.0.1", "rank_port": 1, "pp_rank": 0, "is_dummy": False}
        ]

        decode_req = self.add(make_req(9, room=5))

        self.assertEqual(self.queue.pending_reqs, [])
        self.assertEqual(decode_req.kv_receiver.poll(), KVPoll.WaitingForInput)
        self.mgr._parallel_info_executor.submit.assert_not_called()


class BlockingRoute:
    """Stands in for CommonKVReceiver._get_bootstrap_info_from_server."""

    def __init__(self, block: bool = True, answer: bool = True):
        self.block = block
        self.answer = answer
        self.calls = 0
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, dp_rank, cp_rank, tp_rank, pp_rank):
        self.calls += 1
        if self.block:
            self.entered.set()
            if not self.release.wait(_WAIT_S):
                raise TimeoutError("fake route lookup was never released")
        if not self.answer:
            return None
        return {"rank_ip": "127.0.0.1", "rank_port": 1, "pp_rank": pp_rank}


class TestRouteAndDpRankFetches(_Base):
    def setUp(self):
        super().setUp()
        info = conn_mod.PrefillServerInfo(**PREFILL_INFO)
        self.mgr._resolve_rank_mapping(info)
        self.mgr.prefill_info_table[ADDR] = info
        self.key = f"{ADDR}_0_0_0"

    def patch_route(self, route: BlockingRoute) -> BlockingRoute:
        patcher = mock.patch.object(
            CommonKVReceiver, "_get_bootstrap_info_from_server", route
        )
        patcher.start()
        self.addCleanup(patcher.stop)
        self.addCleanup(route.release.set)
        return route

    def pending(self, room: int) -> DecodeRequest:
        receiver = CommonKVReceiver(self.mgr, ADDR, room)
        decode_req = DecodeRequest(req=make_req(8998, room), kv_receiver=receiver)
        self.queue.pending_reqs.append(decode_req)
        return decode_req

    def test_add_with_cold_routes_waits_instead_of_failing(self):
        route = self.patch_route(BlockingRoute(block=False))

        decode_req = self.add(make_req(8998, room=6))

        # dp rank known from the cache, routes not: pending, not init()ed.
        self.assertEqual(self.queue.pending_reqs, [decode_req])
        self.assertEqual(decode_req.kv_receiver.poll(), KVPoll.Bootstrapping)
        self.cycle()  # starts the route fetch
        self.cycle()  # admits with the fetched routes
        self.assertEqual(self.queue.pending_reqs, [])
        self.assertEqual(decode_req.kv_receiver.poll(), KVPoll.WaitingForInput)
        self.assertEqual(route.calls, 1)

    def test_invalidated_routes_are_fetched_again(self):
        self.patch_route(BlockingRoute(block=False))
        decode_req = self.pending(room=7)
        self.cycle()
        self.cycle()
        self.assertIn(self.key, self.mgr._fetched_bootstrap_infos)

        decode_req.kv_receiver.invalidate_cached_bootstrap_infos()

        self.assertNotIn(self.key, self.mgr.connection_pool)
        self.assertNotIn(self.key, self.mgr._fetched_bootstrap_infos)

    def test_eviction_during_route_fetch_does_not_republish(self):
        route = self.patch_route(BlockingRoute())
        self.pending(room=1)

        self.queue._resolve_pending_reqs()
        self.assertTrue(route.entered.wait(_WAIT_S))
        self.mgr._handle_node_failure(ADDR)
        route.release.set()
        drain(self.mgr)

        self.assertNotIn(self.key, self.mgr._fetched_bootstrap_infos)
        self.assertFalse(self.mgr.bootstrap_infos_fetch_in_flight(ADDR, 0))

    def test_eviction_during_parallel_info_fetch_does_not_republish(self):
        del self.mgr.prefill_info_table[ADDR]
        fake = FakeGet("block")
        with mock.patch.object(conn_mod.requests, "get", fake):
            self.assertFalse(self.mgr.try_ensure_parallel_info(ADDR))
            self.assertTrue(fake.entered.wait(_WAIT_S))
            self.mgr._handle_node_failure(ADDR)
            fake.release.set()
            drain(self.mgr)

        self.assertFalse(self.mgr.has_parallel_info(ADDR))
        self.assertFalse(self.mgr.parallel_info_fetch_in_flight(ADDR))

    def test_failure_of_port_80_keeps_port_8080_cached(self):
        self.mgr.connection_pool["host:80_0_0_0"] = []
        self.mgr.connection_pool["host:8080_0_0_0"] = []
        self.mgr.prefill_info_table["host:8080"] = object()

        self.mgr._handle_node_failure("host:80")

        self.assertNotIn("host:80_0_0_0", self.mgr.connection_pool)
        self.assertIn("host:8080_0_0_0", self.mgr.connection_pool)
        self.assertIn("host:8080", self.mgr.prefill_info_table)

    def test_exhausted_route_budget_aborts_with_the_existing_message(self):
        route = self.patch_route(BlockingRoute(block=False, answer=False))
        self.queue._max_ensure_retries = 2
        decode_req = self.pending(room=3)

        for _ in range(3):
            self.cycle()
            self.clock.now += 1.0

        self.assertEqual(route.calls, 2)
        self.assertEqual(self.queue.pending_reqs, [])
        self.assertEqual(decode_req.kv_receiver.poll(), KVPoll.Failed)
        with self.assertRaisesRegex(
            conn_mod.KVTransferError,
            f"Could not fetch bootstrap info for prefill_dp_rank 0 from {ADDR} "
            "after 2 attempts",
        ):
            decode_req.kv_receiver.failure_exception()

    def test_dp_rank_query_failures_spend_the_budget_not_found_does_not(self):
        self.mgr.prefill_info_table[ADDR] = conn_mod.PrefillServerInfo(**DP_TP_INFO)
        answers = [None, {}, None, None]
        query = mock.MagicMock(side_effect=lambda addr, rooms: answers.pop(0))
        self.queue._max_ensure_retries = 2
        decode_req = self.pending(room=4)

        with mock.patch.object(CommonKVReceiver, "_query_prefill_dp_ranks", query):
            for _ in range(6):
                self.cycle()
                self.clock.now += 1.0

        # An answer without the room (not registered on the prefill yet) is not
        # a failure and resets the budget; two failures in a row abort.
        self.assertEqual(query.call_count, 4)
        self.assertEqual(decode_req.kv_receiver.poll(), KVPoll.Failed)
        with self.assertRaisesRegex(
            conn_mod.KVTransferError,
            f"Could not fetch prefill dp ranks from {ADDR} after 2 attempts",
        ):
            decode_req.kv_receiver.failure_exception()


class TestQueryPrefillDpRanks(CustomTestCase):
    def query(self, response):
        session = mock.MagicMock()
        session.post.return_value = response
        with mock.patch.object(
            conn_mod, "_get_bootstrap_session", return_value=session
        ):
            return (
                CommonKVReceiver._query_prefill_dp_ranks(ADDR, [1]),
                CommonKVReceiver.query_prefill_dp_ranks(ADDR, [1]),
            )

    def test_a_failed_query_is_told_apart_from_an_empty_answer(self):
        self.assertEqual(self.query(FakeResponse(503)), (None, {}))
        self.assertEqual(self.query(FakeResponse(200, ["1"])), (None, {}))
        self.assertEqual(self.query(FakeResponse(200, {"1": "x"})), (None, {}))
        self.assertEqual(self.query(FakeResponse(200, {})), ({}, {}))
        self.assertEqual(self.query(FakeResponse(200, {"1": 1})), ({"1": 1}, {"1": 1}))


class TestMalformedRoute(CustomTestCase):
    def lookup(self, response):
        session = mock.MagicMock()
        session.get.return_value = response
        receiver = CommonKVReceiver.__new__(CommonKVReceiver)
        receiver.bootstrap_addr = ADDR
        with mock.patch.object(
            conn_mod, "_get_bootstrap_session", return_value=session
        ):
            return receiver._get_bootstrap_info_from_server(0, 0, 0, 0)

    def test_a_malformed_route_is_a_failed_lookup_not_a_cached_route(self):
        # init() reads rank_ip / rank_port on the scheduler thread: a route
        # without them must never be cached.
        for body in ({}, ["x"], {"rank_ip": "h", "rank_port": "x"}, {"rank_ip": "h"}):
            with self.subTest(body=body):
                self.assertIsNone(self.lookup(FakeResponse(200, body)))
        self.assertEqual(
            self.lookup(FakeResponse(200, {"rank_ip": "h", "rank_port": 7})),
            {"rank_ip": "h", "rank_port": 7, "pp_rank": 0},
        )


class TestHungPrefills(_Base):
    def test_hung_prefills_do_not_delay_a_healthy_first_contact(self):
        hung = [f"127.0.1.{i}:8998" for i in range(8)]
        healthy = "127.0.0.1:8998"
        release = threading.Event()
        self.addCleanup(release.set)
        published = threading.Event()

        def get(url, timeout=None):
            if healthy not in url:
                release.wait(_WAIT_S)
                return FakeResponse(503)
            return FakeResponse(200, PREFILL_INFO)

        class Table(dict):
            def __setitem__(self, key, value):
                super().__setitem__(key, value)
                published.set()

        self.mgr.prefill_info_table = Table()
        self.mgr._parallel_info_executor = ThreadPoolExecutor(
            max_workers=conn_mod.BOOTSTRAP_FETCH_WORKERS
        )
        self.addCleanup(self.mgr._parallel_info_executor.shutdown, wait=False)
        addr_to_reqs = {addr: [SimpleNamespace(kv_receiver=None)] for addr in hung}
        addr_to_reqs[healthy] = [SimpleNamespace(kv_receiver=None)]

        with mock.patch.object(conn_mod.requests, "get", get):
            self.queue._ensure_prefill_info(addr_to_reqs)
            self.assertTrue(published.wait(_WAIT_S))
            ready, remaining = self.queue._ensure_prefill_info(addr_to_reqs)

            self.assertEqual(list(ready), [healthy])
            self.assertEqual(len(remaining), len(hung))
            release.set()

    def test_teardown_does_not_wait_for_a_hung_fetch(self):
        fake = FakeGet("block")
        with mock.patch.object(conn_mod.requests, "get", fake):
            self.mgr.try_ensure_parallel_info("127.0.0.1:1")
            self.mgr.try_ensure_parallel_info("127.0.0.1:2")  # queued behind it
            self.assertTrue(fake.entered.wait(_WAIT_S))

            self.mgr._stop_bootstrap_fetches()

            self.assertFalse(fake.returned.is_set())
            fake.release.set()
            self.mgr._parallel_info_executor.shutdown(wait=True)
        # The queued fetch was cancelled, not run after the hung one.
        self.assertEqual(len(fake.calls), 1)


class TestFetchTimeBound(_Base):
    """BOOTSTRAP_FETCH_TIMEOUT_S bounds how long a query holds its requests;
    requests' own timeout bounds only connect and each read."""

    def setUp(self):
        super().setUp()
        # Deadlines read the same fake clock as the retry loop.
        patcher = mock.patch.object(conn_mod, "time", self.clock)
        patcher.start()
        self.addCleanup(patcher.stop)

    def test_an_overdue_fetch_spends_the_budget_without_a_second_fetch(self):
        fake = self.patch_get(FakeGet("block"))
        self.queue._max_ensure_retries = 2
        req = SimpleNamespace(kv_receiver=mock.MagicMock())
        addr_to_reqs = {ADDR: [req]}

        self.queue._ensure_prefill_info(addr_to_reqs)
        self.assertTrue(fake.entered.wait(_WAIT_S))
        # Within the bound, waiting spends no attempt.
        for _ in range(conn_mod.BOOTSTRAP_FETCH_TIMEOUT_S - 1):
            self.clock.now += 1.0
            self.queue._ensure_prefill_info(addr_to_reqs)
        self.assertEqual(self.queue._ensure_retry_count[ADDR], 1)
        req.kv_receiver.abort.assert_not_called()

        # Past it, each retry interval is a failed attempt: the budget ends.
        for _ in range(3):
            self.clock.now += 1.0
            self.queue._ensure_prefill_info(addr_to_reqs)

        req.kv_receiver.abort.assert_called_once()
        self.assertIn(
            f"Could not fetch prefill parallel info from {ADDR} after 2 attempts",
            req.kv_receiver.abort.call_args.kwargs["failure_reason"],
        )
        self.assertEqual(len(fake.calls), 1)
        self.assertFalse(self.mgr.has_parallel_info(ADDR))

        # The late answer is still good: it is cached for the next requests.
        fake.release.set()
        drain(self.mgr)
        self.assertTrue(self.mgr.has_parallel_info(ADDR))
        self.assertEqual(self.mgr._fetch_deadlines, {})

    def test_route_lookups_stop_at_the_bound(self):
        info = conn_mod.PrefillServerInfo(**DP_TP_INFO)
        self.mgr._resolve_rank_mapping(info)
        self.mgr.prefill_info_table[ADDR] = info
        calls = []

        def slow_route(dp_rank, cp_rank, tp_rank, pp_rank):
            calls.append(tp_rank)
            # The first lookup returns past the bound: no second one starts.
            self.clock.now += conn_mod.BOOTSTRAP_FETCH_TIMEOUT_S + 1
            return {"rank_ip": "127.0.0.1", "rank_port": 1, "pp_rank": pp_rank}

        receiver = CommonKVReceiver(self.mgr, ADDR, 1)
        with mock.patch.object(
            CommonKVReceiver,
            "_get_bootstrap_info_from_server",
            mock.Mock(side_effect=slow_route),
        ):
            self.assertFalse(self.mgr.try_ensure_bootstrap_infos(receiver, 0))
            drain(self.mgr)

        self.assertEqual(calls, [0])
        self.assertFalse(self.mgr.has_bootstrap_infos(ADDR, 0))
        self.assertFalse(self.mgr.bootstrap_infos_fetch_in_flight(ADDR, 0))


class TestBootstrapFetchExecutor(CustomTestCase):
    WORKERS = 4

    def setUp(self):
        super().setUp()
        self.executor = conn_mod._BootstrapFetchExecutor(self.WORKERS, "test-fetch")
        self.addCleanup(self.executor.shutdown, wait=False, cancel_futures=True)
        self.release = threading.Event()
        self.addCleanup(self.release.set)

    def test_submit_starts_no_thread_on_the_calling_thread(self):
        started = []
        original = threading.Thread.start

        def start(thread):
            started.append(thread)
            return original(thread)

        with mock.patch.object(threading.Thread, "start", start):
            # Every worker busy at once: none may be started lazily here.
            futures = [
                self.executor.submit(self.release.wait, _WAIT_S)
                for _ in range(self.WORKERS)
            ]
        self.release.set()
        for future in futures:
            self.assertTrue(future.result(timeout=_WAIT_S))
        self.assertEqual(started, [])
        self.assertIsInstance(self.executor, ThreadPoolExecutor)

    def test_a_hung_fetch_does_not_hold_up_interpreter_exit(self):
        entered = threading.Event()

        def hung():
            entered.set()
            self.release.wait(_WAIT_S)

        running = self.executor.submit(hung)
        self.assertTrue(entered.wait(_WAIT_S))
        queued = [self.executor.submit(hung) for _ in range(self.WORKERS)]

        self.executor.shutdown(wait=False, cancel_futures=True)

        # Exit joins non-daemon threads only; queued fetches never run.
        self.assertTrue(all(t.daemon for t in self.executor._threads))
        self.assertFalse(running.done())
        self.assertTrue(all(f.cancelled() for f in queued[self.WORKERS - 1 :]))
        with self.assertRaises(RuntimeError):
            self.executor.submit(hung)
        self.release.set()
        self.assertIsNone(running.result(timeout=_WAIT_S))

    def test_results_and_errors_reach_the_future(self):
        self.assertEqual(self.executor.submit(lambda x: x + 1, 1).result(_WAIT_S), 2)
        with self.assertRaises(ZeroDivisionError):
            self.executor.submit(lambda: 1 / 0).result(_WAIT_S)


if __name__ == "__main__":
    unittest.main()
