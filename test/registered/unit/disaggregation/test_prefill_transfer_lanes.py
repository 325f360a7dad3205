"""The prefill side: a decode that stops answering holds only its own share.

Each decode destination's KV transfers run on a lane of their own
(``_TransferLanes``), a watchdog fails the rooms of a lane stuck past its bound,
Mooncake probes a decode before its first transfer, messages to decodes leave
from a sender thread that never waits, and NIXL's and Mori's waits on a decode
are bounded.

CPU-only and sleep-free. The Mooncake manager is built as upstream's transfer
worker tests build it (``MooncakeKVManager.__new__`` with its tables, a fake
engine and a bound ``send_kvcache``); a transfer to a decode that does not
answer is a fake call blocked on a ``threading.Event``. Status messages are
recorded, except in the sender test, which uses real ZMQ sockets on 127.0.0.1.
NIXL's wait runs on a fake clock. ``mori`` (AMD only) is stubbed at import.
"""

import os
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
from sglang.srt.disaggregation.common.conn import (  # noqa: E402
    _PushSender,
    _TransferLanes,
)
from sglang.srt.disaggregation.common.utils import (  # noqa: E402
    FastQueue,
    TransferKVChunk,
)
from sglang.srt.disaggregation.mooncake import conn as mooncake_mod  # noqa: E402
from sglang.srt.disaggregation.mooncake.conn import (  # noqa: E402
    MooncakeKVManager,
    TransferInfo,
)
from sglang.srt.disaggregation.mori import conn as mori_mod  # noqa: E402
from sglang.srt.disaggregation.mori.conn import MoriKVManager  # noqa: E402
from sglang.srt.disaggregation.nixl import conn as nixl_mod  # noqa: E402
from sglang.srt.disaggregation.nixl.conn import NixlKVManager  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402
from sglang.test.test_utils import CustomTestCase  # noqa: E402

register_cpu_ci(est_time=20, suite="base-a-test-cpu")

# Safety net only: a broken implementation fails instead of hanging the suite.
# No test asserts on how long anything takes.
_WAIT_S = 10

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


def _mooncake_prefill(transfer_timeout_s=1e9, handshake_timeout_s=1e9):
    """A PREFILL-mode MooncakeKVManager built without __init__, as upstream's
    transfer worker tests build it, plus the lanes its __init__ would start.
    One 0.5.23 queue and worker, so that without lanes every decode shares
    it. ``send_kvcache`` to a session blocks while ``gates[session]`` is
    clear; every status the manager concludes is put on ``statuses``."""
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
    mgr.sent = []

    def send_kvcache(session_id, *args, **kwargs):
        mgr.sent.append(session_id)
        gate = mgr.gates[session_id]
        assert gate.wait(_WAIT_S), f"the test never released {session_id}"
        return 0

    mgr.send_kvcache = send_kvcache
    mgr.statuses = queue.Queue()

    def send_kv_status_message(*, targets, bootstrap_room, status, **kwargs):
        mgr.statuses.put((bootstrap_room, status))

    mgr.send_kv_status_message = send_kv_status_message
    mgr.transfer_queues = [FastQueue()]
    worker = threading.Thread(
        target=mgr.transfer_worker, args=(mgr.transfer_queues[0], None), daemon=True
    )
    worker.start()
    mgr._transfer_lanes = _TransferLanes(
        "test-transfer",
        run_worker=mgr.transfer_worker,
        on_stuck=mgr._fail_stuck_transfers,
        first_contact=mgr._probe_before_first_transfer,
        transfer_timeout_s=transfer_timeout_s,
        handshake_timeout_s=handshake_timeout_s,
    )
    return mgr


def _room(mgr, room, session):
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
            dst_kv_indices=np.arange(4, dtype=np.int32),
            dst_aux_index=0,
            dst_state_indices=[],
            required_dst_info_num=1,
            is_dummy=False,
        )
    }
    mgr.add_transfer_request(room, np.arange(4, dtype=np.int32), slice(0, 4), True, 0)


def _wait_status(mgr, room):
    """The next status concluded, which must be ``room``'s."""
    got_room, status = mgr.statuses.get(timeout=_WAIT_S)
    assert got_room == room, (got_room, room)
    return status


class TestMooncakeLanes(CustomTestCase):
    def tearDown(self):
        self.mgr.gates[SICK].set()
        self.mgr.engine.probe_gate.pop(SICK, threading.Event()).set()
        self.mgr._transfer_lanes.shutdown()
        self.mgr.transfer_queues[0].put(None)

    def test_a_stuck_decode_holds_only_its_own_lane(self):
        self.mgr = mgr = _mooncake_prefill()
        _room(mgr, 1, SICK)  # its transfer blocks: SICK's gate stays clear
        _room(mgr, 2, HEALTHY)
        mgr.gates[HEALTHY].set()
        self.assertEqual(_wait_status(mgr, 2), KVPoll.Success)
        self.assertEqual(mgr.request_status[1], KVPoll.WaitingForInput)
        mgr.gates[SICK].set()
        self.assertEqual(_wait_status(mgr, 1), KVPoll.Success)

    def test_a_stuck_lane_fails_its_rooms_with_the_decode_named(self):
        self.mgr = mgr = _mooncake_prefill(transfer_timeout_s=0.0)
        _room(mgr, 1, SICK)
        self.assertEqual(_wait_status(mgr, 1), KVPoll.Failed)
        reason = mgr.failure_records[1]
        self.assertIn(SICK, reason)
        self.assertIn("SGLANG_DISAGGREGATION_KV_TRANSFER_TIMEOUT", reason)
        # Its next rooms fail at once, not after another bound.
        self.assertIn(SICK, mgr.failed_sessions)
        _room(mgr, 3, SICK)  # queued behind the blocked transfer
        self.assertEqual(_wait_status(mgr, 3), KVPoll.Failed)
        # When the transport gives up, the room stays failed, with its reason.
        mgr.gates[SICK].set()
        mgr._transfer_lanes.shutdown()
        self.assertEqual(mgr.request_status[1], KVPoll.Failed)
        self.assertEqual(mgr.failure_records[1], reason)

    def test_first_contact_probe_off_the_shared_path(self):
        self.mgr = mgr = _mooncake_prefill()
        mgr.engine.probe_gate[SICK] = gate = threading.Event()
        mgr.engine.probe_rc[SICK] = -1
        _room(mgr, 1, SICK)  # its probe blocks
        _room(mgr, 2, HEALTHY)
        mgr.gates[HEALTHY].set()
        self.assertEqual(_wait_status(mgr, 2), KVPoll.Success)
        gate.set()
        self.assertEqual(_wait_status(mgr, 1), KVPoll.Failed)
        self.assertIn(SICK, mgr.failed_sessions)
        self.assertIn(f"session {SICK} is not alive", mgr.failure_records[1])
        # The engine never opened SICK's segment for a transfer.
        self.assertNotIn(SICK, mgr.sent)
        self.assertEqual(sorted(mgr.engine.probed), [SICK, HEALTHY])

    def test_a_probe_that_does_not_answer_is_bounded(self):
        self.mgr = mgr = _mooncake_prefill(handshake_timeout_s=0.0)
        mgr.engine.probe_gate[SICK] = threading.Event()
        _room(mgr, 1, SICK)
        self.assertEqual(_wait_status(mgr, 1), KVPoll.Failed)
        self.assertIn(
            "SGLANG_DISAGGREGATION_DECODE_HANDSHAKE_TIMEOUT", mgr.failure_records[1]
        )


class TestTransferLanes(CustomTestCase):
    """_TransferLanes alone, with a worker that runs each chunk's ``run``."""

    def _lanes(self, **kwargs):
        self.stuck = queue.Queue()

        def run_worker(lane, executor):
            while (chunk := lane.get()) is not None:
                chunk.run()

        lanes = _TransferLanes(
            "test-lanes",
            run_worker=run_worker,
            on_stuck=lambda *report: self.stuck.put(report),
            **kwargs,
        )
        self.addCleanup(lanes.shutdown)
        return lanes

    def test_idle_lanes_end_and_their_table_shrinks(self):
        lanes = self._lanes(idle_s=0.0)
        done = threading.Event()
        lanes.put(("a",), SimpleNamespace(room=1, run=done.set))
        self.assertTrue(done.wait(_WAIT_S))
        with lanes._lock:
            threads = list(lanes._threads)
        for thread in threads:
            thread.join(_WAIT_S)
        self.assertEqual((lanes.lane_count(), lanes.thread_count()), (0, 0))

    def test_past_max_lanes_destinations_share(self):
        lanes = self._lanes(max_lanes=1)
        gate = threading.Event()
        self.addCleanup(gate.set)
        lanes.put(("a",), SimpleNamespace(room=1, run=gate.wait))
        lanes.put(("b",), SimpleNamespace(room=2, run=gate.wait))
        with lanes._lock:
            keys = sorted(map(str, lanes._lanes))
        self.assertEqual(len(keys), 2)
        self.assertTrue(any(k.startswith("('shared'") for k in keys), keys)

    def test_a_worker_error_fails_its_room_and_the_lane_goes_on(self):
        lanes = self._lanes()
        done = threading.Event()

        def boom():
            raise RuntimeError("boom")

        lanes.put(("a",), SimpleNamespace(room=1, run=boom))
        lanes.put(("a",), SimpleNamespace(room=2, run=done.set))
        self.assertTrue(done.wait(_WAIT_S))
        key, rooms, reason, first = self.stuck.get(timeout=_WAIT_S)
        self.assertEqual((key, rooms, first), (("a",), [1], True))
        self.assertIn("boom", reason)

    def test_a_stuck_thread_gets_the_lowest_priority_and_its_lane_a_new_one(self):
        lanes = self._lanes(transfer_timeout_s=0.0)
        gate = threading.Event()
        self.addCleanup(gate.set)
        ran = queue.Queue()

        def run():
            tid = threading.get_native_id()
            ran.put((tid, os.getpriority(os.PRIO_PROCESS, tid)))
            gate.wait(_WAIT_S)

        lanes.put(("a",), SimpleNamespace(room=1, run=run))
        stuck_tid, _ = ran.get(timeout=_WAIT_S)
        self.stuck.get(timeout=_WAIT_S)  # the watchdog found it stuck
        self.assertEqual(os.getpriority(os.PRIO_PROCESS, stuck_tid), 19)
        gate.set()
        lanes.put(("a",), SimpleNamespace(room=2, run=run))
        tid, priority = ran.get(timeout=_WAIT_S)
        self.assertNotEqual(tid, stuck_tid)
        self.assertEqual(priority, os.getpriority(os.PRIO_PROCESS, 0))

    def test_a_chunk_started_while_the_watchdog_is_idle_is_watched(self):
        # The handshake bound is far off; the transfer bound is 0.
        lanes = self._lanes(transfer_timeout_s=0.0, handshake_timeout_s=1000.0)
        first_done, gate = threading.Event(), threading.Event()
        self.addCleanup(gate.set)
        lanes.put(("a",), SimpleNamespace(room=1, run=first_done.set))
        self.assertTrue(first_done.wait(_WAIT_S))
        with lanes._lock:
            # Once nothing runs, the watchdog waits without a deadline.
            self.assertTrue(lanes._watch.wait_for(lambda: lanes._watch_idle, _WAIT_S))
        lanes.put(("a",), SimpleNamespace(room=2, run=lambda: gate.wait(_WAIT_S)))
        key, rooms, _, first = self.stuck.get(timeout=_WAIT_S)
        self.assertEqual((key, rooms, first), (("a",), [2], True))

    def test_overdue_reports_the_running_room_once_then_the_queued_ones(self):
        lanes = self._lanes(transfer_timeout_s=1000.0, handshake_timeout_s=1000.0)
        started, gate = threading.Event(), threading.Event()
        self.addCleanup(gate.set)

        def block():
            started.set()
            gate.wait(_WAIT_S)

        lanes.put(("a",), SimpleNamespace(room=1, run=block))
        self.assertTrue(started.wait(_WAIT_S))
        lanes.put(("a",), SimpleNamespace(room=2, run=lambda: None))
        with lanes._lock:
            since = lanes._lanes[("a",)].running_since
            due, stuck = lanes._overdue(since + 1.0)
            self.assertEqual((round(due, 6), stuck), (999.0, []))
            _, stuck = lanes._overdue(since + 1001.0)
            self.assertEqual(
                [(k, r, f) for k, r, _, f in stuck], [(("a",), [1, 2], True)]
            )
            _, again = lanes._overdue(since + 1002.0)
            self.assertEqual(again, [])
        lanes._lanes[("a",)].put(SimpleNamespace(room=3, run=lambda: None))
        with lanes._lock:
            _, later = lanes._overdue(since + 1003.0)
        self.assertEqual([(k, r, f) for k, r, _, f in later], [(("a",), [3], False)])


class TestPrefillSender(CustomTestCase):
    """Messages to decodes leave from the prefill's sender thread: a decode
    that does not read holds no caller, and what it does not take is dropped
    after the bound, with a log line."""

    def test_a_decode_that_does_not_read_never_blocks_the_caller(self):
        ctx = zmq.Context()
        self.addCleanup(ctx.destroy, 0)
        pull = ctx.socket(zmq.PULL)  # never read
        pull.setsockopt(zmq.RCVHWM, 1)
        pull.setsockopt(zmq.RCVBUF, 4096)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        mgr = MooncakeKVManager.__new__(MooncakeKVManager)
        mgr._zmq_ctx = ctx
        mgr._socket_lock = threading.Lock()
        mgr._socket_cache, mgr._monitor_cache, mgr._socket_send_locks = {}, {}, {}
        mgr.defer_decode_allocation = False
        mgr._status_sender = _PushSender(
            name="test-prefill-sender",
            connect=lambda target: mgr._connect(*target),
            send_timeout_s=0.0,
        )
        self.addCleanup(mgr._status_sender.stop)
        endpoint = f"tcp://127.0.0.1:{port}"
        # The decode's socket as _connect makes it, with a small SNDHWM so that
        # a few messages fill it.
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 1)
        push.setsockopt(zmq.SNDBUF, 4096)
        push.setsockopt(zmq.SNDTIMEO, 30000)
        push.connect(endpoint)
        mgr._socket_cache[endpoint] = push
        mgr._socket_send_locks[endpoint] = threading.Lock()
        sent = threading.Event()

        def post_many():
            for i in range(200):
                mgr._send_multipart_locked(endpoint, [b"x" * 65536, str(i).encode()])
            sent.set()

        with self.assertLogs(conn_mod.logger, "WARNING") as logs:
            threading.Thread(target=post_many, daemon=True).start()
            self.assertTrue(sent.wait(_WAIT_S), "a caller waited on the decode")
            self.assertTrue(mgr._status_sender.barrier().wait(_WAIT_S))
            self.assertTrue(mgr._status_sender.barrier().wait(_WAIT_S))
        self.assertIn(endpoint, logs.output[0])
        self.assertIn("SGLANG_DISAGGREGATION_STATUS_SEND_TIMEOUT", logs.output[0])
        self.assertEqual(mgr._status_sender.queued(), 0)


class _Clock:
    """A fake time module: sleep() advances the clock and is recorded."""

    def __init__(self, limit=100000):
        self.now = 1000.0
        self.sleeps = []
        self.limit = limit

    def monotonic(self):
        return self.now

    time = perf_counter = monotonic

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        if len(self.sleeps) > self.limit:
            raise AssertionError("still waiting on a decode that never answers")
        self.now += max(seconds, 1e-6)


class TestNixlAwaitHandles(CustomTestCase):
    def test_a_wait_on_a_decode_that_never_answers_is_bounded_and_backs_off(self):
        mgr = NixlKVManager.__new__(NixlKVManager)
        mgr.agent = SimpleNamespace(check_xfer_state=lambda handle: "PROC")
        clock = _Clock()
        with mock.patch.object(nixl_mod, "time", clock):
            settled, failed = mgr._await_handles([object()], failure_seen=False)
        self.assertEqual((settled, failed), (False, True))
        waited = clock.now - 1000.0
        bound = conn_mod.SGLANG_DISAGGREGATION_KV_TRANSFER_TIMEOUT.get()
        self.assertGreaterEqual(waited, bound)
        self.assertLess(waited, bound + 1.0)
        # No busy wait: after the first polls, every pause is the longest one.
        self.assertEqual(set(clock.sleeps[20:]), {nixl_mod.NIXL_POLL_MAX_S})

    def test_a_healthy_batch_is_polled_at_once(self):
        mgr = NixlKVManager.__new__(NixlKVManager)
        states = iter(["PROC", "PROC", "DONE"])
        mgr.agent = SimpleNamespace(check_xfer_state=lambda handle: next(states))
        clock = _Clock()
        with mock.patch.object(nixl_mod, "time", clock):
            self.assertEqual(
                mgr._await_handles([object()], failure_seen=False), (True, False)
            )
        self.assertEqual(clock.sleeps, [0.0, 1e-5])


class TestMori(CustomTestCase):
    def test_the_transfer_wait_is_bounded_by_default(self):
        self.assertEqual(
            mori_mod._mori_transfer_timeout_ms(),
            int(conn_mod.SGLANG_DISAGGREGATION_KV_TRANSFER_TIMEOUT.get() * 1000),
        )
        mgr = MoriKVManager.__new__(MoriKVManager)
        mgr._transfer_timeout_ms = mori_mod._mori_transfer_timeout_ms()
        mgr._wait_poll_ms = 1000
        clock = _Clock()

        def wait_all(statuses, timeout_ms):
            clock.sleep(timeout_ms / 1000)
            return "in progress"

        mgr.engine = SimpleNamespace(wait_all=wait_all)
        codes = SimpleNamespace(IN_PROGRESS="in progress", SUCCESS="success")
        with (
            mock.patch.object(mori_mod, "time", clock),
            mock.patch.object(mori_mod, "StatusCode", codes),
        ):
            reason = mgr._wait_transfer_completion([object()])
        self.assertIn("exceeded", reason)

    def test_rooms_go_to_their_decodes_lane(self):
        mgr = MoriKVManager.__new__(MoriKVManager)
        mgr.disaggregation_mode = DisaggregationMode.PREFILL
        mgr.request_status = {1: KVPoll.WaitingForInput, 2: KVPoll.WaitingForInput}
        mgr.transfer_infos = {1: {"d1-r1": 0, "d1-r0": 0}, 2: {"d2-r0": 0}}
        mgr.decode_kv_args_table = {}
        put = []
        mgr._transfer_lanes = SimpleNamespace(
            inbox=lambda key: SimpleNamespace(put=lambda chunk: put.append(key))
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
        # Shape 7: the 0.5.23 worker signature on a plain FastQueue.
        mgr = _mooncake_prefill()
        self.mgr = mgr
        mgr._transfer_lanes.shutdown()
        mgr._transfer_lanes = None
        _room(mgr, 1, HEALTHY)  # no lanes: the 0.5.23 queue
        mgr.gates[HEALTHY].set()
        self.assertEqual(_wait_status(mgr, 1), KVPoll.Success)
        mgr.transfer_queues[0].put(None)


if __name__ == "__main__":
    unittest.main()
