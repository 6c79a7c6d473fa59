"""Slurm: a task inside ``srun`` (job and step variables), heterogeneous steps included.

Variables from the ``srun`` man page (OUTPUT ENVIRONMENT VARIABLES) and Slurm's heterogeneous_jobs.html: in a
step across het components (``srun ... : ...``) SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_STEP_NODELIST and
SLURM_STEP_TASKS_PER_NODE describe the whole step (one MPI_COMM_WORLD), and each component's own values carry
a ``_HET_GROUP_N`` suffix (checked on Slurm 22.05: ``srun -n1 : -n2`` gives ranks 0-2, SLURM_STEP_NUM_TASKS=3,
SLURM_STEP_TASKS_PER_NODE=1,2). A bare ``salloc`` or ``sbatch`` shell carries SLURM_* variables too but is not a
task of a world: it has no step (or the step is the batch script), so it must not be taken for rank 0.

RANK, LOCAL_RANK, WORLD_SIZE and LOCAL_WORLD_SIZE exported by a job script (``export RANK=$SLURM_PROCID``) are
the same world when they agree with Slurm's values; only a disagreement is a conflict.
"""

from __future__ import annotations

from collections.abc import Mapping

import hostlist

from ddpkit.base.errors import EnvConflict
from ddpkit.env.master import resolve_master
from ddpkit.env.record import VarReader, WorldInfo, expand_nodelist, parse_count, present

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
    "het job": "SLURM_HET_SIZE; a het step's SLURM_STEP_* span every component (sum of SLURM_NTASKS_HET_GROUP_N "
               "where SLURM_STEP_NUM_TASKS is missing)",
}
#: Variables only a task inside a step has: in a step, their absence means the task set does not add up.
STEP_VARS = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID")
# Step ids that belong to the job's own shells, not to srun tasks (Slurm 20+ uses names, older ones numbers).
_NOT_TASK_STEPS = {"batch", "extern", "interactive", "4294967294", "4294967295", "4294967292"}
_NODELIST = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
_TASKS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")


def _step(environ: Mapping[str, str]) -> str | None:
    return next((environ[v].strip() for v in ("SLURM_STEP_ID", "SLURM_STEPID") if present(environ, v)), None)


def in_step(environ: Mapping[str, str]) -> bool:
    """Inside an srun step, or holding a step's variables (not the batch or interactive shell of a job)."""
    step = _step(environ)
    if step is not None:
        return step not in _NOT_TASK_STEPS
    # srun always sets SLURM_STEP_ID; step variables without it are a partial task set, not a job shell (the batch
    # and salloc shells carry none of them: checked on Slurm 22.05)
    # and the batch shell is task 0 on node 0: a higher id belongs to a task
    return any(present(environ, v) for v in ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST",
                                             "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NUM_NODES")) or \
        any((parse_count(environ.get(v, "")) or 0) > 0 for v in STEP_VARS)


def _job(environ: Mapping[str, str]) -> str | None:
    return next((environ[v].strip() for v in ("SLURM_JOB_ID", "SLURM_JOBID") if present(environ, v)), None)


def activated(environ: Mapping[str, str]) -> tuple[bool, str]:
    job = _job(environ)
    if job is None:
        return False, "SLURM_JOB_ID is not set (not inside a Slurm job)"
    step = _step(environ)
    if step is None or step in _NOT_TASK_STEPS:
        return False, (f"SLURM_JOB_ID={job} but no srun step (SLURM_STEP_ID={step}): an salloc/sbatch shell "
                       "is not a task; start ranks with srun")
    if not present(environ, "SLURM_PROCID"):
        return False, f"SLURM_JOB_ID={job}, step {step}, but SLURM_PROCID is not set"
    return True, f"inside srun: job {job}, step {step}"


def read(environ: Mapping[str, str]) -> WorldInfo:
    r = VarReader(environ, NAME)
    job_id = r.text("run_id", "SLURM_JOB_ID", "SLURM_JOBID")
    rank = r.required("rank", "SLURM_PROCID")
    local_rank = r.required("local_rank", "SLURM_LOCALID")
    world = _het_world(r) if not r.has(*_TASKS) else r.required("world_size", *_TASKS, minimum=1)
    node_rank = r.required("node_rank", "SLURM_NODEID")
    nodelist_var = r.first(*_NODELIST)
    hosts: tuple[str, ...] = ()
    if nodelist_var is not None:
        hosts = expand_nodelist(environ[nodelist_var], nodelist_var)
        r.derived("hosts", nodelist_var)
    num_nodes = r.integer("num_nodes", "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", minimum=1)
    nodes_known = num_nodes is not None or bool(hosts)
    if num_nodes is None:
        num_nodes = len(hosts) or 1
        r.derived("num_nodes", "length of the node list" if hosts else "1 (no node count or list: a guess)")
    if world == 1 and (num_nodes > 1 or node_rank > 0):  # one task: one node, whatever the allocation spans
        num_nodes, node_rank = 1, 0
        r.derived("num_nodes", "1: a step of one task")
        r.derived("node_rank", "0: a step of one task")
    local_world = _local_world_size(r, node_rank, num_nodes if nodes_known or world == 1 else None, world)
    if rank >= world:
        raise EnvConflict(f"SLURM_PROCID={rank} is not below the task count {world}",
                          "0 <= SLURM_PROCID < SLURM_NTASKS", "check the srun options (-n, --ntasks-per-node)")
    _check_torch_vars(environ, {"RANK": (rank, "SLURM_PROCID"), "WORLD_SIZE": (world, r.sources["world_size"]),
                                "LOCAL_RANK": (local_rank, "SLURM_LOCALID"),
                                "LOCAL_WORLD_SIZE": (local_world, r.sources["local_world_size"])})
    addr, port = resolve_master(
        r, hosts=hosts, job_id=job_id, single_host=num_nodes == 1,
        hint="run inside an srun step (Slurm sets SLURM_JOB_NODELIST) or export MASTER_ADDR",
    )
    het = r.integer("het_size", "SLURM_HET_SIZE", minimum=1)
    notes: tuple[str, ...] = (f"heterogeneous job of {het} components: this step is one world of {world} tasks",) \
        if het else ()
    exported = [v for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE") if present(environ, v)]
    if exported:
        notes += (f"{', '.join(exported)} exported by hand agree with Slurm's values: the same world",)
    return WorldInfo(
        launcher=NAME, rank=rank, local_rank=local_rank, world_size=world, local_world_size=local_world,
        node_rank=node_rank, num_nodes=num_nodes, master_addr=addr, master_port=port, hosts=hosts,
        restart_count=r.integer("restart_count", "SLURM_RESTART_COUNT"), run_id=job_id, sources=r.sources,
        notes=notes,
    )


def _het_world(r: VarReader) -> int:
    """A het step without SLURM_STEP_NUM_TASKS/SLURM_NTASKS: the sum of every component's task count."""
    het = r.integer("het_size", "SLURM_HET_SIZE", minimum=1)
    names = [f"SLURM_NTASKS_HET_GROUP_{i}" for i in range(het or 0)]
    if not het or not all(present(r.environ, n) for n in names):
        return r.required("world_size", *_TASKS, minimum=1)
    total = sum(r.integer(f"het_{i}", n, minimum=1) or 0 for i, n in enumerate(names))
    r.derived("world_size", f"sum of SLURM_NTASKS_HET_GROUP_0..{het - 1}")
    return total


def _local_world_size(r: VarReader, node_rank: int, num_nodes: int | None, world: int) -> int:
    """``num_nodes``: None where no variable gives the node count or list (a guess of one would read every rank
    as on this host)."""
    var = r.first("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    if var is None:  # srun always sets it; a hand-made set without it is derived only where it cannot be wrong
        if world == 1:
            r.derived("local_world_size", "1: a step of one task")
            return 1
        if num_nodes is not None and (num_nodes == 1 or world % num_nodes == 0):
            r.derived("local_world_size", "SLURM_NTASKS / number of nodes (an even spread)")
            return max(1, world // num_nodes)
        on = "an unknown number of nodes (no SLURM_STEP_NUM_NODES, no node list)" if num_nodes is None \
            else f"{num_nodes} nodes"
        raise EnvConflict(f"{world} Slurm tasks on {on} without SLURM_STEP_TASKS_PER_NODE",
                          "SLURM_STEP_TASKS_PER_NODE (srun sets it), or a task count the node count divides",
                          "run the ranks under srun, which sets every SLURM_STEP_* variable")
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


def _check_torch_vars(environ: Mapping[str, str], slurm_values: Mapping[str, tuple[int, str]]) -> None:
    """RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE exported by hand must agree with Slurm's, or ranks would join
    different worlds. Exported in the batch script before srun, RANK holds the batch shell's value (0) in
    every task: the message says so."""
    for var, (value, slurm_var) in slurm_values.items():
        raw = environ.get(var)
        if raw is not None and raw.strip() and raw.strip() != str(value):
            raise EnvConflict(
                f"{var}={raw.strip()} disagrees with Slurm ({slurm_var} gives {value} for this task)",
                f"{var} equal to Slurm's value, or unset",
                f"unset {var} in the job script (ddpkit takes it from Slurm); a value exported before srun is the "
                "batch shell's, the same in every task: export it inside the step "
                "(srun bash -c 'RANK=$SLURM_PROCID ...') if the program needs it",
            )
