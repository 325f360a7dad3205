"""Command line: ``sglang-pd-patch {install,uninstall,status,export}``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import core, export, series


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--sglang-dir",
        metavar="DIR",
        help="the sglang package directory to act on (default: the sglang "
        "installed for this Python interpreter)",
    )
    common.add_argument(
        "--patched-dir",
        metavar="DIR",
        help="take the patched files from DIR, laid out as <rel> (default: "
        f"${core.PATCHED_DIR_ENV}, else the checkout's "
        f"{core.REPO_DISAGG_SUBDIR}, else the copies shipped in this package)",
    )
    dry = argparse.ArgumentParser(add_help=False)
    dry.add_argument(
        "--dry-run", action="store_true", help="print what would change, change nothing"
    )
    parser = argparse.ArgumentParser(
        prog=core.PROG,
        description="Install the sglang 0.5.23 prefill/decode disaggregation patch "
        "into an installed sglang, check it, remove it, or export it as a diff.",
    )
    parser.add_argument("--version", action="version", version=core.TOOL_VERSION)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "install", parents=[common, dry], help="replace the files with the patched ones"
    )
    sub.add_parser(
        "uninstall", parents=[common, dry], help="restore the stock files from backup"
    )
    sub.add_parser("status", parents=[common], help="show the state of every file")
    exp = sub.add_parser(
        "export",
        parents=[common],
        help="print the patch as a git diff against sglang v0.5.23",
    )
    exp.add_argument("-o", "--output", metavar="FILE", help="write to FILE, not stdout")
    exp.add_argument(
        "--series",
        metavar="DIR",
        help="write the patch as an ordered series of git format-patch files, one "
        "concern each, plus DIR/series (from a clean checkout whose patches/ "
        "gives its files)",
    )
    return parser


def _export_series(args: argparse.Namespace) -> int:
    checkout = core.find_checkout()
    if checkout is None:
        raise core.PatchError(
            "export --series needs a checkout of sglang-pd-patch (its patches/ "
            "directory): run it from one"
        )
    patches = series.export_series(Path(args.series), checkout)
    for patch in patches:
        print(f"{args.series}/{patch.name}")
    print(f"{args.series}/series: {len(patches)} patches", file=sys.stderr)
    return core.EXIT_OK


def _export(args: argparse.Namespace) -> int:
    if args.series:
        return _export_series(args)
    sglang_dir = None
    if args.sglang_dir is not None:
        sglang_dir = core.find_sglang_dir(args.sglang_dir)
    else:
        try:
            sglang_dir = core.find_sglang_dir()
        except core.PatchError:
            sglang_dir = None  # pristine bytes then come from git
    data = export.build_export(sglang_dir, args.patched_dir)
    if args.output:
        Path(args.output).write_bytes(data)
        print(f"wrote {args.output} ({len(data)} bytes)", file=sys.stderr)
    else:
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    return core.EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "export":
            return _export(args)
        if args.command == "status":
            return core.status(args.sglang_dir, args.patched_dir)
        func = core.install if args.command == "install" else core.uninstall
        return func(args.sglang_dir, args.patched_dir, dry_run=args.dry_run)
    except core.PatchError as err:
        print(f"{core.PROG} {args.command}: {err}", file=sys.stderr)
        return err.code
    except KeyboardInterrupt:
        print(
            f"\n{core.PROG} {args.command}: interrupted. Every file is either stock "
            f"or patched; run `{core.PROG} status` to see which, then "
            f"`{core.PROG} install` to finish or `{core.PROG} uninstall` to revert.",
            file=sys.stderr,
        )
        return 130
