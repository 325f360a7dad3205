"""The prefill process of the mirror cluster (mirror.py): prefill_worker.Worker
(a real bootstrap server and a real PREFILL-mode KV manager) that also reports
each send's timeline and the manager's state.

Started by ``mirror.MirrorCluster``; not a test module. Events (id 0) to the
driver, in ``time.monotonic()`` (system-wide on Linux): ``waiting`` (the
decode's metadata arrived), ``sent`` (``sender.send()`` called). The reply to a
``send`` command comes when its room ended. ``state`` returns the manager's
queues, transfer lanes, threads and the free KV and metadata slots.
"""

from __future__ import annotations

import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import prefill_worker  # noqa: E402


class MirrorPrefill(prefill_worker.Worker):
    def event(self, kind: str, **fields) -> None:
        self.reply(dict(fields, id=0, event=kind))

    def cmd_state(self, msg: dict) -> dict:
        mgr = self.manager
        lanes = getattr(mgr, "_transfer_lanes", None)
        queues = getattr(mgr, "transfer_queues", [])
        out = {
            "ok": True,
            "queues": len(queues),
            "queue_depths": [len(getattr(q, "_buf", ())) for q in queues],
            "lanes": lanes.lane_count() if lanes is not None else None,
            "lane_threads": lanes.thread_count() if lanes is not None else None,
            "threads": threading.active_count(),
            "transfer_infos": len(mgr.transfer_infos),
            "request_status": len(mgr.request_status),
            "kv_free_tokens": self.allocator.available_size(),
            "metadata_free": self.metadata_allocator.available_size(),
        }
        if self.args.backend == "mooncake":
            with mgr.session_lock:
                out["failed_sessions"] = sorted(mgr.failed_sessions)
        return out


if __name__ == "__main__":
    sys.exit(prefill_worker.main(MirrorPrefill))
