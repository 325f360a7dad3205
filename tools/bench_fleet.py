"""Fleet-scale benchmark on real PD over 127.0.0.1, one variant (issue 20).

One decode (the real DECODE-mode manager and DecodePreallocQueue in this
process, test/pd_loopback/harness.py), one healthy prefill process, and many
sick prefills: ``Blackhole`` listeners (a frozen bootstrap server: connects
complete in the backlog, nothing is ever read), ``Trickle`` listeners (answer
one byte every 2 s, so no read ever times out) and, for the heartbeat, small
in-process bootstrap servers that answer /health until they are frozen.

    PYTHONPATH=<variant>:$REPO python3 tools/bench_fleet.py --out patched.json

- P9: the healthy prefill's request, add() until its dp rank is resolved
  (the prefill poses as dp rank 0 of 2 that does not follow the room, so
  every request needs a /query_dp_ranks), while K sick prefills each have a
  pending request; cached (the healthy prefill's info already fetched) and at
  first contact; sick = frozen or trickling. Stock blocks the whole decode
  5 s per frozen prefill per cycle, so its runs are one cycle long and K <= 4.
- P10: prefetch_prefill_dp_rank_queries() + _resolve_pending_reqs() per
  cycle with N requests pending over 64 frozen prefills (patched only: on
  stock each of those cycles blocks on the fetches).
- P11: scheduler-thread CPU time a request adds, healthy prefill, no faults:
  the same cycles with and without a request every 4th cycle (both variants).
- P12: time until the heartbeat declares K prefills failed that freeze at
  once, default heartbeat settings (interval 5 s, 2 failures).
- P12b: time from one prefill's death (it freezes, or it refuses
  connections) to its declaration, alone and while 31 others are frozen.
- P15: 1,000 prefill addresses come and go, 50 at a time: each answers its
  bootstrap queries for one request, then goes away and is declared failed.
  The decode's threads, open fds and PD tables (decode_tables), idle after
  the first 50 and idle after all 1,000 (patched only; timers shortened:
  heartbeat every 2 s, a prefill's threads end after 2 s idle; its heartbeat
  probe thread after 60 s, so idle is measured 62 s after). With
  ``--metrics``, also the per-peer series on the decode's /metrics at the
  peak and a minute after the last prefill went (patched only).
- ``--metrics``: the decode's per-peer metrics on (patch 12, as with sglang's
  --enable-metrics: a _PeerMetrics writing a temporary multiprocess
  directory every second, rows built in each cycle): P11 and P15 measured
  with them. Stock has none: the switch does nothing there.
- The decode's threads and open fds with 64 frozen prefills, and after they
  are gone (lane threads started in that scenario end after 2 s idle, 60 s
  by default). Each scenario starts 1 s after the previous one's clean-up.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "test", "pd_loopback"))

for _key in (
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL",
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE",
):
    os.environ.pop(_key, None)  # P12 uses sglang's defaults

import harness  # noqa: E402  (sets the loopback environment first)
import requests  # noqa: E402
from bench_stall import dp_query_faults  # noqa: E402

PERIOD_S = 0.005
LANE_IDLE_S = 2.0
PROBE_IDLE_S = 60.0  # the heartbeat's probe threads (_PrefillThreads' default)
QUIET_S = 1.0
HOST = "127.0.0.1"


def decode_tables(mgr) -> dict:
    """Sizes of the decode manager's per-prefill and per-room tables; one
    that stays above 0 while the decode is idle is a leak."""

    def size(name: str) -> int:
        return len(getattr(mgr, name, ()) or ())

    pool = getattr(mgr, "_parallel_info_executor", None)
    return {
        "prefills": size("prefill_info_table"),
        "route_cache": size("connection_pool"),
        "route_setups": size("_route_setups"),
        "fetches_in_flight": size("_parallel_info_inflight"),
        "heartbeat_failures": size("heartbeat_failures"),
        "failure_records": size("failure_records"),
        "request_status": size("request_status"),
        "rooms_tracked": sum(map(len, getattr(mgr, "addr_to_rooms_tracker", {}).values())),
        "prefills_with_threads": len(getattr(pool, "_tasks", ()) or ()),
    }


class Trickle:
    """A bootstrap server that answers one byte every ``gap_s``: no read of a
    client ever times out, and no answer ever ends in useful time."""

    RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"

    def __init__(self, gap_s: float = 2.0):
        self.gap_s = gap_s
        self.sock = socket.socket()
        self.sock.bind((HOST, 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def addr(self) -> str:
        return f"{HOST}:{self.port}"

    def _accept(self):
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn):
        with conn:
            for byte in self.RESPONSE:  # bounded: one answer, then close
                if self.closed.wait(self.gap_s):
                    return
                try:
                    conn.sendall(bytes([byte]))
                except OSError:
                    return

    def close(self):
        self.closed.set()
        self.sock.close()


class HealthServer:
    """A bootstrap server answering /health, until frozen: then it takes
    requests in and never answers (as a SIGSTOPped one). With ``info`` it
    also answers /route: that parallel info, and a rank route to a port
    nobody listens on."""

    def __init__(self, info: Optional[dict] = None):
        frozen = self.frozen = threading.Event()
        done = self.done = threading.Event()
        dead = socket.socket()
        dead.bind((HOST, 0))
        rank = {"rank_ip": HOST, "rank_port": dead.getsockname()[1]}
        dead.close()

        conns = self.conns = []

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                super().setup()
                conns.append(self.connection)

            def do_GET(self):
                if frozen.is_set():
                    done.wait(600)
                    return
                body = b"ok"
                if info is not None and self.path.startswith("/route"):
                    answer = info if "prefill_dp_rank=-1" in self.path else rank
                    body = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer((HOST, 0), Handler)
        self.httpd.daemon_threads = True
        self.addr = f"{HOST}:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        """Gone, as a killed process: connections refused, and the open
        keep-alive ones closed."""
        self.done.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        for conn in self.conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def pct(values, q):
    return harness.percentile(values, q) if values else None


def threads_and_fds():
    return threading.active_count(), len(os.listdir("/proc/self/fd"))


class Bench:
    def __init__(self, args, variant):
        self.args = args
        self.variant = variant
        self.patched = variant == "patched"

    def say(self, msg):
        print(f"[fleet {self.variant}] {msg}", file=sys.stderr, flush=True)

    def settle(self, addrs):
        d = self.cluster.decode
        d.abort_all()
        for addr in addrs:
            d.forget_prefill(addr)
        # The fetches to closed sick prefills end now, on their own threads:
        # let them, so that the next scenario does not share the GIL with them.
        d.run_for(QUIET_S, period_s=0.05)

    def dp_faults(self, on: bool):
        healthy = self.cluster.prefills[0]
        if not on:
            healthy.clear_fault()
            return
        healthy.set_faults(*dp_query_faults())

    # -- P9 ---------------------------------------------------------------

    def healthy_latency(self, k: int, sick: str, cached: bool) -> dict:
        c = self.cluster
        d = c.decode
        healthy = c.prefills[0]
        self.settle([healthy.addr])
        self.dp_faults(True)
        if cached:
            warm = c.request(healthy)
            d.run(lambda: warm.finished, 30)
        holes = [
            harness.Blackhole() if sick == "frozen" else Trickle() for _ in range(k)
        ]
        try:
            for hole in holes:
                d.add(hole.addr)
            if k and self.patched:
                d.run_for(0.2)  # the sick prefills' fetches are in flight
            elif k:
                d.step()  # stock: one cycle, up to 5 s per frozen prefill
            served = c.request(healthy)
            cap = 40.0 if self.patched else 0.0
            d.run(lambda: served.t_admitted is not None, cap)
            latency = (
                None if served.t_admitted is None else served.t_admitted - served.t_add
            )
            d.run(lambda: served.finished, 30)
            return {
                "k": k,
                "sick": sick,
                "cached": cached,
                "admit_s": latency,
                "state": served.state,
            }
        finally:
            for hole in holes:
                hole.close()
            self.settle([h.addr for h in holes] + [healthy.addr])
            self.dp_faults(False)

    # -- P10 --------------------------------------------------------------

    def pending_cost(self, n: int, prefills: int = 64, cycles: int = 300) -> dict:
        d = self.cluster.decode
        holes = [harness.Blackhole() for _ in range(prefills)]
        try:
            for i in range(n):
                d.add(holes[i % prefills].addr)
            q = d.queue
            times, cpu = [], []
            for _ in range(cycles):
                t0, c0 = time.perf_counter(), time.thread_time()
                q.prefetch_prefill_dp_rank_queries()
                q._resolve_pending_reqs()
                times.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
                time.sleep(PERIOD_S)
            return {
                "n": n,
                "prefills": prefills,
                "cycles": len(times),
                "p50_ms": pct(times, 50) * 1e3,
                "p99_ms": pct(times, 99) * 1e3,
                "max_ms": max(times) * 1e3,
                # Wall time includes waits for the GIL held by other threads
                # (up to the 5 ms switch interval); CPU time does not.
                "cpu_p50_ms": pct(cpu, 50) * 1e3,
                "cpu_p99_ms": pct(cpu, 99) * 1e3,
                "still_pending": len(q.pending_reqs),
            }
        finally:
            for hole in holes:
                hole.close()
            self.settle([h.addr for h in holes])

    # -- per-peer metrics ---------------------------------------------------

    def start_metrics(self) -> bool:
        """The decode's per-peer metrics, as --enable-metrics starts them."""
        if not self.patched:
            return False
        import tempfile

        from sglang.srt.disaggregation.common.conn import _PeerMetrics

        self.metrics_dir = tempfile.mkdtemp(prefix="bench-fleet-metrics-")
        mgr = self.cluster.decode.kv_manager
        mgr.peer_metrics = _PeerMetrics(None, self.metrics_dir, {"tp_rank": "0"})
        return True

    def peer_series(self) -> set:
        """The prefill addresses with a series on /metrics now."""
        from prometheus_client import CollectorRegistry
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self.metrics_dir)
        return {
            s.labels["prefill"]
            for family in registry.collect()
            for s in family.samples
            if "prefill" in s.labels
        }

    # -- P11 --------------------------------------------------------------

    def healthy_cpu(self, cycles: int = 400, every: int = 4, repeats: int = 5):
        """Scheduler-thread CPU a request adds: ``cycles`` cycles with a new
        request every ``every`` cycles, less the same number of cycles
        without requests, per request admitted. Both variants run the same
        cycles, so a variant needing more cycles per request is not charged
        for cycles a decode runs anyway."""
        c = self.cluster
        d = c.decode
        healthy = c.prefills[0]
        self.settle([healthy.addr])
        warm = c.request(healthy)
        d.run(lambda: warm.finished, 30)

        def cpu_of(with_requests: bool):
            first_cycle, first_add = len(d.cycles), len(d.adds)
            tracked = []
            for i in range(cycles):
                if with_requests and i % every == 0:
                    tracked.append(c.request(healthy))
                d.step()
                time.sleep(PERIOD_S)
            cpu = sum(cy.cpu for cy in d.cycles[first_cycle:]) + sum(
                a.cpu for a in d.adds[first_add:]
            )
            admitted = sum(t.t_admitted is not None for t in tracked)
            d.run(lambda: all(t.finished for t in tracked), 60)
            return cpu, admitted, sum(t.state == "success" for t in tracked)

        per_request = []
        for _ in range(repeats):
            idle, _, _ = cpu_of(False)
            busy, admitted, ok = cpu_of(True)
            per_request.append((busy - idle) / max(admitted, 1))
        return {
            "requests": cycles // every,
            "succeeded": ok,
            "cpu_per_request_ms": statistics.median(per_request) * 1e3,
            "runs_ms": [x * 1e3 for x in per_request],
        }

    # -- P12 --------------------------------------------------------------

    def known_and_healthy(self, servers) -> None:
        """Each is a known prefill, and has answered a heartbeat round."""
        mgr = self.cluster.decode.kv_manager
        for s in servers:
            mgr.prefill_info_table[s.addr] = object()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(
            mgr.heartbeat_failures.get(s.addr) == 0 for s in servers
        ):
            time.sleep(0.05)

    def detection(self, k: int, cap_s: float = 90.0) -> dict:
        mgr = self.cluster.decode.kv_manager
        servers = [HealthServer() for _ in range(k)]
        try:
            self.known_and_healthy(servers)
            t0 = time.monotonic()
            for s in servers:
                s.frozen.set()
            declared = {}
            while time.monotonic() - t0 < cap_s and len(declared) < k:
                for s in servers:
                    if s.addr not in declared and s.addr not in mgr.prefill_info_table:
                        declared[s.addr] = time.monotonic() - t0
                time.sleep(0.05)
            return {
                "k": k,
                "declared": len(declared),
                "last_s": max(declared.values()) if len(declared) == k else None,
                "first_s": min(declared.values()) if declared else None,
                "cap_s": cap_s,
            }
        finally:
            for s in servers:
                s.close()
                mgr.prefill_info_table.pop(s.addr, None)
                mgr.heartbeat_failures.pop(s.addr, None)

    def one_death(self, death: str, others: int, cap_s: float = 60.0) -> dict:
        """P12b: seconds from one prefill's death to its declaration, while
        ``others`` other prefills are frozen (since 2 s before)."""
        mgr = self.cluster.decode.kv_manager
        target = HealthServer()
        frozen = [HealthServer() for _ in range(others)]
        servers = [target] + frozen
        try:
            self.known_and_healthy(servers)
            for s in frozen:
                s.frozen.set()
            time.sleep(2.0)  # their probes are in flight when it dies
            t0 = time.monotonic()
            if death == "freeze":
                target.frozen.set()
            else:
                target.close()  # connections refused from now on
            declared_s = None
            while time.monotonic() - t0 < cap_s:
                if target.addr not in mgr.prefill_info_table:
                    declared_s = time.monotonic() - t0
                    break
                time.sleep(0.05)
            return {"death": death, "others": others, "declared_s": declared_s}
        finally:
            for s in servers:
                s.close()
                mgr.prefill_info_table.pop(s.addr, None)
                mgr.heartbeat_failures.pop(s.addr, None)

    # -- P15 --------------------------------------------------------------

    def churn(self, total: int = 1000, wave: int = 50) -> dict:
        """P15: ``total`` prefill addresses come and go, ``wave`` at a time."""
        d = self.cluster.decode
        mgr = d.kv_manager
        healthy = self.cluster.prefills[0]
        info = requests.get(
            f"http://{healthy.addr}/route?prefill_dp_rank=-1"
            "&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1",
            timeout=5,
        ).json()
        pool = mgr._parallel_info_executor
        saved = (pool._idle_s, mgr.heartbeat_interval)
        pool._idle_s = LANE_IDLE_S
        mgr.heartbeat_interval = 2.0
        d.run_for(6.0, period_s=0.05)  # the heartbeat picks its interval up
        metrics = getattr(mgr, "peer_metrics", None) is not None
        peak_series = [0]

        def come_and_go():
            servers = [HealthServer(info) for _ in range(wave)]
            for s in servers:
                d.add(s.addr)
            d.run_for(2.0, period_s=0.02)  # its bootstrap queries
            peak = threads_and_fds()
            if metrics:
                time.sleep(1.1)  # the metrics thread's next write
                peak_series[0] = max(peak_series[0], len(self.peer_series()))
            for s in servers:
                s.close()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and any(
                s.addr in mgr.prefill_info_table for s in servers
            ):
                d.run_for(0.25, period_s=0.02)
            return peak

        def idle():
            # Everything idle runs out: a prefill's threads, and the
            # heartbeat's probe thread of each prefill (60 s after its last
            # probe, which this bench does not shorten).
            d.abort_all()
            d.run_for(PROBE_IDLE_S + 2.0, period_s=0.05)
            return threads_and_fds(), decode_tables(mgr)

        try:
            # A first wave warms up what stays (sockets and threads of the
            # process, not of any prefill): the baseline is idle after it.
            come_and_go()
            before, state_before = idle()
            peak = before
            t_start = time.monotonic()
            for start in range(wave, total, wave):
                peak = tuple(map(max, peak, come_and_go()))
                self.say(f"P15 {start + wave} of {total} come and gone")
            churn_s = time.monotonic() - t_start
            after, state_after = idle()
            series = None
            if metrics:
                # The real decode releases a failed prefill's fenced pages at
                # their deadline; the harness only on forget_prefill. Then a
                # failed prefill's series stay a minute after its last request.
                fenced = {f.kv_receiver.bootstrap_addr for _, f in d.quarantined}
                for addr in fenced - {healthy.addr}:
                    d.forget_prefill(addr)
                d.run_for(62.0, period_s=0.05)
                time.sleep(1.1)
                left = self.peer_series() - {healthy.addr}
                series = {"peak": peak_series[0], "left": len(left)}
        finally:
            pool._idle_s, mgr.heartbeat_interval = saved
        return {
            "total": total,
            "wave": wave,
            "churn_s": churn_s,
            "series": series,
            "before": {"threads": before[0], "fds": before[1]},
            "peak": {"threads": peak[0], "fds": peak[1]},
            "after": {"threads": after[0], "fds": after[1]},
            "state_before": state_before,
            "state_after": state_after,
        }

    # -- threads and fds --------------------------------------------------

    def resources(self, k: int = 64, hold_s: float = 12.0) -> dict:
        d = self.cluster.decode
        pool = getattr(d.kv_manager, "_parallel_info_executor", None)
        if hasattr(pool, "_idle_s"):
            pool._idle_s = LANE_IDLE_S  # threads started from now on
        before = threads_and_fds()
        holes = [harness.Blackhole() for _ in range(k)]
        peak = before
        try:
            for hole in holes:
                d.add(hole.addr)
            deadline = time.monotonic() + hold_s
            while time.monotonic() < deadline:
                d.step()
                now = threads_and_fds()
                peak = (max(peak[0], now[0]), max(peak[1], now[1]))
                time.sleep(0.02)
        finally:
            for hole in holes:
                hole.close()
            self.settle([h.addr for h in holes])
        d.run_for(6.0, period_s=0.05)
        after = threads_and_fds()
        return {
            "k": k,
            "before": {"threads": before[0], "fds": before[1]},
            "peak": {"threads": peak[0], "fds": peak[1]},
            "after": {"threads": after[0], "fds": after[1]},
        }

    def run(self) -> dict:
        quick = self.args.quick
        out = {
            "variant": self.variant,
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "quick": quick,
        }
        with harness.Cluster(self.args.backend, 1) as cluster:
            self.cluster = cluster
            out["metrics"] = self.start_metrics() if self.args.metrics else False
            want = self.args.scenarios
            ks = (0, 8, 16, 32, 64) if self.patched else (0, 1, 4)
            if quick:
                ks = (0, 16, 64) if self.patched else (0, 1)
            if "p9" not in want:
                ks = ()
            p9 = []
            # Patched runs are short: the median of 3 (stock's take 5 s per
            # frozen prefill, once).
            repeats = 3 if self.patched and not quick else 1
            runs = [(k, "frozen", cached) for cached in (True, False) for k in ks]
            if self.patched and "p9" in want:
                runs += [(k, "trickle", True) for k in ((8, 32) if not quick else (8,))]
            for k, sick, cached in runs:
                self.say(f"P9 {sick} k={k} cached={cached}")
                results = [
                    self.healthy_latency(k, sick, cached) for _ in range(repeats)
                ]
                times = [r["admit_s"] for r in results]
                row = dict(results[0], runs_s=times)
                row["admit_s"] = None if None in times else statistics.median(times)
                p9.append(row)
            out["p9"] = p9
            if self.patched and "p10" in want:
                out["p10"] = []
                for n in (100, 1000, 5000):
                    self.say(f"P10 n={n}")
                    out["p10"].append(self.pending_cost(n))
            if "p11" in want:
                self.say("P11")
                out["p11"] = self.healthy_cpu()
            out["p12"] = []
            for k in ((1, 8, 32) if not quick else (1, 8)) if "p12" in want else ():
                self.say(f"P12 k={k}")
                cap = 90.0 if self.patched or k < 32 else 60.0
                out["p12"].append(self.detection(k, cap_s=cap))
            out["p12b"] = []
            for death in ("refuse", "freeze") if "p12b" in want else ():
                for others in (0, 31):
                    self.say(f"P12b {death}, {others} others frozen")
                    out["p12b"].append(self.one_death(death, others))
            if self.patched and "resources" in want:
                self.say("threads and fds, 64 frozen")
                out["resources"] = self.resources()
            if self.patched and "p15" in want:
                self.say("P15")
                out["p15"] = self.churn(total=200 if quick else 1000)
        return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", default="mooncake", choices=["mooncake", "nixl"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--metrics", action="store_true", help="per-peer metrics on")
    ap.add_argument(
        "--scenarios",
        default="p9,p10,p11,p12,p12b,resources,p15",
        help="comma-separated",
    )
    args = ap.parse_args(argv)
    args.scenarios = set(args.scenarios.split(","))
    variant, _ = harness.detect_variant()
    result = Bench(args, variant).run()
    with open(args.out.format(variant=variant), "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
