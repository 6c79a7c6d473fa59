"""Live healing across hosts without Slurm, on namespace hosts: ``train -j 2x2 --rdzv-endpoint H1:PORT --heal live``
on h1 and h2, the same with ``--standby`` on h3 (``ddpkit.heal.live_hosts``). A host lost (its member and ranks
killed, stopped, or its network cut) has its two ranks replaced together on h3 in one generation; h1's ranks keep
their processes; nothing is read from a snapshot; the job ends 0 on h1 and h3."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ddpkit.heal.policy import EXIT_DO_NOT_REQUEUE
from ddpkit.rundir.ledger import AttemptEnded, AttemptStarted, HostExcluded, Ledger
from tests.infra.conftest import Hosts
from tests.infra.live_hosts_drill import RUN_TIMEOUT, heals_of, start, strike, until

pytestmark = [pytest.mark.infra, pytest.mark.multiproc]


@pytest.fixture
def three_hosts(make_hosts: Callable[[int], Hosts]) -> Hosts:
    return make_hosts(3)


def _check(run: dict[str, Any], where: Path, fault: str) -> None:
    h1, h2, h3 = (r.host for r in run["runs"])
    leader, standby = run["runs"][0], run["runs"][2]
    assert leader.returncode == 0 and standby.returncode == 0, leader.output() + standby.output()
    heals = run["heals"]
    assert sorted(h.rank for h in heals) == [2, 3] and {h.gen for h in heals} == {1}, heals  # one generation
    assert {(h.host, h.replacement_host, h.kept, h.together) for h in heals} == {
        (h2.hostname, h3.hostname, (0, 1), (2, 3))}, heals
    why = {"kill": "SIGKILL", "stop": "silent", "link": "silent"}[fault]
    assert all(h.why.startswith(why) for h in heals), heals
    assert run["kept"] and len(run["kept"]) == 2 and run["alive"] == run["kept"], run  # h1's ranks never restarted
    records = run["ledger"]
    assert [r.hosts for r in records if isinstance(r, AttemptStarted)] == [(h1.hostname, h2.hostname)], records
    assert [r.exit_code for r in records if isinstance(r, AttemptEnded)] == [0], records
    assert [r.host for r in records if isinstance(r, HostExcluded)] == [h2.hostname], records
    line = f"ddpkit heal: ranks 2, 3 on {h2.hostname} lost together ("
    assert line in leader.stderr and f"; replacements on {h3.hostname} (pids " in leader.stderr, leader.stderr
    assert "Snapshots: 80 written, 0 loaded" in leader.stdout and "replicas: 4 equal" in leader.stdout, leader.stdout
    summary = json.loads((where / "summary.json").read_text())
    assert summary["resumed_from"] is None and len(set(summary["replica_digests"])) == 1, summary
    assert summary["global_step"] == 80 * 12, summary  # no step lost, none done twice
    print(f"{fault}: fault -> decided {max(h.decided_at or 0 for h in heals) - run['fault_at']:.2f} s, -> first "
          f"step {max(h.first_step_at or 0 for h in heals) - run['fault_at']:.2f} s")


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "link"])
def test_a_lost_host_s_ranks_move_to_the_standby_host_live(three_hosts: Hosts, tmp_path: Path, fault: str) -> None:
    """h2's member and ranks killed (its connection to the agent ends: seen at once), and separately h2's cable
    pulled (its beat stands still 3 s; h1's ranks, blocked with it, shut their connections to it)."""
    run = strike(three_hosts, tmp_path, fault, victim_s=90 if fault == "link" else 0)
    _check(run, tmp_path, fault)
    if fault == "link":  # h2's member, its endpoint unreachable, ends on its own (not after minutes of retries)
        h2 = run["runs"][1]
        assert h2.returncode == 3 and "the endpoint's host" in h2.stderr and "is gone" in h2.stderr, h2.output()


@pytest.mark.slow
def test_a_stopped_host_is_found_silent_and_its_ranks_replaced(three_hosts: Hosts, tmp_path: Path) -> None:
    """Every process of h2 stopped (SIGSTOP): its member's beat stands still, as for a frozen host."""
    _check(strike(three_hosts, tmp_path, "stop"), tmp_path, "stop")


def test_a_clean_run_across_hosts_uses_no_standby_and_ends_0_everywhere(three_hosts: Hosts, tmp_path: Path) -> None:
    runs = start(three_hosts, tmp_path, job=("train", "--epochs", "3", "--samples", "1536", "--model", "toy"))
    for run in runs:
        run.wait(RUN_TIMEOUT)
    assert [r.returncode for r in runs] == [0, 0, 0], "\n".join(r.output() for r in runs)
    assert heals_of(tmp_path) == []
    h2, h3 = three_hosts[1].hostname, three_hosts[2].hostname
    assert f"ddpkit live: host {h2} (" in runs[0].stderr and f"{h3} (" in runs[0].stderr, runs[0].stderr
    assert "as a standby" in runs[2].stderr and "[RANK" not in runs[2].stdout, runs[2].output()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 4 and len(set(summary["replica_digests"])) == 1, summary
    assert three_hosts.leftover() == {}


def test_losing_the_endpoint_s_host_ends_the_job_on_every_host_and_says_why(three_hosts: Hosts,
                                                                           tmp_path: Path) -> None:
    """h1 holds the stores and the agent: killed, the members end their ranks and exit 3 naming it."""
    runs = start(three_hosts, tmp_path)
    until(lambda: bool(list((tmp_path / "snaps").glob("snap.*.pt"))), runs, 180, "no snapshot")
    for pid in three_hosts.cluster.pids(three_hosts[0]):
        os.kill(pid, signal.SIGKILL)
    for run in runs[1:]:
        run.wait(120)
        assert run.returncode == 3, run.output()
        assert f"the endpoint's host ({three_hosts.endpoint(29500)}) is gone: it holds the job's store and its " \
               "live agent" in run.stderr, run.output()
    assert three_hosts.leftover(grace=15) == {}


def test_with_no_standby_the_restart_heal_goes_on_with_fewer_hosts(three_hosts: Hosts, tmp_path: Path) -> None:
    """``-j 1:2x2`` and no standby host: h2 killed; nothing can take its ranks live, so the attempt ends and the next
    runs on h1 alone from the newest snapshot."""
    runs = start(three_hosts, tmp_path, standby=0, shape="1:2x2",
                 job=("train", "--epochs", "30", "--samples", "1536", "--model", "toy"))
    until(lambda: len(list((tmp_path / "snaps").glob("snap.*.pt"))) >= 2, runs, 180, "no two snapshots")
    for pid in three_hosts.cluster.pids(three_hosts[1]):
        os.kill(pid, signal.SIGKILL)
    leader = runs[0].wait(RUN_TIMEOUT)
    assert leader.returncode == 0, leader.output()
    assert "no standby left" in leader.stderr, leader.stderr
    records = Ledger(tmp_path / "run").records()
    started = [r.hosts for r in records if isinstance(r, AttemptStarted)]
    assert started == [(three_hosts[0].hostname, three_hosts[1].hostname), (three_hosts[0].hostname,)], records
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["resumed_from"] is not None, summary


@pytest.mark.slow
def test_a_script_s_lost_host_moves_to_the_standby_host_as_train_s_does(three_hosts: Hosts, tmp_path: Path) -> None:
    """The seeds' ddp.py with docs/heal.md's lines (``live.Replica``) under ``run -j 2x2 ... --heal live -- ddp.py``:
    h2 killed; its ranks go on on h3; the four replicas' weights equal at the end, and they trained."""
    import re

    script = tmp_path / "ddp.py"
    script.write_text((Path(__file__).parents[1] / "multiproc" / "seeds_ddp_live.py").read_text())
    runs: list[Any] = []
    run = strike(three_hosts, tmp_path, "kill", job=("run", "--", str(script), "80", "50"),
                 ready=lambda: any("Epoch 3 " in r.stdout for r in runs[:1]), started=runs)
    leader, standby = run["runs"][0], run["runs"][2]
    assert leader.returncode == 0 and standby.returncode == 0, leader.output() + standby.output()
    h2, h3 = three_hosts[1].hostname, three_hosts[2].hostname
    heals = run["heals"]
    assert {(h.rank, h.host, h.replacement_host, h.gen) for h in heals} == {(2, h2, h3, 1), (3, h2, h3, 1)}, heals
    assert run["kept"] and run["alive"] == run["kept"], run
    digests = re.findall(r"done: weights ([0-9a-f]+) moved ([-+.\de]+)", leader.stdout + standby.stdout)
    assert len(digests) == 4 and len({weights for weights, _ in digests}) == 1, leader.output() + standby.output()
    assert min(float(moved) for _, moved in digests) > 1e-3, digests  # the script trains


#: Fails on purpose on one rank (argv[1]) after a few all-reduces; the others wait in the next one.
FAILS_ON = """
import sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
for step in range(5):
    t = torch.ones(1)
    dist.all_reduce(t)
    time.sleep(0.1)
if dist.get_rank() == int(sys.argv[1]):
    raise ValueError(f"bad batch at step 5 on rank {dist.get_rank()}, on purpose")
dist.all_reduce(torch.ones(1))
"""


@pytest.mark.parametrize("rank", [2, 0])
def test_a_script_s_own_failure_on_any_host_is_classified_from_its_traceback(three_hosts: Hosts, tmp_path: Path,
                                                                             rank: int) -> None:
    """A rank raises on h2 (a member's) or on h1 (the agent's own host): the program's failure, not healed live;
    the restart heal names the exception and where it was raised (a member sends a failed rank's stderr with its
    end), and stops once it repeats (before: "exited with code 1 and left no traceback", an unknown fault)."""
    script = tmp_path / "fails.py"
    script.write_text(FAILS_ON)
    runs = start(three_hosts, tmp_path, standby=0, job=("run", "--", str(script), str(rank)))
    leader = runs[0].wait(RUN_TIMEOUT)
    host = three_hosts[rank // 2].hostname
    said = f"ValueError: bad batch at step 5 on rank {rank}, on purpose on rank {rank} (host {host})"
    assert leader.returncode == EXIT_DO_NOT_REQUEUE and said in leader.stderr, leader.output()
    assert "left no traceback" not in leader.stderr, leader.output()
    records = Ledger(tmp_path / "run").records()
    assert len([r for r in records if isinstance(r, AttemptStarted)]) == 2, records  # the same fault twice: stop
