"""``ddpkit run``: your own DDP script, unchanged, under any launcher ddpkit reads.

    ddpkit run -n 2 -- train.py --lr 0.1              # no launcher: two local ranks, as torchrun would start them
    mpirun -np 8 ddpkit run -- train.py               # Open MPI, MPICH, MVAPICH2, srun, jsrun, PALS, Flux, Kubeflow
    srun --ntasks-per-node=4 ddpkit run -- train.py
    ddpkit run -n 2 -m -- mypackage.train --epochs 3  # a module, as python -m runs it

A script written for torchrun reads RANK, LOCAL_RANK, WORLD_SIZE, ... and calls ``init_process_group()`` with
torch's ``env://``. Other launchers set other variables (OMPI_COMM_WORLD_RANK, PMI_RANK, SLURM_PROCID, ...), and
seed 004 hand-translates them. Here the launcher is detected (``ddpkit.env.detect``), torch's variables are exported
as ``ddpkit.init()`` exports them (the master, GLOO_SOCKET_IFNAME where the master is on another host, the threads:
``ddpkit.runtime.export_world``; a value the user set that differs is overridden with a warning), and the script
runs as ``__main__`` in this very process: ``sys.argv``, ``sys.path[0]`` and ``__file__`` as Python sets them, the
script's exit code and traceback are the command's. Where no launcher started ddpkit, ``-n``/``-j`` start the ranks
through the same elastic agent as every other command (restarts, the first failure named). The watch
(``ddpkit.watch``, docs/watch.md) is on by default: a rank that stalls is named with its host, every live rank's
stack is printed, and every rank stops (exit 3) instead of waiting out gloo's 30 minutes; ``--no-watch`` turns it
off.
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import traceback
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from ddpkit.base.errors import ConfigError
from ddpkit.base.inputs import program_words
from ddpkit.base.log import get_logger
from ddpkit.process.exiting import caused_by_peer, sys_exit_code, yield_to_first_failure

if TYPE_CHECKING:
    from ddpkit.env.start import RankStart
    from ddpkit.watch.options import WatchOptions

__all__ = ["add_arguments", "check_arguments", "run", "run_target", "watch_options"]

log = get_logger(__name__)

# The script's objects outlive it, as they do when Python runs a script: nothing it made is torn down before the
# process exits. Freed here instead, a DDP model whose process group the script had destroyed drops the group's
# last reference in the Reducer's destructor, whose join of gloo's threads hung 3 runs in 10 of `run -n 2`.
_KEPT: list[object] = []


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-m", "--module", action="store_true",
                   help="the target is a module, run as python -m runs it (sys.path[0] is the working directory)")
    from ddpkit.watch.options import add_arguments as watch_arguments

    g = p.add_argument_group("the watch (docs/watch.md): a hung or slow rank named live, with its host and stacks")
    watch_arguments(g)  # type: ignore[arg-type]
    g.add_argument("--no-watch", action="store_true", help="run the script without the watch")
    p.add_argument("target", nargs=argparse.REMAINDER, metavar="-- SCRIPT.py [ARGS ...]",
                   help="the script (or, with -m, the module) and its arguments, after --")


def _target(args: argparse.Namespace) -> list[str]:
    return program_words(args.target, ConfigError(
        "no script to run", "ddpkit run [options] -- SCRIPT.py [ARGS ...] (or -m -- MODULE ...)",
        "name the script after --, e.g. ddpkit run -n 2 -- train.py"))


def check_arguments(args: argparse.Namespace) -> None:
    """Every input of ``ddpkit run`` checked once, where the command starts, before any rank does: the script (or
    module), the watch's options (``inf``, ``nan``, a negative time), the events file's directory. ConfigError
    (exit 2, one line) for the first that is wrong."""
    words = _target(args)
    _check_target(words[0], args.module)
    if args.no_watch:
        return
    from ddpkit.watch.options import options_from_args

    options_from_args(args)
    if args.events is not None:
        from ddpkit.base.inputs import check_output_path

        events = check_output_path(str(args.events), "--events")
        if not events.parent.is_dir():
            raise ConfigError(f"--events {str(args.events)!r}: the directory {str(events.parent)!r} does not exist",
                              "a file in an existing directory (the watch appends one JSON line per report)",
                              f"create it first (mkdir -p {events.parent}) or choose another --events")


def watch_options(args: argparse.Namespace) -> WatchOptions | None:
    """How the watch runs on each rank (``ddpkit.lifecycle`` installs it before ``run``): on by default, off with
    ``--no-watch``. Under ``--heal live`` it watches across the group's generations (on the live agent's store) and
    names a hung rank to the agent, which replaces it (``ddpkit.watch.actions``)."""
    if args.no_watch:
        return None
    from ddpkit.watch.options import options_from_args

    return options_from_args(args)


def run(args: argparse.Namespace, start: RankStart) -> int:
    """In a rank (its inputs checked and the watch installed by ``ddpkit.lifecycle``): export torch's variables for
    the world the launcher made, then run the script."""
    from ddpkit.runtime import export_world, set_env

    words = _target(args)
    world = export_world(start.world)
    if not world.sources.get("node_rank", "").startswith("unknown"):
        set_env("GROUP_RANK", str(world.node_rank))
    if not world.local_world_known:
        log.info("LOCAL_WORLD_SIZE left unset: %s gives none (torch's env:// does not need it)", world.launcher)
    return run_target(words[0], words[1:], module=args.module, error_file=start.context.error_file)


def _check_target(target: str, module: bool) -> None:
    if module:
        import importlib.util

        try:
            found = importlib.util.find_spec(target)
        except (ImportError, ValueError):
            found = None
        if found is None:
            raise ConfigError(f"no module named {target!r} (working directory {os.getcwd()})",
                              "an importable module, as python -m would find it",
                              "check the name, or install the package that holds it")
        return
    path = Path(target)
    if not path.is_file():
        raise ConfigError(f"no script at {target!r} (working directory {os.getcwd()})",
                          "the path of a Python script every rank can read",
                          "check the path; with -m, name a module instead")


def run_target(target: str, argv: list[str], *, module: bool = False, error_file: str | None = None) -> int:
    """Run a script (or module) as ``__main__`` with ``argv``, as ``python SCRIPT ARGV`` would; returns its exit
    code. An exception it raises is printed as Python prints it, without ddpkit's frames, and gives exit code 1;
    with ``error_file`` (an elastic agent's ``TORCHELASTIC_ERROR_FILE``) it is also written there as torch's
    ``@record`` writes it, unless a peer's failure caused it."""
    saved_argv, saved_path0 = sys.argv, (sys.path[0] if sys.path else None)
    try:
        if module:
            sys.argv = [target, *argv]  # runpy puts the module's file in argv[0], as python -m does
            sys.path.insert(0, os.getcwd())
            _KEPT.append(runpy.run_module(target, run_name="__main__", alter_sys=True))
        else:
            path = os.path.abspath(target)
            sys.argv = [target, *argv]
            sys.path.insert(0, os.path.dirname(path))
            _exec_script(path)
        return 0
    except SystemExit as exc:
        _KEPT.append(exc)  # its traceback holds the script's frames
        return sys_exit_code(exc.code)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # the script's own failure: its traceback, as Python would print it
        _KEPT.append(exc)
        from ddpkit.watch import note_exception

        note_exception(exc)  # a failed collective behind it: the watch names the ranks that are gone, first
        shown = _print_user_traceback(exc, os.path.abspath(target) if not module else None)
        if caused_by_peer(exc):  # another rank failed first: the launcher must see that one go first
            yield_to_first_failure()
        elif error_file:
            _record_for_agent(exc, shown, error_file)
        return 1
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None and sys.path and sys.path[0] != saved_path0:
            sys.path.pop(0)
        sys.stdout.flush()
        sys.stderr.flush()


def _exec_script(path: str) -> None:
    """Run a script file as ``python PATH`` does: a fresh ``__main__`` module (so pickling and multiprocessing in
    the script find its functions), ``__file__`` absolute, ``sys.argv[0]`` as written (runpy.run_path would
    rewrite argv[0] with the path it is given)."""
    import builtins
    import importlib.machinery
    import types

    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __builtins__=builtins, __cached__=None, __spec__=None, __package__=None,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    saved = sys.modules["__main__"]
    sys.modules["__main__"] = main
    _KEPT.append(main)
    try:
        exec(code, main.__dict__)
    finally:
        sys.modules["__main__"] = saved


def _record_for_agent(exc: BaseException, shown: str, path: str) -> None:
    """The exception in torch's error file format (``ErrorHandler.record_exception``): the agent's "Root Cause" box
    shows the rank's traceback and torchrun's digest under ``ddpkit step`` reads it there. Its time is the
    failure's: a rank a peer's failure ended writes none (its later exit keeps it from being taken for the first)."""
    import json
    import time

    data = {"message": {"message": f"{type(exc).__name__}: {exc}",
                        "extraInfo": {"py_callstack": shown, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass  # the agent then says what it always said: exit code 1, no traceback


def _print_user_traceback(exc: BaseException, script: str | None) -> str:
    """Print the exception as Python would, from the user's first frame; return what was printed."""
    tb = exc.__traceback__
    ours = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(runpy.__file__ or ""))
    first = tb
    while first is not None:  # drop ddpkit's and runpy's frames: the traceback starts in the user's code
        name = first.tb_frame.f_code.co_filename
        if (script and os.path.abspath(name) == script) or (not script and not name.startswith(ours)
                                                             and not name.startswith("<frozen")):
            break
        first = first.tb_next
    if first is None and isinstance(exc, SyntaxError):  # the script did not compile: Python shows where, no frames
        text = "".join(traceback.format_exception_only(type(exc), exc))
    else:
        trimmed: TracebackType | None = first if first is not None else tb
        text = "".join(traceback.format_exception(type(exc), exc, trimmed))
    sys.stderr.write(text)
    return text
