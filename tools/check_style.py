"""Check that the patch's own lines follow black, without reformatting the base.

The 0.5.23 base files are not stable under current black releases, so black
cannot be run on whole files. Instead: format the base and the patched file
with black, and require that every line the patch adds appears, in order, among
the lines black's diff of the two formatted files adds.
"""

import difflib
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FILES = [
    "common/conn.py",
    "decode.py",
    "nixl/conn.py",
    "mooncake/conn.py",
    "mori/conn.py",
]
PREFIX = "python/sglang/srt/disaggregation/"


def _black(src: str) -> str:
    import black

    return black.format_str(src, mode=black.Mode(line_length=88))


def _added(a: str, b: str):
    out = []
    for line in difflib.unified_diff(a.splitlines(), b.splitlines(), lineterm="", n=0):
        if line.startswith("+") and not line.startswith("+++"):
            out.append(line[1:])
    return out


def main() -> int:
    root = subprocess.check_output(
        ["git", "rev-list", "--max-parents=0", "HEAD"], cwd=REPO, text=True
    ).split()[-1]
    bad = 0
    for rel in FILES:
        base = subprocess.check_output(
            ["git", "show", f"{root}:{PREFIX}{rel}"], cwd=REPO, text=True
        )
        patched = (REPO / PREFIX / rel).read_text()
        if base == patched:
            continue
        raw_added = _added(base, patched)
        black_added = set(_added(_black(base), _black(patched)))
        for line in raw_added:
            if line.strip() and line not in black_added:
                print(f"{PREFIX}{rel}: not black-formatted: {line!r}")
                bad += 1
    print("style: ok" if not bad else f"style: {bad} line(s) to fix")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
