"""The scheduler-owned pieces the decode pending-resolution path reads,
stated for the loopback harness (see harness.py)."""

from __future__ import annotations

import time
from typing import Dict

import pd_setup

# ---------------------------------------------------------------------------
# Decode side
# ---------------------------------------------------------------------------


class _SingleRankGroup:
    """Stands for the attention-TP CPU group of a TP=1 decode: one rank, so
    ``all_reduce_flags`` returns its input."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


class _SchedulerStub:
    """The attributes of ``Scheduler`` that ``DecodePreallocQueue.__init__``,
    ``add()``, ``_resolve_pending_reqs()`` and ``_update_handshake_waiters()``
    read. Anything else raises AttributeError, which is how a new dependency
    would show up."""

    def __init__(self, server_args):
        from types import SimpleNamespace

        self.server_args = server_args
        self.tp_worker = SimpleNamespace(
            is_hybrid_swa=False,
            model_runner=SimpleNamespace(kv_cache_dtype_str="auto"),
        )
        self.model_config = SimpleNamespace(num_hidden_layers=pd_setup.NUM_LAYERS)
        self.random_seed = 0
        self.enable_hisparse = False
        self.kv_checksum_computer = None
        self.metrics_reporter = SimpleNamespace(enable_metrics=False)
        self.output_streamer = SimpleNamespace(stream_output=lambda *a, **k: None)

    def retire_unadmitted_request(self, req) -> None:
        raise AssertionError(f"harness request {req.rid} was rejected at intake")


class _TimestampedDict(dict):
    """``prefill_info_table`` that remembers when each key was last set."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.set_times: Dict[str, float] = {}

    def __setitem__(self, key, value):
        self.set_times[key] = time.perf_counter()
        super().__setitem__(key, value)


def _make_queue_class():
    from sglang.srt.disaggregation.decode import DecodePreallocQueue

    class _LoopbackPreallocQueue(DecodePreallocQueue):
        """The real queue; only the KV manager factory is replaced."""

        def __init__(self, *, prebuilt_kv_manager, **kwargs):
            self._prebuilt_kv_manager = prebuilt_kv_manager
            super().__init__(**kwargs)

        def _init_kv_manager(self):
            return self._prebuilt_kv_manager

    return _LoopbackPreallocQueue
