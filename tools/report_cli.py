"""The command line the stock-vs-patched bench reports share.

    python3 tools/<report>.py --stock stock.json --patched patched.json --out report.md

writes report.md and the report's plot next to it.
"""

from __future__ import annotations

import argparse
import json
import os


def load(path):
    with open(path) as f:
        return json.load(f)


def compare_main(argv, png_name: str, plot, report) -> int:
    """``plot(stock, patched, png_path)``; ``report(stock, patched, png_name)``
    returns the markdown."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--stock", required=True)
    ap.add_argument("--patched", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    stock, patched = load(args.stock), load(args.patched)
    png = os.path.join(os.path.dirname(os.path.abspath(args.out)), png_name)
    plot(stock, patched, png)
    with open(args.out, "w") as f:
        f.write(report(stock, patched, png_name))
    return 0
