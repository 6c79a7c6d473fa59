"""Point-to-point calls watched like collectives (issue 36, item 7), on real ranks: ``ddpkit run -n 2`` runs a small
plain torch.distributed script (gloo) written to the test's folder.

Each script first takes a few steps of a tiny DDP model: the watch's deadline is ``--hang-after`` from the first
step on (5 times longer before), and the group then counts DDP's all-reduces, which gloo's count mixes with the
point-to-point calls.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import run_ddpkit
from tests.watch_jobs import HOST

pytestmark = pytest.mark.multiproc

HANG_AFTER = 5.0

PROLOGUE = """\
import random, sys, time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(torch.nn.Linear(4, 1))
for _ in range(3):
    model(torch.randn(2, 4)).sum().backward()
t = torch.zeros(4)
"""

# rank 1 waits for a message rank 0 never sends; rank 0 sleeps, waits in a barrier rank 1 never reaches, or takes a
# DDP step (it waits in DDP's C++ all-reduce, which the watch counts)
UNANSWERED = PROLOGUE + """\
how, rank0 = sys.argv[1], sys.argv[2]
if rank == 0:
    print("FAULT", time.time(), flush=True)
    if rank0 == "step":
        model(torch.randn(2, 4)).sum().backward()
    time.sleep(3600) if rank0 == "sleep" else dist.barrier()
elif how == "recv":
    dist.recv(t, src=0)
elif how == "irecv":
    dist.irecv(t, src=0).wait()
else:
    for req in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, 0)]):
        req.wait()
"""

# rank 0 sends 200 messages to rank 1: 50 ahead (isend) while both then compute for longer than the deadline, 150
# at an uneven pace (up to 0.9 s apart) that rank 1 receives blocking
PING_PONG = PROLOGUE + """\
rng = random.Random(rank)
if rank == 0:
    ahead = [dist.isend(torch.full((4,), float(i)), dst=1) for i in range(50)]
    time.sleep(6)
    for req in ahead:
        req.wait()
    for i in range(50, 200):
        time.sleep(0.9 if i % 40 == 0 else rng.uniform(0, 0.05))
        dist.send(torch.full((4,), float(i)), dst=1)
else:
    time.sleep(6)
    got = []
    for _ in range(200):
        dist.recv(t, src=0)
        got.append(int(t[0]))
    assert got == list(range(200)), got
model(torch.randn(2, 4)).sum().backward()
dist.barrier()
print("DONE", rank, flush=True)
"""


def _run(tmp_path: Path, script: str, *args: str) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    """``ddpkit run -n 2 --hang-after 5`` of ``script``: the run, and the watch's events."""
    job, events = tmp_path / "job.py", tmp_path / "events.jsonl"
    job.write_text(script)
    res = run_ddpkit("run", "-n", "2", "--hang-after", str(HANG_AFTER), "--events", str(events), "--", str(job),
                     *args, timeout=120)
    return res, [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []


@pytest.mark.parametrize(("how", "op", "rank0"), [("recv", "recv", "sleep"), ("recv", "recv", "barrier"),
                                                  ("irecv", "irecv", "barrier"),
                                                  ("batch", "batch_isend_irecv", "sleep"), ("recv", "recv", "step")])
def test_an_unanswered_receive_is_named_with_its_peer(how: str, op: str, rank0: str, tmp_path: Path) -> None:
    """Rank 1 waits in a receive from rank 0 that never comes (blocking, a wait on irecv's request, or on a batch's):
    the report names the call, rank 1 and rank 0 (alive, no send posted, and where it is: the same place the lines
    above say), within the deadline + 10 s, and every rank stops (exit 3). The stacks show the script's frames and
    torch's, not the watch's wrappers of torch's functions."""
    res, events = _run(tmp_path, UNANSWERED, how, rank0)
    out = res.stdout + res.stderr
    fault = float(next(x for x in res.stdout.splitlines() if "FAULT " in x).split("FAULT ")[1])
    hangs = [e for e in events if e["event"] == "hang"]
    assert len(hangs) == 1 and out.count("ddpkit watch: HANG") == 1, out[-6000:]
    assert float(hangs[0]["time"]) - fault <= HANG_AFTER + 10, (hangs[0]["time"], fault)
    assert f"rank 1 on host {HOST} has waited" in out and f"s in {op} #1 from rank 0 (called at job.py:" in out, \
        out[-6000:]
    where = {"sleep": "waits in no collective or point-to-point call", "barrier": "is in barrier #1",
             "step": "waits in the group's collective #N (DDP's gradient all-reduce on its C++ path: counted, not seen "
                     "one by one), which rank 1 has not entered"}[rank0]
    said = re.search(re.escape(f"rank 0 on host {HOST} is alive, has posted 0 sends to rank 1 and {where}")
                     .replace(re.escape("#N"), r"#(\d+)"), out)
    assert said is not None, out[-6000:]
    if rank0 == "step":  # the line above it says the same: rank 0 waits in that collective
        assert f"rank 0 on {HOST} has issued it (up to #{said.group(1)}) and waits for it to complete" in out, \
            out[-6000:]
    stacks = "".join(hangs[0]["stacks"].values())
    assert "job.py\", line" in stacks and "watch/p2p.py" not in stacks and "watch/hooks.py" not in stacks, stacks
    assert hangs[0]["p2p"]["1"]["peers"] == [["recv", 0]]
    assert "DESYNC" not in out and "backend-level hang" not in out, out[-6000:]
    if rank0 == "sleep":  # both ranks are at the same collective count: nobody is behind in one
        assert not hangs[0].get("behind") and "has not entered" not in out, out[-6000:]
    else:
        assert hangs[0]["behind"] == [1], out[-6000:]
    assert res.returncode == 3, out[-6000:]


def test_a_healthy_send_recv_exchange_raises_no_alarm(tmp_path: Path) -> None:
    """200 messages from rank 0 to rank 1: 50 sent ahead while both compute for 6 s (the group's count differs
    between the ranks by 50 then, with nobody waiting), then 150 at an uneven pace with rank 1 blocked in recv most
    of the time (longer than the deadline in all): no report, exit 0."""
    started = time.monotonic()
    res, events = _run(tmp_path, PING_PONG)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "DONE 0" in res.stdout and "DONE 1" in res.stdout, out[-6000:]
    assert "ddpkit watch: HANG" not in out and not [e for e in events if e["event"] == "hang"], out[-6000:]
    assert time.monotonic() - started > 2 * HANG_AFTER  # long enough for a false alarm to have come
