"""ddpkit.heal.policy: retry what another attempt can mend, stop what it cannot, never restart a healthy job; and the
one line that says each decision (``ddpkit.heal.lines``)."""

from __future__ import annotations

import pytest

from ddpkit.heal.classify import Classification, FailureClass
from ddpkit.heal.lines import Style, sentence
from ddpkit.heal.policy import EXIT_DO_NOT_REQUEUE, HealPolicy, Outcome, Why, attempts_without_progress, decide
from ddpkit.rundir.ledger import Action, AttemptEnded

POLICY = HealPolicy()


def found(kind: FailureClass, reason: str = "rank 1 on host vm was killed by SIGKILL") -> Classification:
    return Classification(kind=kind, reason=reason)


def ended(attempt: int, kind: FailureClass | None, code: int = 1, progress: int | None = None) -> AttemptEnded:
    return AttemptEnded(attempt=attempt, time=0.0, exit_code=code, action=Action.RETRY,
                        classification=found(kind) if kind else None, progress=progress)


def outcome(n: int, kind: FailureClass | None, code: int = 1, progress: int | None = None) -> Outcome:
    return Outcome(attempt=n, of_session=n, exit_code=code, classification=found(kind) if kind else None,
                   progress=progress)


def line(policy: HealPolicy, history: list[AttemptEnded], outcome: Outcome) -> str:
    """The line a one-host supervisor says after ``outcome`` (``heal.lines``, its one author)."""
    decision = decide(policy, history, outcome)
    return sentence(Style.ONE_HOST, decision, outcome.classification, of_session=outcome.of_session,
                    max_attempts=policy.max_attempts, exit_code=outcome.exit_code, progress=outcome.progress)


def test_exit_0_is_never_restarted() -> None:
    decision = decide(POLICY, [], outcome(1, None, code=0))
    assert decision.action is Action.STOP and decision.exit_code == 0


def test_a_host_fault_is_retried_with_one_line_for_the_person_watching() -> None:
    decision = decide(POLICY, [], outcome(1, FailureClass.HOST, code=137))
    assert decision.action is Action.RETRY and decision.exit_code is None
    assert line(POLICY, [], outcome(1, FailureClass.HOST, code=137)) == (
        "ddpkit heal: attempt 1 of 3: rank 1 on host vm was killed by SIGKILL (host fault); relaunching")


def test_unknown_is_retried() -> None:
    assert decide(POLICY, [ended(1, FailureClass.HOST)], outcome(2, FailureClass.UNKNOWN)).action is Action.RETRY


def test_a_job_fault_is_retried_once_then_stops_with_do_not_requeue() -> None:
    first = decide(POLICY, [], outcome(1, FailureClass.JOB))
    assert first.action is Action.RETRY and "relaunching once" in line(POLICY, [], outcome(1, FailureClass.JOB))
    second = decide(POLICY, [ended(1, FailureClass.JOB)], outcome(2, FailureClass.JOB))
    assert second.action is Action.STOP and second.exit_code == EXIT_DO_NOT_REQUEUE == 93
    said = line(POLICY, [ended(1, FailureClass.JOB)], outcome(2, FailureClass.JOB))
    assert second.why is Why.JOB_AGAIN and "the second in a row" in said and "the job's own exit code was 1" in said


def test_a_job_fault_after_a_host_fault_is_still_a_first() -> None:
    history = [ended(1, FailureClass.JOB), ended(2, FailureClass.HOST)]
    assert decide(HealPolicy(max_attempts=5), history, outcome(3, FailureClass.JOB)).action is Action.RETRY


def test_preempted_stops_with_its_own_code_for_the_scheduler_to_requeue() -> None:
    decision = decide(POLICY, [], outcome(1, FailureClass.PREEMPTED, code=75))
    assert decision.action is Action.STOP and decision.exit_code == 75
    assert "requeue" in line(POLICY, [], outcome(1, FailureClass.PREEMPTED, code=75))


def test_max_attempts_gives_up_with_the_attempts_own_code() -> None:
    history = [ended(1, FailureClass.HOST), ended(2, FailureClass.HOST)]
    decision = decide(POLICY, history, outcome(3, FailureClass.HOST, code=137))
    assert decision.action is Action.GIVE_UP and decision.exit_code == 137
    assert "--max-attempts 3" in line(POLICY, history, outcome(3, FailureClass.HOST, code=137))
    assert decide(HealPolicy(max_attempts=1), [], outcome(1, FailureClass.JOB)).action is Action.GIVE_UP


def test_max_attempts_counts_this_supervisors_attempts_only() -> None:
    history = [ended(1, FailureClass.HOST), ended(2, FailureClass.HOST), ended(3, FailureClass.HOST)]
    later = Outcome(attempt=4, of_session=1, exit_code=137, classification=found(FailureClass.HOST))
    decision = decide(POLICY, history, later)
    assert decision.action is Action.RETRY and line(POLICY, history, later).startswith("ddpkit heal: attempt 1 of 3:")


def test_attempts_in_a_row_without_a_newer_snapshot_stop_with_do_not_requeue() -> None:
    policy = HealPolicy(max_attempts=10, no_progress_limit=3)
    history = [ended(1, FailureClass.HOST, progress=100), ended(2, FailureClass.HOST, progress=100),
               ended(3, FailureClass.HOST, progress=100)]
    decision = decide(policy, history, outcome(4, FailureClass.HOST, code=137, progress=100))
    assert decision.action is Action.STOP and decision.exit_code == EXIT_DO_NOT_REQUEUE
    assert "3 attempts in a row without a newer snapshot" in line(policy, history, outcome(4, FailureClass.HOST,
                                                                                          code=137, progress=100))
    moving = [ended(1, FailureClass.HOST, progress=100), ended(2, FailureClass.HOST, progress=200),
              ended(3, FailureClass.HOST, progress=300)]
    assert decide(policy, moving, outcome(4, FailureClass.HOST, progress=400)).action is Action.RETRY


def test_unknown_progress_counts_attempts_only() -> None:
    policy = HealPolicy(max_attempts=10, no_progress_limit=2)
    history = [ended(n, FailureClass.HOST) for n in range(1, 6)]
    assert attempts_without_progress([*history, outcome(6, FailureClass.HOST)]) == 0
    assert decide(policy, history, outcome(6, FailureClass.HOST)).action is Action.RETRY


def test_the_policy_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="max_attempts"):
        HealPolicy(max_attempts=0)


def test_a_retry_with_known_progress_says_the_snapshot_it_resumes_from() -> None:
    said = line(POLICY, [], outcome(1, FailureClass.HOST, code=137, progress=288))
    assert said.endswith("relaunching from the snapshot of step 288")


def test_a_retry_where_no_attempt_can_follow_gives_up_with_its_own_code() -> None:
    """torch elastic's agent has spent its restarts (``last``): the retry becomes giving up, said as such."""
    decision = decide(POLICY, [], outcome(1, FailureClass.HOST, code=137), last=True)
    assert decision.action is Action.GIVE_UP and decision.exit_code == 137 and decision.why is Why.NO_RESTART_LEFT
    said = sentence(Style.RENDEZVOUS, decision, found(FailureClass.HOST), of_session=1, max_attempts=3, exit_code=137)
    assert said == ("ddpkit heal: rank 1 on host vm was killed by SIGKILL; this agent has no restart left "
                    "(--max-attempts 3): stopping with exit 137")
