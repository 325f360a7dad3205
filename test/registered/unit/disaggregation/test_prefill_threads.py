"""One decode, many prefills: a sick prefill holds only its own threads.

- _PrefillThreads runs each call to a prefill on that prefill's threads, at
  most PREFILL_THREADS of them: however many prefills hang, another's call
  starts at once; threads end when idle; shutdown never waits on a prefill.
- The heartbeat probes every prefill at once, so frozen prefills are all
  declared failed in the same round however many they are, and a probe that
  hangs is a miss that no second probe queues behind.

CPU-only, no sleeps: calls are held on ``threading.Event`` and meet at a
``threading.Barrier``.
"""

import concurrent.futures
import threading
import unittest
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from unittest import mock

from sglang.srt.disaggregation.common import conn as conn_mod
from sglang.srt.disaggregation.common.conn import PREFILL_THREADS, _PrefillThreads
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from test_no_network_on_scheduler_thread import FakeClock, make_decode_manager

register_cpu_ci(est_time=3, suite="base-a-test-cpu")

_WAIT_S = 30


class Hang:
    """A call that signals it started and waits until released."""

    def __init__(self):
        self.started = threading.Semaphore(0)
        self.release = threading.Event()
        self.threads = set()

    def __call__(self, addr, value=None):
        self.threads.add(threading.current_thread())
        self.started.release()
        self.release.wait(_WAIT_S)
        return value


class SignallingCondition(threading.Condition):
    """A prefill's wake-up condition that tells when a thread waits on it."""

    def __init__(self, lock):
        super().__init__(lock)
        self.waiting = threading.Event()

    def wait(self, timeout=None):
        self.waiting.set()
        return super().wait(timeout)


class TestPrefillThreads(CustomTestCase):
    def setUp(self):
        super().setUp()
        self.shared = ThreadPoolExecutor(max_workers=1)
        self.pool = _PrefillThreads(self.shared, idle_s=0)
        self.addCleanup(self.pool.shutdown, wait=False, cancel_futures=True)
        self.hang = Hang()
        self.addCleanup(self.hang.release.set)

    def test_hung_prefills_hold_only_their_own_threads(self):
        hung = [f"10.0.0.{i}:8998" for i in range(16)]
        for addr in hung:
            for _ in range(PREFILL_THREADS + 3):
                self.pool.submit(self.hang, addr)
        for _ in range(len(hung) * PREFILL_THREADS):
            self.assertTrue(self.hang.started.acquire(timeout=_WAIT_S))
        # Only PREFILL_THREADS of each prefill's calls started; the rest wait.
        self.assertFalse(self.hang.started.acquire(blocking=False))
        self.assertEqual(len(self.hang.threads), len(hung) * PREFILL_THREADS)

        healthy = self.pool.submit(lambda addr: addr.upper(), "healthy:1")
        self.assertEqual(healthy.result(timeout=_WAIT_S), "HEALTHY:1")

    def test_results_errors_and_calls_without_an_address(self):
        self.assertEqual(
            self.pool.submit(lambda addr, x: x + 1, "a:1", 1).result(_WAIT_S), 2
        )
        failing = self.pool.submit(lambda addr: {}[addr], "a:1")
        self.assertIsInstance(failing.exception(_WAIT_S), KeyError)
        # A PD-retract /generate (its first argument a receiver) is 0.5.23's.
        with mock.patch.object(self.shared, "submit", wraps=self.shared.submit) as s:
            receiver = SimpleNamespace(bootstrap_addr="a:1")
            self.pool.submit(lambda r: r, receiver).result(_WAIT_S)
        s.assert_called_once()

    def test_threads_end_when_idle(self):
        for i in range(50):  # prefills that come and go
            self.pool.submit(lambda addr: None, f"10.1.0.{i}:8998").result(_WAIT_S)
        for thread in threading.enumerate():
            if thread.name.startswith("pd-prefill-"):
                thread.join(_WAIT_S)
        self.assertEqual(
            [t.name for t in threading.enumerate() if t.name.startswith("pd-prefill-")],
            [],
        )
        self.assertEqual(self.pool._tasks, {})

    def test_two_calls_for_one_idle_thread_start_a_second_thread(self):
        pool = _PrefillThreads(self.shared, idle_s=_WAIT_S)
        self.addCleanup(pool.shutdown, wait=False, cancel_futures=True)
        gate = threading.Event()
        first = pool.submit(lambda addr: gate.wait(_WAIT_S), "a:1")
        wake = pool._wake["a:1"] = SignallingCondition(pool._lock)
        gate.set()
        self.assertTrue(first.result(_WAIT_S))
        self.assertTrue(wake.waiting.wait(_WAIT_S))  # its thread is idle

        # The idle thread takes one; the other must not queue behind it.
        pool.submit(self.hang, "a:1")
        quick = pool.submit(lambda addr: addr, "a:1")
        self.assertEqual(quick.result(_WAIT_S), "a:1")
        self.assertTrue(self.hang.started.acquire(timeout=_WAIT_S))

    def test_shutdown_waits_on_no_prefill_and_cancels_what_is_queued(self):
        running = self.pool.submit(self.hang, "a:1")
        self.pool.submit(self.hang, "a:1")
        queued = self.pool.submit(self.hang, "a:1")
        self.assertTrue(self.hang.started.acquire(timeout=_WAIT_S))
        self.assertTrue(self.hang.started.acquire(timeout=_WAIT_S))

        self.pool.shutdown(wait=True, cancel_futures=True)

        self.assertTrue(queued.cancelled())
        self.assertFalse(running.done())
        with self.assertRaises(RuntimeError):
            self.pool.submit(self.hang, "a:1")


class FakeSession:
    def __init__(self, get):
        self.get = get


class TestHeartbeatProbesEveryPrefillAtOnce(CustomTestCase):
    PREFILLS = 8

    def setUp(self):
        super().setUp()
        self.mgr = make_decode_manager()
        self.mgr._parallel_info_executor = _PrefillThreads(
            ThreadPoolExecutor(max_workers=1)
        )
        self.addCleanup(
            self.mgr._parallel_info_executor.shutdown, wait=False, cancel_futures=True
        )
        self.addrs = [f"127.0.2.{i}:8998" for i in range(self.PREFILLS)]
        for addr in self.addrs:
            self.mgr.prefill_info_table[addr] = object()
        self.mgr.heartbeat_interval = 0
        self.mgr.max_failures = 2
        self.mgr._heartbeat_shutdown = threading.Event()
        self.addCleanup(self.mgr._heartbeat_shutdown.set)

    def probes(self, get):
        """``get(url)`` answers every heartbeat probe."""
        self.mgr.session_pool = defaultdict(lambda: FakeSession(get))

    def run_heartbeat(self, until: threading.Event):
        thread = self.mgr._start_heartbeat_checker_thread()
        self.addCleanup(thread.join, _WAIT_S)
        self.assertTrue(until.wait(_WAIT_S))
        self.mgr._heartbeat_shutdown.set()

    def test_a_round_probes_every_prefill_concurrently(self):
        # Every probe waits until all of them are in flight at once: probed
        # one after the other, the first would never get past this.
        all_in_flight = threading.Barrier(self.PREFILLS, timeout=_WAIT_S)

        def get(url, **kwargs):
            all_in_flight.wait()
            return SimpleNamespace(status_code=200)

        self.probes(get)
        answered = []
        all_answered = threading.Event()

        def on_success(addr):
            answered.append(addr)
            if len(set(answered)) == self.PREFILLS:
                all_answered.set()

        self.mgr._on_heartbeat_success = on_success
        with mock.patch.object(conn_mod, "HEARTBEAT_PROBE_TIMEOUT_S", _WAIT_S):
            self.run_heartbeat(all_answered)
        self.assertEqual(sorted(answered[: self.PREFILLS]), sorted(self.addrs))

    def test_a_probe_never_waits_behind_the_decodes_calls_to_its_prefill(self):
        # A live prefill that is slow to answer the decode's own calls (route
        # setups, dp-rank queries) has its threads busy and more calls queued:
        # its /health probe is answered at once all the same.
        addr = self.addrs[0]
        hang = Hang()
        self.addCleanup(hang.release.set)
        for _ in range(PREFILL_THREADS + 6):
            self.mgr._parallel_info_executor.submit(hang, addr)
        for _ in range(PREFILL_THREADS):
            self.assertTrue(hang.started.acquire(timeout=_WAIT_S))
        self.probes(lambda url, **kwargs: SimpleNamespace(status_code=200))
        answered = threading.Event()
        self.mgr._on_heartbeat_success = lambda a: a == addr and answered.set()
        self.mgr._handle_node_failure = mock.MagicMock()

        with mock.patch.object(conn_mod, "HEARTBEAT_PROBE_TIMEOUT_S", _WAIT_S):
            self.run_heartbeat(answered)

        self.assertFalse(hang.release.is_set())
        self.mgr._handle_node_failure.assert_not_called()
        # Its own threads, and one for the probes.
        threads = [t for t in threading.enumerate() if addr in t.name]
        self.assertLessEqual(len(threads), PREFILL_THREADS + 1)

    def test_frozen_prefills_are_all_declared_failed_in_one_round(self):
        release = threading.Event()
        self.addCleanup(release.set)
        calls = defaultdict(int)
        entered = threading.Semaphore(0)

        def get(url, **kwargs):  # a frozen prefill: no answer
            calls[url] += 1
            entered.release()
            release.wait(_WAIT_S)
            return SimpleNamespace(status_code=200)

        self.probes(get)
        failed = []
        all_failed = threading.Event()

        def on_failure(addr):
            self.mgr.prefill_info_table.pop(addr)
            failed.append(addr)
            if len(failed) == self.PREFILLS:
                all_failed.set()

        self.mgr._handle_node_failure = on_failure
        # A probe not answered by its deadline is a miss.
        with mock.patch.object(conn_mod, "HEARTBEAT_PROBE_TIMEOUT_S", 0):
            self.run_heartbeat(all_failed)
        self.assertEqual(sorted(failed), sorted(self.addrs))
        # Two misses each, one probe each: none queued behind a hung one.
        for _ in self.addrs:
            self.assertTrue(entered.acquire(timeout=_WAIT_S))
        self.assertEqual(set(calls.values()), {1})
        self.assertFalse(release.is_set())

    def test_a_probe_thread_that_cannot_start_is_a_miss(self):
        # Review 14 F4: at the thread limit (many hung prefills hold threads),
        # a probe's future carries the start's RuntimeError; reading its
        # result ended the heartbeat thread, and no prefill was failed again.
        dead = self.addrs[0]
        for addr in self.addrs[1:]:
            del self.mgr.prefill_info_table[addr]
        self.probes(lambda url, **kwargs: SimpleNamespace(status_code=503))
        declared = threading.Event()
        self.mgr._handle_node_failure = lambda addr: declared.set()
        real_start = threading.Thread.start
        failures = [RuntimeError("can't start new thread")]

        def start(thread):
            if thread.name.startswith("pd-prefill-") and failures:
                raise failures.pop()
            return real_start(thread)

        with mock.patch.object(threading.Thread, "start", start):
            self.run_heartbeat(declared)
        self.assertEqual(failures, [])

    def test_a_dead_prefill_is_declared_as_soon_among_frozen_ones_as_alone(self):
        # P12b: a round waits for its probes up to HEARTBEAT_PROBE_TIMEOUT_S,
        # all of it when one prefill is frozen. If the next round then began a
        # whole interval later, a dead prefill's two misses took 14.1 s among
        # 31 frozen prefills against 8.0 s alone; judged at the end of that
        # wait, 10.9 s. Fake clock: a wait for the frozen probe takes its
        # whole timeout.
        frozen, dead = self.addrs[:2]
        for addr in self.addrs[2:]:
            del self.mgr.prefill_info_table[addr]
        release = threading.Event()
        self.addCleanup(release.set)

        def get(url, **kwargs):
            if frozen in url:
                release.wait(_WAIT_S)
            raise ConnectionRefusedError(url)

        self.probes(get)
        clock = FakeClock()
        clock.now = 0.0
        real_as_completed = concurrent.futures.as_completed

        def as_completed(futures, timeout):
            # The dead prefill's probe ends at once; the frozen one's never.
            ended = real_as_completed(futures, _WAIT_S)
            for _ in range(len(futures) - 1):
                yield next(ended)
            clock.now += timeout
            raise concurrent.futures.TimeoutError()

        def wait(futures, timeout):  # the same, for rounds judged at their end
            try:
                list(as_completed(futures, timeout))
            except concurrent.futures.TimeoutError:
                pass

        class Shutdown(threading.Event):
            def wait(self, timeout=None):
                clock.now += timeout
                return self.is_set()

        declared = {}
        both = threading.Event()

        def on_failure(addr):
            declared[addr] = clock.now
            self.mgr.prefill_info_table.pop(addr)
            if len(declared) == 2:
                both.set()

        self.mgr._handle_node_failure = on_failure
        self.mgr.heartbeat_interval = 5
        self.mgr._heartbeat_shutdown = Shutdown()
        with mock.patch.object(conn_mod, "time", clock), mock.patch.object(
            conn_mod.concurrent.futures, "as_completed", as_completed
        ), mock.patch.object(conn_mod.concurrent.futures, "wait", wait):
            self.run_heartbeat(both)

        # Rounds at 5 and 10 s: the dead prefill is declared when its second
        # probe ends, at 10 s as alone; the frozen one 5 s later, at the end of
        # its second probe's wait.
        self.assertEqual(declared, {frozen: 15.0, dead: 10.0})


if __name__ == "__main__":
    unittest.main()
