"""Issue 38 on a real Slurm cluster of three namespace nodes: ``ddpkit submit slurm -j 2x1 --spare-nodes 1 --heal
--wait -- train ...``; a few seconds in, node2's ranks are stopped (SIGSTOP), killed (SIGKILL) or cut off (its link
down). The job ends COMPLETED; the ledger names node2, its evidence and its exclusion; node2 runs no later attempt;
the final loss history equals an uninterrupted run's, bitwise. A script that raises on every rank at step 5: two
attempts, exit 93 (do not requeue), the traceback right before the last line, no requeue.

This module's own cluster: a drill leaves a node cut off for a while, which no other test should meet.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from ddpkit.heal.classify import FailureClass
from ddpkit.heal.policy import EXIT_DO_NOT_REQUEUE
from ddpkit.rundir.ledger import AttemptEnded, AttemptStarted, FaultSeen, HostExcluded
from tests.helpers import raises_at_step
from tests.infra.slurm_fixture import HEAL_JOB_TIMEOUT as JOB_TIMEOUT
from tests.infra.slurm_fixture import HEAL_TRAIN as TRAIN
from tests.infra.slurm_fixture import clean_heal_run, heal_fixtures, job_ledger, job_log, pids_on, submit_healing

pytestmark = [pytest.mark.infra, pytest.mark.multiproc]
RAISES = raises_at_step(5, 10)


cluster, uninterrupted = heal_fixtures("ddpkit-slurm-heal-")


def _ranks_on(node: Any) -> list[int]:
    """The ranks in a node's namespace (``PYTHON -m ddpkit CMD``, or ``-m ddpkit run``): not Slurm's processes, not
    the supervisor (``-m ddpkit.heal.slurm_supervisor``) nor the client on node1."""
    return pids_on(node, lambda words: words[1:3] == [b"-m", b"ddpkit"] and len(words) > 3
                   and words[3] in (b"train", b"run"))


def _when_training(node: Any, snaps: Path, proc: subprocess.Popen[str], timeout: float = 120) -> list[int]:
    """Wait until two snapshots exist and the node has ranks, then 2 s more: a fault a few seconds in."""
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        if proc.poll() is not None:
            pytest.fail(f"the job ended before the fault: {proc.communicate()[0]}")
        if len(list(snaps.glob("snap.*.pt"))) >= 2 and _ranks_on(node):
            time.sleep(2)
            return _ranks_on(node)
        time.sleep(0.2)
    pytest.fail(f"no training on {node.name} within {timeout} s")


def _restore(c: Any, node: Any, fault: str) -> None:
    """After a cut the node's link up again; after a stop or a kill, the node idle in Slurm before the next test.
    After a cut Slurm hears from it only at its next ping (minutes): the link drill is the module's last."""
    if fault == "link":
        subprocess.run(["ip", "-n", node.netns, "link", "set", node.veth, "up"], check=False)
        return
    until = time.monotonic() + 120
    while time.monotonic() < until:
        states = c.client("sinfo", "-h", "-N", "-o", "%N %T").stdout.split()
        if dict(zip(states[::2], states[1::2], strict=False)).get(node.name) == "idle":
            return
        time.sleep(1)
    pytest.fail(f"{node.name} not idle again within 120 s")


def _drill(c: Any, tmp_path: Path, uninterrupted: dict[str, Any], fault: str, victim: int = 1) -> None:
    bad = c.nodes[victim]
    rank = victim  # one rank per node: rank R on node R+1
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    proc = submit_healing(c, tmp_path, *TRAIN, "--snapshot-path", str(snaps / "snap.pt"), "--json",
                   str(tmp_path / "summary.json"))
    try:
        victims = _when_training(bad, snaps, proc)
        fault_at = time.time()
        if fault == "link":
            subprocess.run(["ip", "-n", bad.netns, "link", "set", bad.veth, "down"], check=True)
        for pid in victims if fault != "link" else ():
            os.kill(pid, signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
        out, _ = proc.communicate(timeout=JOB_TIMEOUT + 60)
    finally:
        if proc.poll() is None:
            proc.kill()
        if fault == "stop":
            for pid in _ranks_on(bad):
                os.kill(pid, signal.SIGKILL)
        _restore(c, bad, fault)
    log = job_log(tmp_path)
    job = re.findall(r"^(\d+)$", out, re.M)[0]
    assert proc.returncode == 0 and f"job {job} COMPLETED exit code 0 (restarts 0)" in out, out + log

    records = job_ledger(tmp_path)
    ended = [r for r in records if isinstance(r, AttemptEnded)]
    started = [r for r in records if isinstance(r, AttemptStarted)]
    assert len(ended) == 2 and len(started) == 2, log
    found = ended[0].classification
    assert found is not None and found.kind is FailureClass.HOST and found.culprit_hosts == (bad.name,), log
    assert found.culprit_ranks == (rank,) and ended[0].action.value == "retry"
    expected = {"stop": "stopped answering", "link": "stopped answering", "kill": "killed by SIGKILL"}[fault]
    assert expected in found.reason and any(expected in e for e in found.evidence), found
    (excluded,) = [r for r in records if isinstance(r, HostExcluded)]
    assert excluded.host == bad.name and excluded.attempt == 1
    seen = [r for r in records if isinstance(r, FaultSeen)]
    print(f"{fault}: fault -> seen {seen[0].time - fault_at:.1f} s, -> decision {ended[0].time - fault_at:.1f} s")
    assert seen[0].time - fault_at <= 30, seen  # detection within 30 s (--silent-after 10 for a silent rank)
    # node2 runs no later attempt: not asked for, and no line of it after the decision
    after = tuple(n.name for n in c.nodes[:3] if n is not bad)
    assert started[0].hosts == ("node1", "node2") and started[1].hosts == after, started
    decision = f"ddpkit heal: attempt 1 of 3: {bad.name} excluded ("
    assert decision in log and f"relaunching on {', '.join(after)} from the snapshot of step {ended[0].progress}" \
        in log
    assert f"[{bad.name}:" not in log.split(decision, 1)[1], log
    assert f"ddpkit heal: preflight check passed on {', '.join(after)}" in log
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["resumed_from"] is not None, summary
    assert summary["loss_history"] == uninterrupted["loss_history"]  # bitwise: floats compared exactly


@pytest.mark.slow
def test_stopped_host_is_excluded_and_the_job_completes_bitwise(cluster: Any, tmp_path: Path,
                                                                 uninterrupted: dict[str, Any]) -> None:
    _drill(cluster, tmp_path, uninterrupted, "stop")


@pytest.mark.slow
def test_killed_ranks_host_is_excluded_and_the_job_completes_bitwise(cluster: Any, tmp_path: Path,
                                                                     uninterrupted: dict[str, Any]) -> None:
    _drill(cluster, tmp_path, uninterrupted, "kill")


@pytest.mark.serial  # failed under the parallel suite's load, passes alone
@pytest.mark.slow
def test_stopped_rank_0_on_the_batch_host_is_found_by_its_silent_store(cluster: Any, tmp_path: Path,
                                                                       uninterrupted: dict[str, Any]) -> None:
    """Rank 0 holds the job's store: stopped, the others' watch loses the store; under --heal rank 1 names rank 0
    silent within the rule's seconds, node1 (the batch host, where the supervisor runs on) is used no more."""
    _drill(cluster, tmp_path, uninterrupted, "stop", victim=0)


def test_an_exception_on_every_rank_stops_after_two_attempts_without_requeue(cluster: Any, tmp_path: Path) -> None:
    script = tmp_path / "raises.py"
    script.write_text(RAISES)
    proc = submit_healing(cluster, tmp_path, str(script))
    out, _ = proc.communicate(timeout=JOB_TIMEOUT + 60)
    log = job_log(tmp_path)
    job = re.findall(r"^(\d+)$", out, re.M)[0]
    assert proc.returncode == EXIT_DO_NOT_REQUEUE == 93, out + log
    assert f"job {job} FAILED exit code 93 (restarts 0)" in out, out  # not requeued
    ended = [r for r in job_ledger(tmp_path) if isinstance(r, AttemptEnded)]
    assert len(ended) == 2 and all(e.classification is not None and e.classification.kind is FailureClass.JOB
                                   for e in ended), log
    assert [e.action.value for e in ended] == ["retry", "stop"] and ended[1].exit_code == 1
    assert "excluded" not in log  # no host is taken out for the program's own failure
    # the cause first: the traceback right before the last line, which starts with the exception
    tail = log.rstrip("\n").splitlines()[-6:]
    assert tail[0].startswith("ddpkit heal: the first failure, rank ") and tail[1].startswith("Traceback"), tail
    assert tail[-2] == "ValueError: bad batch at step 5", tail
    assert tail[-1].startswith("ddpkit heal: attempt 2 of 3: ValueError: bad batch at step 5 on ") and \
        "stopping with exit 93 (do not requeue; the job's own exit code was 1)" in tail[-1], tail


def test_clean_runs_are_one_attempt_each(cluster: Any, tmp_path: Path) -> None:
    """A healthy job is never restarted: one attempt, no decision line (DDPKIT_CLEAN_RUNS runs, 3 by default)."""
    for n in range(int(os.environ.get("DDPKIT_CLEAN_RUNS", "3"))):
        where = tmp_path / f"run-{n}"
        where.mkdir()
        log, records = clean_heal_run(cluster, where)
        assert [r.hosts for r in records if isinstance(r, AttemptStarted)] == [("node1", "node2")], log
        assert "ddpkit heal: attempt" not in log and "preflight" not in log, log


def _kill_node2_when_training(c: Any, tmp_path: Path, shape: str) -> tuple[subprocess.Popen[str], Path]:
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    proc = submit_healing(c, tmp_path, "train", "--epochs", "60", "--samples", "4096", "--snapshot-path",
                          str(snaps / "snap.pt"), shape=("-j", shape))
    for pid in _when_training(c.nodes[1], snaps, proc):
        os.kill(pid, signal.SIGKILL)
    return proc, snaps


@pytest.mark.slow
def test_with_no_spare_an_elastic_job_shrinks_to_its_minimum(cluster: Any, tmp_path: Path) -> None:
    proc, _ = _kill_node2_when_training(cluster, tmp_path, "1:2x1")
    out, _ = proc.communicate(timeout=JOB_TIMEOUT + 60)
    log = job_log(tmp_path)
    assert proc.returncode == 0 and "COMPLETED exit code 0 (restarts 0)" in out, out + log
    assert "ddpkit heal: attempt 1 of 3: node2 excluded (rank 1 on host node2 was killed by SIGKILL); relaunching " \
           "on node1 (shrunk to 1 of 2 nodes: -j 1:2) from the snapshot of step " in log, log
    started = [r for r in job_ledger(tmp_path) if isinstance(r, AttemptStarted)]
    assert [(a.hosts, a.ranks) for a in started] == [(("node1", "node2"), 2), (("node1",), 1)]


@pytest.mark.slow
def test_with_no_spare_and_no_smaller_shape_the_job_requeues_itself_without_the_bad_host(cluster: Any,
                                                                                         tmp_path: Path) -> None:
    """-j 2x1 with no spare: node2's rank killed -> the job requeues itself with --exclude=node2 and its next run
    (on node1, node3) resumes from the snapshot. Slurm holds a requeued job for 2 minutes before it may start: the
    test starts it at once (scontrol update StartTime=now) as an operator may."""
    proc, _ = _kill_node2_when_training(cluster, tmp_path, "2x1")
    until = time.monotonic() + JOB_TIMEOUT
    while proc.poll() is None and time.monotonic() < until:
        res = cluster.client("squeue", "-h", "-o", "%i %r")
        if "BeginTime" in res.stdout:
            cluster.client("scontrol", "update", f"JobId={res.stdout.split()[0]}", "StartTime=now")
            break
        time.sleep(1)
    out, _ = proc.communicate(timeout=JOB_TIMEOUT + 60)
    log = job_log(tmp_path)
    assert proc.returncode == 0 and "COMPLETED exit code 0 (restarts 1)" in out, out + log
    assert "ddpkit heal: no attempt 2 here: 1 healthy node(s) left of 2 (node2 out), 2 needed: requeuing job " in log
    assert "healed (--heal), restart 1" in log and "Resuming training from snapshot" in log, log
    records = job_ledger(tmp_path)
    started = [r for r in records if isinstance(r, AttemptStarted)]
    assert [a.hosts for a in started] == [("node1", "node2"), ("node1", "node3")], started
    assert [r.host for r in records if isinstance(r, HostExcluded)] == ["node2"]


@pytest.mark.slow
def test_host_cut_off_is_excluded_and_the_job_completes_bitwise(cluster: Any, tmp_path: Path,
                                                                uninterrupted: dict[str, Any]) -> None:
    """Last in the module: Slurm takes minutes to hear from the node again (its link is up at once)."""
    _drill(cluster, tmp_path, uninterrupted, "link")
