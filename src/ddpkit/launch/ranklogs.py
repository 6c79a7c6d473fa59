"""Every rank's stdout and stderr in its own files, echoed to the agent's screen line by line; a failed attempt
ends with the digest (``ddpkit.launch.digest``) instead of every rank's traceback.

The run's directory, ``$TMPDIR/ddpkit-run-XXXX/``, holds ``attempt-N/rank-R.stdout.log`` and ``.stderr.log``
(torch's ``LogsSpecs`` puts the workers' streams there, fork or spawn alike). A thread reads them and writes each
whole line to the agent's own stdout or stderr (the same stream the rank wrote), as ``[host:rank] line``, so two
ranks' lines never run together. Off the screen (in the files only): torch's C++ frames, and, from the moment a
rank prints a Python traceback, every rank's stderr: a traceback mostly means the rank is dying, and the others'
secondary tracebacks ("Connection closed by peer") follow. Those lines are held: the digest replaces them when the
attempt fails; they are shown late where it does not fail within ``release_s`` (a traceback that was handled).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO, TextIO

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from ddpkit.launch.digest import TRACEBACK, RankEnd, digest, is_noise
from ddpkit.launch.failure import RankFailure, first_of, logged_failure, ordered, root_cause_line
from ddpkit.launch.kernlog import oom_line_for
from ddpkit.launcher_output.torch_agent import ending_signal

__all__ = ["TAIL_BYTES", "RankLogs", "file_tail"]

#: a rank's stderr log read back for the digest: its end is where the traceback is
TAIL_BYTES = 64 * 1024
HELD_MAX = 20_000


@dataclass
class _Stream:
    rank: int
    path: str
    to_stderr: bool
    file: BinaryIO | None = None
    partial: bytes = b""
    closed: bool = False

    def read(self) -> bytes:
        """What the rank wrote since the last read (the file is opened once it exists)."""
        if self.closed:
            return b""
        if self.file is None:
            try:
                self.file = open(self.path, "rb")  # noqa: SIM115 (open while the attempt runs)
            except OSError:
                return b""
        return self.file.read() or b""


@dataclass
class _Attempt:
    number: int
    directory: str
    streams: list[_Stream] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    ranks: dict[int, int] = field(default_factory=dict)
    """Local rank -> global rank (torch's failure lines name the local one)."""
    failures: list[RankFailure] = field(default_factory=list)
    """The ranks torch said failed, as it said so (before it restarts the ranks no ChildFailedError follows)."""

    def stderr_of(self, rank: int) -> str:
        return next((s.path for s in self.streams if s.rank == rank and s.to_stderr), "")

    def stdout_of(self, rank: int) -> str:
        return next((s.path for s in self.streams if s.rank == rank and not s.to_stderr), "")


class _Specs(LogsSpecs):
    """torch's hook for where a worker's streams go: ``attempt-N/rank-R.{stdout,stderr}.log`` (by global rank,
    which torch's own ``DefaultLogsSpecs`` does not name), and its error file next to them."""

    def __init__(self, owner: RankLogs) -> None:
        super().__init__(log_dir=owner.directory)
        self._owner = owner

    @property
    def root_log_dir(self) -> str:
        return self._owner.directory

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        number = int(next(iter(envs.values()), {}).get("TORCHELASTIC_RESTART_COUNT", "0"))
        directory = os.path.join(self._owner.directory, f"attempt-{number}")
        os.makedirs(directory, exist_ok=True)
        attempt = _Attempt(number, directory)
        dest = LogsDest()
        for local_rank, env in envs.items():
            base = os.path.join(directory, f"rank-{env.get('RANK', local_rank)}")
            dest.stdouts[local_rank] = f"{base}.stdout.log"
            dest.stderrs[local_rank] = f"{base}.stderr.log"
            dest.error_files[local_rank] = f"{base}.error.json"
            env["TORCHELASTIC_ERROR_FILE"] = dest.error_files[local_rank]
            rank = int(env.get("RANK", local_rank))
            attempt.ranks[local_rank] = rank
            attempt.streams += [_Stream(rank, dest.stdouts[local_rank], False),
                                _Stream(rank, dest.stderrs[local_rank], True)]
        dest.filtered_stdout = os.path.join(directory, "filtered_stdout.log")
        dest.filtered_stderr = os.path.join(directory, "filtered_stderr.log")
        self._owner.begin(attempt)
        return dest


class RankLogs:
    """The run's log directory, torch's ``LogsSpecs`` for it (``specs``), and the thread that echoes the ranks'
    lines while ``started()``."""

    def __init__(self, directory: str, host: str, out: TextIO, err: TextIO, *, poll_s: float = 0.05,
                 release_s: float = 15.0) -> None:
        self.directory = directory
        self.host = host
        self.specs = _Specs(self)
        self._out, self._err = out, err
        self._poll_s, self._release_s = poll_s, release_s
        self._lock = threading.RLock()
        self._attempts: list[_Attempt] = []
        self._pending: dict[int, float] = {}  # rank -> when its traceback began
        self._held: deque[tuple[int, str]] = deque(maxlen=HELD_MAX)
        self._failing = False
        self._ended_by: dict[int, int] = {}  # rank -> the signal the launcher ended it with
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="ddpkit-rank-logs")

    @contextlib.contextmanager
    def started(self) -> Iterator[RankLogs]:
        """The thread runs while the workers do; at the end every line is read, and what was held is shown unless
        the attempt failed (``ChildFailedError``: ``say_failure`` says it)."""
        self._thread.start()
        failed = False
        try:
            yield self
        except ChildFailedError:
            failed = True
            raise
        finally:
            self.finish(failed=failed)

    def say_failure(self, failures: Sequence[RankFailure], first: int | None) -> None:
        """The digest of the failed attempt, after root_cause's line (``first``: the rank it named, None: none)."""
        self._write(self._err, self._failure_lines(failures, first))

    def _failure_lines(self, failures: Sequence[RankFailure], first: int | None) -> list[str]:
        ends = self.ends({f.rank: f.exit_code for f in failures}, {f.rank: f.pid for f in failures})
        return self.digest_lines(first=first, ends=ends)

    def begin(self, attempt: _Attempt) -> None:
        """A new attempt's files (torch asks for them as it starts the workers): the last attempt's are read to
        the end, and, where it failed, said in a digest before the new one's lines."""
        with self._lock:
            if self._attempts:
                self._pump(final=True)
                last = self._attempts[-1]
                if last.failures:  # said as the agent's last failure is (root_cause's line, then the digest)
                    failures = ordered(last.failures)
                    found = first_of(failures)
                    self._write(self._err, [f"ddpkit: attempt {last.number} failed: {root_cause_line(failures)[1]}; "
                                            "the agent restarts the ranks",
                                            *self._failure_lines(failures, None if found is None else found.rank)])
                elif self._failing or self._held:
                    self._write(self._err, [f"ddpkit: attempt {last.number} failed; the agent restarts the ranks. "
                                            "What its ranks said:", *self.digest_lines(first=None, ends=None)])
                self._pending.clear()
                self._held.clear()
                self._ended_by.clear()
                self._failing = False
            self._attempts.append(attempt)

    def failure_seen(self, record: logging.LogRecord) -> bool:
        """A filter on torch's loggers: its lines saying a worker failed and the others are ended mean this attempt
        fails; from now every rank's stderr is held for the digest. torch's "Terminating process P via signal
        SIGTERM", one a rank, is dropped (the digest says which ranks were ended)."""
        text = str(record.msg)
        exc = record.exc_info[1] if record.exc_info else None
        failed = logged_failure(record)
        if text.startswith(("Terminating process", "failed (exitcode", "Sending process", "Closing process",
                            "Unable to shutdown process")) or type(exc).__name__ == "ProcessExitedException":
            with self._lock:
                self._failing = True
                self._note_signal(record)
                if failed is not None and self._attempts:
                    self._note_failure(*failed)
        return not text.startswith("Terminating process")

    def _note_failure(self, local_rank: int, pid: int, exit_code: int) -> None:
        attempt = self._attempts[-1]
        rank = attempt.ranks.get(local_rank, local_rank)
        if not any(f.pid == pid for f in attempt.failures):
            attempt.failures.append(RankFailure(rank=rank, pid=pid, exit_code=exit_code, timestamp=time.time()))

    def _note_signal(self, record: logging.LogRecord) -> None:
        """Which rank the launcher ends with which signal: torch logs the pid ("Terminating process P via signal
        SIGTERM", "Unable to shutdown process P via SIGTERM , forcefully exiting via SIGKILL"; for ranks started
        afresh "Sending process P closing signal SIGTERM") while the process still runs, and the rank is the one
        whose stderr log the process writes (its fd 2)."""
        ending = ending_signal(record.getMessage())
        if ending is None:
            return
        pid, sig = ending
        try:
            target = os.readlink(f"/proc/{pid}/fd/2")
        except OSError:
            return
        rank = re.search(r"rank-(\d+)\.stderr\.log$", target)
        if rank and self._ended_by.get(int(rank[1])) != signal.SIGKILL:
            self._ended_by[int(rank[1])] = sig

    def finish(self, *, failed: bool) -> None:
        """Stop the thread after every line was read; where the attempt did not fail, show what was held."""
        self._done.set()
        self._thread.join()
        with self._lock:
            self._pump(final=True)
            if failed:
                self._failing = True
            else:
                self.release()

    def ends(self, exitcodes: dict[int, int], pids: dict[int, int]) -> list[RankEnd]:
        """Every rank of the last attempt: its exit code and pid where torch reported one, the end of its stderr."""
        attempt = self._attempts[-1] if self._attempts else None
        ranks = sorted({s.rank for s in attempt.streams}) if attempt else sorted(exitcodes)
        lived_s = time.monotonic() - attempt.started + 1 if attempt else None
        return [RankEnd(rank=r, exitcode=exitcodes.get(r), pid=pids.get(r), ended_by=self._ended_by.get(r),
                        kernel=(oom_line_for(pids.get(r), lived_s=lived_s) or "")
                        if exitcodes.get(r) == -signal.SIGKILL else "",
                        stderr=file_tail(attempt.stderr_of(r)) if attempt else "",
                        stdout=file_tail(attempt.stdout_of(r), 4096) if attempt else "") for r in ranks]

    def digest_lines(self, *, first: int | None, ends: list[RankEnd] | None) -> list[str]:
        """The digest of the last attempt (``ends`` None: read from its files, no exit codes known)."""
        with self._lock:
            attempt = self._attempts[-1] if self._attempts else None
            where = attempt.directory if attempt else self.directory
            watch = list(self._held)
        return digest(ends if ends is not None else self.ends({}, {}), first=first, host=self.host,
                      logs=f"{where}{os.sep} (rank-R.stdout.log, rank-R.stderr.log)", watch=watch)

    def _run(self) -> None:
        while not self._done.wait(self._poll_s):
            with self._lock:
                self._pump(final=False)
                oldest = min(self._pending.values(), default=None)
                if not self._failing and oldest is not None and time.monotonic() - oldest > self._release_s:
                    self.release()

    def _pump(self, *, final: bool) -> None:
        """Read what the ranks of the last attempt wrote since the last call; whole lines only, unless ``final``."""
        if not self._attempts:
            return
        read: list[tuple[_Stream, list[str]]] = []
        for stream in self._attempts[-1].streams:
            data = stream.partial + stream.read()
            *whole, stream.partial = data.split(b"\n")
            if final and stream.partial:
                whole, stream.partial = [*whole, stream.partial], b""
            if final and stream.file is not None:
                stream.file.close()
                stream.closed = True
            read.append((stream, [raw.decode(errors="replace").rstrip("\r") for raw in whole]))
        # a traceback read now holds every rank's lines read with it: a peer's report of the dying rank may be
        # read first (a lower rank's file), and must not reach the screen before the cause
        for stream, lines in read:
            if stream.to_stderr and not self._failing and any(line.strip() == TRACEBACK for line in lines):
                self._pending.setdefault(stream.rank, time.monotonic())
        for stream, lines in read:
            for line in lines:
                self._take(stream, line)

    def _take(self, stream: _Stream, line: str) -> None:
        if is_noise(line):
            return
        shown = self._shown(stream.rank, line)
        if not stream.to_stderr:
            self._write(self._out, [shown])
            return
        if self._failing or self._pending:
            self._held.append((stream.rank, line))
        else:
            self._write(self._err, [shown])

    def release(self) -> None:
        """Show what was held (a preemption's lines: no failure to digest)."""
        with self._lock:
            self._write(self._err, [self._shown(rank, line) for rank, line in self._held])
            self._held.clear()
            self._pending.clear()

    def _shown(self, rank: int, line: str) -> str:
        prefix = f"[{self.host}:{rank}]"
        return line if line.startswith(prefix + " ") else f"{prefix} {line}"

    @staticmethod
    def _write(stream: TextIO, lines: list[str]) -> None:
        if lines:
            stream.write("".join(f"{line}\n" for line in lines))
            stream.flush()


def file_tail(path: str | os.PathLike[str], size: int = TAIL_BYTES) -> str:
    """The last ``size`` bytes of the file at ``path`` as text ("" where it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""
