"""What the watch says about ranks that left, and the user's tracebacks (issue 44, items 6 and 7), on real ranks under
``ddpkit run -n 2``: a rank that finished is said to have finished, not to be gone; the watch's wrappers of torch's
functions (``watch/hooks.py``, ``watch/p2p.py``) are in no traceback a user reads. (A rank ddpkit stopped, named so
under mpirun: tests/infra/test_watch_launchers.py; a ``recv`` report's words and stacks: test_watch_p2p.py.)
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import run_ddpkit
from tests.watch_jobs import HOST

pytestmark = pytest.mark.multiproc

# rank 1 makes one all-reduce more than rank 0, of the size of DDP's bucket: the calls pair up one step off, rank 0
# finishes its loop and ends its process group, rank 1's last all-reduce fails when rank 0 leaves
ONE_EXTRA = """
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


def test_a_rank_that_finished_is_said_to_have_finished(tmp_path: Path) -> None:
    script = tmp_path / "extra.py"
    script.write_text(ONE_EXTRA)
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
