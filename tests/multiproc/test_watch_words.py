"""What the watch says about ranks that left, the user's tracebacks, and the summary's step times (issue 44, items 6
and 7), on real ranks under ``ddpkit run -n 2``: a rank that finished is said to have finished, not to be gone; the
watch's wrappers of torch's functions (``watch/hooks.py``, ``watch/p2p.py``) are in no traceback a user reads; a
single stall, which the sampled p99 passes over, is the summary's longest step. (A rank ddpkit stopped, named so
under mpirun: tests/infra/test_watch_launchers.py; a ``recv`` report's words and stacks: test_watch_p2p.py.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers import DDP_OPENING, run_ddpkit
from tests.watch_jobs import HOST, ONE_EXTRA_ALL_REDUCE

pytestmark = pytest.mark.multiproc


def test_a_rank_that_finished_is_said_to_have_finished(tmp_path: Path) -> None:
    script = tmp_path / "extra.py"
    script.write_text(ONE_EXTRA_ALL_REDUCE)
    res = run_ddpkit("run", "-n", "2", "--", str(script), timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 1 and "rank 0 done" in out, out[-4000:]
    assert re.search(rf"rank 0 on host {HOST} \(pid \d+\) finished: it ended its process group and its process "
                     r"exited", out), out[-4000:]
    assert "is gone" not in out, out[-4000:]


# MODE forward: rank 1's model raises in its 4th forward; the script prints the traceback it caught (CAUGHT ...), then
# lets it go. MODE wait: rank 1 waits 1 s on a receive rank 0 never sends (Work.wait's timeout, raised in C++),
# prints the traceback it caught, and both ranks end well.
RAISES = """
import sys, traceback
from datetime import timedelta
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()


class Net(torch.nn.Linear):
    calls = 0

    def forward(self, x):
        if self.calls == 3 and rank == 1:
            raise ValueError("a bad batch")
        self.calls += 1
        return super().forward(x)


model = torch.nn.parallel.DistributedDataParallel(Net(4, 1))
try:
    if sys.argv[1] == "forward":
        for _ in range(10):
            model(torch.randn(2, 4)).sum().backward()
    elif rank == 1:
        dist.irecv(torch.zeros(4), src=0).wait(timeout=timedelta(seconds=1))
except Exception:
    print("CAUGHT " + traceback.format_exc().replace(chr(10), " | "), flush=True)
    if sys.argv[1] == "forward":
        raise
dist.destroy_process_group()
"""


@pytest.mark.parametrize("mode", ["forward", "wait"])
def test_tracebacks_show_the_users_frames_and_torchs_not_the_watchs(mode: str, tmp_path: Path) -> None:
    """The script's own ``except`` (both modes) and ``ddpkit run``'s report of the exception that ended the script
    (forward) show the script's lines and torch's, not the watch's wrappers that the calls passed through."""
    script = tmp_path / "job.py"
    script.write_text(RAISES)
    res = run_ddpkit("run", "-n", "2", "--", str(script), mode, timeout=120)
    out = res.stdout + res.stderr
    caught = next((line for line in out.splitlines() if "CAUGHT " in line), "")
    assert "job.py" in caught and ("a bad batch" if mode == "forward" else "imeout") in caught, out[-4000:]
    assert "ddpkit/watch/" not in caught, caught.replace(" | ", "\n")
    if mode == "wait":
        assert res.returncode == 0, out[-4000:]
        return
    assert res.returncode == 1, out[-4000:]
    logs = Path(re.search(r"full logs: (\S+)/ ", out).group(1))  # type: ignore[union-attr]
    shown = (logs / "rank-1.stderr.log").read_text()
    assert 'job.py", line' in shown and "ValueError: a bad batch" in shown, shown
    assert "ddpkit/watch/" not in shown, shown


# every rank takes 60 steps; after step 25 rank 0 stalls 3 s outside any collective (a slow write), rank 1 waits in
# the next step's all-reduce: one stall in 60 steps, in a step the watch does not time (one in ten is)
STALLS = "\nimport time\n" + DDP_OPENING + """\
for step in range(60):
    model(torch.randn(4, 16)).sum().backward()
    if step == 25 and rank == 0:
        time.sleep(3)
    time.sleep(0.005)
dist.destroy_process_group()
"""


def test_the_summary_shows_a_single_stall_that_p99_hides(tmp_path: Path) -> None:
    script, events = tmp_path / "stalls.py", tmp_path / "events.jsonl"
    script.write_text(STALLS)
    res = run_ddpkit("run", "-n", "2", "--events", str(events), "--", str(script), timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    summary = next(json.loads(x) for x in events.read_text().splitlines() if '"summary"' in x)
    rank_0 = summary["ranks"]["0"]
    assert rank_0["step_p99_s"] < 1 and rank_0["step_max_s"] >= 3 and rank_0["step_max_at"] == 25, summary
    assert summary["hosts"][HOST]["step_max_s"] >= 3, summary
    assert re.search(r"^\[\S+\]\s+0\s+" + HOST + r"\s+60\s.*\s3\.\d s \(step 25\)", out, re.M), out[-4000:]
    assert re.search(rf"host {HOST}: ranks 0 and 1, .*longest 3\.\d s \(step 2[56], rank [01]\)", out), out[-4000:]
