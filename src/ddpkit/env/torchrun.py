"""torchrun / torch elastic: the worker's variables (RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK, TORCHELASTIC_*).

The variables torchrun sets for every worker are listed in the docstring of ``torch/distributed/run.py``
("Environment Variables": LOCAL_RANK, RANK, GROUP_RANK, ROLE_RANK, LOCAL_WORLD_SIZE, WORLD_SIZE,
ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS,
TORCHELASTIC_RUN_ID). A process is torchrun's worker when the agent's own TORCHELASTIC_* variables say so:
RANK, LOCAL_RANK and WORLD_SIZE alone are a hand-made world (launcher ``env``), or a job script's exports
inside another launcher's task.
"""

from __future__ import annotations

from collections.abc import Mapping

from ddpkit.base.errors import EnvConflict
from ddpkit.env.record import VarReader, WorldInfo, present

NAME = "torchrun"
TABLE = {
    "rank": "RANK",
    "local_rank": "LOCAL_RANK",
    "world_size": "WORLD_SIZE",
    "local_world_size": "LOCAL_WORLD_SIZE | WORLD_SIZE / GROUP_WORLD_SIZE",
    "node_rank": "GROUP_RANK",
    "num_nodes": "GROUP_WORLD_SIZE",
    "master": "MASTER_ADDR, MASTER_PORT",
    "run_id": "TORCHELASTIC_RUN_ID",
    "restart_count": "TORCHELASTIC_RESTART_COUNT",
    "activated by": "TORCHELASTIC_RUN_ID | TORCHELASTIC_RESTART_COUNT | TORCHELASTIC_MAX_RESTARTS",
}
AGENT_VARS = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")


def activated(environ: Mapping[str, str]) -> tuple[bool, str]:
    seen = [v for v in AGENT_VARS if present(environ, v)]
    if seen:
        return True, f"{', '.join(seen)} set (a torch elastic worker)"
    return False, "no TORCHELASTIC_* variable: not started by torchrun's agent"


def read(environ: Mapping[str, str]) -> WorldInfo:
    r = VarReader(environ, NAME)
    world = r.required("world_size", "WORLD_SIZE", minimum=1)
    rank = r.required("rank", "RANK")
    local_rank = r.required("local_rank", "LOCAL_RANK")
    num_nodes = r.integer("num_nodes", "GROUP_WORLD_SIZE", minimum=1)
    local_world = r.integer("local_world_size", "LOCAL_WORLD_SIZE", minimum=1)
    if local_world is None:
        local_world = _derive_local_world(r, world, num_nodes)
    node_rank = r.integer("node_rank", "GROUP_RANK")
    if node_rank is None:
        node_rank = rank // local_world
        r.derived("node_rank", "RANK // LOCAL_WORLD_SIZE")
    if num_nodes is None:
        num_nodes = max(1, -(-world // local_world))
        r.derived("num_nodes", "WORLD_SIZE / LOCAL_WORLD_SIZE")
    addr = r.address("master_addr", "MASTER_ADDR")
    port = r.port("master_port", "MASTER_PORT")
    if world > 1 and (addr is None or port is None):
        missing = " and ".join(v for v, x in (("MASTER_ADDR", addr), ("MASTER_PORT", port)) if x is None)
        raise EnvConflict(f"torchrun worker of a world of {world} without {missing}",
                          "MASTER_ADDR and MASTER_PORT, which torchrun sets for every worker",
                          "start the ranks with torchrun itself, or unset TORCHELASTIC_* and export them by hand")
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


def _derive_local_world(r: VarReader, world: int, num_nodes: int | None) -> int:
    """torchrun starts the same number of workers on every node: WORLD_SIZE / GROUP_WORLD_SIZE, when known."""
    if world == 1 or num_nodes == 1:
        r.derived("local_world_size", "WORLD_SIZE (a single node)")
        return world
    if num_nodes is not None and world % num_nodes == 0:
        r.derived("local_world_size", "WORLD_SIZE / GROUP_WORLD_SIZE")
        return world // num_nodes
    raise EnvConflict(f"torchrun worker of a world of {world} without LOCAL_WORLD_SIZE (and no GROUP_WORLD_SIZE "
                      "that divides it)", "LOCAL_WORLD_SIZE, which torchrun sets for every worker",
                      "export LOCAL_WORLD_SIZE (ranks on this node); ddpkit sizes threads from it")
