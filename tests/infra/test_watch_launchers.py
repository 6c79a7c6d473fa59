"""The watch under real mpirun (Open MPI) and across two namespace hosts (torchrun on each), and ddpkit train with
the MPI gradient transport: the same fault matrix as tests/multiproc/test_watch.py (torchrun on one host)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers import ddpkit_env, require_tools
from tests.infra.conftest import Hosts, new_run_id
from tests.multiproc.test_watch import HANG_AFTER, _check_hang
from tests.multiproc.test_watch_first_steps import STOPS_RANK_0_AT, assert_stopped_rank_0_run
from tests.watch_jobs import HOST, JOB, leftover, mpirun, run_watched

pytestmark = pytest.mark.infra


@pytest.mark.parametrize("fault", ["sleep", "stop", "kill", "extra"])
@pytest.mark.parametrize("n", [2, 4])
def test_fault_named_under_mpirun(fault: str, n: int, tmp_path: Path) -> None:
    require_tools("mpirun")
    run = run_watched([*mpirun(n)], tmp_path, "--hook", "--fault", fault, "--steps", "400")
    if fault == "kill":  # mpirun ends the job at once and names the rank (the watch's line may lose that race)
        assert run.proc.returncode != 0
        assert "process rank 1 with PID" in run.output and "exited on signal 9" in run.output, run.output[-4000:]
        assert leftover(run.tag) == []
        return
    assert run.proc.returncode == 3, run.output[-6000:]  # mpirun returns the first failed rank's code: the watch's
    _check_hang_mpi(run, fault, n)


@pytest.mark.parametrize("step", [30, 300])
def test_rank_0_stopped_early_or_late_under_mpirun_named_and_rank_1_not_called_gone(step: int, tmp_path: Path) -> None:
    """``mpirun -np 2 ... ddpkit run --hang-after 10 --stop-after 20``, rank 0 (it holds the job's store) stops itself
    at step 30 (half a second in: the 5x rule made it 50 s, 56 s in all) or 300: named within 20 s of the fault, the
    job over within 45 s. mpirun then continues rank 0 (SIGCONT) before it ends it: its last words call rank 1, which
    ddpkit's watch stopped (exit 3), stopped by ddpkit, not "gone"."""
    require_tools("mpirun")
    script, events = tmp_path / "stops.py", tmp_path / "events.jsonl"
    script.write_text(STOPS_RANK_0_AT)
    res = subprocess.run([*mpirun(2), "-m", "ddpkit", "run", "--hang-after", "10", "--stop-after", "20", "--events",
                          str(events), "--", str(script), str(step)], capture_output=True, text=True, errors="replace",
                         timeout=180, env=ddpkit_env())
    out = assert_stopped_rank_0_run(res, events, over=time.time())
    rank_1 = re.search(rf"--- rank 1 on host {HOST} \(pid (\d+)\): Python stacks", out)  # the reporter's own
    assert rank_1 is not None, out[-4000:]
    assert f"rank 1 on host {HOST} (pid {rank_1.group(1)}) is gone" not in out, out[-4000:]
    if "ddpkit watch: rank 0 on host" in out:  # rank 0 said its last words (mpirun's SIGCONT came before the SIGKILL)
        assert f"rank 1 on host {HOST} (pid {rank_1.group(1)}) was stopped by ddpkit" in out, out[-4000:]


def _check_hang_mpi(run, fault: str, n: int) -> None:  # type: ignore[no-untyped-def]
    # the same checks as under torchrun, without torchrun's per-rank exit codes
    run.proc = subprocess.CompletedProcess(run.proc.args, run.proc.returncode,
                                           run.proc.stdout, run.proc.stderr + "\nexitcode  : 3")
    _check_hang(run, fault, n)


def _rank_pid(env_marker: str, rank_var: str, rank: int, timeout: float = 120) -> int:
    """The PID of the process whose environment holds ``env_marker`` and ``rank_var=rank``."""
    deadline = time.monotonic() + timeout
    want = {env_marker.encode(), f"{rank_var}={rank}".encode()}
    while time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                env = set((entry / "environ").read_bytes().split(b"\0"))
                # python -m ddpkit.watch execs python -m ddpkit run in the same process: either command line
                cmdline = (entry / "cmdline").read_bytes()
                if want <= env and (b"ddpkit.watch" in cmdline or b"ddpkit\0run" in cmdline):
                    return int(entry.name)
            except OSError:
                continue
        time.sleep(0.2)
    raise AssertionError(f"no process with {want}")


def test_train_with_mpi_transport_stopped_rank_named(tmp_path: Path) -> None:
    """``ddpkit train --grad-transport mpi`` under the watch; the test stops rank 1 (SIGSTOP) mid-training: the
    gradient hook that averages through MPI counts its own calls (MPI bypasses the process group), so rank 0 is
    seen ahead of rank 1 by count, in the hook, and rank 1 named."""
    require_tools("mpirun")
    import signal

    tag = f"WATCH_TAG={uuid.uuid4().hex[:12]}"
    events = tmp_path / "events.jsonl"
    argv = [*mpirun(2, "-x", tag), "-m", "ddpkit.watch", "--hang-after", str(HANG_AFTER), "--events", str(events),
            "-m", "ddpkit", "train", "--grad-transport", "mpi", "--samples", "4096", "--epochs", "2000",
            "--collective-timeout", "600"]
    with (tmp_path / "out").open("w") as out, (tmp_path / "err").open("w") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=ddpkit_env())
        try:
            pid = _rank_pid(tag, "OMPI_COMM_WORLD_RANK", 1)
            deadline = time.monotonic() + 120
            while "Epoch 2 " not in (tmp_path / "out").read_text() and time.monotonic() < deadline:
                time.sleep(0.2)  # training under way, its first step long done
            os_kill(pid, signal.SIGSTOP)
            stopped_at = time.time()
            code = proc.wait(timeout=90)
        finally:
            if proc.poll() is None:
                proc.kill()
    output = (tmp_path / "out").read_text() + (tmp_path / "err").read_text()
    assert code == 3, output[-6000:]
    import json

    hang = [json.loads(x) for x in events.read_text().splitlines() if '"hang"' in x]
    assert len(hang) == 1, output[-6000:]
    assert hang[0]["stopped"] == [1] and hang[0]["behind"] == [1], output[-6000:]
    assert sorted(hang[0]["stacks"]) == ["0"] and hang[0]["waiting"] == [0], output[-6000:]
    assert "mpi_transport.py" in hang[0]["stacks"]["0"] and "trainer.py" in hang[0]["stacks"]["0"], hang[0]["stacks"]
    assert f"rank 1 on host {HOST} has not entered the group's collective #" in output, output[-6000:]
    assert "(ddpkit's gradient averaging (mpi): counted, not seen one by one)" in output, output[-6000:]
    assert hang[0]["time"] - stopped_at <= HANG_AFTER + 10
    assert f"rank 1 on host {HOST} (pid {pid}) stopped answering" in output


def os_kill(pid: int, sig: int) -> None:
    import os

    os.kill(pid, sig)


@pytest.mark.parametrize("fault", ["sleep", "stop", "kill", "extra"])
def test_fault_named_across_two_hosts(fault: str, two_hosts: Hosts, tmp_path: Path) -> None:
    """torchrun on each of two namespace hosts, 2 ranks each; rank 3 (on the second host) is the faulty one."""
    run_id = new_run_id()
    tag = uuid.uuid4().hex[:12]
    events = Path(two_hosts.cluster.workdir) / "events.jsonl"
    runs = []
    for i, host in enumerate(two_hosts.hosts):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", two_hosts.endpoint(), "--rdzv-id", run_id,
                "--local-addr", host.ip, *(["--rdzv-conf", "is_host=true"] if i == 0 else []),
                "-m", "ddpkit.watch", "--hang-after", str(HANG_AFTER), "--events", str(events), "--", str(JOB),
                "--hook", "--fault", fault, "--fault-rank", "3", "--steps", "400", "--tag", tag]
        runs.append(two_hosts.start(host, argv, GLOO_SOCKET_IFNAME="eth0"))
    for r in runs:
        r.wait(180)
    output = "\n".join(r.output() for r in runs)
    h1, h2 = two_hosts[0].hostname, two_hosts[1].hostname
    assert all(r.returncode != 0 for r in runs), output[-6000:]
    if fault == "kill":  # torchrun's agent may stop the job before the watch's line (as mpirun does, above)
        watched = f"rank 3 on host {h2} (pid " in output and "is gone" in output
        agent = re.search(r"rank\s*: 3\b[\s\S]*?exitcode\s*: -9", output) is not None
        assert watched or agent, output[-6000:]
    else:
        import json

        lines = events.read_text().splitlines() if events.exists() else []
        hang = [json.loads(x) for x in lines if '"hang"' in x]
        assert len(hang) == 1, output[-6000:]
        hang_event = hang[0]
        assert hang_event["hosts"]["3"] == h2 and hang_event["hosts"]["0"] == h1
        live = [0, 1, 2] if fault == "stop" else [0, 1, 2, 3]
        assert sorted(int(r) for r in hang_event["stacks"]) == live, output[-6000:]
        if fault == "sleep":
            assert hang_event["behind"] == [3]
            assert f"rank 3 on host {h2} has not entered DDP gradient all-reduce (bucket 0) #21" in output
        elif fault == "stop":
            assert hang_event["stopped"] == [3] and f"rank 3 on host {h2} (pid" in output
        else:
            assert hang_event["desync"]["seq"] == 21
            assert [c["ranks"] for c in hang_event["desync"]["calls"] if c["op"] == "broadcast"] == [[3]]
    assert two_hosts.leftover() == {}, output[-4000:]


def _two_host_run(two_hosts: Hosts, events: Path, cpus: tuple[str, str], *job: str) -> str:
    """torchrun on each host, 2 ranks each, every process of host i pinned to CPU ``cpus[i]``; the combined output."""
    run_id = new_run_id()
    runs = []
    for i, host in enumerate(two_hosts.hosts):
        argv = ["taskset", "-c", cpus[i], sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", two_hosts.endpoint(),
                "--rdzv-id", run_id, "--local-addr", host.ip, *(["--rdzv-conf", "is_host=true"] if i == 0 else []),
                "-m", "ddpkit.watch", "--report-every", "2", "--events", str(events), "--", str(JOB), *job]
        runs.append(two_hosts.start(host, argv, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1"))
    for r in runs:
        r.wait(240)
    output = "\n".join(r.output() for r in runs)
    assert [r.returncode for r in runs] == [0, 0], output[-6000:]
    return output


@pytest.mark.serial  # failed under the parallel suite's load, passes alone
def test_cpu_limited_host_named_as_the_straggler(two_hosts: Hosts) -> None:
    """Host 2's two ranks share their CPU with two busy processes (a quarter of a CPU each; host 1's get half): the
    watch names host 2 as the slowest, with its ranks; the same layout without the busy processes names nothing
    well above the 10% bar (the shared machine's own noise may leave one host's ranks a little behind)."""
    import json
    import os

    require_tools("taskset")
    if (os.cpu_count() or 1) < 2:
        pytest.fail("this test pins each host to a CPU of its own: it needs 2 CPUs")
    job = ("--steps", "150", "--step-s", "0", "--busy-ms", "10")
    h2 = two_hosts[1].hostname
    hogs = [subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        slow_events = Path(two_hosts.cluster.workdir) / "slow.jsonl"
        output = _two_host_run(two_hosts, slow_events, ("0", "1"), *job)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    named = [json.loads(x) for x in slow_events.read_text().splitlines() if '"straggler"' in x]
    assert named, output[-6000:]
    # every report points at host 2 (a first one, on few samples, may name one of its ranks); the host is named
    assert all(e["host"] == h2 and (e.get("ranks") == [2, 3] or e.get("rank") in (2, 3)) for e in named), named
    # said as the events say it: the host with both its ranks, or (a report on few samples) one of its ranks
    said = [f"host {h2} (ranks 2 and 3) is the slowest: the ranks on other hosts wait",
            f"rank 2 on {h2} is the slowest: the others wait", f"rank 3 on {h2} is the slowest: the others wait"]
    assert any(line in output for line in said), output[-6000:]
    if any(e.get("ranks") == [2, 3] for e in named):
        assert said[0] in output, output[-6000:]
    # a report is made only above the 10% bar; how far above depends on the machine's other load (with one busy
    # process CI once saw 16%, against a third of a step in theory; two make it half a step)
    assert all(e["wait_share"] > 0.1 for e in named), named
    clean_events = Path(two_hosts.cluster.workdir) / "clean.jsonl"
    output = _two_host_run(two_hosts, clean_events, ("0", "1"), *job)
    lines = clean_events.read_text().splitlines() if clean_events.exists() else []
    clean = [json.loads(x) for x in lines if '"straggler"' in x]
    # without the busy processes nothing is named well above the bar: on this shared 2-core machine the noise of
    # one CPU put a host's ranks at the bar during the full suite (host 1 at 0.1007 once, host 2 once), so a rare
    # report near it is tolerated, whichever host, never one anywhere near the busy run's
    assert all(e["wait_share"] < 0.15 for e in clean), ([(e["host"], e["wait_share"]) for e in clean],
                                                        output[-6000:])
    assert two_hosts.leftover() == {}
