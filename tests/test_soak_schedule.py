"""The chaos soak's fault schedule (tools/soak_pd.py): reproducible from its
seed, and never both prefills down at once unless --both."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import soak_pd  # noqa: E402


def _overlap(a: dict, b: dict) -> bool:
    return (
        a["start"] < b["start"] + b["duration"]
        and b["start"] < a["start"] + a["duration"]
    )


@pytest.mark.parametrize("minutes", [3, 10, 30])
def test_same_arguments_same_schedule(minutes):
    for seed in range(20):
        assert soak_pd.make_schedule(minutes, seed) == soak_pd.make_schedule(
            minutes, seed
        )
    assert soak_pd.make_schedule(minutes, 1) != soak_pd.make_schedule(minutes, 2)


@pytest.mark.parametrize("minutes", [3, 10, 30])
def test_never_both_down_and_one_fault_per_prefill_at_a_time(minutes):
    total = minutes * 60
    for seed in range(50):
        faults = soak_pd.make_schedule(minutes, seed)
        assert faults and faults[0]["kind"] == "kill_restart"
        longest = {"slow": soak_pd.SLOW_S[1], "kill_restart": soak_pd.RESTART_RESERVE_S}
        for f in faults:
            assert f["duration"] <= longest.get(f["kind"], soak_pd.FREEZE_S[1]), f
            assert soak_pd.LEAD_S <= f["start"]
            assert f["start"] + f["duration"] <= total - soak_pd.TAIL_S + 0.1
        for a, b in itertools.combinations(faults, 2):
            if not _overlap(a, b):
                continue
            assert a["target"] != b["target"], (seed, a, b)
            down = soak_pd.DOWN_KINDS
            assert not (a["kind"] in down and b["kind"] in down), (seed, a, b)


def test_ten_minutes_hold_every_kind_on_both_prefills():
    faults = soak_pd.make_schedule(10, 1)
    assert {f["kind"] for f in faults} == set(soak_pd.KINDS)
    assert {f["target"] for f in faults} == set(soak_pd.PREFILLS)


def test_both_lets_down_faults_overlap():
    overlapping = 0
    for seed in range(50):
        faults = soak_pd.make_schedule(10, seed, both=True)
        for a, b in itertools.combinations(faults, 2):
            down = soak_pd.DOWN_KINDS
            if _overlap(a, b) and a["kind"] in down and b["kind"] in down:
                assert a["target"] != b["target"]
                overlapping += 1
    assert overlapping > 0
