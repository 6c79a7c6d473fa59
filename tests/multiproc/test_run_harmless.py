"""`ddpkit run` never harms the job it carries (issue 36): the files a script leaves open are written in full, the
rank that failed first is named and its exit code is the command's, a killed peer is named by the watch and by the
SIGTERM report, and every input is checked once, before any rank starts. Real ranks: ddpkit's own agent (-n) and
torchrun; mpirun in tests/infra/test_run_launchers.py."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import DDP_OPENING, ddpkit_env, run_ddpkit
from tests.watch_jobs import HOST, ONE_EXTRA_ALL_REDUCE, leftover, run_watched, torchrun

pytestmark = pytest.mark.multiproc

# OUT/metrics-RANK.csv and OUT/log-RANK.gz, 1000 lines each, neither closed: Python's exit writes them in full
UNCLOSED = """
import gzip, os, sys
import torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
metrics = open(os.path.join(sys.argv[1], f"metrics-{rank}.csv"), "w")
log = gzip.open(os.path.join(sys.argv[1], f"log-{rank}.gz"), "wt")
for i in range(1000):
    metrics.write(f"{i},{i * i}\\n")
    log.write(f"line {i}\\n")
dist.barrier()
dist.destroy_process_group()
"""

# rank 1 leaves at step 5 (HOW=exit: sys.exit(5); HOW=kill: SIGKILL, as the OOM killer ends a process) while rank 0
# is in DDP's all-reduce with it: a hookless model, DDP's C++ path
FAILS = "\nimport os, signal, sys\n" + DDP_OPENING + """\
for step in range(100):
    if step == 5 and rank == 1:
        if os.environ["HOW"] == "exit":
            sys.exit(5)
        os.kill(os.getpid(), signal.SIGKILL)
    model(torch.randn(4, 16)).sum().backward()
dist.destroy_process_group()
"""


def _write(tmp_path: Path, name: str, text: str) -> Path:
    script = tmp_path / name
    script.write_text(text)
    return script


def assert_written_in_full(out: Path, world: int) -> None:
    for rank in range(world):
        assert (out / f"metrics-{rank}.csv").read_text().splitlines()[-1] == "999,998001"
        assert len((out / f"metrics-{rank}.csv").read_text().splitlines()) == 1000
        with gzip.open(out / f"log-{rank}.gz", "rt") as f:  # a GzipFile closed: its trailer written
            assert f.read().splitlines()[-1] == "line 999"


@pytest.mark.parametrize("watch", [(), ("--no-watch",)])
def test_files_the_script_never_closed_are_written_under_ddpkits_ranks(watch: tuple[str, ...],
                                                                       tmp_path: Path) -> None:
    script = _write(tmp_path, "unclosed.py", UNCLOSED)
    res = run_ddpkit("run", "-n", "2", *watch, "--", str(script), str(tmp_path), timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    assert_written_in_full(tmp_path, 2)


def test_files_the_script_never_closed_are_written_under_torchrun(tmp_path: Path) -> None:
    script = _write(tmp_path, "unclosed.py", UNCLOSED)
    res = subprocess.run([*torchrun(2), "-m", "ddpkit", "run", "--", str(script), str(tmp_path)],
                         capture_output=True, text=True, timeout=180, env=ddpkit_env())
    assert res.returncode == 0, res.stdout + res.stderr
    assert_written_in_full(tmp_path, 2)


@pytest.mark.parametrize(("how", "code", "named"), [
    ("exit", 5, "rank 1 (pid {pid}) failed first with exit code 5"),
    ("kill", 137, "rank 1 (pid {pid}) was killed by SIGKILL first"),
])
@pytest.mark.slow  # a minute or more
def test_the_rank_that_failed_first_is_named_and_its_code_is_the_commands(how: str, code: int, named: str,
                                                                           tmp_path: Path) -> None:
    """Ten runs each: rank 0 fails too (its all-reduce with rank 1 breaks), in the same second; neither the rank
    index nor the clock's one-second resolution may make it the culprit. The watch names the gone peer (DDP's C++
    all-reduce is counted, no watched call failed)."""
    script = _write(tmp_path, "fails.py", FAILS)
    for attempt in range(10):
        res = run_ddpkit("run", "-n", "2", "--", str(script), timeout=180, env=ddpkit_env(HOW=how))
        out = res.stdout + res.stderr
        assert res.returncode == code, f"attempt {attempt}: {out[-4000:]}"
        first = re.findall(r"rank (\d+) \(pid (\d+)\) (?:failed|was killed)[^\n]* first", out)
        assert len(first) == 1 and first[0][0] == "1", f"attempt {attempt}: {out[-4000:]}"
        assert named.format(pid=first[0][1]) in out
        assert "rank 0 (pid" not in out, out[-4000:]
        gone = f"rank 1 on host {HOST} (pid {first[0][1]}) is gone"
        assert out.count(gone) == 1, f"attempt {attempt}: the watch did not name the gone peer once\n{out[-4000:]}"


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_under_torchrun_its_root_cause_is_the_rank_that_failed_first(how: str, tmp_path: Path) -> None:
    script = _write(tmp_path, "fails.py", FAILS)
    res = subprocess.run([*torchrun(2), "-m", "ddpkit", "run", "--", str(script)], capture_output=True, text=True,
                         timeout=180, env=ddpkit_env(HOW=how))
    out = res.stdout + res.stderr
    assert res.returncode != 0
    root = out.split("Root Cause (first observed failure):", 1)[1]
    assert re.search(r"rank\s+: 1 \(local_rank: 1\)\s+exitcode\s+: " + ("5" if how == "exit" else "-9"), root), out
    assert re.search(r"rank\s+: 0 \(local_rank: 0\)\s+exitcode\s+: -15", out), out  # torchrun ended rank 0


@pytest.mark.parametrize("starts", ["ddpkit", "torchrun"])
def test_ddpkit_run_prints_the_sigterm_report_naming_the_peer_that_died(starts: str, tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed while ranks 0 and 2 are in no collective with it: nothing of theirs fails before their
    launcher ends them (SIGTERM). The SIGTERM report (watch/sigterm.py) names rank 1, once, under `ddpkit run`
    whoever started the ranks."""
    launcher = torchrun(3) if starts == "torchrun" else [sys.executable]
    runner = ("ddpkit", "run") if starts == "torchrun" else ("ddpkit", "run", "-n", "3")
    run = run_watched(launcher, tmp_path, "--fault", "kill", "--steps", "400", "--others-idle-s", "60",
                      runner=runner)
    out = run.output
    assert out.count(f"rank 1 on host {HOST} (pid ") == 1 and "is gone (its process no longer runs)" in out, out[-6000:]
    assert out.count("is told to stop (SIGTERM: the launcher is ending the job)") == 1, out[-6000:]
    assert [(e["event"], e["gone"]) for e in run.events] == [("rank-gone", [1])], run.events
    if starts == "ddpkit":
        assert "rank 1 (pid" in out and "was killed by SIGKILL first" in out and run.proc.returncode == 137, out
    assert leftover(run.tag) == []


@pytest.mark.parametrize(("options", "needle"), [
    (["--events", "/missing-dir-of-ddpkit/ev.jsonl"], "does not exist"),
    (["--hang-after", "inf"], "--hang-after inf"),
    (["--hang-after", "nan"], "--hang-after nan"),
    (["--hang-after", "-1"], "--hang-after -1"),
    (["--report-every", "inf"], "--report-every inf"),
])
def test_bad_inputs_are_refused_once_before_any_rank_starts(options: list[str], needle: str, tmp_path: Path) -> None:
    script = _write(tmp_path, "fails.py", FAILS)
    res = run_ddpkit("run", "-n", "2", *options, "--", str(script), timeout=60, env=ddpkit_env(HOW="exit"))
    assert res.returncode == 2, res.stdout + res.stderr
    assert res.stderr.count("ddpkit: error:") == 1 and needle in res.stderr, res.stderr
    assert "OMP_NUM_THREADS" not in res.stderr and res.stdout == "", res.stderr  # no agent, no rank started


def test_a_missing_script_is_refused_once_before_any_rank_starts(tmp_path: Path) -> None:
    res = run_ddpkit("run", "-n", "2", "--", str(tmp_path / "missing.py"), timeout=60)
    assert res.returncode == 2 and res.stderr.count("ddpkit: error: no script at") == 1, res.stderr
    assert "OMP_NUM_THREADS" not in res.stderr, res.stderr



@pytest.mark.parametrize("watch", [(), ("--no-watch",)])
def test_a_rank_that_finished_leaves_and_its_peer_fails_at_once(watch: tuple[str, ...], tmp_path: Path) -> None:
    """torch's wrapper of a forked worker kept a finished rank alive until every rank finished: its sockets open,
    rank 1 waited for it for good (the watch then called rank 0 'stopped answering' and the job ended by SIGKILL
    after 67 s). Now rank 0 leaves, rank 1's all-reduce fails at once and rank 1 is named; no C++ frame is shown."""
    script = _write(tmp_path, "extra.py", ONE_EXTRA_ALL_REDUCE)
    res = run_ddpkit("run", "-n", "2", *watch, "--", str(script), timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 1, out[-4000:]
    assert "rank 0 done" in out and "rank 1 done" not in out, out[-4000:]
    assert re.search(r"rank 1 \(pid \d+\) failed first with exit code 1", out), out[-4000:]
    assert "stopped answering" not in out and "HANG" not in out and not re.search(r"^\s*frame #\d+", out, re.M), out
    if not watch:  # rank 0 ended its process group: the watch says it finished, not that it is gone
        assert re.search(rf"rank 0 on host {HOST} \(pid \d+\) finished", out) and "is gone" not in out, out[-4000:]


# rank 0 stops itself (SIGSTOP) at step 300, in its loop: under env:// rank 0 holds the job's store, so every other
# rank's watch loses its store with it
STOPS_RANK_0 = "\nimport os, signal, time\n" + DDP_OPENING + """\
for step in range(3000):
    if step == 300 and rank == 0:
        os.kill(os.getpid(), signal.SIGSTOP)
    model(torch.randn(4, 16)).sum().backward()
    time.sleep(0.005)
dist.destroy_process_group()
"""


def assert_frozen_rank_0_named(out: str, events: list[dict[str, object]], hang_after: float) -> None:
    hangs = [e for e in events if e["event"] == "hang"]
    assert len(hangs) == 1 and hangs[0]["stopped"] == [0] and hangs[0]["holder"] == 0, (events, out[-4000:])
    assert float(hangs[0]["idle"]) <= hang_after + 10, hangs  # named within the deadline + 10 s  # type: ignore[arg-type]
    assert re.search(rf"held by rank 0 on host {HOST}, pid \d+\) has not answered for \d+ s: rank 0 is stopped "
                     r"\(SIGSTOP\); this rank stops at \d\d:\d\d:\d\d", out), out[-4000:]
    assert "stops (no progress and no store; exit 3)" in out, out[-4000:]


def test_a_frozen_rank_0_that_holds_the_store_is_named_and_the_job_stopped(tmp_path: Path) -> None:
    """A SIGSTOPped rank 0 (it holds the job's store) was a silent hang under `ddpkit run -n 2` (125 s, nothing said):
    rank 1's watch now watches on alone, names rank 0 stopped at its deadline and stops the job at --stop-after."""
    script = _write(tmp_path, "stops.py", STOPS_RANK_0)
    events = tmp_path / "events.jsonl"
    res = run_ddpkit("run", "-n", "2", "--hang-after", "8", "--stop-after", "25", "--events", str(events), "--",
                     str(script), timeout=150)
    out = res.stdout + res.stderr
    assert res.returncode == 3, out[-4000:]
    assert_frozen_rank_0_named(out, [json.loads(x) for x in events.read_text().splitlines()], 8)
    assert "failed first" not in out, out[-4000:]


# rank 0 finishes and leaves (its store with it); rank 1 works on alone for 20 s, its group still open
RANK_0_LEAVES_FIRST = "\nimport time\n" + DDP_OPENING + """\
for step in range(400):
    model(torch.randn(4, 16)).sum().backward()
if rank == 1:
    time.sleep(20)  # writing results alone
    print("rank 1 wrote its results", flush=True)
dist.destroy_process_group()
"""


def test_a_rank_that_works_on_after_the_store_holder_finished_is_left_alone(tmp_path: Path) -> None:
    """The store's holder (rank 0) finished: its last record is final, so rank 1's watch does not take the silent
    store for a frozen rank 0, however long rank 1 works on (--stop-after 12 < its 20 s)."""
    script = _write(tmp_path, "leaves.py", RANK_0_LEAVES_FIRST)
    res = run_ddpkit("run", "-n", "2", "--hang-after", "5", "--stop-after", "12", "--", str(script), timeout=150)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "rank 1 wrote its results" in out, out[-4000:]
    assert "HANG" not in out, out[-4000:]
