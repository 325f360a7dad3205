"""The decode's PD tables in its log: sizes, when they changed, at most once per
SGLANG_LOG_SCHEDULER_STATUS_INTERVAL, so that an operator sees a table that
does not drain back when the server goes idle.

Fixture 5's shape (``DecodePreallocQueue.__new__``) on the decode manager of
test_no_network_on_scheduler_thread.py; time is a FakeClock.
"""

import json
import threading
import unittest
from types import SimpleNamespace

from sglang.srt.disaggregation import decode as decode_mod
from sglang.srt.disaggregation.common import conn as conn_mod
from sglang.srt.disaggregation.common.conn import CommonKVManager
from sglang.srt.disaggregation.decode import DecodeRequest
from sglang.srt.disaggregation.fake.conn import FakeKVManager
from sglang.srt.environ import envs
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from test_no_network_on_scheduler_thread import (
    drain,
    fake_clock_and_manager,
    make_queue,
    make_req,
)
from test_parallel_info_nonblocking import ADDR

register_cpu_ci(est_time=2, suite="base-a-test-cpu")

INTERVAL = 10.0


class TestDecodeStateLog(CustomTestCase):
    def setUp(self):
        self.clock, self.mgr = fake_clock_and_manager(self)
        self.queue = make_queue(self.mgr)
        self.queue.held_rebootstrap_reqs = []
        override = envs.SGLANG_LOG_SCHEDULER_STATUS_INTERVAL.override(INTERVAL)
        override.__enter__()
        self.addCleanup(override.__exit__, None, None, None)

    def logged_after(self, seconds: float):
        """The state line logged by one call ``seconds`` later, or None."""
        self.clock.now += seconds
        with self.assertLogs(decode_mod.logger, "INFO") as cm:
            decode_mod.logger.info("marker")
            self.queue._log_disaggregation_state()
        lines = [r.getMessage() for r in cm.records if r.getMessage() != "marker"]
        self.assertLessEqual(len(lines), 1, lines)
        if not lines:
            return None
        prefix = "PD decode state: "
        self.assertTrue(lines[0].startswith(prefix), lines[0])
        return json.loads(lines[0][len(prefix) :])

    def test_changed_tables_are_logged_once_per_interval(self):
        # The first call only starts the clock.
        self.assertIsNone(self.logged_after(0))
        state = self.logged_after(INTERVAL)
        self.assertEqual(set(state.values()), {0}, state)

        self.mgr._orphaned_rooms.add_endpoints(ADDR, {("127.0.0.1", 7000)})
        self.mgr._orphaned_rooms.add(ADDR, [11, 12])
        self.mgr.connection_pool[f"{ADDR}_0_0_0"] = {"rank_ip": "127.0.0.1"}
        self.queue._ensure_retry_count[ADDR] = 3
        self.queue._ensure_last_attempt_time[ADDR] = self.clock.now
        self.assertIsNone(self.logged_after(INTERVAL / 2))  # not due yet
        state = self.logged_after(INTERVAL / 2)
        self.assertEqual(state["orphaned_rooms"], 2)
        self.assertEqual(state["route_cache"], 1)
        self.assertEqual(state["ensure_retry_count"], 1)
        self.assertEqual(state["ensure_last_attempt_time"], 1)
        # Unchanged: nothing to say.
        self.assertIsNone(self.logged_after(INTERVAL))

        self.mgr._orphaned_rooms.take(ADDR)  # 3 sends, then forgotten
        self.mgr._orphaned_rooms.take(ADDR)
        self.mgr._orphaned_rooms.take(ADDR)
        self.queue._ensure_retry_count.clear()
        self.queue._ensure_last_attempt_time.clear()
        state = self.logged_after(INTERVAL)
        self.assertEqual(state["orphaned_rooms"], 0)
        self.assertEqual(state["ensure_retry_count"], 0)

    def test_a_running_fetch_is_counted_until_it_ends(self):
        self.logged_after(0)
        self.logged_after(INTERVAL)
        started, release = threading.Event(), threading.Event()

        def fetch(addr):
            started.set()
            release.wait(30)

        self.mgr._parallel_info_executor.submit(fetch, ADDR)
        self.assertTrue(started.wait(30))
        state = self.logged_after(INTERVAL)
        self.assertEqual(state["fetches_in_flight"], 1)
        self.assertGreaterEqual(state["fetch_threads"], 1)
        release.set()
        drain(self.mgr)
        self.assertEqual(self.logged_after(INTERVAL)["fetches_in_flight"], 0)


class TestFetchesInFlight(CustomTestCase):
    def test_every_task_is_counted(self):
        pool = conn_mod._BootstrapFetchPool("test-count")
        self.addCleanup(pool.shutdown, wait=False, cancel_futures=True)
        release = threading.Event()
        self.addCleanup(release.set)
        # A dp-rank query takes a list, a rebootstrap call a dict payload:
        # neither hashes, and both count.
        tasks = [
            pool.submit(lambda addr, rooms: release.wait(30), ADDR, [1]),
            pool.submit(
                lambda receiver, payload: release.wait(30),
                SimpleNamespace(bootstrap_addr=ADDR),
                {"rid": "r"},
            ),
            pool.submit(lambda addr: release.wait(30), ADDR),
        ]
        self.assertEqual(pool.in_flight(), 3)
        release.set()
        for task in tasks:
            task.result(timeout=30)
        self.assertEqual(pool.in_flight(), 0)


class TestEveryTransferBackend(CustomTestCase):
    """The decode's per-cycle work reads nothing a kv manager of another
    backend lacks: FakeKVManager (--disaggregation-transfer-backend fake) has
    none of CommonKVManager's tables, and a manager made with
    CommonKVManager.__new__ none of its instance attributes."""

    def managers(self):
        return {
            "fake": FakeKVManager.__new__(FakeKVManager),
            "CommonKVManager.__new__": CommonKVManager.__new__(CommonKVManager),
        }

    def test_the_cycle_and_state_log_run(self):
        for name, manager in self.managers().items():
            with self.subTest(manager=name):
                clock, _ = fake_clock_and_manager(self)
                queue = make_queue(manager)
                queue.held_rebootstrap_reqs = []
                real = DecodeRequest(req=make_req(8998, 1), kv_receiver=None)

                queue._resolve_pending_reqs()  # nothing pending
                self.assertFalse(queue._prefill_unreachable(real))
                with envs.SGLANG_LOG_SCHEDULER_STATUS_INTERVAL.override(INTERVAL):
                    queue._log_disaggregation_state()  # starts the clock
                    clock.now += INTERVAL
                    with self.assertLogs(decode_mod.logger, "INFO") as cm:
                        queue._log_disaggregation_state()
                self.assertIn('"pending_reqs": 0', cm.output[0])


if __name__ == "__main__":
    unittest.main()
