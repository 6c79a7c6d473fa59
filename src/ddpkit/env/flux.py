"""Flux (El Capitan, Tuolumne): a task started by ``flux run`` / ``flux submit``.

flux-environment(7) (flux-core ``doc/man7/flux-environment.rst``, "JOB ENVIRONMENT"): FLUX_TASK_RANK (global
task rank), FLUX_TASK_LOCAL_ID (rank on this node), FLUX_JOB_SIZE (tasks in the job), FLUX_JOB_NNODES (nodes),
FLUX_JOB_ID. Flux names no per-node task count: it follows from an even distribution (size divisible by the
node count, or one node, or one task per node); otherwise ddpkit asks for LOCAL_WORLD_SIZE instead of guessing
(it sets the thread count). Flux also serves PMI (PMI_RANK, PMI_SIZE), so it is tried before MPICH.
"""

from __future__ import annotations

from collections.abc import Mapping

from ddpkit.base.errors import EnvConflict
from ddpkit.env.master import resolve_master
from ddpkit.env.record import RankAndSize, VarReader, WorldInfo

NAME = "flux"
TABLE = {
    "rank": "FLUX_TASK_RANK",
    "local_rank": "FLUX_TASK_LOCAL_ID",
    "world_size": "FLUX_JOB_SIZE",
    "local_world_size": "LOCAL_WORLD_SIZE | FLUX_JOB_SIZE / FLUX_JOB_NNODES (when even)",
    "node_rank": "rank // local world size",
    "num_nodes": "FLUX_JOB_NNODES",
    "master": "MASTER_ADDR | loopback on one node; MASTER_PORT | derived from FLUX_JOB_ID",
    "run_id": "FLUX_JOB_ID",
}
FAMILY = ("FLUX_TASK_RANK", "FLUX_TASK_LOCAL_ID", "FLUX_JOB_SIZE", "FLUX_JOB_NNODES")
activated = RankAndSize("FLUX_TASK_RANK", "FLUX_JOB_SIZE", "a Flux job's task")


def read(environ: Mapping[str, str]) -> WorldInfo:
    r = VarReader(environ, NAME)
    rank = r.required("rank", "FLUX_TASK_RANK")
    world = r.required("world_size", "FLUX_JOB_SIZE", minimum=1)
    local_rank = r.required("local_rank", "FLUX_TASK_LOCAL_ID")
    nodes = r.required("num_nodes", "FLUX_JOB_NNODES", minimum=1)
    local_world = r.integer("local_world_size", "LOCAL_WORLD_SIZE", minimum=1)
    if local_world is None:
        if world % nodes:
            raise EnvConflict(f"a Flux job of {world} tasks on {nodes} nodes (FLUX_JOB_SIZE, FLUX_JOB_NNODES): the "
                              "tasks per node are uneven and Flux does not name this node's count",
                              "LOCAL_WORLD_SIZE, or a task count the node count divides",
                              "use flux run --tasks-per-node, or export LOCAL_WORLD_SIZE")
        local_world = world // nodes
        r.derived("local_world_size", "FLUX_JOB_SIZE / FLUX_JOB_NNODES")
    node_rank = rank // local_world
    r.derived("node_rank", "rank // local world size (Flux places tasks by node)")
    job_id = r.text("run_id", "FLUX_JOB_ID")
    addr, port = resolve_master(r, hosts=(), job_id=job_id, single_host=nodes == 1,
                                hint="export MASTER_ADDR: flux run --env=MASTER_ADDR=$(flux hostlist -n0 $FLUX_JOB_ID)")
    return WorldInfo(launcher=NAME, rank=rank, local_rank=local_rank, world_size=world,
                     local_world_size=local_world, node_rank=node_rank, num_nodes=nodes, master_addr=addr,
                     master_port=port, run_id=job_id, sources=r.sources)
