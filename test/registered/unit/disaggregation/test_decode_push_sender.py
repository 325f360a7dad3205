"""The decode scheduler thread never touches a prefill's ZMQ socket.

KV metadata, BOOTSTRAP and ABORT messages to prefill ranks go through one
sender thread per process, in the order they were posted; a send that fails
there fails its request with the prefill endpoint in the message, as an inline
send did. Real PULL sockets on 127.0.0.1 stand for the prefill ranks; every
send and connect on a ZMQ socket records its thread. No sleeps: receives wait
on the socket with a safety-net timeout, failures on ``threading.Event``.
"""

import threading
import unittest
from types import SimpleNamespace
from unittest import mock

import zmq
from sglang.srt.disaggregation import decode as decode_mod
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common import conn as conn_mod
from sglang.srt.disaggregation.common.conn import (
    AbortNotification,
    CommonKVManager,
    CommonKVReceiver,
    KVTransferError,
)
from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeRequest
from sglang.srt.disaggregation.fake.conn import FakeKVManager
from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from test_no_network_on_scheduler_thread import (
    ADDR,
    cache_info,
    make_decode_manager,
    make_req,
)

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

_WAIT_MS = 30_000


class ZmqSentinel:
    """Records the thread of every send, send_multipart and connect on a ZMQ
    socket in this process."""

    def __init__(self, test: CustomTestCase):
        self.calls = []
        for name in ("send", "send_multipart", "connect"):
            original = getattr(zmq.Socket, name)
            patcher = mock.patch.object(zmq.Socket, name, self._wrap(name, original))
            patcher.start()
            test.addCleanup(patcher.stop)

    def _wrap(self, name, original):
        def recorded(sock, *args, **kwargs):
            self.calls.append((name, threading.current_thread()))
            return original(sock, *args, **kwargs)

        return recorded

    def on(self, thread):
        return [name for name, t in self.calls if t is thread]


class PrefillRank:
    """A PULL socket on 127.0.0.1 standing for one prefill rank's port."""

    def __init__(self, test: CustomTestCase):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.RCVTIMEO, _WAIT_MS)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.info = {"rank_ip": "127.0.0.1", "rank_port": self.port, "is_dummy": False}
        test.addCleanup(self.ctx.destroy, linger=0)

    def recv(self):
        return self.sock.recv_multipart()


def isolate_push_sender(test: CustomTestCase) -> None:
    """A fresh sender and socket cache for ``test``, so nothing leaks between
    tests."""
    for name, value in (
        ("_push_sender", None),
        ("_socket_cache", {}),
        ("_socket_locks", {}),
    ):
        patcher = mock.patch.object(CommonKVReceiver, name, value)
        patcher.start()
        test.addCleanup(patcher.stop)


class _Base(CustomTestCase):
    def setUp(self):
        super().setUp()
        isolate_push_sender(self)
        self.mgr = make_decode_manager()
        self.addCleanup(self.mgr._parallel_info_executor.shutdown, wait=False)
        self.mgr.local_ip = "127.0.0.1"
        self.mgr.rank_port = 12345
        self.mgr.enable_deferred_decode_kv_release = False
        self.mgr.build_receiver_metadata_message = (
            lambda bootstrap_room, kv_indices, **kwargs: [
                b"METADATA",
                str(bootstrap_room).encode(),
                bytes(kv_indices),
            ]
        )
        CommonKVReceiver.start_push_sender()

    def receiver(self, room, *ranks) -> CommonKVReceiver:
        receiver = CommonKVReceiver(self.mgr, ADDR, room)
        receiver.bootstrap_infos = [rank.info for rank in ranks]
        receiver.required_dst_info_num = 1
        return receiver


class TestPushSender(_Base):
    def test_metadata_and_abort_leave_in_order_from_the_sender_thread(self):
        sentinel = ZmqSentinel(self)
        rank = PrefillRank(self)
        receiver = self.receiver(7, rank)

        receiver.send_metadata(bytes([1, 2]), aux_index=0)
        receiver.abort()

        self.assertEqual(rank.recv(), [b"METADATA", b"7", bytes([1, 2])])
        abort = AbortNotification.from_zmq(rank.recv())
        self.assertEqual((abort.room, abort.decode_port), (7, 12345))
        self.assertEqual(sentinel.on(threading.current_thread()), [])
        self.assertIn("send_multipart", [name for name, _ in sentinel.calls])

    def test_bootstrap_is_posted_like_metadata(self):
        rank = PrefillRank(self)
        receiver = self.receiver(8, rank)
        receiver._post_bootstrap_message(
            bootstrap_info=rank.info,
            message=[b"BOOTSTRAP", b"8", b"127.0.0.1", b"12345"],
            operation="BOOTSTRAP",
        )
        self.assertEqual(rank.recv(), [b"BOOTSTRAP", b"8", b"127.0.0.1", b"12345"])

    def test_a_failed_send_fails_the_request_with_the_endpoint(self):
        broken = {"rank_ip": "127.0.0.1", "rank_port": "no-port", "is_dummy": False}
        receiver = CommonKVReceiver(self.mgr, ADDR, 9)
        receiver.bootstrap_infos = [broken]
        receiver.required_dst_info_num = 1
        receiver._connection_pool_entries = {f"{ADDR}_0_0_0": receiver.bootstrap_infos}
        self.mgr.connection_pool[f"{ADDR}_0_0_0"] = receiver.bootstrap_infos
        failed = threading.Event()
        update_status = self.mgr.update_status

        def update(room, status):
            update_status(room, status)
            if status == KVPoll.Failed:
                failed.set()

        with mock.patch.object(self.mgr, "update_status", update):
            receiver.send_metadata(bytes([3]), aux_index=0)
            self.assertTrue(failed.wait(_WAIT_MS / 1000))

        self.assertEqual(receiver.poll(), KVPoll.Failed)
        with self.assertRaisesRegex(
            KVTransferError, "send_metadata to prefill 127.0.0.1:no-port failed"
        ):
            receiver.failure_exception()
        # Routes to a prefill rank that cannot be reached are fetched again.
        self.assertNotIn(f"{ADDR}_0_0_0", self.mgr.connection_pool)

    def test_an_aborted_request_leaves_no_failure_record(self):
        receiver = CommonKVReceiver(self.mgr, ADDR, 30)
        receiver.abort()  # by its client, in the prealloc queue
        receiver.clear()  # pop_preallocated drops it without failure_exception()
        self.assertEqual(self.mgr.failure_records, {})

    def test_a_late_send_failure_of_an_ended_request_records_nothing(self):
        broken = {"rank_ip": "127.0.0.1", "rank_port": "no-port", "is_dummy": False}
        receiver = CommonKVReceiver(self.mgr, ADDR, 31)
        receiver.clear()  # the request ended before its message failed
        receiver._post_bootstrap_message(
            bootstrap_info=broken, message=[b"x"], operation="send_metadata"
        )
        self.assertTrue(CommonKVReceiver.start_push_sender().barrier().wait(30))
        self.assertEqual(self.mgr.failure_records, {})
        self.assertNotIn(31, self.mgr.request_status)

    def test_a_full_queue_fails_the_post_at_once(self):
        sender = CommonKVReceiver.start_push_sender()
        failures = []
        with mock.patch.object(conn_mod._PushSender, "MAX_QUEUED", 0):
            sender.post({"rank_ip": "h", "rank_port": 1}, [b"x"], failures.append)
        self.assertEqual(len(failures), 1)
        self.assertIsInstance(failures[0], conn_mod.queue.Full)

    def test_the_decode_manager_starts_the_sender_not_a_scheduling_cycle(self):
        started = []
        original = threading.Thread.start

        def start(thread):
            started.append(thread.name)
            return original(thread)

        rank = PrefillRank(self)
        receiver = self.receiver(10, rank)
        with mock.patch.object(threading.Thread, "start", start):
            receiver.send_metadata(bytes([4]), aux_index=0)
        rank.recv()
        self.assertEqual(started, [])


class TestUnreachablePrefillHoldsNoHeadroom(CustomTestCase):
    def queue(self, heartbeat_failures):
        queue = DecodePreallocQueue.__new__(DecodePreallocQueue)
        queue.kv_manager = SimpleNamespace(heartbeat_failures=heartbeat_failures)
        queue.scheduler = SimpleNamespace(
            running_batch=SimpleNamespace(reqs=[object()]), waiting_queue=[]
        )
        queue.transfer_queue = SimpleNamespace(
            queue=[
                DecodeRequest(req=make_req(port, room), kv_receiver=None)
                for port, room in ((1, 1), (2, 2), (2, 3))
            ]
        )
        queue._update_held_back()  # what each cycle decides first
        return queue

    def test_requests_of_a_prefill_missing_heartbeats_are_not_counted(self):
        disagg = SimpleNamespace(disaggregation_transfer_backend="mooncake")
        with mock.patch.object(decode_mod, "get_disagg", return_value=disagg):
            self.assertEqual(self.queue({})._active_req_count(), 4)
            unreachable = self.queue({"127.0.0.1:2": 1})
            self.assertEqual(unreachable._active_req_count(), 2)
            self.assertEqual(self.queue({"127.0.0.1:2": 0})._active_req_count(), 4)

    def test_a_fake_transfer_is_never_held(self):
        queue = self.queue({"2.2.2.2:None": 1})
        fake = SimpleNamespace(bootstrap_host=FAKE_BOOTSTRAP_HOST)
        self.assertFalse(queue._prefill_unreachable(SimpleNamespace(req=fake)))

    def test_a_kv_manager_without_a_heartbeat_holds_nothing_back(self):
        # --disaggregation-transfer-backend fake: FakeKVManager has none.
        queue = self.queue({})
        queue.kv_manager = FakeKVManager.__new__(FakeKVManager)
        queue._update_held_back()
        disagg = SimpleNamespace(disaggregation_transfer_backend="fake")
        with mock.patch.object(decode_mod, "get_disagg", return_value=disagg):
            self.assertEqual(queue._active_req_count(), 4)


class TestPrefillAbortAckNeverWaits(CustomTestCase):
    """The prefill scheduler thread sends ABORT_ACK from CommonKVSender.clear();
    a decode that stopped reading must not hold it."""

    def manager(self):
        mgr = CommonKVManager.__new__(CommonKVManager)
        mgr.attn_tp_rank = mgr.attn_cp_rank = mgr.pp_rank = 0
        mgr.attn_cp_size = mgr.pp_size = 1
        mgr._socket_send_locks = {}
        self.sock = mock.MagicMock()
        mgr._connect = lambda endpoint, is_ipv6=False: self.sock
        mgr._socket_send_locks["tcp://127.0.0.1:5"] = threading.Lock()
        return mgr

    def test_a_send_waiting_at_the_same_decode_is_not_waited_for(self):
        mgr = self.manager()
        lock = mgr._socket_send_locks["tcp://127.0.0.1:5"]
        lock.acquire()  # a transfer worker blocked sending to this decode
        sent = threading.Thread(
            target=mgr._send_abort_ack,
            args=(1, conn_mod.AckTarget("127.0.0.1", 5, 0)),
            daemon=True,
        )
        sent.start()
        sent.join(_WAIT_MS / 1000)  # safety net: a wait would hang here
        ended = not sent.is_alive()
        lock.release()

        self.assertTrue(ended)
        self.sock.send_multipart.assert_not_called()

    def test_a_full_queue_is_not_waited_for(self):
        mgr = self.manager()
        self.sock.send_multipart.side_effect = zmq.Again()

        mgr._send_abort_ack(1, conn_mod.AckTarget("127.0.0.1", 5, 0))

        self.assertEqual(
            self.sock.send_multipart.call_args.kwargs["flags"], zmq.DONTWAIT
        )
        self.assertFalse(mgr._socket_send_locks["tcp://127.0.0.1:5"].locked())


if __name__ == "__main__":
    unittest.main()
