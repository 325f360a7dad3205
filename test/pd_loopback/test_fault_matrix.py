"""The fault matrix (fault_matrix.py) on real PD over loopback, Mooncake: for
each fault, before first contact and after the info was cached, nothing stalls
the decode scheduling call and every request ends, admitted or failed with a
clear error, within its retry budget.

The NIXL backend runs with ``python3 dev.py faults --backend nixl``;
``python3 dev.py faults`` also runs stock 0.5.23 and writes the
stock-vs-patched report.

Run: PYTHONPATH=<sglang variant dir>:<repo> python3 test/pd_loopback/test_fault_matrix.py
"""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fault_matrix  # noqa: E402
from fault_matrix import CACHED, FAULTS, Fault  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402
from sglang.test.test_utils import CustomTestCase  # noqa: E402

register_cpu_ci(est_time=240, suite="pd-loopback-cpu")

# Patched calls take milliseconds; one blocking fetch costs up to 5 s.
CALL_BOUND_S = 0.5
PARALLEL_INFO_FAILED = "Could not fetch prefill parallel info from <addr>"
ROUTE_FAILED = "Could not fetch bootstrap info for: prefill_dp_rank"
ROUTE_SHARED = "Could not fetch the bootstrap info of prefill <addr>"
LOST = "Lost connection with prefill instance (bootstrap_addr: <addr>)"
DP_RANK_FAILED = "Could not fetch the prefill dp rank of bootstrap_room <n> from <addr>"
ROUTE_OVERDUE = "bootstrap info lookups to prefill <addr> have not ended"
# A stuck prefill's requests: held at its share, or in transfer (0.5.23's).
HELD_AT_SHARE = "has served none of the requests this decode sent it since it last"
TIMED_OUT = "in KVPoll.WaitingForInput for prefill"
CLEAR = (
    PARALLEL_INFO_FAILED,
    ROUTE_FAILED,
    ROUTE_SHARED,
    LOST,
    DP_RANK_FAILED,
    ROUTE_OVERDUE,
    HELD_AT_SHARE,
    TIMED_OUT,
)
FETCH_BOUND_S = 10  # common/conn.py BOOTSTRAP_QUERY_TIMEOUT_S
# teardown() joins the decode listener, which sees the stop flag between polls
# of up to 500 ms (0.5.23's _make_worker_recv): measured 0.38-0.50 s, all of it
# that join. A teardown that waited on the hanging fetch would take seconds.
TEARDOWN_BOUND_S = 0.5 + CALL_BOUND_S


class TestFaultMatrixMooncake(CustomTestCase):
    BACKEND = "mooncake"

    @classmethod
    def setUpClass(cls):
        cls.matrix = fault_matrix.Matrix(cls.BACKEND).__enter__()

    @classmethod
    def tearDownClass(cls):
        cls.matrix.__exit__(None, None, None)

    def run_fault(self, fault: Fault) -> dict:
        r = self.matrix.run(fault)
        summary = {k: v for k, v in r.items() if k != "title"}
        if fault.name.startswith("mismatch"):
            # Fatal on the scheduler thread with sglang's message, as inline.
            expected = {
                "mismatch_page": "RuntimeError: Page size mismatch",
                "mismatch_dtype": "RuntimeError: KV cache dtype mismatch",
            }[fault.name]
            self.assertTrue((r["fatal"] or "").startswith(expected), summary)
        else:
            self.assertIsNone(r["fatal"], summary)
            self.assertEqual(r["pending_end"], 0, summary)
            self.assertEqual(r["healthy"]["failed"], 0, summary)
            self.assertTrue(r["healthy"]["kv_ok"], summary)
        # The scheduler thread may start a prefill's threads (at most
        # PREFILL_THREADS) and send ZMQ messages, which never wait (zmq.NOBLOCK);
        # it never makes an HTTP request, and no call of it waits on a peer.
        self.assertLess(r["longest_call_s"] or 0.0, CALL_BOUND_S, summary)
        self.assertEqual(r["scheduler_http_to_faulty"], 0, summary)
        for kind, n in r["max_in_flight"].items():
            self.assertLessEqual(n, 1, f"{kind}: {summary}")
        self.assertEqual(r["new_non_daemon_threads"], [], summary)
        for message in r["failures"]:
            self.assertTrue(
                any(m in message for m in CLEAR),
                f"unclear failure message {message!r}: {summary}",
            )
        return r

    def check_port_closed(self, r, fault):
        # Cached: the heartbeat finds the dead prefill; otherwise the fetch.
        expected = LOST if fault.phase == CACHED else PARALLEL_INFO_FAILED
        self.assertIn(expected, "".join(r["failures"]))

    def check_frozen(self, r, fault):
        expected = LOST if fault.phase == CACHED else PARALLEL_INFO_FAILED
        self.assertIn(expected, "".join(r["failures"]))
        # The request made after SIGCONT is served.
        self.assertGreaterEqual(r["faulty"]["transferred"], 1, r)

    def check_frozen_in_flight(self, r, fault):
        self.assertEqual(r["extra"]["in_flight_at_freeze"], 3, r)
        self.assertIn(LOST, "".join(r["failures"]))
        self.assertTrue(r["extra"]["served_after_resume"], r)

    def check_slow_under(self, r, fault):
        self.assertEqual(r["failed"], 0, r)

    def check_slow_over(self, r, fault):
        self.assertIn(PARALLEL_INFO_FAILED, "".join(r["failures"]))
        self.assertGreaterEqual(r["faulty"]["transferred"], 1, r)

    def check_status(self, r, fault):
        self.assertGreaterEqual(r["faulty"]["transferred"], 1, r)

    def check_malformed(self, r, fault):
        self.assertGreaterEqual(r["faulty"]["failed"], 1, r)
        self.assertTrue(r["extra"]["served_after_fix"], r)

    def check_flapping(self, r, fault):
        # Up half the time: requests to it get through, not only fail.
        self.assertGreater(r["faulty"]["total"], 4, r)
        self.assertGreater(r["faulty"]["transferred"], 0, r)

    def check_eviction(self, r, fault):
        self.assertIs(r["extra"]["stale_republished"], False, r)

    def check_restart(self, r, fault):
        self.assertTrue(r["extra"]["served_after_restart"], r)

    def check_scheduler_frozen(self, r, fault):
        # Every healthy request got KV and was served while the stuck
        # prefill's requests still held theirs; those ended with its name.
        extra = r["extra"]
        self.assertEqual(
            extra["healthy_served_while_stuck_held"], extra["healthy_total"], r
        )
        self.assertEqual(r["faulty"]["failed"], r["faulty"]["total"], r)
        failures = "".join(r["failures"])
        self.assertIn(HELD_AT_SHARE, failures)
        self.assertIn(TIMED_OUT, failures)

    def check_scheduler_frozen_prefill_complete(self, r, fault):
        # The frozen prefill's requests held no decode KV; the healthy ones
        # were served meanwhile, and every frozen one after the resume.
        extra = r["extra"]
        self.assertEqual(extra["stuck_held_most"], 0, r)
        self.assertEqual(
            extra["healthy_served_while_stuck_held"], extra["healthy_total"], r
        )
        self.assertEqual(extra["served_after_resume"], r["faulty"]["total"], r)

    def check_teardown(self, r, fault):
        extra = r["extra"]
        self.assertEqual(extra["teardown"], "teardown()", extra)
        self.assertEqual(extra["child_rc"], 0, extra)
        self.assertGreaterEqual(extra["fetches_in_flight_at_teardown"], 1, extra)
        self.assertLess(extra["teardown_s"], TEARDOWN_BOUND_S, extra)
        # The fetch it left hanging runs on a daemon thread: nothing holds up
        # interpreter exit (which takes ~3 s here either way: torch, Mooncake).
        self.assertEqual(extra["non_daemon_threads_after_teardown"], [], extra)
        self.assertLess(extra["exit_after_teardown_s"], FETCH_BOUND_S, extra)


def _make_test(fault: Fault):
    def test(self):
        r = self.run_fault(fault)
        kind = "malformed" if fault.name.startswith("malformed") else fault.name
        if fault.policy != "early":
            kind += f"_{fault.policy}"
        check = getattr(self, f"check_{kind}", None)
        if check is not None:
            check(r, fault)

    phase = "cached" if fault.phase == CACHED else "first_contact"
    policy = "" if fault.policy == "early" else f"_{fault.policy}"
    test.__name__ = f"test_{fault.name}_{phase}{policy}"
    test.__doc__ = f"{fault.title} ({fault.phase})"
    return test


for _fault in FAULTS:
    _test = _make_test(_fault)
    setattr(TestFaultMatrixMooncake, _test.__name__, _test)


if __name__ == "__main__":
    unittest.main()
