"""Issue 46 on a real Slurm cluster of three namespace nodes: ``ddpkit submit slurm -j 2x1 --spare-nodes 1 --heal live
--wait -- train ...``; a few seconds in, node2's rank is stopped (SIGSTOP) or killed (SIGKILL). The job ends
COMPLETED in its one attempt; the standby on node3 took rank 1's place and its state from rank 0, no snapshot was
loaded; node1's rank is the same process from before the fault to the heal; node2 is excluded and runs nothing
after the heal; the replicas end equal and the loss history equals an uninterrupted run's, bitwise.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from ddpkit.rundir.ledger import AttemptEnded, AttemptStarted, HostExcluded, Ledger, RankReplaced
from tests.infra.slurm_fixture import HEAL_JOB_TIMEOUT as JOB_TIMEOUT
from tests.infra.slurm_fixture import HEAL_TRAIN as TRAIN
from tests.infra.slurm_fixture import clean_heal_run, heal_fixtures, job_ledger, job_log, pids_on, submit_healing

pytestmark = [pytest.mark.infra, pytest.mark.multiproc]


cluster, uninterrupted = heal_fixtures("ddpkit-slurm-live-")


def _submit(c: Any, cwd: Path, *job: str, heal: tuple[str, ...] = ("--heal", "live")) -> subprocess.Popen[str]:
    # benchmarks/bench_live_heal_slurm.py submits through this too (with a plain --heal)
    return submit_healing(c, cwd, *job, heal=heal)


def _ranks_on(node: Any) -> list[int]:
    """The rank processes in a node's namespace (``PYTHON -m ddpkit.standby ... -- train``)."""
    return pids_on(node, lambda words: words[1:3] == [b"-m", b"ddpkit.standby"])


def _until(what: str, ok: Any, proc: subprocess.Popen[str], timeout: float = 120) -> Any:
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        found = ok()
        if found:
            return found
        if proc.poll() is not None:
            pytest.fail(f"the job ended before {what}: {proc.communicate()[0]}")
        time.sleep(0.1)
    pytest.fail(f"no {what} within {timeout} s")


def _idle(c: Any) -> None:
    """Every node idle in Slurm again before the next test."""
    until = time.monotonic() + 120
    while time.monotonic() < until:
        states = c.client("sinfo", "-h", "-N", "-o", "%T").stdout.split()
        if states and all(s == "idle" for s in states):
            return
        time.sleep(1)
    pytest.fail("the nodes were not idle again within 120 s")


def _faulted(c: Any, where: Path, fault: str, job: tuple[str, ...], *, shape: tuple[str, ...], ready: Any,
             per_node: int) -> dict[str, Any]:
    """Submit ``job`` (``shape``, ``--heal live``); once ``ready()`` and node1 and node2 run ``per_node`` ranks each,
    stop or kill every rank of node2 at once; wait for a ``rank-replaced`` record for each, then for the job. What it
    measured and what the job left (``heals``: the records, in the ledger's order)."""
    node1, node2 = c.nodes[:2]
    proc = submit_healing(c, where, *job, shape=shape, heal=("--heal", "live"))
    try:
        _until("the job under way", lambda: ready() and len(_ranks_on(node2)) == per_node
               and len(_ranks_on(node1)) == per_node, proc)
        time.sleep(1)
        kept, victims = _ranks_on(node1), _ranks_on(node2)
        fault_at = time.time()
        if fault == "link":  # node2 cut off: its ranks run on, nothing of theirs reaches anyone
            subprocess.run(["ip", "-n", node2.netns, "link", "set", node2.veth, "down"], check=True)
        for pid in victims if fault != "link" else ():
            os.kill(pid, signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
        (run,) = list((where / ".ddpkit-runs").glob("slurm-*"))

        def replaced() -> list[RankReplaced]:
            heals = [r for r in Ledger(run).records() if isinstance(r, RankReplaced)]
            return heals if len(heals) >= per_node else []

        healed = _until(f"{per_node} rank-replaced record(s)", replaced, proc)
        alive = [pid for pid in kept if Path(f"/proc/{pid}").exists()]
        out, _ = proc.communicate(timeout=JOB_TIMEOUT + 60)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _ranks_on(node2):
            os.kill(pid, signal.SIGKILL)
        if fault == "link":  # Slurm hears from node2 again only at its next ping (minutes): the module's last drill
            subprocess.run(["ip", "-n", node2.netns, "link", "set", node2.veth, "up"], check=False)
        else:
            _idle(c)
    return {"out": out, "code": proc.returncode, "log": job_log(where), "records": job_ledger(where), "kept": kept,
            "alive": alive, "fault_at": fault_at, "heals": healed}


def drill(c: Any, where: Path, fault: str) -> dict[str, Any]:
    """One drill (also run by benchmarks/bench_live_heal_slurm.py): node2's rank stopped or killed a few
    seconds in; what it measured and what the job left."""
    snaps = where / "snaps"
    snaps.mkdir()
    run = _faulted(c, where, fault, (*TRAIN, "--snapshot-path", str(snaps / "snap.pt"), "--json",
                                     str(where / "summary.json")),
                   shape=("-j", "2x1", "--spare-nodes", "1"), per_node=1,
                   ready=lambda: len(list(snaps.glob("snap.*.pt"))) >= 2)
    return {**run, "heal": run["heals"][0], "node3": c.nodes[2].name}


def _check(run: dict[str, Any], uninterrupted: dict[str, Any], where: Path, fault: str) -> None:
    out, log, records, heal = run["out"], run["log"], run["records"], run["heal"]
    assert run["code"] == 0 and "COMPLETED exit code 0 (restarts 0)" in out, out + log
    started = [r for r in records if isinstance(r, AttemptStarted)]
    ended = [r for r in records if isinstance(r, AttemptEnded)]
    assert [r.hosts for r in started] == [("node1", "node2")] and [r.exit_code for r in ended] == [0], log
    assert (heal.rank, heal.host, heal.replacement_host, heal.kept, heal.source) == (1, "node2", "node3", (0,), 0)
    assert heal.why.startswith("SIGKILL" if fault == "kill" else "stopped (SIGSTOP)"), heal
    assert run["kept"] and run["alive"] == run["kept"], run  # node1's rank never restarted
    (excluded,) = [r for r in records if isinstance(r, HostExcluded)]
    assert excluded.host == "node2" and excluded.attempt == 1
    line = "ddpkit heal: rank 1 on node2 lost ("
    assert line in log and "a replacement on node3 (pid " in log and "took its state from rank 0" in log, log
    assert "[node2:" not in log.split(line, 1)[1], log  # node2 runs nothing after the heal
    assert "Snapshots: 100 written, 0 loaded" in log and "Live heals: 1; replicas: 2 equal" in log, log
    summary = json.loads((where / "summary.json").read_text())
    assert summary["resumed_from"] is None and len(set(summary["replica_digests"])) == 1, summary
    assert summary["loss_history"] == uninterrupted["loss_history"]  # bitwise: floats compared exactly
    print(f"{fault}: fault -> decided {heal.decided_at - run['fault_at']:.2f} s, -> first step "
          f"{heal.first_step_at - run['fault_at']:.2f} s")


@pytest.mark.slow
def test_a_killed_rank_is_replaced_live_by_the_spare_standby(cluster: Any, tmp_path: Path,
                                                              uninterrupted: dict[str, Any]) -> None:
    _check(drill(cluster, tmp_path, "kill"), uninterrupted, tmp_path, "kill")


@pytest.mark.slow
def test_a_stopped_rank_is_found_by_its_pulse_and_replaced_live(cluster: Any, tmp_path: Path,
                                                                     uninterrupted: dict[str, Any]) -> None:
    _check(drill(cluster, tmp_path, "stop"), uninterrupted, tmp_path, "stop")


def test_a_clean_live_job_replaces_nobody_and_ends_its_standby(cluster: Any, tmp_path: Path) -> None:
    log, records = clean_heal_run(cluster, tmp_path, heal=("--heal", "live"))
    assert not [r for r in records if isinstance(r, RankReplaced | HostExcluded)], records
    assert "Live heals: 0; replicas: 2 equal" in log and "ddpkit standby" not in log, log
    assert not _ranks_on(cluster.nodes[2]), "the standby on node3 outlived the job"


#: A node of two ranks (-j 2x2 on node1, node2; node3 the spare, with two standbys)
NODE = ("-j", "2x2", "--spare-nodes", "1")


def node_drill(c: Any, where: Path, fault: str, *job: str, ready: Any) -> dict[str, Any]:
    """Both ranks of node2 killed or stopped at once, once ``ready(where)``; what the job left."""
    return _faulted(c, where, fault, job, shape=NODE, per_node=2, ready=lambda: ready(where))


def _check_node(run: dict[str, Any], fault: str) -> None:
    """Node2's two ranks (2 and 3) replaced together on node3 in one generation, node1's ranks the same processes,
    node2 out, the run completed in its one attempt."""
    out, log, records, heals = run["out"], run["log"], run["records"], run["heals"]
    assert run["code"] == 0 and "COMPLETED exit code 0 (restarts 0)" in out, out + log
    started = [r for r in records if isinstance(r, AttemptStarted)]
    ended = [r for r in records if isinstance(r, AttemptEnded)]
    assert [r.hosts for r in started] == [("node1", "node2")] and [r.exit_code for r in ended] == [0], log
    # one generation: the first, or (srun telling of the second step's end after the settle) the one that took over
    # the first's pending replacement ("replacing them together")
    gens = {h.gen for h in heals}
    assert sorted(h.rank for h in heals) == [2, 3] and len(gens) == 1, heals
    assert gens == {1} or "replacing them together" in log, log
    assert {(h.host, h.replacement_host, h.kept, h.together) for h in heals} == {("node2", "node3", (0, 1), (2, 3))}
    why = {"kill": "SIGKILL", "stop": "stopped (SIGSTOP)", "link": "silent (no word from its host)"}[fault]
    assert all(h.why.startswith(why) for h in heals), heals
    assert run["kept"] and run["alive"] == run["kept"], run  # node1's ranks never restarted
    assert [r.host for r in records if isinstance(r, HostExcluded)] == ["node2"], records
    line = "ddpkit heal: ranks 2, 3 on node2 lost together ("
    assert line in log and "; replacements on node3 (pids " in log and "took their state from rank" in log, log
    assert "[node2:" not in log.split(line, 1)[1], log  # node2 runs nothing after the heal
    print(f"node {fault}: fault -> decided {max(h.decided_at for h in heals) - run['fault_at']:.2f} s, -> first "
          f"step {max(h.first_step_at or 0 for h in heals) - run['fault_at']:.2f} s")


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_lost_node_s_two_ranks_are_replaced_together_on_the_spare(cluster: Any, tmp_path: Path, fault: str) -> None:
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    run = node_drill(cluster, tmp_path, fault, *TRAIN, "--snapshot-path", str(snaps / "snap.pt"), "--json",
                     str(tmp_path / "summary.json"), ready=lambda where: len(list(snaps.glob("snap.*.pt"))) >= 2)
    _check_node(run, fault)
    assert "Snapshots: 100 written, 0 loaded" in run["log"] and "replicas: 4 equal" in run["log"], run["log"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["resumed_from"] is None and len(set(summary["replica_digests"])) == 1, summary


@pytest.mark.slow
def test_a_script_s_lost_node_is_replaced_live_as_train_s_is(cluster: Any, tmp_path: Path) -> None:
    """The seeds' ddp.py with docs/heal.md's lines (``live.Replica``), submitted as ``-- ddp.py``: node2's two ranks
    killed at once, replaced together on node3; the four replicas' weights equal at the end, and they trained."""
    import re

    (tmp_path / "ddp.py").write_text((Path(__file__).parents[1] / "multiproc" / "seeds_ddp_live.py").read_text())
    run = node_drill(cluster, tmp_path, "kill", str(tmp_path / "ddp.py"), "80", "50",
                     ready=lambda where: "Epoch 3 " in job_log(where))
    _check_node(run, "kill")
    digests = re.findall(r"done: weights ([0-9a-f]+) moved ([-+.\de]+)", run["log"])
    # the weights equal; how far each moved is from its own first weights (each rank draws its own before DDP's
    # broadcast), so that differs
    assert len(digests) == 4 and len({weights for weights, _ in digests}) == 1, run["log"]
    assert min(float(moved) for _, moved in digests) > 1e-3, digests  # the script trains


@pytest.mark.slow
def test_a_hung_rank_is_named_by_the_watch_and_replaced_on_the_spare(cluster: Any, tmp_path: Path) -> None:
    """Under Slurm too: node2's rank sleeps in its step before step 200 (a test fault of the first generation,
    running, not stopped); the watch (on the supervisor's store, ``--collective-timeout 10``: its deadline) names it
    with its stack, the agent ends its step and the standby on node3 takes its place; COMPLETED in one attempt."""
    import re

    proc = submit_healing(cluster, tmp_path, "train", "--epochs", "20", "--samples", "1536", "--model", "toy",
                          "--collective-timeout", "10", "--snapshot-path", str(tmp_path / "snap.pt"), "--json",
                          str(tmp_path / "summary.json"),
                          heal=("--heal", "live", "--env", "DDPKIT_FAULTS=hang:phase=step:rank=1:step=200:gen=0"))
    try:
        out, _ = proc.communicate(timeout=JOB_TIMEOUT + 60)
    finally:
        if proc.poll() is None:
            proc.kill()
        _idle(cluster)
    log, records = job_log(tmp_path), job_ledger(tmp_path)
    assert proc.returncode == 0 and "COMPLETED exit code 0 (restarts 0)" in out, out + log
    assert re.search(r"ddpkit watch: rank 0 on host node1 has waited \d+ s in the group's collective #\d+ for rank 1 "
                     r"on host node2, which is alive and busy outside any collective \(its stack below\); rank\(s\) 1 "
                     r"replaced live \(--heal live\)", log), log
    heals = [r for r in records if isinstance(r, RankReplaced)]
    assert [(h.rank, h.host, h.replacement_host, h.why) for h in heals] == [
        (1, "node2", "node3", "hung, named by the watch")], heals
    assert [r.host for r in records if isinstance(r, HostExcluded)] == ["node2"], records
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["snapshots_loaded"] == 0 and len(set(summary["replica_digests"])) == 1, summary


@pytest.mark.slow
def test_a_node_cut_off_has_its_two_ranks_replaced_together_on_the_spare(cluster: Any, tmp_path: Path) -> None:
    """node2's network cut (its link down): its ranks run on but nothing of theirs arrives, no reset either. Their
    pulses stand still, the agent ends them (scancel cannot reach them: taken as ended ``UNREACHED_S`` later),
    node1's ranks, blocked in a collective with them, shut their own connections to node2 and re-form with the
    replacements on node3. Last in the module: Slurm hears from node2 again only minutes after its link is up."""
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    run = node_drill(cluster, tmp_path, "link", *TRAIN, "--snapshot-path", str(snaps / "snap.pt"), "--json",
                     str(tmp_path / "summary.json"), ready=lambda where: len(list(snaps.glob("snap.*.pt"))) >= 2)
    _check_node(run, "link")
    assert "connection(s) to" in run["log"] and "so its collective fails" in run["log"], run["log"]
    assert "Snapshots: 100 written, 0 loaded" in run["log"] and "replicas: 4 equal" in run["log"], run["log"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["resumed_from"] is None and len(set(summary["replica_digests"])) == 1, summary
