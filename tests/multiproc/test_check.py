"""`ddpkit check` on real gloo process groups: passes, names missing and wrong ranks, never hangs, leaves no orphans."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ddpkit_env, free_port, gloo_status, require_tools, run_ddpkit

pytestmark = pytest.mark.multiproc

OPS = ("barrier", "all_reduce_sum", "all_reduce_max", "broadcast", "reduce", "all_gather", "reduce_scatter",
       "all_to_all", "send_recv_ring")


def _checks(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in report["checks"]}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _processes_mentioning(token: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if token.encode() in f.read():
                        found.append(int(entry))
            except OSError:
                continue
    return found


def _assert_no_orphans(pids: list[int], token: str) -> None:
    """Every rank (by PID) and every process started with this run's unique argument is gone (10 s grace)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and ([p for p in pids if _alive(p)] or _processes_mentioning(token)):
        time.sleep(0.2)
    assert not [p for p in pids if _alive(p)], f"rank processes left running: {pids}"
    assert not _processes_mentioning(token), "processes of the run left behind"


@pytest.mark.parametrize("nproc,via", [(3, "ddpkit -n"), (2, "torchrun")])
def test_local_ranks_pass(nproc: int, via: str, tmp_path: Path) -> None:
    """3 ranks started by ddpkit (forked from its agent), 2 by plain torchrun (its agent hosts the store)."""
    out = tmp_path / "check.json"
    args = ["check", "--json", str(out), "--rank-lines"]
    if via == "torchrun":
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                               str(nproc), "-m", "ddpkit", *args], capture_output=True, text=True, timeout=180,
                              env=ddpkit_env())
    else:
        proc = run_ddpkit(*args, "-n", str(nproc), timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    checks = _checks(report)
    assert report["kind"] == "check" and report["exit_code"] == 0
    assert all(c["status"] == gloo_status(n) for n, c in checks.items()), checks
    assert set(OPS) | {"roll-call", "versions", "comm-settings", "route-to-master", "ddp-sync"} <= set(checks)
    assert sorted(r["rank"] for r in report["ranks"]) == list(range(nproc))
    assert all(r["launcher"] == "torchrun" and r["iface"] == "lo" for r in report["ranks"])
    assert all(r["threads"] == max(1, len(os.sched_getaffinity(0)) // nproc) for r in report["ranks"])
    assert f"identical on {nproc} ranks" in checks["ddp-sync"]["detail"]
    per_rank = checks["ddp-sync"]["data"]["per_rank"]
    assert len(per_rank) == nproc and all(r["max_diff_ranks"] == 0.0 and r["within_tolerance"] for r in per_rank)
    assert all(r["local_only_diff"] > 1e-4 for r in per_rank), "the DDP check must be able to fail"
    # the human report: a node table, one line per check, the verdict, then the seeds' lines in rank order
    lines = proc.stdout.splitlines()
    assert any("LOCAL_WORLD_SIZE" in line for line in lines)
    assert any(line.startswith("PASS") and "all_reduce_sum" in line for line in lines)
    assert f"verdict: PASS: {nproc} rank(s)" in proc.stdout
    host = socket.gethostname()
    hello = [line for line in lines if line.startswith("Start running basic DDP example")]
    assert hello == [f"Start running basic DDP example on rank {r}." for r in range(nproc)]
    assert [line for line in lines if line.startswith(f"{host}: ")] == [f"{host}: {r} of {nproc}"
                                                                      for r in range(nproc)]


def test_corrupted_collective_and_version_mismatch_fail_naming_rank(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    faults = "corrupt:op=all_gather:rank=1;version:rank=1:torch=9.9.9"
    proc = run_ddpkit("check", "-n", "2", "--json", str(out), env=ddpkit_env(DDPKIT_FAULTS=faults), timeout=180)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    checks = _checks(json.loads(out.read_text()))
    assert checks["all_gather"]["status"] == "FAIL" and checks["all_gather"]["bad_ranks"] == [1]
    assert "rank 1: 1 of 2048 elements wrong" in checks["all_gather"]["detail"]
    assert checks["versions"]["status"] == "FAIL" and checks["versions"]["bad_ranks"] == [1]
    assert "9.9.9 on rank 1" in checks["versions"]["detail"]
    others = [name for name in OPS if name != "all_gather"] + ["ddp-sync", "roll-call"]
    assert all(checks[n]["status"] == gloo_status(n) for n in others), checks
    assert "verdict: FAIL (exit 1): versions, all_gather" in proc.stdout


def _start_rank(rank: int, world: int, port: int, *extra: str) -> subprocess.Popen[str]:
    env = ddpkit_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-m", "ddpkit", "check", *extra], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def test_world_of_three_with_two_started_names_rank_2(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    port = int(free_port())
    # a deadline that a loaded machine's second rank (importing torch) still meets: only rank 2 is missing
    procs = [_start_rank(0, 3, port, "--timeout", "15", "--json", str(out)),
             _start_rank(1, 3, port, "--timeout", "15")]
    try:
        results = [p.communicate(timeout=120) for p in procs]  # the deadline is 15 s: a hang fails the test here
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    assert [p.returncode for p in procs] == [3, 3], results
    stdout0 = results[0][0]
    assert f"rank 2 on node 0 ({socket.gethostname()})" in stdout0
    assert "verdict: FAIL (exit 3): roll-call" in stdout0
    roll = _checks(json.loads(out.read_text()))["roll-call"]
    assert roll["bad_ranks"] == [2] and roll["status"] == "FAIL"
    assert "init" not in json.loads(out.read_text())["timings"], "no collective may start with a rank missing"


def test_duplicate_rank_is_named(tmp_path: Path) -> None:
    port = int(free_port())
    procs = [_start_rank(0, 3, port, "--timeout", "20"), _start_rank(1, 3, port), _start_rank(1, 3, port)]
    try:
        results = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    # three processes arrived for three ranks, so rank 0 judges at once: rank 1 twice, rank 2 missing
    assert [p.returncode for p in procs] == [3, 3, 3], results
    text = results[0][0]
    pids = sorted(str(p.pid) for p in procs[1:])
    assert "unique-ranks" in text and "rank 1 claimed by" in text and all(f"pid {pid}" in text for pid in pids)
    assert "rank 2 on node 0" in text


@pytest.mark.parametrize("stuck", [1, 0])
def test_rank_that_never_enters_a_collective_hits_the_deadline(stuck: int, tmp_path: Path) -> None:
    """The watch keeps check's deadlines. Rank 1 stuck: rank 0 reports. Rank 0 stuck (it hosts nothing here, but
    prints the check's report): rank 1's watch reports, and rank 0 still prints the report before every rank exits."""
    token = uuid.uuid4().hex
    out = tmp_path / f"check-{token}.json"
    env = ddpkit_env(DDPKIT_FAULTS=f"hang:phase=all_gather:rank={stuck}")
    proc = run_ddpkit("check", "-n", "2", "--phase-timeout", "4", "--json", str(out), env=env, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    other = 1 - stuck
    assert f"phase 'all_gather' passed its 4 s deadline on rank {other}" in report["deadline"]
    assert f"ranks that had not reached it: rank {stuck} (last: reduce done)" in report["deadline"]
    assert "verdict: FAIL (exit 3): deadline" in proc.stdout
    # the watch's report: the phase, the rank short of it and the collective the other waits in, then every rank's
    # stacks: the stuck one shows where it hung, the other the collective it waits in
    host = socket.gethostname().split(".")[0]
    assert f"ddpkit watch: DEADLINE: phase 'all_gather' passed its 4 s deadline on rank {other}" in proc.stderr
    assert f"rank {stuck} on host {host} has not entered all_gather #" in proc.stderr
    stacks = {r: proc.stderr.split(f"--- rank {r} on host {host} (pid ")[1].split("\n---")[0] for r in (0, 1)}
    assert "in _consult_faults" in stacks[stuck] and "in all_gather" in stacks[other], proc.stderr
    assert f"rank {stuck} on host {host} stops (hang reported by rank {other}; exit 3)" in proc.stderr
    _assert_no_orphans([int(r["pid"]) for r in report["ranks"]], token)


@pytest.mark.infra
def test_open_mpi_two_ranks_pass(tmp_path: Path) -> None:
    require_tools("mpirun")
    out = tmp_path / "check.json"
    proc = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, "-m",
                           "ddpkit", "check", "--json", str(out)], capture_output=True, text=True, timeout=180,
                          env=ddpkit_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert all(c["status"] == gloo_status(c["name"]) for c in report["checks"]), report["checks"]
    assert sorted((r["rank"], r["launcher"]) for r in report["ranks"]) == [(0, "openmpi"), (1, "openmpi")]
