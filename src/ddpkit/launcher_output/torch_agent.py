"""torch's agent in a launcher's output (torchrun's, or ddpkit's own, which is torch's): its log line for a failed
worker, its ``ChildFailedError``, its "Root Cause" box (one entry per failed rank), and the two kinds of log line
torch writes (its C++ ``[W1126 13:20:16.502 socket.cpp:207]`` lines, its Python loggers' ``E1126 13:20:37.738
2658 torch/.../api.py:1002]`` lines), which the screen keeps apart from a rank's own words."""

from __future__ import annotations

import re
import socket

from ddpkit.launcher_output.events import Ending, Event, JobFailing, RootCause, WorkerFailed
from ddpkit.launcher_output.tracebacks import TRACEBACK
from ddpkit.launcher_output.words import signal_number

__all__ = ["AGENT_FRAMES", "BoxReader", "cxx_log", "ending_signal", "is_cxx_frame", "job_failing", "torch_log",
           "worker_failed"]

#: torch's C++ stack frames and the line that opens them: hundreds of lines a failure, none of them the user's
_CXX_FRAME = re.compile(r"^\s*(frame #\d+:|Exception raised from .* \(most recent call first\):$)")
#: torch's C++ log lines: "[W1126 13:20:16.502588947 socket.cpp:207] ...", on a rank "[rank1]:[W1126 ...] ..."
_CXX = re.compile(r"^(?:\[rank\d+\]:)?\[[IWEF]\d{4} [\d:.]+ [^\]]+\]\s*(.*)$")
#: torch's Python loggers as torchrun configures them: "E1126 13:20:37.738000 2658 torch/.../api.py:1002] ..."
_TORCH_LOG = re.compile(r"^[IWEF]\d{4} [\d:.]+ \d+ \S+\] (.*)$")
#: the frames that say a traceback is torchrun's own (its agent), not a rank's
AGENT_FRAMES = ("torch/distributed/elastic/", "/bin/torchrun", "torch/distributed/run.py",
                "torch/distributed/launcher/")


def is_cxx_frame(text: str) -> bool:
    """One of torch's C++ stack frames (kept off the screen; it stays in the rank's log file)."""
    return bool(_CXX_FRAME.match(text))


def cxx_log(text: str) -> str | None:
    """The message of one of torch's C++ log lines; None for any other line."""
    found = _CXX.match(text)
    return found[1] if found else None


def torch_log(text: str) -> str | None:
    """The message of one of torch's Python log lines; None for any other line."""
    found = _TORCH_LOG.match(text)
    return found[1] if found else None


_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")


def worker_failed(text: str) -> WorkerFailed | None:
    """torch's agent's "failed (exitcode: N) local_rank: L (pid: P)", in one of its log lines."""
    message = torch_log(text)
    found = _FAILED.search(message) if message is not None else None
    if found is None:
        return None
    return WorkerFailed(local_rank=int(found[2]), pid=int(found[3]), **Ending.of(int(found[1])))


#: torch's agent ending a worker that still runs: "Terminating process P via signal SIGTERM", "Unable to shutdown
#: process P via SIGTERM , forcefully exiting via SIGKILL", "Sending process P closing signal SIGTERM"
_ENDING = re.compile(r"(?:Terminating|Closing|Sending|Unable to shutdown) process (\d+)\b")
_SIGNAL_WORD = re.compile(r"\bSIG[A-Z0-9]+\b")


def ending_signal(message: str) -> tuple[int, int] | None:
    """(pid, signal) of the worker torch's agent is ending, from its log record's message (the last signal it
    names: SIGKILL once SIGTERM's grace period is spent); None for any other message."""
    found = _ENDING.match(message)
    named = _SIGNAL_WORD.findall(message)
    number = signal_number(named[-1]) if named else None
    return (int(found[1]), number) if found and number is not None else None


def job_failing(text: str) -> JobFailing | None:
    return JobFailing(text=text) if "ChildFailedError" in text else None


class BoxReader:
    """torchrun's "Root Cause" box of one source: each entry opened by "[N]:", its fields (time, host, global rank,
    exit code and pid, error file, and the rank's traceback where it wrote torch's error file) one a line."""

    ENTRY = re.compile(r"\[\d+\]:")
    FIELD = re.compile(r"^\s*(time|host|rank|exitcode|error_file|traceback)\s*: ?(.*)$")
    RULE = re.compile(r"[=\-]{20,}")

    def __init__(self, *, localhost_is_here: bool) -> None:
        self._here = localhost_is_here
        self._box: dict[str, str] | None = None
        self._traceback: list[str] | None = None

    def read(self, text: str) -> list[Event]:
        stripped = text.strip()
        if self.ENTRY.fullmatch(stripped):
            done = self.done()
            self._box, self._traceback = {}, None
            return done
        if self._box is None:
            return []
        if self._traceback is not None:  # the traceback field's lines, indented by the box
            if stripped and text.startswith("  ") and not self.RULE.fullmatch(stripped):
                self._traceback.append(text[2:])
                return []
            return self.done()
        found = self.FIELD.match(text)
        if not found or (found[1] == "traceback" and found[2].strip() != TRACEBACK):
            return self.done()
        if found[1] == "traceback":
            self._traceback = [TRACEBACK]
        else:
            self._box[found[1]] = found[2].strip()
        return []

    def done(self) -> list[Event]:
        """The entry being read, ended (by the next line, or by the end of the output)."""
        if self._box is None:
            return []
        box, self._box = self._box, None
        traceback, self._traceback = "\n".join(self._traceback or []), None
        rank = re.match(r"(\d+)", box.get("rank", ""))
        code = re.match(r"(-?\d+)(?: \(pid: (\d+)\))?", box.get("exitcode", ""))
        if not (rank and code):
            return []
        host = box.get("host")
        if host == "localhost" and self._here:  # a standalone torchrun's box: the agent is here
            host = socket.gethostname().split(".", 1)[0]
        return [RootCause(rank=int(rank[1]), host=host, pid=int(code[2]) if code[2] else None,
                          time=box.get("time", ""), traceback=traceback, **Ending.of(int(code[1])))]
