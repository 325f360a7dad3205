"""The decode-side control listener shared by Mooncake, NIXL and Mori.

CPU-only and sleep-free: real ZMQ PUSH/PULL sockets on 127.0.0.1 feed frames
to a listener thread, a recording ``apply_prefill_status`` hands each applied
status to the test through a queue, and frames from one PUSH socket arrive in
order, so a valid frame sent after a bad one proves the bad one was consumed.
``mori`` (AMD only) is stubbed at import; no NIXL agent or Mooncake engine is
built.
"""

import importlib.util
import queue
import struct
import subprocess
import sys
import threading
import types
import unittest
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def _stub_mori() -> None:
    """Just the names mori/conn.py imports, unless the real package exists."""
    if importlib.util.find_spec("mori") is not None:
        return
    mori = types.ModuleType("mori")
    mori.cpp = types.ModuleType("mori.cpp")
    mori.io = types.ModuleType("mori.io")
    mori.cpp.TransferStatus = type("TransferStatus", (), {})
    for name in (
        "BackendType",
        "EngineDesc",
        "IOEngine",
        "IOEngineConfig",
        "MemoryDesc",
        "MemoryLocationType",
        "PollCqMode",
        "RdmaBackendConfig",
        "StatusCode",
    ):
        setattr(mori.io, name, type(name, (), {}))
    sys.modules.update({"mori": mori, "mori.cpp": mori.cpp, "mori.io": mori.io})


_stub_mori()

from sglang.srt.disaggregation.base.conn import KVPoll  # noqa: E402
from sglang.srt.disaggregation.common import conn as conn_mod  # noqa: E402
from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager  # noqa: E402
from sglang.srt.disaggregation.mori.conn import MoriKVManager  # noqa: E402
from sglang.srt.disaggregation.nixl.conn import NixlKVManager  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402
from sglang.test.test_utils import CustomTestCase  # noqa: E402

register_cpu_ci(est_time=40, suite="base-a-test-cpu")

# Safety net only: a broken implementation fails instead of hanging the suite.
# No test asserts on how long anything takes.
_WAIT_S = 10
HYPOTHESIS_EXAMPLES = 200

ROOM = 7
PREFILL_RANK = 3
REASON = "prefill OOM \u2717"  # non-ASCII: the reason frame is UTF-8

# The 0.5.23 wire, written out by hand (and cross-checked against the 0.5.23
# encoder in TestGoldenFrames.test_matches_the_0_5_23_code):
#   Mooncake: [room, status, prefill_rank], no tag and no reason;
#   NIXL:     [b"KV_STATUS", room, status, prefill_rank, reason];
#   Mori:     [b"MoriMsgGuard", room, status, prefill_rank, reason].
# KVPoll: Failed = 0, Success = 4.
GOLDEN = {
    "mooncake": {
        KVPoll.Success: [b"7", b"4", b"3"],
        KVPoll.Failed: [b"7", b"0", b"3"],
    },
    "nixl": {
        KVPoll.Success: [b"KV_STATUS", b"7", b"4", b"3", b""],
        KVPoll.Failed: [b"KV_STATUS", b"7", b"0", b"3", REASON.encode("utf-8")],
    },
    "mori": {
        KVPoll.Success: [b"MoriMsgGuard", b"7", b"4", b"3", b""],
        KVPoll.Failed: [b"MoriMsgGuard", b"7", b"0", b"3", REASON.encode("utf-8")],
    },
}
CLASSES = {
    "mooncake": MooncakeKVManager,
    "nixl": NixlKVManager,
    "mori": MoriKVManager,
}
# A frame each backend's own handler raises on (in 0.5.23 the Mooncake and
# NIXL loops died on it). The last frame is payload that must not be logged.
RAISING_FRAME = {
    "mooncake": [b"AUX_DATA", b"1", b"0", b"0", struct.pack(">I", 9), b"PAYLOAD!!"],
    "mori": [b"AUX_DATA", b"1", b"0", b"0", struct.pack(">I", 9), b"PAYLOAD!!"],
    "nixl": [b"STAGING_REQ", b"not-a-room", b"0", b"1", b"PAYLOAD!!"],
}
CONN_LOGGER = conn_mod.logger.name


def make_manager(backend: str, mode=DisaggregationMode.DECODE):
    """A manager with just the state the status paths and teardown read."""
    mgr = CLASSES[backend].__new__(CLASSES[backend])
    mgr.disaggregation_mode = mode
    mgr.server_args = SimpleNamespace(enable_pd_role_switch=True)
    mgr.deferred_bootstrap = None
    mgr.defer_decode_allocation = False
    # Registers the STAGING_REQ handler (Mooncake, NIXL); no staging handler
    # is set, so none of it runs past parsing.
    mgr.enable_staging = backend != "mori"
    mgr._staging_handler = None
    # ABORT_ACK frames are parsed, not ignored.
    mgr.enable_deferred_decode_kv_release = True
    mgr._deferred_abort_ack_tracker = {}
    mgr.request_status = {}
    mgr.failure_records = {}
    mgr.failure_lock = threading.Lock()
    mgr.required_prefill_response_num_table = {}
    mgr.prefill_response_tracker = {}
    mgr._deferred_ack_targets = {}
    mgr._deferred_ack_poisoned_rooms = set()
    mgr._staging_outstanding = {}
    # Empty buffer tables: a well-formed AUX_DATA raises instead of writing.
    mgr.kv_args = SimpleNamespace(
        kv_data_ptrs=[],
        kv_data_lens=[],
        aux_data_ptrs=[],
        aux_data_lens=[],
        aux_item_lens=[],
        state_data_ptrs=[],
        state_data_lens=[],
    )
    # Sender side, for the encoder.
    mgr.attn_tp_rank = PREFILL_RANK
    mgr.attn_cp_rank = 0
    mgr.attn_cp_size = 1
    mgr.pp_rank = 0
    mgr.pp_size = 1
    # Teardown.
    mgr._stopped = False
    mgr._worker_threads = []
    mgr._heartbeat_shutdown = threading.Event()
    mgr.heartbeat_interval = 3600.0
    mgr.connection_lock = threading.Lock()
    mgr.connection_pool = {}
    mgr.prefill_info_table = {}
    mgr._socket_lock = threading.Lock()
    mgr._socket_cache = {}
    mgr._monitor_cache = {}
    mgr.engine = mock.MagicMock()
    mgr.kv_mem_descs = []
    mgr.aux_mem_descs = []
    mgr.state_mem_descs = []
    return mgr


def open_room(mgr, room: int) -> None:
    """A decode room waiting on one prefill rank."""
    mgr.request_status[room] = KVPoll.Transferring
    mgr.prefill_response_tracker[room] = set()
    mgr.required_prefill_response_num_table[room] = 1
    mgr.failure_records.pop(room, None)


def record_applied(mgr) -> "queue.Queue[dict]":
    applied = queue.Queue()
    real = mgr.apply_prefill_status

    def apply_prefill_status(**kwargs):
        real(**kwargs)
        applied.put(kwargs)

    mgr.apply_prefill_status = apply_prefill_status
    return applied


def success_frames(backend: str, room: int):
    """The golden Success frames, for another room."""
    frames = list(GOLDEN[backend][KVPoll.Success])
    frames[0 if CLASSES[backend].kv_status_msg_tag is None else 1] = b"%d" % room
    return frames


def start_listener(backend: str, mgr) -> threading.Thread:
    """Start the decode threads as the backend does; return the listener."""
    started = []
    start = mgr._start_decode_listener_thread

    def start_and_keep():
        started.append(start())
        return started[-1]

    mgr._start_decode_listener_thread = start_and_keep
    if backend == "mooncake":
        mgr.start_decode_thread()
    elif backend == "mori":  # as MoriKVManager.__init__ does
        mgr._worker_threads.append(mgr._start_decode_listener_thread())
    else:  # as NixlKVManager.__init__ does
        mgr._decode_threads = [
            mgr._start_decode_listener_thread(),
            mgr._start_heartbeat_checker_thread(),
        ]
    (listener,) = started
    return listener


class _ListenerCase(CustomTestCase):
    def start(self, backend: str):
        """Decode manager with a running listener on a real PULL socket, and a
        PUSH socket (own context: teardown destroys the manager's) to feed it."""
        mgr = make_manager(backend)
        mgr._zmq_ctx = zmq.Context()
        mgr.server_socket = mgr._zmq_ctx.socket(zmq.PULL)
        port = mgr.server_socket.bind_to_random_port("tcp://127.0.0.1")
        applied = record_applied(mgr)
        listener = start_listener(backend, mgr)
        self.addCleanup(self._stop, mgr, listener)

        push_ctx = zmq.Context()
        push = push_ctx.socket(zmq.PUSH)
        push.connect(f"tcp://127.0.0.1:{port}")
        self.addCleanup(push_ctx.destroy, linger=0)
        return mgr, applied, listener, push

    @staticmethod
    def _stop(mgr, listener):
        mgr._stopped = True
        mgr._heartbeat_shutdown.set()
        listener.join(_WAIT_S)
        mgr._zmq_ctx.destroy(linger=0)

    def next_applied(self, applied) -> dict:
        try:
            return applied.get(timeout=_WAIT_S)
        except queue.Empty:
            self.fail("the listener applied no status")


class TestGoldenFrames(CustomTestCase):
    def encode(self, mgr, status: KVPoll, reason=None):
        return mgr._encode_kv_status_message(
            bootstrap_room=ROOM, status=status, failure_reason=reason
        )

    def test_encoder_emits_the_0_5_23_frames(self):
        for backend in CLASSES:
            mgr = make_manager(backend, DisaggregationMode.PREFILL)
            with self.subTest(backend=backend):
                self.assertEqual(
                    self.encode(mgr, KVPoll.Success), GOLDEN[backend][KVPoll.Success]
                )
                self.assertEqual(
                    self.encode(mgr, KVPoll.Failed, REASON),
                    GOLDEN[backend][KVPoll.Failed],
                )

    def test_each_backend_parses_only_its_own_frames(self):
        for receiver in CLASSES:
            mgr = make_manager(receiver)
            for sender in CLASSES:
                for status, frames in GOLDEN[sender].items():
                    with self.subTest(receiver=receiver, sender=sender, status=status):
                        parsed = mgr.parse_kv_status_message(list(frames))
                        if sender != receiver:
                            self.assertIsNone(parsed)
                            continue
                        reason = (
                            REASON
                            if status == KVPoll.Failed and receiver != "mooncake"
                            else None
                        )
                        self.assertEqual(
                            parsed, (ROOM, int(status), PREFILL_RANK, reason)
                        )

    def test_foreign_frames_change_no_room_and_are_counted(self):
        for receiver in CLASSES:
            mgr = make_manager(receiver)
            handlers = mgr.decode_message_handlers()
            open_room(mgr, ROOM)
            foreign = [
                frames
                for sender in CLASSES
                if sender != receiver
                for frames in GOLDEN[sender].values()
            ]
            with self.subTest(receiver=receiver):
                for frames in foreign:
                    mgr.handle_decode_message(list(frames), handlers)
                self.assertEqual(mgr.request_status[ROOM], KVPoll.Transferring)
                self.assertEqual(mgr.failure_records, {})
                self.assertEqual(mgr._bad_decode_msgs, len(foreign))

    def test_matches_the_0_5_23_code(self):
        """The hand-written frames above are what 0.5.23 itself encodes, and
        0.5.23 parses every backend's frames as the patched code does."""
        pristine = load_pristine_common_conn()
        if pristine is None:
            self.skipTest("the 0.5.23 base commit is not in this checkout")
        base = pristine.CommonKVManager
        for receiver in CLASSES:
            mgr = make_manager(receiver, DisaggregationMode.PREFILL)
            with self.subTest(receiver=receiver):
                for status, reason in ((KVPoll.Success, None), (KVPoll.Failed, REASON)):
                    self.assertEqual(
                        base._encode_kv_status_message(
                            mgr,
                            bootstrap_room=ROOM,
                            status=status,
                            failure_reason=reason,
                        ),
                        GOLDEN[receiver][status],
                    )
                for sender in CLASSES:
                    for frames in GOLDEN[sender].values():
                        self.assertEqual(
                            mgr.parse_kv_status_message(list(frames)),
                            base.parse_kv_status_message(mgr, list(frames)),
                        )


def load_pristine_common_conn():
    """common/conn.py of the repo's root commit (the 0.5.23 wheel's bytes), as
    a throwaway module; None when git or the commit is not available."""
    repo = Path(__file__).resolve().parents[4]
    rel = "python/sglang/srt/disaggregation/common/conn.py"
    try:
        root = subprocess.check_output(
            ["git", "rev-list", "--max-parents=0", "HEAD"],
            cwd=repo,
            text=True,
            stderr=subprocess.DEVNULL,
        ).split()[-1]
        source = subprocess.check_output(
            ["git", "show", f"{root}:{rel}"], cwd=repo, text=True
        )
    except (OSError, subprocess.CalledProcessError, IndexError):
        return None
    module = types.ModuleType("pristine_0_5_23_common_conn")
    # dataclasses looks its class's module up while the source runs.
    with mock.patch.dict(sys.modules, {module.__name__: module}):
        exec(compile(source, f"0.5.23:{rel}", "exec"), module.__dict__)
    return module


class TestListener(_ListenerCase):
    def test_success_and_failed_frames_reach_apply_prefill_status(self):
        for backend in CLASSES:
            with self.subTest(backend=backend):
                mgr, applied, _, push = self.start(backend)
                open_room(mgr, ROOM)
                push.send_multipart(GOLDEN[backend][KVPoll.Success])
                self.assertEqual(
                    self.next_applied(applied),
                    dict(
                        bootstrap_room=ROOM,
                        status=KVPoll.Success,
                        prefill_rank=PREFILL_RANK,
                        failure_reason=None,
                    ),
                )
                self.assertEqual(mgr.request_status[ROOM], KVPoll.Success)

                open_room(mgr, ROOM)
                push.send_multipart(GOLDEN[backend][KVPoll.Failed])
                self.assertEqual(self.next_applied(applied)["status"], KVPoll.Failed)
                self.assertEqual(mgr.request_status[ROOM], KVPoll.Failed)
                expected = (
                    mgr.DEFAULT_PREFILL_FAILURE_REASON
                    if backend == "mooncake"
                    else REASON
                )
                self.assertEqual(mgr.failure_records[ROOM], expected)

    def test_a_raising_handler_does_not_end_the_listener(self):
        for backend in CLASSES:
            with self.subTest(backend=backend):
                mgr, applied, listener, push = self.start(backend)
                open_room(mgr, ROOM)
                with self.assertLogs(CONN_LOGGER, "WARNING") as logs:
                    push.send_multipart(RAISING_FRAME[backend])
                    push.send_multipart(GOLDEN[backend][KVPoll.Failed])
                    self.assertEqual(
                        self.next_applied(applied)["status"], KVPoll.Failed
                    )
                self.assertTrue(listener.is_alive())
                self.assertEqual(mgr.request_status[ROOM], KVPoll.Failed)
                self.assertEqual(mgr._bad_decode_msgs, 1)
                (record,) = logs.records
                message = record.getMessage()
                tag = RAISING_FRAME[backend][0]
                self.assertIn(f"tag {tag!r}", message)
                self.assertIn(f"{len(RAISING_FRAME[backend])} frames", message)
                self.assertIn("Failed to handle", message)
                self.assertNotIn("PAYLOAD", message)
                self.assertTrue(record.exc_info)

    def test_teardown_ends_the_listener(self):
        for backend in CLASSES:
            with self.subTest(backend=backend):
                mgr, applied, listener, push = self.start(backend)
                open_room(mgr, ROOM)
                push.send_multipart(GOLDEN[backend][KVPoll.Success])
                self.next_applied(applied)  # the loop is up and serving

                # ZMQ sockets are not thread-safe: teardown must have stopped
                # the listener before it closes the listener's socket. recv
                # holds the real socket, so this stand-in only sees teardown.
                real_socket = mgr.server_socket
                alive_at_close = []

                def close(linger=None):
                    alive_at_close.append(listener.is_alive())
                    real_socket.close(linger=linger)

                mgr.server_socket = SimpleNamespace(close=close)
                mgr.teardown()

                listener.join(_WAIT_S)
                self.assertFalse(listener.is_alive())
                self.assertNotIn(True, alive_at_close)


class TestBadMessageLogging(CustomTestCase):
    def test_unrecognized_messages_are_counted_and_logged_at_a_bounded_rate(self):
        clock = SimpleNamespace(now=1000.0)
        fake_time = SimpleNamespace(monotonic=lambda: clock.now)
        for backend in CLASSES:
            mgr = make_manager(backend)
            handlers = mgr.decode_message_handlers()
            unknown = [b"NOT_A_TAG", b"PAYLOAD!!"]
            with (
                self.subTest(backend=backend),
                mock.patch.object(conn_mod, "time", fake_time),
            ):
                with self.assertLogs(CONN_LOGGER, "WARNING") as logs:
                    for _ in range(5):
                        mgr.handle_decode_message(list(unknown), handlers)
                    clock.now += mgr.BAD_DECODE_MSG_LOG_INTERVAL_S
                    mgr.handle_decode_message(list(unknown), handlers)
                self.assertEqual(mgr._bad_decode_msgs, 6)
                # The listener's own report; parse_kv_status_message also logs
                # each malformed untagged (Mooncake) message, as 0.5.23 did.
                first, second = (
                    r.getMessage()
                    for r in logs.records
                    if "decode control message" in r.getMessage()
                )
                self.assertIn("tag b'NOT_A_TAG', 2 frames, 18 bytes", first)
                self.assertIn("1 bad message(s) so far", first)
                self.assertIn("6 bad message(s) so far", second)
                self.assertNotIn("PAYLOAD", first + second)

    def test_a_malformed_status_message_is_logged_as_in_0_5_23(self):
        mgr = make_manager("mooncake")  # untagged: any frames may be a status
        with self.assertLogs(CONN_LOGGER, "WARNING") as logs:
            self.assertIsNone(mgr.parse_kv_status_message([b"7", b"4"]))
            self.assertIsNone(mgr.parse_kv_status_message([b"7", b"x", b"3"]))
        self.assertEqual(
            [r.getMessage() for r in logs.records],
            [
                "Dropping malformed prefill status message with 2 frames",
                "Dropping unparsable prefill status message",
            ],
        )


# Tags of the other control messages on these sockets (ABORT goes to prefill).
_CONTROL_TAGS = [b"CHUNK_READY", b"ABORT_ACK", b"AUX_DATA", b"STAGING_REQ", b"ABORT"]
_TAGS = [b"KV_STATUS", b"MoriMsgGuard", *_CONTROL_TAGS, b""]
_INT = st.integers(-2, 6).map(lambda i: str(i).encode("ascii"))
_FRAME = st.one_of(st.binary(max_size=16), st.sampled_from(_TAGS), _INT)


@st.composite
def _near_status_message(draw):
    """A tag (or none), three integers, maybe a reason; at times one frame is
    swapped for an arbitrary one."""
    frames = draw(st.sampled_from([[], [b"KV_STATUS"], [b"MoriMsgGuard"]]))
    frames = frames + [draw(_INT) for _ in range(3)]
    frames += draw(st.lists(_FRAME, max_size=2))
    if draw(st.booleans()):
        frames[draw(st.integers(0, len(frames) - 1))] = draw(_FRAME)
    return frames


_MESSAGE = st.one_of(
    st.lists(_FRAME, max_size=7),
    _near_status_message(),
    # Garbage behind a handler's tag.
    st.tuples(st.sampled_from(_CONTROL_TAGS), st.lists(_FRAME, max_size=6)).map(
        lambda parts: [parts[0], *parts[1]]
    ),
)
_WATCHED_ROOMS = range(4)  # inside the integer range above, so hit at times
_PROBE_ROOM = 987654321  # outside it


def is_status_message(backend: str, frames) -> bool:
    """The 0.5.23 wire: the backend's tag (if any), then room, status and
    prefill rank as ASCII integers; a reason frame may follow."""
    tag = CLASSES[backend].kv_status_msg_tag
    if tag is not None:
        if not frames or frames[0] != tag:
            return False
        frames = frames[1:]
    if len(frames) < 3:
        return False
    try:
        for frame in frames[:3]:
            int(frame.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return False
    return True


def room_state(mgr):
    return dict(mgr.request_status), dict(mgr.failure_records)


class TestArbitraryFrames(_ListenerCase):
    """Arbitrary multipart messages, mixed with real tags and small integers so
    that they also reach the handlers and sometimes parse as a status."""

    def check_backend(self, backend: str):
        mgr, applied, listener, push = self.start(backend)
        # The dispatch the live listener runs, called directly as well.
        direct = make_manager(backend)
        handlers = direct.decode_message_handlers()
        examples = []

        @settings(
            max_examples=HYPOTHESIS_EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow],
        )
        @given(frames=_MESSAGE)
        def prop(frames):
            examples.append(frames)
            for target in (mgr, direct):
                for room in _WATCHED_ROOMS:
                    open_room(target, room)
            well_formed = is_status_message(backend, frames)

            before = room_state(direct)
            direct.handle_decode_message(list(frames), handlers)  # never raises
            if not well_formed:
                self.assertEqual(room_state(direct), before)

            # ZMQ carries no empty multipart message.
            if frames:
                before = room_state(mgr)
                push.send_multipart(frames)
                if well_formed:
                    self.next_applied(applied)
                open_room(mgr, _PROBE_ROOM)
                push.send_multipart(success_frames(backend, _PROBE_ROOM))
                self.assertEqual(
                    self.next_applied(applied)["bootstrap_room"], _PROBE_ROOM
                )
                self.assertEqual(mgr.request_status.pop(_PROBE_ROOM), KVPoll.Success)
                if not well_formed:
                    self.assertEqual(room_state(mgr), before)

        # Quiet the warnings that the handlers log for bad frames, by design.
        with mock.patch.object(conn_mod.logger, "disabled", True):
            prop()
        self.assertTrue(listener.is_alive())
        self.assertGreaterEqual(len(examples), HYPOTHESIS_EXAMPLES)

    def test_mooncake(self):
        self.check_backend("mooncake")

    def test_nixl(self):
        self.check_backend("nixl")

    def test_mori(self):
        self.check_backend("mori")


if __name__ == "__main__":
    unittest.main()
