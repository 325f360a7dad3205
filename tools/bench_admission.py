"""P14: a healthy prefill's admission on the decode, against the number of
requests routed to a stuck prefill.

Real servers on this machine, as the demo starts them (tools/demo_pd.py): two
``python -m sglang.launch_server --disaggregation-mode prefill`` and one
``--disaggregation-mode decode`` with the tiny GPT-2, no router. Prefill 2's
scheduler process is SIGSTOPped, as a stuck kernel or an NCCL hang leaves a
GPU server: its HTTP and bootstrap servers keep answering, so the decode's
bootstrap handshake for its requests succeeds and their KV never comes.

Each round freezes it for ``WINDOW_S`` seconds. Two clients send requests
through the healthy prefill 1 back to back, the whole window; N requests are
routed to prefill 2, spread evenly over the window's first half, N = 0, 1x, 4x
and 16x what the decode's KV pool holds (``POOL_REQUESTS``). A PD request is
what the router sends: the same body, with ``bootstrap_host`` /
``bootstrap_port`` / ``bootstrap_room``, to the prefill and to the decode at
once. Then prefill 2 resumes, and the round waits until every request ended.

Measured, per round: the healthy requests' latency at the decode (admission,
the KV transfer and 8 tokens of decode; the prefill is idle, so admission is
what grows), p50 / p90 / max; how the stuck prefill's requests ended; and the
decode's ``#prealloc-req`` / ``#transfer-req`` from its own log lines, the
admission state across the freeze.

Before the rounds, with nothing frozen: the time to first token of
``TTFT_REQUESTS`` requests with a ``LONG_PROMPT``-token prompt (the model's
context is 512), one at a time, streamed from the decode. With
``--allocation-policy prefill_complete`` the decode allocates only once the
prefill is done, so the transfer cannot overlap it: run once per policy.

One variant per run (``python3 dev.py bench --only admission`` runs both):
writes ``--out`` (JSON) and the servers' logs next to it.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_pd import (  # noqa: E402
    DECODE_WAITING_TIMEOUT_S,
    HOST,
    Processes,
    describe_variant,
    free_ports,
    log,
    scheduler_pid,
    server_cmd,
    server_env,
    wait_healthy,
)
from demo_report import quantile  # noqa: E402
from tiny_model import ensure_tiny_gpt2  # noqa: E402

# The decode's pool (demo_pd.server_cmd: --max-total-tokens 4096) over what one
# request holds until its KV arrives: its prompt (~20 tokens) and the 512 tokens
# of decode headroom reserved for it (--num-reserved-decode-tokens, 512).
POOL_TOKENS = 4096
RESERVED_DECODE_TOKENS = 512
PROMPT_WORDS = 16
POOL_REQUESTS = POOL_TOKENS // (PROMPT_WORDS + 4 + RESERVED_DECODE_TOKENS)
MULTIPLES = (0, 1, 4, 16)
WINDOW_S = 20.0
HEALTHY_CLIENTS = 2
DRAIN_CAP_S = 120.0
LEG_TIMEOUT_S = WINDOW_S + DRAIN_CAP_S
LONG_PROMPT = 480
TTFT_REQUESTS = 31

# As the demo's decode (no CUDA host memory to back retracted requests).
DECODE_EXTRA = ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
STATS = re.compile(
    r"pre-allocated usage: ([\d.]+), #prealloc-req: (\d+), #transfer-req: (\d+)"
)


class LogTail(threading.Thread):
    """(monotonic time, pre-allocated usage, #prealloc-req, #transfer-req) of
    each decode stats line, as the decode writes them."""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path = path
        self.samples: List[tuple] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.path.exists() and not self.stop.wait(0.2):
            pass
        with open(self.path, errors="replace") as fh:
            while not self.stop.is_set():
                line = fh.readline()
                if not line:
                    self.stop.wait(0.1)
                    continue
                m = STATS.search(line)
                if m:
                    usage, prealloc, transfer = m.groups()
                    self.samples.append(
                        (time.monotonic(), float(usage), int(prealloc), int(transfer))
                    )

    def between(self, start: float, end: float) -> dict:
        inside = [s for s in self.samples if start <= s[0] <= end]
        return {
            "lines": len(inside),
            "max_preallocated_usage": max((s[1] for s in inside), default=None),
            "max_prealloc_req": max((s[2] for s in inside), default=None),
            "max_transfer_req": max((s[3] for s in inside), default=None),
        }


def pd_request(
    prefill: dict, decode_url: str, rid: str, timeout: float, long: bool = False
) -> dict:
    """One PD request as the router sends it: both legs at once; the row
    times the decode's answer, and with ``long`` its first token (streamed)."""
    rng = random.Random(rid)
    words = "the decode never waits on a prefill that hangs quick brown fox".split()
    body = {
        "rid": rid,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        "bootstrap_host": HOST,
        "bootstrap_port": prefill["bootstrap_port"],
        "bootstrap_room": rng.getrandbits(63),
    }
    if long:
        body["input_ids"] = [rng.randrange(10, 500) for _ in range(LONG_PROMPT)]
    else:
        body["text"] = " ".join(rng.choice(words) for _ in range(PROMPT_WORDS))
    row = {"rid": rid, "prefill": prefill["name"], "t_send": time.monotonic()}

    def first_token(url: str) -> dict:
        try:
            with requests.post(
                url + "/generate",
                json=dict(body, stream=True),
                timeout=(5, timeout),
                stream=True,
            ) as r:
                for line in r.iter_lines():
                    if line.startswith(b"data:") and b"[DONE]" not in line:
                        row["ttft"] = time.monotonic() - row["t_send"]
                        break
                for _ in r.iter_lines():
                    pass
            ok = r.status_code == 200 and "ttft" in row
            return {"status": r.status_code, "outcome": "ok" if ok else "error"}
        except requests.RequestException as e:
            return {"status": None, "outcome": "exception", "error": str(e)[:300]}

    def leg(url: str) -> dict:
        try:
            r = requests.post(url + "/generate", json=body, timeout=(5, timeout))
            try:
                data = r.json()
            except ValueError:
                data = None
            finish = ((data or {}).get("meta_info") or {}).get("finish_reason")
            if r.status_code == 200 and not (
                isinstance(finish, dict) and finish.get("type") == "abort"
            ):
                return {"status": r.status_code, "outcome": "ok"}
            error = finish.get("message") if isinstance(finish, dict) else r.text
            return {
                "status": r.status_code,
                "outcome": "error",
                "error": str(error)[:300],
            }
        except requests.RequestException as e:
            return {"status": None, "outcome": "exception", "error": str(e)[:300]}

    with ThreadPoolExecutor(1) as pool:
        prefill_leg = pool.submit(leg, prefill["url"])
        decode = first_token(decode_url) if long else leg(decode_url)
        row["latency"] = time.monotonic() - row["t_send"]
        row.update(decode)
        row["prefill_leg"] = prefill_leg.result()
    return row


def run_round(servers, decode_url, procs, tail, multiple: int, seed: int) -> dict:
    n_stuck = multiple * POOL_REQUESTS
    pid = scheduler_pid(procs, "prefill2")
    if pid is None:
        raise RuntimeError("no scheduler process of prefill2 found")
    rows: List[dict] = []
    lock = threading.Lock()
    t0 = time.monotonic()
    stop_at = t0 + WINDOW_S
    procs.freeze(pid)
    log(f"round {multiple}x: prefill2's scheduler (pid {pid}) frozen, {n_stuck} to it")

    def healthy_client(c: int) -> None:
        i = 0
        while time.monotonic() < stop_at:
            row = pd_request(servers["prefill1"], decode_url, f"h{seed}-{c}-{i}", 60)
            with lock:
                rows.append(row)
            i += 1

    def stuck_request(i: int) -> None:
        row = pd_request(servers["prefill2"], decode_url, f"s{seed}-{i}", LEG_TIMEOUT_S)
        with lock:
            rows.append(row)

    healthy = [
        threading.Thread(target=healthy_client, args=(c,), daemon=True)
        for c in range(HEALTHY_CLIENTS)
    ]
    for t in healthy:
        t.start()
    stuck = []
    for i in range(n_stuck):
        # Evenly over the window's first half, after the healthy clients began.
        due = t0 + 0.5 + i * (WINDOW_S / 2) / max(1, n_stuck)
        time.sleep(max(0.0, due - time.monotonic()))
        t = threading.Thread(target=stuck_request, args=(i,), daemon=True)
        t.start()
        stuck.append(t)
    time.sleep(max(0.0, stop_at - time.monotonic()))
    t_resume = time.monotonic()
    state = tail.between(t0, t_resume)
    procs.thaw()
    log(f"round {multiple}x: resumed after {t_resume - t0:.1f} s; draining")
    deadline = time.monotonic() + DRAIN_CAP_S
    for t in healthy + stuck:
        t.join(max(0.1, deadline - time.monotonic()))
    open_ = sum(t.is_alive() for t in healthy + stuck)
    with lock:
        done = list(rows)
    h = [r for r in done if r["prefill"] == "prefill1"]
    s = [r for r in done if r["prefill"] == "prefill2"]
    lat = sorted(r["latency"] for r in h if r["outcome"] == "ok")
    result = {
        "multiple": multiple,
        "n_stuck": n_stuck,
        "window_s": WINDOW_S,
        "healthy": {
            "n": len(h),
            "ok": len(lat),
            "p50": quantile(lat, 0.5),
            "p90": quantile(lat, 0.9),
            "max": lat[-1] if lat else None,
            "errors": sorted({r.get("error", "") for r in h if r["outcome"] != "ok"}),
        },
        "stuck": {
            "n": len(s),
            "ok": sum(r["outcome"] == "ok" for r in s),
            "errors": sorted({r.get("error", "") for r in s if r["outcome"] != "ok"}),
            "latency_max": max((r["latency"] for r in s), default=None),
        },
        "open": open_,
        "decode_state_during_freeze": state,
        "drain_s": time.monotonic() - t_resume,
    }
    log(
        f"round {multiple}x: healthy n={len(h)} p50 {result['healthy']['p50']} "
        f"p90 {result['healthy']['p90']} max {result['healthy']['max']}; stuck "
        f"{result['stuck']['ok']}/{len(s)} ok; open {open_}; decode state {state}"
    )
    return result


def run(args, procs: Processes) -> dict:
    variant = describe_variant()
    log(f"variant {variant['label']!r}: sglang from {variant['sglang_dir']}")
    out_dir = args.out.parent / f"{args.out.stem}-logs"
    out_dir.mkdir(parents=True, exist_ok=True)
    model = ensure_tiny_gpt2(args.model_dir)
    env = server_env(args.backend)
    p1, b1, p2, b2, dport = free_ports(5)
    extra = ["--disable-radix-cache", "--disaggregation-bootstrap-port"]
    servers = {
        "prefill1": {"name": "prefill1", "port": p1, "bootstrap_port": b1},
        "prefill2": {"name": "prefill2", "port": p2, "bootstrap_port": b2},
    }
    urls = {}
    for name, s in servers.items():
        cmd = server_cmd(
            model, "prefill", s["port"], args, extra + [str(s["bootstrap_port"])]
        )
        procs.start(name, cmd, env, out_dir / f"{name}.log")
        s["url"] = urls[name] = f"http://{HOST}:{s['port']}"
    decode_env = dict(env)
    # README's setting (below the router's request timeout), as in the demo.
    decode_env["SGLANG_DISAGGREGATION_WAITING_TIMEOUT"] = str(DECODE_WAITING_TIMEOUT_S)
    decode_log = out_dir / "decode.log"
    procs.start(
        "decode",
        server_cmd(model, "decode", dport, args, DECODE_EXTRA),
        decode_env,
        decode_log,
    )
    urls["decode"] = decode_url = f"http://{HOST}:{dport}"
    wait_healthy(urls, procs, timeout=400)
    tail = LogTail(decode_log)
    tail.start()
    for i in range(2):
        for name in servers:
            row = pd_request(servers[name], decode_url, f"warm-{name}-{i}", 60)
            if row["outcome"] != "ok":
                raise RuntimeError(f"warm-up through {name} failed: {row}")
    log("warm-up ok through both prefills")
    ttft_rows = [
        pd_request(servers["prefill1"], decode_url, f"ttft-{i}", 60, long=True)
        for i in range(TTFT_REQUESTS)
    ]
    # The first one pays for the model's first long batch.
    ttfts = [r["ttft"] for r in ttft_rows[1:] if r["outcome"] == "ok"]
    ttft = {
        "prompt_tokens": LONG_PROMPT,
        "n": len(ttft_rows) - 1,
        "ok": len(ttfts),
        "p50": quantile(ttfts, 0.5),
        "p90": quantile(ttfts, 0.9),
        "all": [r.get("ttft") for r in ttft_rows],
    }
    log(f"TTFT, {LONG_PROMPT}-token prompt: p50 {ttft['p50']} p90 {ttft['p90']}")
    rounds = []
    for k, multiple in enumerate(args.multiples):
        rounds.append(run_round(servers, decode_url, procs, tail, multiple, k))
        time.sleep(2.0)
    tail.stop.set()
    return {
        "variant": variant,
        "backend": args.backend,
        "pool_requests": POOL_REQUESTS,
        "healthy_clients": HEALTHY_CLIENTS,
        "decode_waiting_timeout_s": DECODE_WAITING_TIMEOUT_S,
        "allocation_policy": args.allocation_policy,
        "ttft": ttft,
        "rounds": rounds,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="result JSON")
    ap.add_argument("--backend", choices=("mooncake", "nixl"), default="mooncake")
    ap.add_argument("--quick", action="store_true", help="rounds 0x and 4x only")
    ap.add_argument("--ttft-only", action="store_true", help="no rounds")
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument(
        "--allocation-policy",
        choices=("early", "prefill_complete"),
        default="early",
        help="--disaggregation-decode-allocation-policy of every server",
    )
    args = ap.parse_args(argv)
    args.multiples = (0, 4) if args.quick else MULTIPLES
    if args.ttft_only:
        args.multiples = ()
    procs = Processes()

    def on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        result = run(args, procs)
    finally:
        procs.stop_all()
    args.out.write_text(json.dumps(result, indent=1))
    log(f"results in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
