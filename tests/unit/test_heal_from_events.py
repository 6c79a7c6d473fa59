"""heal's evidence is read from the launchers' events (``ddpkit.launcher_output``), never by matching text in heal:
a killed, a stopped, a raising and a preempted attempt classified from what srun, Open MPI and a PyTorchJob's pods
printed (lines the drills printed: tests/infra/test_heal_slurm.py, test_heal_mpi.py, test_heal_k8s.py), with the
classes they had before the reader was shared; and the digest a person reads names the rank the classification
blames."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from ddpkit.heal.classify import FailureClass, classify
from ddpkit.heal.k8s import PodEnd
from ddpkit.heal.k8s import evidence_of as pods_evidence
from ddpkit.heal.mpi import MpiAttempt
from ddpkit.heal.mpi import evidence_of as mpi_evidence
from ddpkit.heal.slurm_step import _Reader
from ddpkit.launch.stepscreen import StepScreen

HEAL = Path(__file__).resolve().parents[2] / "src" / "ddpkit" / "heal"
#: A regular expression run on text: what heal no longer does (the readers in launcher_output do it).
MATCHING = re.compile(r"\bre\.(?:compile|search|match|fullmatch|findall|finditer|sub|split)\(|\.finditer\(|^import re$",
                      re.M)

SILENT = ("ddpkit watch: rank 1 on host {host} (pid 8857) stopped answering: no heartbeat for 10 s (under --heal a "
          "silent rank is a lost host after 10 s); every rank stops now (exit 3)")
TRACEBACK = ["Traceback (most recent call last):", '  File "/tmp/raises.py", line 8, in <module>',
             '    raise ValueError(f"bad batch at step {step}")', "ValueError: bad batch at step 5"]

SRUN = {
    "killed": ["srun: error: node2: task 1: Killed", "srun: launch/slurm: _step_signal: Terminating StepId=6.0",
               "0: slurmstepd-node1: error: *** STEP 6.0 ON node1 CANCELLED AT 2026-11-26T13:20:54 ***",
               "srun: error: node1: task 0: Terminated"],
    "stopped": [f"0: {SILENT.format(host='node2')}", "srun: error: node1: task 0: Exited with exit code 3",
                "srun: launch/slurm: _step_signal: Terminating StepId=5.0", "srun: error: node2: task 1: Terminated"],
    "raising": [*(f"1: {line}" for line in TRACEBACK), *(f"0: {line}" for line in TRACEBACK),
                "srun: error: node2: task 1: Exited with exit code 1",
                "srun: launch/slurm: _step_signal: Terminating StepId=10.1",
                "srun: error: node1: task 0: Exited with exit code 1"],
    "preempted": ["srun: error: node1: tasks 0-1: Exited with exit code 75"],
}
MPIRUN = {
    "killed": ["mpirun noticed that process rank 1 with PID 730 on node 10.0.0.12 exited on signal 9 (Killed)."],
    "stopped": [f"[1,0]<stderr>:{SILENT.format(host='h2-x')}", "[1,0]<stdout>:[RANK 0] Epoch 1"],
    "raising": [f"[1,{r}]<stderr>:{line}" for r in (0, 1) for line in TRACEBACK],
    "preempted": ["mpirun noticed that process rank 0 with PID 731 on node 10.0.0.11 exited on signal 15 "
                  "(Terminated)."],
}
CLASSES = {"killed": FailureClass.HOST, "stopped": FailureClass.HOST, "raising": FailureClass.JOB,
           "preempted": FailureClass.PREEMPTED}


def _slurm(lines: list[str]) -> _Reader:
    reader = _Reader(io.BytesIO(), lambda line: None, lambda rank: ("node1", "node2")[rank])
    reader.thread.join()
    for line in lines:
        reader._read(line)
    return reader


@pytest.mark.parametrize("how", sorted(CLASSES))
def test_srun_attempts_are_classified_from_the_srun_readers_events(how: str) -> None:
    found = classify(_slurm(SRUN[how]).evidence(1, None)[0])
    assert found.kind is CLASSES[how], found
    if found.kind is FailureClass.HOST:
        assert found.culprit_hosts == ("node2",) and found.culprit_ranks == (1,)


@pytest.mark.parametrize("how", sorted(CLASSES))
def test_mpirun_attempts_are_classified_from_the_open_mpi_readers_events(how: str) -> None:
    found = classify(mpi_evidence(MpiAttempt(exit_code=1, hosts=("10.0.0.11", "10.0.0.12"), nproc=1,
                                             lines=MPIRUN[how])))
    assert found.kind is CLASSES[how], found
    if found.kind is FailureClass.HOST:
        assert found.culprit_hosts == ("10.0.0.12",) and found.culprit_ranks == (1,)


@pytest.mark.parametrize("how", sorted(CLASSES))
def test_pod_attempts_are_classified_from_their_logs_events(how: str) -> None:
    code, log = {"killed": (137, ""), "stopped": (3, SILENT.format(host="job-worker-0")),
                 "raising": (1, "\n".join(TRACEBACK)), "preempted": (75, "")}[how]
    pods = [PodEnd(pod="job-master-0", node="node-a", exit_code=1 if how == "killed" else code, log=log),
            PodEnd(pod="job-worker-0", node="node-b", exit_code=code, log="" if how == "stopped" else log)]
    found = classify(pods_evidence(pods, code))
    assert found.kind is CLASSES[how], found
    if found.kind is FailureClass.HOST:
        assert found.culprit_hosts == ("node-b",)


@pytest.mark.parametrize("how", ["killed", "raising"])
def test_the_digest_names_first_the_rank_the_classification_blames(how: str) -> None:
    """The same srun output, through the heal supervisor's screen (its digest) and its evidence (its
    classification): one reader, one rank."""
    screen = StepScreen(io.StringIO(), io.StringIO(), agents=False, ranks_per_task=1)
    for line in SRUN[how]:
        screen.take(line, to_stderr=True, now=0.0)
    found = classify(_slurm(SRUN[how]).evidence(1, None)[0])
    headline = screen.digest(1, "LOG")[0]
    named = re.search(r": rank (\d+) on host (\S+) ", headline)
    assert named is not None, headline
    assert int(named[1]) in found.culprit_ranks and named[2] in found.culprit_hosts, (headline, found)


def test_no_module_under_heal_matches_a_regular_expression_against_text() -> None:
    found = [f"{path.name}:{text.count(chr(10), 0, m.start()) + 1}: {m[0]}"
             for path in sorted(HEAL.glob("*.py")) for text in [path.read_text()] for m in MATCHING.finditer(text)]
    assert not found, "read launcher output with ddpkit.launcher_output's readers, not in heal:\n" + "\n".join(found)


def test_the_check_for_regular_expressions_can_fail() -> None:
    for text in ("import re\n", "X = re.compile(r'a')\n", "m = re.search('a', t)\n", "for m in X.finditer(t):\n",
                 "re.match('a', t)\n"):
        assert MATCHING.search(text), text
    assert not MATCHING.search("from ddpkit.launcher_output import reader_for\nscore = more.sum()\n")
