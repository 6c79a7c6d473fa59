"""Every launcher's own variables, the cases peers' fixtures found wrong (issue 11), and launcher inputs that must
be refused cleanly (issue 20 section 2). Pure logic: detect() on dictionaries, no processes.

Fixtures follow each launcher's documentation (cited in the launcher's module under src/ddpkit/env/).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ddpkit.base.errors import EnvConflict
from ddpkit.env import derive_port, detect, expand_nodelist

# srun -N 4 -n 8 on a job whose script did `export RANK=$SLURM_PROCID ...` inside the step
SRUN = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_LOCALID": "1",
        "SLURM_NODEID": "2", "SLURM_STEP_NUM_TASKS": "8", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_NODES": "4",
        "SLURM_STEP_NODELIST": "gpu[1-4]", "SLURM_STEP_TASKS_PER_NODE": "2(x4)"}


def _conflict(env: dict[str, str], *needles: str) -> EnvConflict:
    with pytest.raises(EnvConflict) as exc:
        detect(env)
    text = str(exc.value)
    for needle in needles:
        assert needle in text, text
    assert exc.value.exit_code == 2
    return exc.value


# ---- correctness on the launchers ddpkit already knew -------------------------------------------------------

def test_srun_task_with_agreeing_hand_exports_is_the_slurm_world() -> None:
    w = detect(dict(SRUN, RANK="5", LOCAL_RANK="1", WORLD_SIZE="8", LOCAL_WORLD_SIZE="2"))
    assert (w.launcher, w.rank, w.local_rank, w.world_size, w.local_world_size) == ("slurm", 5, 1, 8, 2)
    assert w.master_addr == "gpu1"
    assert any("agree with Slurm" in n for n in w.notes)


def test_rank_exported_before_srun_is_a_conflict_that_says_where_to_export() -> None:
    conflict = _conflict(dict(SRUN, RANK="0", LOCAL_RANK="0", WORLD_SIZE="8"), "RANK=0 disagrees with Slurm")
    assert "inside the step" in conflict.fix


def test_three_generic_names_are_not_torchrun() -> None:
    w = detect({"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    assert (w.launcher, w.local_world_size, w.node_rank, w.num_nodes) == ("env", 2, 0, 1)
    assert detect({**SRUN, "TORCHELASTIC_RUN_ID": "j", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8",
                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "gpu1", "MASTER_PORT": "29500",
                   "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_NUM_NODES": "4"}).launcher == "torchrun"


def test_kubeflow_elastic_pod_without_master_is_an_agent_with_the_operators_rendezvous() -> None:
    # elastic.go: PET_RDZV_ENDPOINT=<job>-worker-0:port, PET_RDZV_BACKEND, PET_NNODES=MIN:MAX, no MASTER_ADDR
    env = {"PET_NNODES": "1:3", "PET_NPROC_PER_NODE": "2", "PET_RDZV_ENDPOINT": "job-worker-0:23456",
           "PET_RDZV_BACKEND": "etcd-v2", "PET_MAX_RESTARTS": "3", "PET_RDZV_ID": "job-uid",
           "PET_RDZV_CONF": "last_call_timeout=3,join_timeout=60", "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
    w = detect(env)
    assert w.launcher == "kubeflow" and w.is_agent and w.agent is not None
    plan = w.agent
    assert (plan.min_nodes, plan.max_nodes, plan.nproc_per_node) == (1, 3, 2)
    assert (plan.rdzv_endpoint, plan.rdzv_backend, plan.run_id, plan.max_restarts) == (
        "job-worker-0:23456", "etcd-v2", "job-uid", 3)
    assert plan.rdzv_conf == (("last_call_timeout", "3"), ("join_timeout", "60"))


def test_kubeflow_elastic_single_process_pods_are_agents_too() -> None:
    w = detect({"PET_NNODES": "2:2", "PET_RDZV_ENDPOINT": "etcd:2379", "PET_RDZV_BACKEND": "etcd-v2"})
    assert w.is_agent and w.agent is not None and w.agent.nproc_per_node == 1 and w.agent.max_nodes == 2


def test_kubeflow_single_node_needs_no_master() -> None:
    w = detect({"PET_NNODES": "1", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "0"})
    assert (w.launcher, w.world_size, w.master_addr, w.is_agent) == ("kubeflow", 1, "127.0.0.1", False)
    w = detect({"PET_NNODES": "1", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "0"})
    assert w.is_agent and w.agent is not None and w.agent.rdzv_endpoint is None  # torchrun's standalone run


def test_nproc_per_node_cpu_is_resolved_as_torchrun_does() -> None:
    w = detect({"PET_NNODES": "1", "PET_NPROC_PER_NODE": "cpu"})
    assert w.local_world_size == (os.cpu_count() or 1)
    w = detect({"PET_NNODES": "1", "PET_NPROC_PER_NODE": "auto"})  # no accelerator here: the CPUs
    assert w.local_world_size == (os.cpu_count() or 1)


def test_empty_optional_variables_count_as_absent() -> None:
    w = detect(dict(SRUN, SLURM_RESTART_COUNT="", MASTER_ADDR="", MASTER_PORT=" "))
    assert (w.restart_count, w.master_addr, w.master_port) == (None, "gpu1", derive_port("4242"))


def test_torchrun_without_local_world_size_derives_it_from_the_group_count() -> None:
    env = {"TORCHELASTIC_RUN_ID": "r", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "GROUP_RANK": "1",
           "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "29500"}
    assert detect(env).local_world_size == 2
    _conflict({k: v for k, v in env.items() if k != "GROUP_WORLD_SIZE"}, "without LOCAL_WORLD_SIZE")


def test_open_mpi_without_local_size_is_refused_not_guessed() -> None:
    _conflict({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1"},
              "OMPI_COMM_WORLD_LOCAL_SIZE", "not set")


def test_mpich_under_srun_pmi2_takes_the_local_size_from_the_step() -> None:
    w = detect(dict(SRUN, PMI_RANK="5", PMI_SIZE="8"))
    assert (w.launcher, w.local_rank, w.local_world_size, w.master_addr) == ("mpich", 1, 2, "gpu1")


def test_worlds_torch_starts_are_read_with_the_local_world_left_unknown() -> None:
    """torch's env:// needs RANK, WORLD_SIZE and the master: such a world is read, its local world counted later."""
    w = detect({"RANK": "1", "WORLD_SIZE": "20", "LOCAL_RANK": "2", "GROUP_RANK": "3", "MASTER_ADDR": "1.2.3.4",
                "MASTER_PORT": "500"})  # Lightning's own fixture
    assert (w.launcher, w.rank, w.world_size, w.local_rank, w.node_rank) == ("env", 1, 20, 2, 3)
    assert not w.local_world_known and w.as_dict()["local_world_size"] is None
    assert any("LOCAL_WORLD_SIZE is not set" in n for n in w.notes)
    w = detect({"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "node-a", "MASTER_PORT": "1"})
    assert (w.rank, w.world_size, w.local_world_known) == (2, 4, False)


def test_a_one_task_slurm_step_on_a_multi_node_allocation_is_a_world_of_one() -> None:
    w = detect({"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                "SLURM_NODEID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NUM_NODES": "3",
                "SLURM_JOB_NODELIST": "n[1-3]"})
    assert (w.launcher, w.world_size, w.local_world_size, w.num_nodes) == ("slurm", 1, 1, 1)


@pytest.mark.parametrize("env", [
    {"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4", "SLURM_STEP_NODELIST": "n[1-2]"},
    {"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "2"},
    {"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "4"},
    {"GROUP_RANK": "1"},
    {"GROUP_WORLD_SIZE": "2"},
    {"OMPI_COMM_WORLD_NODE_RANK": "1"},
    {"FLUX_JOB_NNODES": "2"},
])
def test_a_partial_launcher_set_that_shows_a_larger_world_is_refused(env: dict[str, str]) -> None:
    with pytest.raises(EnvConflict) as exc:
        detect(env)
    assert exc.value.exit_code == 2


@pytest.mark.parametrize("value", ["+2", "1e3", " 2", "2 ", "²", "2.0", "0x2", "2_0"])
def test_numbers_in_launcher_variables_are_plain_digits(value: str) -> None:
    with pytest.raises(EnvConflict, match="not a whole number"):
        detect({"RANK": "0", "WORLD_SIZE": value, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    with pytest.raises(EnvConflict, match="PET_NNODES"):
        detect({"RANK": "0", "WORLD_SIZE": "2", "PET_NNODES": value, "PET_NPROC_PER_NODE": "2",
                "PET_RDZV_ENDPOINT": "h:29400", "PET_RDZV_BACKEND": "c10d"})


@pytest.mark.parametrize(("nodelist", "hosts"), [
    ("alpha beta", ("alpha", "beta")),
    ("alpha, host[5-7]", ("alpha", "host5", "host6", "host7")),
    ("  a1\tb[1-2] ", ("a1", "b1", "b2")),
])
def test_node_lists_with_spaces_read_as_scontrol_does(nodelist: str, hosts: tuple[str, ...]) -> None:
    assert expand_nodelist(nodelist, "SLURM_JOB_NODELIST") == hosts


def test_space_inside_brackets_is_refused() -> None:
    with pytest.raises(EnvConflict, match=r"white space inside brackets|not a valid Slurm hostlist"):
        expand_nodelist("host[1, 3]", "SLURM_JOB_NODELIST")


# ---- launchers the big sites use -------------------------------------------------------------------------------

def test_lsf_jsrun_task_and_rankfile_without_the_launch_node(tmp_path: Path) -> None:
    rankfile = tmp_path / "rankfile"
    rankfile.write_text("batch1\n" + "c01\n" * 4 + "c02\n" * 4)
    w = detect({"JSM_NAMESPACE_RANK": "5", "JSM_NAMESPACE_SIZE": "8", "JSM_NAMESPACE_LOCAL_RANK": "1",
                "JSM_NAMESPACE_LOCAL_SIZE": "4", "LSB_JOBID": "777", "LSB_DJOB_RANKFILE": str(rankfile)})
    assert (w.launcher, w.rank, w.local_rank, w.world_size, w.local_world_size) == ("lsf", 5, 1, 8, 4)
    assert (w.node_rank, w.num_nodes, w.hosts, w.master_addr) == (1, 2, ("c01", "c02"), "c01")
    assert w.master_port == derive_port("777")


def test_pals_under_pbs_reads_node_id_and_nodefile(tmp_path: Path) -> None:
    nodefile = tmp_path / "nodes"
    nodefile.write_text("x3001c0s1b0n0.hsn.cm.polaris\nx3001c0s1b1n0.hsn.cm.polaris\n")
    w = detect({"PALS_RANKID": "6", "PALS_LOCAL_RANKID": "2", "PALS_NODEID": "1", "PALS_LOCAL_SIZE": "4",
                "PMI_RANK": "6", "PMI_SIZE": "8", "PMI_LOCAL_SIZE": "4", "PBS_JOBID": "1234.polaris-pbs-01",
                "PBS_NODEFILE": str(nodefile)})
    assert (w.launcher, w.rank, w.local_rank, w.world_size, w.local_world_size) == ("pals", 6, 2, 8, 4)
    assert (w.node_rank, w.num_nodes, w.master_addr) == (1, 2, "x3001c0s1b0n0.hsn.cm.polaris")


def test_flux_task_even_and_uneven() -> None:
    env = {"FLUX_TASK_RANK": "3", "FLUX_TASK_LOCAL_ID": "1", "FLUX_JOB_SIZE": "4", "FLUX_JOB_NNODES": "2",
           "FLUX_JOB_ID": "f5W8gVwm", "PMI_RANK": "3", "PMI_SIZE": "4", "MASTER_ADDR": "tuolumne1001"}
    w = detect(env)
    assert (w.launcher, w.rank, w.local_rank, w.world_size, w.local_world_size, w.node_rank) == (
        "flux", 3, 1, 4, 2, 1)
    _conflict(dict(env, FLUX_JOB_SIZE="5"), "uneven", "LOCAL_WORLD_SIZE")


def test_mvapich2_variables() -> None:
    w = detect({"MV2_COMM_WORLD_RANK": "3", "MV2_COMM_WORLD_SIZE": "4", "MV2_COMM_WORLD_LOCAL_RANK": "1",
                "MV2_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "n1"})
    assert (w.launcher, w.rank, w.local_rank, w.world_size, w.node_rank) == ("mvapich2", 3, 1, 4, 1)


@pytest.mark.parametrize(("var", "value", "addr"), [
    ("AZ_BATCHAI_MPI_MASTER_NODE", "10.0.0.4", "10.0.0.4"),
    ("AZ_BATCH_MASTER_NODE", "10.0.0.5:6000", "10.0.0.5"),
])
def test_azure_master_node_under_mpi(var: str, value: str, addr: str) -> None:
    w = detect({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2", var: value})
    assert w.master_addr == addr and w.sources["master_addr"] == var


def test_slurm_het_step_is_one_world() -> None:
    # as Slurm 22.05 sets them for `srun -N1 -n1 : -N1 -n2` (task 2 on node2)
    env = {"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_HET_SIZE": "2", "SLURM_PROCID": "2",
           "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_STEP_NUM_TASKS": "3", "SLURM_NTASKS": "3",
           "SLURM_NTASKS_HET_GROUP_0": "1", "SLURM_NTASKS_HET_GROUP_1": "2", "SLURM_STEP_NUM_NODES": "2",
           "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_STEP_TASKS_PER_NODE": "1,2"}
    w = detect(env)
    assert (w.rank, w.world_size, w.local_world_size, w.master_addr) == (2, 3, 2, "node1")
    w = detect({k: v for k, v in env.items() if k not in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")})
    assert w.world_size == 3 and "HET_GROUP" in w.sources["world_size"]


# ---- never a silent world of one -----------------------------------------------------------------------------

@pytest.mark.parametrize(("env", "missing"), [
    ({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, "OMPI_COMM_WORLD_RANK"),
    ({"WORLD_SIZE": "4"}, "RANK"),
    ({"JSM_NAMESPACE_SIZE": "8"}, "JSM_NAMESPACE_RANK"),
    ({"FLUX_TASK_RANK": "2"}, "FLUX_JOB_SIZE"),
    ({"MV2_COMM_WORLD_SIZE": "2"}, "MV2_COMM_WORLD_RANK"),
    ({"PMI_SIZE": "4"}, "PMI_RANK"),
    ({"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "4"}, "SLURM_PROCID"),
])
def test_known_launcher_variables_that_do_not_add_up_exit_2(env: dict[str, str], missing: str) -> None:
    _conflict(env, "do not make a", missing)


def test_hand_world_smaller_than_a_launchers_is_refused() -> None:
    _conflict({"RANK": "0", "WORLD_SIZE": "1", "OMPI_COMM_WORLD_SIZE": "4"}, "openmpi variables are set",
              "OMPI_COMM_WORLD_RANK missing")


def test_salloc_shell_stays_not_a_task() -> None:
    assert detect({"SLURM_JOB_ID": "9", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "a[1-2]"}).launcher == "none"


# ---- issue 20: launcher inputs checked before anything runs ---------------------------------------------------

TORCHRUN = {"TORCHELASTIC_RUN_ID": "r", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(("env", "needle"), [
    (dict(TORCHRUN, MASTER_PORT="70000"), "MASTER_PORT=70000 is not a TCP port"),
    (dict(TORCHRUN, MASTER_ADDR=""), "without MASTER_ADDR"),
    (dict(TORCHRUN, MASTER_ADDR="a b"), "not a host name"),
    ({"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "m", "PET_MASTER_PORT": "99999"},
     "PET_MASTER_PORT=99999 is not a TCP port"),
    ({"PET_NNODES": "x:2", "PET_RDZV_ENDPOINT": "e:1"}, "PET_NNODES='x:2'"),
    ({"PET_NNODES": "3:2", "PET_RDZV_ENDPOINT": "e:1"}, "1 <= MIN <= MAX"),
    ({"PET_NNODES": "1:2", "PET_RDZV_ENDPOINT": "e:99999"}, "PET_RDZV_ENDPOINT='e:99999'"),
    ({"PET_NNODES": "1", "PET_MAX_RESTARTS": "x"}, "PET_MAX_RESTARTS='x' is not a whole number"),
    ({"PET_NNODES": "1", "PET_NPROC_PER_NODE": "²"}, "PET_NPROC_PER_NODE='²'"),
    (dict(SRUN, SLURM_PROCID="²"), "SLURM_PROCID='²' is not a whole number"),
    (dict(SRUN, SLURM_PROCID="9" * 5000), "(5000 characters) is not a whole number"),
])
def test_bad_launcher_values_are_clear_errors(env: dict[str, str], needle: str) -> None:
    _conflict(env, needle)


@pytest.mark.parametrize("job_id", ["²", "9" * 5000, "١٢٣"])
def test_odd_job_ids_still_derive_a_port(job_id: str) -> None:
    w = detect(dict(SRUN, SLURM_JOB_ID=job_id))
    assert w.master_port == derive_port(job_id) and 20000 <= w.master_port < 30000
