"""Markdown report and plot from two tools/bench_mirror.py results (P16).

    python3 tools/bench_mirror_report.py --stock stock.json \\
        --patched patched.json --out report.md

Writes report.md and mirror.png next to it. Needs only the standard library
and matplotlib.
"""

from __future__ import annotations

import os

from report_cli import compare_main

# Goal: the healthy decode's p90 with a sick decode within one decode step (the
# harness steps every 5 ms) of its p90 alone.
CYCLE_S = 0.005
TITLES = {
    "frozen": "A frozen (SIGSTOP) after the prefill's first transfer to it",
    "frozen_first_contact": "A frozen before the prefill's first transfer to it",
    "not_reading": "A alive, not reading its control socket",
}


def p90(values):
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return values[min(len(values) - 1, int(0.9 * len(values)))]


def ms(x):
    return "-" if x is None else f"{1e3 * x:.1f} ms" if x < 1 else f"{x:.2f} s"


def row_figures(fault):
    during = [d["latency"] for d in fault["during"]]
    alone_p90, during_p90 = p90(fault["alone"]), p90(during)
    served = sum(1 for d in during if d is not None)
    ended = [s["ended_after"] for s in fault["sick"]]
    met = (
        during_p90 is not None
        and alone_p90 is not None
        and served == len(during)
        and during_p90 <= alone_p90 + CYCLE_S
    )
    return {
        "alone": f"{ms(alone_p90)}",
        "during": f"{ms(during_p90)} / {ms(max(filter(None, during), default=None))}",
        "served": f"{served} of {len(during)}",
        "sick": ", ".join(
            f"{s['pstatus'] or 'open'} at {'-' if e is None else f'{e:.1f} s'}"
            for s, e in zip(fault["sick"], ended)
        ),
        "cores": f"{fault.get('prefill_cores', 0):.2f}",
        "met": met,
    }


def report(stock, patched, png) -> str:
    lines = [
        "# P16: on the prefill, a sick decode against a healthy one",
        "",
        "Real PD over loopback (tools/bench_mirror.py, test/pd_loopback/"
        "mirror.py): one prefill process and four decode processes, real KV "
        "managers in each, KV checked byte for byte. Decode B gets a 16-token "
        "room every 0.5 s while one sick decode has two rooms pending on the "
        "prefill; every decode's rooms go to the same 0.5.23 queue. NIXL runs "
        "over UCX's TCP transport (`UCX_TLS=tcp,self`; on one host UCX would "
        "write into a frozen process through shared memory) with 16384-token "
        "sick rooms, which fill the TCP window. Latency: from the prefill's "
        "`send()` to B's receiver seeing Success.",
        "",
        f"Goal: B's p90 during the fault within one decode step ({CYCLE_S * 1e3:.0f}"
        " ms) of its p90 alone, and every B room served.",
        "",
        "| backend, queues | fault | B's p90 alone | B's p90 / max during | B served "
        "| A's rooms (ended after) | prefill CPU, cores | goal: stock \\| patched |",
        "|---|---|---|---|---|---|---|---|",
    ]
    stock_setups = {(s["backend"], s["queues"]): s for s in stock["setups"]}
    for setup in patched["setups"]:
        key = (setup["backend"], setup["queues"])
        other = stock_setups.get(key, {"faults": []})
        stock_faults = {f["fault"]: f for f in other["faults"]}
        for fault in setup["faults"]:
            p = row_figures(fault)
            s = (
                row_figures(stock_faults[fault["fault"]])
                if fault["fault"] in stock_faults
                else None
            )
            for variant, fig in (("stock", s), ("patched", p)):
                if fig is None:
                    continue
                lines.append(
                    f"| {key[0]}, {key[1]} ({variant}) | {TITLES[fault['fault']]} | "
                    f"{fig['alone']} | {fig['during']} | {fig['served']} | "
                    f"{fig['sick']} | {fig['cores']} | "
                    + ("met" if fig["met"] else "**not met**")
                    + " |"
                )
    lines += [
        "",
        "Prefill CPU is the prefill process's over the fault's window. A's rooms "
        "end as the prefill's sender saw them: both wait on the transport "
        "(Mooncake's MC_TRANSFER_TIMEOUT, 30 s, or 60 s in the handshake of a "
        "first contact; stock's NIXL without bound, patched's NIXL after 30 s "
        "without progress), patched on one transfer worker of its "
        "SGLANG_DISAGGREGATION_QUEUE_SIZE, while the others serve B.",
        "",
        f"![B's latency during each fault]({os.path.basename(png)})",
        "",
    ]
    return "\n".join(lines)


def plot(stock, patched, png) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        (setup["backend"], setup["queues"], fault["fault"])
        for setup in patched["setups"]
        for fault in setup["faults"]
    ]
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(9, 2.4 * len(panels)), squeeze=False
    )
    for ax, (backend, queues, name) in zip(axes[:, 0], panels):
        for doc, style in ((stock, "r."), (patched, "b.")):
            for setup in doc["setups"]:
                if (setup["backend"], setup["queues"]) != (backend, queues):
                    continue
                for fault in setup["faults"]:
                    if fault["fault"] != name:
                        continue
                    points = [
                        (d["t"], d["latency"]) for d in fault["during"] if d["latency"]
                    ]
                    if points:
                        ax.plot(*zip(*points), style, label=doc["variant"])
                    lost = len(fault["during"]) - len(points)
                    if lost:
                        ax.text(
                            0.01,
                            0.92 if doc is stock else 0.8,
                            f"{doc['variant']}: {lost} of {len(fault['during'])} "
                            "not served when the bench stopped waiting",
                            transform=ax.transAxes,
                            fontsize=8,
                            color=style[0],
                        )
        ax.set_yscale("log")
        ax.set_ylabel("B latency, s")
        ax.set_title(f"{backend}, {queues} queue(s): {TITLES[name]}", fontsize=9)
        ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("s after the fault")
    fig.tight_layout()
    fig.savefig(png, dpi=90)


def main(argv=None) -> int:
    return compare_main(argv, "mirror.png", plot, report)


if __name__ == "__main__":
    raise SystemExit(main())
