"""``ddpkit submit mpi --heal`` with real Open MPI across namespace hosts (issue 38): mpirun starts its daemons on
the other hosts through an rsh agent that enters their network namespace (as ssh would log in), each attempt one
mpirun; a host whose rank is stopped is left out of the next attempt's host list, and the job finishes on the
others, bitwise equal to an uninterrupted run; with no host to spare it stops with exit 94 and says so.

Each test fails without the feature: without ``--heal`` the job fails once and stays failed; without the
exclusion the next attempt runs on the stopped host again.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import RAISES_ON_EVERY_RANK, assert_same_newest_model, require_tools, uninterrupted_train
from tests.infra.conftest import HostRun, Hosts

pytestmark = [pytest.mark.infra, pytest.mark.multiproc]
RUN_TIMEOUT = 300
# the rsh agent Open MPI calls as `AGENT HOST COMMAND...`: the command in HOST's namespace, as ssh would run it
RSH = """#!/bin/sh
host="$1"; shift
exec {python} {nshosts} exec "$host" --id {run_id} -- sh -c "$*"
"""


def _submit(hosts: Hosts, shape: str, on: list[int], work: Path, *job: str) -> HostRun:
    rsh = work / "rsh.sh"
    rsh.write_text(RSH.format(python=sys.executable, nshosts=Path("scripts/nshosts.py").resolve(),
                              run_id=hosts.cluster.run_id))
    rsh.chmod(0o755)
    # host addresses, not names: a host's own name resolves to 127.0.1.1 inside it (Debian's /etc/hosts)
    names = ",".join(hosts[i].ip for i in on)
    return hosts.ddpkit(hosts[0], "submit", "mpi", "-j", shape, "--hosts", names, "--heal", "--allow-run-as-root",
                        "--env", "OMP_NUM_THREADS=1", "--run-dir", str(work / "run"), "--", *job,
                        OMPI_MCA_plm_rsh_agent=str(rsh), OMPI_MCA_oob_tcp_if_include="eth0",
                        OMPI_MCA_btl_tcp_if_include="eth0")


def _train(work: Path) -> list[str]:
    # 60 epochs (~3 s here): a fault after the first snapshot lands mid-training (4 epochs ended in 0.2 s, before the
    # fault, which then stopped a rank in its teardown, where no watch runs: the attempt never ended)
    return ["train", "--samples", "8192", "--epochs", "60", "--snapshot-path", str(work / "snap.pt"), "--json",
            str(work / "summary.json")]


def _rank_pids(hosts: Hosts, index: int) -> list[int]:
    """The ddpkit rank processes on host ``index`` (not Open MPI's daemon)."""
    out = []
    for pid in hosts.cluster.pids(hosts[index]):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"ddpkit" in argv and b"train" in argv:
            out.append(pid)
    return out


def _wait_for(what: Callable[[], object], runs: list[HostRun], timeout: float, said: str) -> object:
    deadline = time.monotonic() + timeout
    while not (found := what()):
        if time.monotonic() > deadline or any(r.returncode is not None for r in runs):
            pytest.fail(f"{said} not within {timeout} s\n" + "\n".join(r.output() for r in runs))
        time.sleep(0.2)
    return found


def _ledger(work: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (work / "run" / "ledger.jsonl").read_text().splitlines() if line.strip()]


def _signal_h2_after_a_snapshot(hosts: Hosts, shape: str, on: list[int],
                                sig: signal.Signals) -> tuple[HostRun, Path, float]:
    """Training submitted with -j ``shape`` over the hosts ``on``; once it wrote a snapshot, h2's ranks sent ``sig``:
    the run, ended, its directory (the job's files) and the time of the signal."""
    work = Path(hosts.cluster.workdir) / "job"
    work.mkdir()
    run = _submit(hosts, shape, on, work, *_train(work))
    _wait_for(lambda: list(work.glob("snap.*.pt")), [run], 240, "a snapshot")
    for pid in _wait_for(lambda: _rank_pids(hosts, 1), [run], 30, "h2's rank"):  # type: ignore[attr-defined]
        os.kill(pid, sig)
    at = time.time()
    run.wait(RUN_TIMEOUT)
    return run, work, at


@pytest.mark.slow  # 3 hosts, two attempts and a reference run
def test_a_stopped_host_is_left_out_and_a_spare_finishes_bitwise(make_hosts: Callable[[int], Hosts],
                                                                  tmp_path: Path) -> None:
    """-j 2x1 over --hosts h1,h2,h3 (h3 a spare): h2's rank SIGSTOPped after the first snapshot. The watch stops
    the job within seconds, the supervisor names h2, leaves it out, and relaunches on h1, h3 from the snapshot; the
    run ends bitwise equal to `train -n 2` (loss history and model); h2 runs no later attempt."""
    require_tools("mpirun")
    hosts = make_hosts(3)
    run, work, at = _signal_h2_after_a_snapshot(hosts, "2x1", [0, 1, 2], signal.SIGSTOP)
    h1, h2, h3 = (h.ip for h in hosts.hosts)
    assert run.returncode == 0, run.output()
    assert f"stopped answering (host fault); {h2} excluded for the rest of the run; relaunching on {h1}, {h3} " \
           "from the snapshot of step" in run.stderr, run.output()
    started = [e for e in _ledger(work) if e["kind"] == "attempt-started"]
    assert [e["hosts"] for e in started] == [[h1, h2], [h1, h3]], started
    ended = [e for e in _ledger(work) if e["kind"] == "attempt-ended"]
    found: dict[str, object] = ended[0]["classification"]  # type: ignore[assignment]
    assert found["kind"] == "host" and found["culprit_hosts"] == [h2], ended
    print(f"heal mpi (SIGSTOP): next attempt {float(started[1]['time']) - at:.1f} s after the fault "  # type: ignore[arg-type]
          f"(silent after 10 s); run {run.seconds:.0f} s")

    summary = json.loads((work / "summary.json").read_text())
    reference = uninterrupted_train(tmp_path / "ref", "--samples", "8192", "--epochs", "60", timeout=RUN_TIMEOUT)
    assert summary["resumed_from"] and summary["world_size"] == 2, summary
    assert reference["loss_history"] == summary["loss_history"]
    assert_same_newest_model(work, tmp_path / "ref")
    assert hosts.leftover() == {}


def test_a_killed_host_with_no_spare_stops_with_94(two_hosts: Hosts) -> None:
    """-j 2x1 over exactly two hosts, h2's rank SIGKILLed: a host fault (mpirun saw the signal), h2 excluded, and no
    set of 2 hosts left: the supervisor says so and exits 94 (not the job's code, not a retry on h2)."""
    require_tools("mpirun")
    run, work, _ = _signal_h2_after_a_snapshot(two_hosts, "2x1", [0, 1], signal.SIGKILL)
    h2 = two_hosts[1].ip
    assert run.returncode == 94, run.output()
    assert f"{h2} excluded for the rest of the run; no host set left for the next attempt" in run.stderr, run.output()
    assert f"1 healthy host(s) left of 2 ({h2} out), -j needs 2 at least: stopping with exit 94" in run.stderr
    started = [e for e in _ledger(work) if e["kind"] == "attempt-started"]
    assert len(started) == 1, started
    assert two_hosts.leftover() == {}


def test_a_failure_of_the_program_on_every_rank_is_retried_once_then_93(two_hosts: Hosts) -> None:
    """A script that raises the same ValueError on every rank under `submit mpi --heal`: two attempts on the same
    hosts (a job fault names no host), then exit 93 (do not requeue) with the exception in the line."""
    require_tools("mpirun")
    work = Path(two_hosts.cluster.workdir) / "job"
    work.mkdir()
    script = work / "raises.py"
    script.write_text(RAISES_ON_EVERY_RANK)
    run = _submit(two_hosts, "2x1", [0, 1], work, str(script)).wait(RUN_TIMEOUT)
    assert run.returncode == 93, run.output()
    assert "ValueError: bad batch on ranks 0, 1" in run.stderr and "(job fault); relaunching once on " in run.stderr
    assert "the second in a row: retrying cannot help; stopping with exit 93" in run.stderr, run.output()
    started = [e for e in _ledger(work) if e["kind"] == "attempt-started"]
    assert [e["hosts"] for e in started] == [[two_hosts[0].ip, two_hosts[1].ip]] * 2, started
    assert "excluded" not in run.stderr, run.output()
    assert two_hosts.leftover() == {}


def test_with_min_hosts_the_job_shrinks_instead_of_stopping(two_hosts: Hosts) -> None:
    """-j 1:2x1 over two hosts, h2's rank SIGKILLed: no spare, but the shape allows one host: the next attempt is one
    mpirun on h1 alone, resuming from the snapshot, and the run succeeds."""
    require_tools("mpirun")
    run, work, _ = _signal_h2_after_a_snapshot(two_hosts, "1:2x1", [0, 1], signal.SIGKILL)
    h1, h2 = two_hosts[0].ip, two_hosts[1].ip
    assert run.returncode == 0, run.output()
    assert f"{h2} excluded for the rest of the run; relaunching on {h1} from the snapshot of step" in run.stderr, \
        run.output()
    started = [e for e in _ledger(work) if e["kind"] == "attempt-started"]
    assert [e["hosts"] for e in started] == [[h1, h2], [h1]], started
    summary = json.loads((work / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["resumed_from"], summary
    assert two_hosts.leftover() == {}
