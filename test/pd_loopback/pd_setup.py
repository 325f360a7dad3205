"""Per-process set-up shared by the loopback prefill worker and the decode side.

Builds the minimum global state a real PD KV manager needs on a CPU machine,
the way ``run_scheduler_process`` and the two queues' ``_init_kv_manager``
build it (see "Running real PD on these CPU machines" in the design notes):

- a ``ServerArgs`` for a tiny local model directory (only ``config.json``);
- the runtime context published as a TP=1/PP=1/DP=1 scheduler;
- for Mooncake, the shared transfer engine (TCP transport);
- a CPU ``MHATokenToKVPool`` plus ``MetadataBuffers``, and ``KVArgs`` built
  from them field by field as ``PrefillBootstrapQueue._init_kv_manager`` and
  ``DecodePreallocQueue._init_kv_manager`` build them. The one deviation: NIXL
  KV buffers are registered as ``"DRAM"`` (the decode queue would say
  ``"VRAM"``, which UCX refuses for host memory).

Nothing here imports sglang at module import time, so the harness can set the
environment first.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Optional

HOST = "127.0.0.1"

# Tiny GPT-2 shape: the KV pool below is laid out for it.
NUM_LAYERS = 2
HEAD_NUM = 4
HEAD_DIM = 16
MODEL_CONFIG = {
    "model_type": "gpt2",
    "architectures": ["GPT2LMHeadModel"],
    "vocab_size": 512,
    "n_embd": HEAD_NUM * HEAD_DIM,
    "n_layer": NUM_LAYERS,
    "n_head": HEAD_NUM,
    "n_inner": 128,
    "n_positions": 512,
    "n_ctx": 512,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}

POOL_TOKENS = 1024
PAGE_SIZE = 1
METADATA_SLOTS = 256

# Read by the Mooncake transfer engine and by get_local_ip_auto(): set before
# any sglang import in every process of the harness.
LOOPBACK_ENV = {
    "MC_FORCE_TCP": "1",
    "MOONCAKE_PROTOCOL": "tcp",
    "SGLANG_HOST_IP": HOST,
}
# Defaults only. The nixl wheel's UCX EFA module links the system libefa
# (Debian ibverbs-providers, installed with libibverbs1 for Mooncake), which
# loads the system libnl-route next to the wheel's bundled copy; the process
# then segfaults in rtnl_tc_unregister at exit, after the tests have passed.
# EFA is never used on loopback, so its module is not loaded.
LOOPBACK_ENV_DEFAULTS = {
    "UCX_MODULES": "^efa",
}


def apply_loopback_env(env: Optional[dict] = None) -> dict:
    target = os.environ if env is None else env
    target.update(LOOPBACK_ENV)
    for key, value in LOOPBACK_ENV_DEFAULTS.items():
        target.setdefault(key, value)
    return target


def ensure_tiny_model(root: Optional[str] = None) -> str:
    """Return a directory holding only the tiny model's ``config.json``.
    ``ServerArgs`` reads the config; no weights are ever loaded."""
    root = root or os.path.join(tempfile.gettempdir(), "pd_loopback_model")
    path = os.path.join(root, "config.json")
    text = json.dumps(MODEL_CONFIG, indent=2, sort_keys=True)
    try:
        with open(path) as f:
            if f.read() == text:
                return root
    except OSError:
        pass
    os.makedirs(root, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=root, prefix=".config-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return root


def make_server_args(
    *,
    mode: str,
    backend: str,
    model_path: str,
    port: int,
    bootstrap_port: int,
    **extra,
):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(
        model_path=model_path,
        device="cpu",
        host=HOST,
        port=port,
        disaggregation_mode=mode,
        disaggregation_transfer_backend=backend,
        disaggregation_bootstrap_port=bootstrap_port,
        **extra,
    )


def publish_process(server_args) -> None:
    """Publish the runtime context as ``run_scheduler_process`` does for a
    single-rank scheduler; no torch.distributed group is created."""
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish

    publish(
        server_args,
        role="scheduler",
        ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=0),
    )
    get_parallel().override_permanently(pp_group=None)
    if server_args.disaggregation_transfer_backend == "mooncake":
        from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
            maybe_init_shared_mooncake_transfer_engine,
        )

        maybe_init_shared_mooncake_transfer_engine(gpu_id=0)


def make_kv_pool():
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(
        size=POOL_TOKENS,
        page_size=PAGE_SIZE,
        dtype=torch.float16,
        head_num=HEAD_NUM,
        head_dim=HEAD_DIM,
        layer_num=NUM_LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )


def make_metadata_buffers(server_args):
    import torch
    from sglang.srt.disaggregation.utils import MetadataBuffers

    return MetadataBuffers(
        METADATA_SLOTS,
        hidden_size=16,
        hidden_states_dtype=torch.float32,
        max_sampling_mask_tokens=server_args.sampling_mask_max_tokens,
    )


def make_kv_buffers(server_args):
    """(KV pool, metadata buffers, token allocator, metadata slot allocator)
    of one side, prefill or decode."""
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    pool = make_kv_pool()
    allocator = TokenToKVPoolAllocator(
        POOL_TOKENS, pool.dtype, "cpu", pool, need_sort=False
    )
    return (
        pool,
        make_metadata_buffers(server_args),
        allocator,
        ReqToMetadataIdxAllocator(METADATA_SLOTS),
    )


def _common_kv_args(backend: str, pool, metadata_buffers):
    from sglang.srt.disaggregation.utils import (
        KVClassType,
        TransferBackend,
        build_kv_layer_ids,
        get_kv_class,
        get_kv_transfer_buf_infos,
        get_pd_kv_layout,
    )
    from sglang.srt.runtime_context import get_device, get_disagg, get_parallel

    kv_args = get_kv_class(TransferBackend(backend), KVClassType.KVARGS)()
    kv_args.pp_rank = 0
    kv_args.system_dp_rank = get_parallel().dp_rank
    kv_args.kv_cache_dtype_str = "auto"
    kv_args.kv_layout = get_pd_kv_layout(pool)
    ptrs, lens, item_lens = get_kv_transfer_buf_infos(pool)
    kv_args.kv_data_ptrs = ptrs
    kv_args.kv_data_lens = lens
    kv_args.kv_item_lens = item_lens
    kv_args.num_draft_entries = 0
    kv_args.kv_layer_ids = build_kv_layer_ids(
        token_to_kv_pool=pool,
        draft_token_to_kv_pool=None,
        num_draft_entries=0,
        num_hidden_layers=NUM_LAYERS,
    )
    kv_args.page_size = pool.page_size
    kv_args.aux_data_ptrs, kv_args.aux_data_lens, kv_args.aux_item_lens = (
        metadata_buffers.get_buf_infos()
    )
    kv_args.ib_device = get_disagg().disaggregation_ib_device
    kv_args.gpu_id = get_device().gpu_id
    if backend == "nixl":
        # Host memory: UCX refuses it when registered as VRAM.
        kv_args.kv_data_mem_kinds = ["DRAM"] * len(ptrs)
    return kv_args


def _make_manager(mode: str, backend: str, server_args, pool, metadata_buffers):
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode,
        KVClassType,
        TransferBackend,
        get_kv_class,
        setup_state_kv_args,
    )

    kv_args = _common_kv_args(backend, pool, metadata_buffers)
    kv_args.engine_rank = 0
    if mode == "prefill":
        kv_args.rust_http_port = None
        kv_args.prefill_start_layer = pool.start_layer
        kv_args.prefill_end_layer = getattr(pool, "end_layer", None)
        kv_args.kv_head_num = pool.head_num
        kv_args.total_kv_head_num = HEAD_NUM
    setup_state_kv_args(
        kv_args, pool, None, total_kv_layers=NUM_LAYERS, req_to_token_pool=None
    )
    manager_class = get_kv_class(TransferBackend(backend), KVClassType.MANAGER)
    return manager_class(kv_args, DisaggregationMode(mode), server_args, False)


def make_prefill_manager(backend: str, server_args, pool, metadata_buffers):
    return _make_manager("prefill", backend, server_args, pool, metadata_buffers)


def make_decode_manager(backend: str, server_args, pool, metadata_buffers):
    return _make_manager("decode", backend, server_args, pool, metadata_buffers)


def kv_pattern(room: int, num_tokens: int):
    """The K and V contents the prefill writes for ``room``, one tensor per
    layer of shape (num_tokens, HEAD_NUM, HEAD_DIM); decode checks against it."""
    import torch

    gen = torch.Generator().manual_seed(room & 0x7FFFFFFF)
    shape = (NUM_LAYERS, 2, num_tokens, HEAD_NUM, HEAD_DIM)
    return torch.randn(shape, generator=gen).to(torch.float16)
