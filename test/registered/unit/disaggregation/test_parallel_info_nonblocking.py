"""The decode scheduler thread never waits on the prefill parallel-info fetch.

Built the way sglang's own tests of this path build their fakes, so that a new
helper call or attribute read on it fails here first:

- the fetch methods are bound one by one onto ``MagicMock(spec=CommonKVManager)``
  carrying only the state they are meant to read, with a plain single-worker
  ``ThreadPoolExecutor`` that doubles as a barrier (submit a no-op, wait);
- ``_ensure_prefill_info`` and ``_clear_ensure_state`` are bound alone onto
  ``MagicMock(spec=DecodePreallocQueue)`` with a mock kv manager, and time
  passing is ``_ensure_last_attempt_time`` moved back by one interval.

CPU-only and sleep-free: a fake ``requests.get`` signals entry on one
``threading.Event`` and blocks on another.
"""

import threading
import unittest
from concurrent.futures import ThreadPoolExecutor
from types import MethodType
from unittest import mock

from sglang.srt.disaggregation import decode as decode_mod
from sglang.srt.disaggregation.common import conn as conn_mod
from sglang.srt.disaggregation.common.conn import (
    BOOTSTRAP_QUERY_TIMEOUT_S,
    CommonKVManager,
)
from sglang.srt.disaggregation.decode import DecodePreallocQueue
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

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

FETCH_METHODS = (
    "try_ensure_parallel_info",
    "raise_parallel_info_error",
    "has_parallel_info",
    "_publish_parallel_info",
    "_fetch_parallel_info",
    "_check_parallel_info",
)


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


def patch_get(test: CustomTestCase, fake: FakeGet) -> FakeGet:
    """Stand ``fake`` in for ``requests.get`` for the rest of ``test``."""
    patcher = mock.patch.object(conn_mod.requests, "get", fake)
    patcher.start()
    test.addCleanup(patcher.stop)
    # Never leave a fetch thread blocked behind a failed test.
    test.addCleanup(fake.release.set)
    return fake


def make_spec_manager(connection_lock=None) -> mock.MagicMock:
    """MagicMock(spec=CommonKVManager) with the fetch methods bound and only
    the attributes they may read; everything else stays a mock."""
    mgr = mock.MagicMock(spec=CommonKVManager)
    for name in FETCH_METHODS:
        setattr(mgr, name, MethodType(getattr(CommonKVManager, name), mgr))
    mgr.prefill_info_table = {}
    mgr.connection_lock = connection_lock or threading.Lock()
    mgr._parallel_info_inflight = set()
    mgr._parallel_info_fatal = None
    mgr._parallel_info_executor = ThreadPoolExecutor(max_workers=1)
    set_decode_config(mgr, kv_args=mock.MagicMock(page_size=PAGE_SIZE))
    return mgr


def set_decode_config(mgr, kv_args) -> None:
    """The decode's own configuration, which the parallel-info checks and the
    rank mapping compare with the prefill's, as plain values."""
    mgr.kv_args = kv_args
    mgr.kv_cache_dtype_str = "auto"
    mgr.dcp_size = 1
    mgr.is_mla_backend = False
    mgr.is_hybrid_mla_backend = False
    mgr.kv_layout = None
    mgr.dsv41_spec_layout = None
    mgr.attn_tp_size = 1
    mgr.attn_cp_size = 1
    mgr.pp_size = 1


def drain(mgr) -> None:
    """Barrier: every fetch submitted so far has finished."""
    mgr._parallel_info_executor.submit(lambda: None).result(timeout=_WAIT_S)


class TestTryEnsureParallelInfo(CustomTestCase):
    def setUp(self):
        super().setUp()
        self.mgr = make_spec_manager()
        self.addCleanup(self.mgr._parallel_info_executor.shutdown, wait=False)

    def patch_get(self, fake: FakeGet) -> FakeGet:
        return patch_get(self, fake)

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
        self.assertIn(ADDR, self.mgr._parallel_info_inflight)
        self.assertFalse(self.mgr.has_parallel_info(ADDR))

        fake.release.set()
        drain(self.mgr)

        self.assertTrue(self.mgr.has_parallel_info(ADDR))
        self.assertEqual(self.mgr._parallel_info_inflight, set())
        info = self.mgr.prefill_info_table[ADDR]
        self.assertEqual(info.page_size, PAGE_SIZE)
        # Rank mapping is computed once, on the fetch thread, before publishing.
        self.mgr._resolve_rank_mapping.assert_called_once_with(info)
        self.assertTrue(self.mgr.try_ensure_parallel_info(ADDR))
        self.assertEqual(len(fake.calls), 1)

    def test_in_flight_reads_the_set_alone_on_a_plain_executor(self):
        # parallel_info_fetch_in_flight bound onto this fixture, with its
        # plain ThreadPoolExecutor: a set lookup, nothing else.
        self.mgr.parallel_info_fetch_in_flight = MethodType(
            CommonKVManager.parallel_info_fetch_in_flight, self.mgr
        )
        fake = self.patch_get(FakeGet("block"))
        self.assertFalse(self.mgr.parallel_info_fetch_in_flight(ADDR))
        self.assertFalse(self.mgr.try_ensure_parallel_info(ADDR))
        self.assertTrue(fake.entered.wait(_WAIT_S))
        self.assertTrue(self.mgr.parallel_info_fetch_in_flight(ADDR))
        fake.release.set()
        drain(self.mgr)
        self.assertFalse(self.mgr.parallel_info_fetch_in_flight(ADDR))

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
        self.mgr._resolve_rank_mapping.assert_called_once()

    def test_result_published_at_the_lock_is_not_fetched_again(self):
        fake = self.patch_get(FakeGet())
        real_lock = threading.Lock()
        table = {}

        class PublishOnEnter:
            """A fetch publishes between the unlocked check and the lock."""

            def __enter__(self):
                table[ADDR] = object()
                return real_lock.__enter__()

            def __exit__(self, *exc):
                return real_lock.__exit__(*exc)

        mgr = make_spec_manager(connection_lock=PublishOnEnter())
        self.addCleanup(mgr._parallel_info_executor.shutdown, wait=False)
        mgr.prefill_info_table = table

        self.assertTrue(mgr.try_ensure_parallel_info(ADDR))

        drain(mgr)
        self.assertEqual(fake.calls, [])
        self.assertEqual(mgr._parallel_info_inflight, set())

    def test_failed_fetch_publishes_nothing_and_is_retried(self):
        fake = self.patch_get(
            FakeGet(FakeResponse(503), FakeResponse(200, PREFILL_INFO))
        )

        self.assertFalse(self.mgr.try_ensure_parallel_info(ADDR))
        drain(self.mgr)

        self.assertFalse(self.mgr.has_parallel_info(ADDR))
        self.assertEqual(self.mgr._parallel_info_inflight, set())
        self.assertEqual(len(fake.calls), 1)
        self.mgr._resolve_rank_mapping.assert_not_called()

        self.assertFalse(self.mgr.try_ensure_parallel_info(ADDR))
        drain(self.mgr)

        self.assertEqual(len(fake.calls), 2)
        self.assertTrue(self.mgr.try_ensure_parallel_info(ADDR))
        self.mgr._resolve_rank_mapping.assert_called_once()

    def test_page_size_mismatch_is_raised_on_the_caller_thread(self):
        mismatched = dict(PREFILL_INFO, page_size=PAGE_SIZE * 2)
        self.patch_get(FakeGet(FakeResponse(200, mismatched)))

        self.assertFalse(self.mgr.try_ensure_parallel_info(ADDR))
        drain(self.mgr)

        self.assertFalse(self.mgr.has_parallel_info(ADDR))
        self.assertEqual(self.mgr._parallel_info_inflight, set())
        self.mgr._resolve_rank_mapping.assert_not_called()
        with self.assertRaisesRegex(RuntimeError, "Page size mismatch"):
            self.mgr.try_ensure_parallel_info(ADDR)
        with self.assertRaisesRegex(RuntimeError, "Page size mismatch"):
            self.mgr.raise_parallel_info_error()

    def test_a_malformed_answer_is_a_failed_fetch_not_a_fatal_error(self):
        self.patch_get(FakeGet(FakeResponse(200, {"dp_size": 1})))

        self.assertFalse(self.mgr.try_ensure_parallel_info(ADDR))
        drain(self.mgr)

        self.assertFalse(self.mgr.has_parallel_info(ADDR))
        self.assertIsNone(self.mgr._parallel_info_fatal)
        self.assertEqual(self.mgr._parallel_info_inflight, set())


def make_spec_queue(kv_manager, max_retries: int = 15) -> mock.MagicMock:
    """MagicMock(spec=DecodePreallocQueue) with only the retry bookkeeping
    bound and its real state."""
    queue = mock.MagicMock(spec=DecodePreallocQueue)
    for name in ("_ensure_prefill_info", "_clear_ensure_state"):
        setattr(queue, name, MethodType(getattr(DecodePreallocQueue, name), queue))
    queue.kv_manager = kv_manager
    queue._ensure_retry_count = {}
    queue._ensure_last_attempt_time = {}
    queue._ensure_retry_interval = 1.0
    queue._max_ensure_retries = max_retries
    return queue


def make_kv_manager(has=False, in_flight=False, fetched=False) -> mock.MagicMock:
    kv_manager = mock.MagicMock()
    kv_manager.has_parallel_info.return_value = has
    kv_manager.parallel_info_fetch_in_flight.return_value = in_flight
    kv_manager.try_ensure_parallel_info.return_value = fetched
    return kv_manager


def make_req():
    return mock.MagicMock()


class TestEnsurePrefillInfo(CustomTestCase):
    def pass_interval(self, queue):
        """Time passing: the last attempt moved back by one interval."""
        queue._ensure_last_attempt_time[ADDR] -= queue._ensure_retry_interval

    def test_landed_result_is_admitted_inside_the_retry_interval(self):
        kv_manager = make_kv_manager()
        queue = make_spec_queue(kv_manager)
        reqs = [make_req()]

        ready, remaining = queue._ensure_prefill_info({ADDR: reqs})
        self.assertEqual((ready, remaining), ({}, reqs))
        kv_manager.try_ensure_parallel_info.assert_called_once_with(ADDR)

        # The fetch lands well inside the 1 s retry interval.
        kv_manager.has_parallel_info.return_value = True
        ready, remaining = queue._ensure_prefill_info({ADDR: reqs})

        self.assertEqual((ready, remaining), ({ADDR: reqs}, []))
        self.assertEqual(queue._ensure_retry_count, {})
        self.assertEqual(queue._ensure_last_attempt_time, {})
        kv_manager.try_ensure_parallel_info.assert_called_once()

    def test_retry_interval_still_paces_fetch_attempts(self):
        kv_manager = make_kv_manager()
        queue = make_spec_queue(kv_manager)
        reqs = [make_req()]

        queue._ensure_prefill_info({ADDR: reqs})
        _, remaining = queue._ensure_prefill_info({ADDR: reqs})
        self.assertEqual(remaining, reqs)
        self.assertEqual(kv_manager.try_ensure_parallel_info.call_count, 1)

        self.pass_interval(queue)
        queue._ensure_prefill_info({ADDR: reqs})
        self.assertEqual(kv_manager.try_ensure_parallel_info.call_count, 2)
        self.assertEqual(queue._ensure_retry_count[ADDR], 2)

    def test_cycles_waiting_on_a_fetch_do_not_spend_the_budget(self):
        kv_manager = make_kv_manager()
        queue = make_spec_queue(kv_manager, max_retries=2)
        reqs = [make_req()]

        queue._ensure_prefill_info({ADDR: reqs})
        kv_manager.parallel_info_fetch_in_flight.return_value = True
        # Less time than a fetch may take (requests' timeout=5 per read).
        for _ in range(9):
            self.pass_interval(queue)
            ready, remaining = queue._ensure_prefill_info({ADDR: reqs})
            self.assertEqual((ready, remaining), ({}, reqs))

        self.assertEqual(queue._ensure_retry_count[ADDR], 1)
        self.assertEqual(kv_manager.try_ensure_parallel_info.call_count, 1)
        reqs[0].kv_receiver.abort.assert_not_called()

    def test_success_on_the_last_attempt_admits_its_requests(self):
        kv_manager = make_kv_manager()
        queue = make_spec_queue(kv_manager, max_retries=2)
        reqs = [make_req()]

        queue._ensure_prefill_info({ADDR: reqs})  # attempt 1 fails
        self.pass_interval(queue)
        queue._ensure_prefill_info({ADDR: reqs})  # attempt 2 is in flight
        self.assertEqual(queue._ensure_retry_count[ADDR], 2)
        reqs[0].kv_receiver.abort.assert_not_called()

        kv_manager.has_parallel_info.return_value = True  # ... and succeeds
        self.pass_interval(queue)
        ready, remaining = queue._ensure_prefill_info({ADDR: reqs})

        self.assertEqual((ready, remaining), ({ADDR: reqs}, []))
        reqs[0].kv_receiver.abort.assert_not_called()
        self.assertEqual(kv_manager.try_ensure_parallel_info.call_count, 2)

    def test_publish_before_the_abort_admits_its_requests(self):
        kv_manager = make_kv_manager()
        # The last fetch publishes right after the top-of-cycle cache check.
        kv_manager.has_parallel_info.side_effect = [False, True]
        queue = make_spec_queue(kv_manager, max_retries=1)
        queue._ensure_retry_count[ADDR] = 1
        reqs = [make_req()]

        ready, remaining = queue._ensure_prefill_info({ADDR: reqs})

        self.assertEqual((ready, remaining), ({ADDR: reqs}, []))
        reqs[0].kv_receiver.abort.assert_not_called()
        kv_manager.try_ensure_parallel_info.assert_not_called()
        self.assertNotIn(ADDR, queue._ensure_retry_count)

    def test_mismatch_on_the_last_attempt_raises_instead_of_aborting(self):
        kv_manager = make_kv_manager()
        queue = make_spec_queue(kv_manager, max_retries=1)
        reqs = [make_req()]

        queue._ensure_prefill_info({ADDR: reqs})  # the only allowed attempt
        kv_manager.raise_parallel_info_error.side_effect = RuntimeError(
            "Page size mismatch: prefill server has page_size=32"
        )
        self.pass_interval(queue)

        with self.assertRaisesRegex(RuntimeError, "Page size mismatch"):
            queue._ensure_prefill_info({ADDR: reqs})
        reqs[0].kv_receiver.abort.assert_not_called()

    def test_exhausted_budget_aborts_every_request(self):
        kv_manager = make_kv_manager()
        queue = make_spec_queue(kv_manager, max_retries=2)
        reqs = [make_req(), make_req()]

        queue._ensure_prefill_info({ADDR: reqs})
        for _ in range(2):
            self.pass_interval(queue)
            queue._ensure_prefill_info({ADDR: reqs})

        self.assertEqual(kv_manager.try_ensure_parallel_info.call_count, 2)
        for req in reqs:
            req.kv_receiver.abort.assert_called_once()
        self.assertEqual(queue._ensure_retry_count, {})
        self.assertEqual(queue._ensure_last_attempt_time, {})

    def test_abort_follows_the_last_failed_attempt_not_one_interval_later(self):
        kv_manager = make_kv_manager()
        queue = make_spec_queue(kv_manager, max_retries=2)
        early, late = [make_req()], [make_req()]

        queue._ensure_prefill_info({ADDR: early})  # attempt 1 fails
        self.pass_interval(queue)
        queue._ensure_prefill_info({ADDR: early})  # attempt 2 fails

        # The next cycle aborts at once, as 0.5.23 did after the last attempt;
        # a request added after that starts on a fresh budget.
        queue._ensure_prefill_info({ADDR: early})
        early[0].kv_receiver.abort.assert_called_once()
        queue._ensure_prefill_info({ADDR: late})
        self.assertEqual(kv_manager.try_ensure_parallel_info.call_count, 3)
        self.assertEqual(queue._ensure_retry_count[ADDR], 1)
        late[0].kv_receiver.abort.assert_not_called()

    def test_cleared_receiver_does_not_crash_the_abort(self):
        kv_manager = make_kv_manager()
        queue = make_spec_queue(kv_manager, max_retries=1)
        queue._ensure_retry_count[ADDR] = 1
        queue._ensure_last_attempt_time[ADDR] = 0.0
        cleared = mock.MagicMock(kv_receiver=None)
        live = make_req()

        ready, remaining = queue._ensure_prefill_info({ADDR: [cleared, live]})

        self.assertEqual((ready, remaining), ({}, []))
        live.kv_receiver.abort.assert_called_once()
        kv_manager.try_ensure_parallel_info.assert_not_called()
        self.assertEqual(queue._ensure_retry_count, {})

    def test_the_abort_records_the_cause(self):
        kv_manager = make_kv_manager()
        queue = make_spec_queue(kv_manager, max_retries=1)
        queue._ensure_retry_count[ADDR] = 1
        reqs = [make_req(), make_req()]

        queue._ensure_prefill_info({ADDR: reqs})

        expected = f"Could not fetch prefill parallel info from {ADDR} after 1 attempts"
        for req in reqs:
            req.kv_receiver.abort.assert_called_once()
            kv_manager.record_failure.assert_any_call(
                req.kv_receiver.bootstrap_room, mock.ANY
            )
        for call in kv_manager.record_failure.call_args_list:
            self.assertIn(expected, call.args[1])

    def test_abort_follows_the_last_failed_attempt_not_one_interval_later(self):
        kv_manager = make_kv_manager()
        queue = make_spec_queue(kv_manager, max_retries=2)
        early, late = [make_req()], [make_req()]

        queue._ensure_prefill_info({ADDR: early})  # attempt 1 fails
        self.pass_interval(queue)
        queue._ensure_prefill_info({ADDR: early})  # attempt 2 fails

        # The next cycle aborts at once, as 0.5.23 did after the last attempt;
        # a request added after that starts on a fresh budget.
        queue._ensure_prefill_info({ADDR: early})
        early[0].kv_receiver.abort.assert_called_once()
        queue._ensure_prefill_info({ADDR: late})
        self.assertEqual(kv_manager.try_ensure_parallel_info.call_count, 3)
        self.assertEqual(queue._ensure_retry_count[ADDR], 1)
        late[0].kv_receiver.abort.assert_not_called()

    def test_cleared_receiver_does_not_crash_the_abort(self):
        kv_manager = make_kv_manager()
        queue = make_spec_queue(kv_manager, max_retries=1)
        queue._ensure_retry_count[ADDR] = 1
        queue._ensure_last_attempt_time[ADDR] = 0.0
        cleared = mock.MagicMock(kv_receiver=None)
        live = make_req()

        ready, remaining = queue._ensure_prefill_info({ADDR: [cleared, live]})

        self.assertEqual((ready, remaining), ({}, []))
        live.kv_receiver.abort.assert_called_once()
        kv_manager.try_ensure_parallel_info.assert_not_called()
        self.assertEqual(queue._ensure_retry_count, {})


    def test_a_fetch_running_past_its_bound_is_a_failed_attempt(self):
        # requests' timeout bounds each read: a peer that trickles holds the
        # fetch for as long as it likes. Past the bound it counts as spent.
        kv_manager = make_kv_manager()
        queue = make_spec_queue(kv_manager, max_retries=2)
        reqs = [make_req()]
        queue._ensure_prefill_info({ADDR: reqs})
        kv_manager.parallel_info_fetch_in_flight.return_value = True
        queue._ensure_last_attempt_time[ADDR] -= BOOTSTRAP_QUERY_TIMEOUT_S

        self.assertEqual(queue._ensure_prefill_info({ADDR: reqs}), ({}, reqs))
        kv_manager.abandon_parallel_info_fetch.assert_called_once_with(ADDR)
        self.assertEqual(kv_manager.try_ensure_parallel_info.call_count, 2)
        self.assertEqual(queue._ensure_retry_count[ADDR], 2)

    def test_a_fetch_that_outlived_its_requests_still_has_its_bound(self):
        # Their bookkeeping went with them (_drop_idle_ensure_state) while the
        # fetch trickles on: a later request must not wait on it forever.
        kv_manager = make_kv_manager(in_flight=True)
        queue = make_spec_queue(kv_manager, max_retries=1)
        reqs = [make_req()]
        clock = mock.Mock()
        clock.monotonic.return_value = 1000.0
        with mock.patch.object(decode_mod, "time", clock):
            for _ in range(3 * BOOTSTRAP_QUERY_TIMEOUT_S):
                queue._ensure_prefill_info({ADDR: reqs})
                if reqs[0].kv_receiver.abort.called:
                    break
                clock.monotonic.return_value += 1.0

        # Given up after the bound, then the one allowed attempt, given up too.
        self.assertEqual(kv_manager.abandon_parallel_info_fetch.call_count, 2)
        reqs[0].kv_receiver.abort.assert_called_once()
        self.assertEqual(
            clock.monotonic.return_value, 1000.0 + 2 * BOOTSTRAP_QUERY_TIMEOUT_S
        )


if __name__ == "__main__":
    unittest.main()
