"""The failure digest of `ddpkit run -n N`: a failed attempt on one screen, cause first, every rank's full output
in the run's log directory that the digest names (src/ddpkit/launch/ranklogs.py, digest.py)."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from tests.helpers import ddpkit_env, run_ddpkit
from tests.multiproc.test_run import SCRIPT, assert_replicas_identical

pytestmark = pytest.mark.multiproc
HOST = socket.gethostname().split(".", 1)[0]

KEYERROR = """
import os
import torch
import torch.distributed as dist

rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
t = torch.ones(4)
for step in range(6):
    if rank == 11 and step == 3:
        raise KeyError("batch")
    dist.all_reduce(t)
print(f"rank {rank} done", flush=True)
"""


def test_sixteen_ranks_one_raises_one_screen_cause_first_full_logs_named(tmp_path: Path) -> None:
    script = tmp_path / "keyerror.py"
    script.write_text(KEYERROR)
    res = run_ddpkit("run", "-n", "16", "--", str(script), timeout=600)
    screen = res.stdout + res.stderr
    assert res.returncode == 1, screen
    lines = screen.splitlines()
    assert len(lines) <= 40, screen  # 53 before the digest (seen 2026-11-26)
    assert not any(re.match(r"^\s*frame #\d+:", line) for line in lines), screen
    assert "Terminating process" not in screen, screen
    named = screen.index("rank 11 (pid ")
    assert screen.index(f"rank 11 on host {HOST}") > named and screen.index("KeyError: 'batch'") > named, screen
    assert "RuntimeError" not in screen[:screen.index("KeyError: 'batch'")], screen  # rank 11's words come first
    assert screen.count("Traceback (most recent call last)") == 0, screen  # no rank's whole traceback
    logs = re.search(r"full logs: (\S+)", screen)
    assert logs is not None, screen
    directory = Path(logs[1])
    culprit = (directory / "rank-11.stderr.log").read_text()
    assert culprit.startswith("Traceback (most recent call last):") and 'raise KeyError("batch")' in culprit
    assert culprit.rstrip().endswith("KeyError: 'batch'")
    other = "".join((directory / f"rank-{r}.stderr.log").read_text() for r in range(16) if r != 11)
    assert "Connection closed by peer" in other  # the other ranks' secondary tracebacks: in the files, not on screen


def test_a_healthy_run_prefixes_each_rank_line_and_leaves_no_logs_behind(tmp_path: Path) -> None:
    res = run_ddpkit("run", "-n", "2", "--", str(SCRIPT), timeout=180, env=ddpkit_env(TMPDIR=str(tmp_path)))
    assert res.returncode == 0, res.stdout + res.stderr
    assert_replicas_identical(res.stdout, 2)
    results = [line for line in res.stdout.splitlines() if "RESULT" in line]
    assert sorted(line.split(" RESULT ")[0] for line in results) == [f"[{HOST}:0]", f"[{HOST}:1]"], res.stdout
    assert "full logs" not in res.stderr and not list(tmp_path.glob("ddpkit-run-*"))
