"""The goodput ledger on a real job, and its report in a real browser: ``ddpkit train -n 2 --heal`` with two
injected faults (rank 1 killed by SIGKILL in epochs 1 and 3: the train drills) runs three attempts, each resumed
from the newest snapshot. Its ledger's categories add up to the wall clock within 1%, the lost progress is the
steps done again (read from the trainer's own output), and ``ddpkit report`` turns the run directory into an HTML
page and a trace that headless Chromium (Debian's) opens, showing all three attempts, with no console message."""

from __future__ import annotations

import json
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddpkit.goodput.accounting import Category
from ddpkit.goodput.records import Loaded, read_goodput
from ddpkit.reports.run import load_run
from ddpkit.rundir.ledger import Ledger
from tests.helpers import require_tools, run_ddpkit

pytestmark = pytest.mark.multiproc


@dataclass(frozen=True)
class Job:
    run_dir: Path
    out: str
    code: int
    started: float
    ended: float


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Job:
    work = tmp_path_factory.mktemp("goodput")
    (work / "snaps").mkdir()
    started = time.time()
    res = run_ddpkit("train", "-n", "2", "--heal", "--run-dir", "run", "--epochs", "5", "--snapshot-path", "snaps/",
                     "--drill", "kill-worker@epoch=1,rank=1", "--drill", "kill-worker@epoch=3,rank=1",
                     timeout=300, cwd=work)
    return Job(run_dir=work / "run", out=res.stdout + res.stderr, code=res.returncode, started=started,
               ended=time.time())


def test_three_attempts_add_up_to_the_wall_clock_and_lose_exactly_the_steps_done_again(job: Job) -> None:
    assert job.code == 0, job.out
    assert [e.exit_code for e in Ledger(job.run_dir).ended()] == [137, 137, 0], job.out
    split = load_run(job.run_dir).split
    assert [a.attempt for a in split.attempts] == [1, 2, 3]
    assert abs(split.accounted_s - split.wall_s) <= 0.01 * split.wall_s
    # the ledger's wall clock is the command's, less the interpreter's exit after the last attempt
    assert job.ended - job.started - 2.0 <= split.wall_s <= job.ended - job.started
    # steps done again, from the trainer's own words: each drill's step, and the snapshot the next attempt loaded
    fired = [int(s) for s in re.findall(r"killing rank 1 \(pid \d+\) with SIGKILL at step (\d+)", job.out)]
    resumed = [int(s) for s in re.findall(r"Loading snapshot \S+?\.0*(\d+)\.pt", job.out)]
    assert len(fired) == 2 and len(resumed) == 2, job.out
    done_again = sum(f - r for f, r in zip(fired, resumed, strict=True))
    assert done_again > 0
    assert split.lost_steps == done_again
    assert split.seconds[Category.LOST_PROGRESS] > 0 and split.seconds[Category.FAILURE] > 0
    assert [r.step for r in read_goodput(job.run_dir) if isinstance(r, Loaded)] == [None, *resumed]
    # both ranks timed their gradient sync (ddpkit's hook), so the straggler wait is measured, not assumed zero
    view = load_run(job.run_dir)
    assert set(view.rank_steps) == {0, 1}
    for rank, lines in view.rank_steps.items():
        assert lines and all(r.sync_s is not None and 0 < r.sync_s <= r.busy_s for r in lines), (rank, lines[:2])
    assert split.seconds[Category.STRAGGLER_WAIT] >= 0
    print("split (s): " + ", ".join(f"{c.value} {v:.3f}" for c, v in split.seconds.items())
          + f"; wall {split.wall_s:.3f}, goodput {split.goodput:.3f}, lost steps {split.lost_steps}")


def _chromium(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    require_tools("chromium")
    try:
        res = subprocess.run(["chromium", "--headless", "--disable-gpu", "--no-sandbox", "--enable-logging=stderr",
                              "--v=0", *args], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.fail(f"headless chromium did not run: {exc}")
    assert res.returncode == 0, f"chromium exited {res.returncode}: {res.stderr[-2000:]}"
    return res


def _console(stderr: str) -> list[str]:
    """Console messages of the page (an uncaught exception, console.error): the page writes none."""
    return [line for line in stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]


def test_the_html_page_opens_in_headless_chromium_with_its_pictures_and_all_three_attempts(job: Job) -> None:
    assert job.code == 0, job.out
    page = job.run_dir.parent / "run.html"
    report = run_ddpkit("report", str(job.run_dir), "--html", str(page), "--trace",
                        str(job.run_dir.parent / "run.trace.json"), timeout=120)
    assert report.returncode == 0, report.stdout + report.stderr
    res = _chromium("--dump-dom", page.resolve().as_uri())
    dom = res.stdout
    assert 'data-ddpkit-ready="4"' in dom, dom[:500]  # the page's script ran and counted its four figures
    assert dom.count("<svg") == 4
    for attempt in (1, 2, 3):
        assert f"attempt {attempt}" in dom
    assert dom.count("was killed by SIGKILL") >= 2
    assert "waiting for a slower rank" in dom and "<td>1</td>" in dom  # the per-rank table, rank 1's row
    assert _console(res.stderr) == []
    shot = job.run_dir.parent / "run.png"
    _chromium("--hide-scrollbars", "--window-size=1200,2400", f"--screenshot={shot}", page.resolve().as_uri())
    assert shot.stat().st_size > 20_000  # a rendered page, not a blank one


def test_the_trace_loads_as_json_and_in_chromium_with_every_attempt(job: Job) -> None:
    assert job.code == 0, job.out
    trace = job.run_dir.parent / "run.trace.json"
    if not trace.exists():
        run_ddpkit("report", str(job.run_dir), "--trace", str(trace), timeout=120)
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert [e["name"] for e in complete if e["cat"] == "attempt"] == ["attempt 1", "attempt 2", "attempt 3"]
    for attempt in (1, 2, 3):  # each rank's steps in its own lane of each attempt
        assert {e["tid"] for e in complete if e["pid"] == attempt and e["cat"] in ("steps", "lost-progress")} \
            == {1, 2}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in complete)
    res = _chromium("--dump-dom", trace.resolve().as_uri())
    assert '"attempt 3"' in res.stdout and _console(res.stderr) == []
