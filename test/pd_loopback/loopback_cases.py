"""Integration cases on real PD over loopback, shared by the per-backend files.

Each backend's test class starts two prefill processes (``prefill0`` is the one
that gets frozen or faulted, ``prefill1`` stays healthy) and the decode side
in-process once, and brings the decode back to "first contact" with both
prefills before every test. Every test also checks that no decode scheduling
call (``DecodeSide.step()`` or ``add()``) took longer than ``CYCLE_BOUND_S``,
far below the 5 s HTTP timeout a blocking call would cost; the fault tests
also check that the scheduler thread sent no HTTP request to the faulty
bootstrap server while it was faulty (a timing-independent check).

These cases describe the patched behaviour. Against stock 0.5.23 the
frozen/slow cases fail on the cycle bound (5 s stalls), the first-contact case
also on the failure message ("Aborted by AbortReq.").
"""

from __future__ import annotations

import os
import time

import harness

# Generous: patched cycles take milliseconds; a blocking fetch costs 5 s.
CYCLE_BOUND_S = 0.5
# Small retry budget: 2 fetch attempts, 0.2 s apart. Each attempt against a
# frozen bootstrap server takes requests' 5 s read timeout.
MAX_ENSURE_RETRIES = 2
ENSURE_RETRY_INTERVAL_S = 0.2
HTTP_TIMEOUT_S = 5.0
# Heartbeat: every 2 s (the floor), evict after 2 misses of (2 s connect,
# 3 s read). Two misses rather than one keeps a slow /health on a loaded
# machine from evicting a healthy prefill.
HEARTBEAT_ENV = {
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
}
HEARTBEAT_DETECT_S = 2 * (2 + 2 + 3) + 2
NUM_TOKENS = 24


class FastFailCluster(harness.Cluster):
    """A Cluster with the small retry budget above, and the fast heartbeat
    set in this process's environment while it runs."""

    def __init__(
        self, backend: str, num_prefills: int, allocation_policy: str = "early"
    ):
        super().__init__(
            backend,
            num_prefills,
            decode_kwargs=dict(
                max_ensure_retries=MAX_ENSURE_RETRIES,
                ensure_retry_interval=ENSURE_RETRY_INTERVAL_S,
            ),
            allocation_policy=allocation_policy,
        )
        self._saved_env = None

    def __enter__(self) -> "FastFailCluster":
        self._saved_env = {k: os.environ.get(k) for k in HEARTBEAT_ENV}
        os.environ.update(HEARTBEAT_ENV)
        return super().__enter__()

    def close(self) -> None:
        try:
            super().close()
        finally:
            for key, value in (self._saved_env or {}).items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            self._saved_env = None


class LoopbackCases:
    """Mixed into a ``CustomTestCase`` subclass that sets ``BACKEND``."""

    BACKEND: str = ""
    cluster: harness.Cluster

    @classmethod
    def setUpClass(cls):
        cls.cluster = FastFailCluster(cls.BACKEND, 2).__enter__()
        cls.decode = cls.cluster.decode
        cls.faulty, cls.healthy = cls.cluster.prefills

    @classmethod
    def tearDownClass(cls):
        cluster = getattr(cls, "cluster", None)
        if cluster is not None:
            cluster.close()

    def setUp(self):
        super().setUp()
        for p in self.cluster.prefills:
            self.assertTrue(p.alive(), f"{p.name} died:\n{p.log_tail()}")
            if p.frozen:
                p.resume()
            p.clear_fault()
        d = self.decode
        # Requests a failed test left behind must not leak into this one.
        d.abort_all()
        # Let fetches a previous test left outstanding finish, then forget
        # both prefills the way a heartbeat failure does.
        self.assertTrue(
            d.run(
                lambda: not any(
                    d.fetch_in_flight(p.addr) for p in self.cluster.prefills
                ),
                timeout_s=HTTP_TIMEOUT_S + 2,
            )
        )
        for p in self.cluster.prefills:
            d.forget_prefill(p.addr)
        self.t_start = time.perf_counter()

    def tearDown(self):
        for p in self.cluster.prefills:
            if p.frozen:
                p.resume()
        super().tearDown()

    # -- helpers ----------------------------------------------------------

    def assertCyclesBounded(self):
        d = self.decode
        calls = [c for c in d.cycles + d.adds if c.start >= self.t_start]
        self.assertGreater(len(calls), 0)
        worst = max(calls, key=lambda c: c.duration)
        self.assertLess(
            worst.duration,
            CYCLE_BOUND_S,
            f"a decode scheduling call took {worst.duration:.3f}s "
            f"(bound {CYCLE_BOUND_S}s, {len(calls)} calls; "
            f"its CPU time {worst.cpu:.3f}s, HTTP requests {worst.http})",
        )

    def assertNoSchedulerHTTP(self, prefill, until=None):
        """The scheduler thread sent no HTTP request to ``prefill``'s
        bootstrap server since the test started (up to ``until``)."""
        sent = self.decode.scheduler_http(
            port=prefill.bootstrap_port, since=self.t_start, until=until
        )
        self.assertEqual(sent, [], f"the scheduler thread called {prefill.addr}")

    def assertTransferred(self, t: harness.Tracked):
        self.assertEqual(t.state, "success", t.error)
        self.assertTrue(t.kv_ok, "KV bytes on decode differ from what prefill wrote")
        self.assertTrue(t.aux_ok, "metadata buffer did not arrive")
        result = t.prefill_job.result(timeout=10)
        self.assertEqual(result["status"], "Success", result)

    def assertServedWithoutWaiting(self, served: harness.Tracked):
        """Transferred sooner than one fetch to a frozen prefill could take."""
        self.run_until(lambda: served.finished, 30)
        self.assertTransferred(served)
        self.assertLess(
            served.t_done - served.t_add,
            HTTP_TIMEOUT_S,
            "the healthy prefill's request waited for a frozen one",
        )

    def run_until(self, predicate, timeout_s: float):
        ok = self.decode.run(predicate, timeout_s=timeout_s)
        self.assertTrue(ok, f"condition not reached within {timeout_s}s")

    def request(self, prefill, n=NUM_TOKENS) -> harness.Tracked:
        return self.cluster.request(prefill, n)

    # -- cases ------------------------------------------------------------

    def test_healthy_transfer(self):
        reqs = [self.request(p) for p in self.cluster.prefills for _ in range(2)]
        self.run_until(lambda: all(r.finished for r in reqs), 30)
        for r in reqs:
            self.assertTransferred(r)
        # Info is cached now: the next request is admitted inside add().
        again = self.request(self.healthy)
        self.assertEqual(again.state, "admitted")
        self.run_until(lambda: again.finished, 30)
        self.assertTransferred(again)
        self.assertCyclesBounded()

    def test_frozen_before_first_contact(self):
        self.faulty.freeze()
        stuck = [self.request(self.faulty) for _ in range(2)]
        served = self.request(self.healthy)

        # Admitted and transferred while the frozen prefill is unreachable.
        self.assertServedWithoutWaiting(served)
        self.assertTrue(self.faulty.frozen)
        self.assertEqual([r.state for r in stuck], ["pending"] * len(stuck))

        budget = MAX_ENSURE_RETRIES * (HTTP_TIMEOUT_S + ENSURE_RETRY_INTERVAL_S)
        self.run_until(lambda: all(r.finished for r in stuck), budget + 10)
        for r in stuck:
            self.assertEqual(r.state, "failed")
            self.assertIn(self.faulty.addr, r.error)
            self.assertIn("Could not fetch prefill parallel info", r.error)
            self.assertNotIn("Aborted by AbortReq.", r.error)
            self.assertLess(r.t_done - r.t_add, budget + 3)
        self.assertNoSchedulerHTTP(self.faulty)

        self.faulty.resume()
        self.run_until(lambda: not self.decode.fetch_in_flight(self.faulty.addr), 10)
        after = self.request(self.faulty)
        self.run_until(lambda: after.finished, 30)
        self.assertTransferred(after)
        self.assertCyclesBounded()

    def test_more_frozen_prefills_than_fetch_workers(self):
        # More than 0.5.23's default pool of 16 threads, which every prefill
        # shared: each frozen prefill now holds only threads of its own.
        holes = [self.cluster.add_blackhole() for _ in range(20)]
        try:
            stuck = [self.request(hole.addr) for hole in holes]
            served = self.request(self.healthy)

            self.assertServedWithoutWaiting(served)
            self.assertEqual([r.state for r in stuck], ["pending"] * len(stuck))
            self.assertCyclesBounded()
        finally:
            for hole in holes:
                hole.close()  # resets their connections: fetches end at once

    def test_frozen_after_info_cached(self):
        first = self.request(self.faulty)
        self.run_until(lambda: first.finished, 30)
        self.assertTransferred(first)
        self.assertIn(self.faulty.addr, self.decode.kv_manager.prefill_info_table)

        self.faulty.freeze()
        lost = self.request(self.faulty)
        # Cached info: admitted inside add(), no network on the way.
        self.assertEqual(lost.state, "admitted")
        served = self.request(self.healthy)
        self.run_until(lambda: lost.finished and served.finished, HEARTBEAT_DETECT_S)
        self.assertTransferred(served)
        self.assertEqual(lost.state, "failed")
        self.assertIn("Lost connection with prefill instance", lost.error)
        self.assertIn(self.faulty.addr, lost.error)
        self.assertNotIn(self.faulty.addr, self.decode.kv_manager.prefill_info_table)

        self.faulty.resume()
        later = self.request(self.faulty)
        # Evicted by the heartbeat: this request fetches the info again.
        self.assertEqual(later.state, "pending")
        self.run_until(lambda: later.finished, 30)
        self.assertTransferred(later)
        self.assertIn(self.faulty.addr, self.decode.kv_manager.prefill_info_table)
        self.assertCyclesBounded()

    def test_bootstrap_answers_5xx(self):
        self.faulty.set_fault("status", status=503, paths=["/route"], route_kind="info")
        refused = [self.request(self.faulty) for _ in range(2)]
        served = self.request(self.healthy)
        self.run_until(lambda: all(r.finished for r in refused + [served]), 30)
        self.assertTransferred(served)
        for r in refused:
            self.assertEqual(r.state, "failed")
            self.assertIn(self.faulty.addr, r.error)
            self.assertIn("Could not fetch prefill parallel info", r.error)
        self.assertNoSchedulerHTTP(self.faulty)

        self.faulty.clear_fault()
        after = self.request(self.faulty)
        self.run_until(lambda: after.finished, 30)
        self.assertTransferred(after)
        self.assertCyclesBounded()

    def test_slow_bootstrap(self):
        delay = 1.5
        self.faulty.set_fault(
            "delay", delay_s=delay, paths=["/route"], route_kind="info"
        )
        slow = self.request(self.faulty)
        served = self.request(self.healthy)
        self.run_until(lambda: slow.finished and served.finished, 30)
        self.assertTransferred(served)
        self.assertTransferred(slow)
        self.assertLess(
            served.t_done - served.t_add,
            delay,
            "the healthy prefill's request waited for the slow one",
        )
        self.assertGreaterEqual(slow.t_admitted - slow.t_add, delay)
        self.assertNoSchedulerHTTP(self.faulty)
        self.assertCyclesBounded()

    def test_slow_rank_lookup(self):
        """On a connection-pool miss the per-rank ``/route`` lookups that
        ``CommonKVReceiver.init`` reads run in the background too, so a slow
        answer does not stall the cycle (stock: 1 s per rank, inline)."""
        delay = 1.0
        self.faulty.set_fault(
            "delay", delay_s=delay, paths=["/route"], route_kind="rank"
        )
        slow = self.request(self.faulty)
        self.run_until(lambda: slow.finished, 30)
        self.assertTransferred(slow)
        self.assertNoSchedulerHTTP(self.faulty)
        self.assertCyclesBounded()
