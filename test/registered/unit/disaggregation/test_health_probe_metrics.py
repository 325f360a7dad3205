"""The decode's own /health probe is not a bootstrap failure.

/health sends a 1-token request with the fake bootstrap host. When its caller
gives up (sglang-router's 5 s health-check timeout while the decode's KV is
held by requests for a frozen prefill), the probe is aborted in the prealloc
queue and ended as a failed handshake. 0.5.23 counted that in
sglang:num_bootstrap_failed_reqs_total, which then disagreed with what clients
saw (the chaos soak: 21 failures counted, 19 failed attempts seen).

``_update_handshake_waiters`` bound on ``DecodePreallocQueue.__new__`` (fixture
5's shape), polls patched to Failed.
"""

import unittest
from types import SimpleNamespace
from unittest import mock

from sglang.srt.disaggregation import decode as decode_mod
from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.disaggregation.decode import DecodePreallocQueue
from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=1, suite="base-a-test-cpu")


def decode_req(rid: str, host: str, room: int):
    receiver = mock.MagicMock()
    receiver.failure_exception.side_effect = Exception("lost the prefill")
    req = SimpleNamespace(rid=rid, bootstrap_host=host, bootstrap_room=room)
    return SimpleNamespace(req=req, kv_receiver=receiver)


class TestHealthProbeIsNotABootstrapFailure(CustomTestCase):
    def test_only_client_requests_are_counted(self):
        queue = DecodePreallocQueue.__new__(DecodePreallocQueue)
        queue.queue = [
            decode_req("HEALTH_CHECK_1", FAKE_BOOTSTRAP_HOST, 0),
            decode_req("client-1", "127.0.0.1", 7),
        ]
        queue.pp_size = 1
        queue.gloo_group = None
        queue.tp_rank = 0
        queue.scheduler = SimpleNamespace(
            metrics_reporter=SimpleNamespace(enable_metrics=True),
            metrics_collector=mock.MagicMock(),
        )
        with (
            mock.patch.object(
                decode_mod,
                "poll_and_all_reduce",
                return_value=[KVPoll.Failed, KVPoll.Failed],
            ),
            mock.patch.object(decode_mod, "prepare_abort") as prepare_abort,
        ):
            queue._update_handshake_waiters()

        # Both are ended; one is a client's bootstrap failure.
        self.assertEqual(prepare_abort.call_count, 2)
        collector = queue.scheduler.metrics_collector
        collector.increment_bootstrap_failed_reqs.assert_called_once_with()


if __name__ == "__main__":
    unittest.main()
