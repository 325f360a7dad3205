"""The decode scheduler thread never waits on the prefill parallel-info fetch.

CPU-only and sleep-free: a fake ``requests.get`` signals entry on one
``threading.Event`` and blocks on another, a single-worker executor turns
"submit a no-op and wait for it" into a barrier, and a fake monotonic clock
drives the retry interval.
"""

import threading
import unittest
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from unittest import mock

from sglang.srt.disaggregation import decode as decode_mod
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common import conn as conn_mod
from sglang.srt.disaggregation.common.conn import (
    CommonKVManager,
    CommonKVReceiver,
    KVTransferError,
)
from sglang.srt.disaggregation.decode import DecodePreallocQueue
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=20, suite="base-a-test-cpu")

ADDR = "127.0.0.1:8998"
PAGE_SIZE = 16
# Safety net only: a broken implementation fails instead of hanging the suite.
# No test asserts on how long anything takes.
_WAIT_S = 30

PREFILL_INFO = {
    "attn_tp_size": 1,
    "attn_cp_size": 1,
    "dp_size": 1,
    "pp_size": 1,
    "page_size": PAGE_SIZE,
    "kv_cache_dtype": "auto",
    "follow_bootstrap_room": True,
}


class FakeResponse:
    def __init__(self, status_code, data=None):
        self.status_code = status_code
        self._data = data
        self.text = "" if data is not None else "Service Unavailable"

    def json(self):
        return self._data


class FakeGet:
    """Stands in for ``requests.get``. Each call takes the next scripted
    response; a call whose script entry is ``"block"`` signals ``entered`` and
    waits for ``release``, then answers with ``release_response``."""

    def __init__(self, *script):
        self.script = list(script)
        self.calls = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.returned = threading.Event()
        self.release_response = FakeResponse(200, dict(PREFILL_INFO))
        self.threads = []

    def __call__(self, url, timeout=None):
        self.calls.append(url)
        self.threads.append(threading.current_thread())
        step = self.script.pop(0) if self.script else FakeResponse(200, PREFILL_INFO)
        try:
            if step == "block":
                self.entered.set()
                if not self.release.wait(_WAIT_S):
                    raise TimeoutError("fake GET was never released")
                return self.release_response
            return step
        finally:
            self.returned.set()


def make_manager() -> CommonKVManager:
    """A decode-mode CommonKVManager with just the state the parallel-info
    path reads, and a single-worker fetch executor usable as a barrier."""
    mgr = CommonKVManager.__new__(CommonKVManager)
    mgr.kv_args = SimpleNamespace(page_size=PAGE_SIZE, state_types=[], engine_rank=0)
    mgr.kv_cache_dtype_str = "auto"
    mgr.kv_layout = None
    mgr.dsv41_spec_layout = None
    mgr.is_mla_backend = False
    mgr.is_hybrid_mla_backend = False
    mgr.attn_tp_size = 1
    mgr.attn_cp_size = 1
    mgr.attn_cp_rank = 0
    mgr.dcp_size = 1
    mgr.pp_size = 1
    mgr.pp_rank = 0
    mgr.enable_all_cp_ranks_for_transfer = False
    mgr.connection_lock = threading.Lock()
    mgr.prefill_info_table = {}
    mgr._parallel_info_executor = ThreadPoolExecutor(max_workers=1)
    mgr._parallel_info_inflight = set()
    mgr._parallel_info_fatal = None
    # Receiver bookkeeping, for the abort-reason test.
    mgr.failure_records = {}
    mgr.failure_lock = threading.Lock()
    mgr.request_status = {}
    mgr.required_prefill_response_num_table = {}
    mgr.prefill_response_tracker = {}
    mgr.addr_to_rooms_tracker = defaultdict(set)
    # Route / dp-rank fetches and heartbeat eviction.
    mgr.connection_pool = {}
    mgr._fetched_bootstrap_infos = {}
    mgr._bootstrap_infos_inflight = set()
    mgr._prefill_dp_rank_answers = {}
    mgr._prefill_dp_rank_inflight = set()
    mgr.heartbeat_failures = {}
    mgr._deferred_ack_targets = {}
    mgr._deferred_ack_poisoned_rooms = set()
    mgr._staging_outstanding = defaultdict(int)
    mgr.enable_staging = False
    return mgr


def drain(mgr: CommonKVManager) -> None:
    """Barrier: every fetch submitted so far has finished."""
    mgr._parallel_info_executor.submit(lambda: None).result(timeout=_WAIT_S)


def make_queue(kv_manager, max_retries: int = 15) -> DecodePreallocQueue:
    queue = DecodePreallocQueue.__new__(DecodePreallocQueue)
    queue.kv_manager = kv_manager
    queue._ensure_retry_count = {}
    queue._max_ensure_retries = max_retries
    queue._ensure_last_attempt_time = {}
    queue._ensure_retry_interval = 1.0
    return queue


def make_req():
    return SimpleNamespace(kv_receiver=mock.MagicMock())


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def monotonic(self):
        return self.now


class _Base(CustomTestCase):
    def setUp(self):
        super().setUp()
        self.mgr = make_manager()
        self.addCleanup(self.mgr._parallel_info_executor.shutdown, wait=False)
        self.clock = FakeClock()
        patcher = mock.patch.object(decode_mod, "time", self.clock)
        patcher.start()
        self.addCleanup(patcher.stop)

    def patch_get(self, fake: FakeGet) -> FakeGet:
        patcher = mock.patch.object(conn_mod.requests, "get", fake)
        patcher.start()
        self.addCleanup(patcher.stop)
        # Never leave a fetch thread blocked behind a failed test.
        self.addCleanup(fake.release.set)
        return fake


class TestTryEnsureParallelInfo(_Base):
    def test_cache_hit_touches_no_network(self):
        fake = self.patch_get(FakeGet())
        self.mgr.prefill_info_table[ADDR] = object()
        self.mgr._parallel_info_executor = mock.MagicMock()

        self.assertTrue(self.mgr.try_ensure_parallel_info(ADDR))

        self.assertEqual(fake.calls, [])
        self.mgr._parallel_info_executor.submit.assert_not_called()

    def test_returns_while_get_is_outstanding_then_publishes(self):
        fake = self.patch_get(FakeGet("block"))

        self.assertFalse(self.mgr.try_ensure_parallel_info(ADDR))

        # The call came back while the GET is still blocked on its thread.
        self.assertTrue(fake.entered.wait(_WAIT_S))
        self.assertFalse(fake.returned.is_set())
        self.assertIsNot(fake.threads[0], threading.current_thread())
        self.assertTrue(self.mgr.parallel_info_fetch_in_flight(ADDR))
        self.assertFalse(self.mgr.has_parallel_info(ADDR))

        fake.release.set()
        drain(self.mgr)

        self.assertTrue(self.mgr.has_parallel_info(ADDR))
        self.assertFalse(self.mgr.parallel_info_fetch_in_flight(ADDR))
        info = self.mgr.prefill_info_table[ADDR]
        # Rank mapping is computed once, on the fetch thread.
        self.assertEqual(info.target_tp_ranks, [0])
        self.assertEqual(info.required_prefill_response_num, 1)
        self.assertTrue(self.mgr.try_ensure_parallel_info(ADDR))
        self.assertEqual(len(fake.calls), 1)

    def test_repeated_calls_while_in_flight_issue_one_get(self):
        fake = self.patch_get(FakeGet("block"))

        for _ in range(5):
            self.assertFalse(self.mgr.try_ensure_parallel_info(ADDR))
        self.assertTrue(fake.entered.wait(_WAIT_S))
        fake.release.set()
        drain(self.mgr)

        self.assertEqual(len(fake.calls), 1)
        self.assertTrue(self.mgr.try_ensure_parallel_info(ADDR))
        self.assertEqual(len(fake.calls), 1)

    def test_result_published_at_the_lock_is_not_fetched_again(self):
        fake = self.patch_get(FakeGet())
        mgr = self.mgr
        real_lock = mgr.connection_lock

        class PublishOnEnter:
            """A fetch publishes between the unlocked check and the lock."""

            def __enter__(self):
                mgr.prefill_info_table[ADDR] = object()
                return real_lock.__enter__()

            def __exit__(self, *exc):
                return real_lock.__exit__(*exc)

        mgr.connection_lock = PublishOnEnter()

        self.assertTrue(mgr.try_ensure_parallel_info(ADDR))

        mgr.connection_lock = real_lock
        drain(mgr)
        self.assertEqual(fake.calls, [])
        self.assertFalse(mgr.parallel_info_fetch_in_flight(ADDR))

    def test_failed_fetch_publishes_nothing_and_is_retried(self):
        fake = self.patch_get(
            FakeGet(FakeResponse(503), FakeResponse(200, PREFILL_INFO))
        )

        self.assertFalse(self.mgr.try_ensure_parallel_info(ADDR))
        drain(self.mgr)

        self.assertFalse(self.mgr.has_parallel_info(ADDR))
        self.assertFalse(self.mgr.parallel_info_fetch_in_flight(ADDR))
        self.assertEqual(len(fake.calls), 1)

        self.assertFalse(self.mgr.try_ensure_parallel_info(ADDR))
        drain(self.mgr)

        self.assertEqual(len(fake.calls), 2)
        self.assertTrue(self.mgr.try_ensure_parallel_info(ADDR))

    def test_page_size_mismatch_is_raised_on_the_caller_thread(self):
        mismatched = dict(PREFILL_INFO, page_size=PAGE_SIZE * 2)
        self.patch_get(FakeGet(FakeResponse(200, mismatched)))

        self.assertFalse(self.mgr.try_ensure_parallel_info(ADDR))
        drain(self.mgr)

        self.assertFalse(self.mgr.has_parallel_info(ADDR))
        self.assertFalse(self.mgr.parallel_info_fetch_in_flight(ADDR))
        with self.assertRaisesRegex(RuntimeError, "Page size mismatch"):
            self.mgr.try_ensure_parallel_info(ADDR)
        with self.assertRaisesRegex(RuntimeError, "Page size mismatch"):
            self.mgr.raise_parallel_info_error()


class TestEnsurePrefillInfo(_Base):
    def test_landed_result_is_admitted_inside_the_retry_interval(self):
        fake = self.patch_get(FakeGet("block"))
        queue = make_queue(self.mgr)
        reqs = [make_req()]

        ready, remaining = queue._ensure_prefill_info({ADDR: reqs})
        self.assertEqual((ready, remaining), ({}, reqs))

        fake.release.set()
        drain(self.mgr)
        self.clock.now += 0.1  # well inside the 1 s retry interval

        ready, remaining = queue._ensure_prefill_info({ADDR: reqs})
        self.assertEqual((ready, remaining), ({ADDR: reqs}, []))
        self.assertEqual(queue._ensure_retry_count, {})
        self.assertEqual(queue._ensure_last_attempt_time, {})

    def test_retry_interval_still_paces_fetch_attempts(self):
        fake = self.patch_get(FakeGet(FakeResponse(503), FakeResponse(503)))
        queue = make_queue(self.mgr)
        reqs = [make_req()]

        queue._ensure_prefill_info({ADDR: reqs})
        drain(self.mgr)
        self.clock.now += 0.5
        _, remaining = queue._ensure_prefill_info({ADDR: reqs})
        drain(self.mgr)

        self.assertEqual(remaining, reqs)
        self.assertEqual(len(fake.calls), 1)

        self.clock.now += 0.5
        queue._ensure_prefill_info({ADDR: reqs})
        drain(self.mgr)
        self.assertEqual(len(fake.calls), 2)
        self.assertEqual(queue._ensure_retry_count[ADDR], 2)

    def test_cycles_waiting_on_a_fetch_do_not_spend_the_budget(self):
        fake = self.patch_get(FakeGet("block"))
        queue = make_queue(self.mgr, max_retries=2)
        reqs = [make_req()]

        for _ in range(10):
            ready, remaining = queue._ensure_prefill_info({ADDR: reqs})
            self.assertEqual((ready, remaining), ({}, reqs))
            self.clock.now += 5.0

        self.assertEqual(queue._ensure_retry_count[ADDR], 1)
        reqs[0].kv_receiver.abort.assert_not_called()
        fake.release.set()
        drain(self.mgr)
        self.assertEqual(len(fake.calls), 1)
        ready, _ = queue._ensure_prefill_info({ADDR: reqs})
        self.assertEqual(ready, {ADDR: reqs})

    def test_success_on_the_last_attempt_admits_its_requests(self):
        fake = self.patch_get(FakeGet(FakeResponse(503), "block"))
        queue = make_queue(self.mgr, max_retries=2)
        reqs = [make_req()]

        queue._ensure_prefill_info({ADDR: reqs})  # attempt 1 fails
        drain(self.mgr)
        self.clock.now += 1.0
        ready, remaining = queue._ensure_prefill_info({ADDR: reqs})  # attempt 2
        self.assertEqual((ready, remaining), ({}, reqs))
        reqs[0].kv_receiver.abort.assert_not_called()

        fake.release.set()
        drain(self.mgr)
        self.clock.now += 1.0
        ready, remaining = queue._ensure_prefill_info({ADDR: reqs})

        self.assertEqual((ready, remaining), ({ADDR: reqs}, []))
        reqs[0].kv_receiver.abort.assert_not_called()
        self.assertEqual(len(fake.calls), 2)

    def test_publish_before_the_abort_admits_with_real_manager(self):
        self.patch_get(FakeGet())
        queue = make_queue(self.mgr, max_retries=1)
        queue._ensure_retry_count[ADDR] = 1
        reqs = [make_req()]
        published = object()
        real_in_flight = self.mgr.parallel_info_fetch_in_flight

        def publish_then_answer(addr):
            # The last fetch publishes right after the top-of-cycle cache check.
            self.mgr.prefill_info_table[addr] = published
            return real_in_flight(addr)

        with mock.patch.object(
            self.mgr, "parallel_info_fetch_in_flight", publish_then_answer
        ):
            ready, remaining = queue._ensure_prefill_info({ADDR: reqs})

        self.assertEqual((ready, remaining), ({ADDR: reqs}, []))
        reqs[0].kv_receiver.abort.assert_not_called()
        self.assertNotIn(ADDR, queue._ensure_retry_count)

    def test_publish_before_the_abort_admits_with_mock_manager(self):
        kv_manager = mock.MagicMock()
        kv_manager.has_parallel_info.side_effect = [False, True]
        kv_manager.parallel_info_fetch_in_flight.return_value = False
        queue = make_queue(kv_manager, max_retries=1)
        queue._ensure_retry_count[ADDR] = 1
        reqs = [make_req()]

        ready, remaining = queue._ensure_prefill_info({ADDR: reqs})

        self.assertEqual((ready, remaining), ({ADDR: reqs}, []))
        reqs[0].kv_receiver.abort.assert_not_called()
        kv_manager.try_ensure_parallel_info.assert_not_called()

    def test_mismatch_on_the_last_attempt_raises_instead_of_aborting(self):
        mismatched = dict(PREFILL_INFO, page_size=PAGE_SIZE * 2)
        self.patch_get(FakeGet(FakeResponse(200, mismatched)))
        queue = make_queue(self.mgr, max_retries=1)
        reqs = [make_req()]

        queue._ensure_prefill_info({ADDR: reqs})  # the only allowed attempt
        drain(self.mgr)
        self.clock.now += 1.0

        with self.assertRaisesRegex(RuntimeError, "Page size mismatch"):
            queue._ensure_prefill_info({ADDR: reqs})
        reqs[0].kv_receiver.abort.assert_not_called()

    def test_exhausted_budget_aborts_with_the_cause(self):
        fake = self.patch_get(FakeGet(FakeResponse(503), FakeResponse(503)))
        queue = make_queue(self.mgr, max_retries=2)
        reqs = [make_req(), make_req()]

        for _ in range(3):
            queue._ensure_prefill_info({ADDR: reqs})
            drain(self.mgr)
            self.clock.now += 1.0

        self.assertEqual(len(fake.calls), 2)
        for req in reqs:
            req.kv_receiver.abort.assert_called_once()
            reason = req.kv_receiver.abort.call_args.kwargs["failure_reason"]
            self.assertIn(
                f"Could not fetch prefill parallel info from {ADDR} after 2 attempts",
                reason,
            )
        self.assertEqual(queue._ensure_retry_count, {})
        self.assertEqual(queue._ensure_last_attempt_time, {})

    def test_abort_follows_the_last_failed_attempt_not_one_interval_later(self):
        fake = self.patch_get(FakeGet(*[FakeResponse(503)] * 2))
        queue = make_queue(self.mgr, max_retries=2)
        early, late = [make_req()], [make_req()]

        queue._ensure_prefill_info({ADDR: early})  # attempt 1 fails
        drain(self.mgr)
        self.clock.now += 1.0
        queue._ensure_prefill_info({ADDR: early})  # attempt 2 fails
        drain(self.mgr)
        self.clock.now += 0.1

        # The next cycle aborts, as 0.5.23 did right after the last attempt;
        # a request added after it starts on a fresh budget at once.
        queue._ensure_prefill_info({ADDR: early})
        early[0].kv_receiver.abort.assert_called_once()
        queue._ensure_prefill_info({ADDR: late})
        drain(self.mgr)
        self.assertEqual(len(fake.calls), 3)
        self.assertEqual(queue._ensure_retry_count[ADDR], 1)
        late[0].kv_receiver.abort.assert_not_called()


class TestAbortCarriesTheCause(_Base):
    def make_receiver(self, room: int) -> CommonKVReceiver:
        receiver = CommonKVReceiver.__new__(CommonKVReceiver)
        receiver.kv_mgr = self.mgr
        receiver.bootstrap_room = room
        receiver.bootstrap_addr = ADDR
        receiver.conclude_state = None
        receiver.abort_notified = False
        self.mgr.request_status[room] = KVPoll.Bootstrapping
        self.mgr.addr_to_rooms_tracker[ADDR].add(room)
        return receiver

    def test_failure_exception_names_the_prefill_and_the_cause(self):
        self.patch_get(FakeGet(FakeResponse(503)))
        queue = make_queue(self.mgr, max_retries=1)
        receiver = self.make_receiver(room=42)
        reqs = [SimpleNamespace(kv_receiver=receiver)]

        queue._ensure_prefill_info({ADDR: reqs})
        drain(self.mgr)
        self.clock.now += 1.0
        queue._ensure_prefill_info({ADDR: reqs})

        self.assertEqual(receiver.poll(), KVPoll.Failed)
        with self.assertRaises(KVTransferError) as ctx:
            receiver.failure_exception()
        message = str(ctx.exception)
        self.assertIn(ADDR, message)
        self.assertIn("Could not fetch prefill parallel info", message)
        self.assertNotIn("Aborted by AbortReq.", message)

    def test_plain_abort_keeps_the_generic_reason(self):
        receiver = self.make_receiver(room=43)
        receiver.abort()
        with self.assertRaisesRegex(KVTransferError, "Aborted by AbortReq."):
            receiver.failure_exception()


class TestQueueCleanupWithMockManager(CustomTestCase):
    """sglang's tests drive the queue with a bare MagicMock kv_manager; a
    request whose kv_receiver a prior queue cleanup already cleared must not
    crash the abort path."""

    def test_cleared_receiver_does_not_crash_abort(self):
        kv_manager = mock.MagicMock()
        kv_manager.has_parallel_info.return_value = False
        kv_manager.parallel_info_fetch_in_flight.return_value = False
        queue = make_queue(kv_manager, max_retries=1)
        queue._ensure_retry_count[ADDR] = 1
        queue._ensure_last_attempt_time[ADDR] = 0.0
        cleared = SimpleNamespace(kv_receiver=None)
        live = make_req()

        ready, remaining = queue._ensure_prefill_info({ADDR: [cleared, live]})

        self.assertEqual((ready, remaining), ({}, []))
        live.kv_receiver.abort.assert_called_once()
        kv_manager.try_ensure_parallel_info.assert_not_called()
        self.assertEqual(queue._ensure_retry_count, {})


if __name__ == "__main__":
    unittest.main()
