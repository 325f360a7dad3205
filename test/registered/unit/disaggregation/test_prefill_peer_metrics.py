"""Per-decode series for sglang's /metrics on the prefill: what each decode
has queued and in flight, how old its oldest chunk is, and its rooms failed.

The real _TransferScheduler on a fake clock, and the Mooncake and NIXL
transfer workers on fakes (test_prefill_transfer_scheduler.py's and
test_nixl_stuck_decode.py's), read back as sglang's /metrics reads them.
CPU-only, no sleeps.
"""

import threading
import unittest
from types import SimpleNamespace
from unittest import mock

import test_nixl_stuck_decode as nixl_tests
from test_nixl_stuck_decode import _nixl_prefill, _nixl_room
from test_peer_metrics import LABELS, MetricsTestCase, scrape, series
from test_prefill_transfer_scheduler import (
    SICK,
    _Clock,
    _mooncake_prefill,
    _room,
    _wait_status,
)

from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.disaggregation.common import conn as conn_mod
from sglang.srt.disaggregation.common.conn import CommonKVManager, _TransferScheduler
from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="base-a-test-cpu")

FAILED = "sglang:pd_decode_rooms_failed_total"
OLD, NEW = (
    "3f2a1b9c-5d1e-4c5a-9d6f-0a1b2c3d4e5f",
    "77e0c5d1-2b3a-4f4e-8a9b-5c6d7e8f9a0b",
)


class _Chunk(SimpleNamespace):
    pass


class TestPrefillSeries(MetricsTestCase):
    def test_queued_in_flight_oldest_and_failed_per_decode(self):
        clock = SimpleNamespace(now=100.0)
        scheduler = _TransferScheduler()
        metrics = self.metrics(lambda: scheduler.metric_rows({"rank": "0"}))
        sick, healthy = ("10.0.0.9:1",), ("10.0.0.8:1",)
        with mock.patch.object(conn_mod.time, "monotonic", lambda: clock.now):
            scheduler.put(sick, _Chunk(room=1))
            scheduler.put(sick, _Chunk(room=2))
            worker = scheduler.worker_queue()
            self.assertEqual(worker.get().room, 1)  # stuck sending it
            clock.now += 40
            scheduler.put(healthy, _Chunk(room=3))
            clock.now += 1
            metrics.write()
            samples = scrape(self.dir)
            queued = series(samples, "sglang:pd_decode_rooms_queued")
            self.assertEqual(queued, {"10.0.0.9:1": 1, "10.0.0.8:1": 1})
            in_flight = series(samples, "sglang:pd_decode_rooms_in_flight")
            self.assertEqual(in_flight, {"10.0.0.9:1": 1, "10.0.0.8:1": 0})
            age = series(samples, "sglang:pd_decode_oldest_chunk_age_seconds")
            self.assertEqual(age, {"10.0.0.9:1": 41.0, "10.0.0.8:1": 1.0})
            busy = series(samples, "sglang:pd_transfer_workers_busy")
            self.assertEqual(busy, {None: 1})
            # Its failure counters start at 0: rate() never sees a first sample.
            for kind in ("session", "transfer"):
                failed = series(samples, FAILED, kind=kind)
                self.assertEqual(failed, {"10.0.0.9:1": 0, "10.0.0.8:1": 0})

            scheduler.note_failed(sick, "session")
            scheduler.note_failed(sick, "session")
            self.assertEqual(worker.get().room, 3)  # the turn that waited longest
            self.assertEqual(worker.get().room, 2)
            metrics.write()
            samples = scrape(self.dir)
            failed = series(samples, FAILED, kind="session")
            self.assertEqual(failed, {"10.0.0.9:1": 2})
            queued = series(samples, "sglang:pd_decode_rooms_queued")
            self.assertEqual(queued, {"10.0.0.9:1": 0})  # the healthy one drained
            # The worker leaves the failed decode. Its failures stay a minute
            # after the last with nothing queued for it (forgotten or not: NIXL
            # and Mori never forget), then go.
            with scheduler._lock:
                worker._leave()
            clock.now += 59
            metrics.write()
            failed = series(scrape(self.dir), FAILED, kind="session")
            self.assertEqual(failed, {"10.0.0.9:1": 2})
            clock.now += 1
            metrics.write()
            self.assertEqual(series(scrape(self.dir), FAILED), {})
            self.assertEqual(scheduler._rooms, {})

    def test_rooms_are_counted_without_reading_the_queued_chunks(self):
        # metric_rows runs under the lock every put() takes: what it costs must
        # not grow with the chunks queued (100k of them took it 12-29 ms).
        reads = []

        class Chunk:
            def __init__(self, room):
                self._room = room

            @property
            def room(self):
                reads.append(self._room)
                return self._room

        scheduler = _TransferScheduler()
        for room in (1, 1, 2, 3, 3):
            scheduler.put(("10.0.0.9:1",), Chunk(room))
        del reads[:]
        rows = scheduler.metric_rows(LABELS)
        self.assertEqual(reads, [])
        queued = [r[2] for r in rows if r[0] == "sglang:pd_decode_rooms_queued"]
        self.assertEqual(queued, [3])
        worker = scheduler.worker_queue()
        worker.get()
        worker.get()  # room 1's two chunks taken: rooms 2 and 3 queued
        rows = scheduler.metric_rows(LABELS)
        queued = [r[2] for r in rows if r[0] == "sglang:pd_decode_rooms_queued"]
        self.assertEqual(queued, [2])

    def test_a_decode_failed_both_ways_goes_once_and_writes_go_on(self):
        clock = SimpleNamespace(now=100.0)
        scheduler = _TransferScheduler()
        metrics = self.metrics(lambda: scheduler.metric_rows(LABELS))
        sick = ("10.0.0.9:1",)
        with mock.patch.object(conn_mod.time, "monotonic", lambda: clock.now):
            scheduler.note_failed(sick, "session")
            scheduler.note_failed(sick, "transfer")
            clock.now += 60
            metrics.write()
            self.assertEqual(series(scrape(self.dir), FAILED), {})
            self.assertEqual(scheduler._failed_at, {})

    def test_a_failed_room_is_counted_for_its_decode_only_with_metrics(self):
        mgr = _mooncake_prefill(workers=1)
        self.addCleanup(mgr._transfer_scheduler.shutdown)
        self.addCleanup(lambda: [g.set() for g in list(mgr.gates.values())])
        mgr.rcs[SICK] = -1
        mgr.gates[SICK].set()
        _room(mgr, 1, SICK)
        self.assertEqual(_wait_status(mgr, 1), KVPoll.Failed)
        # Off: nothing kept (it is pruned only when written).
        self.assertEqual(dict(mgr._transfer_scheduler._failed), {})
        mgr.peer_metrics = self.metrics()
        _room(mgr, 2, SICK)
        self.assertEqual(_wait_status(mgr, 2), KVPoll.Failed)
        self.assertEqual(
            dict(mgr._transfer_scheduler._failed), {((SICK,), "session"): 1}
        )

    def test_a_room_its_decode_aborted_is_not_a_failure(self):
        # The decode's ABORT (a client cancelled, or it gave up on the room)
        # marks the room Failed while its chunk is sent; the worker then
        # concludes it Failed. No failure of that decode.
        mgr = _mooncake_prefill(workers=1)
        self.addCleanup(mgr._transfer_scheduler.shutdown)
        self.addCleanup(lambda: [g.set() for g in list(mgr.gates.values())])
        mgr.peer_metrics = self.metrics()
        _room(mgr, 1, SICK)
        self.assertTrue(mgr.entered[SICK].wait(30))
        mgr.update_status(1, KVPoll.Failed)  # as the ABORT handlers do
        mgr.gates[SICK].set()
        self.assertEqual(_wait_status(mgr, 1), KVPoll.Failed)
        self.assertEqual(dict(mgr._transfer_scheduler._failed), {})

    def test_a_nixl_room_given_up_unsettled_is_counted_for_its_decodes_address(self):
        # Its handles may still write: the worker fails it without concluding
        # it. It is a failure of that decode all the same, named by its
        # address (NIXL's agent names are uuids).
        clock = _Clock(step=0.5)
        mgr = _nixl_prefill(clock)
        mgr._transfer_scheduler = _TransferScheduler()
        mgr.peer_metrics = self.metrics(mgr._peer_metric_rows)
        mgr.durations[OLD] = None
        chunk = _nixl_room(mgr, 1, OLD)
        mgr.decode_kv_args_table[OLD].endpoint = "10.0.0.7"
        mgr.decode_kv_args_table[OLD].dst_port = 17000
        nixl_tests.TestNixlTransferWorker.run_worker(None, mgr, clock, chunk)
        self.assertEqual(mgr.request_status[1], KVPoll.Failed)
        mgr.peer_metrics.write()
        failed = series(scrape(self.dir), FAILED, kind="transfer")
        self.assertEqual(failed, {"10.0.0.7:17000/3f2a1b9c": 1})
        # It restarts at the same address: another agent, series of its own
        # (one label set for both would show 0 or 1 by turns).
        _nixl_room(mgr, 2, NEW)
        mgr.decode_kv_args_table[NEW].endpoint = "10.0.0.7"
        mgr.decode_kv_args_table[NEW].dst_port = 17000
        mgr._transfer_scheduler.put((NEW,), SimpleNamespace(room=2))
        mgr.peer_metrics.write()
        failed = series(scrape(self.dir), FAILED, kind="transfer")
        self.assertEqual(
            failed, {"10.0.0.7:17000/3f2a1b9c": 1, "10.0.0.7:17000/77e0c5d1": 0}
        )

    def test_conclude_transfer_on_upstreams_spec_mock(self):
        # A MagicMock(spec=MooncakeKVManager) has a (Mock) peer_metrics: it is
        # not counted, and reads nothing 0.5.23's conclude_transfer does not.
        mgr = mock.MagicMock(spec=MooncakeKVManager)
        mgr.request_status = {7: KVPoll.Transferring}
        mgr.failure_records = {}
        mgr.failure_lock = threading.Lock()
        mgr.deferred_bootstrap = None
        status = CommonKVManager.conclude_transfer(
            mgr, bootstrap_room=7, status=KVPoll.Failed, failure_reason="x"
        )
        self.assertEqual(status, KVPoll.Failed)
        self.assertEqual(mgr.failure_records, {7: "x"})


if __name__ == "__main__":
    unittest.main()
