"""The prefill side: a decode that stops answering holds one transfer worker,
and only its own rooms fail.

_TransferScheduler queues chunks by decode destination and serves them with
the backend's fixed transfer workers, one worker per destination at a time:
a room's chunks go out in order, threads stay what 0.5.23 starts, and a room
is failed only once its transfer call has returned. Mooncake probes a decode
before its first transfer; sends to a decode never wait on it.

CPU-only and sleep-free. The Mooncake manager is built as upstream's transfer
worker tests build it (``MooncakeKVManager.__new__`` with its tables, a fake
engine and a bound ``send_kvcache``); a transfer to a decode that does not
answer is a fake call blocked on a ``threading.Event``. ``mori`` (AMD only)
is stubbed at import.
"""

import queue
import threading
import unittest
from collections import defaultdict
from types import SimpleNamespace
from unittest import mock

import numpy as np
import zmq

# Stubs mori (AMD only) at import, for mori/conn.py.
import test_decode_status_listener  # noqa: F401

from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402
from sglang.srt.disaggregation.common import conn as conn_mod  # noqa: E402
from sglang.srt.disaggregation.common.conn import _TransferScheduler  # noqa: E402
from sglang.srt.disaggregation.common.utils import FastQueue  # noqa: E402
from sglang.srt.disaggregation.mooncake.conn import (  # noqa: E402
    MooncakeKVManager,
    TransferInfo,
)
from sglang.srt.disaggregation.mori.conn import MoriKVManager  # noqa: E402
from sglang.srt.disaggregation.nixl.conn import NixlKVManager  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402
from sglang.test.test_utils import CustomTestCase  # noqa: E402

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

# Safety net only: a broken implementation fails instead of hanging the suite.
# No test asserts on how long anything takes.
_WAIT_S = 30

SICK = "127.0.0.1:17001"  # a decode that stops answering
HEALTHY = "127.0.0.1:17005"


class _Engine:
    """Mooncake engine fake: send_probe answers per session, or blocks until
    the test releases it."""

    def __init__(self):
        self.probe_rc = {}
        self.probe_gate = {}
        self.probed = []

    def send_probe(self, session_id):
        self.probed.append(session_id)
        gate = self.probe_gate.get(session_id)
        if gate is not None:
            assert gate.wait(_WAIT_S)
        return self.probe_rc.get(session_id, 0)


def _mooncake_prefill(workers=2):
    """A PREFILL-mode MooncakeKVManager built without __init__, as upstream's
    transfer worker tests build it, with the scheduler and ``workers``
    transfer workers its __init__ starts. ``send_kvcache`` to a session sets
    ``entered[session]``, blocks while ``gates[session]`` is clear, then
    returns ``rcs[session]`` (0);
    every status the manager concludes is put on ``statuses``."""
    mgr = MooncakeKVManager.__new__(MooncakeKVManager)
    mgr.disaggregation_mode = DisaggregationMode.PREFILL
    mgr.enable_trace = False
    mgr.enable_staging = False
    mgr.enable_deferred_decode_kv_release = False
    mgr.deferred_bootstrap = None
    mgr.is_mla_backend = True
    mgr.kv_args = SimpleNamespace(kv_data_ptrs=[1])
    mgr.request_status = {}
    mgr.transfer_infos = {}
    mgr.req_to_decode_prefix_len = {}
    mgr.decode_kv_args_table = {}
    mgr.session_lock = threading.Lock()
    mgr.failed_sessions = set()
    mgr.session_failures = defaultdict(int)
    mgr.failed_session_probes = {}
    mgr.state_layout_rejections = {}
    mgr.failure_lock = threading.Lock()
    mgr.failure_records = {}
    mgr._staging_outstanding = defaultdict(int)
    mgr._deferred_ack_targets = {}
    mgr._deferred_ack_poisoned_rooms = set()
    mgr.engine = _Engine()
    mgr._get_dsa_cache_transfer_skip_flags = lambda info: (False, False)
    mgr.send_aux = lambda req, aux_index, dst_aux_ptrs: 0
    mgr.gates = defaultdict(threading.Event)
    mgr.entered = defaultdict(threading.Event)
    mgr.rcs = defaultdict(int)
    mgr.sent = []
    lock = threading.Lock()
    mgr.in_flight = defaultdict(int)
    mgr.overlaps = []

    def send_kvcache(session_id, prefill_kv_indices, *args, **kwargs):
        chunk = int(prefill_kv_indices[0])
        with lock:
            mgr.sent.append((session_id, chunk))
            mgr.in_flight[session_id] += 1
            if mgr.in_flight[session_id] > 1:
                mgr.overlaps.append(session_id)
        mgr.entered[session_id].set()
        gate = mgr.gates[session_id]
        try:
            assert gate.wait(_WAIT_S), f"the test never released {session_id}"
            return mgr.rcs[session_id]
        finally:
            with lock:
                mgr.in_flight[session_id] -= 1

    mgr.send_kvcache = send_kvcache
    mgr.statuses = queue.Queue()

    def send_kv_status_message(*, targets, bootstrap_room, status, **kwargs):
        mgr.statuses.put((bootstrap_room, status))

    mgr.send_kv_status_message = send_kv_status_message
    mgr.transfer_queues = [FastQueue() for _ in range(workers)]
    mgr._transfer_scheduler = _TransferScheduler(
        first_contact=mgr._probe_before_first_transfer
    )
    mgr.bootstrap_port = 8998
    for _ in range(workers):
        threading.Thread(
            target=conn_mod._run_transfer_worker,
            args=(mgr.transfer_worker, mgr._transfer_scheduler.worker_queue(), None),
            daemon=True,
        ).start()
    return mgr


def _room(mgr, room, session, chunks=1):
    """A room to ``session`` whose ``chunks`` chunks are all added now; the
    KV indices of chunk i are all i, so that send_kvcache can tell them."""
    port = int(session.rsplit(":", 1)[1])
    mgr.request_status[room] = KVPoll.WaitingForInput
    mgr.decode_kv_args_table[session] = SimpleNamespace(
        requires_dcp_relayout=False,
        dst_kv_ptrs=[2],
        dst_aux_ptrs=[3],
        dst_kv_layer_ids=None,
        dst_kv_item_len=None,
        dst_attn_tp_size=1,
    )
    mgr.transfer_infos[room] = {
        session: TransferInfo(
            room=room,
            endpoint="127.0.0.1",
            dst_port=port,
            mooncake_session_id=session,
            dst_kv_indices=np.arange(4 * chunks, dtype=np.int32),
            dst_aux_index=0,
            dst_state_indices=[],
            required_dst_info_num=1,
            is_dummy=False,
        )
    }
    for i in range(chunks):
        mgr.add_transfer_request(
            room,
            np.full(4, i, dtype=np.int32),
            slice(4 * i, 4 * i + 4),
            i == chunks - 1,
            0,
        )


def _wait_status(mgr, room):
    """The next status concluded, which must be ``room``'s."""
    got_room, status = mgr.statuses.get(timeout=_WAIT_S)
    assert got_room == room, (got_room, room)
    return status


class _Clock:
    """A fake time module: sleep() advances the clock and is recorded."""

    def __init__(self, limit=1_000_000, step=1e-3):
        self.now = 1000.0
        self.sleeps = []
        self.limit = limit
        self.step = step

    def monotonic(self):
        return self.now

    time = perf_counter = monotonic

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        if len(self.sleeps) > self.limit:
            raise AssertionError("still waiting on a decode that never answers")
        self.now += max(seconds, self.step)


class TestMooncakeScheduler(CustomTestCase):
    def start(self, workers=2):
        self.mgr = mgr = _mooncake_prefill(workers)
        self.addCleanup(mgr._transfer_scheduler.shutdown)
        self.addCleanup(lambda: [g.set() for g in list(mgr.gates.values())])
        return mgr

    def test_a_stuck_decode_holds_one_worker_and_its_own_rooms(self):
        mgr = self.start(workers=2)
        _room(mgr, 1, SICK)  # its transfer blocks: SICK's gate stays clear
        _room(mgr, 2, SICK)  # queued behind it, not on the other worker
        _room(mgr, 3, HEALTHY)
        _room(mgr, 4, HEALTHY)
        mgr.gates[HEALTHY].set()
        self.assertEqual(_wait_status(mgr, 3), KVPoll.Success)
        self.assertEqual(_wait_status(mgr, 4), KVPoll.Success)
        self.assertEqual([s for s in mgr.sent if s[0] == SICK], [(SICK, 0)])
        mgr.gates[SICK].set()
        self.assertEqual(_wait_status(mgr, 1), KVPoll.Success)
        self.assertEqual(_wait_status(mgr, 2), KVPoll.Success)

    def test_a_room_is_failed_only_once_its_transfer_call_returned(self):
        # Past every bound of the prefill's (a fake hour), the call still
        # runs: the decode's pages may still be written, so nothing is said.
        mgr = self.start(workers=1)
        clock = _Clock()
        with mock.patch.object(conn_mod, "time", clock):
            _room(mgr, 1, SICK)
            _room(mgr, 2, SICK)
            self.assertTrue(mgr.entered[SICK].wait(_WAIT_S))
            clock.now += 3600
            self.assertTrue(mgr.statuses.empty())
            self.assertEqual(mgr.request_status[1], KVPoll.WaitingForInput)
            # The transport gives up (Mooncake's own timeout): now it fails,
            # and the session with it, so the room behind fails at once.
            mgr.rcs[SICK] = -1
            mgr.gates[SICK].set()
            self.assertEqual(_wait_status(mgr, 1), KVPoll.Failed)
            self.assertEqual(_wait_status(mgr, 2), KVPoll.Failed)
        self.assertIn(SICK, mgr.failed_sessions)
        self.assertEqual(mgr.sent, [(SICK, 0)])
        self.assertIn("is not alive", mgr.failure_records[2])

    def test_a_slow_transfer_past_every_bound_is_served(self):
        mgr = self.start(workers=1)
        clock = _Clock()
        with mock.patch.object(conn_mod, "time", clock):
            _room(mgr, 1, HEALTHY, chunks=2)
            clock.now += 3600
            mgr.gates[HEALTHY].set()
            self.assertEqual(_wait_status(mgr, 1), KVPoll.Success)

    def test_chunks_in_order_one_at_a_time_past_any_number_of_destinations(self):
        # More destinations than workers or any limit, coming and going; a
        # few hold their worker while the others are served around them.
        mgr = self.start(workers=4)
        destinations = [f"127.0.0.{1 + i // 200}:{20000 + i}" for i in range(600)]
        slow = set(destinations[::97])
        rooms = {}
        for i, session in enumerate(destinations):
            if session not in slow:
                mgr.gates[session].set()
            rooms[i] = session
            _room(mgr, i, session, chunks=3)
        for session in slow:
            mgr.gates[session].set()
        for _ in rooms:
            self.assertEqual(mgr.statuses.get(timeout=_WAIT_S)[1], KVPoll.Success)
        self.assertEqual(mgr.overlaps, [])
        by_session = defaultdict(list)
        for session, chunk in mgr.sent:
            by_session[session].append(chunk)
        self.assertEqual({s: c for s, c in by_session.items() if c != [0, 1, 2]}, {})
        # Nothing is left behind: no destination keeps a queue.
        self.assertEqual(len(mgr._transfer_scheduler._turns), 0)

    def test_a_later_chunk_never_overtakes_an_earlier_one(self):
        # Decodes come and go around a room whose first chunk waits: its last
        # chunk must still follow it, on the same destination's queue.
        mgr = self.start(workers=2)
        busy = [f"127.0.0.2:{p}" for p in range(1, 12)]
        for room, session in enumerate(busy, start=100):
            _room(mgr, room, session)  # hold both workers, and queue
        target = "127.0.0.3:5000"
        port = 5000
        mgr.request_status[7] = KVPoll.WaitingForInput
        mgr.decode_kv_args_table[target] = mgr.decode_kv_args_table[busy[0]]
        mgr.transfer_infos[7] = {
            target: TransferInfo(
                room=7,
                endpoint="127.0.0.1",
                dst_port=port,
                mooncake_session_id=target,
                dst_kv_indices=np.arange(8, dtype=np.int32),
                dst_aux_index=0,
                dst_state_indices=[],
                required_dst_info_num=1,
                is_dummy=False,
            )
        }
        mgr.add_transfer_request(7, np.full(4, 0, np.int32), slice(0, 4), False, 0)
        mgr.gates[target].set()
        for session in busy:  # they end, and their queues with them
            mgr.gates[session].set()
        for _ in busy:
            mgr.statuses.get(timeout=_WAIT_S)
        mgr.add_transfer_request(7, np.full(4, 1, np.int32), slice(4, 8), True, 0)
        self.assertEqual(_wait_status(mgr, 7), KVPoll.Success)
        self.assertEqual([c for s, c in mgr.sent if s == target], [0, 1])
        self.assertEqual(mgr.overlaps, [])

    def test_threads_stay_the_workers_whatever_the_number_of_decodes(self):
        mgr = self.start(workers=2)
        # Threads of earlier tests may end meanwhile: count only new ones.
        before = set(threading.enumerate())
        for i in range(300):
            _room(mgr, i, f"127.0.0.9:{30000 + i}")
        self.assertEqual(set(threading.enumerate()) - before, set())

    def test_with_more_stuck_decodes_than_workers_a_healthy_one_waits_one_call(self):
        mgr = self.start(workers=2)
        stuck = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
        for room, session in enumerate(stuck):
            _room(mgr, room, session)
        _room(mgr, 9, HEALTHY)
        mgr.gates[HEALTHY].set()
        # Both workers hold a stuck decode that froze at the same moment: the
        # healthy room waits until their calls return (the transport's own
        # bound), and not behind the third stuck decode's call as well.
        self.assertTrue(mgr.entered[stuck[0]].wait(_WAIT_S))
        self.assertTrue(mgr.entered[stuck[1]].wait(_WAIT_S))
        self.assertTrue(mgr.statuses.empty())
        for session in stuck[:2]:
            mgr.rcs[session] = -1
            mgr.gates[session].set()
        ended = {mgr.statuses.get(timeout=_WAIT_S) for _ in range(3)}
        self.assertEqual(
            ended, {(0, KVPoll.Failed), (1, KVPoll.Failed), (9, KVPoll.Success)}
        )

    def test_a_decode_frozen_at_first_contact_holds_one_worker(self):
        mgr = self.start(workers=2)
        mgr.engine.probe_gate[SICK] = gate = threading.Event()
        self.addCleanup(gate.set)
        mgr.engine.probe_rc[SICK] = -102
        _room(mgr, 1, SICK)  # its probe blocks
        _room(mgr, 2, HEALTHY)
        mgr.gates[HEALTHY].set()
        self.assertEqual(_wait_status(mgr, 2), KVPoll.Success)
        gate.set()
        self.assertEqual(_wait_status(mgr, 1), KVPoll.Failed)
        self.assertIn(SICK, mgr.failed_sessions)
        # The engine never opened SICK's segment for a transfer.
        self.assertNotIn(SICK, [s for s, _ in mgr.sent])
        self.assertEqual(sorted(mgr.engine.probed), [SICK, HEALTHY])

    def test_a_probe_that_raises_is_a_failed_probe(self):
        # As _send_probe counts it: the session fails, its segment is not
        # opened by a transfer.
        mgr = self.start(workers=1)

        def send_probe(session_id):
            raise RuntimeError("send_probe: connection refused")

        mgr.engine.send_probe = send_probe
        _room(mgr, 1, SICK)
        mgr.gates[SICK].set()
        self.assertEqual(_wait_status(mgr, 1), KVPoll.Failed)
        self.assertIn(SICK, mgr.failed_sessions)
        self.assertEqual(mgr.sent, [])

    def test_an_engine_without_send_probe_transfers_as_0_5_23(self):
        mgr = self.start(workers=1)

        def send_probe(session_id):  # the wrapper, over a Mooncake without it
            raise AttributeError("'TransferEngine' has no attribute 'send_probe'")

        mgr.engine.send_probe = send_probe
        _room(mgr, 1, HEALTHY)
        mgr.gates[HEALTHY].set()
        self.assertEqual(_wait_status(mgr, 1), KVPoll.Success)
        self.assertEqual(mgr.failed_sessions, set())

    def test_a_decode_back_from_a_failure_is_probed_again_first(self):
        # Maybe restarted under the same session id: its next transfer is a
        # first contact again.
        mgr = self.start(workers=1)
        mgr.failed_session_probe_interval = 1.0
        mgr.failed_session_probe_max_interval = 8.0
        mgr.failed_session_idle_timeout = 3600.0
        mgr.rcs[SICK] = -1
        _room(mgr, 1, SICK)
        mgr.gates[SICK].set()
        self.assertEqual(_wait_status(mgr, 1), KVPoll.Failed)
        self.assertIn(SICK, mgr.failed_sessions)
        mgr.rcs[SICK] = 0
        mgr._run_one_probe_pass()  # it answers again
        self.assertNotIn(SICK, mgr.failed_sessions)
        probed = len(mgr.engine.probed)
        _room(mgr, 2, SICK)
        self.assertEqual(_wait_status(mgr, 2), KVPoll.Success)
        self.assertEqual(mgr.engine.probed[probed:], [SICK])


class _ClearedOnRead(dict):
    """request_status whose room ``room``, once Success, is cleared (as the
    scheduler thread's clear() does) right after a worker finds it there."""

    room = None

    def __contains__(self, key):
        found = super().__contains__(key)
        if key == self.room and self.get(key) == KVPoll.Success:
            self.room = None
            self.pop(key, None)
        return found


class TestMooncakeWorkerSurvives(CustomTestCase):
    def test_a_room_cleared_while_its_worker_reads_its_status(self):
        # 0.5.23 reads it twice (`room not in request_status or
        # check_status(room)`): the KeyError between killed the worker, and no
        # later room to that decode was served (bench F, run-5d82665).
        mgr = TestMooncakeScheduler.start(self, workers=1)
        mgr.request_status = _ClearedOnRead()
        _room(mgr, 1, HEALTHY)
        self.assertTrue(mgr.entered[HEALTHY].wait(_WAIT_S))
        mgr.request_status.room = 1
        mgr.gates[HEALTHY].set()
        self.assertEqual(_wait_status(mgr, 1), KVPoll.Success)
        _room(mgr, 2, HEALTHY)
        self.assertEqual(_wait_status(mgr, 2), KVPoll.Success)

    def test_a_room_whose_transfer_raises_fails_alone(self):
        # 0.5.23 let the worker die with the room unconcluded; handed to
        # another worker, its decode's last chunk would have ended the room
        # Success without the first chunk's KV.
        mgr = TestMooncakeScheduler.start(self, workers=2)
        send_kvcache = mgr.send_kvcache

        def raises_on_chunk_0(session_id, prefill_kv_indices, *args, **kwargs):
            if int(prefill_kv_indices[0]) == 0 and not mgr.sent:
                mgr.sent.append((session_id, "raised"))
                raise ValueError("a bug in the worker")
            return send_kvcache(session_id, prefill_kv_indices, *args, **kwargs)

        mgr.send_kvcache = raises_on_chunk_0
        mgr.gates[HEALTHY].set()
        _room(mgr, 1, HEALTHY, chunks=2)
        self.assertEqual(_wait_status(mgr, 1), KVPoll.Failed)
        _room(mgr, 2, HEALTHY)
        self.assertEqual(_wait_status(mgr, 2), KVPoll.Success)
        self.assertEqual(mgr.sent, [(HEALTHY, "raised"), (HEALTHY, 0)])

    def test_a_worker_that_dies_leaves_its_decode_to_the_others(self):
        scheduler = _TransferScheduler()
        self.addCleanup(scheduler.shutdown)
        scheduler.put(("d",), "chunk 0")
        scheduler.put(("d",), "chunk 1")

        def dies(queue):
            queue.get()
            raise ValueError("a bug in the worker")

        dead = threading.Thread(
            target=conn_mod._run_transfer_worker,
            args=(dies, scheduler.worker_queue()),
        )
        dead.start()
        dead.join(_WAIT_S)
        got = []
        other = threading.Thread(
            target=lambda: got.append(scheduler.worker_queue().get()), daemon=True
        )
        other.start()
        other.join(_WAIT_S)
        self.assertEqual(got, ["chunk 1"])


class TestPrefillSendsNeverWait(CustomTestCase):
    def test_a_decode_that_does_not_read_fails_the_send_at_once(self):
        ctx = zmq.Context()
        self.addCleanup(ctx.destroy, 0)
        mgr = MooncakeKVManager.__new__(MooncakeKVManager)
        mgr._zmq_ctx = ctx
        mgr._socket_lock = threading.Lock()
        mgr._socket_cache, mgr._monitor_cache, mgr._socket_send_locks = {}, {}, {}
        mgr.defer_decode_allocation = False
        # Nothing listens: every message stays queued, as for a decode that
        # does not read. Its socket is _connect's (SNDTIMEO 30 s).
        endpoint = f"tcp://127.0.0.1:{_unused_port()}"
        done = threading.Event()
        failures = []

        def send_many():
            try:
                for _ in range(100_000):
                    mgr._send_multipart_locked(endpoint, [b"x"])
            except zmq.Again as e:
                failures.append(e)
            done.set()

        threading.Thread(target=send_many, daemon=True).start()
        self.assertTrue(done.wait(_WAIT_S), "a send waited on the decode")
        self.assertEqual(len(failures), 1)
        # send_kv_status_message logs it and goes on.
        mgr.transfer_infos = {}
        parts = [b"status"]
        mgr._encode_kv_status_message = lambda **kwargs: parts
        with self.assertLogs(conn_mod.logger, "WARNING") as logs:
            mgr.send_kv_status_message(
                targets=[("127.0.0.1", int(endpoint.rsplit(":", 1)[1]))],
                bootstrap_room=1,
                status=KVPoll.Success,
            )
        self.assertIn("Failed to sync status", logs.output[0])


def _unused_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Joined:
    """A decode thread of NixlKVManager's: records what joins it."""

    def __init__(self):
        self.joins = []

    def join(self, timeout=None):
        self.joins.append(timeout)


class TestNixlTeardown(CustomTestCase):
    def teardown_decode(self, role_switch):
        """Tear down a DECODE manager; return its listener and heartbeat
        checker threads, in the order NixlKVManager.__init__ starts them."""
        mgr = NixlKVManager.__new__(NixlKVManager)
        mgr.disaggregation_mode = DisaggregationMode.DECODE
        mgr.server_args = SimpleNamespace(enable_pd_role_switch=role_switch)
        mgr.deferred_bootstrap = None
        mgr._heartbeat_shutdown = threading.Event()
        mgr._decode_threads = [_Joined(), _Joined()]
        mgr.teardown()
        self.assertTrue(mgr._stopped)
        self.assertTrue(mgr._heartbeat_shutdown.is_set())
        return mgr._decode_threads

    def test_a_listener_blocked_in_recv_is_not_waited_for(self):
        # Without role switch its recv blocks and never sees _stopped: a join
        # would only wait out its timeout.
        listener, heartbeat = self.teardown_decode(role_switch=False)
        self.assertEqual(listener.joins, [])
        self.assertEqual(len(heartbeat.joins), 1)

    def test_a_listener_that_polls_is_joined(self):
        listener, heartbeat = self.teardown_decode(role_switch=True)
        self.assertEqual(len(listener.joins), 1)
        self.assertEqual(len(heartbeat.joins), 1)


class TestTransferScheduler(CustomTestCase):
    def test_the_destinations_it_remembers_are_bounded(self):
        contacted = []
        scheduler = _TransferScheduler(first_contact=contacted.append)
        worker = scheduler.worker_queue()
        destinations = [(f"decode-{i}",) for i in range(10)]
        with mock.patch.object(conn_mod, "_MAX_CONTACTED_DESTINATIONS", 4):
            for destination in destinations + destinations[-4:]:
                scheduler.put(destination, "chunk")
                self.assertEqual(worker.get(), "chunk")
            self.assertEqual(contacted, destinations)  # the last 4 remembered
            self.assertLessEqual(len(scheduler._contacted), 4)
            scheduler.put(destinations[0], "chunk")
            worker.get()
        # The oldest was forgotten: it is probed again.
        self.assertEqual(contacted, destinations + destinations[:1])


class TestMori(CustomTestCase):
    def test_rooms_queue_by_their_decodes(self):
        mgr = MoriKVManager.__new__(MoriKVManager)
        mgr.disaggregation_mode = DisaggregationMode.PREFILL
        mgr.request_status = {1: KVPoll.WaitingForInput, 2: KVPoll.WaitingForInput}
        mgr.transfer_infos = {1: {"d1-r1": 0, "d1-r0": 0}, 2: {"d2-r0": 0}}
        mgr.decode_kv_args_table = {}
        put = []
        mgr._transfer_scheduler = SimpleNamespace(
            put=lambda destination, chunk: put.append(destination)
        )
        mgr._num_shards = 8
        mgr._transfer_queues = [FastQueue() for _ in range(8)]
        for room in (1, 2):
            mgr.add_transfer_request(room, np.arange(2), slice(0, 2), False)
        self.assertEqual(put, [("d1-r0", "d1-r1"), ("d2-r0",)])


class TestUpstreamFixtureShapes(CustomTestCase):
    """The prefill fixtures of design.md: each must keep working."""

    def test_send_kvcache_generic_on_a_simple_namespace(self):
        # Shape 6: batching over a SimpleNamespace manager and a mock engine.
        engine = mock.MagicMock()
        engine.batch_transfer_sync.return_value = 0
        manager = SimpleNamespace(
            engine=engine,
            is_mla_backend=True,
            is_hybrid_mla_backend=False,
            pp_size=1,
            enable_custom_mem_pool=False,
            custom_mem_pool_type=None,
            enable_deferred_decode_kv_release=False,
            max_transfer_batch_indices=0,
            get_mla_kv_ptrs_with_pp=mock.MagicMock(return_value=([10], [20], 1)),
        )
        manager._transfer_data = (
            lambda session, blocks: MooncakeKVManager._transfer_data(
                manager, session, blocks
            )
        )
        manager._await_transfer_futures = (
            lambda futures: MooncakeKVManager._await_transfer_futures(manager, futures)
        )
        ret = MooncakeKVManager._send_kvcache_generic(
            manager,
            mooncake_session_id=HEALTHY,
            src_data_ptrs=[10],
            dst_data_ptrs=[20],
            item_lens=[8],
            prefill_data_indices=np.array([0, 1, 2], dtype=np.int32),
            dst_data_indices=np.array([5, 6, 7], dtype=np.int32),
            executor=None,
        )
        self.assertEqual(ret, 0)
        engine.batch_transfer_sync.assert_called_once()
        self.assertEqual(engine.batch_transfer_sync.call_args.args[0], HEALTHY)

    def test_transfer_worker_on_a_fast_queue(self):
        # Shape 7: the 0.5.23 worker signature on a plain FastQueue, with no
        # scheduler: rooms go to 0.5.23's queues.
        mgr = _mooncake_prefill(workers=1)
        mgr._transfer_scheduler.shutdown()
        mgr._transfer_scheduler = None
        worker = threading.Thread(
            target=mgr.transfer_worker,
            args=(mgr.transfer_queues[0], None),
            daemon=True,
        )
        worker.start()
        _room(mgr, 1, HEALTHY)
        mgr.gates[HEALTHY].set()
        self.assertEqual(_wait_status(mgr, 1), KVPoll.Success)
        mgr.transfer_queues[0].put(None)
        worker.join(_WAIT_S)
        self.assertFalse(worker.is_alive())


if __name__ == "__main__":
    unittest.main()
