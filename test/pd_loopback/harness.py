"""Real prefill/decode disaggregation on 127.0.0.1, for tests and the stall bench.

What runs for real
------------------
- N prefill processes (``prefill_worker.py``), each hosting the backend's real
  bootstrap server and a real PREFILL-mode ``MooncakeKVManager`` /
  ``NixlKVManager``, sending KV through the real ``KVSender`` API.
- In this process, the DECODE side: a real DECODE-mode KV manager (with its
  heartbeat and listener threads) and a real ``DecodePreallocQueue`` whose
  ``add()``, ``_resolve_pending_reqs()`` (with ``_ensure_prefill_info`` and
  ``_init_receiver``) and ``_update_handshake_waiters()`` are the 0.5.23 /
  patched code, unmodified. KV moves over the backend's TCP transport into a
  CPU ``MHATokenToKVPool`` and is compared byte for byte.

What is replaced (scheduler-owned pieces the pending-resolution path does not
exercise)
----------------------------------------------------------------------------
- The ``Scheduler`` passed to ``DecodePreallocQueue.__init__`` is
  ``_SchedulerStub``: server args, a TP worker that is not hybrid-SWA, metrics
  off, an output streamer that drops output, a random seed.
- ``DecodePreallocQueue._init_kv_manager`` is overridden (``_LoopbackPreallocQueue``)
  to return a manager built by ``pd_setup.make_decode_manager``, which builds
  ``KVArgs`` field by field as the real method does; the only deviation is
  NIXL memory registered as DRAM. The rest of ``__init__`` is the real one.
- ``get_parallel().attn_tp_group`` is stated as a one-rank group
  (``_SingleRankGroup``, ``size() == 1``), so the poll all-reduce in
  ``_update_handshake_waiters`` is the identity, as on a TP=1 decode. No
  torch.distributed group exists.
- No ``req_to_token_pool``, tree cache, running batch or ``DecodeTransferQueue``:
  ``DecodeSide.step()`` does what ``pop_preallocated()`` and
  ``pop_transferred()`` would do for the requests it owns: allocate KV slots
  from a real ``TokenToKVPoolAllocator`` and a metadata slot, call
  ``kv_receiver.send_metadata``, poll the receiver, drop aborted requests from
  ``queue``/``pending_reqs``. ``step()`` is the "decode scheduling call" whose
  duration the tests bound and the bench reports; ``add()`` calls are timed
  too. Both record the HTTP requests the calling (scheduler) thread sends,
  through the interpreter's ``http.client.send`` audit event.
- ``kv_manager.prefill_info_table`` is swapped for a dict subclass that
  timestamps insertions (observation only: when a fetch landed).

Faults: ``PrefillProcess.freeze()`` / ``resume()`` / ``kill()`` send SIGSTOP /
SIGCONT / SIGKILL; ``PrefillProcess.set_fault()`` makes that prefill's
bootstrap server delay or answer an HTTP error on decode-facing requests (an
aiohttp middleware inside the prefill process, see ``prefill_worker.py``).
``Blackhole`` is a listening socket that never accepts: a frozen bootstrap
server as seen from the network, costing no process.

Setup requirements
------------------
- Python packages (in the project venv): ``sglang==0.5.23``,
  ``mooncake-transfer-engine-non-cuda``, ``nixl``.
- Debian package ``libibverbs1`` (brings ``libnl-3-200``, ``libnl-route-3-200``):
  the Mooncake transfer engine loads it even for its TCP transport.
- The environment of ``pd_setup.LOOPBACK_ENV`` (``MC_FORCE_TCP=1
  MOONCAKE_PROTOCOL=tcp SGLANG_HOST_IP=127.0.0.1``) and, unless already set,
  ``UCX_MODULES=^efa`` (see ``pd_setup``: without it a process that ran NIXL
  segfaults at exit when Debian's ``ibverbs-providers`` is installed);
  ``apply_loopback_env()`` sets them, and this module does so at import time,
  before sglang, Mooncake or UCX are loaded.
- The sglang under test comes from ``PYTHONPATH`` (a variant directory); the
  prefill processes inherit it.
- Only 127.0.0.1 is used. Each prefill costs ~10 s of CPU to start (sglang
  import) and ~1.3 GB RSS, most of it shared library pages (three processes
  add ~2.5 GB to the host's used memory).

Process hygiene: every prefill runs in its own session (process group) and is
killed with SIGKILL on ``close()``, at interpreter exit (``atexit``), on
SIGTERM/SIGHUP (turned into ``SystemExit`` so ``finally`` blocks run) and, via
``PR_SET_PDEATHSIG``, when the thread that started it dies. Start prefills from
the main thread.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import pd_setup  # noqa: E402

pd_setup.apply_loopback_env()

# The harness by concern; names are re-exported here for its users.
from call_recording import HTTP, Cycle, HttpLog  # noqa: E402,F401
from decode_side import DecodeSide, Tracked, detect_variant  # noqa: E402,F401
from prefill_processes import (  # noqa: E402,F401
    HOST,
    WORKER,
    Blackhole,
    PrefillProcess,
    _kill_group,
    fault_spec,
    free_port,
    install_signal_handlers,
    kill_all_children,
)

# ---------------------------------------------------------------------------
# A whole loopback deployment
# ---------------------------------------------------------------------------


class Cluster:
    """N prefill processes plus the in-process decode side, as a context
    manager that stops everything it started on exit, success or not."""

    def __init__(
        self,
        backend: str,
        num_prefills: int,
        *,
        decode_kwargs: Optional[dict] = None,
        log_dir: Optional[str] = None,
        allocation_policy: str = "early",
    ):
        self.backend = backend
        self.model_path = pd_setup.ensure_tiny_model()
        self._own_log_dir = log_dir is None
        self.log_dir = log_dir or tempfile.mkdtemp(prefix=f"pd_loopback_{backend}_")
        # allocation_policy: --disaggregation-decode-allocation-policy, on every
        # server.
        self.prefills: List[PrefillProcess] = [
            PrefillProcess(
                backend, self.model_path, self.log_dir, f"prefill{i}", allocation_policy
            )
            for i in range(num_prefills)
        ]
        self.blackholes: List[Blackhole] = []
        self.decode: Optional[DecodeSide] = None
        self._decode_kwargs = dict(decode_kwargs or {})
        self._decode_kwargs["server_args"] = {
            **self._decode_kwargs.get("server_args", {}),
            "disaggregation_decode_allocation_policy": allocation_policy,
        }

    def __enter__(self) -> "Cluster":
        install_signal_handlers()
        try:
            for p in self.prefills:
                p.start()
            # The decode side imports sglang while the prefills do the same.
            self.decode = DecodeSide(
                self.backend, self.model_path, **self._decode_kwargs
            )
            for p in self.prefills:
                p.wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add_blackhole(self) -> Blackhole:
        b = Blackhole()
        self.blackholes.append(b)
        return b

    def request(
        self,
        target,
        num_tokens: int = 16,
        send_timeout_s: float = 30,
        hold_s: float = 0.0,
    ) -> Tracked:
        """A new request routed to ``target`` (a PrefillProcess or an addr):
        the prefill is asked to serve it (sending its KV ``hold_s`` after the
        decode's metadata came), then the decode ``add()``s it."""
        addr = target.addr if hasattr(target, "addr") else target
        room = self.decode.new_room()
        job = None
        if isinstance(target, PrefillProcess):
            job = target.send_kv(
                room, num_tokens, timeout_s=send_timeout_s, hold_s=hold_s
            )
        t = self.decode.add(addr, num_tokens=num_tokens, room=room)
        t.prefill_job = job
        return t

    def close(self) -> None:
        try:
            if self.decode is not None:
                self.decode.close()
        finally:
            for p in self.prefills:
                p.kill()
            for b in self.blackholes:
                b.close()
            if self._own_log_dir and not os.environ.get("PD_LOOPBACK_KEEP_LOGS"):
                shutil.rmtree(self.log_dir, ignore_errors=True)


def percentile(values: List[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)
