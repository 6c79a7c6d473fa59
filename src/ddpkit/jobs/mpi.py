"""The mpi backend: an ``mpirun`` (Open MPI) or ``mpiexec.mpich`` (MPICH) script that also gives the master.

MPI starts every rank and tells it its rank and size, but no launcher sets a master address: ranks started by
mpirun alone cannot meet (seed 004 worked around it in bash). The script exports MASTER_ADDR (the first host,
which runs rank 0 with by-node placement; 127.0.0.1 on one node) and MASTER_PORT, and forwards them to every
rank; ddpkit's Open MPI / MPICH detection does the rest. Ranks are not bound to one core (``--bind-to none``):
each rank runs several torch threads.

    ddpkit submit mpi -j 2x4 --hosts node1,node2 --dry-run -- check
    ddpkit submit mpi -j 1x2 --allow-run-as-root -- check         # runs it here, now
    ddpkit submit mpi -j 2:2x4 --hosts node1,node2,node3 --heal -- train --snapshot-path /shared/snap.pt

With ``--heal`` the script runs ``python -m ddpkit.heal.mpi`` with the same command line: each attempt is this
module's script for N healthy hosts of ``--hosts`` (the rest are spares), a host-class failure's host is left out
of every later attempt, and with no spare left the job shrinks down to MIN (``-j MIN:N``) or stops (exit 94).
"""

from __future__ import annotations

from ddpkit.jobs.interpreter import STEP_NOTE, job_interpreter, step_argv
from ddpkit.jobs.rendering import python_argv
from ddpkit.jobs.shell import Raw, preamble, wrap
from ddpkit.jobs.spec import JobSpec

__all__ = ["master_address", "render"]


def master_address(spec: JobSpec) -> str:
    if spec.kept_hosts:
        return spec.kept_hosts[0]
    return "127.0.0.1" if spec.shape.max_nodes == 1 else "$(hostname)"


def render(spec: JobSpec, *, step: bool = True) -> str:
    """The job's script. ``step``: Open MPI's mpirun under ``ddpkit step`` (its screen and digest); the heal
    supervisor's attempts (``heal.mpi``) read mpirun's tagged lines themselves and show them through the same screen."""
    if spec.heal:
        return _render_heal(spec)
    s = spec.shape
    total = s.max_nodes * s.nproc_per_node
    port = str(spec.port or 29500)
    addr = master_address(spec)
    lines = preamble(spec)
    if spec.exclude:
        lines.append(f"# Left out (--exclude-from: a report's bad hosts, or those a heal run took out): "
                     f"{', '.join(spec.exclude)}")
    lines += ["# MPI gives each rank its rank and size but no master: rank 0's host and a port, for every rank."]
    if addr == "$(hostname)":
        lines.append("# No --hosts given: mpirun's own host (the allocation's first) runs rank 0.")
        lines.append('MASTER_ADDR="$(hostname)"')
    else:
        lines.append(f"MASTER_ADDR={wrap([addr])}")
    lines += [f"MASTER_PORT={port}", "export MASTER_ADDR MASTER_PORT"]
    if spec.mpi_flavour == "openmpi":
        argv: list[str] = ["mpirun", "-np", str(total), "--map-by", f"ppr:{s.nproc_per_node}:node",
                           "--bind-to", "none"]
        if spec.hosts:
            argv += ["--host", ",".join(f"{h}:{s.nproc_per_node}" for h in spec.kept_hosts)]
        if spec.allow_run_as_root:
            argv.append("--allow-run-as-root")
        for var in ("MASTER_ADDR", "MASTER_PORT", "PATH", *(k for k, _ in spec.env)):
            argv += ["-x", var]
        argv.append("--tag-output")  # each rank's lines tagged with its rank: digested
    else:
        argv = ["mpiexec.mpich", "-n", str(total), "-ppn", str(s.nproc_per_node)]
        if spec.hosts:
            argv += ["-hosts", ",".join(spec.kept_hosts)]
        argv += ["-genv", "MASTER_ADDR", Raw('"$MASTER_ADDR"'), "-genv", "MASTER_PORT", Raw('"$MASTER_PORT"'),
                 "-prepend-rank"]
    if step:
        argv = [*step_argv(spec), *argv]
        lines.append(STEP_NOTE)
    lines += [wrap([*argv, *python_argv(spec)]), ""]
    return "\n".join(lines)


def _render_heal(spec: JobSpec) -> str:
    """The supervisor's script: ``python -m ddpkit.heal.mpi`` with this command line (less what only renders)."""
    words, skip = [], False
    for word in spec.argv:
        if skip:
            skip = False
            continue
        if word in ("-o", "--output-file"):
            skip = True
            continue
        if word == "--dry-run" or word.startswith(("--output-file=", "-o=")):
            continue
        words.append(word)
    if "submit" in words:
        words = words[words.index("submit"):]
    spares = len(spec.kept_hosts) - spec.shape.max_nodes
    lines = preamble(spec)
    lines += [f"# --heal: each attempt one mpirun on {spec.shape.max_nodes} healthy host(s) of "
              f"{', '.join(spec.kept_hosts)} ({max(0, spares)} spare(s); down to {spec.shape.min_nodes} when none is "
              "left);",
              "# a host-class failure's host is left out of every later attempt (ddpkit.heal.mpi; the ledger is in "
              "the run directory)",
              wrap(["exec", job_interpreter(spec).path, "-m", "ddpkit.heal.mpi", *words]), ""]
    return "\n".join(lines)
