"""The decode's ZMQ sends to a prefill never wait on it.

A PUSH socket to a prefill that does not read (here: nothing listens on the
port, so every message stays queued) takes SNDHWM messages, then a blocking
send waits SNDTIMEO. With SNDTIMEO set to far more than this test waits, a
send that blocked would still be running when the test gives up on it.
CPU-only: real ZMQ sockets on 127.0.0.1, no sleeps.
"""

import os
import socket
import threading
import unittest
from types import SimpleNamespace
from unittest import mock

import zmq

from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import CommonKVReceiver
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")

_WAIT_S = 30


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TestSendsToAPrefillThatDoesNotRead(CustomTestCase):
    def setUp(self):
        super().setUp()
        env = mock.patch.dict(
            os.environ, {"SGLANG_DISAGGREGATION_ZMQ_SEND_TIMEOUT": "3600"}
        )
        env.start()
        self.addCleanup(env.stop)
        self.info = {"rank_ip": "127.0.0.1", "rank_port": unused_port()}
        self.endpoint = f"tcp://127.0.0.1:{self.info['rank_port']}"
        self.blocked = None
        self.addCleanup(self.close)
        sock, _ = CommonKVReceiver._connect_to_bootstrap_server(self.info)
        # Fill its queue to SNDHWM: from here a blocking send would wait.
        for _ in range(100_000):
            try:
                sock.send_multipart([b"x"], flags=zmq.NOBLOCK)
            except zmq.Again:
                break
        else:
            self.fail("the socket never filled up")
        self.failures = {}
        self.statuses = {}
        self.receiver = CommonKVReceiver.__new__(CommonKVReceiver)
        self.receiver.bootstrap_room = 7
        self.receiver.kv_mgr = SimpleNamespace(
            record_failure=self.failures.__setitem__,
            update_status=self.statuses.__setitem__,
            local_ip="127.0.0.1",
            rank_port=1,
            enable_deferred_decode_kv_release=False,
        )

    def close(self):
        # A send that blocked still holds the socket's lock: leave it.
        if self.blocked is None:
            CommonKVReceiver.disconnect_endpoint(self.endpoint)

    def run_off_thread(self, fn):
        """Run ``fn`` on a thread; fail if it is still running after _WAIT_S
        (a blocked send waits an hour here)."""
        result = []
        thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
        thread.start()
        thread.join(_WAIT_S)
        if thread.is_alive():
            self.blocked = thread
            self.fail("the send waited on the prefill")
        return result[0] if result else None

    def test_a_metadata_send_fails_at_once_with_the_cause(self):
        sent = self.run_off_thread(
            lambda: self.receiver._send_bootstrap_message(
                bootstrap_info=self.info, message=[b"m"], operation="send_metadata"
            )
        )
        self.assertFalse(sent)
        self.assertEqual(self.statuses, {7: KVPoll.Failed})
        self.assertIn("does not read what this decode sends", self.failures[7])

    def test_an_abort_notification_is_dropped_at_once(self):
        self.receiver.bootstrap_infos = [self.info]
        self.receiver.init_time = None
        self.receiver.abort_notified = False
        self.receiver._abort_generation = None
        self.run_off_thread(self.receiver._send_abort_notification)


if __name__ == "__main__":
    unittest.main()
