"""The decode side's bootstrap fetch pool and the time bound of a fetch.

requests' ``timeout=5`` bounds connect and each read, not a query's total
time, so a fetch can outlive any budget; the pool times each task from its
submission into its prefill's own lane, and an overdue or evicted fetch is
retired: a new attempt may start, the old one's late answer is dropped, and
its connection is shut down. Each prefill has lanes of its own, so prefills
that hang never hold up another's query. CPU-only, no sleeps: a fake
monotonic clock stands for time, and fetches block on ``threading.Event``;
the connection cases use a silent HTTP server on 127.0.0.1.
"""

import socket
import threading
import unittest
from concurrent.futures import Future, ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import MethodType, SimpleNamespace
from unittest import mock

from sglang.srt.disaggregation import decode as decode_mod
from sglang.srt.disaggregation.common import conn as conn_mod
from sglang.srt.disaggregation.common.conn import CommonKVManager, CommonKVReceiver
from sglang.srt.disaggregation.decode import DecodePreallocQueue
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from test_no_network_on_scheduler_thread import (
    ADDR,
    PAGE_SIZE,
    PREFILL_INFO,
    FakeClock,
    drain,
    fake_clock_and_manager,
    make_decode_manager,
    make_queue,
    patch_early_policy,
)
from test_parallel_info_nonblocking import FakeGet, FakeResponse, patch_get

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

_WAIT_S = 30
BOUND_S = conn_mod.BOOTSTRAP_FETCH_TIMEOUT_S


class TestBootstrapFetchPool(CustomTestCase):
    WORKERS = 2

    def setUp(self):
        super().setUp()
        self.pool = conn_mod._BootstrapFetchPool(
            "test-fetch", lane_workers={"bootstrap": self.WORKERS}
        )
        self.addCleanup(self.pool.shutdown, wait=False, cancel_futures=True)
        self.release = threading.Event()
        self.addCleanup(self.release.set)

    def hang(self, addr: str, entered: threading.Semaphore):
        def hung(addr):
            entered.release()
            self.release.wait(_WAIT_S)

        return self.pool.submit(hung, addr)

    def test_submit_starts_no_thread_on_the_calling_thread(self):
        starters = []
        original = threading.Thread.start

        def start(thread):
            starters.append(threading.current_thread())
            return original(thread)

        with mock.patch.object(threading.Thread, "start", start):
            futures = [
                self.pool.submit(self.release.wait, f"127.0.0.1:{port}")
                for port in range(1, 5)
            ]
            self.release.set()
            for future in futures:
                self.assertIsInstance(future, Future)
                self.assertTrue(future.result(timeout=_WAIT_S))
        self.assertEqual(len(starters), 4)  # a lane thread per prefill
        self.assertNotIn(threading.current_thread(), starters)

    def test_more_hung_prefills_than_workers_leave_a_healthy_query_running(self):
        entered = threading.Semaphore(0)
        hung = [f"127.0.1.{i}:8998" for i in range(4 * self.WORKERS)]
        for addr in hung:
            for _ in range(self.WORKERS + 1):  # every lane thread, and one queued
                self.hang(addr, entered)
        for _ in range(len(hung) * self.WORKERS):
            self.assertTrue(entered.acquire(timeout=_WAIT_S))

        healthy = self.pool.submit(lambda addr: addr, ADDR)

        self.assertEqual(healthy.result(timeout=_WAIT_S), ADDR)
        self.assertFalse(self.release.is_set())
        # A sick prefill holds its own lane's threads, no more.
        self.assertLessEqual(self.pool.thread_count(), (len(hung) + 1) * self.WORKERS)

    def test_a_hung_fetch_does_not_hold_up_interpreter_exit(self):
        entered = threading.Semaphore(0)
        running = [self.hang(ADDR, entered) for _ in range(self.WORKERS)]
        for _ in running:
            self.assertTrue(entered.acquire(timeout=_WAIT_S))
        queued = self.hang(ADDR, entered)

        self.pool.shutdown(wait=False, cancel_futures=True)

        # Exit joins non-daemon threads only; queued fetches never run.
        self.assertTrue(all(t.daemon for t in self.pool._threads))
        self.assertFalse(any(f.done() for f in running))
        self.assertTrue(queued.cancelled())
        with self.assertRaises(RuntimeError):
            self.pool.submit(int)
        self.release.set()
        for future in running:
            self.assertIsNone(future.result(timeout=_WAIT_S))

    def test_results_and_errors_reach_the_future(self):
        self.assertEqual(self.pool.submit(lambda x: x + 1, 1).result(_WAIT_S), 2)
        with self.assertRaises(ZeroDivisionError):
            self.pool.submit(lambda: 1 / 0).result(_WAIT_S)

    def test_idle_lane_threads_end(self):
        pool = conn_mod._BootstrapFetchPool("test-idle", idle_s=0)
        self.addCleanup(pool.shutdown, wait=False)
        pool.submit(lambda addr: None, ADDR).result(timeout=_WAIT_S)
        for thread in list(pool._threads):
            thread.join(_WAIT_S)
        self.assertEqual(pool.thread_count(), 0)
        self.assertEqual(pool._lanes, {})

    def test_the_bound_runs_from_submission_in_the_prefills_own_lane(self):
        clock = FakeClock()
        pool = conn_mod._BootstrapFetchPool("test-one", lane_workers={"bootstrap": 1})
        self.addCleanup(pool.shutdown, wait=False, cancel_futures=True)
        entered = threading.Event()

        def hung(addr):
            entered.set()
            self.release.wait(_WAIT_S)

        with mock.patch.object(conn_mod, "time", clock):
            running = pool.submit(hung, ADDR)
            self.assertTrue(entered.wait(_WAIT_S))
            # Queued behind its own prefill's hung fetch: that wait is its own.
            queued = pool.submit(lambda addr: None, ADDR)
            other = pool.submit(lambda addr: None, "127.0.0.1:1")
            other.result(timeout=_WAIT_S)
            clock.now += BOUND_S + 1

            self.assertTrue(conn_mod.bootstrap_fetch_overdue(running))
            self.assertTrue(conn_mod.bootstrap_fetch_overdue(queued))
            self.release.set()
            queued.result(timeout=_WAIT_S)
        self.assertFalse(conn_mod.bootstrap_fetch_overdue(queued))

    def test_a_retired_queued_task_never_runs(self):
        entered = threading.Semaphore(0)
        for _ in range(self.WORKERS):  # the lane's threads, all busy
            self.hang(ADDR, entered)
        for _ in range(self.WORKERS):
            self.assertTrue(entered.acquire(timeout=_WAIT_S))
        ran = threading.Event()
        queued = self.pool.submit(lambda addr: ran.set(), ADDR)
        queued.retire()
        self.assertTrue(queued.cancelled())
        with self.pool._lock:  # it left its lane's queue at once
            lanes = list(self.pool._lanes.values())
        self.assertEqual([len(lane.tasks) for lane in lanes], [0])
        self.release.set()
        # Barrier: a task submitted after it has run on the same lane.
        self.pool.submit(lambda addr: None, ADDR).result(timeout=_WAIT_S)
        self.assertFalse(ran.is_set())

    def test_a_plain_future_has_no_bound(self):
        with ThreadPoolExecutor(1) as plain:
            self.assertFalse(conn_mod.bootstrap_fetch_overdue(plain.submit(int)))


class SilentHandler(BaseHTTPRequestHandler):
    """Takes a request in and sends the first bytes of an answer (a peer
    that answers a byte at a time keeps each read alive), then nothing
    more until released."""

    def do_GET(self):
        self.wfile.write(b"HTTP/1.1 2")
        self.wfile.flush()
        self.server.arrived.set()
        self.server.release.wait(10 * _WAIT_S)  # longer than any wait here

    def log_message(self, *args):
        pass


def start_server(test: CustomTestCase, handler) -> ThreadingHTTPServer:
    """An HTTP server on 127.0.0.1 with a ``release`` Event, stopped (and
    released) when ``test`` ends; its "host:port" is ``httpd.addr``."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    httpd.release = threading.Event()
    test.addCleanup(httpd.server_close)
    test.addCleanup(httpd.shutdown)
    test.addCleanup(httpd.release.set)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    httpd.addr = f"127.0.0.1:{httpd.server_address[1]}"
    return httpd


class NoTimeoutHTTP(conn_mod._BootstrapHTTP):
    """Reads that outlast the test: only a shutdown of the socket ends them."""

    def request(self, method, url, *, json_body=None, timeout=5):
        return super().request(method, url, json_body=json_body, timeout=10 * _WAIT_S)


class TestRetiredFetchConnection(CustomTestCase):
    """A retired fetch's connection is shut down: its thread comes back while
    the peer still holds the request, not when a read times out."""

    def setUp(self):
        super().setUp()
        self.server = start_server(self, SilentHandler)
        self.server.arrived = threading.Event()
        self.addr = self.server.addr
        self.pool = conn_mod._BootstrapFetchPool("test-retire")
        self.addCleanup(self.pool.shutdown, wait=False, cancel_futures=True)
        patcher = mock.patch.object(conn_mod, "_bootstrap_http", NoTimeoutHTTP())
        patcher.start()
        self.addCleanup(patcher.stop)

    def assert_thread_comes_back(self, fetch):
        self.assertTrue(self.server.arrived.wait(_WAIT_S))
        fetch.retire()
        result = fetch.result(timeout=_WAIT_S)
        self.assertFalse(self.server.release.is_set())  # the peer never answered
        return result

    def test_a_retired_route_lookup_is_cut_off(self):
        receiver = CommonKVReceiver.__new__(CommonKVReceiver)
        receiver.bootstrap_addr = self.addr
        with self.assertNoLogs(conn_mod.logger, "ERROR"):  # cut off on purpose
            lookup = self.pool.submit(
                receiver._get_bootstrap_info_from_server, 0, 0, 0, 0
            )
            self.assertIsNone(self.assert_thread_comes_back(lookup))
        # Its connection is not handed to the next query.
        self.assertEqual(conn_mod._bootstrap_http.idle_count(), 0)

    def test_shutdown_cuts_a_running_fetch_off(self):
        receiver = CommonKVReceiver.__new__(CommonKVReceiver)
        receiver.bootstrap_addr = self.addr
        lookup = self.pool.submit(receiver._get_bootstrap_info_from_server, 0, 0, 0, 0)
        self.assertTrue(self.server.arrived.wait(_WAIT_S))
        # Teardown waits on no prefill: shutdown(wait=True) returns.
        shutdown = threading.Thread(target=self.pool.shutdown, daemon=True)
        shutdown.start()
        shutdown.join(_WAIT_S)
        self.assertFalse(shutdown.is_alive())
        self.assertIsNone(lookup.result(timeout=0))
        self.assertFalse(self.server.release.is_set())

    def test_a_heartbeat_probe_left_unanswered_fails_and_is_cut_off(self):
        probe = self.pool.submit_to(
            "health",
            conn_mod.HEARTBEAT_PROBE_TIMEOUT_S,
            MethodType(CommonKVManager._probe_prefill_health, SimpleNamespace()),
            self.addr,
        )
        self.assertFalse(self.assert_thread_comes_back(probe))


class KeepAliveHandler(BaseHTTPRequestHandler):
    """HTTP/1.1 with keep-alive: /route answers at once; /query_dp_ranks
    only once released. Counts the connections it accepted."""

    protocol_version = "HTTP/1.1"

    def setup(self):
        super().setup()
        self.server.connections += 1

    def answer(self, body: bytes):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.answer(b'{"rank_ip": "127.0.0.1", "rank_port": 1}')

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.server.held.set()
        self.server.release.wait(_WAIT_S)
        if self.server.at_once is not None:
            self.server.at_once.wait()
        self.answer(b'{"1": 0}')

    def log_message(self, *args):
        pass


class KeepAliveServer:
    def __init__(self, test: CustomTestCase):
        self.httpd = start_server(test, KeepAliveHandler)
        self.httpd.connections = 0
        self.httpd.at_once = None  # a Barrier: answer once that many are in
        self.httpd.held = threading.Event()
        self.addr = self.httpd.addr


class TestFetchesOwnTheirConnections(CustomTestCase):
    """Keep-alive connections to one prefill pass from fetch to fetch; a
    socket is shut down only by the fetch that is reading on it then."""

    def setUp(self):
        super().setUp()
        self.server = KeepAliveServer(self)
        self.http = conn_mod._BootstrapHTTP()
        patcher = mock.patch.object(conn_mod, "_bootstrap_http", self.http)
        patcher.start()
        self.addCleanup(patcher.stop)
        self.pool = conn_mod._BootstrapFetchPool("test-own")
        self.addCleanup(self.pool.shutdown, wait=False, cancel_futures=True)
        self.receiver = CommonKVReceiver.__new__(CommonKVReceiver)
        self.receiver.bootstrap_addr = self.server.addr

    def test_retiring_a_fetch_leaves_another_fetchs_connection_alone(self):
        looked_up = threading.Event()
        release = threading.Event()
        self.addCleanup(release.set)

        def route_setup(addr):
            # Several lookups, on one keep-alive connection, then it waits.
            for tp_rank in range(3):
                self.assertIsNotNone(
                    self.receiver._get_bootstrap_info_from_server(0, 0, tp_rank, 0)
                )
            looked_up.set()
            release.wait(_WAIT_S)

        setup = self.pool.submit(route_setup, self.server.addr)
        self.assertTrue(looked_up.wait(_WAIT_S))
        # Another fetch of the same prefill takes that connection over.
        query = self.pool.submit(
            CommonKVReceiver.query_prefill_dp_ranks, self.server.addr, [1]
        )
        self.assertTrue(self.server.httpd.held.wait(_WAIT_S))
        setup.retire()
        self.server.httpd.release.set()

        self.assertEqual(query.result(timeout=_WAIT_S), {"1": 0})
        self.assertEqual(self.server.httpd.connections, 1)

    def test_threads_share_connections_instead_of_holding_one_each(self):
        for tp_rank in range(8):  # eight threads, one after the other
            lookup = self.pool.submit(
                self.receiver._get_bootstrap_info_from_server, 0, 0, tp_rank, 0
            )
            self.assertIsNotNone(lookup.result(timeout=_WAIT_S))
        self.assertEqual(self.server.httpd.connections, 1)
        self.assertEqual(self.http.idle_count(), 1)

    def test_a_reused_connection_reads_for_its_new_requests_timeout(self):
        # A heartbeat probe (reads for 3 s) leaves its connection idle; the
        # route lookup that takes it over reads for its own 5 s.
        self.http.get(f"http://{self.server.addr}/health", timeout=(2, 3))
        self.assertIsNotNone(self.receiver._get_bootstrap_info_from_server(0, 0, 0, 0))
        self.assertEqual(self.server.httpd.connections, 1)
        [(_, conn)] = self.http._idle[self.server.addr]
        self.assertEqual(conn.sock.gettimeout(), 5)

    def test_a_query_is_not_held_back_by_nagle(self):
        # http.client sends a POST's body in a second segment; with Nagle on,
        # it waits for the server's delayed ACK (40 ms), as requests' does not.
        self.server.httpd.release.set()
        self.assertEqual(
            CommonKVReceiver.query_prefill_dp_ranks(self.server.addr, [1]), {"1": 0}
        )
        [(_, conn)] = self.http._idle[self.server.addr]
        self.assertTrue(conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    def test_idle_connections_per_prefill_are_capped_then_closed(self):
        self.server.httpd.release.set()
        self.server.httpd.at_once = threading.Barrier(4, timeout=_WAIT_S)
        pool = conn_mod._BootstrapFetchPool("test-cap", lane_workers={"bootstrap": 4})
        self.addCleanup(pool.shutdown, wait=False, cancel_futures=True)
        queries = [  # four at once
            pool.submit(CommonKVReceiver.query_prefill_dp_ranks, self.server.addr, [1])
            for _ in range(4)
        ]
        for future in queries:
            self.assertEqual(future.result(timeout=_WAIT_S), {"1": 0})

        self.assertEqual(self.server.httpd.connections, 4)
        self.assertEqual(self.http.idle_count(), conn_mod.BOOTSTRAP_HTTP_IDLE_MAX)
        clock = FakeClock()
        clock.now = conn_mod.time.monotonic() + conn_mod.BOOTSTRAP_HTTP_IDLE_S + 1
        with mock.patch.object(conn_mod, "time", clock):
            self.http.sweep()
        self.assertEqual(self.http.idle_count(), 0)

    def test_a_failed_prefills_idle_connections_are_closed(self):
        self.assertIsNotNone(self.receiver._get_bootstrap_info_from_server(0, 0, 0, 0))
        self.assertEqual(self.http.idle_count(), 1)
        self.http.forget(self.server.addr)
        self.assertEqual(self.http.idle_count(), 0)


class TestOverdueParallelInfoFetch(CustomTestCase):
    """A real manager and retry loop against a fetch that does not end."""

    def setUp(self):
        super().setUp()
        self.clock, self.mgr = fake_clock_and_manager(self)
        self.fetches = self.record_submissions()

    def patch_get(self, fake: FakeGet) -> FakeGet:
        return patch_get(self, fake)

    def record_submissions(self):
        """The pool's futures in submission order, to wait on each."""
        executor = self.mgr._parallel_info_executor
        original = executor.submit
        submitted = []

        def submit(fn, /, *args, **kwargs):
            submitted.append(original(fn, *args, **kwargs))
            return submitted[-1]

        executor.submit = submit
        return submitted

    def test_an_overdue_fetch_lets_a_new_one_start_and_its_late_answer_drops(self):
        fake = self.patch_get(FakeGet("block", FakeResponse(503)))
        fake.release_response = FakeResponse(200, dict(PREFILL_INFO, dp_size=9))

        self.assertFalse(self.mgr.try_ensure_parallel_info(ADDR))
        self.assertTrue(fake.entered.wait(_WAIT_S))
        self.assertTrue(self.mgr.parallel_info_fetch_in_flight(ADDR))

        self.clock.now += BOUND_S + 1
        self.assertFalse(self.mgr.parallel_info_fetch_in_flight(ADDR))
        self.assertFalse(self.mgr.try_ensure_parallel_info(ADDR))
        self.fetches[1].result(timeout=_WAIT_S)
        self.assertEqual(len(fake.calls), 2)  # a real second attempt

        # The first fetch answers late: dropped, and it does not clear the
        # marker of a newer fetch.
        self.mgr._parallel_info_inflight.add("marker-of-a-newer-fetch")
        fake.release.set()
        self.fetches[0].result(timeout=_WAIT_S)
        self.assertFalse(self.mgr.has_parallel_info(ADDR))
        self.assertIn("marker-of-a-newer-fetch", self.mgr._parallel_info_inflight)

    def test_info_landing_in_the_background_clears_its_retry_count(self):
        fake = self.patch_get(FakeGet("block"))
        patch_early_policy(self)
        queue = make_queue(self.mgr)
        queue.pending_reqs.append(
            SimpleNamespace(
                req=SimpleNamespace(
                    bootstrap_host="127.0.0.1",
                    bootstrap_port=8998,
                    bootstrap_room=1,
                    disagg_prefill_dp_rank=0,
                ),
                kv_receiver=mock.MagicMock(bootstrap_room=1),
            )
        )
        queue._resolve_pending_reqs()  # attempt 1 starts
        self.assertTrue(fake.entered.wait(_WAIT_S))
        queue._resolve_pending_reqs()  # waits for it, no news
        self.assertEqual(queue._ensure_retry_count, {ADDR: 1})

        fake.release.set()  # the info lands between two cycles
        self.fetches[0].result(timeout=_WAIT_S)
        queue._resolve_pending_reqs()

        self.assertEqual(queue.pending_reqs, [])
        self.assertEqual(queue._ensure_retry_count, {})
        self.assertEqual(queue._ensure_last_attempt_time, {})

    def test_the_abort_counts_real_attempts_only(self):
        fake = self.patch_get(FakeGet("block", FakeResponse(503)))
        queue = make_queue(self.mgr, max_retries=2)
        req = SimpleNamespace(kv_receiver=mock.MagicMock(bootstrap_room=1))
        self.mgr.record_failure = mock.MagicMock()

        queue._ensure_prefill_info({ADDR: [req]})  # attempt 1 hangs
        self.assertTrue(fake.entered.wait(_WAIT_S))
        for _ in range(BOUND_S):  # within the bound: waiting spends nothing
            self.clock.now += 1.0
            queue._ensure_prefill_info({ADDR: [req]})
        self.assertEqual(queue._ensure_retry_count[ADDR], 1)

        self.clock.now += 2.0  # overdue: attempt 2 goes out, and fails
        queue._ensure_prefill_info({ADDR: [req]})
        self.fetches[1].result(timeout=_WAIT_S)
        self.clock.now += 1.0
        queue._ensure_prefill_info({ADDR: [req]})

        req.kv_receiver.abort.assert_called_once()
        reason = self.mgr.record_failure.call_args.args[1]
        self.assertIn(f"from {ADDR} after 2 attempts", reason)
        self.assertEqual(len(fake.calls), 2)

    def test_a_healthy_fetch_does_not_wait_behind_hung_ones(self):
        hung = [f"127.0.1.{i}:8998" for i in range(8)]  # more than workers
        release = threading.Event()
        self.addCleanup(release.set)
        entered = threading.Semaphore(0)

        def get(url, timeout=None):
            if ADDR not in url:
                entered.release()
                release.wait(_WAIT_S)
                return FakeResponse(503)
            return FakeResponse(200, PREFILL_INFO)

        with mock.patch.object(conn_mod.requests, "get", get):
            for addr in hung:
                self.mgr.try_ensure_parallel_info(addr)
            for _ in hung:
                self.assertTrue(entered.acquire(timeout=_WAIT_S))
            self.mgr.try_ensure_parallel_info(ADDR)
            self.fetches[-1].result(timeout=_WAIT_S)

            self.assertTrue(self.mgr.has_parallel_info(ADDR))
            self.assertFalse(release.is_set())
            self.assertTrue(self.mgr.parallel_info_fetch_in_flight(hung[0]))
            release.set()

    def test_eviction_during_a_fetch_does_not_republish(self):
        fake = self.patch_get(FakeGet("block"))
        self.assertFalse(self.mgr.try_ensure_parallel_info(ADDR))
        self.assertTrue(fake.entered.wait(_WAIT_S))

        self.mgr._handle_node_failure(ADDR)
        # A request after the eviction fetches afresh at once.
        self.assertFalse(self.mgr.parallel_info_fetch_in_flight(ADDR))
        fake.release.set()
        self.fetches[0].result(timeout=_WAIT_S)

        self.assertFalse(self.mgr.has_parallel_info(ADDR))
        self.assertFalse(self.mgr.try_ensure_parallel_info(ADDR))
        self.fetches[1].result(timeout=_WAIT_S)
        self.assertTrue(self.mgr.has_parallel_info(ADDR))

    def test_teardown_does_not_wait_for_a_hung_fetch(self):
        fake = self.patch_get(FakeGet("block"))
        mgr = make_decode_manager(workers=1)
        mgr.try_ensure_parallel_info("127.0.0.1:1")
        self.assertTrue(fake.entered.wait(_WAIT_S))
        # Queued behind it in that prefill's lane.
        mgr._parallel_info_executor.submit(mgr._publish_parallel_info, "127.0.0.1:1")

        mgr._stop_bootstrap_fetches()

        self.assertFalse(fake.returned.is_set())
        fake.release.set()
        mgr._parallel_info_executor.shutdown(wait=True)
        # The queued fetch was cancelled, not run after the hung one.
        self.assertEqual(len(fake.calls), 1)


class TestParallelInfoThroughTheFetchPool(CustomTestCase):
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
