"""The dp-rank query (/query_dp_ranks) never waits on the scheduler thread.

Built the way sglang's tests of the query overlap build their queue: a
``DecodePreallocQueue.__new__`` whose kv manager is a SimpleNamespace with only
``prefill_info_table``, ``try_ensure_parallel_info`` and
``_ensure_prefill_recompute_executor``, pending requests of SimpleNamespaces,
and a real HTTP server on 127.0.0.1 answering ``POST /query_dp_ranks``. The
executor has one worker, so "submit a no-op and wait" is a barrier; time
passing is a fake clock moved on by one interval. No sleeps.
"""

import json
import os
import threading
import unittest
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler
from types import SimpleNamespace
from unittest import mock

from sglang.srt.disaggregation import decode as decode_mod
from sglang.srt.disaggregation.common import conn as conn_mod
from sglang.srt.disaggregation.common.conn import CommonKVReceiver
from sglang.srt.disaggregation.decode import DecodePreallocQueue
from sglang.test.ci.ci_register import register_cpu_ci
from sglang.test.test_utils import CustomTestCase
from test_no_network_on_scheduler_thread import (
    FakeClock,
    LocalHTTPServer,
    make_queue,
    make_req,
)

register_cpu_ci(est_time=10, suite="base-a-test-cpu")

_WAIT_S = 30


class DpRankServer:
    """POST /query_dp_ranks on 127.0.0.1: records each request's rooms and
    answers ``room % 8`` for every room not in ``unknown``, or ``status``."""

    def __init__(self):
        server = self
        self.bodies = []
        self.unknown = set()
        self.status = 200
        self.hold = threading.Event()
        self.hold.set()
        self.held = threading.Event()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                length = int(self.headers["Content-Length"])
                rooms = json.loads(self.rfile.read(length))["bootstrap_rooms"]
                server.bodies.append(rooms)
                if not server.hold.is_set():
                    server.held.set()
                    server.hold.wait(_WAIT_S)
                if server.status != 200:
                    payload, status = {"error": "unavailable"}, server.status
                else:
                    payload = {str(r): r % 8 for r in rooms if r not in server.unknown}
                    status = 200
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = LocalHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.addr = f"127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.hold.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(_WAIT_S)


class Receiver:
    """A kv_receiver with init(rank) only, recording the init order."""

    def __init__(self, room, inits):
        self.room = room
        self.inits = inits

    def init(self, rank):
        self.inits.append((self.room, rank))


class _Base(CustomTestCase):
    def setUp(self):
        super().setUp()
        disagg = SimpleNamespace(disaggregation_decode_allocation_policy="early")
        # Time passes only when a test says so (pass_interval), however long
        # a query takes on a loaded host.
        self.clock = FakeClock()
        for patcher in (
            mock.patch.object(decode_mod, "get_disagg", return_value=disagg),
            mock.patch.object(decode_mod, "time", self.clock),
        ):
            patcher.start()
            self.addCleanup(patcher.stop)
        self.server = DpRankServer()
        self.addCleanup(self.server.stop)
        self.executor = ThreadPoolExecutor(max_workers=1)
        self.addCleanup(self.executor.shutdown, wait=False, cancel_futures=True)
        self.inits = []
        self.queue = self.make_queue()

    def make_queue(self) -> DecodePreallocQueue:
        queue = make_queue(None)
        queue.kv_manager = SimpleNamespace(
            prefill_info_table={
                self.server.addr: SimpleNamespace(
                    dp_size=8, follow_bootstrap_room=False
                )
            },
            try_ensure_parallel_info=lambda addr: True,
            _ensure_prefill_recompute_executor=lambda: self.executor,
        )
        return queue

    def pend(self, *rooms, port=None):
        for room in rooms:
            req = SimpleNamespace(
                bootstrap_host="127.0.0.1",
                bootstrap_port=port or self.server.port,
                bootstrap_room=room,
                disagg_prefill_dp_rank=None,
            )
            self.queue.pending_reqs.append(
                SimpleNamespace(req=req, kv_receiver=Receiver(room, self.inits))
            )

    def drain(self):
        self.executor.submit(lambda: None).result(timeout=_WAIT_S)

    def pass_interval(self):
        self.clock.now += self.queue._ensure_retry_interval

    def pending_rooms(self):
        return [r.req.bootstrap_room for r in self.queue.pending_reqs]


class TestDpRankQueryOverlap(_Base):
    def test_a_prefetched_answer_is_used_in_the_same_cycle_in_fifo_order(self):
        self.pend(13, 11, 12)

        self.queue.prefetch_prefill_dp_rank_queries()
        self.drain()  # the answer lands before the consume point
        self.queue._resolve_pending_reqs()

        self.assertEqual(self.server.bodies, [[13, 11, 12]])
        self.assertEqual(self.inits, [(13, 5), (11, 3), (12, 4)])
        self.assertEqual(self.queue.pending_reqs, [])
        self.assertEqual(self.queue._prefill_dp_rank_queries, {})
        self.assertEqual(self.queue._ensure_retry_count, {})

    def test_the_consume_point_does_not_wait_for_an_outstanding_query(self):
        self.server.hold.clear()
        self.pend(1, 2)

        self.queue.prefetch_prefill_dp_rank_queries()
        self.assertTrue(self.server.held.wait(_WAIT_S))
        self.queue._resolve_pending_reqs()

        # Came back with the query still held by the server: nothing initialised.
        _, future = self.queue._prefill_dp_rank_queries[self.server.addr]
        self.assertFalse(future.done())
        self.assertEqual(self.inits, [])
        self.assertEqual(self.pending_rooms(), [1, 2])
        self.queue._resolve_pending_reqs()
        self.assertEqual(len(self.server.bodies), 1)  # no second query meanwhile

        self.server.hold.set()
        self.drain()
        self.queue._resolve_pending_reqs()
        self.assertEqual(self.inits, [(1, 1), (2, 2)])
        self.assertEqual(self.queue.pending_reqs, [])

    def test_without_a_prefetch_the_query_starts_at_the_consume_point(self):
        self.pend(5)

        self.queue._resolve_pending_reqs()
        self.assertEqual(self.inits, [])
        self.drain()
        self.queue._resolve_pending_reqs()

        self.assertEqual(self.server.bodies, [[5]])
        self.assertEqual(self.inits, [(5, 5)])

    def test_a_room_missing_from_the_answer_is_asked_again_alone_once_due(self):
        self.server.unknown = {22}
        self.pend(21, 22)
        self.queue.prefetch_prefill_dp_rank_queries()
        self.drain()
        self.queue._resolve_pending_reqs()
        self.assertEqual(self.inits, [(21, 5)])
        self.assertEqual(self.pending_rooms(), [22])

        # Not registered on the prefill yet: no back-to-back POSTs for it.
        for _ in range(5):
            self.queue.prefetch_prefill_dp_rank_queries()
            self.drain()
            self.queue._resolve_pending_reqs()
        self.assertEqual(self.server.bodies, [[21, 22]])

        self.server.unknown = set()
        self.pass_interval()
        self.queue.prefetch_prefill_dp_rank_queries()
        self.drain()
        self.queue._resolve_pending_reqs()
        self.assertEqual(self.server.bodies, [[21, 22], [22]])
        self.assertEqual(self.inits, [(21, 5), (22, 6)])

    def test_a_room_added_after_the_prefetch_is_asked_without_waiting(self):
        self.pend(31)
        self.queue.prefetch_prefill_dp_rank_queries()
        self.pend(32)
        self.drain()

        self.queue._resolve_pending_reqs()
        self.drain()
        self.queue._resolve_pending_reqs()

        self.assertEqual(self.server.bodies, [[31], [32]])
        self.assertEqual(self.inits, [(31, 7), (32, 0)])

    def test_http_503_keeps_the_request_pending_for_the_retry_path(self):
        self.server.status = 503
        self.pend(41)
        self.queue.prefetch_prefill_dp_rank_queries()
        self.drain()
        self.queue._resolve_pending_reqs()

        self.assertEqual(self.inits, [])
        self.assertEqual(self.pending_rooms(), [41])
        self.server.status = 200
        self.pass_interval()
        self.queue._resolve_pending_reqs()
        self.drain()
        self.queue._resolve_pending_reqs()
        self.assertEqual(self.inits, [(41, 1)])

    def test_release_cancels_the_queries_and_initialises_nothing(self):
        self.server.hold.clear()
        self.pend(51, 52)
        self.queue.prefetch_prefill_dp_rank_queries()
        self.assertTrue(self.server.held.wait(_WAIT_S))

        self.queue.release_memory_occupation()

        self.assertEqual(self.queue._prefill_dp_rank_queries, {})
        self.server.hold.set()
        self.drain()
        self.assertEqual(self.inits, [])


class TestDpRankRetryBudget(_Base):
    def setUp(self):
        super().setUp()
        self.queue.kv_manager.record_failure = mock.MagicMock()

    def budget(self, seconds: int) -> None:
        """A room's budget: the waiting timeout from its first query. One
        retry interval is two queries."""
        timeout = {"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(seconds)}
        patcher = mock.patch.dict(os.environ, timeout)
        patcher.start()
        self.addCleanup(patcher.stop)

    def pend_abortable(self, room):
        self.pend(room)
        decode_req = self.queue.pending_reqs[-1]
        decode_req.kv_receiver = mock.MagicMock(bootstrap_room=room)
        return decode_req

    def attempt(self):
        self.pass_interval()
        self.queue.prefetch_prefill_dp_rank_queries()
        self.drain()
        self.queue._resolve_pending_reqs()

    def test_a_room_never_registered_fails_at_the_waiting_timeout_with_the_cause(self):
        self.budget(1)
        self.server.unknown = {61}
        decode_req = self.pend_abortable(61)

        for _ in range(3):
            self.attempt()

        self.assertEqual(self.server.bodies, [[61], [61]])
        decode_req.kv_receiver.abort.assert_called_once()
        room, reason = self.queue.kv_manager.record_failure.call_args.args
        self.assertEqual(room, 61)
        self.assertIn(
            f"Prefill {self.server.addr} has not registered bootstrap_room 61 in "
            f"the 1 s since the decode first asked for its dp rank "
            f"(SGLANG_DISAGGREGATION_WAITING_TIMEOUT)",
            reason,
        )
        self.assertEqual(self.queue.pending_reqs, [])
        self.assertEqual(self.queue._ensure_retry_count, {})

    def test_a_room_registered_late_is_asked_for_until_the_waiting_timeout(self):
        # A dp-attention prefill registers a room only once its dp scheduler
        # takes the request: under load, long after the decode got it.
        self.budget(30)
        self.server.unknown = {63}
        decode_req = self.pend_abortable(63)
        for _ in range(30):
            self.attempt()
        decode_req.kv_receiver.abort.assert_not_called()
        self.server.unknown = set()
        self.attempt()

        decode_req.kv_receiver.init.assert_called_once_with(63 % 8)
        self.assertEqual(len(self.server.bodies), 31)

    def test_an_answer_to_the_last_attempt_still_resolves_the_room(self):
        self.budget(1)
        self.server.unknown = {65}
        decode_req = self.pend_abortable(65)
        self.attempt()  # attempt 1: not known yet
        self.server.unknown = set()
        self.server.hold.clear()
        self.pass_interval()
        self.queue.prefetch_prefill_dp_rank_queries()  # attempt 2, held
        self.assertTrue(self.server.held.wait(_WAIT_S))

        # The budget is spent, but its last attempt has not ended.
        self.queue._resolve_pending_reqs()
        decode_req.kv_receiver.abort.assert_not_called()
        self.server.hold.set()
        self.drain()
        self.queue._resolve_pending_reqs()

        decode_req.kv_receiver.init.assert_called_once_with(65 % 8)
        decode_req.kv_receiver.abort.assert_not_called()

    def test_each_room_has_its_own_budget(self):
        self.budget(1)
        self.server.unknown = {71}
        stuck = self.pend_abortable(71)
        self.attempt()
        # A room added later is not charged with the earlier room's attempts.
        late = self.pend_abortable(72)
        self.server.unknown = {71, 72}
        self.attempt()  # 71's second and last, 72's first

        stuck.kv_receiver.abort.assert_called_once()
        late.kv_receiver.abort.assert_not_called()
        self.assertEqual(self.pending_rooms(), [72])

    def test_the_budget_ends_with_the_last_request_that_needed_it(self):
        self.budget(1)
        self.server.unknown = {81}
        self.pend_abortable(81)
        self.attempt()
        first_asked = self.queue._ensure_retry_count[(self.server.addr, 81)]
        self.assertEqual(first_asked, self.clock.now)

        # The request leaves the pending list some other way (an abort) while
        # another one stays.
        self.queue.pending_reqs.clear()
        self.pend_abortable(82)
        self.queue._resolve_pending_reqs()
        self.assertNotIn((self.server.addr, 81), self.queue._ensure_retry_count)
        self.queue.pending_reqs.clear()
        self.queue._resolve_pending_reqs()

        # A later request with the same room starts with a fresh budget.
        again = self.pend_abortable(81)
        self.attempt()
        again.kv_receiver.abort.assert_not_called()
        first_asked = self.queue._ensure_retry_count[(self.server.addr, 81)]
        self.assertEqual(first_asked, self.clock.now)
        self.attempt()
        again.kv_receiver.abort.assert_called_once()

    def test_an_unexpected_error_is_a_failed_attempt_not_a_crash(self):
        self.budget(1)
        decode_req = self.pend_abortable(91)
        with mock.patch.object(
            CommonKVReceiver,
            "query_prefill_dp_ranks",
            mock.Mock(side_effect=KeyError("boom")),
        ):
            with self.assertLogs(decode_mod.logger, "ERROR") as logs:
                self.attempt()
            self.assertIn("Traceback", "\n".join(logs.output))
            self.assertEqual(self.pending_rooms(), [91])
            decode_req.kv_receiver.abort.assert_not_called()

            self.attempt()  # the second and last attempt
        decode_req.kv_receiver.abort.assert_called_once()

    def test_a_malformed_answer_is_a_failed_attempt(self):
        for body in ('["1"]', '{"1": "x"}', "not json"):
            with self.subTest(body=body):
                session = SimpleNamespace(
                    post=lambda *args, **kwargs: FakeResponse(body)
                )
                with mock.patch.object(
                    conn_mod, "_get_bootstrap_session", return_value=session
                ):
                    self.assertEqual(
                        CommonKVReceiver.query_prefill_dp_ranks(self.server.addr, [1]),
                        {},
                    )

    def test_a_query_that_hangs_is_given_up_and_asked_again(self):
        decode_req = self.pend_abortable(93)
        self.server.hold.clear()
        self.queue.prefetch_prefill_dp_rank_queries()
        self.assertTrue(self.server.held.wait(_WAIT_S))
        self.clock.now += conn_mod.BOOTSTRAP_QUERY_TIMEOUT_S - 1
        self.queue._resolve_pending_reqs()
        self.assertIn(self.server.addr, self.queue._prefill_dp_rank_queries)

        self.clock.now += 1
        with self.assertLogs(decode_mod.logger, "WARNING") as logs:
            self.queue._resolve_pending_reqs()
        self.assertIn("has not ended", logs.output[0])
        # Asked again at once, on the prefill's other thread.
        self.assertEqual(self.server.bodies, [[93]])
        self.server.hold.set()
        self.drain()
        self.queue._resolve_pending_reqs()
        decode_req.kv_receiver.init.assert_called_once_with(93 % 8)

    def test_a_hung_query_is_given_up_after_its_first_rooms_request_ended(self):
        # The query's age is kept with each of its rooms: the request of the
        # first may end (an abort) while it hangs, the others must not wait.
        self.server.hold.clear()
        self.pend_abortable(94)
        decode_req = self.pend_abortable(95)
        self.queue.prefetch_prefill_dp_rank_queries()
        self.assertTrue(self.server.held.wait(_WAIT_S))
        del self.queue.pending_reqs[0]  # 94's client went away
        self.queue._resolve_pending_reqs()

        self.clock.now += conn_mod.BOOTSTRAP_QUERY_TIMEOUT_S
        with self.assertLogs(decode_mod.logger, "WARNING") as logs:
            self.queue._resolve_pending_reqs()
        self.assertIn("has not ended", logs.output[0])
        self.server.hold.set()
        self.drain()
        self.queue._resolve_pending_reqs()
        self.assertEqual(self.server.bodies, [[94, 95], [95]])
        decode_req.kv_receiver.init.assert_called_once_with(95 % 8)

    def test_a_query_no_request_waits_for_does_not_hold_a_later_room(self):
        self.server.hold.clear()
        self.pend_abortable(96)
        self.pend_abortable(98)
        self.queue.prefetch_prefill_dp_rank_queries()
        self.assertTrue(self.server.held.wait(_WAIT_S))
        # The clients of 96 and 98 go away and 97 comes: once their
        # bookkeeping is dropped, the query is, without a timeout warning.
        self.queue.pending_reqs.clear()
        late = self.pend_abortable(97)
        self.queue._resolve_pending_reqs()
        with self.assertNoLogs(decode_mod.logger, "WARNING"):
            self.queue._resolve_pending_reqs()
        self.server.hold.set()
        self.drain()
        self.queue._resolve_pending_reqs()
        self.assertEqual(self.server.bodies, [[96, 98], [97]])
        late.kv_receiver.init.assert_called_once_with(97 % 8)


class TestPendingOfFrozenPrefills(CustomTestCase):
    def test_each_cycle_parses_each_prefill_address_not_each_request(self):
        # P10: requests wait in pending_reqs while their prefill's parallel
        # info is fetched, and every cycle groups them by address twice.
        # NetworkAddress parses the host (about 2 us): per request, 5,000
        # pending took 25 ms a cycle.
        kv_manager = mock.MagicMock()
        kv_manager.prefill_info_table = {}
        kv_manager.has_parallel_info.return_value = False
        kv_manager.parallel_info_fetch_in_flight.return_value = True
        queue = make_queue(kv_manager)
        ports = [19000 + i for i in range(4)]
        queue.pending_reqs = [
            SimpleNamespace(req=make_req(ports[i % 4], i), kv_receiver=None)
            for i in range(400)
        ]
        decode_mod._host_port_str.cache_clear()
        parse = mock.Mock(wraps=decode_mod.NetworkAddress)
        with mock.patch.object(decode_mod, "NetworkAddress", parse):
            for _ in range(3):
                queue.prefetch_prefill_dp_rank_queries()
                queue._resolve_pending_reqs()

        self.assertEqual(parse.call_count, 4)
        # Cached by value and type: a float port is not taken for an int one.
        for port in (19000.0, 19000):
            req = make_req(port, 0)
            self.assertEqual(decode_mod._bootstrap_addr(req), f"127.0.0.1:{port}")
        self.assertEqual(len(queue.pending_reqs), 400)
        self.assertEqual(
            sorted(
                c.args[0] for c in kv_manager.parallel_info_fetch_in_flight.mock_calls
            ),
            sorted(f"127.0.0.1:{p}" for p in ports * 3),
        )


class FakeResponse:
    def __init__(self, text):
        self.status_code = 200
        self.text = text

    def json(self):
        return json.loads(self.text)


class TestDropIdleEnsureState(_Base):
    def test_keys_without_a_pending_request_are_dropped(self):
        self.pend(1)
        addr = self.server.addr
        for key in (addr, (addr, 1), "10.0.0.1:1", ("10.0.0.1:1", 7), (addr, 2)):
            self.queue._ensure_retry_count[key] = 1
            self.queue._ensure_last_attempt_time[key] = 0.0

        self.queue._drop_idle_ensure_state()

        self.assertEqual(set(self.queue._ensure_retry_count), {addr, (addr, 1)})
        self.assertEqual(set(self.queue._ensure_last_attempt_time), {addr, (addr, 1)})


if __name__ == "__main__":
    unittest.main()
