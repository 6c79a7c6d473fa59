"""ddpkit.launcher_output: what each launcher printed in a real job (the lines of tests/unit/test_steplog.py and
test_heal_slurm_units.py, captured on the test cluster, and Open MPI's and MPICH's from real runs) read into typed
events, and the words every dialect shares said one way."""

from __future__ import annotations

import signal

import pytest

from ddpkit.launcher_output import events as ev
from ddpkit.launcher_output import reader_for
from ddpkit.launcher_output.pods import pod_events
from ddpkit.launcher_output.tracebacks import exception_line, last_traceback, rank_traceback
from ddpkit.launcher_output.words import rank_list, signal_name, signal_number, task_ids
from tests.unit.test_steplog import MPICH_LINES, MPIRUN_LINES, REQUEUE, STDERR, TORCHRUN_STDERR


def _events(launcher: str, text: str) -> list[tuple[int | None, object]]:
    return reader_for(launcher).read_all(text.replace("\\\n", "").splitlines())


def test_srun_with_torchrun_agents_a_ranks_host_its_agents_failure_and_box_and_srun_on_the_task() -> None:
    found = _events("srun", STDERR)
    assert (1, ev.RankOnHost(rank=1, host="node2")) in found and (0, ev.RankOnHost(rank=0, host="node1")) in found
    assert (1, ev.WorkerFailed(exit_code=1, local_rank=0, pid=20080)) in found
    assert (1, ev.RootCause(rank=1, host="node2", exit_code=1, pid=20080, time="2026-11-26_13:31:44")) in found
    assert (None, ev.TasksEnded(tasks=(1,), host="node2", exit_code=1)) in found
    assert any(isinstance(e, ev.JobFailing) and "ChildFailedError" in e.text for _, e in found)
    headline = next(e for _, e in found if isinstance(e, ev.WatchLine))
    assert headline.headline and headline.text.startswith("ddpkit watch: rank 0 on host node1: all_reduce #4")
    last_box = [e for _, e in found if isinstance(e, ev.RootCause)][-1]  # the output's end closed it
    assert last_box.rank == 0 and last_box.host == "node1" and last_box.code == 1


def test_srun_a_requeue_is_a_cancellation_and_the_tasks_end_after_it_are_srun_s() -> None:
    found = [e for _, e in _events("srun", REQUEUE)]
    assert ev.Cancelled(text="STEP 7.0 ON node1 CANCELLED AT 2026-11-26T13:33:40 DUE TO JOB REQUEUE") in found
    assert any(isinstance(e, ev.StepEnding) for e in found)
    ended = next(e for e in found if isinstance(e, ev.TasksEnded))
    assert ended.tasks == (0,) and ended.exit_code == 1 and ended.after_step_ending


def test_srun_says_a_signal_in_words_and_a_task_list_as_ranges() -> None:
    reader = reader_for("srun")
    (killed,) = reader.read("srun: error: node2: task 1: Killed").events
    assert isinstance(killed, ev.TasksEnded) and killed.signal == signal.SIGKILL and killed.exit_code is None
    assert killed.code == -9 and killed.signal_name == "SIGKILL" and not killed.after_step_ending
    (exited,) = reader.read("srun: error: node1: tasks 0-1,3: Exited with exit code 3").events
    assert isinstance(exited, ev.TasksEnded) and exited.tasks == (0, 1, 3) and exited.exit_code == 3
    reading = reader.read("0: srun: error: node1: task 0: Killed")  # a rank's own line that looks like srun's
    assert reading.source == 0 and not reading.events


def test_the_watch_names_silent_ranks_in_its_headline_or_under_a_hangs() -> None:
    reader = reader_for("srun")
    headline = reader.read("0: ddpkit watch: rank 1 on host node2 (pid 8857) stopped answering: no heartbeat for 10 s "
                           "(under --heal a silent rank is a lost host after 10 s); every rank stops now (exit 3)")
    silent = [e for e in headline.events if isinstance(e, ev.SilentRank)]
    assert [(s.rank, s.host, s.pid, s.headline) for s in silent] == [(1, "node2", 8857, True)]
    under = reader.read("0:   rank 2 on host node3 (pid 7) stopped answering: no heartbeat for 12 s (stopped, killed, "
                        "or its host lost); last seen at collective #4")
    assert [(e.rank, e.host, e.headline) for e in under.events if isinstance(e, ev.SilentRank)] == [(2, "node3", False)]


def test_open_mpi_names_its_first_failed_process_and_one_a_signal_ended_and_its_frame_is_quiet() -> None:
    found = _events("mpirun", MPIRUN_LINES)
    assert (None, ev.RankEnded(rank=1, exit_code=5)) in found
    assert sum(isinstance(e, ev.JobFailing) for _, e in found) == 2
    reader = reader_for("mpirun")
    (killed,) = reader.read("mpirun noticed that process rank 1 with PID 730 on node 10.0.0.12 exited on signal 9 "
                            "(Killed).").events
    assert killed == ev.RankEnded(rank=1, host="10.0.0.12", signal=9)
    assert reader.read("-" * 74).quiet and not reader.read("[1,0]<stderr>:" + "-" * 74).quiet
    tagged = reader.read("[1,3]<stderr>:KeyError: 'batch'")
    assert tagged.source == 3 and tagged.text == "KeyError: 'batch'"


def test_mpich_labels_each_line_with_its_rank_and_names_no_failed_one() -> None:
    reader = reader_for("mpich")
    assert not reader.names_failures and reader.program == "mpiexec"
    found = [reader.read(line) for line in MPICH_LINES.splitlines()]
    assert [r.source for r in found] == [0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    assert not any(isinstance(e, (ev.RankEnded, ev.TasksEnded, ev.WorkerFailed)) for r in found for e in r.events)


def test_a_standalone_torchruns_box_says_this_host_for_localhost() -> None:
    import socket

    boxes = [e for _, e in _events("torchrun", TORCHRUN_STDERR) if isinstance(e, ev.RootCause)]
    assert [(b.rank, b.host, b.pid) for b in boxes] == [(1, socket.gethostname().split(".", 1)[0], 20758)]
    assert boxes[0].traceback.splitlines()[-1] == "KeyError: 'batch'"


def test_a_pods_log_names_its_rank_and_its_own_traceback_never_torchruns() -> None:
    log = ("[job-master-0:0] ERROR rank 0: another rank is gone\nTraceback (most recent call last):\n"
           "  File \"torchrun\"\ntorch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n")
    rank, events = pod_events("job-master-0", log, 5)
    assert rank == 0 and not any(isinstance(e, ev.RankTraceback) for e in events)
    rank, events = pod_events("job-worker-0", "Traceback (most recent call last):\n  File \"a.py\"\nValueError: x\n", 1)
    assert rank == 1 and [getattr(e, "exception", None) for e in events] == ["ValueError: x"]


def test_a_traceback_read_for_people_and_for_heal_has_the_same_exception() -> None:
    lines = ["warming up", "Traceback (most recent call last):", '  File "/tmp/t/raise.py", line 8, in <module>',
             '    raise KeyError("batch")', "KeyError: 'batch'", "[vm:0] INFO after"]
    frames, exception = last_traceback("\n".join(lines)) or ([], [])
    assert exception == ["KeyError: 'batch'"] and exception_line("\n".join(lines)) == exception[0]
    said = rank_traceback(3, "vm", lines)
    assert said is not None and said.exception == "KeyError: 'batch'" and said.frames == tuple(frames)
    assert said.text.splitlines()[0] == "Traceback (most recent call last):"
    assert rank_traceback(3, "vm", ["no traceback"]) is None


@pytest.mark.parametrize(("number", "name"), [(9, "SIGKILL"), (15, "SIGTERM"), (11, "SIGSEGV"), (40, "signal 40")])
def test_a_signal_has_one_name_and_its_name_one_number(number: int, name: str) -> None:
    assert signal_name(number) == name and signal_number(name) == number
    assert signal_number(None) is None and signal_number("NOPE") is None


def test_rank_and_task_lists() -> None:
    assert rank_list([3]) == "rank 3" and rank_list([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7-8"
    assert rank_list([1, 0], spans=False) == "ranks 0, 1" and rank_list([4], spans=False) == "rank 4"
    assert rank_list([2, 0], sentence=True) == "ranks 0 and 2" and rank_list([4], sentence=True) == "rank 4"
    assert rank_list([2, 1, 0], sentence=True) == "ranks 0, 1 and 2"
    assert rank_list([3, 2, 1, 0], sentence=True) == "ranks 0, 1, 2, 3"
    assert task_ids("0-2,5") == [0, 1, 2, 5] and task_ids("7") == [7] and task_ids("") == []
