"""Under ``python -m ddpkit.watch`` (each rank of ``ddpkit run``): when the launcher ends this rank (SIGTERM), the
watch first says which rank on this host is gone, then the rank ends as SIGTERM ends it (exit status -15).

Why: a launcher ends every rank when one dies: torchrun 0.1 s after (its ``--monitor-interval``), mpirun soon after.
A rank whose peer was SIGKILLed (the OOM killer) is then often ended before its collective with that peer failed,
or before the failure reached the watch's report, and the log names no rank with its host (torchrun's own summary
says "local_rank 1, exitcode -9", on host "localhost").

How, without holding a rank its launcher wants gone: the signal's number reaches a thread of the watch at once
(``signal.set_wakeup_fd``), also while the main thread is blocked in a collective (where a Python handler would
wait for the collective to return). That thread runs ``FailureReport.on_terminate`` for at most TERM_GRACE_S, then ends
the process with the default action of SIGTERM. The Python handler does the same when the main thread gets to it
first. Left alone: a script that sets its own SIGTERM handler (it replaces this one, and the watch does nothing on
SIGTERM then), a process where something else holds the wakeup fd (nothing is installed), ``ddpkit.init(watch=True)``
(the user's process, the user's signals), and children (``fork``: the default comes back in the child).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import types
from typing import TYPE_CHECKING, NoReturn

from ddpkit.base.log import get_logger

if TYPE_CHECKING:
    from ddpkit.watch.monitor import Monitor

__all__ = ["TERM_GRACE_S", "install"]

log = get_logger(__name__)
#: The longest a rank told to stop spends on its report before it ends.
TERM_GRACE_S = 2.0

_lock = threading.Lock()
_started = False
_ending = threading.Event()


def install() -> bool:
    """Call on the main thread, before the script runs. False, and nothing changed, when SIGTERM already has a
    handler or the wakeup fd is taken."""
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    r, w = os.pipe()
    os.set_blocking(w, False)  # the C handler must never block
    old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    if old != -1:  # someone's event loop holds it: give it back
        signal.set_wakeup_fd(old)
        os.close(r)
        os.close(w)
        return False
    signal.signal(signal.SIGTERM, _handler)
    threading.Thread(target=_wait, args=(r,), name="ddpkit-watch-sigterm", daemon=True).start()
    os.register_at_fork(after_in_child=_in_child)
    return True


def _wait(r: int) -> None:
    """The watch's thread: every signal with a Python handler writes its number here; SIGTERM, with this handler
    still the one set, ends the rank."""
    while True:
        try:
            data = os.read(r, 64)
        except OSError:
            return
        if not data:
            return
        if signal.SIGTERM in data and signal.getsignal(signal.SIGTERM) is _handler:
            _terminate()


def _handler(signum: int, frame: types.FrameType | None) -> None:
    """On the main thread, between two bytecodes: when that was in the middle of the failure report, the report
    finishes first (its thread cannot wait for itself)."""
    monitor = _monitor()
    if monitor is not None and monitor.failures.writing_here():
        monitor.failures.after_report = _die
        return
    _terminate()


def _terminate() -> None:
    global _started
    with _lock:
        first, _started = not _started, True
    if not first:  # the first caller reports and ends the process; this one waits for that, bounded
        _ending.wait(TERM_GRACE_S + 1.0)
        _die()
    monitor = _monitor()
    if monitor is not None:
        worker = threading.Thread(target=_report, args=(monitor,), name="ddpkit-watch-sigterm-report", daemon=True)
        worker.start()
        worker.join(TERM_GRACE_S)  # a store that does not answer cannot hold the rank
    _ending.set()
    _die()


def _report(monitor: Monitor) -> None:
    lines = monitor.steplines
    if lines is not None:  # the steps this rank ended are the run's goodput (a file of its own: quick)
        lines.beat(final=True)
    try:
        monitor.failures.on_terminate()
    except Exception as exc:  # the store may be gone with the launcher: the rank ends all the same
        log.debug("watch: no report on SIGTERM (%s)", exc)


def _die() -> NoReturn:
    """End the process as SIGTERM's default action does (the launcher reads -15, as without the watch)."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    else:  # signal.signal works on the main thread only; the disposition is the process's, set it in C
        ctypes.CDLL(None).signal(ctypes.c_int(signal.SIGTERM), ctypes.c_void_p(int(signal.SIG_DFL)))
    os.kill(os.getpid(), signal.SIGTERM)
    _ending.wait(1.0)
    os._exit(128 + signal.SIGTERM)  # not reached: the signal ended the process


def _in_child() -> None:
    """A forked child (a DataLoader worker) keeps SIGTERM's default and no wakeup fd: its signals are its own."""
    with contextlib.suppress(Exception):
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _monitor() -> Monitor | None:
    from ddpkit.watch import active

    session = active()
    return session.monitor if session is not None else None
