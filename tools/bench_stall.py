"""Decode scheduler stall benchmark on real PD over 127.0.0.1, one variant.

Runs against whatever sglang is first on PYTHONPATH (the variant: stock 0.5.23
or patched) and writes JSON for tools/bench_report.py:

    PYTHONPATH=/tmp/sg-harness-patched:$REPO python3 tools/bench_stall.py \\
        --out patched.json [--repeats 3] [--quick] [--backend mooncake]

The variant's name is taken from SGLANG_PD_VARIANT when set, otherwise
detected (the patched CommonKVManager has has_parallel_info()).

Set-up (test/pd_loopback/harness.py): two real prefill processes, ``frozen``
(SIGSTOPped for the frozen scenarios) and ``healthy``, and the real decode
manager plus DecodePreallocQueue in this process, with the default retry
budget (15 attempts, 1 s apart). A "cycle" is one DecodeSide.step(): the
prealloc-queue part of a decode scheduling call; cycles run every
``--period-ms`` (the stand-in for a decode forward).

Figures (each repeated; the report gives min / median / max over repeats):
- P1: cycle stall (max, p99) with one frozen prefill, first contact.
- P2: the same with K = 1, 2, 4, 8 frozen prefills: the real frozen process
  plus K-1 ``Blackhole`` listeners (accept nothing, answer nothing: the same
  TCP behaviour as a SIGSTOPped bootstrap server). K = 1 is P1.
- P3: ns per try_ensure_parallel_info() on a cached addr, and per
  _ensure_prefill_info() call for one cached addr (the steady-state path),
  next to a reference bound-method dict lookup timed in the same loop, which
  the report uses to compare runs made while the host was more or less busy.
- P4: in the P2 runs, time from add() until the healthy prefill's first
  request is admitted (its receiver initialised), and how long after its
  parallel-info fetch landed in prefill_info_table.
- P5 (extra): cycle stall when only the per-rank /route lookup of the
  healthy prefill is slow (1 s): the blocking call in CommonKVReceiver.init
  that the parallel-info patch alone does not move.
- P6 (extra): cycle stall when the healthy prefill poses as dp rank 0 of 2
  (rooms not followed) and its /query_dp_ranks answers after 1 s: the dp-rank
  resolution of _resolve_pending_reqs.
- P7: a fast healthy prefill at first contact: cycles and time from add()
  until the request's handshake is done (receiver initialised, KV metadata
  sent), with the dp rank followed and with it queried (dp rank 0 of 2).
- P8: K = 1, 8, 32 requests in flight to a prefill whose whole process is
  then frozen; a healthy request is served, then one call aborts the K
  requests (ABORTs to the frozen prefill): longest call, and ZMQ sends and
  connects made by the scheduler thread.

Every cycle also carries its CPU time and the number of HTTP requests the
scheduler thread sent in it (interpreter audit events), so a stall from a
network wait can be told apart from one from a starved CPU on a shared host.

Stock stalls 5 s per frozen prefill per cycle, so each frozen scenario is
bounded by time: it runs at least ``duration`` seconds and until the healthy
request is admitted, but stops after the first cycle that ends past the
duration. Stock uses fewer repeats (--stock-repeats, default min(repeats, 2)).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "test", "pd_loopback"))

import harness  # noqa: E402  (sets the loopback environment first)

KS = (1, 2, 4, 8)
HARD_CAP_S = 120.0  # no single frozen scenario runs longer than this


def fetch_threads(decode):
    executor = getattr(decode.kv_manager, "_parallel_info_executor", None)
    return None if executor is None else len(executor._threads)


def dp_query_faults():
    """A prefill posing as dp rank 0 of 2 that does not follow the bootstrap
    room: the decode queries the dp rank of every request."""
    return [
        harness.fault_spec(
            "patch_json",
            fields={"dp_size": 2, "follow_bootstrap_room": False},
            paths=["/route"],
            route_kind="info",
        ),
        harness.fault_spec("dp_rank_zero", paths=["/query_dp_ranks"]),
    ]


def spread(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {
        "min": min(values),
        "median": statistics.median(values),
        "max": max(values),
        "n": len(values),
    }


def cycle_stats(cycles):
    if not cycles:
        return {"n": 0}
    durations = [c.duration for c in cycles]
    worst = max(cycles, key=lambda c: c.duration)
    return {
        "n": len(durations),
        "max_s": worst.duration,
        "p99_s": harness.percentile(durations, 99),
        "p50_s": harness.percentile(durations, 50),
        "mean_s": sum(durations) / len(durations),
        # Was the worst call waiting (network, GIL, a starved CPU) or working?
        "worst_cpu_s": worst.cpu,
        "p99_cpu_s": harness.percentile([c.cpu for c in cycles], 99),
        "worst_http": len(worst.http),
        "worst_index": cycles.index(worst),
    }


class Bench:
    def __init__(self, args, variant: str):
        self.args = args
        self.variant = variant
        self.cluster: harness.Cluster = None
        self.log = args.log

    def say(self, msg: str) -> None:
        if self.log:
            print(f"[bench {self.variant}] {msg}", file=sys.stderr, flush=True)

    # -- helpers ----------------------------------------------------------

    def settle(self, addrs) -> None:
        """Back to first contact: no request left, no fetch in flight, the
        addrs evicted as by a heartbeat failure."""
        d = self.cluster.decode
        d.abort_all()
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            if not any(d.fetch_in_flight(a) for a in addrs):
                break
            time.sleep(0.02)
        for a in addrs:
            d.forget_prefill(a)

    # -- scenarios --------------------------------------------------------

    def frozen_scenario(self, k: int, duration_s: float) -> dict:
        c = self.cluster
        d = c.decode
        frozen, healthy = c.prefills
        blackholes = [harness.Blackhole() for _ in range(k - 1)]
        frozen_addrs = [frozen.addr] + [b.addr for b in blackholes]
        frozen_ports = {int(a.rsplit(":", 1)[1]) for a in frozen_addrs}
        first_cycle = len(d.cycles)
        threads_before = fetch_threads(d)
        try:
            frozen.freeze()
            for addr in frozen_addrs:
                d.add(addr)
            # Added last: the worst position for stock, which walks addrs in
            # arrival order on the scheduler thread.
            served = c.request(healthy)
            t0 = served.t_add
            deadline = time.monotonic() + HARD_CAP_S
            period = self.args.period_ms / 1000.0
            while True:
                d.step()
                elapsed = time.perf_counter() - t0
                if served.t_admitted is not None and elapsed >= duration_s:
                    break
                if time.monotonic() >= deadline:
                    break
                time.sleep(period)
            cycles = d.cycles[first_cycle:]
            landed = d.kv_manager.prefill_info_table.set_times.get(healthy.addr)
            out = {
                "k": k,
                "frozen": f"1 process + {k - 1} blackhole(s)",
                "wall_s": time.perf_counter() - t0,
                # [start since add(), duration, CPU time, HTTP requests] per cycle
                "cycles": [
                    [
                        round(cy.start - t0, 6),
                        round(cy.duration, 7),
                        round(cy.cpu, 7),
                        len(cy.http),
                    ]
                    for cy in cycles
                ],
                "stats": cycle_stats(cycles),
                # Patched only: fetch-executor workers started during the
                # scenario (ThreadPoolExecutor starts them lazily, in submit()).
                "fetch_threads_started": (
                    None
                    if threads_before is None
                    else fetch_threads(d) - threads_before
                ),
                "http_to_frozen": sum(
                    1 for cy in cycles for _, port in cy.http if port in frozen_ports
                ),
                "healthy": {
                    "state": served.state,
                    "admit_s": (
                        None
                        if served.t_admitted is None
                        else served.t_admitted - served.t_add
                    ),
                    "landed_s": None if landed is None else landed - served.t_add,
                    "done_s": (
                        None
                        if served.t_done is None or served.state != "success"
                        else served.t_done - served.t_add
                    ),
                },
            }
            h = out["healthy"]
            if h["admit_s"] is not None and h["landed_s"] is not None:
                h["admit_after_landing_s"] = h["admit_s"] - h["landed_s"]
                # Whole cycles that ran after the info landed without
                # admitting the request: 0 means it was admitted by the
                # first cycle that could see the info.
                h["missed_cycles"] = sum(
                    1
                    for cy in cycles
                    if cy.start > landed
                    and cy.start + cy.duration < served.t_admitted - 1e-9
                )
            return out
        finally:
            d.abort_all()
            for b in blackholes:
                b.close()  # resets the queued connections: fetches end now
            if frozen.frozen:
                frozen.resume()
            self.settle(frozen_addrs + [healthy.addr])

    def cached_lookup(self, repeats: int, calls: int) -> dict:
        c = self.cluster
        d = c.decode
        healthy = c.prefills[1]
        warm = c.request(healthy)
        d.run(lambda: warm.finished, 30)
        assert warm.state == "success", warm.error
        mgr = d.kv_manager
        addr = healthy.addr
        assert addr in mgr.prefill_info_table
        try_ensure = mgr.try_ensure_parallel_info
        ensure = d.queue._ensure_prefill_info
        addr_to_reqs = {addr: [warm.decode_req]}
        table = mgr.prefill_info_table

        class Reference:
            # A bound method doing the same dict lookup: tracks how fast this
            # host runs Python right now, to compare runs made at other times.
            def lookup(self, key):
                return key in table

        reference = Reference().lookup
        per_call_ref, per_call_try, per_call_ensure = [], [], []
        for _ in range(repeats):
            t = time.perf_counter_ns()
            for _ in range(calls):
                reference(addr)
            per_call_ref.append((time.perf_counter_ns() - t) / calls)
            t = time.perf_counter_ns()
            for _ in range(calls):
                try_ensure(addr)
            per_call_try.append((time.perf_counter_ns() - t) / calls)
            t = time.perf_counter_ns()
            for _ in range(calls // 4):
                ensure(addr_to_reqs)
            per_call_ensure.append((time.perf_counter_ns() - t) / (calls // 4))
        self.settle([addr])
        return {
            "calls": calls,
            "reference_ns": per_call_ref,
            "try_ensure_ns": per_call_try,
            "ensure_prefill_info_ns": per_call_ensure,
        }

    def slow_query(self, delay_s: float, *faults: dict) -> dict:
        """One request to the healthy prefill while its bootstrap server has
        ``faults``; the cycles from its add() until it ends."""
        c = self.cluster
        d = c.decode
        healthy = c.prefills[1]
        self.settle([healthy.addr])
        first_cycle = len(d.cycles)
        healthy.set_faults(*faults)
        try:
            t = c.request(healthy)
            d.run(lambda: t.finished, 30, period_s=self.args.period_ms / 1000.0)
        finally:
            healthy.clear_fault()
        cycles = d.adds[-1:] + d.cycles[first_cycle:]
        out = {
            "delay_s": delay_s,
            "state": t.state,
            "error": t.error,
            "stats": cycle_stats(cycles),
            "scheduler_http": sum(len(cy.http) for cy in cycles),
        }
        self.settle([healthy.addr])
        return out

    def slow_rank_lookup(self, delay_s: float) -> dict:
        """P5: the per-rank /route lookups answer after ``delay_s``."""
        return self.slow_query(
            delay_s,
            harness.fault_spec(
                "delay", delay_s=delay_s, paths=["/route"], route_kind="rank"
            ),
        )

    def slow_dp_rank_query(self, delay_s: float) -> dict:
        """P6: the healthy prefill poses as dp rank 0 of 2 (rooms not
        followed), so the decode must ask its /query_dp_ranks, which answers
        after ``delay_s``."""
        return self.slow_query(
            delay_s,
            harness.fault_spec(
                "patch_json",
                fields={"dp_size": 2, "follow_bootstrap_room": False},
                paths=["/route"],
                route_kind="info",
            ),
            harness.fault_spec(
                "dp_rank_zero", delay_s=delay_s, paths=["/query_dp_ranks"]
            ),
        )

    def fast_first_contact(self, dp_query: bool) -> dict:
        """P7: one request to the healthy prefill at first contact, nothing
        slow: the cycles from its add() until its handshake is done (the
        receiver initialised, its KV metadata sent). With ``dp_query`` the
        prefill poses as dp rank 0 of 2, so the dp rank is queried too."""
        c = self.cluster
        d = c.decode
        healthy = c.prefills[1]
        self.settle([healthy.addr])
        faults = dp_query_faults() if dp_query else []
        if faults:
            healthy.set_faults(*faults)
        first_cycle = len(d.cycles)
        try:
            t = c.request(healthy)
            d.run(
                lambda: t.t_metadata is not None or t.finished,
                30,
                period_s=self.args.period_ms / 1000.0,
            )
            cycles = [
                cy
                for cy in d.cycles[first_cycle:]
                if t.t_metadata is not None and cy.start <= t.t_metadata
            ]
            d.run(lambda: t.finished, 30)
        finally:
            if faults:
                healthy.clear_fault()
        out = {
            "dp_query": dp_query,
            "state": t.state,
            "error": t.error,
            "cycles_to_init": len(cycles) if t.t_metadata is not None else None,
            "init_s": None if t.t_metadata is None else t.t_metadata - t.t_add,
        }
        self.settle([healthy.addr])
        return out

    def frozen_in_flight(self, k: int) -> dict:
        """P8: K requests to the frozen prefill were in flight (their KV
        metadata sent, their KV not yet) when its whole process stopped; a
        healthy request is served meanwhile, then the clients give up and one
        scheduling call aborts the K requests (their ABORTs go to the frozen
        prefill). The longest call and the ZMQ operations of the scheduler
        thread, from the freeze on."""
        c = self.cluster
        d = c.decode
        frozen, healthy = c.prefills
        self.settle([frozen.addr, healthy.addr])
        warm = c.request(frozen)
        d.run(lambda: warm.finished, 30)
        held = [c.request(frozen, hold_s=120) for _ in range(k)]
        d.run(lambda: all(t.t_metadata is not None for t in held), 30)
        first_cycle = len(d.cycles)
        frozen.freeze()
        try:
            served = c.request(healthy)
            d.run(lambda: served.finished, 30)
            d.timed(lambda: [t.decode_req.kv_receiver.abort() for t in held])
            d.run_for(0.5)
        finally:
            frozen.resume()
            d.abort_all()
            self.settle([frozen.addr, healthy.addr])
        cycles = d.cycles[first_cycle:]
        return {
            "k": k,
            "in_flight": sum(t.t_metadata is not None for t in held),
            "stats": cycle_stats(cycles),
            "scheduler_zmq_ops": sum(len(cy.zmq) for cy in cycles),
            "healthy_state": served.state,
        }

    # -- driver -----------------------------------------------------------

    def run(self) -> dict:
        a = self.args
        is_stock = self.variant_detected == "stock"
        repeats = a.repeats
        frozen_repeats = repeats
        if is_stock:
            frozen_repeats = a.stock_repeats or min(repeats, 2)
        duration = a.duration_s
        # Many short repeats: the minimum is the least disturbed estimate on
        # a shared host.
        p3_repeats, p3_calls = (5, 50_000) if a.quick else (15, 100_000)

        results = {
            "frozen": [],
            "cached_lookup": None,
            "slow_rank_lookup": [],
            "slow_dp_rank_query": [],
            "fast_first_contact": [],
            "frozen_in_flight": [],
        }
        t_setup = time.perf_counter()
        with harness.Cluster(a.backend, 2) as cluster:
            self.cluster = cluster
            setup_s = time.perf_counter() - t_setup
            self.say(f"cluster up in {setup_s:.1f}s")
            queue = cluster.decode.queue
            self.retry_budget = {
                "max_ensure_retries": queue._max_ensure_retries,
                "ensure_retry_interval_s": queue._ensure_retry_interval,
            }
            self.settle([p.addr for p in cluster.prefills])
            results["cached_lookup"] = self.cached_lookup(p3_repeats, p3_calls)
            self.say("P3 done")
            for rep in range(frozen_repeats):
                for k in a.ks:
                    r = self.frozen_scenario(k, duration)
                    r["repeat"] = rep
                    results["frozen"].append(r)
                    st = r["stats"]
                    self.say(
                        f"K={k} rep={rep}: {st['n']} cycles, max {st['max_s']:.4f}s, "
                        f"p99 {st['p99_s']:.4f}s, healthy admitted after "
                        f"{r['healthy']['admit_s']}"
                    )
            results["slow_rank_lookup"].append(self.slow_rank_lookup(1.0))
            self.say("P5 done")
            results["slow_dp_rank_query"].append(self.slow_dp_rank_query(1.0))
            self.say("P6 done")
            for rep in range(repeats):
                for dp_query in (False, True):
                    results["fast_first_contact"].append(
                        self.fast_first_contact(dp_query)
                    )
            self.say("P7 done")
            for k in (1, 8, 32):
                results["frozen_in_flight"].append(self.frozen_in_flight(k))
            self.say("P8 done")
        return {"setup_s": setup_s, "results": results}


def summarize(results: dict) -> dict:
    frozen = results["frozen"]
    ks = sorted({r["k"] for r in frozen})
    by_k = {k: [r for r in frozen if r["k"] == k] for k in ks}
    p2 = {
        str(k): {
            "max_s": spread([r["stats"].get("max_s") for r in rs]),
            "p99_s": spread([r["stats"].get("p99_s") for r in rs]),
            "cycles": spread([r["stats"]["n"] for r in rs]),
            "worst_cpu_s": spread([r["stats"].get("worst_cpu_s") for r in rs]),
            "p99_cpu_s": spread([r["stats"].get("p99_cpu_s") for r in rs]),
            "fetch_threads_started": spread(
                [r.get("fetch_threads_started") for r in rs]
            ),
            "http_to_frozen": spread([r["http_to_frozen"] for r in rs]),
        }
        for k, rs in by_k.items()
    }
    p4 = {
        str(k): {
            "admit_s": spread([r["healthy"]["admit_s"] for r in rs]),
            "landed_s": spread([r["healthy"]["landed_s"] for r in rs]),
            "admit_after_landing_s": spread(
                [r["healthy"].get("admit_after_landing_s") for r in rs]
            ),
            "done_s": spread([r["healthy"]["done_s"] for r in rs]),
            "missed_cycles": spread([r["healthy"].get("missed_cycles") for r in rs]),
            "admitted": sum(r["healthy"]["admit_s"] is not None for r in rs),
            "runs": len(rs),
        }
        for k, rs in by_k.items()
    }
    cached = results["cached_lookup"]
    return {
        "P1": p2.get("1"),
        "P2": p2,
        "P3": {
            "reference_ns": spread(cached["reference_ns"]),
            "try_ensure_ns": spread(cached["try_ensure_ns"]),
            "ensure_prefill_info_ns": spread(cached["ensure_prefill_info_ns"]),
        },
        "P4": p4,
        "P5": [
            {
                "delay_s": r["delay_s"],
                "state": r["state"],
                "scheduler_http": r["scheduler_http"],
                **r["stats"],
            }
            for r in results["slow_rank_lookup"]
        ],
        "P6": [
            {
                "delay_s": r["delay_s"],
                "state": r["state"],
                "scheduler_http": r["scheduler_http"],
                **r["stats"],
            }
            for r in results.get("slow_dp_rank_query", [])
        ],
        "P8": [
            {
                "k": r["k"],
                "in_flight": r["in_flight"],
                "max_s": r["stats"].get("max_s"),
                "scheduler_zmq_ops": r["scheduler_zmq_ops"],
                "healthy_state": r["healthy_state"],
            }
            for r in results.get("frozen_in_flight", [])
        ],
        "P7": {
            ("dp_query" if dp_query else "dp_followed"): {
                "cycles_to_init": spread(
                    [r["cycles_to_init"] for r in rs if r["dp_query"] == dp_query]
                ),
                "init_s": spread(
                    [r["init_s"] for r in rs if r["dp_query"] == dp_query]
                ),
                "failed": sum(
                    r["state"] != "success" for r in rs if r["dp_query"] == dp_query
                ),
            }
            for rs in [results.get("fast_first_contact", [])]
            for dp_query in (False, True)
        },
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON results file")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="1 repeat, 4 s scenarios (stock ~2 min, patched ~1 min)",
    )
    parser.add_argument("--backend", default="mooncake", choices=["mooncake", "nixl"])
    parser.add_argument("--stock-repeats", type=int, default=None)
    parser.add_argument("--duration-s", type=float, default=None)
    parser.add_argument("--period-ms", type=float, default=5.0)
    parser.add_argument("--ks", type=str, default=",".join(map(str, KS)))
    parser.add_argument("--quiet", dest="log", action="store_false")
    args = parser.parse_args(argv)
    args.ks = [int(k) for k in args.ks.split(",")]
    if args.quick:
        args.repeats = 1
        args.stock_repeats = 1
    if args.duration_s is None:
        # Full: two parallel-info attempts against a frozen server (5 s each).
        args.duration_s = 4.0 if args.quick else 10.0

    variant, detected = harness.detect_variant()
    bench = Bench(args, variant)
    bench.variant_detected = detected
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.perf_counter()
    load_before = os.getloadavg()
    run = bench.run()
    import sglang

    doc = {
        "schema": 1,
        "variant": variant,
        "variant_detected": detected,
        "sglang_path": os.path.dirname(sglang.__file__),
        "sglang_version": getattr(sglang, "__version__", None),
        "backend": args.backend,
        "quick": args.quick,
        "config": {
            "repeats": args.repeats,
            "stock_repeats": args.stock_repeats,
            "duration_s": args.duration_s,
            "period_ms": args.period_ms,
            "ks": args.ks,
            **bench.retry_budget,
        },
        "host": {
            "nproc": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "started": started.isoformat(),
        "elapsed_s": time.perf_counter() - t0,
        "setup_s": run["setup_s"],
        "summary": summarize(run["results"]),
        "results": run["results"],
    }
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, args.out)
    bench.say(f"wrote {args.out} in {doc['elapsed_s']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
