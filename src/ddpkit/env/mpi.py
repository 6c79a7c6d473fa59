"""MPI launchers: Open MPI (``OMPI_COMM_WORLD_*``), MVAPICH2 (``MV2_COMM_WORLD_*``) and MPICH / Intel MPI's Hydra
(``PMI_*``, ``MPI_LOCAL*``).

Sources: Open MPI's "Environment variables set for MPI applications" (docs.open-mpi.org, tuning-apps);
the MVAPICH2 user guide ("Run-time environment variables": MV2_COMM_WORLD_RANK, MV2_COMM_WORLD_SIZE,
MV2_COMM_WORLD_LOCAL_RANK, MV2_COMM_WORLD_LOCAL_SIZE, set by mpirun_rsh and its Hydra); MPICH's Hydra sets
PMI_RANK, PMI_SIZE, MPI_LOCALRANKID and MPI_LOCALNRANKS (Slurm's pmi2 plugin sets only the first two).

None sets a master address. ddpkit takes MASTER_ADDR when given, Azure's master variables (AzureML and
Azure Batch multi-instance tasks), the first host of the Slurm node list when the ranks run inside an
allocation, loopback when every rank is on this host, and otherwise says what to export. Without a local
size, the Slurm step's (when it agrees) is used; otherwise ddpkit refuses rather than guess one rank per node.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ddpkit.base.errors import EnvConflict
from ddpkit.env import slurm
from ddpkit.env.master import resolve_master
from ddpkit.env.record import RankAndSize, VarReader, WorldInfo, expand_nodelist, present

OPENMPI_TABLE = {
    "rank": "OMPI_COMM_WORLD_RANK",
    "local_rank": "OMPI_COMM_WORLD_LOCAL_RANK",
    "world_size": "OMPI_COMM_WORLD_SIZE",
    "local_world_size": "OMPI_COMM_WORLD_LOCAL_SIZE",
    "node_rank": "rank // OMPI_COMM_WORLD_LOCAL_SIZE (OMPI_COMM_WORLD_NODE_RANK is a per-node rank, not a node index)",
    "master": "MASTER_ADDR | AZ_BATCHAI_MPI_MASTER_NODE | AZ_BATCH_MASTER_NODE | first host of SLURM_JOB_NODELIST "
              "| loopback on one host",
}
MVAPICH_TABLE = {
    "rank": "MV2_COMM_WORLD_RANK",
    "local_rank": "MV2_COMM_WORLD_LOCAL_RANK",
    "world_size": "MV2_COMM_WORLD_SIZE",
    "local_world_size": "MV2_COMM_WORLD_LOCAL_SIZE",
    "master": "MASTER_ADDR | AZ_BATCHAI_MPI_MASTER_NODE | AZ_BATCH_MASTER_NODE | first host of SLURM_JOB_NODELIST "
              "| loopback on one host",
}
MPICH_TABLE = {
    "rank": "PMI_RANK",
    "local_rank": "MPI_LOCALRANKID",
    "world_size": "PMI_SIZE",
    "local_world_size": "MPI_LOCALNRANKS | the Slurm step's tasks per node (srun --mpi=pmi2)",
    "master": "MASTER_ADDR | AZ_BATCHAI_MPI_MASTER_NODE | AZ_BATCH_MASTER_NODE | first host of SLURM_JOB_NODELIST "
              "| loopback on one host",
}
_JOB_ID_VARS = ("OMPI_MCA_ess_base_jobid", "OMPI_MCA_orte_ess_jobid", "PMIX_NAMESPACE", "PMI_KVSNAME",
                "SLURM_JOB_ID")


openmpi_activated = RankAndSize("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "started by Open MPI's mpirun")
mvapich_activated = RankAndSize("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "started by MVAPICH2")
mpich_activated = RankAndSize("PMI_RANK", "PMI_SIZE", "started by MPICH / Intel MPI Hydra")


def read_openmpi(environ: Mapping[str, str]) -> WorldInfo:
    r = VarReader(environ, "openmpi")
    return _read(r, environ, rank_vars=("OMPI_COMM_WORLD_RANK",), size_vars=("OMPI_COMM_WORLD_SIZE",),
                 local_vars=("OMPI_COMM_WORLD_LOCAL_RANK",), local_size_vars=("OMPI_COMM_WORLD_LOCAL_SIZE",),
                 export_hint="mpirun -x MASTER_ADDR=<rank 0's host>")


def read_mvapich(environ: Mapping[str, str]) -> WorldInfo:
    r = VarReader(environ, "mvapich2")
    return _read(r, environ, rank_vars=("MV2_COMM_WORLD_RANK",), size_vars=("MV2_COMM_WORLD_SIZE",),
                 local_vars=("MV2_COMM_WORLD_LOCAL_RANK",), local_size_vars=("MV2_COMM_WORLD_LOCAL_SIZE",),
                 export_hint="mpirun_rsh ... MASTER_ADDR=<rank 0's host> prog")


def read_mpich(environ: Mapping[str, str]) -> WorldInfo:
    r = VarReader(environ, "mpich")
    return _read(r, environ, rank_vars=("PMI_RANK",), size_vars=("PMI_SIZE",),
                 local_vars=("MPI_LOCALRANKID",), local_size_vars=("MPI_LOCALNRANKS",),
                 export_hint="mpiexec -genv MASTER_ADDR <rank 0's host>")


def _read(
    r: VarReader,
    environ: Mapping[str, str],
    *,
    rank_vars: tuple[str, ...],
    size_vars: tuple[str, ...],
    local_vars: tuple[str, ...],
    local_size_vars: tuple[str, ...],
    export_hint: str,
) -> WorldInfo:
    rank = r.required("rank", *rank_vars)
    world = r.required("world_size", *size_vars, minimum=1)
    local_rank = r.integer("local_rank", *local_vars)
    local_world = r.integer("local_world_size", *local_size_vars, minimum=1)
    if local_rank is None or local_world is None:
        local_rank, local_world = _local_from_elsewhere(r, environ, rank, world, local_vars, local_size_vars)
    # Neither MPI names the node index (Open MPI's OMPI_COMM_WORLD_NODE_RANK is a rank within the node);
    # with the default by-slot mapping, ranks fill nodes in blocks.
    node_rank = rank // local_world
    r.derived("node_rank", "rank // local world size (ranks fill nodes in blocks)")
    num_nodes = max(1, -(-world // local_world))
    r.derived("num_nodes", "world size / local world size")
    _check_slurm_agreement(environ, r.launcher, rank, world)
    hosts: tuple[str, ...] = ()
    nodelist = r.first("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
    if nodelist is not None and present(environ, "SLURM_STEP_ID"):
        hosts = expand_nodelist(environ[nodelist], nodelist)
        r.derived("hosts", nodelist)
    job_var = r.first(*_JOB_ID_VARS)
    # Every rank on one host shares its parent (mpirun, orted or hydra_pmi_proxy): a job id all can agree on.
    job_id = environ[job_var] if job_var else f"ppid-{os.getppid()}"
    addr, port = resolve_master(
        r, hosts=hosts, job_id=job_id, single_host=local_world == world, azure=True,
        hint=f"export MASTER_ADDR on every rank, e.g. {export_hint} (MPI does not set one)",
    )
    return WorldInfo(
        launcher=r.launcher, rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world,
        node_rank=node_rank, num_nodes=num_nodes, master_addr=addr, master_port=port, hosts=hosts,
        run_id=job_id, sources=r.sources,
    )


def _local_from_elsewhere(r: VarReader, environ: Mapping[str, str], rank: int, world: int,
                          local_vars: tuple[str, ...], local_size_vars: tuple[str, ...]) -> tuple[int, int]:
    """Local rank and size where the MPI names none: a world of one, or the Slurm step that started the ranks."""
    if world == 1:
        r.derived("local_rank", "a world of one")
        return 0, 1
    if slurm.activated(environ)[0]:  # srun --mpi=pmi2 gives PMI_RANK/PMI_SIZE only; the step knows the rest
        step = slurm.read(environ)
        if (step.rank, step.world_size) == (rank, world):
            r.derived("local_rank", "SLURM_LOCALID (the srun step that started the ranks)")
            r.derived("local_world_size", "the Slurm step's tasks on this node")
            return step.local_rank, step.local_world_size
    missing = " and ".join(v for v in (*local_vars, *local_size_vars) if not present(environ, v))
    raise EnvConflict(f"{r.launcher} rank {rank} of {world} but {missing} not set",
                      f"{' and '.join((*local_vars, *local_size_vars))}, which {r.launcher} sets for every rank",
                      "export LOCAL_RANK/LOCAL_WORLD_SIZE equivalents, or start the ranks with the MPI's own "
                      "launcher; ddpkit sizes threads from the ranks per node and will not guess")


def _check_slurm_agreement(environ: Mapping[str, str], launcher: str, rank: int, world: int) -> None:
    """Under srun, MPI and Slurm must agree; a mismatch is the wrong --mpi plugin (N worlds of size 1)."""
    if not present(environ, "SLURM_STEP_ID") or not present(environ, "SLURM_PROCID"):
        return
    tasks = next((environ[v] for v in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") if present(environ, v)), None)
    if tasks is not None and tasks.strip() != str(world):
        plugin = "pmix" if launcher in ("openmpi", "mvapich2") else "pmi2"
        raise EnvConflict(
            f"{launcher} says the world has {world} rank(s) but the Slurm step has {tasks} tasks",
            "one MPI world spanning every srun task",
            f"start with srun --mpi={plugin} (the wrong MPI plugin makes every task its own world)",
        )
    if environ["SLURM_PROCID"].strip() != str(rank):
        raise EnvConflict(
            f"{launcher} rank {rank} differs from SLURM_PROCID={environ['SLURM_PROCID']}",
            "the same rank from MPI and Slurm", "start the ranks with one launcher: srun or mpirun, not both",
        )


def mpi_launcher(environ: Mapping[str, str]) -> str | None:
    """The kind of MPI launcher that started this process, or None: ``openmpi`` (Open MPI's mpirun/mpiexec),
    ``mpich`` (Hydra's mpiexec, or ``srun --mpi=pmi2``, which set PMI_RANK/PMI_SIZE or PMI_FD), ``pmix``
    (``srun --mpi=pmix`` and other PMIx servers, which set PMIX_RANK and PMIX_NAMESPACE).

    Only a process started this way can join an MPI world with its peers; any other becomes a singleton world.
    """
    if "OMPI_COMM_WORLD_RANK" in environ:
        return "openmpi"
    if "PMIX_RANK" in environ and "PMIX_NAMESPACE" in environ:
        return "pmix"
    if ("PMI_RANK" in environ and "PMI_SIZE" in environ) or "PMI_FD" in environ:
        return "mpich"
    return None
