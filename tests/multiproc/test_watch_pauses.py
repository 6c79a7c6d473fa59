"""The watch under ``ddpkit run`` with its defaults, on an unchanged script (plain torch.distributed + DDP on gloo, no
``ddpkit.watch.phase`` marks): a healthy job that pauses for longer than the report's deadline is reported once and
keeps running, and the report says it resumed; a real hang is reported, then stopped at the time the report gave.

The two 75 s pauses (rank 0 alone "writes a checkpoint", or evaluates, while rank 1 waits in the next collective)
run at the default deadlines (a report at 60 s, every rank stopped only after 600 s) and run side by side, started
by one fixture; the hangs use small ``--hang-after`` / ``--stop-after``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from ddpkit.watch.options import MIN_HANG_S, MIN_STOP_S
from tests.helpers import ddpkit_env
from tests.watch_jobs import HOST, leftover

pytestmark = pytest.mark.multiproc

PAUSE_S = 75.0

# python SCRIPT MODE SECONDS TAG: 20 steps, then rank 0 pauses (checkpoint: then a barrier; eval: rank 1 goes on to
# the next step and waits in its gradient all-reduce) or rank 1 hangs (stop: SIGSTOP; sleep: outside any collective),
# then 20 more steps; checkpoint-then-stop: the checkpoint, then 20 steps, then rank 1's SIGSTOP
SCRIPT = '''
import os, signal, sys, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

mode, seconds = sys.argv[1], float(sys.argv[2])
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = DDP(torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(8, 16)


def train(steps):
    for _ in range(steps):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
        time.sleep(0.01)


def write_checkpoint(path):
    time.sleep(seconds)  # a slow filesystem
    torch.save(model.module.state_dict(), path)


def evaluate():
    until = time.monotonic() + seconds
    with torch.no_grad():
        while time.monotonic() < until:
            model.module(x)
            time.sleep(0.05)


if mode == "first-step" and rank == 0:
    time.sleep(seconds)  # a slow first step: data loading, compilation (rank 1 waits in its first all-reduce)
train(20)
if mode == "all-sleep":
    time.sleep(seconds)  # every rank at once: nobody waits for anybody
if mode in ("checkpoint", "checkpoint-then-stop"):
    if rank == 0:
        write_checkpoint(os.path.join(os.path.dirname(os.path.abspath(__file__)), "model.pt"))
    dist.barrier()
elif mode == "eval" and rank == 0:
    evaluate()
elif mode == "stop" and rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
elif mode == "sleep" and rank == 1:
    time.sleep(seconds)
train(20)
if mode == "checkpoint-then-stop" and rank == 1:
    os.kill(os.getpid(), signal.SIGSTOP)
# a stopped rank that the stop resumes (SIGCONT) trains on with the others until it sees the order (within a second):
# enough steps that they do not finish first
train(500 if "stop" in mode else 20)
print(f"rank {rank} done", flush=True)
dist.destroy_process_group()
'''


@dataclass
class Job:
    """``ddpkit run -n 2 [WATCH] --events F -- SCRIPT MODE SECONDS TAG``, started, not yet waited for."""

    popen: subprocess.Popen[str]
    events_path: Path
    tag: str
    started: float

    def wait(self, timeout: float) -> Done:
        try:
            out, err = self.popen.communicate(timeout=max(self.started + timeout - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            self.kill()
            self.popen.communicate()
            raise
        lines = self.events_path.read_text().splitlines() if self.events_path.exists() else []
        return Done(self.popen.returncode, out + err, [json.loads(x) for x in lines], self.started, self.tag)

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        for pid in leftover(self.tag, grace=0):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


@dataclass
class Done:
    code: int
    output: str
    events: list[dict[str, Any]]
    started: float
    tag: str

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == kind]

    def lines(self) -> list[str]:
        """The output's lines without the ``[host:rank]`` prefix ddpkit's agent may put before a rank's."""
        return [re.sub(r"^\[[^\]\s]+\] ", "", line) for line in self.output.splitlines()]


def start(tmp: Path, mode: str, seconds: float, *watch: str) -> Job:
    tag = uuid.uuid4().hex[:12]
    script = tmp / f"job-{mode}.py"
    script.write_text(SCRIPT)
    events = tmp / f"events-{mode}.jsonl"
    argv = [sys.executable, "-m", "ddpkit", "run", "-n", "2", *watch, "--events", str(events), "--", str(script),
            mode, str(seconds), tag]
    popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
                             env=ddpkit_env(), cwd=tmp, start_new_session=True)
    return Job(popen, events, tag, time.monotonic())


#: The issue's other healthy pauses: a 150 s checkpoint, a 90 s slow first step, every rank sleeping at once.
LONGER = {"checkpoint": 150.0, "first-step": 90.0, "all-sleep": PAUSE_S}


@pytest.fixture(scope="module")
def paused(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Job]]:
    """Every healthy pause at once, at the watch's defaults (each job's ranks mostly sleep or wait): both 75 s
    pauses, and the longer ones (keyed ``longer-MODE``)."""
    tmp = tmp_path_factory.mktemp("paused")
    jobs = {mode: start(tmp, mode, PAUSE_S) for mode in ("checkpoint", "eval")}
    for mode, seconds in LONGER.items():
        where = tmp / f"longer-{mode}"
        where.mkdir()
        jobs[f"longer-{mode}"] = start(where, mode, seconds)
    yield jobs
    for job in jobs.values():
        job.kill()


def _reported_then_resumed(done: Done, waiters: str, busy_in: str) -> None:
    out = done.output
    assert done.code == 0, out[-6000:]
    assert out.count("ddpkit watch: progress resumed after") == 1, out[-6000:]
    assert "HANG" not in out and "stops (hang reported" not in out, out[-6000:]
    (hang,) = done.of("hang")
    (resumed,) = done.of("resumed")
    assert hang["busy"] == [0] and hang["behind"] == [0], hang
    assert busy_in in hang["busy_at"]["0"], hang["busy_at"]
    headline = next(line for line in done.lines() if "which is alive and busy outside any collective" in line)
    assert headline.startswith(f"ddpkit watch: {waiters} on host {HOST} has waited "), headline
    assert f"for rank 0 on host {HOST}, which is alive and busy outside any collective (its stack below); every " \
           "rank stops at " in headline and headline.endswith(" unless progress resumes"), headline
    # the report at the default deadline, the stop it announced MIN_STOP_S after the pause began
    assert MIN_HANG_S <= hang["idle_s"] < PAUSE_S, hang
    assert hang["stop_at"] - hang["time"] >= MIN_STOP_S - PAUSE_S, hang
    stack_order = [line for line in done.lines() if line.startswith("--- rank ")]
    assert stack_order[0].startswith(f"--- rank 0 on host {HOST}"), stack_order  # the rank waited for first
    assert MIN_HANG_S < resumed["paused_s"] < PAUSE_S + 15 and resumed["time"] > hang["time"], resumed
    line = next(x for x in done.lines() if x.startswith("ddpkit watch: progress resumed after"))
    assert f"(rank 0 was in {hang['busy_at']['0']})" in line, line
    assert out.count("rank 0 done") == 1 and out.count("rank 1 done") == 1
    assert leftover(done.tag) == []


@pytest.mark.slow  # a minute or more
def test_a_checkpoint_longer_than_the_deadline_is_reported_once_and_resumes(paused: dict[str, Job]) -> None:
    """Rank 0 alone writes a checkpoint for 75 s, then ``dist.barrier()``, where rank 1 waits: today's watch called
    this a hang at 64 s and stopped both ranks (exit 3)."""
    done = paused["checkpoint"].wait(timeout=240)
    _reported_then_resumed(done, "rank 1", "time.sleep(seconds)  # a slow filesystem")
    assert "(write_checkpoint)" in done.of("hang")[0]["busy_at"]["0"]
    assert done.of("hang")[0]["collective"]["op"] == "barrier"


@pytest.mark.slow  # a minute or more
@pytest.mark.parametrize("mode", sorted(LONGER))
def test_the_other_healthy_pauses_finish_with_at_most_one_report(mode: str, paused: dict[str, Job]) -> None:
    """A 150 s checkpoint is reported once and resumes (every rank stops only after 600 s); a 90 s slow first step
    (the deadline is 5x until the job made a step) and every rank sleeping at once (nobody waits)
    raise no report at all."""
    done = paused[f"longer-{mode}"].wait(timeout=420)
    out = done.output
    assert done.code == 0, out[-6000:]
    assert out.count("rank 0 done") == 1 and out.count("rank 1 done") == 1, out[-6000:]
    assert "HANG" not in out and "stops (" not in out and not done.of("stop"), out[-6000:]
    if mode == "checkpoint":
        assert len(done.of("hang")) == 1 and len(done.of("resumed")) == 1, done.events
        assert done.of("resumed")[0]["paused_s"] > LONGER[mode] - 15, done.events
    else:
        assert not done.of("hang") and "ddpkit watch: " not in out.replace("ddpkit watch: summary", ""), out[-6000:]
    assert leftover(done.tag) == []


def test_an_evaluation_longer_than_the_deadline_is_reported_once_and_resumes(paused: dict[str, Job]) -> None:
    """Rank 0 evaluates for 75 s while rank 1 waits in the next step's gradient all-reduce (DDP's C++ path)."""
    done = paused["eval"].wait(timeout=240)
    _reported_then_resumed(done, "rank 1", "(evaluate)")
    assert done.of("hang")[0]["group_collective"] > 0


@pytest.mark.parametrize("fault", ["stop", "sleep"])
def test_a_real_hang_is_reported_then_stopped_at_the_time_the_report_gave(fault: str, tmp_path: Path) -> None:
    """Rank 1 stops itself (SIGSTOP) or sleeps outside any collective while rank 0 waits: reported after 5 s with
    the time every rank stops, and stopped then (20 s without progress), exit 3; the stopped rank is ended too."""
    done = start(tmp_path, fault, 3600, "--hang-after", "5", "--stop-after", "20").wait(timeout=150)
    out = done.output
    assert done.code == 3, out[-6000:]
    (hang,) = done.of("hang")
    (stop,) = done.of("stop")
    assert 5 <= hang["idle_s"] < 20 and hang["behind"] == [1], hang
    assert stop["idle_s"] >= 20 and stop["time"] > hang["time"], (hang, stop)
    assert abs(stop["time"] - hang["stop_at"]) < 6, (hang, stop)  # when the report said (the watch looks each ~1 s)
    assert " unless progress resumes" in out and "every rank stops (exit 3)" in out, out[-6000:]
    assert "progress resumed" not in out and not done.of("resumed")
    if fault == "stop":
        assert hang["stopped"] == [1] and stop["silent"] == [1], (hang, stop)
        assert f"rank 1 on host {HOST} (pid " in out and "stopped answering" in out, out[-6000:]
    else:
        assert hang["busy"] == [1] and "time.sleep(seconds)" in hang["busy_at"]["1"], hang
    assert "rank 0 done" not in out and "rank 1 done" not in out
    assert leftover(done.tag) == [], "processes left behind"


@pytest.mark.slow  # a minute or more
def test_a_later_hang_after_a_resumed_pause_gets_its_own_report(tmp_path: Path) -> None:
    """--on-hang abort's default wait: rank 0's 12 s checkpoint is reported at 5 s and resumes; rank 1's SIGSTOP
    afterwards is a new hang, reported on its own and stopped."""
    done = start(tmp_path, "checkpoint-then-stop", 12, "--hang-after", "5", "--stop-after", "30").wait(timeout=180)
    out = done.output
    assert done.code == 3, out[-6000:]
    hangs = done.of("hang")
    assert [h["behind"] for h in hangs] == [[0], [1]], hangs
    assert hangs[0]["busy"] == [0] and hangs[1]["stopped"] == [1], hangs
    (resumed,) = done.of("resumed")
    assert hangs[0]["time"] < resumed["time"] < hangs[1]["time"], (hangs, resumed)
    assert len(done.of("stop")) == 1 and leftover(done.tag) == []
