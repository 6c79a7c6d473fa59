"""What the watch says about ranks that left (issue 44, item 6), on real ranks under ``ddpkit run -n 2``: a rank that
finished is said to have finished, not to be gone. (A rank ddpkit stopped, named so under mpirun:
tests/infra/test_watch_launchers.py.)
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
