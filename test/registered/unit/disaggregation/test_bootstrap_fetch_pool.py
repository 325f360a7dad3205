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

import threading
import unittest
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import MethodType, SimpleNamespace
from unittest import mock

import requests

from sglang.srt.disaggregation import decode as decode_mod
from sglang.srt.disaggregation.common import conn as conn_mod
from sglang.srt.disaggregation.common.conn import CommonKVManager
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

    def test_a_plain_future_has_no_bound(self):
        with ThreadPoolExecutor(1) as plain:
            self.assertFalse(conn_mod.bootstrap_fetch_overdue(plain.submit(int)))


class SilentHandler(BaseHTTPRequestHandler):
    """Takes a request in, then answers nothing until released."""

    def do_GET(self):
        self.server.arrived.set()
        self.server.release.wait(_WAIT_S)

    def log_message(self, *args):
        pass


class TestRetiredFetchConnection(CustomTestCase):
    """A retired fetch's connection is shut down: its thread comes back while
    the peer still holds the request, not when a read times out."""

    def setUp(self):
        super().setUp()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), SilentHandler)
        self.server.daemon_threads = True
        self.server.arrived = threading.Event()
        self.server.release = threading.Event()
        self.addCleanup(self.server.server_close)
        self.addCleanup(self.server.shutdown)
        self.addCleanup(self.server.release.set)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.addr = f"127.0.0.1:{self.server.server_address[1]}"
        self.pool = conn_mod._BootstrapFetchPool("test-retire")
        self.addCleanup(self.pool.shutdown, wait=False, cancel_futures=True)

    def assert_thread_comes_back(self, fetch):
        self.assertTrue(self.server.arrived.wait(_WAIT_S))
        fetch.retire()
        with self.assertRaises(requests.RequestException):
            fetch.result(timeout=_WAIT_S)
        self.assertFalse(self.server.release.is_set())  # the peer never answered

    def test_a_retired_query_on_a_shared_session_is_cut_off(self):
        def query(addr):
            with conn_mod._bootstrap_session(addr) as session:
                # Longer than the safety net: only the shutdown ends it in time.
                return session.get(f"http://{addr}/route", timeout=10 * _WAIT_S)

        self.assert_thread_comes_back(self.pool.submit(query, self.addr))
        # Its session is not handed to the next query.
        self.assertEqual(conn_mod._idle_bootstrap_sessions.get(self.addr, []), [])

    def test_a_heartbeat_probe_left_unanswered_fails_and_is_cut_off(self):
        mgr = SimpleNamespace(
            session_pool=defaultdict(conn_mod._new_bootstrap_session),
            session_pool_lock=threading.Lock(),
        )
        probe = self.pool.submit_to(
            "health",
            conn_mod.HEARTBEAT_PROBE_TIMEOUT_S,
            MethodType(CommonKVManager._probe_prefill_health, mgr),
            self.addr,
        )
        self.assertTrue(self.server.arrived.wait(_WAIT_S))

        self.assertFalse(CommonKVManager._heartbeat_probe_answered(probe))
        self.assertFalse(probe.result(timeout=_WAIT_S))
        self.assertFalse(self.server.release.is_set())


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


class TestBootstrapSessions(CustomTestCase):
    def setUp(self):
        super().setUp()
        conn_mod._idle_bootstrap_sessions.clear()
        self.addCleanup(conn_mod._idle_bootstrap_sessions.clear)
        self.created = []
        patcher = mock.patch.object(conn_mod.requests, "Session", self.new_session)
        patcher.start()
        self.addCleanup(patcher.stop)

    def new_session(self):
        self.created.append(mock.MagicMock())
        return self.created[-1]

    def test_pool_threads_share_sessions_instead_of_holding_one_each(self):
        def use():
            with conn_mod._bootstrap_session(ADDR):
                pass

        for _ in range(8):  # eight threads, one after the other
            thread = threading.Thread(target=use)
            thread.start()
            thread.join(_WAIT_S)

        self.assertEqual(len(self.created), 1)

    def test_idle_sessions_per_prefill_are_capped(self):
        inside = threading.Barrier(6)

        def use():
            with conn_mod._bootstrap_session(ADDR):
                inside.wait(_WAIT_S)  # six queries at once

        threads = [threading.Thread(target=use) for _ in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(_WAIT_S)

        self.assertEqual(len(self.created), 6)
        idle = conn_mod._idle_bootstrap_sessions[ADDR]
        self.assertEqual(len(idle), conn_mod._BOOTSTRAP_SESSIONS_IDLE_MAX)
        closed = [s for s in self.created if s.close.called]
        self.assertEqual(len(closed), 6 - conn_mod._BOOTSTRAP_SESSIONS_IDLE_MAX)


if __name__ == "__main__":
    unittest.main()
