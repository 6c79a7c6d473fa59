"""ddpkit.rundir.ledger: records written one fsynced line each, read back typed, continued by a later supervisor."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ddpkit.heal.classify import Classification, FailureClass
from ddpkit.rundir.ledger import (
    Action,
    AttemptEnded,
    AttemptStarted,
    Ledger,
    SupervisorStarted,
    from_json,
    read_records,
    to_json,
)

HOST = Classification(kind=FailureClass.HOST, reason="rank 1 on host vm was killed by SIGKILL", culprit_ranks=(1,),
                      culprit_hosts=("vm",), evidence=("rank 1 on host vm: killed by SIGKILL; failed first",))


def test_every_record_goes_through_one_json_line_unchanged() -> None:
    for record in (SupervisorStarted(time=1.5, pid=7, host="vm", max_attempts=3, command=("run", "-n", "2")),
                   AttemptStarted(attempt=2, time=2.0, hosts=("vm",), ranks=2, logs="/r/attempt-2"),
                   AttemptEnded(attempt=2, time=3.0, exit_code=137, action=Action.RETRY, classification=HOST,
                                progress=1632, decision="ddpkit heal: attempt 2 of 3: ..."),
                   AttemptEnded(attempt=3, time=4.0, exit_code=0, action=Action.STOP, exit_code_of_run=0)):
        line = to_json(record)
        assert "\n" not in line
        assert from_json(line) == record
    assert json.loads(to_json(AttemptEnded(attempt=1, time=0, exit_code=1, action=Action.GIVE_UP)))["action"] \
        == "give-up"


def test_a_line_that_is_no_record_is_refused() -> None:
    with pytest.raises(ValueError, match="not a ledger record"):
        from_json('{"kind": "lunch"}')


def test_appended_records_are_read_back_in_order_and_attempts_numbered(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "run")
    assert ledger.next_attempt() == 1 and ledger.records() == []
    ledger.append(AttemptStarted(attempt=1, time=1.0, hosts=("vm",), ranks=2))
    ledger.append(AttemptEnded(attempt=1, time=2.0, exit_code=137, action=Action.RETRY, classification=HOST))
    assert [type(r) for r in ledger.records()] == [AttemptStarted, AttemptEnded]
    assert ledger.ended()[0].classification == HOST
    assert ledger.next_attempt() == 2


def test_a_second_supervisor_on_the_same_directory_continues_the_count(tmp_path: Path) -> None:
    Ledger(tmp_path).append(AttemptStarted(attempt=1, time=1.0, hosts=("vm",), ranks=2))  # killed mid-attempt
    later = Ledger(tmp_path)
    assert later.next_attempt() == 2
    later.append(AttemptStarted(attempt=2, time=5.0, hosts=("vm",), ranks=2))
    assert [r.attempt for r in read_records(tmp_path / "ledger.jsonl")] == [1, 2]  # type: ignore[union-attr]


def test_a_torn_last_line_is_skipped_and_the_next_record_starts_on_its_own_line(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path)
    ledger.append(AttemptStarted(attempt=1, time=1.0, hosts=("vm",), ranks=2))
    with open(ledger.path, "a") as f:  # a supervisor killed in the middle of a write
        f.write('{"attempt": 1, "kind": "attempt-en')
    assert len(ledger.records()) == 1
    ledger.append(AttemptStarted(attempt=2, time=2.0, hosts=("vm",), ranks=2))
    assert [r.attempt for r in ledger.records()] == [1, 2]  # type: ignore[union-attr]


def test_each_append_reaches_the_disk_before_it_returns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    Ledger(tmp_path / "new").append(AttemptStarted(attempt=1, time=1.0, hosts=("vm",), ranks=2))
    assert len(synced) == 2  # the line, and the directory that now holds the new file
    Ledger(tmp_path / "new").append(AttemptStarted(attempt=2, time=1.0, hosts=("vm",), ranks=2))
    assert len(synced) == 3


def test_the_supervisors_command_is_the_ranks_ddpkit_command_line_for_every_backend() -> None:
    from ddpkit.rundir.ledger import ranks_command

    # Slurm's supervisor is handed the ranks' whole program line; the one-host supervisor and mpirun's record the
    # same words: what follows ``ddpkit`` (the report prints it after "ddpkit")
    assert ranks_command(("/venv/bin/python", "-m", "ddpkit", "train", "--epochs", "5")) == ("train", "--epochs", "5")
    assert ranks_command(("/venv/bin/ddpkit", "run", "--", "job.py")) == ("run", "--", "job.py")
    assert ranks_command(("./my_launcher.sh", "x")) == ("./my_launcher.sh", "x")  # not ddpkit: said whole


def test_store_values_read_back_as_written() -> None:
    """The values the agents pass through their stores (``base.jsonlines.JsonFields``): enums by value, tuples
    back as tuples, every field kept."""
    from ddpkit.heal.elastic_round import Excluded
    from ddpkit.live.protocol import Joined, Plan

    for value in (HOST, Excluded(host="node2", reason="rank 1 was killed by SIGKILL", by="node1", time=4.5),
                  Plan(gen=2, ranks=(1, 3), why="SIGKILL", hosts=("node2", "node2"), lost_at=3.25, port=29511),
                  Joined(gen=2, source=0, step=978, behind=(2,), at=5.5)):
        assert type(value).from_json(value.to_json()) == value
    assert json.loads(HOST.to_json())["kind"] == "host"
    assert Joined.from_json(Joined(gen=1, source=0, step=1, behind=(1, 2)).to_json()).behind == (1, 2)
