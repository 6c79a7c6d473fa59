"""Kubeflow: PyTorchJob v1 (one process per pod, or PET_* for torchrun with elasticPolicy) and Trainer v2.

Inside a pod whose command runs torchrun, the worker sees torchrun's variables and the torchrun launcher wins.
When ddpkit is the pod's command itself and PET_NPROC_PER_NODE asks for several processes, this process is the
node's agent: ddpkit starts the local ranks itself through torch's elastic launcher.
"""

from __future__ import annotations

from collections.abc import Mapping

from ddpkit.env.record import VarReader, WorldInfo
from ddpkit.errors import EnvConflict

NAME = "kubeflow"
TABLE = {
    "rank": "RANK (v1 pod) | PET_NODE_RANK x PET_NPROC_PER_NODE (agent)",
    "world_size": "WORLD_SIZE | PET_NNODES x PET_NPROC_PER_NODE",
    "local_world_size": "PET_NPROC_PER_NODE | 1",
    "node_rank": "PET_NODE_RANK | RANK",
    "num_nodes": "PET_NNODES | WORLD_SIZE",
    "master": "MASTER_ADDR, MASTER_PORT | PET_MASTER_ADDR, PET_MASTER_PORT",
    "run_id": "PET_RDZV_ID | JOB name",
}


def activated(environ: Mapping[str, str]) -> tuple[bool, str]:
    pet = sorted(k for k in environ if k.startswith("PET_"))
    if pet:
        return True, f"Kubeflow's PET_* variables are set ({', '.join(pet[:4])}{', ...' if len(pet) > 4 else ''})"
    if "KUBERNETES_SERVICE_HOST" in environ and "RANK" in environ and "WORLD_SIZE" in environ:
        return True, "inside a Kubernetes pod with RANK and WORLD_SIZE (PyTorchJob v1)"
    return False, "no PET_* variables, and not a Kubernetes pod with RANK/WORLD_SIZE"


def read(environ: Mapping[str, str]) -> WorldInfo:
    r = VarReader(environ, NAME)
    nproc_raw = environ.get("PET_NPROC_PER_NODE", "1").strip()
    if nproc_raw in ("auto", "cpu", "gpu"):
        raise EnvConflict(f"PET_NPROC_PER_NODE={nproc_raw!r}", "a number of processes per pod",
                          "set nprocPerNode to a number in the PyTorchJob, or run torchrun as the pod's command")
    nproc = r.integer("local_world_size", "PET_NPROC_PER_NODE", minimum=1) or 1
    nnodes_var = r.first("PET_NNODES")
    if nnodes_var is not None and ":" in environ[nnodes_var]:
        low, _, high = environ[nnodes_var].partition(":")
        r.derived("num_nodes", f"PET_NNODES={environ[nnodes_var]} (elastic: the upper bound)")
        num_nodes = _positive(high or low, nnodes_var)
    else:
        num_nodes = r.integer("num_nodes", "PET_NNODES", "WORLD_SIZE", minimum=1) or 1
    node_rank = r.integer("node_rank", "PET_NODE_RANK", "RANK") or 0
    is_agent = nproc > 1
    if is_agent:
        rank, world = node_rank * nproc, num_nodes * nproc
        r.derived("rank", "PET_NODE_RANK x PET_NPROC_PER_NODE (rank of this pod's first process)")
        r.derived("world_size", "PET_NNODES x PET_NPROC_PER_NODE")
    else:
        rank = r.integer("rank", "RANK") or node_rank
        world = r.integer("world_size", "WORLD_SIZE", minimum=1) or num_nodes
    addr = r.text("master_addr", "MASTER_ADDR", "PET_MASTER_ADDR")
    port = r.integer("master_port", "MASTER_PORT", "PET_MASTER_PORT", minimum=1)
    if addr is None:
        raise EnvConflict("Kubeflow variables are set but neither MASTER_ADDR nor PET_MASTER_ADDR",
                          "the master pod's address, which the training operator sets",
                          "run inside a PyTorchJob or TrainJob pod, or export MASTER_ADDR")
    return WorldInfo(
        launcher=NAME, rank=rank, local_rank=0, world_size=world, local_world_size=nproc, node_rank=node_rank,
        num_nodes=num_nodes, master_addr=addr, master_port=port, is_agent=is_agent,
        run_id=r.text("run_id", "PET_RDZV_ID", "JOB_NAME"), sources=r.sources,
    )


def _positive(raw: str, var: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise EnvConflict(f"{var}={raw!r} is not a number of nodes", "N or MIN:MAX",
                          "check the PyTorchJob's elasticPolicy") from None
    if value < 1:
        raise EnvConflict(f"{var}={raw!r} is below 1", "N or MIN:MAX with N >= 1", "check the elasticPolicy")
    return value
