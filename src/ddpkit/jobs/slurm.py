"""The slurm backend: an sbatch script.

Two shapes of step, both launched by one ``srun``:

- default, the seeds' pattern: one task per node running a torchrun agent (``srun torchrun`` needs exactly one
  task per node). The rendezvous is on the allocation's first node, named by Slurm's own hostlist parser
  (``scontrol show hostnames``, never a regex), on a port derived from the job id (``20000 + id % 10000``,
  ddpkit.base.ports.derive_port), with the job id as the rendezvous id. torch's c10d rendezvous recognises its
  own host by name, so the first node's agent hosts the store. Ranks are torchrun's: elastic shapes and
  ``--max-restarts`` work.
- ``--tasks-per-rank``: one srun task per rank, no agent; each rank is ``python -m ddpkit ...``, whose Slurm
  detection (ddpkit.env.slurm) reads rank, world and the first node of the node list from Slurm's variables and
  derives the same port from the job id. No bash parsing at all.

Why not ``srun --ntasks-per-node=1 python -m ddpkit CMD -j NxP``: under srun ddpkit (rightly) takes the srun task
for a rank and ignores ``-j``, so one task per node would make a world of N ranks, not N x P. torchrun is the
agent that turns one task per node into P ranks, and ddpkit's detection already understands ``srun torchrun``
(it checks there is one task per node).

MPI (``train --grad-transport mpi``, ``bench --transport mpi``, with ``--tasks-per-rank``): srun itself makes its
tasks one MPI world through Slurm's PMI plugin: ``--mpi=pmix`` for Open MPI, ``--mpi=pmi2`` for MPICH (``--mpi
mpich``). With the wrong plugin every task is an MPI world of one (ddpkit then refuses to start, exit 2).

Preemption: ``--signal USR1@90`` makes Slurm signal every process of the step 90 s before the time limit;
``train`` gets ``--preempt-signal USR1`` (and ``--requeue`` with ``--requeue``), snapshots and exits 75. The
torchrun agent ignores that signal (a USR1 would kill it, and with it the step, before the workers saved).
``scontrol requeue`` sends SIGTERM, which the agent forwards and ``train`` always handles. With ``--requeue`` the
output is opened in append mode, so the requeued run's log follows the first run's.

The job's output is what a user reads: the step runs under ``ddpkit step`` (``ddpkit.launch.steplog``), which keeps
every line srun writes (``--label``: the task) in ``NAME_ID.full.log`` beside the output and shows the rest without
torch's C++ frames, repeated store warnings and the agents' ``ChildFailedError`` boxes; a failed step ends with its
digest, cause first. Not under ``--container-image``: the batch script runs outside the image, where ddpkit may not be.
"""

from __future__ import annotations

from ddpkit.base.ports import derive_port_shell
from ddpkit.jobs.interpreter import job_interpreter
from ddpkit.jobs.rendering import python_argv
from ddpkit.jobs.shell import Raw, preamble, wrap
from ddpkit.jobs.spec import DDPKIT_COMMANDS, JobSpec, asks_for_mpi
from ddpkit.jobs.torchrun import RESTART_FIX, torchrun_argv

__all__ = ["render"]


def directives(spec: JobSpec, *, nodes: str | None = None, per_node: int | None = None,
               allocation: tuple[str, ...] = ()) -> list[str]:
    """The ``#SBATCH`` lines: ``nodes`` and ``per_node`` as the spec asks unless given (the heal supervisor's
    allocation has its spares and one task per rank); ``allocation``: how the allocation itself behaves
    (``--no-kill``, ``--requeue``), after ``--wait-all-nodes``."""
    s = spec.shape
    nodes = nodes or s.nodes_text("-")
    if per_node is None:
        per_node = s.nproc_per_node if spec.tasks_per_rank else 1
    d = [f"--job-name={spec.job_name}", f"--nodes={nodes}", f"--ntasks-per-node={per_node}"]
    if spec.exclusive:
        d.append("--exclusive")
    d += ["--wait-all-nodes=1", *allocation, f"--output={spec.output}"]
    if spec.partition:
        d.append(f"--partition={spec.partition}")
    if spec.time:
        d.append(f"--time={spec.time}")
    if spec.signal:
        d.append(f"--signal={spec.signal}")
    if spec.requeue and "--requeue" not in allocation:
        d += ["--requeue", "--open-mode=append"]
    if spec.exclude:  # the hosts a check or bench report named bad (--exclude-from)
        d.append(f"--exclude={','.join(spec.exclude)}")
    return [f"#SBATCH {x}" for x in d]


def _srun(spec: JobSpec) -> list[str]:
    argv: list[str] = ["srun", f"--ntasks-per-node={spec.shape.nproc_per_node if spec.tasks_per_rank else 1}",
                       "--kill-on-bad-exit=1"]
    if not spec.container_image:  # ddpkit step reads the task of each line
        argv = [job_interpreter(spec).path, "-m", "ddpkit", "step", "--", *argv, "--label"]
    # Slurm's MPI guide (slurm.schedmd.com/mpi_guide.html): PMIx for Open MPI, PMI-2 for MPICH
    if asks_for_mpi(spec.command):
        argv.append("--mpi=pmix" if spec.mpi_flavour == "openmpi" else "--mpi=pmi2")
    if spec.container_image:
        argv.append(f"--container-image={spec.container_image}")
        if spec.container_mounts:
            argv.append(f"--container-mounts={spec.container_mounts}")
        argv.append(Raw('--container-workdir="$PWD"'))
    return argv


def render(spec: JobSpec) -> str:
    lines = preamble(spec, directives(spec))
    srun = _srun(spec)
    if spec.tasks_per_rank:
        lines += ['echo "ddpkit: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, one task per rank, restart '
                  '${SLURM_RESTART_COUNT:-0}"',
                  "# Each task is a rank: ddpkit reads SLURM_PROCID, SLURM_NTASKS and the node list itself"
                  + ("." if spec.command[0] in DDPKIT_COMMANDS else
                     " (ddpkit run hands them to the script as torch's RANK, WORLD_SIZE, ...)."),
                  wrap([*srun, *python_argv(spec)]), ""]
        return "\n".join(lines)
    port = str(spec.port) if spec.port else derive_port_shell("SLURM_JOB_ID")
    lines += ["# Rendezvous on the allocation's first node (Slurm's own hostlist parser), port from the job id.",
              'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              f"rdzv_port={port}",
              RESTART_FIX,
              'echo "ddpkit: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, rendezvous $head_node:$rdzv_port, restart '
              '${SLURM_RESTART_COUNT:-0}"',
              "# One task per node, each a torchrun agent starting this node's ranks."]
    agent = torchrun_argv(spec, endpoint='"$head_node:$rdzv_port"', run_id='"$SLURM_JOB_ID"')
    agent = [Raw(w) if w.startswith(("--rdzv-endpoint=", "--rdzv-id=")) else w for w in agent]
    if spec.signal_name:
        lines.append(f"# The agent ignores SIG{spec.signal_name} (its default action: die); the workers handle it.")
        guard = f'trap "" {spec.signal_name}; exec "$@"'
        lines.append(wrap([*srun, "bash", "-c", guard, "torchrun-agent", *agent]))
    else:
        lines.append(wrap([*srun, *agent]))
    lines.append("")
    return "\n".join(lines)

