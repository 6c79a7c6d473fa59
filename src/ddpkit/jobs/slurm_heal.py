"""The slurm backend with ``--heal``: an sbatch script whose batch shell runs ddpkit's heal supervisor.

    ddpkit submit slurm -j 2x1 --spare-nodes 1 --heal --wait -- train --epochs 40 --snapshot-path /shared/run/

allocates N+K nodes (``--nodes=3``) and execs ``python -m ddpkit.heal.slurm_supervisor``, which runs each attempt
as an ``srun`` step of one task per rank on N healthy nodes of the allocation (``ddpkit.heal.slurm_step``), takes a
host found bad out for the rest of the job and relaunches from the newest snapshot. ``--no-kill``: a node that fails
does not end the allocation (the supervisor goes on without it). ``--requeue`` and ``--open-mode=append``: with no
spare left and no smaller shape allowed (``-j MIN:N``), the job requeues itself and its log goes on. No torch, no
import of the supervisor: the script names it.
"""

from __future__ import annotations

from ddpkit.jobs import slurm
from ddpkit.jobs.interpreter import job_interpreter
from ddpkit.jobs.rendering import python_argv
from ddpkit.jobs.shell import preamble, wrap
from ddpkit.jobs.spec import JobSpec

__all__ = ["directives", "render"]

SUPERVISOR = "ddpkit.heal.slurm_supervisor"


def directives(spec: JobSpec) -> list[str]:
    """N+K nodes, one task per rank; the allocation outlives a failed node and may requeue itself."""
    s = spec.shape
    return slurm.directives(spec, nodes=str(s.max_nodes + spec.spare_nodes), per_node=s.nproc_per_node,
                            allocation=("--no-kill", "--requeue", "--open-mode=append"))


def render(spec: JobSpec) -> str:
    s = spec.shape
    python = job_interpreter(spec).path
    supervisor = [python, "-m", SUPERVISOR, "--nodes", str(s.max_nodes), "--min-nodes", str(s.min_nodes),
                  "--per-node", str(s.nproc_per_node), "--max-attempts", str(spec.max_attempts),
                  "--silent-after", f"{spec.silent_after:g}", "--requeue"]
    if spec.on_fail == "drain":
        supervisor += ["--on-fail", "drain"]
    if spec.heal_live:
        supervisor += ["--live"]
    if spec.run_dir:
        supervisor += ["--run-dir", spec.run_dir]
    lines = preamble(spec, directives(spec))
    how = "--heal live" if spec.heal_live else "--heal"
    lines += [f'echo "ddpkit: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, healed ({how}), restart '
              '${SLURM_RESTART_COUNT:-0}"',
              f"# ddpkit's supervisor: each attempt an srun step, one task per rank, on {s.nodes_text()} healthy "
              f"node(s) of this allocation ({spec.spare_nodes} spare);",
              "# a host found bad is out for the rest of the job; the ledger is in the run directory.",
              "exec " + wrap([*supervisor, "--", *python_argv(spec, python)]), ""]
    return "\n".join(lines)
