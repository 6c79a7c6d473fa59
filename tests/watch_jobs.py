"""Running tests/multiproc/watch_user_job.py under the watch and a real launcher, and reading what came out: shared
by the watch's multiprocess and infrastructure tests and its benchmarks."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.helpers import ROOT, ddpkit_env, free_port

JOB = ROOT / "tests" / "multiproc" / "watch_user_job.py"
#: Rank 1 makes one all-reduce more than rank 0, of the size of DDP's bucket: the calls pair up one step off, rank 0
#: finishes its loop and ends its process group while rank 1 waits in its last all-reduce.
ONE_EXTRA_ALL_REDUCE = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
size = sum(p.numel() for p in model.parameters())
for step in range(40):
    if step == 10 and rank == 1:
        dist.all_reduce(torch.zeros(size))
    model(torch.randn(8, 64)).sum().backward()
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()
"""
HOST = socket.gethostname().split(".", 1)[0]


def torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)]


def mpirun(n: int, *options: str) -> list[str]:
    """Open MPI's mpirun with ``options`` (before the program), ending with this Python."""
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(n), "-x", "MASTER_ADDR=127.0.0.1",
            "-x", f"MASTER_PORT={free_port()}", *options, sys.executable]


@dataclass
class WatchedRun:
    proc: subprocess.CompletedProcess[str]
    events: list[dict[str, Any]]
    tag: str
    seconds: float

    @property
    def output(self) -> str:
        return self.proc.stdout + self.proc.stderr

    def fault_time(self) -> float:
        line = next(x for x in self.proc.stdout.splitlines() if x.startswith("FAULT "))
        return float(line.split()[2])

    def event(self, kind: str) -> dict[str, Any]:
        found = [e for e in self.events if e["event"] == kind]
        assert len(found) == 1, f"{len(found)} {kind} events\n{self.output[-6000:]}"
        return found[0]


def run_watched(launcher: list[str], tmp: Path, *job_args: str, watch: tuple[str, ...] = ("--hang-after", "4"),
                module: bool = True, timeout: float = 150, env: dict[str, str] | None = None,
                term_after: float | None = None, runner: tuple[str, ...] = ("ddpkit.watch",),
                kill_after: tuple[str, float] | None = None) -> WatchedRun:
    """``LAUNCHER [python] -m ddpkit.watch WATCH --events F -- watch_user_job.py JOB_ARGS --tag T`` (``module``
    False: ``LAUNCHER watch_user_job.py ...``, the script watching itself). ``term_after``: SIGTERM to the launcher
    that many seconds after its ranks have started (what a scheduler does). ``runner``: the module and words after
    ``-m`` (``("ddpkit", "run")``: ddpkit's own command; with ``("ddpkit", "run", "-n", "3")`` and a launcher of
    ``[python]``, ddpkit starts the ranks). ``kill_after`` (an event, seconds): the job killed that many seconds
    after the event is written (a job that would run on), its run returned; ``timeout`` still bounds the whole."""
    tag = uuid.uuid4().hex[:12]
    events = tmp / f"events-{tag}.jsonl"
    job = [str(JOB), *job_args, "--tag", tag]
    # without the runner, the script watches itself and finds the events file in WATCH_EVENTS
    argv = [*launcher, "-m", *runner, *watch, "--events", str(events), "--", *job] if module else \
        [*launcher, *job]
    env = {"WATCH_EVENTS": str(events), **(env or {})}
    started = time.monotonic()
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                          env=ddpkit_env(**env), cwd=ROOT, start_new_session=True) as popen:
        try:
            if term_after is not None:
                _term_after_start(popen, tag, term_after, started + timeout)
            ended = None if kill_after is None else _event_then(popen, events, kill_after, started + timeout)
            if kill_after is not None and ended is None:
                _kill_job(popen, tag)
            out, err = ended or popen.communicate(timeout=max(started + timeout - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            # the launcher and every rank (torchrun starts its ranks in sessions of their own: killing the
            # launcher's group alone leaves them behind, blocked in a collective and holding the pipes)
            _kill_job(popen, tag)
            popen.communicate()
            raise
    proc = subprocess.CompletedProcess(argv, popen.returncode, out, err)
    seconds = time.monotonic() - started
    lines = events.read_text().splitlines() if events.exists() else []
    return WatchedRun(proc=proc, events=[json.loads(x) for x in lines], tag=tag, seconds=seconds)


def _kill_job(popen: subprocess.Popen[str], tag: str) -> None:
    """The launcher and every rank (torchrun starts its ranks in sessions of their own: killing the launcher's group
    alone leaves them behind, blocked in a collective and holding the pipes)."""
    os.killpg(popen.pid, signal.SIGKILL)
    for pid in leftover(tag, grace=0):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def _event_then(popen: subprocess.Popen[str], events: Path, kill_after: tuple[str, float],
                until: float) -> tuple[str, str] | None:
    """Read the job's pipes until an event of kind ``kill_after[0]`` is in ``events``, then ``kill_after[1]`` s
    more: None (the job is to be killed); the job's output where it ended first. TimeoutExpired at ``until``."""
    kind, then = kill_after
    marker = f'"event": "{kind}"'
    end = None
    while end is None or time.monotonic() < end:
        try:
            return popen.communicate(timeout=0.5)  # output is kept across the timeouts
        except subprocess.TimeoutExpired:
            if end is None and events.exists() and marker in events.read_text():
                end = time.monotonic() + then
            elif end is None and time.monotonic() > until:
                raise
    return None


def _term_after_start(popen: subprocess.Popen[str], tag: str, after: float, until: float) -> None:
    """SIGTERM to the launcher ``after`` s once its ranks run (each rank's command line carries ``tag``; the
    launcher's own does too)."""
    while time.monotonic() < until and popen.poll() is None and len(leftover(tag, grace=0)) < 2:
        time.sleep(0.2)
    time.sleep(after)
    popen.send_signal(signal.SIGTERM)


def leftover(tag: str, grace: float = 10.0) -> list[int]:
    """PIDs of processes whose command line carries ``tag``, after up to ``grace`` seconds."""
    deadline = time.monotonic() + grace
    while True:
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                try:
                    if tag.encode() in (entry / "cmdline").read_bytes():
                        pids.append(int(entry.name))
                except OSError:
                    continue
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.2)
