"""One decode, many prefills: a sick prefill only ever uses up its own share.

- Each prefill has lanes of its own in the fetch pool (test_bootstrap_fetch_pool.py
  has the pool itself); here, the heartbeat: every prefill is probed at once,
  so a round takes as long as its slowest probe, and frozen prefills are all
  declared failed in the same round however many they are.
- The ZMQ sender: a prefill rank whose SNDHWM is full holds back only its own
  messages.
- The pending path: a cycle looks again only at prefills with news (a request
  added, an answer landed, a retry due), also when ``pending_reqs`` is
  assigned or appended to directly, and keeps each prefill's FIFO order.

Built like sglang's tests of these paths: ``DecodePreallocQueue.__new__`` with
a SimpleNamespace kv manager and a real ``/query_dp_ranks`` server on
127.0.0.1 (fixture 5 of design.md), and the decode manager of
test_no_network_on_scheduler_thread.py. CPU-only, no sleeps: threads meet at
``threading.Barrier`` and ``threading.Event``; time is a fake clock.
"""

import threading
import unittest
from types import SimpleNamespace
from unittest import mock

import zmq
from sglang.srt.disaggregation import decode as decode_mod
from sglang.srt.disaggregation.common import conn as conn_mod
from sglang.srt.disaggregation.common.conn import CommonKVReceiver, _PushSender
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from test_no_network_on_scheduler_thread import (
    fake_clock_and_manager,
    make_decode_manager,
    make_queue,
)
from test_parallel_info_nonblocking import FakeGet, FakeResponse, patch_get
from test_prefill_dp_rank_query import _Base as DpRankBase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

_WAIT_S = 30


class TestHeartbeatProbesEveryPrefillAtOnce(CustomTestCase):
    PREFILLS = 8

    def setUp(self):
        super().setUp()
        self.mgr = make_decode_manager()
        self.addCleanup(
            self.mgr._parallel_info_executor.shutdown, wait=False, cancel_futures=True
        )
        self.addrs = [f"127.0.2.{i}:8998" for i in range(self.PREFILLS)]
        for addr in self.addrs:
            self.mgr.prefill_info_table[addr] = object()
        self.mgr.session_pool_lock = threading.Lock()
        self.mgr.heartbeat_interval = 0
        self.mgr.max_failures = 2
        self.mgr._heartbeat_shutdown = threading.Event()
        self.addCleanup(self.mgr._heartbeat_shutdown.set)

    def sessions(self, get):
        session = mock.MagicMock()
        session.get.side_effect = get
        self.mgr.session_pool = {addr: session for addr in self.addrs}

    def run_heartbeat(self, until: threading.Event):
        thread = self.mgr._start_heartbeat_checker_thread()
        self.addCleanup(thread.join, _WAIT_S)
        self.assertTrue(until.wait(_WAIT_S))
        self.mgr._heartbeat_shutdown.set()

    def test_a_round_probes_every_prefill_concurrently(self):
        # Every probe waits until all of them are in flight at once: probed
        # one after the other, the first would never get past this.
        all_in_flight = threading.Barrier(self.PREFILLS, timeout=_WAIT_S)

        def get(url, **kwargs):
            all_in_flight.wait()
            return FakeResponse(200)

        self.sessions(get)
        answered = []
        all_answered = threading.Event()

        def on_success(addr):
            answered.append(addr)
            if len(set(answered)) == self.PREFILLS:
                all_answered.set()

        self.mgr._on_heartbeat_success = on_success
        with mock.patch.object(conn_mod, "HEARTBEAT_PROBE_TIMEOUT_S", _WAIT_S):
            self.run_heartbeat(all_answered)
        self.assertEqual(sorted(answered[: self.PREFILLS]), sorted(self.addrs))

    def test_frozen_prefills_are_all_declared_failed_in_one_round(self):
        release = threading.Event()
        self.addCleanup(release.set)

        def get(url, **kwargs):  # a frozen prefill: no answer
            release.wait(_WAIT_S)
            return FakeResponse(200)

        self.sessions(get)
        self.mgr.max_failures = 1
        failed = []
        all_failed = threading.Event()

        def on_failure(addr):
            self.mgr.prefill_info_table.pop(addr)
            failed.append(addr)
            if len(failed) == self.PREFILLS:
                all_failed.set()

        self.mgr._handle_node_failure = on_failure
        # A probe not answered by the end of the round has failed.
        with mock.patch.object(conn_mod, "HEARTBEAT_PROBE_TIMEOUT_S", 0):
            self.run_heartbeat(all_failed)
        self.assertEqual(sorted(failed), sorted(self.addrs))
        self.assertFalse(release.is_set())


class FakePushSocket:
    """A PUSH socket: ``full`` stands for a peer whose SNDHWM is reached."""

    def __init__(self, full: bool):
        self.full = full
        self.sent = []
        self.sent_event = threading.Event()
        self.all_sent = threading.Event()
        self.expected = 1

    def send_multipart(self, frames, flags=0):
        if self.full:
            raise zmq.Again()
        self.sent.append(frames)
        self.sent_event.set()
        if len(self.sent) >= self.expected:
            self.all_sent.set()


class TestPushSenderPerPeer(CustomTestCase):
    def setUp(self):
        super().setUp()
        self.sockets = {1: FakePushSocket(full=True), 2: FakePushSocket(full=False)}
        locks = {port: threading.Lock() for port in self.sockets}
        patcher = mock.patch.object(
            CommonKVReceiver,
            "_connect_to_bootstrap_server",
            lambda info: (self.sockets[info["rank_port"]], locks[info["rank_port"]]),
        )
        patcher.start()
        self.addCleanup(patcher.stop)
        self.sender = _PushSender()
        self.sender._send_timeout_s = 10 * _WAIT_S  # held until a test says
        self.addCleanup(self.fail_held_messages)

    def fail_held_messages(self):
        """Leave nothing for this sender's thread to send in a later test."""
        self.sender._send_timeout_s = 0
        done = threading.Event()
        for _ in range(1000):  # bounded: held ones are retried every few ms
            if self.sender.queued() == 0:
                return
            done.wait(self.sender.RETRY_INTERVAL_S)
        self.fail("the sender kept messages")

    @staticmethod
    def info(port):
        return {"rank_ip": "127.0.0.1", "rank_port": port}

    def test_a_peer_that_does_not_read_does_not_delay_another(self):
        failed = threading.Event()
        self.sender.post(self.info(1), [b"to-full"], lambda e: failed.set())
        self.sender.post(self.info(2), [b"to-healthy"])

        self.assertTrue(self.sockets[2].sent_event.wait(_WAIT_S))
        self.assertEqual(self.sockets[2].sent, [[b"to-healthy"]])
        self.assertFalse(failed.is_set())

        # Past SNDTIMEO it fails, as an inline send would have.
        errors = []
        failed_again = threading.Event()
        self.sender.post(
            self.info(1),
            [b"second"],
            lambda e: (errors.append(e), failed_again.set()),
        )
        self.sender._send_timeout_s = 0
        self.assertTrue(failed.wait(_WAIT_S))
        self.assertTrue(failed_again.wait(_WAIT_S))
        self.assertIsInstance(errors[0], zmq.Again)
        self.assertEqual(self.sender.queued(), 0)

    def test_held_messages_leave_in_order_once_the_peer_reads(self):
        self.sockets[1].expected = 3
        for i in range(3):
            self.sender.post(self.info(1), [str(i).encode()])
        self.sender.post(self.info(2), [b"meanwhile"])
        self.assertTrue(self.sockets[2].sent_event.wait(_WAIT_S))
        self.sockets[1].full = False  # the peer reads again
        self.assertTrue(self.sockets[1].all_sent.wait(_WAIT_S))
        self.assertEqual(self.sockets[1].sent, [[b"0"], [b"1"], [b"2"]])

    def test_a_peer_holds_a_bounded_backlog_and_others_still_post(self):
        failures = []
        with mock.patch.object(_PushSender, "MAX_QUEUED_PER_ENDPOINT", 2):
            for i in range(3):
                self.sender.post(self.info(1), [b"x"], failures.append)
            self.sender.post(self.info(2), [b"y"], failures.append)
        self.assertEqual(len(failures), 1)  # the third to the full peer only
        self.assertTrue(self.sockets[2].sent_event.wait(_WAIT_S))


class CountingAddr:
    """Counts the pending requests a cycle looks at (each one's address)."""

    def __init__(self, test: CustomTestCase):
        self.calls = 0
        original = decode_mod._bootstrap_addr

        def counted(req):
            self.calls += 1
            return original(req)

        patcher = mock.patch.object(decode_mod, "_bootstrap_addr", counted)
        patcher.start()
        test.addCleanup(patcher.stop)


class TestPendingPathCostsWhatChanged(DpRankBase):
    """Fixture 5 of design.md: DecodePreallocQueue.__new__, a SimpleNamespace
    kv manager, a real /query_dp_ranks server."""

    def cycle(self):
        self.queue.prefetch_prefill_dp_rank_queries()
        self.queue._resolve_pending_reqs()

    def test_a_cycle_without_news_looks_at_no_request(self):
        self.server.hold.clear()  # the answer does not land
        self.pend(*range(100, 150))
        self.cycle()
        self.assertTrue(self.server.held.wait(_WAIT_S))
        counted = CountingAddr(self)

        for _ in range(5):
            self.cycle()

        self.assertEqual(counted.calls, 0)
        self.assertEqual(len(self.queue.pending_reqs), 50)
        # The answer lands: news, and every request of that prefill resolves.
        self.server.hold.set()
        self.drain()
        self.cycle()
        self.assertEqual(self.queue.pending_reqs, [])
        self.assertEqual([room for room, _ in self.inits], list(range(100, 150)))

    def test_appended_and_assigned_requests_are_seen(self):
        self.server.unknown = {1}
        self.pend(1)
        self.cycle()
        self.drain()
        self.cycle()
        self.assertEqual(self.pending_rooms(), [1])

        self.pend(2, 3)  # appended directly
        self.cycle()
        self.drain()
        self.cycle()
        self.assertEqual(self.inits, [(2, 2), (3, 3)])

        # Assigned directly, as pop_preallocated and upstream's tests do.
        others = list(self.queue.pending_reqs)
        self.pend(4)
        self.queue.pending_reqs = [self.queue.pending_reqs[-1]] + others
        self.cycle()
        self.drain()
        self.cycle()
        self.assertEqual(self.inits, [(2, 2), (3, 3), (4, 4)])
        self.assertEqual(self.pending_rooms(), [1])

        # Cleared and refilled in place with as many requests.
        self.queue.pending_reqs.clear()
        self.server.unknown = set()
        self.pend(5)
        self.cycle()
        self.drain()
        self.cycle()
        self.assertEqual(self.inits[-1], (5, 5))
        self.assertEqual(self.queue.pending_reqs, [])

    def test_a_room_due_again_is_asked_without_a_new_request(self):
        self.server.unknown = {7}
        self.pend(7)
        self.cycle()
        self.drain()
        self.cycle()
        self.server.unknown = set()
        self.cycle()  # not due yet
        self.assertEqual(self.server.bodies, [[7]])

        self.pass_interval()
        self.cycle()
        self.drain()
        self.cycle()
        self.assertEqual(self.server.bodies, [[7], [7]])
        self.assertEqual(self.inits, [(7, 7)])


class TestWaitingForParallelInfoCostsNothingPerRequest(CustomTestCase):
    """The real manager's parallel-info fetch, hung on a frozen prefill."""

    def setUp(self):
        super().setUp()
        self.clock, self.mgr = fake_clock_and_manager(self)
        self.queue = make_queue(self.mgr)

    def test_requests_of_a_frozen_prefill_are_not_walked_each_cycle(self):
        fake = patch_get(self, FakeGet("block", FakeResponse(503)))
        for room in range(200):
            self.queue.pending_reqs.append(
                SimpleNamespace(
                    req=SimpleNamespace(
                        bootstrap_host="127.0.0.1",
                        bootstrap_port=8998,
                        bootstrap_room=room,
                        disagg_prefill_dp_rank=None,
                    ),
                    kv_receiver=mock.MagicMock(bootstrap_room=room),
                )
            )
        self.queue._resolve_pending_reqs()
        self.assertTrue(fake.entered.wait(_WAIT_S))
        counted = CountingAddr(self)

        for _ in range(5):
            self.clock.now += 1.0  # within the fetch's bound
            self.queue.prefetch_prefill_dp_rank_queries()
            self.queue._resolve_pending_reqs()

        self.assertEqual(counted.calls, 0)
        self.assertEqual(len(fake.calls), 1)
        self.assertEqual(len(self.queue.pending_reqs), 200)


if __name__ == "__main__":
    unittest.main()
