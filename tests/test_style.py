"""The patch's own lines in the five sglang files are black-formatted."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_patch_lines_are_black_formatted():
    proc = subprocess.run(
        [sys.executable, str(REPO / "tools" / "check_style.py")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
