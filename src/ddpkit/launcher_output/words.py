"""The words every dialect shares, each said one way: a signal's name from its number (and back), srun's word for
the signal that ended a task, a list of tasks as srun writes it ("0-1,3"), and a list of ranks as ddpkit says it
("rank 3", "ranks 0-2, 5", "ranks 0, 1" or "ranks 0, 1 and 2")."""

from __future__ import annotations

import signal
from collections.abc import Iterable

__all__ = ["SRUN_SIGNALS", "rank_list", "signal_name", "signal_number", "task_ids"]

#: srun's word for the signal that ended a task (``srun: error: node2: task 1: Killed``): strsignal's words.
SRUN_SIGNALS = {"Killed": signal.SIGKILL, "Terminated": signal.SIGTERM, "Segmentation fault": signal.SIGSEGV,
                "Aborted": signal.SIGABRT, "Bus error": signal.SIGBUS, "Interrupt": signal.SIGINT,
                "Hangup": signal.SIGHUP}


def signal_name(number: int) -> str:
    """``SIGKILL`` for 9; ``signal 40`` for a number Python has no name for (a real-time signal)."""
    return signal.Signals(number).name if number in signal.Signals._value2member_map_ else f"signal {number}"


def signal_number(name: str | None) -> int | None:
    """The number of ``SIGKILL`` or ``signal 40`` (``signal_name``'s words); None for None or a word it is not."""
    if not name:
        return None
    if name.startswith("signal ") and name[7:].isdigit():
        return int(name[7:])
    member = signal.Signals.__members__.get(name)
    return int(member) if member is not None else None


def task_ids(text: str) -> list[int]:
    """srun's list of tasks: ``0-1,3`` -> [0, 1, 3]."""
    ids: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        if first.isdigit():
            ids += range(int(first), int(last if last.isdigit() else first) + 1)
    return ids


def rank_list(ranks: Iterable[int], *, spans: bool = True, sentence: bool = False) -> str:
    """``rank 3``; several: ``ranks 0-10, 12-15`` (``spans``), else each named, ``ranks 0, 1``; ``sentence``: each
    named, two or three as a sentence says them, ``ranks 0, 1 and 2`` (the watch's reports), more as a list."""
    ordered = sorted(set(ranks))
    if sentence and 1 < len(ordered) < 4:
        return f"ranks {', '.join(map(str, ordered[:-1]))} and {ordered[-1]}"
    if not spans or sentence:
        return f"rank {ordered[0]}" if len(ordered) == 1 else f"ranks {', '.join(map(str, ordered))}"
    runs: list[list[int]] = []
    for r in ordered:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    words = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank{'s' if len(ordered) > 1 else ''} {words}"
