"""``ddpkit run``'s goodput ledger, from the watch (``watch.steplines``): a user's unchanged DDP script under
``run -n 2 --run-dir`` gets the lines ``train`` writes (rank 0's start, its DDP steps without gaps, the end), the
other rank its own step lines, so the straggler wait under DDP's C++ all-reduce is measured; ``ddpkit report`` splits
the time. Under ``--heal`` a killed rank makes two attempts, each with its lines, the steps done again lost."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from ddpkit.goodput.accounting import Category
from ddpkit.goodput.records import Finished, RankStarted, Steps, rank_file, read_goodput
from ddpkit.reports.run import load_run
from tests.helpers import run_ddpkit

pytestmark = pytest.mark.multiproc

#: A DDP loop; rank 1 takes 10 ms longer a step (a straggler); with KILL_AT, rank 1 kills itself at that step in
#: the first attempt.
SCRIPT = """\
import os, signal, sys, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
steps, kill_at = int(sys.argv[1]), int(sys.argv[2])
for step in range(steps):
    loss = model(torch.randn(16, 8)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    time.sleep(0.01 * (1 + dist.get_rank()))
    if step == kill_at and dist.get_rank() == 1 and os.environ.get("DDPKIT_ATTEMPT") == "1":
        os.kill(os.getpid(), signal.SIGKILL)
dist.destroy_process_group()
"""


def _lines(run_dir: Path, rank: int = 0) -> list[object]:
    return list(read_goodput(run_dir if rank == 0 else run_dir / rank_file(rank)))


def test_a_scripts_steps_are_its_goodput_lines_and_the_straggler_is_seen(tmp_path: Path) -> None:
    (tmp_path / "loop.py").write_text(SCRIPT)
    res = run_ddpkit("run", "-n", "2", "--run-dir", "run", "--", "loop.py", "120", "-1", timeout=240, cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    zero = _lines(tmp_path / "run")
    assert isinstance(zero[0], RankStarted) and zero[0].world_size == 2
    steps = [r for r in zero if isinstance(r, Steps)]
    # steps 1..119 ended (the 120th was in flight at the end), windows back to back
    assert steps[0].first == 1 and steps[-1].last == 119, zero
    assert all(a.last + 1 == b.first and a.end == b.start for a, b in itertools.pairwise(steps)), zero
    assert steps[0].start >= zero[0].time, zero  # (a window from the epoch's 0: a race the watch's thread had)
    assert isinstance(zero[-1], Finished) and zero[-1].step == 119 and zero[-1].outcome == "completed", zero
    one = [r for r in _lines(tmp_path / "run", 1) if isinstance(r, Steps)]
    assert one and one[-1].last == 119 and all(r.rank == 1 for r in one), one
    assert any(s.sync_s is not None for s in steps) and any(s.sync_s is not None for s in one), (zero, one)
    split = load_run(tmp_path / "run").split
    assert abs(split.accounted_s - split.wall_s) <= 0.01 * split.wall_s, (split.seconds, split.wall_s, zero)
    assert split.seconds[Category.UNMEASURED] == 0.0 and split.seconds[Category.TRAINING] > 0, split.seconds
    assert split.seconds[Category.STRAGGLER_WAIT] > 0, (split.seconds, zero, one)  # rank 0 waits for rank 1
    report = run_ddpkit("report", "run", timeout=120, cwd=tmp_path)
    assert report.returncode == 0 and "run: 1 attempt(s), goodput " in report.stdout, report.stdout + report.stderr


def test_under_heal_a_killed_rank_makes_two_attempts_each_with_its_lines(tmp_path: Path) -> None:
    (tmp_path / "loop.py").write_text(SCRIPT)
    res = run_ddpkit("run", "-n", "2", "--heal", "--run-dir", "run", "--", "loop.py", "160", "100", timeout=300,
                     cwd=tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = _lines(tmp_path / "run")
    by_attempt = {a: [r for r in lines if isinstance(r, Steps) and r.attempt == a] for a in (1, 2)}
    assert by_attempt[1] and by_attempt[1][-1].last <= 101, by_attempt[1]  # rank 1 died in step 101
    assert by_attempt[2][0].first == 1 and by_attempt[2][-1].last == 159
    assert [r.attempt for r in lines if isinstance(r, Finished)] == [2]
    split = load_run(tmp_path / "run").split
    assert [a.attempt for a in split.attempts] == [1, 2]
    assert abs(split.accounted_s - split.wall_s) <= 0.01 * split.wall_s
    assert split.attempts[0].seconds[Category.FAILURE] > 0  # from its last line to the attempt's end
    # the script starts again from step 1: every step the first attempt had done is done again
    assert split.lost_steps == by_attempt[1][-1].last
