"""ddpkit.heal.classify: each rule of the classification, on the evidence a failed attempt leaves."""

from __future__ import annotations

import pytest

from ddpkit.heal.classify import (
    Classification,
    Evidence,
    FailureClass,
    RankEvidence,
    WatchReport,
    classify,
    exception_line,
)

PEER = ("RuntimeError: [../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:3284: Connection reset by peer. "
        "This is typically caused by a remote worker hanging")


def rank(r: int, **kw: object) -> RankEvidence:
    return RankEvidence(rank=r, host=str(kw.pop("host", "vm")), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSEGV", "SIGBUS"])
def test_a_rank_killed_by_a_signal_is_a_host_fault_naming_that_rank(sig: str) -> None:
    found = classify(Evidence(exit_code=137, ranks=(rank(1, signal=sig, first=True), rank(0, exception=PEER))))
    assert found.kind is FailureClass.HOST
    assert found.culprit_ranks == (1,) and found.culprit_hosts == ("vm",)
    assert found.reason == f"rank 1 on host vm was killed by {sig}"
    assert found.evidence[0] == f"rank 1 on host vm: killed by {sig}; failed first"
    assert "a peer's failure" in found.evidence[1]


def test_the_same_exception_on_every_rank_is_a_job_fault_with_the_exception_first() -> None:
    found = classify(Evidence(exit_code=1, ranks=(rank(1, exit_code=1, first=True, exception="ValueError: bad batch"),
                                                  rank(0, exception="ValueError: bad batch"))))
    assert found.kind is FailureClass.JOB
    assert found.culprit_ranks == (0, 1)
    assert found.reason.startswith("ValueError: bad batch on ranks 0, 1")


def test_an_exception_in_the_first_rank_alone_is_a_job_fault_and_its_peers_are_not_blamed() -> None:
    found = classify(Evidence(exit_code=1, ranks=(rank(0, exception=PEER),
                                                  rank(1, exit_code=1, first=True, exception="KeyError: 'batch'"))))
    assert found.kind is FailureClass.JOB
    assert found.culprit_ranks == (1,)
    assert found.reason == "KeyError: 'batch' on rank 1 (host vm)"


def test_the_first_failing_rank_decides_over_a_later_exception() -> None:
    found = classify(Evidence(exit_code=137, ranks=(rank(0, exception="ValueError: late"),
                                                    rank(1, signal="SIGKILL", first=True))))
    assert found.kind is FailureClass.HOST and found.culprit_ranks == (1,)


def test_peer_failures_alone_are_a_cut_off_host() -> None:
    found = classify(Evidence(exit_code=1, ranks=(rank(0, exit_code=1, first=True, exception=PEER),
                                                  rank(1, exception="RuntimeError: Broken pipe"))))
    assert found.kind is FailureClass.HOST
    assert "cut off" in found.reason and found.culprit_ranks == ()


def test_the_watch_naming_a_rank_that_stopped_answering_is_a_host_fault_on_that_host() -> None:
    watch = WatchReport(stopped_answering=((1, "node2"),), hang=True,
                        lines=("ddpkit watch: HANG: no rank has made progress for 60 s",))
    found = classify(Evidence(exit_code=3, ranks=(rank(0, exit_code=3, stopped_by_ddpkit=True),), watch=watch))
    assert found.kind is FailureClass.HOST
    assert found.culprit_ranks == (1,) and found.culprit_hosts == ("node2",)
    assert found.reason == "rank 1 on host node2 stopped answering"
    assert "ddpkit watch: HANG" in found.evidence[-1]


def test_ranks_ddpkit_stopped_with_no_report_are_unknown() -> None:
    found = classify(Evidence(exit_code=3, ranks=(rank(0, exit_code=3, stopped_by_ddpkit=True),
                                                  rank(1, exit_code=3, stopped_by_ddpkit=True))))
    assert found.kind is FailureClass.UNKNOWN and "ddpkit stopped ranks 0, 1" in found.reason


@pytest.mark.parametrize("code", [75, 76])
def test_preemption_codes_are_preempted(code: int) -> None:
    assert classify(Evidence(exit_code=code, all_preempted=True)).kind is FailureClass.PREEMPTED
    found = classify(Evidence(exit_code=code, ranks=(rank(0, exit_code=code, first=True),
                                                     rank(1, signal="SIGTERM", stopped_by_ddpkit=True))))
    assert found.kind is FailureClass.PREEMPTED and f"exit {code}" in found.reason


def test_a_signal_from_outside_is_preempted_whatever_the_ranks_did() -> None:
    found = classify(Evidence(exit_code=143, outside_signal="SIGTERM", ranks=(rank(1, signal="SIGKILL", first=True),)))
    assert found.kind is FailureClass.PREEMPTED and "SIGTERM" in found.reason


def test_a_sigterm_not_from_the_agent_on_the_first_rank_is_preempted() -> None:
    found = classify(Evidence(exit_code=143, ranks=(rank(1, signal="SIGTERM", first=True),)))
    assert found.kind is FailureClass.PREEMPTED and found.culprit_ranks == (1,)


def test_the_agents_sigterm_of_the_survivors_is_no_culprit() -> None:
    found = classify(Evidence(exit_code=137, ranks=(rank(0, signal="SIGTERM", stopped_by_ddpkit=True),
                                                    rank(1, signal="SIGKILL", first=True))))
    assert found.kind is FailureClass.HOST and found.culprit_ranks == (1,)


def test_an_exit_code_without_a_traceback_is_unknown() -> None:
    found = classify(Evidence(exit_code=5, ranks=(rank(1, exit_code=5, first=True),)))
    assert found.kind is FailureClass.UNKNOWN
    assert found.reason == "rank 1 on host vm exited with code 5 and left no traceback"


def test_no_evidence_at_all_is_unknown() -> None:
    found = classify(Evidence(exit_code=1))
    assert found.kind is FailureClass.UNKNOWN and "exit code 1" in found.reason


def test_a_classification_goes_through_json_unchanged() -> None:
    found = classify(Evidence(exit_code=137, ranks=(rank(1, signal="SIGKILL", first=True),)))
    assert Classification.from_json(found.to_json()) == found


def test_exception_line_reads_the_last_traceback() -> None:
    text = ("warming up\nTraceback (most recent call last):\n  File \"a.py\", line 1, in <module>\n    f()\n"
            "KeyError: 'first'\n\nlater\nTraceback (most recent call last):\n  File \"a.py\", line 9, in g\n"
            "    raise ValueError('x')\nValueError: x\n")
    assert exception_line(text) == "ValueError: x"
    assert exception_line("no traceback here\n") is None


def test_a_very_long_exception_is_shortened() -> None:
    said = exception_line("Traceback (most recent call last):\n  File \"a\"\nRuntimeError: " + "x" * 500)
    assert said is not None and len(said) == 200 and said.endswith("...")
