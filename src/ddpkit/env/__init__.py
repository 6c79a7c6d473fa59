"""Who am I, in which world: rank discovery from any launcher.

Each launcher is a table of field -> variable plus an ``activated()`` test. ``detect()`` tries them in a fixed
order, and the first active one wins; other active launchers are reported in the record's notes (or as an
error when they contradict the winner). Nothing here imports torch.

Order, and why: torchrun first (under ``srun torchrun`` or a Kubeflow pod running torchrun, the worker's
rank is torchrun's, not the agent's); Kubeflow (its pods carry RANK without LOCAL_RANK); LSF jsrun, Cray PALS
and Flux (they also serve PMI_RANK/PMI_SIZE, and Flux runs inside Slurm allocations); MVAPICH2, Open MPI and
MPICH (under ``srun --mpi=...`` both MPI and Slurm variables exist and must agree); Slurm; a hand-exported
RANK/WORLD_SIZE (``env``); and finally no launcher at all (a single process) -- but never while a known
launcher's variables are present without adding up to a task (ddpkit.env.evidence).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from ddpkit.base.errors import EnvConflict
from ddpkit.env import flux, kubeflow, lsf, mpi, pals, slurm, torchrun
from ddpkit.env.evidence import refuse_hidden_world
from ddpkit.env.master import resolve_master
from ddpkit.env.record import (
    PORT_RANGE,
    AgentPlan,
    RankAndSize,
    VarReader,
    WorldInfo,
    derive_port,
    expand_nodelist,
    is_ip_address,
    present,
)

__all__ = [
    "LAUNCHERS",
    "PORT_RANGE",
    "AgentPlan",
    "Launcher",
    "WorldInfo",
    "derive_port",
    "detect",
    "expand_nodelist",
    "explain",
    "thread_count",
]


@dataclass(frozen=True)
class Launcher:
    name: str
    table: Mapping[str, str]
    activated: Callable[[Mapping[str, str]], tuple[bool, str]]
    read: Callable[[Mapping[str, str]], WorldInfo]


ENV_TABLE = {
    "rank": "RANK",
    "local_rank": "LOCAL_RANK | RANK (every rank on this host)",
    "world_size": "WORLD_SIZE",
    "local_world_size": "LOCAL_WORLD_SIZE | WORLD_SIZE (loopback master) | 1 (assumed, and said)",
    "node_rank": "GROUP_RANK | RANK // local world size",
    "master": "MASTER_ADDR, MASTER_PORT",
}


_env_activated = RankAndSize("RANK", "WORLD_SIZE", "torch's env:// convention", verb="exported by hand")


def _env_read(environ: Mapping[str, str]) -> WorldInfo:
    r = VarReader(environ, "env")
    world = r.required("world_size", "WORLD_SIZE", minimum=1)
    rank = r.required("rank", "RANK")
    local_rank = r.integer("local_rank", "LOCAL_RANK")
    local_world = r.integer("local_world_size", "LOCAL_WORLD_SIZE", minimum=1)
    master = r.address("master_addr", "MASTER_ADDR")
    notes: list[str] = []
    known = True
    if local_world is None:
        if world == 1 or (master is not None and _is_loopback(master)):
            local_world = world  # a loopback master: every rank runs on this host
            r.derived("local_world_size", "WORLD_SIZE (MASTER_ADDR is loopback: every rank on this host)")
        else:  # torch's env:// needs no more: count it at start-up rather than guess (it sizes threads)
            known = False
            local_world = (local_rank or 0) + 1
            r.derived("local_world_size", "unknown (LOCAL_WORLD_SIZE unset): counted at start-up")
            notes.append("LOCAL_WORLD_SIZE is not set: ddpkit counts the ranks on this host when the process group "
                         "starts (it sizes each rank's threads from it); export it to skip the count")
    if local_rank is None:
        local_rank = rank if local_world == world else 0
        r.derived("local_rank", "RANK (every rank on this host)" if local_world == world else "0 (assumed)")
    node_rank = r.integer("node_rank", "GROUP_RANK")
    if node_rank is None:
        node_rank = rank // local_world if known else rank
        r.derived("node_rank", "RANK // local world size" if known else "unknown (GROUP_RANK unset): RANK")
    num_nodes = max(1, -(-world // local_world)) if known else world
    addr, port = resolve_master(r, hosts=(), job_id=None, single_host=known and local_world == world,
                                hint="export MASTER_ADDR and MASTER_PORT beside RANK and WORLD_SIZE")
    return WorldInfo(launcher="env", rank=rank, local_rank=local_rank, world_size=world,
                     local_world_size=local_world, local_world_known=known, node_rank=node_rank, num_nodes=num_nodes,
                     master_addr=addr, master_port=port, sources=r.sources, notes=tuple(notes))


def _is_loopback(addr: str) -> bool:
    import ipaddress

    return addr == "localhost" or (is_ip_address(addr) and ipaddress.ip_address(addr).is_loopback)


def _none_read(environ: Mapping[str, str]) -> WorldInfo:
    addr = environ["MASTER_ADDR"].strip() if present(environ, "MASTER_ADDR") else None
    return WorldInfo(launcher="none", rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
                     num_nodes=1, master_addr=addr,
                     sources={f: "no launcher: a single process" for f in ("rank", "world_size")})


LAUNCHERS: tuple[Launcher, ...] = (
    Launcher("torchrun", torchrun.TABLE, torchrun.activated, torchrun.read),
    Launcher("kubeflow", kubeflow.TABLE, kubeflow.activated, kubeflow.read),
    Launcher("lsf", lsf.TABLE, lsf.activated, lsf.read),
    Launcher("pals", pals.TABLE, pals.activated, pals.read),
    Launcher("flux", flux.TABLE, flux.activated, flux.read),
    Launcher("mvapich2", mpi.MVAPICH_TABLE, mpi.mvapich_activated, mpi.read_mvapich),
    Launcher("openmpi", mpi.OPENMPI_TABLE, mpi.openmpi_activated, mpi.read_openmpi),
    Launcher("mpich", mpi.MPICH_TABLE, mpi.mpich_activated, mpi.read_mpich),
    Launcher("slurm", slurm.TABLE, slurm.activated, slurm.read),
    Launcher("env", ENV_TABLE, _env_activated, _env_read),
    Launcher("none", {}, lambda environ: (True, "no launcher variables: a single process"), _none_read),
)


def explain(environ: Mapping[str, str] | None = None) -> list[tuple[str, bool, str]]:
    """Every launcher tried, in order, with whether it matched and why."""
    environ = os.environ if environ is None else environ
    return [(lnc.name, *lnc.activated(environ)) for lnc in LAUNCHERS]


def detect(environ: Mapping[str, str] | None = None) -> WorldInfo:
    """Detect the launcher and read this process's place in the world.

    Raises EnvConflict (exit code 2) for malformed values and launchers that contradict each other.
    """
    environ = os.environ if environ is None else environ
    active = [lnc for lnc in LAUNCHERS[:-1] if lnc.activated(environ)[0]]
    winner = active[0] if active else LAUNCHERS[-1]
    info = winner.read(environ)
    _validate(info)
    refuse_hidden_world(environ, info, {lnc.name for lnc in active})
    others = [lnc.name for lnc in active[1:] if lnc.name != "env"]
    notes = list(info.notes)
    if others:
        notes.append(f"also present: {', '.join(others)}; {winner.name} wins because it started this process "
                     f"directly (order: {', '.join(lnc.name for lnc in LAUNCHERS)})")
    if winner.name == "torchrun" and "slurm" in others:
        _check_srun_torchrun(environ, info)
        notes.append("a Slurm task runs this torchrun agent (srun torchrun)")
    if info.hosts == () and "slurm" in others and winner.name == "torchrun":
        var = next((v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST") if present(environ, v)), None)
        if var:
            info = replace(info, hosts=expand_nodelist(environ[var], var))
    return replace(info, notes=tuple(notes))


def _validate(info: WorldInfo) -> None:
    checks = [
        (info.rank < info.world_size, f"rank {info.rank} is not below the world size {info.world_size}"),
        (info.local_rank < info.local_world_size,
         f"local rank {info.local_rank} is not below the local world size {info.local_world_size}"),
        (info.local_world_size <= info.world_size,
         f"local world size {info.local_world_size} exceeds the world size {info.world_size}"),
        (info.node_rank < info.num_nodes, f"node rank {info.node_rank} is not below the node count {info.num_nodes}"),
    ]
    for ok, what in checks:
        if not ok:
            src = ", ".join(f"{k}<-{v}" for k, v in info.sources.items())
            raise EnvConflict(f"{info.launcher}: {what} ({src})", "0 <= rank < size for every field",
                              f"check the {info.launcher} options that set these variables")


def _check_srun_torchrun(environ: Mapping[str, str], info: WorldInfo) -> None:
    tasks = environ.get("SLURM_STEP_NUM_TASKS", "").strip()
    nodes = environ.get("SLURM_STEP_NUM_NODES", "").strip()
    if tasks and nodes and tasks != nodes:
        raise EnvConflict(
            f"srun started {tasks} tasks on {nodes} node(s), each running a torchrun agent",
            "exactly one task per node for srun torchrun",
            f"use srun -N {nodes} -n {nodes} (or --ntasks-per-node=1) and let torchrun start the ranks",
        )


def thread_count(local_world_size: int, environ: Mapping[str, str] | None = None) -> tuple[int | None, str]:
    """Threads per rank: the cores available to this process shared among the node's ranks.

    Returns (value to set, message); value is None when OMP_NUM_THREADS is already set and respected.
    """
    environ = os.environ if environ is None else environ
    if present(environ, "OMP_NUM_THREADS"):
        return None, f"OMP_NUM_THREADS={environ['OMP_NUM_THREADS']} is set: respected"
    total = os.cpu_count() or 1
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = total
    if cores < total:  # the launcher bound this rank to its own cores (mpirun --bind-to core): use them all
        return cores, f"OMP_NUM_THREADS set to {cores} (the {cores} core(s) this rank is bound to)"
    threads = max(1, cores // max(1, local_world_size))
    return threads, (f"OMP_NUM_THREADS set to {threads} ({cores} cores available / "
                     f"{local_world_size} ranks on this node)")
