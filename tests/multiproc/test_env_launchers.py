"""`ddpkit env --connect` and ddpkit.init() + a verified all_reduce under every real launcher available here."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ddpkit_env, free_port, require_tools, run_ddpkit

pytestmark = pytest.mark.multiproc


def _records(stdout: str) -> list[dict[str, object]]:
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return sorted(rows, key=lambda r: int(r["rank"]))  # type: ignore[call-overload]


def _assert_world(rows: list[dict[str, object]], launcher: str, size: int) -> None:
    assert [r["rank"] for r in rows] == list(range(size)), rows
    for r in rows:
        assert r["launcher"] == launcher and r["world_size"] == size
        assert r["connect"]["all_reduce_ok"] is True, r  # type: ignore[index]
        assert r["connect"]["all_reduce"] == size * (size + 1) / 2  # type: ignore[index]
    assert len({(r["master_addr"], r["master_port"]) for r in rows}) == 1, "ranks disagree on the master"


def test_local_launch_two_ranks() -> None:
    proc = run_ddpkit("env", "-n", "2", "--connect", "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = _records(proc.stdout)
    _assert_world(rows, "torchrun", 2)
    assert all(r["local_world_size"] == 2 and r["run_id"] for r in rows)
    assert "OMP_NUM_THREADS set to" in proc.stderr


def test_real_torchrun_two_ranks() -> None:
    torchrun = shutil.which("torchrun", path=str(__import__("pathlib").Path(sys.executable).parent))
    assert torchrun, "torchrun is installed with torch"
    proc = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "-m", "ddpkit", "env", "--connect",
                           "--json"], capture_output=True, text=True, timeout=120, env=ddpkit_env())
    assert proc.returncode == 0, proc.stderr
    _assert_world(_records(proc.stdout), "torchrun", 2)


@pytest.mark.infra
def test_open_mpi_mpirun_two_ranks() -> None:
    require_tools("mpirun")
    proc = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, "-m",
                           "ddpkit", "env", "--connect", "--json"], capture_output=True, text=True, timeout=120,
                          env=ddpkit_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _records(proc.stdout)
    _assert_world(rows, "openmpi", 2)
    assert rows[0]["master_addr"] == "127.0.0.1"  # every rank on this host: loopback, port from the job id


@pytest.mark.infra
def test_mpich_mpiexec_two_ranks() -> None:
    require_tools("mpiexec.mpich")
    proc = subprocess.run(["mpiexec.mpich", "-n", "2", sys.executable, "-m", "ddpkit", "env", "--connect",
                           "--json"], capture_output=True, text=True, timeout=120, env=ddpkit_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _assert_world(_records(proc.stdout), "mpich", 2)


def test_python_api_init_and_shutdown_single_process() -> None:
    code = ("import ddpkit, torch, torch.distributed as dist\n"
            "rt = ddpkit.init()\n"
            "t = torch.ones(3); dist.all_reduce(t)\n"
            "print(rt.world.launcher, rt.backend, rt.device, rt.world_size, t.tolist())\n"
            "ddpkit.shutdown(); print('initialized after shutdown:', dist.is_initialized())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=ddpkit_env())
    assert proc.returncode == 0, proc.stderr
    assert "none gloo cpu 1 [1.0, 1.0, 1.0]" in proc.stdout
    assert "initialized after shutdown: False" in proc.stdout


def test_conflicting_environment_exits_2_without_traceback() -> None:
    env = ddpkit_env(SLURM_JOB_ID="12", SLURM_STEP_ID="0", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0",
                     SLURM_NTASKS="2", SLURM_JOB_NODELIST="a[1-", WORLD_SIZE="2")
    proc = run_ddpkit("env", env=env, timeout=60)
    assert proc.returncode == 2
    assert "SLURM_JOB_NODELIST='a[1-' is not a valid Slurm hostlist" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_job_shape_exits_2() -> None:
    proc = run_ddpkit("env", "-j", "0x4", timeout=60)
    assert proc.returncode == 2 and "zero nodes or processes" in proc.stderr and "Traceback" not in proc.stderr


def test_kubeflow_pod_command_acts_as_agent_for_its_ranks() -> None:
    """A PyTorchJob pod running `ddpkit env` with nprocPerNode=2 starts its two ranks itself."""
    env = ddpkit_env(PET_NNODES="1", PET_NPROC_PER_NODE="2", PET_NODE_RANK="0", PET_MASTER_ADDR="127.0.0.1",
                     PET_MASTER_PORT=free_port(), PET_RDZV_ID="pytorchjob-uid-1")
    proc = run_ddpkit("env", "--connect", "--json", env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = _records(proc.stdout)
    _assert_world(rows, "torchrun", 2)
    assert {r["run_id"] for r in rows} == {"pytorchjob-uid-1"}


def test_kubeflow_single_node_pod_needs_no_master_address() -> None:
    """Trainer v2 / PyTorchJob with one node: PET_NNODES=1 and no PET_MASTER_ADDR; ddpkit runs torchrun's
    standalone rendezvous for the pod's two ranks."""
    env = ddpkit_env(PET_NNODES="1", PET_NPROC_PER_NODE="2", PET_NODE_RANK="0")
    proc = run_ddpkit("env", "--connect", "--json", env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    _assert_world(_records(proc.stdout), "torchrun", 2)


def test_kubeflow_elastic_pod_uses_the_operators_rendezvous() -> None:
    """elasticPolicy: PET_NNODES=MIN:MAX, PET_RDZV_ENDPOINT, PET_RDZV_BACKEND, PET_RDZV_ID, no MASTER_ADDR."""
    env = ddpkit_env(PET_NNODES="1:2", PET_NPROC_PER_NODE="2", PET_RDZV_BACKEND="c10d",
                     PET_RDZV_ENDPOINT=f"127.0.0.1:{free_port()}", PET_RDZV_ID="pytorchjob-elastic-1",
                     PET_RDZV_CONF="last_call_timeout=1", PET_MAX_RESTARTS="0")
    proc = run_ddpkit("env", "--connect", "--json", env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr
    rows = _records(proc.stdout)
    _assert_world(rows, "torchrun", 2)
    assert {r["run_id"] for r in rows} == {"pytorchjob-elastic-1"}


@pytest.mark.parametrize("command", [["env"], ["check", "--timeout", "5"]])
def test_launcher_variables_that_do_not_add_up_exit_2_in_every_command(command: list[str]) -> None:
    env = ddpkit_env(OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_LOCAL_RANK="1")
    proc = run_ddpkit(*command, env=env, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "openmpi variables are set" in proc.stderr and "OMPI_COMM_WORLD_RANK missing" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_check_in_a_slurm_job_shell_of_four_tasks_fails() -> None:
    env = ddpkit_env(SLURM_JOB_ID="91", SLURM_NTASKS="4", SLURM_JOB_NODELIST="a[1-2]")
    proc = run_ddpkit("check", "--timeout", "10", env=env, timeout=180)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Slurm job 91 has 4 tasks" in proc.stdout and "verdict: FAIL" in proc.stdout


def test_check_started_twice_by_an_unknown_launcher_fails_on_both(tmp_path: Path) -> None:
    """An unknown launcher (here a shell) starts two copies: each sees no launcher, a world of one; neither may
    pass."""
    ddpkit = f"{sys.executable} -m ddpkit check --timeout 10"
    proc = subprocess.run(["bash", "-c", f"{ddpkit} > a.out 2>&1 & {ddpkit} > b.out 2>&1 & wait -n; a=$?; wait -n; "
                           "b=$?; cat a.out b.out; echo codes $a $b"], capture_output=True, text=True,
                          timeout=240, env=ddpkit_env(), cwd=tmp_path)
    assert "codes 1 1" in proc.stdout, proc.stdout + proc.stderr
    assert proc.stdout.count("processes run this same command under parent process") == 2



def _hand_exported_pair(*argv: str, timeout: float) -> list[tuple[str, str]]:
    """Two ranks of ``ddpkit ARGV`` given only RANK, WORLD_SIZE and a non-loopback master (this host's name):
    each one's (stdout, stderr), once both exited 0."""
    import socket

    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-m", "ddpkit", *argv], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env=ddpkit_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR=socket.gethostname(),
                                             MASTER_PORT=port))
             for r in range(2)]
    outs = [p.communicate(timeout=timeout) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
    return outs


def test_a_hand_exported_world_without_local_sizes_starts_and_counts_its_local_world() -> None:
    """RANK, WORLD_SIZE and a non-loopback master are all torch's env:// needs: two such ranks connect, and the
    ranks on this host are counted at start-up (not assumed one per node)."""
    outs = _hand_exported_pair("env", "--connect", "--json", timeout=120)
    rows = _records("".join(o for o, _ in outs))
    _assert_world(rows, "env", 2)
    assert all(r["local_world_size"] is None for r in rows)  # unknown from the environment, and said so
    stderr = "".join(e for _, e in outs)
    assert stderr.count("LOCAL_WORLD_SIZE was not set: 2 rank(s) of 2 run on") == 1, stderr
    assert "OMP_NUM_THREADS set to 1" in stderr  # the count sized the threads: 2 ranks share this host's cores


def test_check_in_a_hand_exported_world_counts_its_nodes_before_the_roll_call() -> None:
    outs = _hand_exported_pair("check", "--timeout", "90", timeout=180)
    report = outs[0][0]
    assert "2 rank(s) on 1 node(s)" in report and "verdict: PASS: 2 rank(s) on 1 host(s)" in report, report
    assert "overriding" not in outs[1][1], outs[1][1]  # nothing guessed and then corrected
