"""No orphaned requests: when a decode fails rooms because their prefill was
unreachable, that prefill is told once it answers again, and its side of
those requests ends at once with the decode's reason instead of waiting for
a decode bootstrap that never comes.

Decode side: what is remembered (bounded in count and age) and the ABORTs
sent on recovery, received on a real PULL socket on 127.0.0.1. Prefill side:
the ABORT handler of a real Mooncake manager's class. The wire format stays
0.5.23's: the reason is a frame after the generation, which 0.5.23 ignores.
No sleeps: a fake monotonic clock stands for time.
"""

import threading
import unittest
from unittest import mock

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common import conn as conn_mod
from sglang.srt.disaggregation.common.conn import (
    ORPHANED_ROOM_ABORT_REASON,
    AbortNotification,
    CommonKVManager,
    CommonKVReceiver,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from test_decode_push_sender import PrefillRank
from test_decode_push_sender import _Base as _SenderBase
from test_no_network_on_scheduler_thread import ADDR, FakeClock

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

ENDPOINTS = {("127.0.0.1", 7001), ("127.0.0.1", 7002)}


class TestOrphanedRoomsMemory(CustomTestCase):
    def setUp(self):
        super().setUp()
        self.clock = FakeClock()
        patcher = mock.patch.object(conn_mod, "time", self.clock)
        patcher.start()
        self.addCleanup(patcher.stop)
        self.rooms = conn_mod._OrphanedRooms(max_age_s=300)

    def test_nothing_is_kept_without_the_prefills_endpoints(self):
        self.assertEqual(self.rooms.add(ADDR, [1, 2]), 0)
        self.assertEqual(self.rooms.addrs(), [])

    def test_rooms_are_sent_at_a_few_answers_then_forgotten(self):
        self.rooms.add_endpoints(ADDR, ENDPOINTS)
        self.rooms.add(ADDR, [1, 2])

        for _ in range(conn_mod._OrphanedRooms.SENDS):
            endpoints, rooms = self.rooms.take(ADDR)
            self.assertEqual(endpoints, sorted(ENDPOINTS))
            self.assertEqual(sorted(rooms), [1, 2])
        self.assertEqual(self.rooms.take(ADDR), ([], []))
        self.assertEqual(self.rooms.addrs(), [])

    def test_rooms_expire_with_the_prefills_bootstrap_timeout(self):
        self.rooms.add_endpoints(ADDR, ENDPOINTS)
        self.rooms.add(ADDR, [1])
        self.clock.now += 200
        self.rooms.add(ADDR, [2])
        self.clock.now += 101

        self.assertEqual(self.rooms.take(ADDR)[1], [2])

    def test_the_count_is_bounded_oldest_first(self):
        self.rooms.add_endpoints(ADDR, ENDPOINTS)
        limit = conn_mod._OrphanedRooms.MAX_ROOMS
        for room in range(limit + 10):
            self.clock.now += 0.001
            self.rooms.add(ADDR, [room])

        rooms = self.rooms.take(ADDR)[1]
        self.assertEqual(len(rooms), limit)
        self.assertEqual(min(rooms), 10)


class TestDecodeAbortsOrphanedRooms(_SenderBase):
    def setUp(self):
        super().setUp()
        self.rank = PrefillRank(self)
        self.mgr.connection_pool[f"{ADDR}_0_0_0"] = [self.rank.info]
        self.mgr.prefill_info_table[ADDR] = object()

    def receiver(self, room) -> CommonKVReceiver:
        return CommonKVReceiver(self.mgr, ADDR, room)

    def aborts(self, n):
        return [AbortNotification.from_zmq(self.rank.recv()) for _ in range(n)]

    def test_rooms_failed_by_the_heartbeat_are_aborted_when_it_answers(self):
        failed = [self.receiver(room) for room in (1, 2)]
        done = self.receiver(3)
        self.mgr.update_status(3, KVPoll.Success)

        self.mgr._handle_node_failure(ADDR)
        later = self.receiver(4)  # made after the failure: never aborted
        self.mgr._abort_orphaned_rooms(ADDR)

        aborts = self.aborts(2)
        self.assertEqual(sorted(a.room for a in aborts), [1, 2])
        for abort in aborts:
            self.assertEqual(abort.reason, ORPHANED_ROOM_ABORT_REASON)
            self.assertEqual((abort.decode_ip, abort.decode_port), ("127.0.0.1", 12345))
            self.assertEqual(abort.generation, 0)
        self.assertEqual(
            self.mgr.check_status(later.bootstrap_room), KVPoll.Bootstrapping
        )
        del failed, done

    def cached_after_aborts(self):
        """Whether the decode still caches a socket to the rank's endpoint once
        the ABORTs of its orphaned rooms have left."""
        self.mgr._handle_node_failure(ADDR)
        self.mgr._abort_orphaned_rooms(ADDR)
        self.assertEqual([a.room for a in self.aborts(1)], [11])
        self.assertTrue(CommonKVReceiver._push_sender.barrier().wait(30))
        endpoint = f"tcp://127.0.0.1:{self.rank.port}"
        return endpoint in CommonKVReceiver._socket_cache

    def test_an_abort_to_endpoints_no_route_uses_keeps_no_socket(self):
        # A prefill that comes back at its address with other rank ports (a
        # restart) is never reached at the old ones again: a socket kept for
        # them would reconnect to them for as long as the decode runs.
        self.receiver(11)
        self.assertFalse(self.cached_after_aborts())

    def test_an_abort_to_endpoints_a_route_uses_keeps_the_socket(self):
        self.receiver(11)
        other_prefill = "127.0.0.1:8999"
        self.mgr.connection_pool[f"{other_prefill}_0_0_0"] = [self.rank.info]
        self.assertTrue(self.cached_after_aborts())

    def probe(self):
        """One heartbeat probe of ADDR and its verdict, as the heartbeat
        thread does them."""
        self.mgr._on_heartbeat_probe(ADDR, self.mgr._probe_prefill_health(ADDR))

    def test_a_prefill_no_longer_checked_is_probed(self):
        self.receiver(5)
        self.mgr._handle_node_failure(ADDR)
        get = mock.patch.object(conn_mod._bootstrap_http, "get").start()
        self.addCleanup(mock.patch.stopall)

        get.side_effect = ConnectionRefusedError
        self.probe()
        self.assertEqual(self.mgr._orphaned_rooms.addrs(), [ADDR])

        get.side_effect = None
        get.return_value = mock.MagicMock(status_code=200)
        self.probe()
        self.assertEqual([a.room for a in self.aborts(1)], [5])

    def run_heartbeat_until_aborted(self):
        """The real heartbeat checker thread, until it aborts orphaned rooms."""
        aborted = threading.Event()
        abort = self.mgr._abort_orphaned_rooms

        def recorded(addr):
            abort(addr)
            aborted.set()

        self.mgr._abort_orphaned_rooms = recorded
        get = mock.patch.object(conn_mod._bootstrap_http, "get").start()
        self.addCleanup(mock.patch.stopall)
        get.return_value = mock.MagicMock(status_code=200)
        self.mgr.session_pool_lock = threading.Lock()
        self.mgr.heartbeat_interval = 0
        self.mgr.max_failures = 2
        self.mgr._heartbeat_shutdown = threading.Event()
        thread = self.mgr._start_heartbeat_checker_thread()
        self.addCleanup(thread.join, 30)
        self.addCleanup(self.mgr._heartbeat_shutdown.set)
        self.assertTrue(aborted.wait(30))

    def test_the_heartbeat_aborts_when_a_checked_prefill_answers(self):
        self.receiver(8)
        self.mgr._handle_node_failure(ADDR)
        self.mgr.prefill_info_table[ADDR] = object()  # back, re-fetched

        self.run_heartbeat_until_aborted()
        self.assertEqual([a.room for a in self.aborts(1)], [8])

    def test_the_heartbeat_probes_a_prefill_no_longer_in_the_table(self):
        self.receiver(9)
        self.mgr._handle_node_failure(ADDR)
        self.assertNotIn(ADDR, self.mgr.prefill_info_table)

        self.run_heartbeat_until_aborted()
        self.assertEqual([a.room for a in self.aborts(1)], [9])

    def test_a_budget_exhausted_for_a_known_prefill_is_remembered(self):
        self.mgr._handle_node_failure(ADDR)  # its endpoints are known
        self.mgr.remember_orphaned_rooms(ADDR, [6])
        self.mgr._abort_orphaned_rooms(ADDR)
        self.assertEqual([a.room for a in self.aborts(1)], [6])

    def test_an_unknown_prefill_is_said_and_nothing_kept(self):
        with self.assertLogs(conn_mod.logger, "WARNING") as logs:
            self.mgr.remember_orphaned_rooms("10.0.0.9:1", [7])
        self.assertIn("never learned that prefill's rank endpoints", logs.output[0])
        self.assertEqual(self.mgr._orphaned_rooms.addrs(), [])


class TestAbortWireFormat(CustomTestCase):
    def test_the_reason_is_a_frame_after_0_5_23s(self):
        plain = AbortNotification(room=1, decode_ip="h", decode_port=2, generation=0)
        told = AbortNotification(
            room=1, decode_ip="h", decode_port=2, generation=0, reason="why"
        )
        self.assertEqual(plain.to_zmq(), [b"ABORT", b"1", b"h", b"2", b"0"])
        self.assertEqual(told.to_zmq(), plain.to_zmq() + [b"why"])
        self.assertEqual(AbortNotification.from_zmq(told.to_zmq()), told)
        self.assertIsNone(AbortNotification.from_zmq(plain.to_zmq()).reason)


class TestPrefillEndsAnAbortedWaitingRoom(CustomTestCase):
    def manager(self):
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

        mgr = MooncakeKVManager.__new__(MooncakeKVManager)
        mgr.request_status = {}
        mgr.failure_records = {}
        mgr.failure_lock = threading.Lock()
        mgr.deferred_bootstrap = None
        mgr.enable_deferred_decode_kv_release = False
        mgr._deferred_ack_targets = {}
        mgr._deferred_ack_poisoned_rooms = set()
        mgr._staging_outstanding = {}
        mgr._send_multipart_locked = mock.MagicMock()
        return mgr

    def abort(self, room):
        return AbortNotification(
            room=room,
            decode_ip="127.0.0.1",
            decode_port=5,
            generation=0,
            reason=ORPHANED_ROOM_ABORT_REASON,
        ).to_zmq()

    def test_a_room_waiting_for_its_decode_fails_with_the_decodes_reason(self):
        mgr = self.manager()
        mgr.update_status(11, KVPoll.Bootstrapping)

        self.assertTrue(mgr._handle_abort_notification(self.abort(11)))

        self.assertEqual(mgr.request_status[11], KVPoll.Failed)
        self.assertEqual(
            mgr.failure_records[11],
            f"Aborted by the decode: {ORPHANED_ROOM_ABORT_REASON}",
        )
        self.assertEqual(mgr._ignored_abort_notifications, 0)

    def test_an_unknown_or_finished_room_is_counted_and_ignored(self):
        mgr = self.manager()
        mgr.update_status(12, KVPoll.Bootstrapping)
        mgr.update_status(12, KVPoll.Success)

        mgr._handle_abort_notification(self.abort(12))
        mgr._handle_abort_notification(self.abort(13))

        self.assertEqual(mgr.request_status, {12: KVPoll.Success})
        self.assertEqual(mgr.failure_records, {})
        self.assertEqual(mgr._ignored_abort_notifications, 2)

    def test_the_shared_helper_keeps_an_existing_cause_without_a_reason(self):
        mgr = CommonKVManager.__new__(CommonKVManager)
        mgr.failure_records = {14: "earlier"}
        mgr.failure_lock = threading.Lock()
        mgr.note_abort_notification(AbortNotification(room=14), room_active=True)
        self.assertEqual(mgr.failure_records, {14: "earlier"})


if __name__ == "__main__":
    unittest.main()
