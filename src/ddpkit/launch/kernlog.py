"""The kernel's word on a rank killed by SIGKILL: the OOM killer's line for its pid, where the kernel log can be read.

A rank the OOM killer ends leaves no traceback, only exit -9 (pytorch/pytorch#54823: "a mystery"). The kernel says
it in its log (``/dev/kmsg``, what ``dmesg`` reads):

    Out of memory: Killed process 4321 (python) total-vm:..., anon-rss:..., UID:0 pgtables:...kB oom_score_adj:0
    Memory cgroup out of memory: Killed process 4321 (python) total-vm:..., anon-rss:..., ...
    oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,...,task=python,pid=4321,uid=0

Where the log cannot be read (``kernel.dmesg_restrict``, no /dev/kmsg in a container), ``read_kernel_log`` returns
None and nothing is said: no line claims the kernel was silent when it was not asked. Pids are reused, so only a
line after the rank's start is its own (the caller gives the time it knows the pid lived).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable

__all__ = ["oom_kill_line", "oom_line_for", "read_kernel_log"]

#: "Out of memory: Killed process 4321 (python)", "Memory cgroup out of memory: Killed process ...", the older
#: "Out of memory: Kill process 4321 (python) score 900 or sacrifice child"
_KILLED = re.compile(r"(?:^|: )Kill(?:ed)? process (\d+) \(([^)]*)\)")
_OOM_KILL = re.compile(r"^oom-kill:.*\bpid=(\d+)\b")
#: /dev/kmsg's record: "PRIORITY,SEQUENCE,MICROSECONDS,FLAGS;message"; dmesg's: "[  123.456789] message"
_KMSG = re.compile(r"^\d+,\d+,(\d+),[^;]*;(.*)$")
_DMESG = re.compile(r"^\[\s*(\d+)\.(\d+)\]\s?(.*)$")
MAX_RECORDS = 200_000


def _message(line: str) -> tuple[float | None, str]:
    """A kernel log line without its prefix, and its time since boot in seconds where the prefix gives it."""
    found = _KMSG.match(line)
    if found:
        return int(found[1]) / 1e6, found[2]
    found = _DMESG.match(line)
    if found:
        return int(found[1]) + int(found[2]) / 10 ** len(found[2]), found[3]
    return None, line


def oom_kill_line(pid: int, lines: Iterable[str], *, since: float | None = None) -> str | None:
    """The OOM killer's line that killed ``pid`` (the last one, its prefix taken off); None where there is none.
    ``since``: seconds since boot before which a line is another process's that had the same pid."""
    killed: str | None = None
    constraint: str | None = None  # the "oom-kill:" line: said where the "Killed process" line is gone
    for line in lines:
        when, text = _message(line.rstrip("\n"))
        if since is not None and when is not None and when < since:
            continue
        found = _KILLED.search(text)
        if found and int(found[1]) == pid and ("memory" in text.lower() or "total-vm" in text):
            killed = text.strip()
        found = _OOM_KILL.match(text)
        if found and int(found[1]) == pid:
            constraint = text.strip()
    return killed or constraint


def read_kernel_log(path: str = "/dev/kmsg", budget_s: float = 2.0) -> list[str] | None:
    """Every record the kernel still holds, as /dev/kmsg gives them; None where it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    records: list[str] = []
    deadline = time.monotonic() + budget_s
    try:
        while len(records) < MAX_RECORDS and time.monotonic() < deadline:
            try:
                data = os.read(fd, 8192)
            except BlockingIOError:
                break  # every record read
            except BrokenPipeError:
                continue  # the record was overwritten while read: the next one follows
            except OSError:
                return records or None
            if not data:
                break
            records.append(data.decode(errors="replace"))
    finally:
        os.close(fd)
    return records


def uptime() -> float | None:
    """Seconds since boot (the kernel log's clock)."""
    try:
        with open("/proc/uptime") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def oom_line_for(pid: int | None, *, lived_s: float | None = None) -> str | None:
    """The OOM killer's line for ``pid`` on this host, looked up in the kernel log; None where there is none or the
    log cannot be read. ``lived_s``: how long ago the pid is known to have lived at the latest (older lines with
    that pid were another process's)."""
    if pid is None:
        return None
    lines = read_kernel_log()
    if lines is None:
        return None
    now = uptime()
    since = now - lived_s if now is not None and lived_s is not None else None
    return oom_kill_line(pid, lines, since=since)
