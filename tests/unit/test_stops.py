"""Why a run stops, told truly: a signal from outside the job or the job's own agent, a preemption with or without
a snapshot, a lost peer named by rank and host, a rendezvous that timed out versus a store lost later."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddpkit.base.errors import EXIT_PREEMPTED, EXIT_PREEMPTED_UNSAVED
from ddpkit.base.shape import parse_job_shape
from ddpkit.launch.rendezvous import JoinedNode, describe_missing
from ddpkit.launch.stops import handle_outside_signals, lost_reports
from ddpkit.process.stopping import signal_from_outside
from ddpkit.train.stops import LastSnapshot, describe_lost_peer, preemption_outcome

HOSTS = ["h1 (10.0.0.1)", "h2 (10.0.0.2)"]


def test_a_signal_is_from_outside_only_when_the_agent_marked_it(tmp_path: Path) -> None:
    assert not signal_from_outside(None, str(tmp_path))
    assert not signal_from_outside("SIGTERM", str(tmp_path), grace=0.1)  # the agent stopped its workers itself
    (tmp_path / "signal").write_text("SIGTERM")
    assert signal_from_outside("SIGTERM", str(tmp_path), grace=0.1)
    assert signal_from_outside("SIGTERM", "")  # no ddpkit agent (srun, mpirun): every signal is from outside


def test_the_agent_marks_a_signal_it_receives_before_forwarding_it(tmp_path: Path) -> None:
    forwarded: list[str] = []

    def forward(sig: signal.Signals) -> None:
        forwarded.append(sig.name if (tmp_path / "signal").exists() else "unmarked")

    previous = signal.getsignal(signal.SIGUSR2)
    try:
        handle_outside_signals(str(tmp_path), ["SIGUSR2"], forward)
        os.kill(os.getpid(), signal.SIGUSR2)
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert forwarded == ["SIGUSR2"] and (tmp_path / "signal").read_text() == "SIGUSR2"


def test_a_preemption_claims_a_snapshot_only_when_one_exists() -> None:
    outcome, line = preemption_outcome(LastSnapshot(configured=True, step=42, path="d/snap.000000042.pt"), 42)
    code = outcome.exit_code
    assert code == EXIT_PREEMPTED and "snapshot written at step 42" in line
    outcome, line = preemption_outcome(LastSnapshot(configured=False), 42)
    code = outcome.exit_code
    assert code == EXIT_PREEMPTED_UNSAVED and "snapshot written" not in line
    assert "no --snapshot-path was given" in line and "42 steps done are lost" in line
    outcome, _ = preemption_outcome(LastSnapshot(configured=True), 42)
    code = outcome.exit_code
    assert code == EXIT_PREEMPTED_UNSAVED


def test_the_lost_peer_is_named_with_its_host_phase_and_snapshot() -> None:
    snap = LastSnapshot(configured=True, step=256, path="d/snap.000000256.pt")
    text = describe_lost_peer(rank=0, hosts=HOSTS, phase="the gradient all-reduce of step 300 (epoch 1, batch 44)",
                              snapshot=snap, answered={0}, error="Timed out")
    assert "rank 1 on h2 (10.0.0.2) stopped answering, during the gradient all-reduce of step 300" in text
    assert "the next run resumes from the snapshot of step 256 (d/snap.000000256.pt)" in text
    cut_off = describe_lost_peer(rank=1, hosts=HOSTS, phase="x", snapshot=LastSnapshot(configured=False),
                                 answered=None, error="Timed out")
    assert "rank 0 on h1 (10.0.0.1) stopped answering" in cut_off and "no --snapshot-path" in cut_off


def test_lost_reports_are_read_in_rank_order(tmp_path: Path) -> None:
    (tmp_path / "lost.rank-10").write_text("final\nten\n")
    (tmp_path / "lost.rank-2").write_text("restartable\ntwo\n")
    assert lost_reports(str(tmp_path)) == ["two", "ten"]


def test_the_rendezvous_message_never_contradicts_itself() -> None:
    both = (JoinedNode(addr="10.0.0.1", pid=1), JoinedNode(addr="10.0.0.2", pid=2))
    two = parse_job_shape("2x1")
    assert "2 of 2 node(s) joined" not in describe_missing(both, two)
    assert "never completed" in describe_missing(both, two)
    assert describe_missing(both, two, complete=True).startswith("the round had completed with 2 node(s)")


def test_a_store_lost_after_the_start_is_not_called_a_join_timeout() -> None:
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError

    from ddpkit.launch.agent import LaunchOptions, _rendezvous_failure

    options = LaunchOptions(shape=parse_job_shape("2x1"), rdzv_endpoint="10.0.0.1:29400")
    watch = SimpleNamespace(nodes=(JoinedNode(addr="10.0.0.1", pid=1), JoinedNode(addr="10.0.0.2", pid=2)),
                            completed=True)
    lost = _rendezvous_failure(RendezvousConnectionError("gone"), watch, options,  # type: ignore[arg-type]
                               "10.0.0.1:29400", {"join_timeout": 120}, ["rank 0 on h1 stopped answering"])
    assert "did not complete" not in lost.found and "rank 0 on h1 stopped answering" in lost.found
    watch.completed = False
    late = _rendezvous_failure(RendezvousTimeoutError(), SimpleNamespace(nodes=watch.nodes[:1], completed=False),  # type: ignore[arg-type]
                               options, "10.0.0.1:29400", {"join_timeout": 120}, [])
    assert "did not complete within 120 s; 1 of 2 node(s) joined" in late.found


@pytest.mark.parametrize(("codes", "expected"), [((75, -15), 75), ((76, 76), 76), ((3, -15), 3)])
def test_the_agent_reports_a_preemption_only_when_the_workers_said_so(codes: tuple[int, int], expected: int) -> None:
    from ddpkit.launch.failure import root_cause

    failures = {r: SimpleNamespace(timestamp=100, exitcode=c, pid=1000 + r) for r, c in enumerate(codes)}
    assert root_cause(SimpleNamespace(failures=failures)) == expected
