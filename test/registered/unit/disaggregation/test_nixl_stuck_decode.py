"""NIXL on the prefill: a batch none of whose handles settles within the
no-progress bound is given up, and its decode's next rooms fail at once for
as long, so that a decode that stops answering holds no transfer worker.

NIXL's transfer worker runs on the test's thread, on a scripted queue, a fake
agent and a fake clock; the manager is built without __init__, as upstream's
transfer worker tests build theirs. CPU-only and sleep-free.
"""

import threading
import unittest
from collections import defaultdict, deque
from types import SimpleNamespace
from unittest import mock

import numpy as np
from test_prefill_transfer_scheduler import _WAIT_S, _Clock

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.nixl import conn as nixl_mod
from sglang.srt.disaggregation.nixl.conn import NixlKVManager
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")


class TestNixlAwaitHandles(CustomTestCase):
    def manager(self, states):
        mgr = NixlKVManager.__new__(NixlKVManager)
        mgr.agent = SimpleNamespace(check_xfer_state=lambda handle: next(states))
        return mgr

    def test_a_batch_without_progress_is_given_up_after_the_bound(self):
        mgr = NixlKVManager.__new__(NixlKVManager)
        mgr.agent = SimpleNamespace(check_xfer_state=lambda handle: "PROC")
        clock = _Clock()
        with mock.patch.object(nixl_mod, "time", clock):
            self.assertEqual(
                mgr._await_handles([object()], failure_seen=False), (False, True)
            )
        waited = clock.now - 1000.0
        self.assertGreaterEqual(waited, nixl_mod.NIXL_NO_PROGRESS_TIMEOUT_S)
        self.assertLess(waited, nixl_mod.NIXL_NO_PROGRESS_TIMEOUT_S + 1.0)

    def test_a_batch_that_keeps_moving_is_waited_for_past_the_bound(self):
        # Four handles, one settling every 0.8 of the bound: 3.2 bounds in all.
        handles = [object() for _ in range(4)]
        clock = _Clock()
        bound = nixl_mod.NIXL_NO_PROGRESS_TIMEOUT_S
        start = clock.now

        def state(handle):
            done = int((clock.now - start) / (0.8 * bound))
            return "DONE" if handles.index(handle) < done else "PROC"

        mgr = NixlKVManager.__new__(NixlKVManager)
        mgr.agent = SimpleNamespace(check_xfer_state=state)
        with mock.patch.object(nixl_mod, "time", clock):
            self.assertEqual(
                mgr._await_handles(handles, failure_seen=False), (True, False)
            )
        self.assertGreater(clock.now - start, 3 * bound)

    def test_a_healthy_batch_is_polled_without_a_pause(self):
        mgr = self.manager(iter(["PROC", "PROC", "DONE"]))
        clock = _Clock()
        with mock.patch.object(nixl_mod, "time", clock):
            self.assertEqual(
                mgr._await_handles([object()], failure_seen=False), (True, False)
            )
        self.assertEqual(clock.sleeps, [0, 0])

    def test_a_stuck_decodes_next_rooms_fail_at_once_for_the_bound(self):
        mgr = NixlKVManager.__new__(NixlKVManager)
        clock = _Clock()
        with mock.patch.object(nixl_mod, "time", clock):
            self.assertIsNone(mgr._stuck_decode({"agent-a": 0}))
            mgr._note_stuck_decode({"agent-a": 0})
            self.assertIn("agent-a", mgr._stuck_decode({"agent-a": 0, "b": 0}))
            self.assertIsNone(mgr._stuck_decode({"b": 0}))
            clock.now += nixl_mod.NIXL_NO_PROGRESS_TIMEOUT_S
            self.assertIsNone(mgr._stuck_decode({"agent-a": 0}))
            self.assertEqual(mgr._stuck_decodes, {})
            # A decode that is gone gets no room again: its mark ends anyway.
            mgr._note_stuck_decode({"gone": 0})
            clock.now += nixl_mod.NIXL_NO_PROGRESS_TIMEOUT_S
            mgr._note_stuck_decode({"agent-b": 0})
            self.assertEqual(list(mgr._stuck_decodes), ["agent-b"])


GIB = 1 << 30


class _NixlAgent:
    """NIXL agent fake on a fake clock: a transfer handle is PROC until the
    clock reaches its end (None: never), then DONE. Releasing a handle still
    in PROC aborts it if ``abortable``, else raises, as NIXL does when its
    backend cannot abort a transfer."""

    def __init__(self, clock):
        self.clock = clock
        self.ends = {}
        self.released = []
        self.abortable = False

    def check_xfer_state(self, handle):
        end = self.ends[handle]
        return "DONE" if end is not None and self.clock.now >= end else "PROC"

    def release_xfer_handle(self, handle):
        if self.check_xfer_state(handle) == "PROC" and not self.abortable:
            raise RuntimeError("NIXL could not abort an active transfer")
        self.released.append(handle)

    def check_remote_metadata(self, agent_name):
        return True


def _nixl_prefill(clock):
    """A PREFILL-mode NixlKVManager built without __init__, with what its
    transfer worker reads and a fake agent. send_kvcache and send_aux post a
    handle to ``peer_name`` that ends ``durations[peer_name]`` s later on the
    fake clock (None: never). A page of KV is 4 MiB over all layers
    (``kv_item_lens_sum``, as CommonKVManager.__init__ sets it). Every status
    the manager concludes is appended to ``statuses``."""
    mgr = NixlKVManager.__new__(NixlKVManager)
    mgr.disaggregation_mode = DisaggregationMode.PREFILL
    mgr.enable_staging = False
    mgr.enable_deferred_decode_kv_release = False
    mgr.deferred_bootstrap = None
    mgr.is_mla_backend = True
    mgr.attn_tp_size = 1
    mgr.kv_args = SimpleNamespace(kv_data_ptrs=[1])
    mgr.kv_item_lens_sum = 4 << 20
    mgr.request_status = {}
    mgr.transfer_infos = {}
    mgr.req_to_decode_prefix_len = {}
    mgr.decode_kv_args_table = {}
    mgr.failure_lock = threading.Lock()
    mgr.failure_records = {}
    mgr._staging_outstanding = defaultdict(int)
    mgr._deferred_ack_targets = {}
    mgr._deferred_ack_poisoned_rooms = set()
    mgr.agent = _NixlAgent(clock)
    mgr.durations = {}

    def post(peer_name, *args, **kwargs):
        handle = object()
        duration = mgr.durations[peer_name]
        mgr.agent.ends[handle] = None if duration is None else clock.now + duration
        return handle

    mgr.send_kvcache = mgr.send_aux = post
    mgr.statuses = []

    def send_kv_status_message(*, targets, bootstrap_room, status, **kwargs):
        mgr.statuses.append((bootstrap_room, status))

    mgr.send_kv_status_message = send_kv_status_message
    return mgr


def _nixl_room(mgr, room, agent_name, pages=256):
    """A room to decode ``agent_name`` and its only chunk: ``pages`` pages
    (256: 1 GiB)."""
    mgr.request_status[room] = KVPoll.WaitingForInput
    mgr.decode_kv_args_table[agent_name] = SimpleNamespace(
        decode_tp_size=1,
        requires_dcp_relayout=False,
        kv_xfer_segments=None,
        dst_homogeneous_mem_kind="VRAM",
        dst_kv_ptrs=[2],
        dst_aux_ptrs=[3],
        gpu_id=0,
    )
    mgr.transfer_infos[room] = {
        agent_name: nixl_mod.TransferInfo(
            room=room,
            endpoint="127.0.0.1",
            dst_port=17000,
            agent_name=agent_name,
            dst_kv_indices=np.arange(pages, dtype=np.int32),
            dst_aux_index=0,
            required_dst_info_num=1,
            dst_state_indices=[],
        )
    }
    return nixl_mod.TransferKVChunk(
        room=room,
        prefill_kv_indices=np.arange(pages, dtype=np.int32),
        index_slice=slice(0, pages),
        is_last_chunk=True,
        prefill_aux_index=0,
        state_indices=None,
    )


class _Script:
    """A transfer worker's queue: get() returns the items in turn and runs
    the callables among them in between; None, last, stops the worker."""

    def __init__(self, *items):
        self.items = deque(items)

    def get(self):
        while callable(self.items[0]):
            self.items.popleft()()
        return self.items.popleft()


class _NixlTransportError(Exception):
    """Stands for nixl._bindings' errors, which the worker logs in one line."""


class TestNixlTransferWorker(CustomTestCase):
    """NIXL's transfer worker run on the test's thread, on a fake clock and a
    scripted queue."""

    def run_worker(self, mgr, clock, *items):
        with (
            mock.patch.object(nixl_mod, "time", clock),
            # As with NIXL installed: a RuntimeError is not a transport error.
            mock.patch.object(
                nixl_mod, "_NIXL_TRANSPORT_ERRORS", (_NixlTransportError,)
            ),
        ):
            mgr.transfer_worker(_Script(*items, None))

    def test_a_healthy_transfer_that_needs_more_than_30_s_is_served(self):
        # 1 GiB over TCP at 20 MB/s: 54 s, in one handle that settles only at
        # the end. 0.5.23 waits for it; it must not be given up.
        clock = _Clock(step=0.5)
        mgr = _nixl_prefill(clock)
        mgr.durations["decode-a"] = GIB / 20e6
        self.run_worker(mgr, clock, _nixl_room(mgr, 1, "decode-a"))
        self.assertEqual(mgr.statuses, [(1, KVPoll.Success)])
        self.assertIsNone(mgr._stuck_decodes)

    def test_a_frozen_decode_is_given_up_once_its_bytes_had_time_at_the_floor(self):
        clock = _Clock(step=0.5)
        mgr = _nixl_prefill(clock)
        mgr.durations["frozen"] = None
        start = clock.now
        given_up = []
        self.run_worker(
            mgr,
            clock,
            _nixl_room(mgr, 1, "frozen"),
            lambda: given_up.append(clock.now - start),
        )
        bound = (
            nixl_mod.NIXL_NO_PROGRESS_TIMEOUT_S
            + GIB / nixl_mod.NIXL_MIN_TRANSFER_RATE_BYTES_S
        )
        self.assertGreaterEqual(given_up[0], bound)
        self.assertLess(given_up[0], bound + 1)
        # Its pages may still be written: the room is left to the decode's
        # waiting timeout, and its decode's next rooms fail at once.
        self.assertEqual(mgr.request_status[1], KVPoll.Failed)
        self.assertEqual(mgr.statuses, [])
        self.assertIn("frozen", mgr._stuck_decodes)

    def test_a_stuck_decodes_next_rooms_fail_at_once_in_one_line_each(self):
        clock = _Clock(step=0.5)
        mgr = _nixl_prefill(clock)
        mgr.durations["frozen"] = None
        mgr.durations["healthy"] = 1.0
        self.run_worker(mgr, clock, _nixl_room(mgr, 1, "frozen"))
        given_up_at = clock.now
        with self.assertLogs(nixl_mod.logger, "DEBUG") as logs:
            self.run_worker(
                mgr,
                clock,
                _nixl_room(mgr, 2, "frozen"),
                _nixl_room(mgr, 3, "frozen"),
                _nixl_room(mgr, 4, "healthy"),
            )
        self.assertEqual(
            mgr.statuses,
            [(2, KVPoll.Failed), (3, KVPoll.Failed), (4, KVPoll.Success)],
        )
        self.assertLess(clock.now - given_up_at, 2.0)  # fake clock: 1 s for room 4
        failed = [r for r in logs.records if r.levelno >= 30]
        self.assertEqual(len(failed), 2, [r.getMessage() for r in failed])
        for room, record in zip((2, 3), failed):
            self.assertIsNone(record.exc_info)
            self.assertIn(f"room {room}", record.getMessage())
            self.assertIn("frozen", record.getMessage())
            self.assertNotIn("\n", record.getMessage())

    def test_a_given_up_batch_is_released_at_once_where_nixl_can_abort_it(self):
        clock = _Clock(step=0.5)
        mgr = _nixl_prefill(clock)
        mgr.durations["frozen"] = None
        mgr.agent.abortable = True
        self.run_worker(mgr, clock, _nixl_room(mgr, 1, "frozen"))
        self.assertEqual(len(mgr.agent.ends), 2)  # its KV and aux handles
        self.assertEqual(set(mgr.agent.released), set(mgr.agent.ends))

    def test_what_nixl_cannot_abort_is_released_once_it_ends(self):
        clock = _Clock(step=0.5)
        mgr = _nixl_prefill(clock)
        mgr.durations["frozen"] = None
        mgr.durations["healthy"] = 1.0
        given_up, released = [], []

        def transfers_end():  # NIXL finally settles them (UCX keepalive)
            for handle in given_up:
                mgr.agent.ends[handle] = clock.now

        with self.assertLogs(nixl_mod.logger, "WARNING") as logs:
            self.run_worker(
                mgr,
                clock,
                _nixl_room(mgr, 1, "frozen"),
                lambda: given_up.extend(mgr.agent.ends),
                _nixl_room(mgr, 2, "healthy"),
                lambda: released.append(set(mgr.agent.released)),
                transfers_end,
                _nixl_room(mgr, 3, "healthy"),
            )
        self.assertEqual(len(given_up), 2)
        # Still running after room 2: kept, never waited for.
        self.assertEqual(released[0] & set(given_up), set())
        self.assertLessEqual(set(given_up), set(mgr.agent.released))
        self.assertEqual(mgr.statuses, [(2, KVPoll.Success), (3, KVPoll.Success)])
        self.assertTrue(
            any("could not abort 2" in r.getMessage() for r in logs.records),
            [r.getMessage() for r in logs.records],
        )

    def test_a_decode_that_given_up_writes_may_still_reach_gets_no_room(self):
        # Review 14 F2: once the stuck mark expired, the decode's next room was
        # served while the given-up batch still ran; the decode ends the
        # given-up room's fence on that serve, and reused pages it may write.
        clock = _Clock(step=0.5)
        mgr = _nixl_prefill(clock)
        mgr.durations["decode-a"] = None
        given_up = []

        def moves_again():
            given_up.extend(mgr.agent.ends)
            mgr.durations["decode-a"] = 1.0
            clock.now += nixl_mod.NIXL_NO_PROGRESS_TIMEOUT_S  # the mark expired

        def transfers_end():
            for handle in given_up:
                mgr.agent.ends[handle] = clock.now

        self.run_worker(
            mgr,
            clock,
            _nixl_room(mgr, 1, "decode-a"),
            moves_again,
            _nixl_room(mgr, 2, "decode-a"),
            transfers_end,
            _nixl_room(mgr, 3, "decode-a"),
        )
        self.assertEqual(mgr.statuses, [(2, KVPoll.Failed), (3, KVPoll.Success)])
        self.assertIn("still writing", mgr.failure_records[2])
        self.assertLessEqual(set(given_up), set(mgr.agent.released))
        self.assertEqual(mgr._kept_writes, ())

    def test_what_is_still_running_when_the_worker_stops_is_reported(self):
        clock = _Clock(step=0.5)
        mgr = _nixl_prefill(clock)
        mgr.durations["frozen"] = None
        with self.assertLogs(nixl_mod.logger, "WARNING") as logs:
            self.run_worker(mgr, clock, _nixl_room(mgr, 1, "frozen"))
        self.assertEqual(mgr.agent.released, [])
        self.assertIn("left 2", logs.records[-1].getMessage())


class _FirstReadWaits(NixlKVManager):
    """Each thread's first read of ``_stuck_decodes`` returns what it read
    only once both threads read it, and the second thread's only once the
    first one is done: two workers that give up at once, interleaved."""

    hook = None

    def __getattribute__(self, name):
        value = super().__getattribute__(name)
        hook = NixlKVManager.__getattribute__(self, "hook")
        if name == "_stuck_decodes" and hook is not None:
            hook()
        return value


class TestNixlStuckDecodes(CustomTestCase):
    def test_workers_that_find_an_expired_entry_at_once_fail_no_room(self):
        mgr = NixlKVManager.__new__(NixlKVManager)
        mgr._stuck_decodes = {"agent-d": 0.0}
        barrier = threading.Barrier(2, timeout=_WAIT_S)

        class Clock:
            def monotonic(self):
                barrier.wait()  # both between the read and the removal
                return 1e9

        results = []

        def worker():
            try:
                results.append(mgr._stuck_decode({"agent-d": None}))
            except Exception as e:
                results.append(e)

        with mock.patch.object(nixl_mod, "time", Clock()):
            threads = [threading.Thread(target=worker) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(_WAIT_S)
        self.assertEqual(results, [None, None])
        self.assertEqual(mgr._stuck_decodes, {})

    def test_workers_that_give_up_at_once_both_remember_their_decode(self):
        mgr = _FirstReadWaits.__new__(_FirstReadWaits)
        barrier = threading.Barrier(2, timeout=_WAIT_S)
        first_done = threading.Event()
        seen = threading.local()

        def hook():
            if getattr(seen, "read", False):
                return
            seen.read = True
            barrier.wait()
            if threading.current_thread().name == "second":
                assert first_done.wait(_WAIT_S)

        def note(agent_name):
            mgr._note_stuck_decode({agent_name: None})
            if agent_name == "agent-a":
                first_done.set()

        mgr.hook = hook
        threads = [
            threading.Thread(target=note, args=("agent-a",), name="first"),
            threading.Thread(target=note, args=("agent-b",), name="second"),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(_WAIT_S)
        mgr.hook = None
        self.assertEqual(sorted(mgr._stuck_decodes), ["agent-a", "agent-b"])


if __name__ == "__main__":
    unittest.main()
