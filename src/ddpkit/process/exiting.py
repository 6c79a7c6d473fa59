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

What the teardown does that matters to a script's results is kept: the files it left open are flushed and closed
(``close_files``), as the interpreter's last collection would close them. A script that writes a CSV and never
closes it left a 0-byte file under ``os._exit`` alone.
"""

from __future__ import annotations

import _io
import atexit
import contextlib
import gc
import io
import os
import sys
import threading
from typing import NoReturn

__all__ = [
    "COLLECTIVE_WORDS",
    "PEER_GONE",
    "YIELD_S",
    "caused_by_peer",
    "close_files",
    "collective_failed",
    "flush_files",
    "leave",
    "sys_exit_code",
    "wind_up",
    "yield_to_first_failure",
]

#: The words of a backend's error when a peer of this rank is gone (it exited, was killed, or its host is cut off):
#: gloo's transport (tcp/pair.cc), NCCL's watchdog and abort, and the store's client. Such an error is this rank's
#: failure only because another rank failed first.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused",
             "remote process exited", "NCCL communicator was aborted", "NCCL communicator encountered an error",
             "ProcessGroupNCCL is aborted", "Connection was likely closed")
#: What else a collective that failed says (gloo's and NCCL's own words, their timeouts): with ``PEER_GONE``, how a
#: rank that is not live-healed names a lost peer after the fact (``ddpkit train``'s exit 3). Live healing never
#: reads an exception's text: its agent, which sees every rank's process, says whether a peer was lost.
COLLECTIVE_WORDS = ("gloo", "NCCL", "imed out", "timeout", "pair closure")
#: How long a rank whose failure is a peer's doing waits before it leaves, so that its launcher sees the rank that
#: failed first exit first (torchrun and ddpkit's agent poll every 0.05-0.1 s and then end the others with SIGTERM;
#: mpirun reports the first rank to exit non-zero): without it both exits fell in the same second and torch's root
#: cause, which breaks a tie by rank, named rank 0.
YIELD_S = 2.0


def sys_exit_code(code: object) -> int:
    """What Python's exit does with sys.exit's argument: None is 0, an int is itself, anything else is printed
    and gives 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def caused_by_peer(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a collective's failure because a peer is gone."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        text = str(cause)
        if any(words in text for words in PEER_GONE):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def collective_failed(exc: BaseException) -> bool:
    """Whether ``exc`` reads as a collective's failure (torch's DistBackendError, or gloo's and NCCL's words)."""
    from torch.distributed import DistBackendError

    return isinstance(exc, DistBackendError) or (isinstance(exc, RuntimeError) and any(
        words in str(exc) for words in (*PEER_GONE, *COLLECTIVE_WORDS)))


def yield_to_first_failure(grace: float = YIELD_S) -> None:
    """A rank whose failure is a peer's doing: give the launcher ``grace`` seconds to see that peer's exit (it then
    ends this rank with SIGTERM, and names the peer). Output is flushed first: nothing waits unsaid."""
    import time

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    time.sleep(grace)


def leave(code: int) -> NoReturn:
    """End the process with ``code`` as the interpreter's exit would, without its teardown: the atexit handlers
    (logging's flush among them) run here as the interpreter would run them, then MPI is finalized where mpi4py
    started it (its own MPI_Finalize is a C-level exit hook, Py_AtExit, which os._exit skips: Open MPI then calls
    the job failed), output is flushed, then os._exit. A non-daemon thread still running (a user's --make-job may
    start one) gets the ordinary exit, which waits for it."""
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    wind_up()
    os._exit(code)


def wind_up() -> None:
    """What the interpreter's exit does that matters, without its teardown: the atexit handlers (they run once:
    the list is emptied), the files left open flushed and closed, MPI finalized, the standard streams flushed.
    ``leave`` then ends the process; a rank forked by ddpkit's agent calls it before torch's process wrapper ends
    the process with ``os._exit`` (which would skip all of it)."""
    atexit._run_exitfuncs()
    close_files()
    _finalize_mpi()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more can reach the reader anyway
            stream.flush()


def _open_files() -> list[io.IOBase]:
    """The file objects of this process still open for writing, other than the standard streams: outermost first (a
    text wrapper, then a compressor such as GzipFile, then a buffer, then the raw file), so that closing one
    writes through the layers below it before they close. From the collector's list of every object it tracks
    (0.03 s for the 280,000 objects of a rank that imported torch); ``type(o)`` is read, never ``o.__class__``
    (a deprecated torch object warns when its class is asked)."""
    standard: set[int] = set()
    for stream in (sys.stdin, sys.stdout, sys.stderr, sys.__stdin__, sys.__stdout__, sys.__stderr__):
        layer: object = stream
        while layer is not None and id(layer) not in standard:
            standard.add(id(layer))
            layer = getattr(layer, "buffer", None) or getattr(layer, "raw", None)
    found: list[tuple[int, io.IOBase]] = []
    for obj in gc.get_objects():
        kind = type(obj)
        if not issubclass(kind, _io._IOBase) or id(obj) in standard:
            continue
        try:
            if obj.closed or not obj.writable():
                continue
        except (ValueError, OSError, AttributeError):  # detached, or a file-like object half built
            continue
        depth = (0 if issubclass(kind, io.TextIOBase) else
                 1 if issubclass(kind, io.BufferedIOBase) and kind.__module__ != "_io" else
                 2 if issubclass(kind, io.BufferedIOBase) else 3)
        found.append((depth, obj))
    return [obj for _, obj in sorted(found, key=lambda item: item[0])]


def close_files() -> None:
    """Flush and close every file the process left open for writing (the standard streams are flushed by the
    caller, never closed): what the interpreter's teardown would do when it frees them. A file that cannot be
    written now (a full disk, a closed pipe) is skipped, as the interpreter's finalizer ignores the error."""
    for obj in _open_files():
        with contextlib.suppress(Exception):
            obj.close()


def flush_files() -> None:
    """Flush, without closing, every file the process has open for writing: for a rank that must leave while its
    main thread may still be using them (the watch's abort)."""
    for obj in _open_files():
        with contextlib.suppress(Exception):
            obj.flush()


def _finalize_mpi() -> None:
    """MPI_Finalize now, where mpi4py initialized MPI and nothing finalized it yet (the MPI transport of ``train``,
    ``bench`` and ``check``, or the user's script): what mpi4py's exit hook would do, as the last MPI call."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
