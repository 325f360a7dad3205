"""The real sglang-router in front of scripted PD servers: with the router
settings README gives, a prefill that dies with more than 10 requests in
flight does not take the decode out of rotation; with the router's defaults
it does (why README gives them).

The decode here does what the patched decode does when its heartbeat declares
a prefill failed: it aborts every request waiting for that prefill's KV at
once, HTTP 500 with the prefill named. sglang-router 0.3.2 retries a 500 on
another pair, and charges each failed attempt to both workers of its pair;
its circuit breaker opens a worker after 10 such failures in a row. Servers
run on 127.0.0.1 in this process; the router is the one in the env.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
from demo_pd import ROUTER_PD_SETTINGS, ROUTER_REQUEST_TIMEOUT  # noqa: E402

pytest.importorskip("sglang_router")

HOST = "127.0.0.1"
IN_FLIGHT = 12  # more than the breaker's 10
WAIT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Worker:
    """A scripted sglang server: /health, the info the router reads at
    registration, and /generate by ``answer(body)``: (status, payload)."""

    def __init__(self, role: str, model_dir: Path, answer):
        info = {
            "model_path": str(model_dir),
            "tokenizer_path": str(model_dir),
            "served_model_name": str(model_dir),
            "disaggregation_mode": role,
            "is_generation": True,
            "version": "0.5.23",
            "tp_size": 1,
            "dp_size": 1,
        }
        self.healthy = threading.Event()
        self.healthy.set()
        worker = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def reply(self, status, payload):
                body = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                if self.path.startswith("/health"):
                    ok = worker.healthy.is_set()
                    return self.reply(200 if ok else 503, {})
                if "server_info" in self.path or "model_info" in self.path:
                    return self.reply(200, info)
                self.reply(404, {"error": {"message": "not found"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self.reply(*answer(body))

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer((HOST, 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://{HOST}:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def generated(body):
    rid = body.get("rid") or "r"
    return 200, {
        "text": " ok",
        "output_ids": [1],
        "meta_info": {"id": rid, "finish_reason": {"type": "length", "length": 1}},
    }


class Deployment:
    """Prefill 1 healthy, prefill 2 about to die, one decode, the router.
    ``death``: "kill" (prefill 2's requests in flight fail, new ones are
    refused) or "stuck" (its HTTP server answers, its KV never comes)."""

    def __init__(self, tmp: Path, router_args, death: str):
        self.death = death
        (tmp / "model").mkdir()
        (tmp / "model" / "config.json").write_text(
            '{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}'
        )
        self.dead_port = free_port()  # prefill 2's bootstrap port
        self.held = threading.Semaphore(0)
        self.declared = threading.Event()  # the decode's heartbeat verdict
        self.prefill2_dead = threading.Event()

        def prefill1(body):
            return generated(body)

        def prefill2(body):
            if death == "stuck":
                return generated(body)
            if not self.prefill2_dead.is_set():
                self.prefill2_dead.wait(WAIT_S)  # in flight when it dies
            return 502, {"error": {"message": "connection lost"}}

        def decode(body):
            if body.get("bootstrap_port") != self.dead_port:
                return generated(body)
            if not self.declared.is_set():
                self.held.release()
                self.declared.wait(WAIT_S)  # waits for its prefill's KV
            message = (
                f"Lost connection with prefill instance (bootstrap_addr: "
                f"{HOST}:{self.dead_port})"
            )
            return 500, {"error": {"message": message}}

        self.workers = {
            "prefill1": Worker("prefill", tmp / "model", prefill1),
            "prefill2": Worker("prefill", tmp / "model", prefill2),
            "decode": Worker("decode", tmp / "model", decode),
        }
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        cmd = [
            sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--prefill", self.workers["prefill1"].url, str(free_port()),
            "--prefill", self.workers["prefill2"].url, str(self.dead_port),
            "--decode", self.workers["decode"].url,
            "--host", HOST, "--port", str(self.port),
            "--prometheus-host", HOST, "--prometheus-port", str(free_port()),
            "--policy", "round_robin", "--worker-startup-check-interval", "1",
            *router_args,
        ]  # fmt: skip
        self.log = tmp / "router.log"
        self.router = subprocess.Popen(
            cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT
        )

    def close(self):
        self.declared.set()
        self.prefill2_dead.set()
        self.router.kill()
        self.router.wait(10)
        for worker in self.workers.values():
            worker.close()

    def healthy_workers(self) -> int:
        import requests

        try:
            r = requests.get(f"{self.url}/readiness", timeout=2)
            return r.json().get("healthy_workers", 0)
        except (requests.RequestException, ValueError):
            return 0

    def wait_until(self, condition, what: str):
        tick = threading.Event()
        for _ in range(int(WAIT_S / 0.1)):  # bounded: the router's own timers
            if condition():
                return
            tick.wait(0.1)
        raise AssertionError(f"timed out waiting for {what}; see {self.log}")

    def generate(self, n: int):
        import requests

        body = {"text": f"prompt {n}", "sampling_params": {"max_new_tokens": 1}}
        r = requests.post(f"{self.url}/generate", json=body, timeout=WAIT_S)
        return r.status_code, r.text

    def burst_then_death(self, in_flight: int = IN_FLIGHT):
        """2 x in_flight requests at once: round robin sends half to prefill 2,
        and it dies. The test then lets the decode abort those at once (500)."""
        pool = ThreadPoolExecutor(4 * in_flight)
        first = [pool.submit(self.generate, n) for n in range(2 * in_flight)]
        for _ in range(in_flight):
            assert self.held.acquire(timeout=WAIT_S), "requests never reached it"
        self.prefill2_dead.set()
        if self.death == "kill":
            self.workers["prefill2"].healthy.clear()
        return pool, first


@pytest.fixture
def deployment(tmp_path, request):
    dep = Deployment(tmp_path, *request.param)
    yield dep
    dep.close()


@pytest.mark.parametrize(
    "deployment", [(ROUTER_REQUEST_TIMEOUT + ROUTER_PD_SETTINGS, "kill")], indirect=True
)
def test_with_readmes_settings_the_decode_stays_in_rotation(deployment):
    dep = deployment
    dep.wait_until(lambda: dep.healthy_workers() == 3, "the router to register")
    pool, first = dep.burst_then_death()
    # Its health check takes the dead prefill out first (2 s x 2), then the
    # decode's heartbeat declares it (5 s x 2 by default) and aborts.
    dep.wait_until(lambda: dep.healthy_workers() == 2, "prefill 2 out of rotation")
    dep.declared.set()
    outcomes = [f.result(timeout=WAIT_S) for f in first]
    later = [pool.submit(dep.generate, n) for n in range(100, 120)]
    outcomes += [f.result(timeout=WAIT_S) for f in later]
    pool.shutdown()

    failed = [o for o in outcomes if o[0] != 200]
    assert failed == [], failed
    assert "closed -> open" not in dep.log.read_text()


@pytest.mark.parametrize("deployment", [([], "stuck")], indirect=True)
def test_with_the_routers_defaults_the_decode_leaves_rotation(deployment):
    # The decode gives up on the requests of prefill 2 at once (its heartbeat,
    # or any bound), while the router's health check (every 60 s) still has
    # prefill 2 in rotation. The breaker opens on 10 failures in a row, and
    # the retries' successes interleave with the 500s: 30 make that certain.
    dep = deployment
    dep.wait_until(lambda: dep.healthy_workers() == 3, "the router to register")
    pool, first = dep.burst_then_death(in_flight=30)
    dep.declared.set()
    [f.result(timeout=WAIT_S) for f in first]
    status, text = dep.generate(200)
    pool.shutdown()

    assert "closed -> open" in dep.log.read_text()
    assert status == 503 and "No available decode workers" in text, (status, text)
