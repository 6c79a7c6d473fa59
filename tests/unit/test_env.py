"""Rank discovery from every launcher's variables: pure logic, no processes."""

from __future__ import annotations

import hostlist
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ddpkit.base.errors import EnvConflict
from ddpkit.env import PORT_RANGE, derive_port, detect, expand_nodelist, explain, thread_count

TORCHRUN = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
            "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "node-a", "MASTER_PORT": "29500",
            "TORCHELASTIC_RUN_ID": "job7", "TORCHELASTIC_RESTART_COUNT": "2"}
SRUN = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2", "SLURM_STEP_NUM_TASKS": "8", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_NODES": "4",
        "SLURM_STEP_NODELIST": "smc-r07-[07-08],gpu[1,10]", "SLURM_STEP_TASKS_PER_NODE": "2(x4)"}
OMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "0", "OMPI_MCA_ess_base_jobid": "77"}
MPICH = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2",
         "MASTER_ADDR": "10.0.0.1"}


def test_torchrun_fields_and_sources() -> None:
    w = detect(TORCHRUN)
    assert (w.launcher, w.rank, w.local_rank, w.world_size, w.local_world_size) == ("torchrun", 3, 1, 4, 2)
    assert (w.node_rank, w.num_nodes, w.master_addr, w.master_port) == (1, 2, "node-a", 29500)
    assert (w.run_id, w.restart_count) == ("job7", 2)
    assert w.sources["rank"] == "RANK" and w.sources["node_rank"] == "GROUP_RANK"


def test_slurm_task_reads_step_and_master_from_nodelist() -> None:
    w = detect(SRUN)
    assert (w.launcher, w.rank, w.local_rank, w.world_size, w.local_world_size) == ("slurm", 5, 1, 8, 2)
    assert (w.node_rank, w.num_nodes) == (2, 4)
    assert w.hosts == ("smc-r07-07", "smc-r07-08", "gpu1", "gpu10")
    assert w.master_addr == "smc-r07-07"
    assert w.master_port == derive_port("4242") == PORT_RANGE[0] + 4242
    assert w.run_id == "4242"


def test_slurm_tasks_without_a_node_count_or_list_are_refused_not_read_as_one_host() -> None:
    """Found by test_env_property: SLURM_NTASKS=2 with no SLURM_STEP_NUM_NODES, node list or tasks per node read as
    one node of 2 ranks, local world size "known", master on loopback; a guess. srun sets them all: refused, exit 2."""
    env = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
           "SLURM_NTASKS": "2"}
    with pytest.raises(EnvConflict, match=r"2 Slurm tasks on an unknown number of nodes") as exc:
        detect(env)
    assert exc.value.exit_code == 2
    assert detect({**env, "SLURM_STEP_NUM_NODES": "1"}).local_world_size == 2  # counted, not guessed: read


def test_slurm_uneven_tasks_per_node() -> None:
    env = dict(SRUN, SLURM_STEP_TASKS_PER_NODE="3(x2),1", SLURM_STEP_NUM_TASKS="7", SLURM_NTASKS="7",
               SLURM_STEP_NUM_NODES="3", SLURM_STEP_NODELIST="a[1-3]", SLURM_NODEID="2", SLURM_PROCID="6",
               SLURM_LOCALID="0")
    assert detect(env).local_world_size == 1


@pytest.mark.parametrize("shell", [
    {"SLURM_JOB_ID": "9", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "a[1-2]"},               # salloc shell
    {"SLURM_JOB_ID": "9", "SLURM_NTASKS": "4", "SLURM_PROCID": "0", "SLURM_STEP_ID": "batch"},  # sbatch script
    {"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "SLURM_STEP_ID": "4294967294"},                # old batch step
])
def test_salloc_or_sbatch_shell_is_not_a_task(shell: dict[str, str]) -> None:
    w = detect(shell)
    assert w.launcher == "none" and w.world_size == 1
    slurm = next(e for e in explain(shell) if e[0] == "slurm")
    assert slurm[1] is False and "srun" in slurm[2]


def test_explicit_master_wins_and_port_too() -> None:
    w = detect(dict(SRUN, MASTER_ADDR="gpu10", MASTER_PORT="31000"))
    assert (w.master_addr, w.master_port) == ("gpu10", 31000)
    assert w.sources["master_addr"] == "MASTER_ADDR"


def test_master_addr_not_in_nodelist_is_a_conflict() -> None:
    with pytest.raises(EnvConflict, match=r"MASTER_ADDR='other-host' is not one of this job's hosts"):
        detect(dict(SRUN, MASTER_ADDR="other-host"))


def test_master_addr_as_ip_is_accepted() -> None:
    assert detect(dict(SRUN, MASTER_ADDR="10.1.96.108")).master_addr == "10.1.96.108"


def test_world_size_disagreeing_with_slurm_is_a_conflict() -> None:
    with pytest.raises(EnvConflict) as exc:
        detect(dict(SRUN, WORLD_SIZE="16"))
    assert "WORLD_SIZE=16 disagrees with Slurm (SLURM_STEP_NUM_TASKS gives 8" in str(exc.value)
    assert exc.value.exit_code == 2


@pytest.mark.parametrize(("var", "value", "needle"), [
    ("SLURM_PROCID", "abc", "SLURM_PROCID='abc' is not a whole number"),
    ("SLURM_STEP_NODELIST", "a[1-", "SLURM_STEP_NODELIST='a[1-' is not a valid Slurm hostlist"),
    ("SLURM_STEP_TASKS_PER_NODE", "2(x", "not a Slurm tasks-per-node list"),
    ("SLURM_PROCID", "-1", "below 0"),
    ("SLURM_PROCID", "8", "not below the task count 8"),
])
def test_malformed_slurm_values_name_variable_and_value(var: str, value: str, needle: str) -> None:
    with pytest.raises(EnvConflict, match=needle.replace("[", r"\[").replace("(", r"\(")):
        detect(dict(SRUN, **{var: value}))


def test_openmpi_single_host_uses_loopback_and_job_port() -> None:
    w = detect(OMPI)
    assert (w.launcher, w.rank, w.world_size, w.local_world_size) == ("openmpi", 1, 2, 2)
    assert w.master_addr == "127.0.0.1" and w.master_port == derive_port("77")


def test_openmpi_multi_host_without_master_says_what_to_set() -> None:
    env = dict(OMPI, OMPI_COMM_WORLD_SIZE="4", OMPI_COMM_WORLD_NODE_RANK="0")
    with pytest.raises(EnvConflict) as exc:
        detect(env)
    assert "MASTER_ADDR" in exc.value.found and "mpirun -x MASTER_ADDR" in exc.value.fix


def test_mpich_hydra_variables() -> None:
    w = detect(MPICH)
    assert (w.launcher, w.rank, w.local_rank, w.world_size, w.local_world_size) == ("mpich", 2, 0, 4, 2)
    assert (w.node_rank, w.num_nodes, w.master_addr) == (1, 2, "10.0.0.1")


def test_mpi_inside_srun_with_wrong_plugin_is_named() -> None:
    env = dict(SRUN, PMI_RANK="0", PMI_SIZE="1", MASTER_ADDR="gpu1")
    with pytest.raises(EnvConflict, match="srun --mpi=pmi2"):
        detect(env)


def test_mpi_inside_srun_agreeing_wins_and_notes_slurm() -> None:
    env = dict(SRUN, OMPI_COMM_WORLD_RANK="5", OMPI_COMM_WORLD_SIZE="8", OMPI_COMM_WORLD_LOCAL_RANK="1",
               OMPI_COMM_WORLD_LOCAL_SIZE="2", OMPI_COMM_WORLD_NODE_RANK="2")
    w = detect(env)
    assert w.launcher == "openmpi" and w.master_addr == "smc-r07-07"
    assert any("also present: slurm" in n and "openmpi wins" in n for n in w.notes)


def test_srun_torchrun_prefers_torchrun_and_checks_one_task_per_node() -> None:
    env = dict(SRUN, **TORCHRUN, SLURM_STEP_NUM_TASKS="4", SLURM_NTASKS="4", SLURM_PROCID="1", SLURM_NODEID="1")
    w = detect(env)
    assert w.launcher == "torchrun" and w.rank == 3
    assert w.hosts[0] == "smc-r07-07"
    assert any("srun torchrun" in n for n in w.notes)
    with pytest.raises(EnvConflict, match="exactly one task per node"):
        detect(dict(env, SLURM_STEP_NUM_TASKS="8"))


def test_kubeflow_pytorchjob_v1_pod() -> None:
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "RANK": "1", "WORLD_SIZE": "2",
           "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"}
    w = detect(env)
    assert (w.launcher, w.rank, w.world_size, w.node_rank, w.num_nodes) == ("kubeflow", 1, 2, 1, 2)
    assert not w.is_agent


def test_kubeflow_elastic_pod_is_an_agent() -> None:
    env = {"PET_NNODES": "1:4", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-0",
           "PET_MASTER_PORT": "29400", "PET_RDZV_ID": "job-uid"}
    w = detect(env)
    assert w.launcher == "kubeflow" and w.is_agent
    assert (w.num_nodes, w.local_world_size, w.world_size, w.rank) == (4, 2, 8, 2)
    assert w.run_id == "job-uid"


def test_trainer_v2_without_master_is_explained() -> None:
    with pytest.raises(EnvConflict, match="PET_MASTER_ADDR"):
        detect({"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "0"})


def test_hand_exported_env_and_no_launcher() -> None:
    w = detect({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1234"})
    assert w.launcher == "env" and w.world_size == 2
    assert detect({}).launcher == "none"
    assert [e[0] for e in explain({})] == ["torchrun", "kubeflow", "lsf", "pals", "flux", "mvapich2", "openmpi",
                                          "mpich", "slurm", "env", "none"]


@pytest.mark.parametrize(("nodelist", "hosts"), [
    ("smc-r07-[07-08]", ["smc-r07-07", "smc-r07-08"]),
    ("a[1-3,5],b7", ["a1", "a2", "a3", "a5", "b7"]),
    ("node-[001-004]", ["node-001", "node-002", "node-003", "node-004"]),
    ("gpu[1,10-12]", ["gpu1", "gpu10", "gpu11", "gpu12"]),
])
def test_nodelist_shapes(nodelist: str, hosts: list[str]) -> None:
    assert list(expand_nodelist(nodelist, "SLURM_JOB_NODELIST")) == hosts


_host = st.builds(lambda p, n, w: f"{p}{str(n).zfill(w)}", st.sampled_from(["a", "gpu", "node-", "smc-r07-"]),
                  st.integers(0, 999), st.integers(1, 3))


@given(st.lists(_host, min_size=1, max_size=40, unique=True))
def test_expand_of_collect_is_lossless(hosts: list[str]) -> None:
    assert sorted(expand_nodelist(hostlist.collect_hostlist(hosts), "X")) == sorted(hosts)


def test_derived_port_is_in_range_and_deterministic() -> None:
    for job in ("1", "987654321", "abc-def", "ppid-42"):
        port = derive_port(job)
        assert PORT_RANGE[0] <= port < PORT_RANGE[1] and port == derive_port(job)
    assert derive_port("100") != derive_port("101")


def test_thread_count_divides_cores_and_respects_explicit_value() -> None:
    threads, msg = thread_count(2, {})
    assert threads is not None and threads >= 1 and "ranks on this node" in msg
    assert thread_count(1000, {})[0] == 1
    assert thread_count(2, {"OMP_NUM_THREADS": "7"}) == (None, "OMP_NUM_THREADS=7 is set: respected")
