"""The evidence each heal backend reads (issue 38), on the lines the real tools print: Open MPI's tagged output
under ``submit mpi --heal``, a PyTorchJob's pods under ``heal.k8s``, torch's failed-worker log records and the
rendezvous store's exclusion list under ``heal.elastic``. The infra tests run them for real
(tests/infra/test_heal_mpi.py, test_heal_k8s.py, test_heal_multihost.py); these pin each rule in milliseconds."""

from __future__ import annotations

import logging
from pathlib import Path

from ddpkit.heal.classify import FailureClass, classify
from ddpkit.heal.elastic import stop_together
from ddpkit.heal.elastic_round import Excluded, ExclusionList, _TorchFailures
from ddpkit.heal.k8s import PodEnd, record_attempt
from ddpkit.heal.k8s import evidence_of as pods_evidence
from ddpkit.heal.mpi import MpiAttempt
from ddpkit.heal.mpi import evidence_of as mpi_evidence
from ddpkit.heal.policy import EXIT_DO_NOT_REQUEUE, HealPolicy
from ddpkit.rundir.ledger import Action, HostExcluded, Ledger

HOSTS = ("10.0.0.11", "10.0.0.12", "10.0.0.13")
TRACEBACK = ["Traceback (most recent call last):", '  File "job.py", line 3, in <module>', "ValueError: bad batch"]


def test_mpi_a_silent_rank_names_its_host_by_the_attempts_host_list() -> None:
    lines = ["[1,0]<stderr>:ddpkit watch: rank 3 on host h2-x (pid 77) stopped answering: no heartbeat for 10 s",
             "[1,0]<stdout>:[RANK 0] Epoch 1"]
    found = classify(mpi_evidence(MpiAttempt(exit_code=3, hosts=HOSTS[:2], nproc=2, lines=lines)))
    assert found.kind is FailureClass.HOST and found.culprit_hosts == (HOSTS[1],)  # rank 3 = host 1 with P=2
    assert found.culprit_ranks == (3,)


def test_mpi_a_rank_killed_by_a_signal_is_its_hosts_fault() -> None:
    lines = ["mpirun noticed that process rank 1 with PID 730 on node 10.0.0.12 exited on signal 9 (Killed)."]
    found = classify(mpi_evidence(MpiAttempt(exit_code=137, hosts=HOSTS[:2], nproc=1, lines=lines)))
    assert found.kind is FailureClass.HOST and found.culprit_hosts == (HOSTS[1],)
    assert "was killed by SIGKILL" in found.reason


def test_mpi_the_same_traceback_on_every_rank_is_the_programs_own() -> None:
    lines = [f"[1,{r}]<stderr>:{line}" for r in (0, 1) for line in TRACEBACK]
    found = classify(mpi_evidence(MpiAttempt(exit_code=1, hosts=HOSTS[:2], nproc=1, lines=lines)))
    assert found.kind is FailureClass.JOB and found.culprit_ranks == (0, 1)


def _pod(name: str, node: str, code: int, log: str = "") -> PodEnd:
    return PodEnd(pod=name, node=node, exit_code=code, log=log)


def test_k8s_the_pod_a_signal_ended_names_its_node_not_torchruns_report() -> None:
    master = _pod("job-master-0", "node-a", 1, "[job-master-0:0] ERROR rank 0: another rank is gone\n"
                  "Traceback (most recent call last):\n  File \"torchrun\"\n"
                  "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n")
    worker = _pod("job-worker-0", "node-b", 137, "[job-worker-0:1] WARNING setting GLOO_SOCKET_IFNAME=eth0\n")
    found = classify(pods_evidence([master, worker], 1))
    assert found.kind is FailureClass.HOST and found.culprit_hosts == ("node-b",)
    assert found.reason == "rank 1 on host node-b was killed by SIGKILL"


def test_k8s_a_silent_rank_is_named_by_the_node_its_pod_ran_on() -> None:
    log = "ddpkit watch: rank 1 on host job-worker-0 (pid 9) stopped answering: no heartbeat for 10 s\n"
    found = classify(pods_evidence([_pod("job-master-0", "node-a", 3, log), _pod("job-worker-0", "node-c", 137)], 3))
    assert found.kind is FailureClass.HOST and found.culprit_hosts == ("node-c",)


def test_k8s_record_attempt_excludes_a_node_once_and_a_job_fault_twice_ends_with_93(tmp_path: Path) -> None:
    ledger, policy = Ledger(tmp_path), HealPolicy()
    killed = [_pod("p0", "node-a", 1), _pod("p1", "node-b", 137)]
    said, out = record_attempt(ledger, killed, started=1.0, policy=policy, progress=64)
    assert said.decision.action is Action.RETRY and out == ("node-b",)
    assert "node node-b kept out of the next attempt (nodeAffinity NotIn)" in said.line
    raising = [_pod(f"p{i}", n, 1, "\n".join(TRACEBACK)) for i, n in enumerate(("node-a", "node-c"))]
    said, out = record_attempt(ledger, raising, started=2.0, policy=policy, progress=64)
    assert said.decision.action is Action.RETRY and out == ("node-b",)  # a job fault names no node
    said, _ = record_attempt(ledger, raising, started=3.0, policy=policy, progress=64)
    assert said.decision.action is Action.STOP and said.decision.exit_code == EXIT_DO_NOT_REQUEUE
    assert "the second in a row: retrying cannot help; stopping with exit 93" in said.line
    assert [r.host for r in ledger.records() if isinstance(r, HostExcluded)] == ["node-b"]


def test_elastic_the_exclusion_list_keeps_each_host_once_in_a_torch_store() -> None:
    from torch.distributed import HashStore

    exclusions = ExclusionList(HashStore())
    assert exclusions.read() == []
    entry = Excluded(host="h2", reason="rank 1 on host h2 stopped answering", by="h1", time=5.0)
    assert exclusions.add(entry) and not exclusions.add(Excluded(host="h2", reason="x", by="h3", time=6.0))
    assert exclusions.read() == [entry]


def test_elastic_the_host_that_stops_the_run_waits_until_every_host_of_the_round_has() -> None:
    """The store's host leaves last: a host that stopped the run (a job fault, seen on every host) waits until the
    round's other hosts have stopped it too, so none of them loses the store while it judges its own ranks (in a
    run under load one said only 'the store was lost, exit 3' where the other said 93)."""
    import threading

    from torch.distributed import HashStore

    store = HashStore()
    first: list[int] = []
    holder = threading.Thread(target=lambda: first.append(stop_together(store, 2, timeout=30)))
    holder.start()
    holder.join(0.6)
    assert holder.is_alive(), "the store's host left before the other host stopped the run"
    assert stop_together(store, 2, timeout=30) == 2
    holder.join(5)
    assert not holder.is_alive() and first == [2]
    assert stop_together(HashStore(), 3, timeout=0.3) == 1  # a host that never stops it: bounded


def test_elastic_torchs_failed_worker_lines_are_read_before_the_agents_filter_drops_them() -> None:
    from ddpkit.launch.failure import drop_exit_tracebacks

    logger = logging.getLogger("test.heal.torch.failures")
    failures = _TorchFailures()
    logger.filters.insert(0, failures)
    logger.addFilter(drop_exit_tracebacks)
    try:
        logger.error("failed (exitcode: %s) local_rank: %s (pid: %s) of fn: %s (start_method: %s)", -9, 0, 4242,
                     "main", "fork")
    finally:
        logger.removeFilter(failures)
        logger.removeFilter(drop_exit_tracebacks)
    assert failures.seen == [(-9, 0, 4242)]


def test_mpi_an_attempt_keeps_its_last_lines_in_memory_and_every_line_in_its_log(tmp_path: Path) -> None:
    """A real bash 'attempt' printing more lines than the supervisor keeps: all of them in the log, the last
    KEPT_LINES in memory (the evidence is at the end), and the failure still read from them."""
    from ddpkit.heal.mpi import KEPT_LINES, _run

    many = KEPT_LINES + 5000
    script = (f"for i in $(seq 1 {many}); do echo \"[1,0]<stdout>:line $i\"; done\n"
              "echo 'mpirun noticed that process rank 1 with PID 730 on node 10.0.0.12 exited on signal 9 (Killed).'\n"
              "exit 137\n")
    log = tmp_path / "attempt.log"
    run = _run(script, log, HOSTS[:2], 1)
    assert run.exit_code == 137 and len(run.lines) == KEPT_LINES
    assert len(log.read_text().splitlines()) == many + 1
    assert classify(mpi_evidence(run)).culprit_hosts == (HOSTS[1],)
