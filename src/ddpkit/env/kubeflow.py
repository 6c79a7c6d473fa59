"""Kubeflow: PyTorchJob v1 (one process per pod, or PET_* for torchrun with elasticPolicy) and Trainer v2.

What each pod gets, from training-operator 1.9 ``pkg/controller.v1/pytorch/``: ``envvar.go`` sets MASTER_ADDR,
MASTER_PORT, WORLD_SIZE (pods) and RANK (pod index) when the job has a Master replica, plus PET_MASTER_ADDR,
PET_MASTER_PORT, PET_NNODES, PET_NODE_RANK and PET_NPROC_PER_NODE for torchrun; with an ``elasticPolicy``,
``elastic.go`` sets PET_RDZV_ENDPOINT (rdzvHost:rdzvPort, default ``<job>-worker-0``), PET_RDZV_BACKEND (default
c10d), PET_NNODES=MIN:MAX, PET_MAX_RESTARTS, PET_NPROC_PER_NODE (PET_N_PROC_PER_NODE in older releases),
PET_RDZV_ID and PET_RDZV_CONF (``k=v,k=v``), and no MASTER_ADDR. Trainer v2's torch plugin sets PET_NNODES,
PET_NPROC_PER_NODE (``auto`` by default), PET_NODE_RANK and PET_MASTER_ADDR/PORT.

torchrun reads every PET_X as its ``--x`` option. Inside a pod whose command runs torchrun, the worker sees
torchrun's variables and the torchrun launcher wins. When ddpkit is the pod's command, it is the pod's agent
whenever torchrun would be one (several processes, or an elastic rendezvous) and starts the ranks itself with
the same rendezvous (``AgentPlan``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ddpkit.base.errors import EnvConflict
from ddpkit.env.record import AgentPlan, VarReader, WorldInfo, parse_count, present

NAME = "kubeflow"
TABLE = {
    "rank": "RANK (v1 pod) | PET_NODE_RANK x PET_NPROC_PER_NODE (agent)",
    "world_size": "WORLD_SIZE | PET_NNODES (its maximum) x PET_NPROC_PER_NODE",
    "local_world_size": "PET_NPROC_PER_NODE (a number, or auto/cpu/gpu as torchrun resolves it) | 1",
    "node_rank": "PET_NODE_RANK | RANK",
    "num_nodes": "PET_NNODES (N or MIN:MAX) | WORLD_SIZE",
    "master": "MASTER_ADDR, MASTER_PORT | PET_MASTER_ADDR, PET_MASTER_PORT (none needed for PET_NNODES=1)",
    "rendezvous": "PET_RDZV_ENDPOINT, PET_RDZV_BACKEND, PET_RDZV_CONF, PET_MAX_RESTARTS (elasticPolicy)",
    "run_id": "PET_RDZV_ID | JOB_NAME",
}
_BACKENDS = ("c10d", "etcd", "etcd-v2", "static")
_NPROC_VARS = ("PET_NPROC_PER_NODE", "PET_N_PROC_PER_NODE")


def activated(environ: Mapping[str, str]) -> tuple[bool, str]:
    pet = sorted(k for k in environ if k.startswith("PET_") and present(environ, k))
    if pet:
        return True, f"Kubeflow's PET_* variables are set ({', '.join(pet[:4])}{', ...' if len(pet) > 4 else ''})"
    if present(environ, "KUBERNETES_SERVICE_HOST") and present(environ, "RANK") and present(environ, "WORLD_SIZE"):
        return True, "inside a Kubernetes pod with RANK and WORLD_SIZE (PyTorchJob v1)"
    return False, "no PET_* variables, and not a Kubernetes pod with RANK/WORLD_SIZE"


def read(environ: Mapping[str, str]) -> WorldInfo:
    r = VarReader(environ, NAME)
    nproc = _nproc_per_node(r)
    min_nodes, max_nodes = _nnodes(r)
    endpoint = _endpoint(r)
    elastic = min_nodes != max_nodes or endpoint is not None
    node_rank = r.integer("node_rank", "PET_NODE_RANK", "RANK")
    addr = r.address("master_addr", "MASTER_ADDR", "PET_MASTER_ADDR")
    port = r.port("master_port", "MASTER_PORT", "PET_MASTER_PORT")
    run_id = r.text("run_id", "PET_RDZV_ID", "JOB_NAME")
    r.integer("max_restarts", "PET_MAX_RESTARTS")  # validated in every pod, used by an agent
    notes: list[str] = []
    if nproc > 1 or elastic:  # torchrun would be this pod's agent: so is ddpkit
        plan = _agent_plan(r, nproc, min_nodes, max_nodes, endpoint, node_rank, addr, port, run_id, notes)
        rank = (node_rank or 0) * nproc
        r.derived("rank", "PET_NODE_RANK x PET_NPROC_PER_NODE (this pod's first rank; elastic: set at rendezvous)")
        r.derived("world_size", "PET_NNODES (maximum) x PET_NPROC_PER_NODE")
        return WorldInfo(
            launcher=NAME, rank=rank, local_rank=0, world_size=max_nodes * nproc, local_world_size=nproc,
            node_rank=node_rank or 0, num_nodes=max_nodes, master_addr=addr, master_port=port, is_agent=True,
            agent=plan, run_id=plan.run_id, sources=r.sources, notes=tuple(notes),
        )
    world = r.integer("world_size", "WORLD_SIZE", minimum=1) or max_nodes
    pod_rank = r.integer("rank", "RANK")
    rank = (node_rank or 0) if pod_rank is None else pod_rank
    if world > 1 and addr is None:
        raise EnvConflict(f"a Kubeflow pod of a world of {world} but neither MASTER_ADDR nor PET_MASTER_ADDR",
                          "the master pod's address, which the training operator sets",
                          "run inside a PyTorchJob or TrainJob pod, or export MASTER_ADDR")
    if addr is None:
        addr = "127.0.0.1"
        r.derived("master_addr", "a single pod: loopback")
    return WorldInfo(
        launcher=NAME, rank=rank, local_rank=0, world_size=world, local_world_size=1, node_rank=node_rank or rank,
        num_nodes=world, master_addr=addr, master_port=port, run_id=run_id, sources=r.sources,
    )


def _agent_plan(r: VarReader, nproc: int, min_nodes: int, max_nodes: int, endpoint: str | None,
                node_rank: int | None, addr: str | None, port: int | None, run_id: str | None,
                notes: list[str]) -> AgentPlan:
    backend = (r.text("rdzv_backend", "PET_RDZV_BACKEND") or "c10d").strip()
    if backend not in _BACKENDS:
        raise EnvConflict(f"PET_RDZV_BACKEND={backend!r}", f"one of {', '.join(_BACKENDS)}",
                          "set elasticPolicy.rdzvBackend to c10d, etcd or etcd-v2")
    restarts = r.integer("max_restarts", "PET_MAX_RESTARTS") or 0
    conf = _rdzv_conf(r)
    if endpoint is None and max_nodes > 1:
        if addr is None:
            raise EnvConflict(f"PET_NNODES={r.environ.get('PET_NNODES')} spans several pods but neither "
                              "PET_RDZV_ENDPOINT nor MASTER_ADDR/PET_MASTER_ADDR is set",
                              "the rendezvous endpoint or the master pod's address, which the operator sets",
                              "run inside a PyTorchJob (elasticPolicy or a Master replica) or TrainJob pod")
        endpoint = f"{addr}:{port or 29400}"
        r.derived("rdzv_endpoint", "MASTER_ADDR:MASTER_PORT (non-elastic job)")
    if min_nodes != max_nodes and run_id is None:
        notes.append("PET_RDZV_ID is not set: the rendezvous id is torchrun's default 'none', shared by every "
                     "job on the same rendezvous server (set elasticPolicy.rdzvId to the job's name)")
    return AgentPlan(min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=nproc, rdzv_endpoint=endpoint,
                     rdzv_backend=backend, rdzv_conf=conf, run_id=run_id or ("none" if endpoint else None),
                     max_restarts=restarts, node_rank=None if min_nodes != max_nodes else node_rank)


def _nproc_per_node(r: VarReader) -> int:
    var = r.first(*_NPROC_VARS)
    if var is None:
        return 1
    raw = r.environ[var].strip()
    if parse_count(raw) is not None:
        return r.integer("local_world_size", var, minimum=1) or 1
    if raw not in ("auto", "cpu", "gpu"):
        raise EnvConflict(f"{var}={raw!r}", "a number of processes per pod, or auto, cpu or gpu",
                          "set nprocPerNode in the PyTorchJob or TrainJob")
    r.derived("local_world_size", f"{var}={raw}, resolved as torchrun does")
    if raw == "cpu":
        return os.cpu_count() or 1
    # torchrun's own rule (torch/distributed/run.py determine_local_world_size): gpu = the CUDA devices, auto =
    # the accelerators if any, else the CPUs. Only these two values need torch, so only they import it.
    from torch.distributed.run import determine_local_world_size

    try:
        return int(determine_local_world_size(raw))
    except ValueError as exc:
        raise EnvConflict(f"{var}={raw} but {exc}", "a GPU visible to this pod, or a number",
                          "request GPUs for the pod or set nprocPerNode to a number") from None


def _nnodes(r: VarReader) -> tuple[int, int]:
    var = r.first("PET_NNODES")
    if var is None:
        return 1, 1
    raw = r.environ[var]
    low_raw, sep, high_raw = raw.partition(":")
    low, high = parse_count(low_raw), parse_count(high_raw if sep else low_raw)
    if low is None or high is None or low < 1 or high < low:
        raise EnvConflict(f"PET_NNODES={raw!r}", "N or MIN:MAX with 1 <= MIN <= MAX",
                          "check the PyTorchJob's elasticPolicy (minReplicas, maxReplicas) or the worker replicas")
    r.derived("num_nodes", f"PET_NNODES={raw}" + (" (elastic: the upper bound)" if low != high else ""))
    return low, high


def _endpoint(r: VarReader) -> str | None:
    var = r.first("PET_RDZV_ENDPOINT")
    if var is None:
        return None
    raw = r.environ[var].strip()
    host, sep, port_raw = raw.rpartition(":")
    port = parse_count(port_raw)
    if not sep or not host or port is None or not 1 <= port <= 65535 or any(c.isspace() for c in host):
        raise EnvConflict(f"PET_RDZV_ENDPOINT={raw!r}", "HOST:PORT with a port in 1..65535",
                          "check elasticPolicy.rdzvHost and rdzvPort")
    r.derived("rdzv_endpoint", var)
    return raw


def _rdzv_conf(r: VarReader) -> tuple[tuple[str, str], ...]:
    raw = r.text("rdzv_conf", "PET_RDZV_CONF")
    if raw is None:
        return ()
    pairs = []
    for item in raw.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep or not key:
            raise EnvConflict(f"PET_RDZV_CONF={raw!r}", "key=value pairs separated by commas",
                              "check elasticPolicy.rdzvConf")
        pairs.append((key, value))
    return tuple(pairs)
