"""The Slurm heal supervisor's pure parts: which nodes an attempt takes (spares, shrinking, nothing left), and what
srun's and the watch's lines of a failed step say (its evidence, classified). The lines are those the drills on the
namespace Slurm cluster printed (tests/infra/test_heal_slurm.py runs them for real)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from ddpkit.heal.classify import FailureClass, classify
from ddpkit.heal.nodepool import NodePool
from ddpkit.heal.progress import program_progress as snapshot_step
from ddpkit.heal.slurm_step import StepPlan, _Reader, srun_argv
from ddpkit.heal.slurm_supervisor import step_port

PLAN = StepPlan(nodes=("node1", "node2"), per_node=1, program=("python", "-m", "ddpkit", "train"))


def test_an_attempt_takes_the_first_healthy_nodes_and_a_bad_host_never_comes_back() -> None:
    pool = NodePool(allocation=("node1", "node2", "node3"), want=2, least=2)
    assert pool.take() == ("node1", "node2") and pool.spares == 1
    assert pool.exclude("node2", "stopped answering") and not pool.exclude("node2", "again")
    assert pool.take() == ("node1", "node3") and pool.spares == 0
    assert not pool.exclude("node9", "not in the allocation")
    pool.exclude("node3", "killed")
    assert pool.take() is None  # -j 2x1: cannot shrink


def test_an_elastic_shape_shrinks_down_to_its_minimum() -> None:
    pool = NodePool(allocation=("a", "b", "c"), want=2, least=1)
    pool.exclude("b", "x")
    pool.exclude("c", "y")
    assert pool.take() == ("a",)
    pool.exclude("a", "z")
    assert pool.take() is None
    with pytest.raises(ValueError):
        NodePool(allocation=("a",), want=1, least=2)


def _read(lines: list[str]) -> _Reader:
    reader = _Reader(io.BytesIO(), lambda line: None, lambda rank: PLAN.nodes[rank])
    reader.thread.join()
    for line in lines:
        reader._read(line)
    return reader


def test_a_stopped_rank_named_by_the_watch_is_a_host_fault_of_its_host() -> None:
    reader = _read([
        "0: ddpkit watch: rank 1 on host node2 (pid 8857) stopped answering: no heartbeat for 10 s (under --heal a "
        "silent rank is a lost host after 10 s); every rank stops now (exit 3)",
        "srun: error: node1: task 0: Exited with exit code 3",
        "srun: launch/slurm: _step_signal: Terminating StepId=5.0",
        "srun: error: node2: task 1: Terminated"])
    evidence, _ = reader.evidence(3, None)
    found = classify(evidence)
    assert found.kind is FailureClass.HOST and found.culprit_hosts == ("node2",) and found.culprit_ranks == (1,)
    assert reader.fault_line is not None and "stopped answering" in reader.fault_line
    assert reader.only_silent_left(PLAN)  # node1's task ended: what is left is on the silent host


def test_a_killed_rank_is_a_host_fault_and_the_ranks_srun_ended_after_it_are_not_blamed() -> None:
    reader = _read(["srun: error: node2: task 1: Killed", "srun: launch/slurm: _step_signal: Terminating StepId=6.0",
                    "0: slurmstepd-node1: error: *** STEP 6.0 ON node1 CANCELLED AT 2026-11-26T13:20:54 ***",
                    "srun: error: node1: task 0: Terminated"])
    found = classify(reader.evidence(137, None)[0])
    assert found.kind is FailureClass.HOST and found.culprit_hosts == ("node2",)
    assert found.reason == "rank 1 on host node2 was killed by SIGKILL"
    assert not reader.only_silent_left(PLAN)  # no rank was named silent: srun ends the step itself


def test_the_same_exception_on_every_rank_is_the_jobs_own_fault_with_its_traceback() -> None:
    traceback = ["Traceback (most recent call last):", '  File "/tmp/raises.py", line 8, in <module>',
                 '    raise ValueError(f"bad batch at step {step}")', "ValueError: bad batch at step 5"]
    reader = _read([*(f"1: {line}" for line in traceback), *(f"0: {line}" for line in traceback),
                    "srun: error: node2: task 1: Exited with exit code 1",
                    "srun: launch/slurm: _step_signal: Terminating StepId=10.1",
                    "srun: error: node1: task 0: Exited with exit code 1"])
    evidence, tracebacks = reader.evidence(1, None)
    found = classify(evidence)
    assert found.kind is FailureClass.JOB and found.reason.startswith("ValueError: bad batch at step 5 on ranks 0, 1")
    assert tracebacks[1].splitlines() == traceback


def test_a_signal_from_outside_is_a_preemption() -> None:
    reader = _read(["srun: error: node1: task 0: Exited with exit code 75"])
    assert classify(reader.evidence(75, "SIGTERM")[0]).kind is FailureClass.PREEMPTED


def test_each_step_is_srun_on_the_named_nodes_with_a_port_of_its_own() -> None:
    argv = srun_argv(StepPlan(nodes=("node1", "node3"), per_node=2, program=("py", "-m", "ddpkit", "check")))
    assert argv[:6] == ["srun", "--nodelist=node1,node3", "--nodes=2", "--ntasks=4", "--ntasks-per-node=2",
                        "--kill-on-bad-exit=1"]
    assert "--overlap" in argv and "--label" in argv and argv[-4:] == ["py", "-m", "ddpkit", "check"]
    assert len({step_port(1234, k) for k in range(10)}) == 10
    assert all(20000 <= step_port(j, k) < 30000 for j in (1, 99999) for k in range(5))


def test_progress_is_the_newest_snapshot_of_a_train_program(tmp_path: object) -> None:
    from pathlib import Path

    where = Path(str(tmp_path))
    assert snapshot_step(("py", "-m", "ddpkit", "run", "--", "x.py")) is None
    assert snapshot_step(("py", "-m", "ddpkit", "train", "--snapshot-path", str(where / "snap.pt"))) is None
    for step in (64, 128):
        (where / f"snap.{step:09d}.pt").write_bytes(b"x")
    assert snapshot_step(("py", "-m", "ddpkit", "train", f"--snapshot-path={where / 'snap.pt'}")) == 128


def test_a_preflight_report_names_its_bad_hosts_by_slurm_node(tmp_path: object) -> None:
    import json
    from pathlib import Path

    from ddpkit.heal.slurm_supervisor import _named_bad

    report = Path(str(tmp_path)) / "preflight.json"
    assert _named_bad(report, ("node1", "node3")) == ()  # no report (the check did not get that far)
    report.write_text(json.dumps({"bad_hosts": [{"host": "h3", "slurm_node": "node3", "reasons": ["mtu"]},
                                                {"host": "node9", "slurm_node": None, "reasons": ["x"]}]}))
    assert _named_bad(report, ("node1", "node3")) == ("node3",)


def test_mpiruns_progress_reads_snapshot_path_with_an_equals_sign_too(tmp_path: Path) -> None:
    """mpirun's supervisor read only ``--snapshot-path X``; Slurm's also ``--snapshot-path=X``: one reading now."""
    from ddpkit.heal.mpi import _MpirunAttempts

    (tmp_path / "snap.256.pt").write_bytes(b"x")

    class _Spec:
        command = ("train", f"--snapshot-path={tmp_path / 'snap.pt'}")

    assert _MpirunAttempts(_Spec(), None, None, None).progress() == 256  # type: ignore[arg-type]
