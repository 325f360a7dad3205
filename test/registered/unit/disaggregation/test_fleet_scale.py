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

import socket
import threading
import unittest
from types import SimpleNamespace
from unittest import mock

import zmq
from sglang.srt.disaggregation import decode as decode_mod
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common import conn as conn_mod
from sglang.srt.disaggregation.common.conn import (
    CommonKVReceiver,
    KVTransferError,
    _PushSender,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from test_decode_push_sender import isolate_push_sender
from test_no_network_on_scheduler_thread import _Base as NoNetworkBase
from test_no_network_on_scheduler_thread import (
    PREFILL_INFO,
    FakeBootstrapServer,
    FakeClock,
    fake_clock_and_manager,
    make_decode_manager,
    make_queue,
    make_req,
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
        self.mgr.heartbeat_interval = 0
        self.mgr.max_failures = 2
        self.mgr._heartbeat_shutdown = threading.Event()
        self.addCleanup(self.mgr._heartbeat_shutdown.set)

    def probes(self, get):
        """``get(url)`` answers every heartbeat probe."""
        patcher = mock.patch.object(conn_mod._bootstrap_http, "get", side_effect=get)
        patcher.start()
        self.addCleanup(patcher.stop)

    def run_heartbeat(self, until: threading.Event):
        thread = self.mgr._start_heartbeat_checker_thread()
        self.addCleanup(thread.join, _WAIT_S)
        self.assertTrue(until.wait(_WAIT_S))
        self.mgr._heartbeat_shutdown.set()
        self.mgr._heartbeat_results.put(None)

    def test_a_round_probes_every_prefill_concurrently(self):
        # Every probe waits until all of them are in flight at once: probed
        # one after the other, the first would never get past this.
        all_in_flight = threading.Barrier(self.PREFILLS, timeout=_WAIT_S)

        def get(url, **kwargs):
            all_in_flight.wait()
            return FakeResponse(200)

        self.probes(get)
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

        self.probes(get)
        self.mgr.max_failures = 1
        failed = []
        all_failed = threading.Event()

        def on_failure(addr):
            self.mgr.prefill_info_table.pop(addr)
            failed.append(addr)
            if len(failed) == self.PREFILLS:
                all_failed.set()

        self.mgr._handle_node_failure = on_failure
        # A probe not answered by its deadline has failed.
        with mock.patch.object(conn_mod, "HEARTBEAT_PROBE_TIMEOUT_S", 0):
            self.run_heartbeat(all_failed)
        self.assertEqual(sorted(failed), sorted(self.addrs))
        self.assertFalse(release.is_set())

    def test_an_answer_is_handled_while_another_probe_hangs(self):
        frozen, healthy = self.addrs[0], self.addrs[1]
        for addr in self.addrs[2:]:
            del self.mgr.prefill_info_table[addr]
        self.mgr.heartbeat_failures[healthy] = 1  # missed once: held back
        release = threading.Event()
        self.addCleanup(release.set)

        def get(url, **kwargs):
            if frozen in url:
                release.wait(_WAIT_S)
            return FakeResponse(200)

        self.probes(get)
        answered = threading.Event()
        self.mgr._on_heartbeat_success = lambda addr: addr == healthy and answered.set()
        # The frozen probe's deadline is far off: a round that waited for it
        # would mark the healthy prefill reachable only then.
        with mock.patch.object(conn_mod, "HEARTBEAT_PROBE_TIMEOUT_S", 10 * _WAIT_S):
            self.run_heartbeat(answered)
        self.assertEqual(self.mgr.heartbeat_failures[healthy], 0)
        self.assertFalse(release.is_set())

    def test_teardown_during_a_probe_declares_nothing(self):
        in_flight = threading.Event()
        release = threading.Event()
        self.addCleanup(release.set)

        def get(url, **kwargs):
            in_flight.set()
            release.wait(_WAIT_S)
            raise ConnectionResetError  # the shutdown cut it off

        self.probes(get)
        self.mgr.max_failures = 1
        declared = []
        self.mgr._handle_node_failure = declared.append
        with mock.patch.object(conn_mod, "HEARTBEAT_PROBE_TIMEOUT_S", 10 * _WAIT_S):
            thread = self.mgr._start_heartbeat_checker_thread()
            self.assertTrue(in_flight.wait(_WAIT_S))
            self.mgr._stop_bootstrap_fetches()  # what every teardown calls
            thread.join(_WAIT_S)
        self.assertFalse(thread.is_alive())
        release.set()
        self.assertEqual(declared, [])


class FrozenRank:
    """A prefill rank's PULL socket on 127.0.0.1 that reads only when told:
    with small buffers on both ends, a few messages fill it (SNDHWM)."""

    def __init__(self, test: CustomTestCase):
        self.ctx = zmq.Context()
        test.addCleanup(self.ctx.destroy, linger=0)
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVHWM, 1)
        self.sock.setsockopt(zmq.RCVBUF, 4096)
        self.sock.setsockopt(zmq.RCVTIMEO, _WAIT_S * 1000)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.info = {"rank_ip": "127.0.0.1", "rank_port": self.port}
        # The decode's PUSH socket to it, small too, made before the sender
        # would make one with the defaults.
        push = CommonKVReceiver._ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.SNDHWM, 1)
        push.setsockopt(zmq.SNDBUF, 4096)
        push.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        push.connect(self.endpoint)
        CommonKVReceiver._socket_cache[self.endpoint] = push
        CommonKVReceiver._socket_locks[self.endpoint] = threading.Lock()

    def recv(self):
        return self.sock.recv_multipart()


class TestPushSenderPerPeer(CustomTestCase):
    """The real sender thread and ZMQ sockets; a fake clock stands for time."""

    MESSAGES = 200
    FRAME = b"x" * 4096

    def setUp(self):
        super().setUp()
        isolate_push_sender(self)
        self.clock = FakeClock()
        patcher = mock.patch.object(conn_mod, "time", self.clock)
        patcher.start()
        self.addCleanup(patcher.stop)
        self.frozen, self.healthy = FrozenRank(self), FrozenRank(self)
        self.sender = CommonKVReceiver.start_push_sender()
        self.addCleanup(self.forget_all)  # runs first: the sender closes them

    def forget_all(self):
        for rank in (self.frozen, self.healthy):
            self.sender.forget(rank.endpoint)
        self.sync()
        self.assertEqual(CommonKVReceiver._socket_cache, {})

    def sync(self):
        self.assertTrue(self.sender.barrier().wait(_WAIT_S))

    def fill_frozen(self, failures):
        """Post MESSAGES to the frozen rank: a few leave into the buffers,
        the rest are held back."""
        for i in range(self.MESSAGES):
            self.sender.post(
                self.frozen.info, [str(i).encode(), self.FRAME], failures.append
            )
        self.sync()
        self.assertIn(self.frozen.endpoint, self.sender._held)

    def test_a_peer_that_does_not_read_does_not_delay_another(self):
        failures = []
        self.fill_frozen(failures)
        self.sender.post(self.healthy.info, [b"to-healthy"])
        self.assertEqual(self.healthy.recv(), [b"to-healthy"])
        self.assertEqual(failures, [])

    def test_the_sender_sleeps_once_it_has_caught_up(self):
        # A wake-up left unread makes every poll return at once: a sender
        # thread that spins a core for as long as the process lives.
        done = self.sender.barrier()
        self.assertTrue(done.wait(_WAIT_S))
        entries, after_barrier = [], threading.Event()
        poll = self.sender._poller.poll

        def recorded(timeout=None):
            try:
                pending = bool(self.sender._wake_r.recv(1, socket.MSG_PEEK))
            except BlockingIOError:
                pending = False
            with self.sender._lock:
                # A wake-up with no command to go with it.
                entries.append(pending and not self.sender._inbox)
            if done.is_set():
                after_barrier.set()
            return poll(timeout)

        self.sender._poller.poll = recorded
        self.sender.post(self.healthy.info, [b"x"])
        self.assertEqual(self.healthy.recv(), [b"x"])
        done = self.sender.barrier()
        self.assertTrue(done.wait(_WAIT_S))
        self.assertTrue(after_barrier.wait(_WAIT_S))
        self.assertNotIn(True, entries)

    def test_held_messages_are_waited_on_not_polled_for(self):
        timeouts = []
        poll = self.sender._poller.poll

        def recorded(timeout=None):
            timeouts.append(timeout)
            return poll(timeout)

        self.sender._poller.poll = recorded
        self.fill_frozen([])
        self.sync()
        # It sleeps until the held messages are due to fail, or a socket can
        # take one: no wake-ups every few ms.
        self.assertGreaterEqual(timeouts[-1], 900 * self.sender._send_timeout_s)

    def test_a_stuck_peers_held_messages_all_fail_within_one_sndtimeo(self):
        failures = []
        self.fill_frozen(failures)
        # ZMQ's I/O thread may still move a message or two into the kernel
        # buffers after fill_frozen: the peer took one, so it is not stuck
        # yet. Each SNDTIMEO then either sees one leave or fails them all,
        # so this ends within MESSAGES rounds.
        for _ in range(self.MESSAGES):
            self.clock.now += self.sender._send_timeout_s  # one SNDTIMEO later
            self.sync()
            if self.sender.queued() == 0:
                break
            self.assertEqual(failures, [])  # none fail while some leave
        self.assertEqual(self.sender.queued(), 0)
        self.assertGreater(len(failures), self.MESSAGES // 2)
        self.assertTrue(all(isinstance(e, zmq.Again) for e in failures))

    def test_held_messages_leave_in_order_once_the_peer_reads(self):
        failures = []
        self.fill_frozen(failures)
        got = [self.frozen.recv()[0] for _ in range(self.MESSAGES)]
        self.assertEqual(got, [str(i).encode() for i in range(self.MESSAGES)])
        self.assertEqual(failures, [])

    def test_a_failed_prefills_messages_are_dropped_and_its_socket_closed(self):
        failures = []
        self.fill_frozen(failures)
        CommonKVReceiver.disconnect_endpoint(self.frozen.endpoint)
        self.sync()
        self.assertNotIn(self.frozen.endpoint, CommonKVReceiver._socket_cache)
        self.assertEqual(self.sender.queued(), 0)
        self.assertEqual(failures, [])  # nobody waits for them any more
        self.sender.post(self.healthy.info, [b"after"])
        self.assertEqual(self.healthy.recv(), [b"after"])

    def test_a_peer_holds_a_bounded_backlog_and_others_still_post(self):
        failures = []
        self.fill_frozen(failures)
        # More than this are held (and a late one leaving cannot change it).
        full = self.MESSAGES // 2
        self.assertGreater(self.sender.queued(), full)
        with mock.patch.object(_PushSender, "MAX_QUEUED_PER_ENDPOINT", full):
            self.sender.post(self.frozen.info, [b"one too many"], failures.append)
        self.assertEqual(len(failures), 1)  # at once, in post()
        self.assertIsInstance(failures[0], conn_mod.queue.Full)
        self.sender.post(self.healthy.info, [b"y"])
        self.assertEqual(self.healthy.recv(), [b"y"])


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

    def settle(self):
        """Cycles until the rooms asked so far have their answers used."""
        self.cycle()
        self.drain()
        self.cycle()

    def test_a_request_replaced_in_place_is_seen(self):
        self.server.unknown = {1, 2, 3}
        self.pend(1, 2, 3)
        self.settle()
        self.assertEqual(self.pending_rooms(), [1, 2, 3])

        # Same length, same last element: only the first one changed.
        replaced = self.queue.pending_reqs[0]
        self.pend(4)
        self.queue.pending_reqs[0] = self.queue.pending_reqs.pop()
        self.server.unknown = set()
        self.pass_interval()
        self.settle()

        self.assertEqual(self.inits, [(4, 4), (2, 2), (3, 3)])
        self.assertEqual(self.queue.pending_reqs, [])
        self.assertNotIn(replaced.req.bootstrap_room, [room for room, _ in self.inits])

    def test_an_in_place_sort_is_followed(self):
        self.server.unknown = {10, 11, 12}
        self.pend(10, 11, 12)
        for decode_req, priority in zip(self.queue.pending_reqs, (1, 2, 0)):
            decode_req.req.priority = priority
        self.settle()

        # Priority scheduling reorders the list in place; the last stays.
        self.queue.pending_reqs.sort(key=lambda r: -r.req.priority)
        self.assertEqual(self.pending_rooms(), [11, 10, 12])
        self.server.unknown = set()
        self.pass_interval()
        self.settle()

        self.assertEqual([room for room, _ in self.inits], [11, 10, 12])

    def test_a_query_dropped_by_release_memory_occupation_is_asked_again(self):
        self.server.hold.clear()
        self.pend(20, 21)
        self.cycle()  # the query goes out and is held
        self.assertTrue(self.server.held.wait(_WAIT_S))

        self.queue.release_memory_occupation()
        self.assertEqual(self.queue._prefill_dp_rank_queries, {})
        self.server.hold.set()
        self.drain()
        self.pass_interval()
        self.settle()

        self.assertEqual(self.inits, [(20, 4), (21, 5)])
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


class TestTablesDrainAfterChurn(NoNetworkBase):
    """Prefills that come and go (served a request, then went away and were
    declared failed) leave nothing behind on the decode: every per-address
    table, the fetch threads, the connections and the sockets are back to
    idle."""

    PREFILLS = 12

    def setUp(self):
        super().setUp()
        isolate_push_sender(self)
        self.sender = CommonKVReceiver.start_push_sender()
        self.http = conn_mod._BootstrapHTTP()
        patcher = mock.patch.object(conn_mod, "_bootstrap_http", self.http)
        patcher.start()
        self.addCleanup(patcher.stop)
        self.pool = self.mgr._parallel_info_executor
        self.pool._idle_s = 0  # a lane's threads end once it has no work
        self.mgr.max_failures = 2
        self.mgr.local_ip = "127.0.0.1"
        self.mgr.rank_port = 12345

    def come_and_go(self, room: int) -> None:
        server = FakeBootstrapServer(
            dict(PREFILL_INFO, attn_tp_size=2), keep_alive=True
        )
        addr = f"127.0.0.1:{server.port}"
        try:
            decode_req = self.add(make_req(server.port, room))
            for _ in range(3):
                self.cycle()
            self.assertEqual(decode_req.kv_receiver.poll(), KVPoll.WaitingForInput)
            decode_req.kv_receiver.abort()  # served, or aborted: it ends
            with self.assertRaises(KVTransferError):
                decode_req.kv_receiver.failure_exception()
            self.queue.queue.remove(decode_req)
        finally:
            server.stop()
        for _ in range(self.mgr.max_failures):  # it went away: the heartbeat
            self.mgr._on_heartbeat_probe(addr, self.mgr._probe_prefill_health(addr))
        self.assertNotIn(addr, self.mgr.prefill_info_table)

    def test_prefills_that_come_and_go_leave_nothing_behind(self):
        for room in range(self.PREFILLS):
            self.come_and_go(room)

        self.assertTrue(self.sender.barrier().wait(_WAIT_S))
        with self.pool._lock:
            threads = list(self.pool._threads)
        for thread in threads:
            thread.join(_WAIT_S)
        later = FakeClock()
        later.now = conn_mod.time.monotonic() + 3600
        with mock.patch.object(conn_mod, "time", later):
            self.mgr._orphaned_rooms.addrs()
            self.http.sweep()

        self.assertEqual(self.mgr._bootstrap_setups, {})
        for table in (
            "prefill_info_table",
            "connection_pool",
            "heartbeat_failures",
            "failure_records",
            "request_status",
            "_parallel_info_inflight",
        ):
            self.assertEqual(len(getattr(self.mgr, table)), 0, table)
        self.assertEqual(self.mgr._orphaned_rooms.addrs(), [])
        self.assertEqual(self.mgr._orphaned_rooms.endpoint_count(), 0)
        self.assertEqual(self.pool.thread_count(), 0)
        self.assertEqual(dict(self.mgr.addr_to_rooms_tracker), {})
        self.assertEqual(self.mgr.session_pool, {})
        self.assertEqual(
            (self.pool._lanes, self.pool._by_addr, self.pool._by_call), ({}, {}, {})
        )
        self.assertEqual(self.http._idle, {})
        self.assertEqual(CommonKVReceiver._socket_cache, {})
        self.assertEqual((self.sender._queued, self.sender._held), ({}, {}))
        self.assertEqual(self.queue.pending_reqs, [])
        self.assertEqual(self.queue._pending_seen, ())


if __name__ == "__main__":
    unittest.main()
