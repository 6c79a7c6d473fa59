"""Never a silent world of one: launcher variables that do not add up, and signs of a larger job.

Two uses. ``detect()`` calls :func:`refuse_hidden_world` after reading the winning launcher: where the winner is
``none`` or a hand-made ``env`` world, any known launcher family whose variables are present (but did not make
a task), or that says the world is larger, is an EnvConflict (exit 2) naming the variables seen and what is
missing. ``ddpkit check`` in a world of one calls :func:`lone_world_evidence` and FAILs with what it finds:
a Slurm job shell of several tasks (not an srun step), or other copies of this very command started by the
same parent (an unknown launcher that started N processes, each of which sees no launcher).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from ddpkit.base.errors import EnvConflict
from ddpkit.env import flux, lsf, mpi, pals, slurm
from ddpkit.env.record import WorldInfo, parse_count, present

__all__ = ["FAMILIES", "Family", "lone_world_evidence", "refuse_hidden_world", "visible_families"]


@dataclass(frozen=True)
class Family:
    launcher: str
    """Name of the launcher in ddpkit.env.LAUNCHERS these variables belong to."""
    markers: tuple[str, ...]
    """Variables only this launcher sets."""
    needs: tuple[str, ...]
    """Variables it always sets for a task: those missing are named."""
    sizes: tuple[str, ...]
    """Variables holding a count of processes (the world, or this node's share of it)."""
    ranks: tuple[str, ...] = ()
    """Variables holding a rank: the world is larger than any of them."""


FAMILIES: tuple[Family, ...] = (
    Family("lsf", lsf.FAMILY, lsf.activated.names,
           ("JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_LOCAL_SIZE"), ("JSM_NAMESPACE_RANK", "JSM_NAMESPACE_LOCAL_RANK")),
    Family("pals", pals.FAMILY, ("PALS_RANKID", "PMI_SIZE"), ("PALS_LOCAL_SIZE",),
           ("PALS_RANKID", "PALS_LOCAL_RANKID", "PALS_NODEID")),
    Family("flux", flux.FAMILY, flux.activated.names, ("FLUX_JOB_SIZE", "FLUX_JOB_NNODES"),
           ("FLUX_TASK_RANK", "FLUX_TASK_LOCAL_ID")),
    Family("mvapich2", ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
                        "MV2_COMM_WORLD_LOCAL_SIZE"), mpi.mvapich_activated.names,
           ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE"), ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_LOCAL_RANK")),
    Family("openmpi", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                       "OMPI_COMM_WORLD_LOCAL_SIZE"), mpi.openmpi_activated.names,
           ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
           ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_NODE_RANK")),
    Family("mpich", ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"), mpi.mpich_activated.names,
           ("PMI_SIZE", "MPI_LOCALNRANKS"), ("PMI_RANK", "MPI_LOCALRANKID")),
    # inside a step (only there do Slurm's variables count: see visible_families) the job's task and node counts
    # describe the step's world too: a step without SLURM_PROCID that shows them is a task set that does not add up
    Family("slurm", (*slurm.STEP_VARS, "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE",
                     "SLURM_STEP_NUM_NODES"),
           ("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID"),
           ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_STEP_NUM_NODES"),
           ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID")),
    Family("env", ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE"),
           ("RANK", "WORLD_SIZE"), ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE"),
           ("RANK", "LOCAL_RANK", "GROUP_RANK")),
)


def visible_families(environ: Mapping[str, str]) -> list[tuple[Family, list[str], int]]:
    """Each family with variables present: (family, the variables seen, the least world size they imply).

    Slurm's variables count only inside an srun step: a job's batch or salloc shell is not a task.
    """
    found = []
    for fam in FAMILIES:
        if fam.launcher == "slurm" and not slurm.in_step(environ):
            continue
        seen = [v for v in dict.fromkeys(fam.markers + fam.sizes + fam.ranks) if present(environ, v)]
        if not seen:
            continue
        counts = [parse_count(environ[v]) for v in fam.sizes if v in seen]
        ranks = [parse_count(environ[v]) for v in fam.ranks if v in seen]
        bound = max([1] + [c for c in counts if c is not None] + [k + 1 for k in ranks if k is not None])
        found.append((fam, seen, bound))
    return found


def refuse_hidden_world(environ: Mapping[str, str], info: WorldInfo, active: set[str]) -> None:
    """Raise EnvConflict when the world detected (none, or a hand-made env world) hides a launcher's task."""
    if info.launcher not in ("none", "env"):
        return  # a launcher that reads its own task checks its neighbours itself (MPI vs Slurm, srun torchrun)
    for fam, seen, bound in visible_families(environ):
        shown = ", ".join(f"{v}={environ[v].strip()[:20]}" for v in seen)
        if fam.launcher not in active and (info.launcher == "none" or bound > 1):
            missing = [v for v in fam.needs if not present(environ, v)]
            raise EnvConflict(
                f"{fam.launcher} variables are set ({shown}) but do not make a task of {fam.launcher}: "
                f"{', '.join(missing) or 'a consistent set'} missing",
                f"every variable {fam.launcher} sets for a task ({', '.join(fam.needs)}), or none of them",
                f"start the ranks with {fam.launcher}'s own launcher, or unset {', '.join(seen)}; ddpkit will not "
                "run as a world of one while a launcher's variables say otherwise",
            )
        if bound > info.world_size:
            raise EnvConflict(
                f"{fam.launcher} variables ({shown}) say the world has at least {bound} processes, but "
                f"{info.launcher} gives a world of {info.world_size}",
                "one world size from every launcher variable", f"unset the stale variables ({', '.join(seen)}) "
                f"or start the ranks with {fam.launcher}'s own launcher",
            )


def lone_world_evidence(info: WorldInfo, environ: Mapping[str, str] | None = None) -> list[str]:
    """In a world of one: the reasons to believe this process is one of a larger job (empty when none)."""
    environ = os.environ if environ is None else environ
    if info.world_size != 1:
        return []
    reasons = []
    job = next((environ[v] for v in ("SLURM_JOB_ID", "SLURM_JOBID") if present(environ, v)), None)
    tasks = next((parse_count(environ[v]) for v in ("SLURM_NTASKS", "SLURM_NPROCS") if present(environ, v)), None)
    if job and not slurm.in_step(environ) and tasks and tasks > 1:
        reasons.append(f"Slurm job {job} has {tasks} tasks (SLURM_NTASKS={tasks}) but this process runs outside "
                       "any srun step, as one process: start it with srun")
    lsf_slots = parse_count(environ.get("LSB_DJOB_NUMPROC", "")) if present(environ, "LSB_DJOB_NUMPROC") else None
    if lsf_slots and lsf_slots > 1 and not present(environ, "JSM_NAMESPACE_RANK"):
        reasons.append(f"LSF job {environ.get('LSB_JOBID', '?')} has {lsf_slots} slots (LSB_DJOB_NUMPROC) but this "
                       "process was not started by jsrun: start it with jsrun")
    siblings = same_command_siblings()
    if siblings:
        reasons.append(f"{len(siblings) + 1} processes run this same command under parent process {os.getppid()} "
                       f"(PIDs {', '.join(map(str, [os.getpid(), *siblings][:8]))}): a launcher ddpkit does not "
                       "know started them, and each sees a world of one; export RANK, WORLD_SIZE, MASTER_ADDR "
                       "and MASTER_PORT for each, or use a launcher ddpkit knows (ddpkit env --explain)")
    return reasons


def same_command_siblings() -> list[int]:
    """Other processes with this process's parent and command line (Linux /proc; empty elsewhere)."""
    parent = os.getppid()
    if parent <= 1:
        return []
    try:
        with open(f"/proc/{os.getpid()}/cmdline", "rb") as f:
            mine = f.read()
        names = os.listdir("/proc")
    except OSError:
        return []
    found = []
    for name in names:
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
            if ppid != parent:
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if f.read() == mine:
                    found.append(int(name))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
    return sorted(found)
