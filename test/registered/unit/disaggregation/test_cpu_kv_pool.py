"""PD transfer backends with the KV cache in host memory (``--device cpu``).

Mooncake: the prefill must not take the async index copy (pinned memory +
``torch.cuda.Event``) when the KV cache is not on an accelerator.
NIXL: a host KV pool must be registered as DRAM on both sides; UCX refuses host
memory registered as VRAM.
"""

import sys
import unittest
from types import SimpleNamespace
from unittest import mock

import torch
from sglang.srt.disaggregation import decode as decode_mod
from sglang.srt.disaggregation.base.conn import KVArgs
from sglang.srt.disaggregation.common.conn import CommonKVManager
from sglang.srt.disaggregation.decode import DecodePreallocQueue
from sglang.srt.disaggregation.mooncake import conn as mooncake_conn
from sglang.srt.disaggregation.nixl import conn as nixl_conn
from sglang.srt.disaggregation.utils import DisaggregationMode, TransferBackend
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

LAYERS = 2


def device(name: str):
    return SimpleNamespace(device=name, gpu_id=0)


def cpu_kv_pool() -> MHATokenToKVPool:
    return MHATokenToKVPool(
        size=64,
        page_size=1,
        dtype=torch.float16,
        head_num=2,
        head_dim=8,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )


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


class _Stop(Exception):
    pass


class TestNixlPrefillMemKind(CustomTestCase):
    """The prefill passes no kinds: the manager picks them from the device."""

    def kinds_chosen(self, device_name: str, kinds=None):
        kv_args = SimpleNamespace(kv_data_ptrs=[1, 2], kv_data_mem_kinds=kinds)

        def fake_common_init(self, args, *_):
            self.kv_args = args

        mgr = nixl_conn.NixlKVManager.__new__(nixl_conn.NixlKVManager)
        with mock.patch.object(
            nixl_conn, "get_device", lambda: device(device_name)
        ), mock.patch.object(
            CommonKVManager, "__init__", fake_common_init
        ), mock.patch.dict(
            sys.modules, {"nixl._api": None}
        ):
            # Construction stops at the NIXL import, right after the choice.
            with self.assertRaises(ImportError):
                mgr.__init__(kv_args, DisaggregationMode.PREFILL, None)
        return kv_args.kv_data_mem_kinds, mgr.src_mem_kind

    def test_host_kv_pool_registers_as_dram(self):
        self.assertEqual(self.kinds_chosen("cpu"), (["DRAM", "DRAM"], "DRAM"))

    def test_cuda_kv_pool_registers_as_vram(self):
        self.assertEqual(self.kinds_chosen("cuda"), (["VRAM", "VRAM"], "VRAM"))

    def test_explicit_kinds_win(self):
        self.assertEqual(
            self.kinds_chosen("cpu", ["VRAM", "VRAM"]), (["VRAM", "VRAM"], "VRAM")
        )


class TestNixlDecodeMemKind(CustomTestCase):
    """DecodePreallocQueue._init_kv_manager hands the pool's kind to NIXL."""

    def kinds_sent(self, pool, draft_pool=None):
        captured = {}

        class Manager:
            def __init__(self, kv_args, *args):
                captured["kv_args"] = kv_args
                raise _Stop

        def get_kv_class(backend, class_type):
            self.assertEqual(backend, TransferBackend.NIXL)
            return KVArgs if class_type.name == "KVARGS" else Manager

        queue = DecodePreallocQueue.__new__(DecodePreallocQueue)
        queue.transfer_backend = TransferBackend.NIXL
        queue.tp_rank = queue.pp_rank = 0
        queue.token_to_kv_pool = pool
        queue.draft_token_to_kv_pool = draft_pool
        queue.is_mla_backend = False
        queue.metadata_buffers = SimpleNamespace(get_buf_infos=lambda: ([0], [8], [8]))
        queue.scheduler = SimpleNamespace(
            enable_hisparse=False,
            tp_worker=SimpleNamespace(
                model_runner=SimpleNamespace(kv_cache_dtype_str="auto")
            ),
            model_config=SimpleNamespace(num_hidden_layers=LAYERS),
            server_args=None,
        )
        patches = [
            mock.patch.object(decode_mod, "get_kv_class", get_kv_class),
            mock.patch.object(
                decode_mod,
                "get_parallel",
                lambda: SimpleNamespace(attn_tp_size=1, dp_rank=None),
            ),
            mock.patch.object(
                decode_mod,
                "get_disagg",
                lambda: SimpleNamespace(
                    disaggregation_decode_host_receive_threshold=1.0,
                    disaggregation_ib_device=None,
                ),
            ),
            mock.patch.object(decode_mod, "get_device", lambda: device("cpu")),
        ]
        for p in patches:
            p.start()
            self.addCleanup(p.stop)
        with self.assertRaises(_Stop):
            queue._init_kv_manager()
        return captured["kv_args"].kv_data_mem_kinds

    def test_host_kv_pool_registers_as_dram(self):
        kinds = self.kinds_sent(cpu_kv_pool())
        self.assertEqual(kinds, ["DRAM"] * (2 * LAYERS))

    def test_device_kv_pool_registers_as_vram(self):
        pool = cpu_kv_pool()
        pool.device = "cuda:0"  # only where the pool says it lives matters
        self.assertEqual(self.kinds_sent(pool), ["VRAM"] * (2 * LAYERS))

    def test_host_draft_kv_pool_registers_as_dram(self):
        kinds = self.kinds_sent(cpu_kv_pool(), draft_pool=cpu_kv_pool())
        self.assertEqual(kinds, ["DRAM"] * (4 * LAYERS))


if __name__ == "__main__":
    unittest.main()
