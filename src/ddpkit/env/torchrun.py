"""torchrun / torch elastic: the worker's variables (RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK, TORCHELASTIC_*)."""

from __future__ import annotations

from collections.abc import Mapping

from ddpkit.env.record import VarReader, WorldInfo

NAME = "torchrun"
TABLE = {
    "rank": "RANK",
    "local_rank": "LOCAL_RANK",
    "world_size": "WORLD_SIZE",
    "local_world_size": "LOCAL_WORLD_SIZE",
    "node_rank": "GROUP_RANK",
    "num_nodes": "GROUP_WORLD_SIZE",
    "master": "MASTER_ADDR, MASTER_PORT",
    "run_id": "TORCHELASTIC_RUN_ID",
    "restart_count": "TORCHELASTIC_RESTART_COUNT",
}


def activated(environ: Mapping[str, str]) -> tuple[bool, str]:
    if "TORCHELASTIC_RUN_ID" in environ:
        return True, "TORCHELASTIC_RUN_ID is set (a torch elastic worker)"
    if all(v in environ for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE")):
        return True, "RANK, LOCAL_RANK and WORLD_SIZE are set"
    return False, "neither TORCHELASTIC_RUN_ID nor RANK+LOCAL_RANK+WORLD_SIZE is set"


def read(environ: Mapping[str, str]) -> WorldInfo:
    r = VarReader(environ, NAME)
    world = r.required("world_size", "WORLD_SIZE", minimum=1)
    rank = r.required("rank", "RANK")
    local_rank = r.required("local_rank", "LOCAL_RANK")
    local_world = r.integer("local_world_size", "LOCAL_WORLD_SIZE", minimum=1)
    if local_world is None:
        local_world = world
        r.derived("local_world_size", "WORLD_SIZE (LOCAL_WORLD_SIZE unset)")
    node_rank = r.integer("node_rank", "GROUP_RANK")
    if node_rank is None:
        node_rank = rank // local_world
        r.derived("node_rank", "RANK // LOCAL_WORLD_SIZE")
    num_nodes = r.integer("num_nodes", "GROUP_WORLD_SIZE", minimum=1)
    if num_nodes is None:
        num_nodes = max(1, -(-world // local_world))
        r.derived("num_nodes", "WORLD_SIZE / LOCAL_WORLD_SIZE")
    addr = r.text("master_addr", "MASTER_ADDR")
    port = r.integer("master_port", "MASTER_PORT", minimum=1)
    return WorldInfo(
        launcher=NAME,
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        local_world_size=local_world,
        node_rank=node_rank,
        num_nodes=num_nodes,
        master_addr=addr,
        master_port=port,
        restart_count=r.integer("restart_count", "TORCHELASTIC_RESTART_COUNT"),
        run_id=r.text("run_id", "TORCHELASTIC_RUN_ID"),
        sources=r.sources,
    )
