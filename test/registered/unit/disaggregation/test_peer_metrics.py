"""Per-peer series for sglang's /metrics: what each prefill holds of a decode
and how it is doing, written into sglang's multiprocess Prometheus directory
and gone with the peer.

Read back as sglang's /metrics reads them (prometheus_client's
MultiProcessCollector over the directory). The decode side runs the real
queues over simulated time (decode_sim.py). CPU-only, no sleeps.
"""

import os
import shutil
import tempfile
import time
import unittest
from contextlib import ExitStack
from types import SimpleNamespace
from unittest import mock

from decode_sim import Prefill, run_ranks
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector
from test_decode_admission_edges import HEALTHY, STUCK, SimTestCase

from sglang.srt import runtime_context
from sglang.srt.disaggregation import decode as decode_mod
from sglang.srt.disaggregation.base import KVPoll
from sglang.srt.disaggregation.common.conn import (
    PD_PEER_METRICS,
    _PeerMetrics,
)
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase

register_cpu_ci(est_time=5, suite="base-a-test-cpu")

LOST = "Lost connection with prefill instance (bootstrap_addr: {})"


def scrape(directory):
    """{(sample name, frozenset(labels)): value}, as /metrics would show."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=directory)
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in registry.collect()
        for s in family.samples
    }


def series(samples, name, **labels):
    """The values of ``name`` whose labels include ``labels``, by peer."""
    out = {}
    for (sample, sample_labels), value in samples.items():
        have = dict(sample_labels)
        if sample == name and labels.items() <= have.items():
            out[have.get("prefill") or have.get("decode")] = value
    return out


LABELS = {"tp_rank": "0"}


def sglang_context(enable_metrics=True, all_schedulers=False, switch=False, **ranks):
    """runtime_context's getters as a scheduler process has them published."""
    parallel = dict(attn_tp_rank=0, attn_cp_rank=0, tp_rank=0, pp_rank=0)
    parallel = {**parallel, "moe_ep_rank": 0, "dp_rank": None, **ranks}
    observability = SimpleNamespace(
        enable_metrics=enable_metrics,
        enable_metrics_for_all_schedulers=all_schedulers,
        extra_metric_labels={"cluster": "a"},
    )
    stack = ExitStack()
    for name, value in (
        ("get_parallel", SimpleNamespace(**parallel)),
        ("get_observability", observability),
        ("get_serving", SimpleNamespace(served_model_name="m")),
        ("get_disagg", SimpleNamespace(enable_pd_role_switch=switch)),
    ):
        stack.enter_context(mock.patch.object(runtime_context, name, lambda v=value: v))
    return stack


class MetricsTestCase(CustomTestCase):
    def metrics(self, rows=None, labels=LABELS):
        directory = tempfile.TemporaryDirectory()
        self.addCleanup(directory.cleanup)
        self.dir = directory.name
        # No write of its own in a test: write() is called where it reads.
        metrics = _PeerMetrics(rows, self.dir, labels, interval=3600)
        self.addCleanup(metrics._thread.join, 30)
        self.addCleanup(metrics.close)
        return metrics


class TestPeerMetricsFiles(MetricsTestCase):
    def test_a_peer_left_out_of_a_write_is_gone_from_metrics(self):
        rows = [
            ("sglang:pd_prefill_state", {"rank": "0", "prefill": "a:1"}, 2),
            ("sglang:pd_prefill_state", {"rank": "0", "prefill": "b:1"}, 0),
            (
                "sglang:pd_prefill_failures",
                {"rank": "0", "prefill": "a:1", "kind": "transfer"},
                3,
            ),
        ]
        metrics = self.metrics(lambda: rows)
        metrics.write()
        samples = scrape(self.dir)
        self.assertEqual(
            series(samples, "sglang:pd_prefill_state"), {"a:1": 2, "b:1": 0}
        )
        self.assertEqual(
            series(samples, "sglang:pd_prefill_failures_total", kind="transfer"),
            {"a:1": 3},
        )
        del rows[0], rows[1]  # a:1 went away
        metrics.write()
        samples = scrape(self.dir)
        self.assertEqual(series(samples, "sglang:pd_prefill_state"), {"b:1": 0})
        self.assertEqual(series(samples, "sglang:pd_prefill_failures_total"), {})
        # Written aside and renamed: /metrics never reads a half-written file.
        self.assertEqual([f for f in os.listdir(self.dir) if ".db" != f[-3:]], [])

    def test_closing_removes_its_series(self):
        metrics = self.metrics(
            lambda: [("sglang:pd_prefill_state", {"prefill": "a:1"}, 1)]
        )
        metrics.write()
        # A scrape that listed the files just before the close reads them after.
        listed = [os.path.join(self.dir, f) for f in os.listdir(self.dir)]
        self.assertTrue(scrape(self.dir))
        metrics.close()
        metrics._thread.join(30)
        self.assertEqual(scrape(self.dir), {})
        self.assertEqual(list(MultiProcessCollector.merge(listed)), [])

    def test_only_with_enable_metrics_and_sglangs_directory(self):
        with mock.patch.dict(os.environ, {"PROMETHEUS_MULTIPROC_DIR": ""}):
            with sglang_context():
                self.assertIsNone(_PeerMetrics.start("decode", None))
        with tempfile.TemporaryDirectory() as directory, mock.patch.dict(
            os.environ, {"PROMETHEUS_MULTIPROC_DIR": directory}
        ):
            with sglang_context(enable_metrics=False):
                self.assertIsNone(_PeerMetrics.start("decode", None))
            # Not a scheduler process: its context is not published.
            self.assertIsNone(_PeerMetrics.start("decode", None))
            with sglang_context():
                metrics = _PeerMetrics.start("decode", None)
            self.assertIsInstance(metrics, _PeerMetrics)
            metrics.close()
            metrics._thread.join(30)

    def test_each_rank_writes_under_sglangs_scheduler_labels(self):
        # DP-attention replicas and PP stages share an engine rank: each needs
        # series of its own. Attention-TP ranks other than 0 write none, as
        # sglang's scheduler metrics, unless it writes for all schedulers.
        ranks = [dict(dp_rank=0), dict(dp_rank=1, tp_rank=1), dict(pp_rank=1)]
        ranks += [dict(attn_tp_rank=1, tp_rank=2)]
        with tempfile.TemporaryDirectory() as directory, mock.patch.dict(
            os.environ, {"PROMETHEUS_MULTIPROC_DIR": directory}
        ):
            started = []
            for rank in ranks:
                with sglang_context(**rank):
                    started.append(_PeerMetrics.start("decode", None))
            self.assertIsNone(started.pop())
            with sglang_context(all_schedulers=True, **ranks[-1]):
                started.append(_PeerMetrics.start("decode", None))
            for metrics in started:
                self.addCleanup(metrics._thread.join, 30)
                self.addCleanup(metrics.close)
                labels = {**metrics.labels, "prefill": "a:1"}
                metrics.rows = [("sglang:pd_prefill_state", labels, 2)]
                metrics.write()
            samples = scrape(directory)
        states = [dict(k[1]) for k in samples if k[0] == "sglang:pd_prefill_state"]
        self.assertEqual(len(states), 4)
        self.assertEqual(
            states[0].keys() - {"dp_rank"},
            {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"}
            | {"cluster", "prefill"},
        )
        self.assertEqual({s["engine_type"] for s in states}, {"decode"})

    def test_series_of_a_process_that_died_without_teardown_go_at_next_start(self):
        # A user-set PROMETHEUS_MULTIPROC_DIR outlives the server: a failed
        # prefill's series of a scheduler that was killed would stay forever.
        # Its pid says nothing: a restarted container's scheduler often has
        # the same (here, this process's own).
        with tempfile.TemporaryDirectory() as directory, mock.patch.dict(
            os.environ, {"PROMETHEUS_MULTIPROC_DIR": directory}
        ):
            for alive in (False, True):
                metrics = _PeerMetrics(None, directory, LABELS, interval=3600)
                self.addCleanup(metrics._thread.join, 30)
                self.addCleanup(metrics.close)
                prefill = {"prefill": f"alive-{alive}:1"}
                metrics.write(rows=[("sglang:pd_prefill_state", prefill, 3)])
                for path in [] if alive else metrics._paths.values():
                    os.utime(path, (time.time() - 61,) * 2)  # not rewritten since
            sglangs = os.path.join(directory, f"counter_{os.getpid()}.db")
            others = os.path.join(directory, "counter_updater.db")
            # Another pid's file, killed mid-write (not a "pd" of the directory).
            name = os.path.basename(metrics._paths["counter"]).replace("pd", "0pd")
            half_written = os.path.join(directory, f"{name}.tmp")
            for path in (sglangs, others, half_written):
                shutil.copy(metrics._paths["counter"], path)
                os.utime(path, (time.time() - 3600,) * 2)
            states = series(scrape(directory), "sglang:pd_prefill_state")
            self.assertEqual(states, {"alive-False:1": 3, "alive-True:1": 3})
            with sglang_context():
                metrics = _PeerMetrics.start("decode", None)
            metrics.close()
            metrics._thread.join(30)
            states = series(scrape(directory), "sglang:pd_prefill_state")
            self.assertEqual(states, {"alive-True:1": 3})
            self.assertTrue(os.path.exists(sglangs))  # prometheus_client's own
            self.assertTrue(os.path.exists(others))  # not ours either
            self.assertFalse(os.path.exists(half_written))  # killed mid-write

    def test_every_name_written_is_registered(self):
        for name, (typ, help_text) in PD_PEER_METRICS.items():
            self.assertTrue(name.startswith("sglang:pd_"), name)
            self.assertIn(typ, ("gauge", "counter"))
            self.assertFalse(name.endswith("_total"), name)
            self.assertTrue(help_text)

    def test_engine_type_is_sglangs_under_role_switch(self):
        with tempfile.TemporaryDirectory() as directory, mock.patch.dict(
            os.environ, {"PROMETHEUS_MULTIPROC_DIR": directory}
        ):
            with sglang_context(switch=True):
                metrics = _PeerMetrics.start("prefill", lambda: [])
            metrics.close()
            metrics._thread.join(30)
        self.assertEqual(metrics.labels["engine_type"], "dynamic")


class TestDecodeSeries(SimTestCase, MetricsTestCase):
    TOKENS, SLOTS, TIMEOUT = 16384, 64, 30.0

    def setUp(self):
        super().setUp()
        self.rank = self.healthy_and_stuck()
        kv = self.rank.kv_manager
        kv.peer_metrics = self.metrics()
        kv._route_setups = {}
        kv.parallel_info_fetch_in_flight = lambda addr: False
        self.rank.prealloc._prefill_dp_rank_queries = {}

    def one_each_second(self, t):
        if abs(t - round(t)) < 1e-9:
            self.add(STUCK)
            self.add(HEALTHY)

    def scrape(self):
        self.rank.kv_manager.peer_metrics.write()
        return scrape(self.dir)

    def share_tokens_held_by(self, addr):
        """Its requests' prompts and reserved decode headroom, as shares count."""
        transfer = self.rank.transfer
        held = [*transfer.queue, *(e[0] for e in transfer._deferred_releases)]
        return sum(
            len(r.req.origin_input_ids) + self.rank.prealloc.num_reserved_decode_tokens
            for r in held
            if r.kv_receiver.bootstrap_addr == addr
        )

    def test_the_stuck_prefill_holds_its_share_and_the_healthy_one_is_served(self):
        self.run_for(60, self.one_each_second)
        samples = self.scrape()
        held = series(samples, "sglang:pd_prefill_held_tokens")
        self.assertEqual(held[STUCK], self.share_tokens_held_by(STUCK))
        self.assertGreater(held[STUCK], self.TOKENS // 2 - 464)  # one request
        self.assertLessEqual(held[STUCK], self.TOKENS // 2)
        self.assertLess(held[HEALTHY], held[STUCK])
        state = series(samples, "sglang:pd_prefill_state")
        self.assertEqual(state, {STUCK: 2, HEALTHY: 0})
        since = series(samples, "sglang:pd_prefill_seconds_since_transfer")
        self.assertEqual(list(since), [HEALTHY])  # the stuck one never served
        self.assertLessEqual(since[HEALTHY], 2.0)
        waiting = series(samples, "sglang:pd_prefill_waiting_reqs")
        self.assertGreater(waiting[STUCK], 0)
        self.assertEqual(waiting[STUCK], len(self.rank.waiting(STUCK)))
        # Past the waiting timeout the held-back requests end, naming it.
        failures = series(samples, "sglang:pd_prefill_failures_total", kind="timeout")
        self.assertGreater(failures.get(STUCK, 0), 0)
        self.assertEqual(failures[HEALTHY], 0)
        # Every kind is written from a prefill's first write, at 0 until one
        # fails: rate() and increase() miss a counter's first sample.
        kinds = {
            dict(labels)["kind"]
            for name, labels in samples
            if name == "sglang:pd_prefill_failures_total"
            and dict(labels)["prefill"] == HEALTHY
        }
        self.assertEqual(kinds, {"bootstrap", "transfer", "heartbeat", "timeout"})

    def test_a_failed_prefill_shows_how_it_ended_then_its_series_go(self):
        self.run_for(20, self.one_each_second)
        kv = self.rank.kv_manager
        del kv.prefill_info_table[STUCK]  # the heartbeat declares it failed
        for r in (*self.rank.prealloc.queue, *self.rank.transfer.queue):
            if r.kv_receiver.bootstrap_addr == STUCK:
                kv.record_failure(r.req.bootstrap_room, LOST.format(STUCK))
                r.kv_receiver.conclude_state = KVPoll.Failed
        self.run_for(2)
        samples = self.scrape()
        self.assertEqual(series(samples, "sglang:pd_prefill_state")[STUCK], 3)
        lost = series(samples, "sglang:pd_prefill_failures_total", kind="heartbeat")
        self.assertGreater(lost[STUCK], 0)
        # Its pages go back at the release timeout (it may have written until
        # it was declared failed), and a minute later its series.
        self.run_for(30)
        self.assertEqual(self.rank.held_by(STUCK), 0)
        self.run_for(61)
        samples = self.scrape()
        self.assertEqual(
            {dict(labels).get("prefill") for (_, labels) in samples}, {HEALTHY}
        )

    def test_held_at_its_share_is_what_admission_decided(self):
        self.run_for(40, self.one_each_second)
        for _ in range(20):  # rows built at every cycle's phase
            self.rank.prealloc._peer_metrics_due = 0.0
            self.run_for(0.1)
            state = series(self.scrape(), "sglang:pd_prefill_state")
            held = [r for r in self.rank.prealloc.queue if r.held_since is not None]
            self.assertTrue(held)
            self.assertEqual(state, {STUCK: 2, HEALTHY: 0})

    def test_client_cancellations_are_not_failures_and_not_fenced(self):
        # A healthy prefill that acknowledges no ABORT (NIXL, Mori): its
        # cancelled rooms wait out the release timeout, as in 0.5.23, and are
        # fenced only past it.
        self.world.prefills[HEALTHY].acks = False
        rooms = [self.add(HEALTHY) for _ in range(3)]
        self.run_for(0.2)
        sent = {r.req.bootstrap_room for r in self.rank.transfer.queue}
        self.assertEqual(sent, set(rooms))
        for room in rooms + [self.add(HEALTHY)]:  # one still waiting for KV
            self.rank.client_abort(room)
        self.run_for(2)
        samples = self.scrape()
        failed = series(samples, "sglang:pd_prefill_failures_total")
        self.assertEqual({peer: n for peer, n in failed.items() if n}, {})
        fenced = series(samples, "sglang:pd_prefill_fenced_tokens")
        self.assertEqual(fenced[HEALTHY], 0)
        self.assertEqual(series(samples, "sglang:pd_prefill_state")[HEALTHY], 0)

    def test_fenced_past_the_release_timeout(self):
        self.run_for(5, self.one_each_second)
        for room in [r.req.bootstrap_room for r in self.rank.transfer.queue]:
            self.rank.client_abort(room)
        self.run_for(2)
        fenced = series(self.scrape(), "sglang:pd_prefill_fenced_tokens")
        self.assertEqual(fenced, {STUCK: 0, HEALTHY: 0})
        self.run_for(30)  # the release timeout: the stuck one may still write
        fenced = series(self.scrape(), "sglang:pd_prefill_fenced_tokens")
        self.assertEqual(fenced[HEALTHY], 0)
        self.assertGreater(fenced[STUCK], 0)

    def test_pop_preallocated_alone_builds_the_rows(self):
        # PP's decode loop calls pop_preallocated, not process_decode_queue.
        self.run_for(5, self.one_each_second)
        self.rank.kv_manager.peer_metrics.rows = []
        self.rank.prealloc._peer_metrics_due = 0.0
        run_ranks(
            self.ranks, self.collectives, lambda rank: rank.prealloc.pop_preallocated()
        )
        held = series(self.scrape(), "sglang:pd_prefill_held_tokens")
        self.assertEqual(held[STUCK], self.share_tokens_held_by(STUCK))

    def test_0523s_own_timeouts_count_as_timeouts(self):
        from sglang.srt.disaggregation.decode import _note_failed

        for reason in (
            "KVTransferError(bootstrap_room=1): Request 1 timed out after 30.0s "
            "in KVPoll.WaitingForInput",
            "KVTransferError(bootstrap_room=2): Request 2 timed out after 30.0s "
            "in KVPoll.Bootstrapping",
        ):
            self.add(STUCK)
            self.run_for(0.1)
            stuck = [*self.rank.prealloc.queue, *self.rank.transfer.queue]
            _note_failed(stuck[-1], "transfer", reason)
        failures = self.rank.kv_manager.peer_metrics.failures
        self.assertEqual({k for k, n in failures.items() if n}, {(STUCK, "timeout")})

    def test_a_prefill_never_reached_is_not_shown_answering(self):
        addr = "10.3.0.1:8998"
        self.world.prefills[addr] = Prefill(addr, 0.5)  # no parallel info yet
        self.add(addr)
        self.run_for(1)
        self.assertEqual(series(self.scrape(), "sglang:pd_prefill_state")[addr], 1)

    def test_rows_are_built_while_retracted_requests_wait(self):
        self.run_for(5, self.one_each_second)
        prealloc, kv = self.rank.prealloc, self.rank.kv_manager
        prealloc.retracted_queue = [object()]  # admission is skipped
        prealloc.resume_retracted_reqs = lambda: []
        kv.peer_metrics.rows = []
        scheduler = SimpleNamespace(
            enable_decode_hicache=False,
            scheduler_stage_metrics=None,
            disagg_decode_transfer_queue=self.rank.transfer,
            disagg_decode_prealloc_queue=prealloc,
            waiting_queue=[],
        )
        self.world.now += 1
        process = decode_mod.SchedulerDisaggregationDecodeMixin.process_decode_queue
        run_ranks(self.ranks, self.collectives, lambda rank: process(scheduler))
        held = series(self.scrape(), "sglang:pd_prefill_held_tokens")
        self.assertEqual(held[STUCK], self.share_tokens_held_by(STUCK))

    def test_prefills_coming_and_going_leave_no_series(self):
        # P15's churn: 1,000 prefill addresses, ten at a time, each serves a
        # request and goes (the heartbeat declares it failed).
        kv = self.rank.kv_manager
        most = 0
        for batch in range(100):
            addrs = [f"10.1.{batch}.{i}:8998" for i in range(10)]
            for addr in addrs:
                prefill = self.world.prefills[addr] = Prefill(addr, 0.5)
                kv.prefill_info_table[addr] = prefill.info
                self.add(addr)
            self.run_for(2)
            since = series(self.scrape(), "sglang:pd_prefill_seconds_since_transfer")
            self.assertLessEqual(set(addrs), set(since))
            most = max(most, len(since))
            for addr in addrs:
                del kv.prefill_info_table[addr]
        self.run_for(61)
        samples = self.scrape()
        left = {dict(labels)["prefill"] for (_, labels) in samples}
        self.assertEqual(left - {HEALTHY, STUCK}, set())
        self.assertLessEqual(most, 10 * 62 // 2)  # a minute's worth, no more


class TestHeldStateOfARecoveredPrefill(SimTestCase, MetricsTestCase):
    def test_a_prefill_that_recovered_is_not_shown_held(self):
        # Its requests held at its share keep held_since while they wait for
        # memory (long decodes fill the pool) once it serves again.
        rank = self.healthy_and_stuck(waiting_timeout=300.0, decode_s=1e4)
        kv = rank.kv_manager
        kv.peer_metrics = self.metrics()
        kv._route_setups = {}
        kv.parallel_info_fetch_in_flight = lambda addr: False
        rank.prealloc._prefill_dp_rank_queries = {}
        self.run_for(20, lambda t: abs(t - round(t)) < 1e-9 and self.add(STUCK))
        self.run_for(20, lambda t: abs(t - round(t)) < 1e-9 and self.add(HEALTHY))
        self.assertTrue([r for r in rank.prealloc.queue if r.held_since])
        self.world.prefills[STUCK].transfer_s = 0.5  # it recovers
        self.run_for(5)
        self.assertEqual(dict(rank.prealloc._prefill_shares().stalled), {})
        self.assertTrue([r for r in rank.prealloc.queue if r.held_since])
        rank.prealloc._peer_metrics_due = 0.0
        self.run_for(0.25)
        kv.peer_metrics.write()
        self.assertEqual(series(scrape(self.dir), "sglang:pd_prefill_state")[STUCK], 0)


if __name__ == "__main__":
    unittest.main()
