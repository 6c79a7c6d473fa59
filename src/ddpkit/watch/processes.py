"""The processes on this host, as the watch sees and ends them: a rank's state from /proc (no signal sent), every
thread's Python stack, and the two ways a rank is ended (exit 3 after a report; SIGCONT then SIGKILL for a stopped
peer)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import NoReturn

from ddpkit.base.errors import EXIT_MISSING
from ddpkit.process.exiting import flush_files
from ddpkit.process.worker_context import process_started_at
from ddpkit.watch.frames import user_frames

__all__ = ["STACK_WAIT_S", "end_stopped", "ended_by_watch", "listening_pid", "process_state", "python_stacks",
           "stop_rank", "write_lines"]

#: How long the reporter waits for the live ranks' stacks, for the others to see the abort, and for a stopped rank
#: to go once sent SIGCONT.
STACK_WAIT_S = 3.0
#: The longest a rank stopped by the watch spends flushing the script's open files before it exits.
FLUSH_WAIT_S = 2.0
#: How long a rank's mark that the watch ended it is kept on its host (``ended_by_watch``).
MARK_KEEP_S = 86400.0

#: Frames of the runner (runpy, ``python -m ddpkit.watch``) that only say how the script was started.
_LAUNCH = ("<frozen runpy>", os.path.join(os.path.dirname(__file__), "__main__.py"))
_PACKAGE = os.path.dirname(os.path.dirname(__file__))
#: The files a rank starts through before the command's or the user's own code: a stack begins after the last of
#: them (ddpkit's agent's worker, the command line, ``ddpkit run``'s runner).
_RUNNERS = frozenset(os.path.join(_PACKAGE, *parts) for parts in
                     (("launch", "worker.py"), ("cli.py",), ("lifecycle", "__init__.py"), ("run", "__init__.py"),
                      ("watch", "__main__.py")))


def process_state(pid: int) -> str:
    """``gone``, ``stopped`` or ``running``, for a process on this host (from /proc: no signal sent)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except OSError:
        return "gone"
    return {"Z": "gone", "X": "gone", "T": "stopped", "t": "stopped"}.get(state, "running")


def listening_pid(port: int) -> int | None:
    """The process on this host that listens on TCP ``port`` (the job's store: its holder), from /proc (no signal,
    no connection: a stopped holder does not answer one); None when none here, or when it is not this user's to see.
    A forked child (a DataLoader worker) inherits the socket: the holder is the one whose parent does not hold it."""
    sockets = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()  # sl local_address rem_address st ... inode
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rpartition(":")[2], 16) == port:
                sockets.add(f"socket:[{fields[9]}]")
    if not sockets:
        return None
    holders: dict[int, int] = {}  # pid -> its parent
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if any(os.readlink(fd.path) in sockets for fd in os.scandir(f"/proc/{entry.name}/fd")):
                with open(f"/proc/{entry.name}/stat", encoding="ascii", errors="replace") as f:
                    holders[int(entry.name)] = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    first = [pid for pid, parent in holders.items() if parent not in holders]
    return first[0] if len(first) == 1 else None


def python_stacks() -> str:
    """Every thread's Python stack in this process but the watch's own threads, without the watch's wrappers of
    torch's functions (``sys._current_frames``: it needs the GIL, which a rank waiting in a collective has
    released)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == me or names.get(ident, "").startswith("ddpkit-watch"):
            continue
        frames = [f for f in user_frames(traceback.extract_stack(frame)) if not f.filename.startswith(_LAUNCH)]
        # the command's or the user's frames: after the runner's (a script under ``ddpkit run`` begins at its own)
        starts = [i for i, f in enumerate(frames) if f.filename in _RUNNERS]
        frames = frames[starts[-1] + 1:] if starts else frames
        parts.append(f"  Thread {names.get(ident, '?')} ({ident:#x}), most recent call last:\n"
                     + "".join("    " + line for line in "".join(traceback.format_list(frames)).splitlines(True)))
    return "".join(parts)


def write_lines(lines: list[str]) -> None:
    """The watch's lines on the process's own stderr (``Monitor.emit`` says why not ``sys.stderr``), in one write
    with their last newline: ``print`` writes that newline apart, and another process's line on the same stream (a
    launcher's agent shares it with its ranks) ran into the report's last line between the two."""
    stream = sys.__stderr__ or sys.stderr
    stream.write("\n".join(lines) + "\n")
    stream.flush()


def _ended_mark(pid: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"ddpkit-watch-{os.getuid()}", f"ended.{pid}")


def ended_by_watch(pid: int) -> bool:
    """Whether the process ``pid`` on this host, gone now, was a rank the watch ended (``stop_rank``: exit 3), from
    the mark it left. A mark older than this process is another job's (a pid used again)."""
    try:
        return os.stat(_ended_mark(pid)).st_mtime >= process_started_at()
    except OSError:
        return False


def _leave_ended_mark() -> None:
    """This rank is ending by the watch's order: a mark on this host, for a peer that outlives it (mpirun sends a
    stopped rank 0 SIGCONT before SIGTERM; its report would call this rank merely gone)."""
    path = _ended_mark(os.getpid())
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="ascii") as f:
            f.write(f"{time.time():.3f}\n")
        old = time.time() - MARK_KEEP_S
        for entry in os.scandir(os.path.dirname(path)):  # the marks of jobs long over
            if entry.stat().st_mtime < old:
                os.unlink(entry.path)


#: What this rank writes before the watch ends it with ``os._exit``: its last goodput lines (``watch.steplines``
#: registers them). Every way the watch stops a rank goes through ``stop_rank``, so no exit path loses them.
LAST_WORDS: list[Callable[[], None]] = []


def _last_words() -> None:
    for write in list(LAST_WORDS):
        with contextlib.suppress(Exception):  # a file that cannot be written must not keep the rank
            write()
    flush_files()


def stop_rank(line: str | None) -> NoReturn:
    """End this rank with exit 3 (EXIT_MISSING), after ``line`` on stderr: ``os._exit``, since a thread blocked in C
    (the rank's main thread in a collective) cannot hold the process then. A mark on this host says so to a peer
    that outlives it (``ended_by_watch``)."""
    _leave_ended_mark()
    if line is not None:
        write_lines([line])
    # what the script wrote to its files so far reaches them (not closed: its main thread may still hold them); on
    # a thread of its own, bounded: a write stuck on a full pipe must not keep the rank
    flushing = threading.Thread(target=_last_words, name="ddpkit-flush", daemon=True)
    flushing.start()
    flushing.join(timeout=FLUSH_WAIT_S)
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
    os._exit(EXIT_MISSING)


def end_stopped(pids: list[int]) -> None:
    """Stopped ranks on this host: SIGCONT (each then sees the abort and exits 3 itself), SIGKILL after
    STACK_WAIT_S for any still there (as NVRx's rank monitor does: SIGCONT, then SIGKILL)."""
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGCONT)
    until = time.monotonic() + STACK_WAIT_S
    while time.monotonic() < until and any(process_state(p) != "gone" for p in pids):
        time.sleep(0.1)
    for pid in pids:
        if process_state(pid) != "gone":
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
