"""A prefill that answers but does not progress holds only its share of the
decode: no prefill's transfers that have not arrived starve another prefill's
requests of KV or metadata slots, and nothing it held is lost or overwritten.

A prefill whose scheduler hangs keeps its bootstrap server (and so the
heartbeat) answering, and the decode admits its requests: their KV is
preallocated and waits for transfers that do not come. _PrefillAdmission marks
such a prefill stuck (no new KV, no decode headroom held), caps what any
prefill holds to its share while others wait, and gives up on a stuck
prefill's requests after a longer bound, fencing their pages until it
acknowledges the abort.

Built like sglang's tests of this queue: DecodePreallocQueue.__new__ /
DecodeTransferQueue.__new__ with SimpleNamespace collaborators (fixture 5 of
design.md). CPU-only, no sleeps: time is passed in, or a FakeClock.
"""

import unittest
from types import SimpleNamespace
from unittest import mock

from sglang.srt.disaggregation import decode as decode_mod
from sglang.srt.disaggregation.decode import (
    DecodePreallocQueue,
    DecodeRequest,
    DecodeTransferQueue,
    _PrefillAdmission,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from test_no_network_on_scheduler_thread import FakeClock

register_cpu_ci(est_time=2, suite="base-a-test-cpu")

STUCK_S, GIVE_UP_S = 10.0, 30.0
HEALTHY, STUCK = "10.0.0.1:8998", "10.0.0.2:8998"
TOKENS = 4096  # the decode's KV, and 512 of headroom per request
SLOTS = 64


class TestStuckMark(CustomTestCase):
    def setUp(self):
        super().setUp()
        self.admission = _PrefillAdmission(STUCK_S, GIVE_UP_S)

    def test_no_progress_marks_it_stuck_and_a_transfer_that_ends_unmarks_it(self):
        held = {STUCK: [2, 1060]}
        self.assertEqual(self.admission.update(held, now=0.0), [])
        self.admission.update(held, now=STUCK_S - 0.1)
        self.assertEqual(self.admission.stuck, {})

        with self.assertLogs(decode_mod.logger, "WARNING") as logs:
            self.admission.update(held, now=STUCK_S)
        self.assertIn(STUCK, self.admission.stuck)
        self.assertIn(f"Prefill {STUCK} is stuck", logs.output[0])
        self.assertIn("1060 tokens", logs.output[0])

        with self.assertLogs(decode_mod.logger, "INFO") as logs:
            self.admission.progress(STUCK, now=STUCK_S + 2)
        self.assertEqual(self.admission.stuck, {})
        self.assertIn("makes progress again", logs.output[0])
        # Its clock starts again from that progress.
        self.admission.update(held, now=2 * STUCK_S + 1)
        self.assertEqual(self.admission.stuck, {})

    def test_a_slow_but_progressing_prefill_is_never_stuck(self):
        # One transfer ends every 0.9 of the bound; it always holds three.
        now = 0.0
        for _ in range(20):
            self.admission.update({STUCK: [3, 1500]}, now)
            now += 0.9 * STUCK_S
            self.admission.update({STUCK: [3, 1500]}, now)
            self.admission.progress(STUCK, now)
            self.assertEqual(self.admission.stuck, {})
        self.assertEqual(self.admission.update({STUCK: [3, 1500]}, now), [])

    def test_its_requests_are_given_up_after_the_longer_bound(self):
        held = {STUCK: [1, 530]}
        self.admission.update(held, now=0.0)
        self.assertEqual(self.admission.update(held, now=GIVE_UP_S - 1), [])
        self.assertEqual(self.admission.update(held, now=GIVE_UP_S), [STUCK])

    def test_a_prefill_that_holds_nothing_has_no_clock(self):
        self.admission.update({STUCK: [1, 530]}, now=0.0)
        self.admission.update({}, now=STUCK_S)  # its one transfer went away
        self.admission.update({STUCK: [1, 530]}, now=STUCK_S + 1)
        self.assertEqual(self.admission.stuck, {})


class TestShare(CustomTestCase):
    def admission(self, held, waiting, demand=None):
        admission = _PrefillAdmission(STUCK_S, GIVE_UP_S)
        admission.held = held
        admission.capacity = (TOKENS, SLOTS)
        admission.waiting = set(waiting)
        admission.demand = set(demand if demand is not None else set(held) | waiting)
        return admission

    def test_alone_a_prefill_has_no_cap(self):
        admission = self.admission({HEALTHY: [7, 3700]}, waiting={HEALTHY})
        self.assertFalse(admission.over_share(HEALTHY, 530))

    def test_with_another_waiting_it_holds_at_most_its_share_of_tokens(self):
        admission = self.admission({STUCK: [3, 1590]}, waiting={STUCK, HEALTHY})
        self.assertFalse(admission.over_share(STUCK, 400))  # 1990 <= 4096 / 2
        self.assertTrue(admission.over_share(STUCK, 530))  # 2120 > 2048
        self.assertFalse(admission.over_share(HEALTHY, 530))

    def test_and_of_slots(self):
        admission = self.admission({STUCK: [32, 320]}, waiting={STUCK, HEALTHY})
        self.assertTrue(admission.over_share(STUCK, 10))  # 33 > 64 / 2

    def test_between_anothers_requests_a_prefill_without_progress_holds_its_share(
        self,
    ):
        # The healthy prefill held or waited lately, none of it waits now.
        admission = self.admission(
            {STUCK: [3, 1590]}, waiting={STUCK}, demand={STUCK, HEALTHY}
        )
        self.assertTrue(admission.over_share(STUCK, 530))
        # One of its transfers ended lately: it takes what is free.
        admission.progress(STUCK, admission.now)
        self.assertFalse(admission.over_share(STUCK, 530))

    def test_a_prefill_counts_for_stuck_s_and_progress_for_proven_s(self):
        admission = _PrefillAdmission(STUCK_S, GIVE_UP_S)
        admission.update({}, now=0.0)
        admission.progress(HEALTHY, now=0.0)
        self.assertEqual(admission.recent({HEALTHY}), {HEALTHY})
        admission.update({}, now=admission.proven_s)
        self.assertEqual(admission.progress_at, {})
        admission.update({}, now=STUCK_S - 0.1)
        self.assertEqual(admission.recent(set()), {HEALTHY})
        admission.update({}, now=STUCK_S)
        self.assertEqual(admission.recent(set()), set())
        self.assertEqual(admission.demand_at, {})


def make_req(addr, room, prompt=18, priority=None):
    host, port = addr.split(":")
    return SimpleNamespace(
        bootstrap_host=host,
        bootstrap_port=int(port),
        bootstrap_room=room,
        origin_input_ids=[0] * prompt,
        priority=priority,
        disagg_prefill_dp_rank=0,
        lora_id=None,
        finished_reason=None,
    )


class Receiver:
    def __init__(self, room):
        self.bootstrap_room = room
        self.aborted = False

    def abort(self):
        self.aborted = True


def decode_req(addr, room, waiting=True, **kwargs):
    return DecodeRequest(
        req=make_req(addr, room, **kwargs),
        kv_receiver=Receiver(room),
        waiting_for_input=waiting,
    )


class TestAdmissionByPrefill(CustomTestCase):
    """The per-cycle decisions of DecodePreallocQueue.pop_preallocated on a
    DecodePreallocQueue.__new__ queue: its admission loop skips a request
    when _skip_for_its_prefill() says so, and gives KV to the others in
    order (admit() below walks it the same way; two tests run
    pop_preallocated itself)."""

    def setUp(self):
        super().setUp()
        self.clock = FakeClock()
        patcher = mock.patch.object(decode_mod, "time", self.clock)
        patcher.start()
        self.addCleanup(patcher.stop)
        self.failures = {}
        info = SimpleNamespace(dp_size=1)
        self.queue = DecodePreallocQueue.__new__(DecodePreallocQueue)
        self.queue.kv_manager = SimpleNamespace(
            heartbeat_failures={},
            prefill_info_table={HEALTHY: info, STUCK: info},
            record_failure=self.failures.__setitem__,
        )
        self.queue.transfer_queue = SimpleNamespace(queue=[])
        self.queue.token_to_kv_pool_allocator = SimpleNamespace(size=TOKENS)
        self.queue.req_to_metadata_buffer_idx_allocator = SimpleNamespace(size=SLOTS)
        self.queue.num_reserved_decode_tokens = 512
        self.queue.scheduler = SimpleNamespace(
            running_batch=SimpleNamespace(reqs=[]), waiting_queue=[]
        )
        self.queue.queue = []
        env = mock.patch.multiple(
            decode_mod,
            SGLANG_DISAGGREGATION_STUCK_PREFILL_TIMEOUT=SimpleNamespace(
                get=lambda: STUCK_S
            ),
            SGLANG_DISAGGREGATION_STUCK_PREFILL_GIVE_UP_TIMEOUT=SimpleNamespace(
                get=lambda: GIVE_UP_S
            ),
        )
        env.start()
        self.addCleanup(env.stop)

    def hold(self, addr, *rooms):
        """Requests of ``addr`` whose KV is preallocated, waiting for it."""
        self.queue.transfer_queue.queue += [decode_req(addr, r) for r in rooms]

    def progress(self, addr):
        """One of ``addr``'s transfers ended now."""
        if self.queue._admission is None:
            self.queue._admission_cycle()
        self.queue.transfer_queue.prefill_admission.progress(addr, self.clock.now)

    def admit(self):
        """One cycle: which waiting requests would get KV, in order."""
        admission = self.queue._admission_cycle()
        skipped, admitted = set(), []
        for r in self.queue.queue:
            if not r.waiting_for_input:
                continue
            if self.queue._skip_for_its_prefill(r, admission, skipped):
                continue
            admitted.append(r.req.bootstrap_room)
            admission.hold(r, self.queue._admission_tokens(r.req))
        return admitted

    def reached_by_pop_preallocated(self):
        """Run the real pop_preallocated for one cycle: the rooms whose
        requests get past its admission checks to the first per-request
        capacity check (the LoRA one here, which says no to each, so nothing
        is allocated and the loop goes on)."""
        reached = []

        def can_schedule_lora_req(req, running_loras):
            reached.append(req.bootstrap_room)
            return False

        q = self.queue
        q.pp_size = 1
        for name, value in (
            ("_resolve_pending_reqs", lambda: None),
            ("_log_disaggregation_state", lambda: None),
            ("_update_handshake_waiters", lambda *args: None),
            ("_uses_swa_tail_prealloc", lambda: False),
            ("_uses_swa_reservation", lambda: False),
            ("_allocatable_token_budgets", lambda **kwargs: TOKENS),
            ("_hicache_pending_restore_tokens", lambda: 0),
        ):
            setattr(q, name, value)
        q.req_to_metadata_buffer_idx_allocator.available_size = lambda: SLOTS
        q.scheduler.enable_priority_scheduling = False
        q.scheduler.enable_hisparse = False
        q.scheduler.enable_lora = True
        q.scheduler.can_schedule_lora_req = can_schedule_lora_req
        self.assertEqual(q.pop_preallocated(), ([], []))
        return reached

    def test_pop_preallocated_skips_a_capped_prefill_and_goes_on(self):
        # A request over its prefill's share is skipped, not a break: the
        # healthy request behind it still gets to the capacity checks.
        self.hold(STUCK, 1, 2, 3)
        self.queue.queue = [decode_req(STUCK, 4), decode_req(HEALTHY, 5)]
        self.assertEqual(self.reached_by_pop_preallocated(), [5])

    def test_pop_preallocated_gives_a_stuck_prefill_one_probe_a_cycle(self):
        self.hold(STUCK, 1)
        self.admit()
        self.clock.now += STUCK_S
        self.queue.queue = [
            decode_req(STUCK, 2),
            decode_req(STUCK, 3),
            decode_req(HEALTHY, 4),
        ]
        self.assertEqual(self.reached_by_pop_preallocated(), [2, 4])

    def test_a_capped_prefills_request_is_skipped_and_a_later_one_admitted(self):
        self.hold(STUCK, 1, 2, 3)  # 3 x 530 of 4096: its share is 2048
        self.queue.queue = [
            decode_req(STUCK, 4),
            decode_req(STUCK, 5, prompt=1),  # would fit: FIFO says no
            decode_req(HEALTHY, 6),
            decode_req(HEALTHY, 7),
        ]
        self.assertEqual(self.admit(), [6, 7])

    def test_a_stuck_prefill_does_not_take_the_kv_freed_between_healthy_requests(
        self,
    ):
        self.hold(STUCK, 1, 2, 3)  # 1590 of 4096
        self.queue.queue = [decode_req(HEALTHY, 4)]
        self.assertEqual(self.admit(), [4])
        # Its KV arrived; the healthy prefill's next request is not here yet.
        self.progress(HEALTHY)
        self.clock.now += 0.5
        self.queue.queue = [decode_req(STUCK, 5), decode_req(STUCK, 6)]
        self.assertEqual(self.admit(), [])
        # What they did not take is there for the healthy prefill's next one.
        self.queue.queue.append(decode_req(HEALTHY, 7))
        self.assertEqual(self.admit(), [7])

    def test_order_within_a_prefill_and_by_priority_is_kept(self):
        self.queue.queue = [
            decode_req(HEALTHY, room, priority=p)
            for room, p in ((10, 2), (11, 0), (12, 1), (13, 0))
        ]
        self.queue.queue.sort(key=lambda r: r.req.priority)  # as pop_preallocated
        self.hold(STUCK, 1)
        self.progress(HEALTHY)  # or it holds at most its share of 4 x 530
        self.assertEqual(self.admit(), [11, 13, 12, 10])

    def test_a_stuck_prefill_gets_no_kv_and_holds_no_headroom(self):
        self.hold(STUCK, 1, 2)
        self.hold(HEALTHY, 3)
        self.queue.queue = [decode_req(STUCK, 4), decode_req(HEALTHY, 5)]
        self.assertEqual(self.admit(), [4, 5])  # nobody stuck yet (4 fits)

        self.queue.transfer_queue.queue.pop()  # the healthy one's KV arrived
        self.queue.transfer_queue.prefill_admission.progress(HEALTHY, self.clock.now)
        self.clock.now += STUCK_S
        # Marked stuck, it gets KV for one request at a time: a probe.
        self.queue.queue = [
            decode_req(STUCK, 6),
            decode_req(STUCK, 7),
            decode_req(HEALTHY, 8),
        ]
        self.assertEqual(self.admit(), [6, 8])
        self.hold(STUCK, 6)
        self.hold(HEALTHY, 8)
        self.queue.queue = [decode_req(STUCK, 7), decode_req(HEALTHY, 9)]
        self.assertEqual(self.admit(), [9])  # its probe is out
        # Its three transfers hold no decode headroom; the healthy one does.
        self.assertEqual(self.queue._active_req_count(), 1)

        # It makes progress: its next requests get KV at once.
        self.queue.transfer_queue.prefill_admission.progress(STUCK, self.clock.now)
        self.queue.queue = [decode_req(STUCK, 7), decode_req(STUCK, 10)]
        self.assertEqual(self.admit(), [7, 10])

    def test_a_stuck_prefill_that_only_lost_a_request_is_unmarked_by_its_probe(
        self,
    ):
        # Its one transfer's KV never comes (that request was lost on its
        # side); nothing else was sent to it meanwhile.
        self.hold(STUCK, 1)
        self.admit()
        self.clock.now += STUCK_S
        self.queue.queue = [decode_req(STUCK, 2), decode_req(STUCK, 3)]
        self.assertEqual(self.admit(), [2])
        self.hold(STUCK, 2)
        with self.assertLogs(decode_mod.logger, "INFO") as logs:
            self.progress(STUCK)  # the probe's KV arrives
        self.assertIn("makes progress again", logs.output[0])
        self.queue.transfer_queue.queue.pop()
        self.queue.queue = [decode_req(STUCK, 3)]
        self.assertEqual(self.admit(), [3])

    def test_a_stuck_prefill_that_holds_nothing_any_more_is_unmarked(self):
        self.hold(STUCK, 1)
        self.admit()
        self.clock.now += STUCK_S
        self.admit()
        self.assertIn(STUCK, self.queue._admission.stuck)
        self.queue.transfer_queue.queue.clear()  # e.g. it timed out
        with self.assertLogs(decode_mod.logger, "INFO") as logs:
            self.admit()
        self.assertEqual(self.queue._admission.stuck, {})
        self.assertIn(f"Prefill {STUCK} holds nothing", logs.output[0])

    def test_after_the_longer_bound_its_requests_end_with_a_retryable_cause(self):
        self.hold(STUCK, 1)
        self.queue.queue = [
            decode_req(STUCK, 2),  # waiting, holding nothing
            decode_req(STUCK, 3, waiting=False),  # not bootstrapped yet
            decode_req(HEALTHY, 4),
        ]
        self.admit()
        self.clock.now += GIVE_UP_S
        with self.assertLogs(decode_mod.logger, "ERROR") as logs:
            self.assertEqual(self.admit(), [4])

        ended = [
            r
            for r in (*self.queue.transfer_queue.queue, *self.queue.queue)
            if r.kv_receiver.aborted
        ]
        self.assertEqual([r.req.bootstrap_room for r in ended], [1, 2, 3])
        self.assertTrue(all(r.given_up for r in ended))
        self.assertEqual(set(self.failures), {1, 2, 3})
        self.assertIn(f"Prefill {STUCK} made no progress", self.failures[1])
        self.assertIn("retried on another prefill", self.failures[1])
        self.assertIn(f"Gave up on 3 request(s) of prefill {STUCK}", logs.output[0])
        # Done once: the next cycle does not abort them again.
        self.failures.clear()
        self.admit()
        self.assertEqual(self.failures, {})

    def test_every_attention_tp_rank_holds_back_what_any_rank_does(self):
        self.hold(STUCK, 1)
        self.hold(HEALTHY, 2)
        self.queue.gloo_group = object()
        calls = []

        def another_rank_is_stuck_on(addr):
            def reduce(flags, group, op):
                calls.append((list(flags), group))
                return [2 if a == addr else f for a, f in zip(addrs, flags)]

            return reduce

        addrs = sorted([HEALTHY, STUCK])
        with mock.patch.object(
            decode_mod, "all_reduce_flags", another_rank_is_stuck_on(STUCK)
        ):
            self.queue._update_held_back()
        self.assertEqual(calls, [([0, 0], self.queue.gloo_group)])
        self.assertEqual(self.queue._held_back, {STUCK})
        self.assertEqual(self.queue._probe_ok, set())

    def test_every_rank_probes_a_stuck_prefill_only_if_all_may(self):
        self.hold(STUCK, 1)
        self.hold(HEALTHY, 2)
        self.admit()
        self.clock.now += STUCK_S
        self.progress(HEALTHY)
        self.admit()  # stuck here, no probe out
        self.queue.gloo_group = object()
        sent = []

        def reduce_with(other_rank):
            def reduce(flags, group, op):
                sent.append(list(flags))
                return [max(a, b) for a, b in zip(flags, other_rank)]

            return reduce

        # Sorted: HEALTHY, STUCK. The other rank has not marked it yet.
        with mock.patch.object(decode_mod, "all_reduce_flags", reduce_with([0, 0])):
            self.queue._update_held_back()
        self.assertEqual(sent, [[0, 1]])
        self.assertEqual(self.queue._probe_ok, {STUCK})
        # The other rank's probe of it is out.
        with mock.patch.object(decode_mod, "all_reduce_flags", reduce_with([0, 2])):
            self.queue._update_held_back()
        self.assertEqual(self.queue._held_back, {STUCK})
        self.assertEqual(self.queue._probe_ok, set())


class TestFence(CustomTestCase):
    """A request given up on a stuck prefill keeps its KV pages past the
    deferred release timeout: that prefill is alive and may still write into
    them once it resumes. They are released when it acknowledges the abort,
    or when the heartbeat declares it failed."""

    def setUp(self):
        super().setUp()
        self.clock = FakeClock()
        patcher = mock.patch.object(decode_mod, "time", self.clock)
        patcher.start()
        self.addCleanup(patcher.stop)
        self.info = SimpleNamespace(dp_size=1)
        self.acked = False
        self.kv_mgr = SimpleNamespace(
            prefill_info_table={STUCK: self.info},
            is_abort_release_safe=lambda room, acks: self.acked,
        )
        self.released = []
        self.transfer = DecodeTransferQueue.__new__(DecodeTransferQueue)
        self.transfer.gloo_group = None
        self.transfer.deferred_kv_release_timeout = 30.0
        self.transfer.scheduler = SimpleNamespace(
            metrics_reporter=SimpleNamespace(enable_metrics=False)
        )
        self.transfer._do_release = lambda r, idx: self.released.append(r)
        self.transfer._deferred_releases = []
        for patcher in (
            mock.patch.object(
                decode_mod, "all_reduce_flags", lambda flags, group, op: flags
            ),
        ):
            patcher.start()
            self.addCleanup(patcher.stop)

    def held(self, given_up):
        r = decode_req(STUCK, 1)
        r.kv_receiver.kv_mgr = self.kv_mgr
        r.given_up = given_up
        now = self.clock.now
        self.transfer._deferred_releases = [(r, now, now + 30.0, 0, 1)]
        return r

    def test_the_timeout_releases_other_failures_as_0_5_23_does(self):
        r = self.held(given_up=False)
        self.clock.now += 31
        self.transfer.resolve_deferred_releases()
        self.assertEqual(self.released, [r])

    def test_a_given_up_request_is_held_until_its_prefill_acknowledges(self):
        r = self.held(given_up=self.info)
        self.clock.now += 31
        with self.assertLogs(decode_mod.logger, "WARNING") as logs:
            self.transfer.resolve_deferred_releases()
        self.assertEqual(self.released, [])
        self.assertIn("may still write into it", logs.output[0])
        self.clock.now += 300
        self.transfer.resolve_deferred_releases()
        self.assertEqual(self.released, [])

        self.acked = True  # it resumed and drained the aborted room
        self.transfer.resolve_deferred_releases()
        self.assertEqual(self.released, [r])

    def test_or_until_it_is_declared_failed(self):
        r = self.held(given_up=self.info)
        self.clock.now += 31
        self.transfer.resolve_deferred_releases()
        del self.kv_mgr.prefill_info_table[STUCK]  # _handle_node_failure
        self.transfer.resolve_deferred_releases()
        self.assertEqual(self.released, [r])

    def test_a_prefill_fetched_anew_is_another_process(self):
        r = self.held(given_up=self.info)
        self.kv_mgr.prefill_info_table[STUCK] = SimpleNamespace(dp_size=1)
        self.clock.now += 31
        self.transfer.resolve_deferred_releases()
        self.assertEqual(self.released, [r])


if __name__ == "__main__":
    unittest.main()
