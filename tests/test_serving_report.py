"""Bench F's report (tools/serving_report.py): patched over stock on the median
of the rounds, each goal marked met or not."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import serving_report  # noqa: E402


def _run(path: Path, ttft: float, throughput: float) -> None:
    phase = {
        "completed": 30,
        "median_ttft_ms": ttft,
        "p99_ttft_ms": 2 * ttft,
        "median_itl_ms": 5.0,
        "p99_itl_ms": 9.0,
        "request_throughput": throughput,
    }
    path.mkdir(parents=True)
    result = {"serving": {"half": phase, "saturation": phase}, "serving_capacity": 2}
    (path / "result.json").write_text(json.dumps(result))


def test_the_median_of_the_rounds_decides(tmp_path):
    # Round 1 patched is slower, round 2 faster: the median ratio is 1.0.
    for i, (stock, patched) in enumerate(((100.0, 150.0), (100.0, 50.0))):
        _run(tmp_path / f"round{i + 1}" / "stock", stock, 2.0)
        _run(tmp_path / f"round{i + 1}" / "patched", patched, 2.0)
    text = serving_report.report(tmp_path)
    assert "| TTFT median (ms) | 100.00 | 150.00 | 100.00 | 50.00 | 1.00 met |" in text
    assert text.rstrip().endswith("Every goal met.")


def test_a_slower_ttft_and_a_lower_throughput_are_not_met(tmp_path):
    _run(tmp_path / "round1" / "stock", 100.0, 2.0)
    _run(tmp_path / "round1" / "patched", 120.0, 1.8)
    text = serving_report.report(tmp_path)
    assert "| TTFT median (ms) | 100.00 | 120.00 | 1.20 NOT met |" in text
    assert "| throughput (req/s) | 2.00 | 1.80 | 0.90 NOT met |" in text
    assert "Missed: half TTFT median (ms) (1.20)" in text
