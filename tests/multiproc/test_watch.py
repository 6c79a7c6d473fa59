"""The watch on real ranks under real torchrun: an unchanged DDP script (tests/multiproc/watch_user_job.py) started
through ``python -m ddpkit.watch`` (what ``ddpkit run`` does in each rank), with one fault injected per run.

Durations are scaled down from the issue's (a 5-minute run with a 2-minute checkpoint): --hang-after 4 s, runs of
about 20 s with an 8 s marked checkpoint, so the whole file stays within a few minutes on 2 cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.watch_jobs import HOST, leftover, run_watched, torchrun

HANG_AFTER = 4.0


def _check_hang(run, fault: str, n: int) -> None:  # type: ignore[no-untyped-def]
    out = run.output
    assert run.proc.returncode != 0, out[-4000:]
    if fault == "kill":  # the launcher ends the job at once; the watch names the rank that is gone
        assert f"rank 1 on host {HOST} (pid " in out and "is gone (its process no longer runs)" in out, out[-6000:]
        assert leftover(run.tag) == []
        return
    hang = run.event("hang")
    assert run.output.count("ddpkit watch: HANG") == 1, out[-6000:]
    assert hang["time"] - run.fault_time() <= HANG_AFTER + 10, (hang["time"], run.fault_time())
    live = [r for r in range(n) if not (fault == "stop" and r == 1)]
    assert sorted(int(r) for r in hang["stacks"]) == live, out[-6000:]
    for r in live:
        assert f"--- rank {r} on host {HOST} (pid " in out
    assert "exitcode  : 3" in out  # every rank stopped with exit 3 (torchrun prints each failed rank)
    if fault == "sleep":
        assert hang["behind"] == [1] and hang["stopped"] == []
        assert f"rank 1 on host {HOST} has not entered DDP gradient all-reduce (bucket 0) #21" in out, out[-6000:]
        assert "step 20" in out and "time.sleep(3600)" in hang["stacks"]["1"]
        assert hang["waiting"] == [r for r in range(n) if r != 1]
    elif fault == "stop":
        assert hang["stopped"] == [1] and hang["behind"] == [1], out[-6000:]
        assert f"rank 1 on host {HOST} (pid" in out and "stopped answering" in out
    elif fault == "extra":
        desync = hang["desync"]
        assert desync["seq"] == 21, desync
        sites = {c["site"] for c in desync["calls"]}
        assert any("watch_user_job.py" in s and "(fault)" in s for s in sites), desync
        assert any("watch_user_job.py" in s and "(train)" in s for s in sites), desync  # the backward line
        assert [c["ranks"] for c in desync["calls"] if c["op"] == "broadcast"] == [[1]]
        assert "DESYNC at collective #21" in out
    assert leftover(run.tag) == [], "processes left behind"


@pytest.mark.parametrize("fault", ["sleep", "stop", "kill", "extra"])
@pytest.mark.parametrize("n", [2, 4])
def test_fault_named_under_torchrun(fault: str, n: int, tmp_path: Path) -> None:
    """The script registers its own Python comm hook (--hook): the watch wraps it and sees each gradient bucket."""
    run = run_watched(torchrun(n), tmp_path, "--hook", "--fault", fault, "--steps", "400")
    _check_hang(run, fault, n)


@pytest.mark.parametrize("idle_in", ["sleep", "store"])
def test_killed_rank_named_when_the_launcher_ends_the_others_first(idle_in: str, tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed while ranks 0 and 2 are in no collective with it (for 60 s): nothing of theirs fails
    before torchrun ends them (SIGTERM, 0.1 s after the death). The watch still names rank 1, once, and every rank
    ends as SIGTERM ends it. ``store``: their main thread waits in C (the job's store), where no Python signal
    handler runs: the watch's thread acts on its own (without it, torchrun would SIGKILL them after 30 s)."""
    run = run_watched(torchrun(3), tmp_path, "--fault", "kill", "--steps", "400", "--others-idle-s", "60",
                      *(["--idle-in-store"] if idle_in == "store" else []))
    out = run.output
    assert out.count(f"rank 1 on host {HOST} (pid ") == 1 and "is gone (its process no longer runs)" in out, out[-6000:]
    assert out.count("is told to stop (SIGTERM: the launcher is ending the job)") == 1, out[-6000:]
    assert [(e["event"], e["gone"]) for e in run.events] == [("rank-gone", [1])], run.events
    assert out.count("exitcode  : -15") == 2, out[-6000:]  # ranks 0 and 2: SIGTERM's own end, not a SIGKILL
    assert leftover(run.tag) == []


def test_a_healthy_job_ended_by_sigterm_names_no_rank(tmp_path: Path) -> None:
    """torchrun itself told to stop (a scheduler's SIGTERM) mid-training: it ends its 4 ranks one after the other,
    and none of them is named gone (a rank told to stop marks itself first; the others read the mark)."""
    run = run_watched(torchrun(4), tmp_path, "--steps", "100000", term_after=8)
    out = run.output
    assert run.proc.returncode != 0 and "SignalException" in out, out[-6000:]
    assert "is gone" not in out and "told to stop" not in out, out[-6000:]
    assert [e for e in run.events if e["event"] in ("rank-gone", "collective-failed", "hang")] == [], run.events
    assert leftover(run.tag) == []


# a model with no comm hook of its own (most scripts) stays on DDP's C++ path: counted, not hooked; a wide one too
WIDE = ("--width", "8192")


@pytest.mark.parametrize("fault", ["sleep", "extra"])  # a stopped rank is named by its heartbeat, on any path
@pytest.mark.parametrize("wide", [False, True])
def test_fault_named_for_a_hookless_model_on_ddps_cpp_path(fault: str, wide: bool, tmp_path: Path) -> None:
    run = run_watched(torchrun(2), tmp_path, *(WIDE if wide else ()), "--fault", fault, "--steps", "400")
    out = run.output
    hang = run.event("hang")
    assert out.count("ddpkit watch: HANG") == 1 and "exitcode  : 3" in out, out[-6000:]
    assert hang["time"] - run.fault_time() <= HANG_AFTER + 10, (hang["time"], run.fault_time())
    assert "DDP gradient all-reduce (bucket" not in out, "a hookless model got a Python hook from the watch"
    if fault == "sleep":
        assert hang["behind"] == [1] and hang["waiting"] == [0], out[-6000:]
        assert f"rank 1 on host {HOST} has not entered the group's collective #" in out, out[-6000:]
        assert "(DDP's gradient all-reduce on its C++ path: counted, not seen one by one)" in out
        assert "time.sleep(3600)" in hang["stacks"]["1"]
    else:  # rank 1 in its extra broadcast, rank 0 in the C++ all-reduce of the same step
        assert hang["cpp_desync"] == [0] and hang["behind"] == [] and hang["waiting"] == [1], out[-6000:]
        assert "DESYNC at the group's collective #" in out
        assert "in DDP's gradient all-reduce on its C++ path (counted" in out
    assert leftover(run.tag) == [], "processes left behind"


def test_straggler_named_for_a_wide_model_on_ddps_cpp_path(tmp_path: Path) -> None:
    slow = run_watched(torchrun(2), tmp_path, *WIDE, "--steps", "150", "--slow-rank", "1", "--slow-ms", "40",
                       watch=("--report-every", "2"))
    assert slow.proc.returncode == 0, slow.output[-6000:]
    named = [e for e in slow.events if e["event"] == "straggler"]
    assert named and all(e.get("rank") == 1 and e["host"] == HOST for e in named), slow.events
    summary = next(e for e in slow.events if e["event"] == "summary")
    assert summary["ranks"]["0"]["wait_share"] > summary["ranks"]["1"]["wait_share"], summary


def test_on_hang_report_keeps_waiting_then_names_it_once(tmp_path: Path) -> None:
    """--on-hang report: the report, then the job keeps running (ended by the test 3 hang deadlines later)."""
    run = run_watched(torchrun(2), tmp_path, "--fault", "sleep", "--steps", "400",
                      watch=("--hang-after", str(HANG_AFTER), "--on-hang", "report"),
                      kill_after=("hang", 3 * HANG_AFTER))
    assert run.proc.returncode == -9, run.output[-4000:]  # still running when killed
    assert [e["event"] for e in run.events] == ["hang"] and run.events[0]["on_hang"] == "report", run.events
    assert leftover(run.tag) == [], "the launcher and its ranks are all gone"


def test_marked_checkpoint_and_unmarked_slow_first_step_raise_no_alarm(tmp_path: Path) -> None:
    """A clean ~20 s run: a 6 s unmarked first step (x5 deadline until the first step ends), then rank 0 'writes a
    checkpoint' for 8 s (twice --hang-after) inside ddpkit.watch.phase while the others wait in a barrier."""
    run = run_watched(torchrun(2), tmp_path, "--steps", "150", "--first-step-s", "6", "--checkpoint-at", "40",
                      "--checkpoint-s", "8")
    assert run.proc.returncode == 0, run.output[-6000:]
    assert "HANG" not in run.output and [e["event"] for e in run.events] == ["summary"], run.events
    summary = run.events[0]
    assert sorted(summary["ranks"]) == ["0", "1"] and summary["ranks"]["0"]["steps"] >= 100
    assert summary["hosts"][HOST]["ranks"] == [0, 1]
    assert "ddpkit watch: summary" in run.output


def test_unmarked_checkpoint_is_a_hang(tmp_path: Path) -> None:
    """The same 8 s rank-0 pause, unmarked: reported (so the marked run above proves the mark works)."""
    run = run_watched(torchrun(2), tmp_path, "--steps", "150", "--checkpoint-at", "40", "--checkpoint-s", "30",
                      "--no-phase")
    hang = run.event("hang")
    assert hang["waiting"] == [1] and hang["behind"] == [0], run.output[-6000:]


def test_straggler_named_with_its_host(tmp_path: Path) -> None:
    slow = run_watched(torchrun(2), tmp_path, "--steps", "150", "--slow-rank", "1", "--slow-ms", "40",
                       watch=("--report-every", "2"))
    assert slow.proc.returncode == 0, slow.output[-6000:]
    named = [e for e in slow.events if e["event"] == "straggler"]
    assert named and all(e.get("rank") == 1 and e["host"] == HOST for e in named), slow.events
    assert f"rank 1 on {HOST} is the slowest: the others wait" in slow.output


@pytest.mark.serial  # beside the parallel suite's load one rank can truly wait 10% of a ~20 ms step for the other
def test_no_straggler_in_a_clean_run(tmp_path: Path) -> None:
    clean = run_watched(torchrun(2), tmp_path, "--steps", "150", watch=("--report-every", "2"))
    assert clean.proc.returncode == 0, clean.output[-6000:]
    assert [e for e in clean.events if e["event"] == "straggler"] == [], clean.events


@pytest.mark.parametrize("how", ["init", "with"])
def test_watch_from_the_users_own_code(how: str, tmp_path: Path) -> None:
    """``ddpkit.init(watch=WatchOptions(...))`` and ``with ddpkit.watch(...)`` in the script, under plain torchrun."""
    run = run_watched(torchrun(2), tmp_path, "--fault", "sleep", "--steps", "400", "--watch-in-code", how,
                      module=False)
    assert run.proc.returncode != 0 and "exitcode  : 3" in run.output, run.output[-4000:]
    assert [e["event"] for e in run.events] == ["hang"] and run.events[0]["behind"] == [1], run.output[-4000:]
    assert leftover(run.tag) == []


_SAMPLING_JOB = """
import json, os, sys, time
import torch, torch.distributed as dist
from ddpkit.watch import WatchOptions, active, install
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
install(WatchOptions(summary=False))
dist.init_process_group("gloo", rank=0, world_size=1)
sleep_s, steps = float(sys.argv[2]), int(sys.argv[3])

class Slow(torch.nn.Linear):
    def forward(self, x):
        time.sleep(sleep_s)
        return super().forward(x)

model = torch.nn.parallel.DistributedDataParallel(Slow(8, 1))
x = torch.randn(4, 8)
for _ in range(steps):
    model(x).sum().backward()
from ddpkit.watch.recorder import LONG_STEP_S
recorder = active().recorder
slow = sum(took >= LONG_STEP_S for took in recorder.step_times)
print(json.dumps({**recorder.timings(), "slow": slow}))
dist.destroy_process_group()
"""


# short steps: 9 samples, and at most one more for each timed step the machine made last 5 ms (the job counts them:
# "slow"); at DDP's rate of 1 in 10 every timed step would read one (99), at the old time-based reads about 1
@pytest.mark.parametrize(("sleep_s", "steps", "samples"), [(0.0, 1000, (8, 9)), (0.006, 41, (4, 4))])
def test_ddp_statistic_sampled_as_the_step_length_allows(sleep_s: float, steps: int, samples: tuple[int, int]) -> None:
    """Short steps: DDP samples its gradient-sync time at its default rate (one iteration in 100) and the watch reads
    it as often (steps 101, 201, ... 901: 9 samples in 1000 steps). Steps of 5 ms and more: one in 10, every timed
    step read (steps 11, 21, 31, 41)."""
    import json
    import subprocess
    import sys

    from tests.helpers import ddpkit_env, free_port

    done = subprocess.run([sys.executable, "-c", _SAMPLING_JOB, free_port(), str(sleep_s), str(steps)],
                          capture_output=True, text=True, env=ddpkit_env(), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    timings = json.loads(done.stdout.strip().splitlines()[-1])
    assert timings["steps"] == steps and timings["timed"] == (steps - 1) // 10, timings
    extra = timings["slow"] if sleep_s < 5e-3 else 0
    assert samples[0] <= timings["sync_samples"] <= samples[1] + extra, timings
