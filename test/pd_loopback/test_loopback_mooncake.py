"""Real PD over 127.0.0.1 with the Mooncake backend: healthy transfer, a frozen,
slow or 5xx prefill bootstrap server, each against a healthy one. The cases
live in loopback_cases.py; the harness and its set-up requirements
(libibverbs1, the loopback environment) are described in harness.py.

Run: PYTHONPATH=<sglang variant dir>:<repo> python3 test/pd_loopback/test_loopback_mooncake.py
"""

import os
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from loopback_cases import LoopbackCases  # noqa: E402
from sglang.test.ci.ci_register import register_cpu_ci  # noqa: E402
from sglang.test.test_utils import CustomTestCase  # noqa: E402

register_cpu_ci(est_time=120, suite="pd-loopback-cpu")


class TestLoopbackMooncake(LoopbackCases, CustomTestCase):
    BACKEND = "mooncake"


if __name__ == "__main__":
    unittest.main()
