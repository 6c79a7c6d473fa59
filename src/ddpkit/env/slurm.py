"""Slurm: a task inside ``srun`` (job and step variables).

A bare ``salloc`` or ``sbatch`` shell carries SLURM_* variables too but is not a task of a world: it has no
step (or the step is the batch script), so it must not be taken for rank 0.
"""

from __future__ import annotations

from collections.abc import Mapping

import hostlist

from ddpkit.env.master import resolve_master
from ddpkit.env.record import VarReader, WorldInfo, expand_nodelist
from ddpkit.errors import EnvConflict

NAME = "slurm"
TABLE = {
    "rank": "SLURM_PROCID",
    "local_rank": "SLURM_LOCALID",
    "world_size": "SLURM_STEP_NUM_TASKS | SLURM_NTASKS",
    "local_world_size": "SLURM_STEP_TASKS_PER_NODE | SLURM_TASKS_PER_NODE",
    "node_rank": "SLURM_NODEID",
    "num_nodes": "SLURM_STEP_NUM_NODES | SLURM_JOB_NUM_NODES",
    "hosts": "SLURM_STEP_NODELIST | SLURM_JOB_NODELIST",
    "master": "MASTER_ADDR | first host of the node list; MASTER_PORT | derived from SLURM_JOB_ID",
    "run_id": "SLURM_JOB_ID",
    "restart_count": "SLURM_RESTART_COUNT",
}
# Step ids that belong to the job's own shells, not to srun tasks (Slurm 20+ uses names, older ones numbers).
_NOT_TASK_STEPS = {"batch", "extern", "interactive", "4294967294", "4294967295", "4294967292"}
_NODELIST = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_TASKS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")


def _step(environ: Mapping[str, str]) -> str | None:
    return environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID"))


def activated(environ: Mapping[str, str]) -> tuple[bool, str]:
    job = environ.get("SLURM_JOB_ID", environ.get("SLURM_JOBID"))
    if job is None:
        return False, "SLURM_JOB_ID is not set (not inside a Slurm job)"
    step = _step(environ)
    if step is None or step.strip() in _NOT_TASK_STEPS:
        return False, (f"SLURM_JOB_ID={job} but no srun step (SLURM_STEP_ID={step}): an salloc/sbatch shell "
                       "is not a task; start ranks with srun")
    if "SLURM_PROCID" not in environ:
        return False, f"SLURM_JOB_ID={job}, step {step}, but SLURM_PROCID is not set"
    return True, f"inside srun: job {job}, step {step}"


def read(environ: Mapping[str, str]) -> WorldInfo:
    r = VarReader(environ, NAME)
    job_id = r.text("run_id", "SLURM_JOB_ID", "SLURM_JOBID")
    rank = r.required("rank", "SLURM_PROCID")
    local_rank = r.required("local_rank", "SLURM_LOCALID")
    world = r.required("world_size", *_TASKS, minimum=1)
    node_rank = r.required("node_rank", "SLURM_NODEID")
    nodelist_var = r.first(*_NODELIST)
    hosts: tuple[str, ...] = ()
    if nodelist_var is not None:
        hosts = expand_nodelist(environ[nodelist_var], nodelist_var)
        r.derived("hosts", nodelist_var)
    num_nodes = r.integer("num_nodes", "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", minimum=1)
    if num_nodes is None:
        num_nodes = len(hosts) or 1
        r.derived("num_nodes", "length of the node list")
    local_world = _local_world_size(r, node_rank, num_nodes, world)
    if rank >= world:
        raise EnvConflict(f"SLURM_PROCID={rank} is not below the task count {world}",
                          "0 <= SLURM_PROCID < SLURM_NTASKS", "check the srun options (-n, --ntasks-per-node)")
    _check_torch_vars(environ, rank, world)
    addr, port = resolve_master(
        r, hosts=hosts, job_id=job_id, single_host=num_nodes == 1,
        hint="run inside an srun step (Slurm sets SLURM_JOB_NODELIST) or export MASTER_ADDR",
    )
    return WorldInfo(
        launcher=NAME, rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world,
        node_rank=node_rank, num_nodes=num_nodes, master_addr=addr, master_port=port, hosts=hosts,
        restart_count=r.integer("restart_count", "SLURM_RESTART_COUNT"), run_id=job_id, sources=r.sources,
    )


def _local_world_size(r: VarReader, node_rank: int, num_nodes: int, world: int) -> int:
    var = r.first("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if var is None:
        r.derived("local_world_size", "SLURM_NTASKS / number of nodes")
        return max(1, world // num_nodes)
    raw = r.environ[var]
    try:
        per_node = hostlist.parse_slurm_tasks_per_node(raw)
    except (ValueError, hostlist.BadHostlist):
        raise EnvConflict(f"{var}={raw!r} is not a Slurm tasks-per-node list", "a list like 2(x3),1",
                          f"check how {var} is set; srun sets it correctly") from None
    if node_rank >= len(per_node):
        raise EnvConflict(f"SLURM_NODEID={node_rank} but {var}={raw!r} lists {len(per_node)} nodes",
                          "a node id inside the step's node list", "check the srun options (-N)")
    r.derived("local_world_size", f"{var}[SLURM_NODEID]")
    return int(per_node[node_rank])


def _check_torch_vars(environ: Mapping[str, str], rank: int, world: int) -> None:
    """RANK/WORLD_SIZE exported by hand must agree with Slurm's, or ranks would join different worlds."""
    for var, value, slurm_var in (("WORLD_SIZE", world, "SLURM_NTASKS"), ("RANK", rank, "SLURM_PROCID")):
        raw = environ.get(var)
        if raw is not None and raw.strip() != str(value):
            raise EnvConflict(
                f"{var}={raw} disagrees with Slurm ({slurm_var}={value})",
                f"{var} equal to {slurm_var}, or unset",
                f"unset {var} in the job script (ddpkit takes it from Slurm), or fix the srun task count",
            )
