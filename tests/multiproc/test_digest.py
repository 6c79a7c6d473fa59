"""The failure digest of `ddpkit run -n N`: a failed attempt on one screen, cause first, every rank's full output
in the run's log directory that the digest names (src/ddpkit/launch/ranklogs.py, digest.py)."""

from __future__ import annotations

import io
import logging
import os
import re
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpkit.launch.kernlog import read_kernel_log
from ddpkit.launch.ranklogs import RankLogs
from tests.helpers import ddpkit_env, run_ddpkit
from tests.multiproc.test_run import SCRIPT, assert_replicas_identical
from tests.watch_jobs import torchrun

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


def _run(script: Path, text: str, *options: str, ranks: int = 2, timeout: float = 180,
         env: dict[str, str] | None = None) -> tuple[int, str]:
    """`ddpkit run -n RANKS OPTIONS -- SCRIPT`, ``text`` written to ``script`` first: its exit code and what it
    said (stdout, then stderr)."""
    script.write_text(text)
    res = run_ddpkit("run", "-n", str(ranks), *options, "--", str(script), timeout=timeout, env=env)
    return res.returncode, res.stdout + res.stderr


def test_sixteen_ranks_one_raises_one_screen_cause_first_full_logs_named(tmp_path: Path) -> None:
    code, screen = _run(tmp_path / "keyerror.py", KEYERROR, ranks=16, timeout=600)
    assert code == 1, screen
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


OOM = """
import os
import torch.distributed as dist

rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
if rank == 1:  # into a memory cgroup of 64 MiB, then past it: the OOM killer ends this rank (SIGKILL)
    with open(os.path.join(os.environ["OOM_CGROUP"], "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    hog = [bytearray(1 << 20) for _ in range(400)]
dist.barrier()
"""


@pytest.fixture(name="memory_cgroup")
def memory_cgroup_fixture() -> Iterator[Path]:
    """A cgroup v1 memory group of 64 MiB (root, the memory controller mounted), removed after the test."""
    base = Path("/sys/fs/cgroup/memory")
    if os.geteuid() != 0 or not (base / "cgroup.procs").exists():
        pytest.skip("needs root and the cgroup v1 memory controller")
    group = base / f"ddpkit-oom-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(64 << 20))
        yield group
    finally:
        deadline = time.monotonic() + 10
        while (group / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.1)
        group.rmdir()


def test_a_rank_the_oom_killer_ended_gets_the_kernels_line(tmp_path: Path, memory_cgroup: Path) -> None:
    """Issue 39 item 5: a rank killed by SIGKILL gets the OOM killer's line for its pid from the kernel log (this
    machine can read /dev/kmsg as root; tests/unit/test_kernlog.py covers the parser and an unreadable log)."""
    if read_kernel_log() is None:
        pytest.skip("the kernel log cannot be read here")
    code, screen = _run(tmp_path / "oom.py", OOM, env=ddpkit_env(OOM_CGROUP=str(memory_cgroup)))
    assert code == 137, screen
    pid = re.search(r"rank 1 \(pid (\d+)\) was killed by SIGKILL first", screen)
    assert pid, screen
    assert re.search(rf"the kernel: Memory cgroup out of memory: Killed process {pid[1]} \(", screen), screen


def test_a_rank_the_agent_sigkilled_is_said_killed(tmp_path: Path) -> None:
    """Issue 39 item 4: torch's agent logs the pid it ends ("Terminating process P via signal SIGTERM", then
    "Unable to shutdown process P via SIGTERM , forcefully exiting via SIGKILL"); the rank is the one whose stderr
    log that process writes: here a real process writing rank 1's log."""
    logs = RankLogs(str(tmp_path), "vm", io.StringIO(), io.StringIO())
    dest = logs.specs.reify({0: {"RANK": "0"}, 1: {"RANK": "1"}, 2: {"RANK": "2"}})
    procs = []
    for local in (1, 2):
        with open(dest.stderrs[local], "wb") as err:
            procs.append(subprocess.Popen(["sleep", "60"], stderr=err))
    try:
        said = [("Terminating process %s via signal SIGTERM", procs[0].pid),
                ("Terminating process %s via signal SIGTERM", procs[1].pid),
                ("Unable to shutdown process %s via SIGTERM , forcefully exiting via SIGKILL", procs[0].pid)]
        for msg, pid in said:
            logs.failure_seen(logging.LogRecord("torch.multiprocessing.spawn", logging.WARNING, __file__, 1, msg,
                                                (pid,), None))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=10)
    lines = logs.digest_lines(first=0, ends=logs.ends({0: 1}, {0: 4242}))
    assert "  rank 1: killed by the agent (SIGKILL): still running after SIGTERM and its grace period" in lines, lines
    assert "  rank 2: ended by the agent (SIGTERM) after rank 0 failed" in lines, lines
    assert not any("no error" in line for line in lines), lines


#: rank 1 raises (tests/infra/test_step_digest_slurm.py runs it on Slurm too)
RAISES_ON_1 = KEYERROR.replace("rank == 11", "rank == 1")


def test_under_torchrun_the_root_cause_box_shows_the_ranks_own_traceback(tmp_path: Path) -> None:
    """``torchrun -m ddpkit run``: the failed rank's exception is written to torch's error file, so torchrun's
    "Root Cause" box shows its traceback (no ``@record`` in the user's script: pytorch/pytorch#66182) and ddpkit
    step reads it there when a node's ranks share one stream; the peer the failure ended writes none."""
    script = tmp_path / "raises.py"
    script.write_text(RAISES_ON_1)
    res = subprocess.run([*torchrun(2), "-m", "ddpkit", "run", "--", str(script)], capture_output=True, text=True,
                         timeout=180, env=ddpkit_env())
    out = res.stdout + res.stderr
    assert res.returncode != 0, out
    root = out.split("Root Cause (first observed failure):", 1)[1]
    assert re.search(r"rank\s+: 1 \(local_rank: 1\)", root), out
    assert re.search(r"traceback : Traceback \(most recent call last\):\n\s+File \"" + re.escape(str(script))
                     + r"\", line 11, in <module>\n\s+raise KeyError\(\"batch\"\)\n\s+KeyError: 'batch'", root), out
    assert "Connection closed by peer" not in root, out


#: rank 1 prints its epochs to stdout and SIGKILLs itself in epoch 2 of the first attempt only; a DataLoader with
#: pin_memory=True on a machine with no accelerator has torch warn on every rank's stderr as it starts
KILLED_IN_EPOCH_2 = """
import os, signal
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

dist.init_process_group("gloo")
rank = dist.get_rank()
first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
batches = DataLoader(torch.ones(8, 4), batch_size=4, pin_memory=True)
for epoch in range(4):
    for batch in batches:
        dist.all_reduce(batch)
    print(f"rank {rank}: epoch {epoch} done", flush=True)
    if epoch == 2 and rank == 1 and first:
        os.kill(os.getpid(), signal.SIGKILL)
"""


def _restart_digest(screen: str) -> list[str]:
    """The lines of the digest said before the agent's restart: its headline and the indented lines under it."""
    lines = screen.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ddpkit: attempt 0 failed"))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("  ")), len(lines))
    return lines[start:end]


def test_a_restart_names_the_killed_rank_first_as_the_final_digest_does(tmp_path: Path) -> None:
    """Issue 44 item 5: the digest before a --max-restarts restart reads torch's typed failure as the final one
    does: the rank killed by SIGKILL first, with its pid, its own words first, the survivor after."""
    code, screen = _run(tmp_path / "killed.py", KILLED_IN_EPOCH_2, "--max-restarts", "1")
    assert code == 0, screen
    digest = _restart_digest(screen)
    assert re.fullmatch(r"ddpkit: attempt 0 failed: rank 1 \(pid \d+\) was killed by SIGKILL first; the agent "
                        r"restarts the ranks", digest[0]), screen
    assert digest[1] == f"  rank 1 on host {HOST}:", screen  # the culprit first, the survivor after
    assert any(line.startswith("  rank 0: ") for line in digest[2:]), screen
    assert not any("exit code not reported" in line for line in digest), screen


def test_a_killed_ranks_last_lines_are_its_own_not_torchs_start_up_warning(tmp_path: Path) -> None:
    """Issue 44 item 7: a rank killed mid-run left only torch's start-up warning on its stderr; the digest shows
    the rank's own last lines (its stdout) instead."""
    code, screen = _run(tmp_path / "killed.py", KILLED_IN_EPOCH_2)
    assert code == 137, screen
    lines = screen.splitlines()
    start = lines.index(f"  rank 1 on host {HOST}:")
    block = lines[start + 1:next(i for i in range(start + 1, len(lines)) if lines[i].startswith("  rank 0"))]
    assert block[-1].strip() == "rank 1: epoch 2 done", screen
    assert not any("Warning" in line or "super().__init__" in line for line in block), screen


def test_a_syntax_error_is_said_with_its_file_line_and_source(tmp_path: Path) -> None:
    """Issue 44 item 7: the digest of a script that does not compile shows where, as Python does: file and line,
    the source line and the caret under it, then the error."""
    script = tmp_path / "broken.py"
    code, screen = _run(script, "import torch\nx = 1\nif x == 1\n    print(x)\n")
    assert code == 1, screen
    lines = screen.splitlines()
    start = next(i for i, line in enumerate(lines) if re.fullmatch(rf"  rank \d on host {HOST}:", line))
    assert lines[start + 1:start + 5] == [f'    File "{script}", line 3', "      if x == 1",
                                          "               ^", "    SyntaxError: expected ':'"], screen
