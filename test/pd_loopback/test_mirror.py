"""The fault matrix's sick-decode rows (12-14) on real PD over loopback,
Mooncake: on the prefill, a decode that is frozen, frozen before the prefill
ever sent to it, or not reading its control socket delays no healthy decode's
transfer, and its own rooms end, failed with an error naming it, within the
bound.

One prefill and four decodes (mirror.py), every decode's rooms on the same
0.5.23 queue of two (SGLANG_DISAGGREGATION_QUEUE_SIZE=2), so that stock's
healthy decode waits 30-60 s; the patched prefill's two transfer workers take
turns over the decodes. Mooncake's transfer timeout is shortened to keep the
rows short. ``python3 dev.py faults`` runs these rows against stock too, and
bench P16 (``python3 dev.py bench --only mirror``) with the default bounds and
NIXL.

Run: PYTHONPATH=<sglang variant dir>:<repo> python3 test/pd_loopback/test_mirror.py
"""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import mirror  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402
from sglang.test.test_utils import CustomTestCase  # noqa: E402

register_cpu_ci(est_time=90, suite="pd-loopback-cpu")

# A healthy transfer takes milliseconds here; one behind a stuck decode 30-60 s.
HEALTHY_BOUND_S = 1.0
# A sick room ends within its bound, plus the prefill's hold (1 s) and slack
# for this 2-core machine.
SLACK_S = 4.0


class TestMirrorMooncake(CustomTestCase):
    BACKEND = "mooncake"

    @classmethod
    def setUpClass(cls):
        cls.cluster = mirror.MirrorCluster(
            cls.BACKEND, mirror.ROW_DECODES, env=mirror.ROW_ENV
        ).__enter__()

    @classmethod
    def tearDownClass(cls):
        cls.cluster.__exit__(None, None, None)

    def run_row(self, number: int) -> dict:
        name, title, fault, sick, knob, bound_s = mirror.ROWS[number - 12]
        r = mirror.run_fault(self.cluster, fault, sick, "B", mirror.ROW_WINDOW_S)
        self.cluster.decodes[sick].kill()
        during = r["during"]
        self.assertTrue(during)
        for d in during:
            self.assertEqual(d["state"], "success", d)
            self.assertTrue(d["kv_ok"], d)
            self.assertLess(d["latency"], HEALTHY_BOUND_S, d)
        if knob is not None:
            info = self.cluster.decodes[sick].ready_info()
            # Named by its session (Mooncake) or its rank endpoint.
            names = (info["session_id"], f"{mirror.HOST}:{info['rank_port']}")
            for room in r["sick"]:
                self.assertEqual(room["pstatus"], "Failed", room)
                self.assertTrue(any(n in room["perror"] for n in names), room)
                self.assertLess(room["ended_after"], bound_s + SLACK_S, room)
            self.assertIn(knob, r["sick"][0]["perror"])
        return r

    def test_12_decode_frozen(self):
        self.run_row(12)

    def test_13_decode_frozen_before_first_transfer(self):
        self.run_row(13)

    def test_14_decode_not_reading(self):
        r = self.run_row(14)
        # Its transfers succeed; it only never hears so (its own timeout ends
        # them on its side).
        self.assertEqual([room["pstatus"] for room in r["sick"]], ["Success"] * 2)


if __name__ == "__main__":
    unittest.main()
