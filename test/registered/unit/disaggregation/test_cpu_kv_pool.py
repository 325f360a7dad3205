"""PD transfer backends with the KV cache in host memory (``--device cpu``).

Mooncake: the prefill must not take the async index copy (pinned memory +
``torch.cuda.Event``) when the KV cache is not on an accelerator.
"""

import unittest
from types import SimpleNamespace
from unittest import mock

from sglang.srt.disaggregation.mooncake import conn as mooncake_conn
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")


def device(name: str):
    return SimpleNamespace(device=name, gpu_id=0)


class TestMooncakeHostTensorIndices(CustomTestCase):
    def supports(self, device_name: str) -> bool:
        sender = mooncake_conn.MooncakeKVSender.__new__(mooncake_conn.MooncakeKVSender)
        with mock.patch.object(
            mooncake_conn, "get_device", lambda: device(device_name)
        ):
            # prefill.py reads it exactly like this.
            return getattr(sender, "supports_host_tensor_indices", False)

    def test_host_kv_cache_takes_the_plain_index_path(self):
        self.assertFalse(self.supports("cpu"))

    def test_cuda_kv_cache_keeps_the_async_index_copy(self):
        self.assertTrue(self.supports("cuda"))
        self.assertTrue(self.supports("cuda:1"))


if __name__ == "__main__":
    unittest.main()
