"""The rules of ``--heal`` and its options on a job (``ddpkit.jobs.spec.JobSpec`` checks them on construction)."""

from __future__ import annotations

from ddpkit.base.errors import ConfigError
from ddpkit.jobs.fields import JobFields

__all__ = ["check_heal", "check_mpi_heal"]


def check_heal(spec: JobFields) -> None:
    """``--heal`` and its options: Slurm's supervisor today (torchrun, mpi and k8s heal in their own ways)."""
    given = [name for name, on in (("--spare-nodes", spec.spare_nodes), ("--on-fail drain", spec.on_fail == "drain"),
                                   ("--run-dir", spec.run_dir)) if on]
    if not spec.heal:
        if given:
            raise ConfigError(f"{', '.join(given)} without --heal", "these options with --heal",
                              f"add --heal, or drop {', '.join(given)}")
        return
    if spec.backend not in ("slurm", "mpi") and not (spec.backend == "k8s" and spec.heal_live):
        raise ConfigError(f"submit {spec.backend} --heal", "submit slurm --heal (a supervisor in the batch script) "
                          "or submit mpi --heal (a supervisor around mpirun); submit k8s --heal live (a standby "
                          "pod); across hosts without a scheduler: ddpkit run|train -j MIN:MAXxP --heal on every host",
                          "use one of those, or drop --heal")
    if spec.backend == "mpi" and spec.on_fail == "drain":
        raise ConfigError("submit mpi --heal --on-fail drain", "--on-fail drain under Slurm (scontrol drains a node)",
                          "drop --on-fail drain: the mpi supervisor keeps the bad host out of its own attempts")
    if spec.spare_nodes < 0:
        raise ConfigError(f"--spare-nodes {spec.spare_nodes}", "0 or more", "pass --spare-nodes 1")
    if spec.max_attempts < 1:
        raise ConfigError(f"--max-attempts {spec.max_attempts}", "1 or more", "pass --max-attempts 3 (the default)")
    if spec.on_fail not in ("report", "drain"):
        raise ConfigError(f"--on-fail {spec.on_fail!r}", "report or drain", "pass --on-fail drain")
    if not (4 <= spec.silent_after <= 3600):
        raise ConfigError(f"--silent-after {spec.silent_after:g}", "4 to 3600 seconds (a heartbeat is stale "
                          "after 3 s)", "leave it at 10")
    if spec.heal_live:
        _check_live(spec)
    if spec.max_restarts:
        raise ConfigError(f"--heal with --max-restarts {spec.max_restarts}", "one of them: --heal starts the "
                          "ranks again itself, after classifying each failure", "drop --max-restarts")
    if spec.container_image:
        raise ConfigError("--heal with --container-image", "--heal with a Python on the nodes: its supervisor runs "
                          "in the batch script, outside the image", "drop --container-image, or drop --heal")
    if spec.run_dir is not None and (not spec.run_dir.isprintable() or not spec.run_dir.strip()):
        raise ConfigError(f"--run-dir {spec.run_dir!r}", "a path of printable text", "pass --run-dir runs/job")


def _check_live(spec: JobFields) -> None:
    """``--heal live``: Slurm, ``train`` or a user's script (``ddpkit run`` runs it); each rank an srun step, on each
    spare node a standby for each rank a node holds."""
    if spec.backend not in ("slurm", "k8s"):
        raise ConfigError(f"submit {spec.backend} --heal live", "--heal live with submit slurm (standbys on each "
                          "spare node take a lost node's ranks) or submit k8s (a standby pod); mpirun ends every "
                          "rank when one fails, so submit mpi heals by restarting; on one host: ddpkit train|run -n "
                          "N --heal live", "use submit slurm|k8s --heal live, or --heal (the restart heal)")
    if spec.backend == "k8s" and (spec.shape.is_elastic or spec.k8s_kind != "pytorchjob" or spec.k8s_rdzv != "c10d"):
        raise ConfigError(f"submit k8s --heal live with -j {spec.shape} --k8s-kind {spec.k8s_kind} --k8s-rdzv "
                          f"{spec.k8s_rdzv}", "a fixed shape -j NxP on a PyTorchJob (the defaults): the master pod "
                          "runs the live agent, the --spare-nodes K extra worker pods stand by",
                          "use -j NxP --spare-nodes K with the default --k8s-kind and --k8s-rdzv")
    if spec.command[0] != "train" and not spec.command[0].endswith(".py"):
        raise ConfigError(f"submit {spec.backend} --heal live -- {' '.join(spec.command[:2])}", "-- train ..., or -- "
                          "SCRIPT.py (a script written as docs/heal.md shows: live.Replica; its ranks run under "
                          "ddpkit run)", "use -- train or -- your_script.py, or --heal (the restart heal)")


def check_mpi_heal(spec: JobFields, kept: tuple[str, ...]) -> None:
    """``submit mpi --heal``: the hosts to choose from (beyond -j's N: spares), at least MIN of them."""
    s = spec.shape
    if not spec.hosts:
        raise ConfigError("submit mpi --heal without --hosts", "--hosts naming the hosts to run on (more than -j's "
                          "N: spares)", f"add --hosts with {s.max_nodes} host(s) or more")
    if len(kept) < s.min_nodes:
        left = f" ({len(kept)} left after --exclude-from)" if len(kept) != len(spec.hosts) else ""
        raise ConfigError(f"--hosts names {len(spec.hosts)} host(s){left} but -j {s} needs {s.min_nodes} at least",
                          "at least MIN hosts", "add hosts to --hosts")
    if spec.spare_nodes and spec.spare_nodes != len(kept) - s.max_nodes:
        raise ConfigError(f"submit mpi --spare-nodes {spec.spare_nodes} with {len(kept)} host(s) for -j {s}",
                          "the spares of submit mpi are the --hosts beyond -j's N "
                          f"({max(0, len(kept) - s.max_nodes)} here)",
                          f"leave out --spare-nodes, or list {s.max_nodes + spec.spare_nodes} hosts in --hosts")
