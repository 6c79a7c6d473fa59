"""Run an unchanged DDP script under the watch, in this rank's process (what ``ddpkit run`` does in each rank)::

    torchrun --standalone --nproc-per-node 2 -m ddpkit.watch --hang-after 30 -- train.py --epochs 3
    mpirun -np 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29500 python -m ddpkit.watch -- train.py

Under a launcher that sets no RANK / WORLD_SIZE (mpirun, srun), the world is exported from its variables before a
script runs (``runtime.export_world``), so its ``init_process_group()`` with env:// finds it; a module (``-m``)
is left to read its launcher itself.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path
from typing import NoReturn

from ddpkit.errors import DdpkitError
from ddpkit.exiting import exit_code, leave
from ddpkit.watch import WatchOptions, install, sigterm
from ddpkit.watch.options import MIN_STOP_S, ON_HANG

__all__ = ["add_arguments", "main", "options_from_args"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The watch's options, for ``ddpkit run`` and this runner."""
    parser.add_argument("--hang-after", type=float, default=None, metavar="S",
                        help="seconds with no progress on any rank before the hang report (default: adaptive, "
                             "at least 60 s and twice the slowest stretch seen; x5 until the first step ends); "
                             "given without --stop-after, every rank also stops then")
    parser.add_argument("--stop-after", type=float, default=None, metavar="S",
                        help="under --on-hang abort: seconds with no progress on any rank before every rank stops "
                             f"(exit 3), never before the report (default: {MIN_STOP_S:g} s, or the report's "
                             "deadline when longer; with --hang-after alone: at the report)")
    parser.add_argument("--on-hang", choices=ON_HANG, default="abort",
                        help="abort: report, then every rank stops (exit 3) after --stop-after; report: report "
                             "and keep waiting")
    parser.add_argument("--report-every", type=float, default=60.0, metavar="S",
                        help="seconds between straggler checks (default 60)")
    parser.add_argument("--events", type=Path, default=None, metavar="PATH",
                        help="append one JSON line per report (hang, straggler, summary) to PATH")


def options_from_args(args: argparse.Namespace) -> WatchOptions:
    """The watch's options from ``add_arguments``' flags; ConfigError for a bad value (pure: a parent process
    checks them before any rank starts)."""
    return WatchOptions(hang_after=args.hang_after, stop_after=args.stop_after, on_hang=args.on_hang,
                        report_every=args.report_every, events=args.events)


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the watch's own arguments, the script and its arguments / the module's arguments): everything after
    ``--``, after ``-m MODULE``, or from the first word that is not an option of ours, belongs to the program."""
    valued = {"--hang-after", "--stop-after", "--on-hang", "--report-every", "--events"}
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return argv[:i], argv[i + 1:]
        if word == "-m":
            return argv[:i + 2], argv[i + 2:]
        if word in valued:
            i += 2
        elif word.startswith("-"):
            i += 1
        else:
            return argv[:i], argv[i:]
    return argv, []


def _export_world() -> None:
    if "RANK" in os.environ:
        return
    from ddpkit.env import detect
    from ddpkit.runtime import export_world

    info = detect()
    if info.world_size > 1:
        export_world(info)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddpkit.watch", description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("-m", dest="module", metavar="MODULE", help="run a module (as python -m) instead of a script")
    parser.add_argument("target", nargs="?", metavar="[--] SCRIPT ARGS", help="the script and its arguments")
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, rest = _split(argv)
    args = parser.parse_args(ours)
    if args.module is None and not rest:
        parser.error("no script given (expected: python -m ddpkit.watch [options] -- SCRIPT [ARGS])")
    try:
        options = options_from_args(args)
        if args.module is None and not Path(rest[0]).is_file():
            parser.error(f"script {rest[0]!r} not found (expected a Python file; check the path)")
        if args.module is None:  # a module such as ddpkit reads its launcher itself
            _export_world()
        install(options)
        sigterm.install()  # the launcher ending this rank: first name a rank on this host that is gone
    except DdpkitError as exc:
        print(f"ddpkit: error: {exc}", file=sys.stderr)
        return exc.exit_code
    if args.module is not None:
        sys.argv = [args.module, *rest]
        runpy.run_module(args.module, run_name="__main__", alter_sys=True)
        return 0
    sys.argv = list(rest)
    sys.path.insert(0, str(Path(rest[0]).resolve().parent))
    runpy.run_path(rest[0], run_name="__main__")
    return 0


def program() -> NoReturn:
    """``python -m ddpkit.watch``: the script's own exit code (``sys.exit`` included), then the prompt exit that
    ``ddpkit run`` takes (``exiting.leave``: torch 2.13's gloo can abort a rank that succeeded in the interpreter's
    teardown). An exception the script raises leaves as Python leaves with one: its traceback, exit 1."""
    try:
        code = main()
    except SystemExit as exc:
        code = exit_code(exc.code)
    leave(code)


if __name__ == "__main__":
    program()
