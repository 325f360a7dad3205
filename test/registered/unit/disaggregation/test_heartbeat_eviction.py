"""A prefill the heartbeat declares failed: only its own routes go, a fetch
still running for it publishes nothing, and teardown waits on no fetch.

The decode manager of test_no_network_on_scheduler_thread.py, with
``requests.get`` standing in for the prefill's bootstrap server. CPU-only,
no sleeps: a fetch is held on a ``threading.Event``.
"""

import threading
import unittest
from unittest import mock

from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from test_no_network_on_scheduler_thread import make_decode_manager
from test_parallel_info_nonblocking import ADDR, FakeGet, conn_mod, patch_get

register_cpu_ci(est_time=3, suite="base-a-test-cpu")

_WAIT_S = 30


class TestNodeFailure(CustomTestCase):
    def setUp(self):
        super().setUp()
        self.mgr = make_decode_manager()
        self.addCleanup(
            self.mgr._parallel_info_executor.shutdown, wait=False, cancel_futures=True
        )

    def test_failure_of_port_80_keeps_port_8080_cached(self):
        self.mgr.connection_pool["host:80_0_0_0"] = []
        self.mgr.connection_pool["host:8080_0_0_0"] = []
        self.mgr.prefill_info_table["host:8080"] = object()

        self.mgr._handle_node_failure("host:80")

        self.assertNotIn("host:80_0_0_0", self.mgr.connection_pool)
        self.assertIn("host:8080_0_0_0", self.mgr.connection_pool)
        self.assertIn("host:8080", self.mgr.prefill_info_table)

    def test_a_fetch_running_when_its_prefill_fails_does_not_publish(self):
        fake = patch_get(self, FakeGet("block"))
        self.assertFalse(self.mgr.try_ensure_parallel_info(ADDR))
        self.assertTrue(fake.entered.wait(_WAIT_S))

        self.mgr._handle_node_failure(ADDR)
        # A request after the failure fetches afresh at once.
        self.assertFalse(self.mgr.parallel_info_fetch_in_flight(ADDR))
        fake.release.set()
        self.mgr._parallel_info_executor.futures[0].result(timeout=_WAIT_S)

        self.assertFalse(self.mgr.has_parallel_info(ADDR))
        self.assertFalse(self.mgr.try_ensure_parallel_info(ADDR))
        self.mgr._parallel_info_executor.futures[1].result(timeout=_WAIT_S)
        self.assertTrue(self.mgr.has_parallel_info(ADDR))

    def test_a_failure_of_another_prefill_keeps_this_ones_fetch(self):
        # With a fleet's churn, some prefill fails every few seconds: a healthy
        # one's fetch must still publish, or its requests refetch without end.
        fake = patch_get(self, FakeGet("block"))
        self.assertFalse(self.mgr.try_ensure_parallel_info(ADDR))
        self.assertTrue(fake.entered.wait(_WAIT_S))
        self.mgr._handle_node_failure("10.9.9.9:8998")
        fake.release.set()
        self.mgr._parallel_info_executor.futures[0].result(timeout=_WAIT_S)
        self.assertTrue(self.mgr.has_parallel_info(ADDR))

    def test_a_fetch_from_before_the_failure_ending_after_a_newer_one_started(self):
        # The failure lets the next request fetch at once, so the old fetch
        # can end while the new one runs: it must still publish nothing.
        old, new = FakeGet("block"), FakeGet("block")
        fetches = iter([old, new, FakeGet()])
        self.addCleanup(old.release.set)
        self.addCleanup(new.release.set)
        patcher = mock.patch.object(
            conn_mod.requests, "get", lambda url, timeout=None: next(fetches)(url)
        )
        patcher.start()
        self.addCleanup(patcher.stop)
        self.assertFalse(self.mgr.try_ensure_parallel_info(ADDR))
        self.assertTrue(old.entered.wait(_WAIT_S))
        self.mgr._handle_node_failure(ADDR)
        self.assertFalse(self.mgr.try_ensure_parallel_info(ADDR))
        self.assertTrue(new.entered.wait(_WAIT_S))

        old.release.set()
        self.mgr._parallel_info_executor.futures[0].result(timeout=_WAIT_S)
        self.assertFalse(self.mgr.has_parallel_info(ADDR))

        new.release.set()
        self.mgr._parallel_info_executor.futures[1].result(timeout=_WAIT_S)
        # The old fetch may have taken the new one's in-flight marker with it;
        # then the next request fetches once more.
        if not self.mgr.try_ensure_parallel_info(ADDR):
            self.mgr._parallel_info_executor.futures[-1].result(timeout=_WAIT_S)
        self.assertTrue(self.mgr.has_parallel_info(ADDR))


class TestTeardown(CustomTestCase):
    def test_teardown_does_not_wait_for_a_hung_fetch(self):
        fake = patch_get(self, FakeGet("block"))
        mgr = make_decode_manager(workers=1)
        mgr._heartbeat_shutdown = heartbeat_shutdown = threading.Event()
        mgr.try_ensure_parallel_info("127.0.0.1:1")
        self.assertTrue(fake.entered.wait(_WAIT_S))
        # Queued behind it.
        mgr._parallel_info_executor.submit(mgr._publish_parallel_info, "127.0.0.1:1")

        mgr._stop_bootstrap_fetches()

        self.assertFalse(fake.returned.is_set())
        self.assertTrue(heartbeat_shutdown.is_set())
        fake.release.set()
        mgr._parallel_info_executor.shutdown(wait=True)
        # The queued fetch was cancelled, not run after the hung one.
        self.assertEqual(len(fake.calls), 1)


if __name__ == "__main__":
    unittest.main()
