"""How a ddpkit process leaves once its work is done: the atexit handlers and a flush, then ``os._exit``.

Once a process has imported torch (and torch._dynamo, which DDP imports), the interpreter's own teardown (module
clean-up, a last garbage collection of millions of objects) takes 1-5 s on a loaded 2-core machine: after the last
line was printed and every result written, the command did not return for that long, in the agent and in every
rank a launcher waits for. And in that teardown torch 2.13's gloo can abort a rank that succeeded: a gloo worker
thread frees the last collective's work (tensors with Python objects) after ``Py_FinalizeEx`` began, takes the GIL,
is ended there, and the forced unwind through a noexcept frame calls ``std::terminate`` ("terminate called without
an active exception", SIGABRT; a core's backtrace: ``ProcessGroupGloo::runLoop`` -> ``~AsyncAllgatherWork`` ->
``decref_pyobject`` -> ``take_gil`` -> ``PyThread_exit_thread``). A 4-rank DDP script here, after printing its
results: 6 runs of 20 ended so under plain torchrun, 0 of 20 under ``torchrun -m ddpkit.watch``, which leaves through
``leave`` (scripts/reliability_teardown.py; pytorch/pytorch#190489; #179291 tried an atexit
``destroy_process_group``, abandoned). A barrier before ``destroy_process_group`` left 1 run in 17, freeing the DDP
model first 5 in 21.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn

__all__ = ["exit_code", "leave"]


def exit_code(code: object) -> int:
    """What Python's exit does with sys.exit's argument: None is 0, an int is itself, anything else is printed
    and gives 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def leave(code: int) -> NoReturn:
    """End the process with ``code`` as the interpreter's exit would, without its teardown: the atexit handlers
    (logging's flush among them) run here as the interpreter would run them, then MPI is finalized where mpi4py
    started it (its own MPI_Finalize is a C-level exit hook, Py_AtExit, which os._exit skips: Open MPI then calls
    the job failed), output is flushed, then os._exit. A non-daemon thread still running (a user's --make-job may
    start one) gets the ordinary exit, which waits for it."""
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()
    _finalize_mpi()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more can reach the reader anyway
            stream.flush()
    os._exit(code)


def _finalize_mpi() -> None:
    """MPI_Finalize now, where mpi4py initialized MPI and nothing finalized it yet (the MPI transport of ``train``,
    ``bench`` and ``check``, or the user's script): what mpi4py's exit hook would do, as the last MPI call."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
