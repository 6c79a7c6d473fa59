"""A job, field by field: ``JobFields``, which ``ddpkit.jobs.spec.JobSpec`` extends with the rules that validate it on
construction. The fields stand in a base of their own so that the spec and the rules it applies
(``jobs.heal_options``, ``jobs.interpreter``), which read them, do not import each other; a job is built as a
``JobSpec``, never as a bare ``JobFields``."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from ddpkit.base.inputs import HEAL_SILENT_DEFAULT_S
from ddpkit.base.shape import JobShape

__all__ = ["JobFields"]


@dataclass(frozen=True, kw_only=True)
class JobFields:
    """What a distributed job is, independent of where it runs (``JobSpec`` checks it)."""

    backend: str
    """Where it runs: torchrun, slurm, mpi or k8s."""
    shape: JobShape
    """Nodes (elastic between min and max where the backend allows) and ranks per node."""
    command: tuple[str, ...]
    """The job: a ddpkit command with its options (``check``, ``train --epochs 3``) or ``script.py ARGS``."""
    argv: tuple[str, ...] = ()
    """The ddpkit command line that produced this spec, quoted into every generated file's header."""
    name: str = ""
    """Job name (Slurm job name, Kubernetes object name); default ``ddpkit-<command>``."""
    run_id: str = ""
    """Rendezvous id shared by every node (torchrun, k8s); Slurm uses the job id."""
    rdzv_endpoint: str | None = None
    """HOST:PORT of the rendezvous for the torchrun backend (required for several nodes)."""
    static: bool = False
    """torchrun: static rendezvous (master address and port, NODE_RANK set on each node) instead of c10d."""
    port: int | None = None
    """Rendezvous / master port; default: derived from the Slurm job id, 29400 (torchrun), 29500 (MPI)."""
    max_restarts: int = 0
    """Worker-group restarts torchrun allows after a failure."""
    python: str | None = None
    """Interpreter that runs the ranks (``--python``). None: ``python`` from the environment or image when one is
    given (``--venv``, ``--conda-env``, a container image, k8s), else ``submitter`` (ddpkit.jobs.interpreter)."""
    submitter: str = field(default_factory=lambda: os.path.abspath(sys.executable) if sys.executable else "")
    """The interpreter that renders and submits the job: with no environment option the ranks run with it, by
    absolute path, so a venv that is not on PATH still runs the job. An input, so that rendering is reproducible."""
    venv: str | None = None
    """A virtual environment to activate before the job runs (``source VENV/bin/activate``)."""
    conda_env: str | None = None
    """A conda environment to activate before the job runs."""
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment variables for the ranks."""
    # Slurm
    partition: str | None = None
    """Slurm partition."""
    time: str | None = None
    """Slurm time limit (``MM``, ``HH:MM:SS``, ``D-HH``)."""
    exclusive: bool = True
    """Whole nodes (``--exclusive``), as the seeds do."""
    output: str = "logs/%x_%j.out"
    """Slurm output file pattern; its directory is created before sbatch runs."""
    tasks_per_rank: bool = False
    """Slurm: one srun task per rank (ddpkit reads Slurm's variables) instead of one torchrun agent per node."""
    container_image: str | None = None
    """pyxis/enroot container image for the srun step (``--container-image``)."""
    container_mounts: str | None = None
    """pyxis mounts, ``SRC:DST[,SRC:DST]``."""
    signal: str | None = None
    """Preemption warning signal, ``USR1@90``: Slurm sends it 90 s before the end; ``train`` snapshots on it."""
    requeue: bool = False
    """Slurm: the job may be requeued (preemption); a requeued ``train`` resumes from its snapshot."""
    # MPI
    mpi_flavour: str = "openmpi"
    """openmpi (mpirun) or mpich (mpiexec.mpich)."""
    hosts: tuple[str, ...] = ()
    """MPI hosts, first one runs rank 0 (default: this host only)."""
    allow_run_as_root: bool = False
    """Open MPI refuses to run as root unless told."""
    # Kubernetes
    image: str | None = None
    """Container image for Kubernetes."""
    k8s_kind: str = "pytorchjob"
    """pytorchjob (Kubeflow training-operator v1) or trainjob (Kubeflow Trainer v2)."""
    k8s_rdzv: str = "c10d"
    """PyTorchJob rendezvous: c10d (on worker 0) or etcd (an etcd Deployment and Service, etcd-v2 protocol)."""
    namespace: str | None = None
    """Kubernetes namespace."""
    cpu: str = "2"
    """CPU request (and limit) per pod."""
    memory: str = "4Gi"
    """Memory request (and limit) per pod."""
    gpus: int = 0
    """GPUs per pod (``nvidia.com/gpu``)."""
    snapshot_size: str = "10Gi"
    """Size of the shared snapshot volume (PVC, ReadWriteMany)."""
    exclude: tuple[str, ...] = ()
    """Hosts kept out of the job (``--exclude-from``, a report's bad hosts): Slurm node names for slurm."""
    # Healing (issue 38)
    heal: bool = False
    """Slurm: a supervisor in the batch script runs each attempt as an srun step on healthy nodes of the allocation
    and relaunches after a host fault without the bad host (``ddpkit.heal.slurm_supervisor``)."""
    heal_live: bool = False
    """``--heal live`` (Slurm): a lost node's ranks replaced within the attempt by the standbys of a spare node, the
    others keeping their processes (``ddpkit.live.agent.slurm``); else the restart heal."""
    spare_nodes: int = 0
    """With ``heal``: nodes allocated beyond the job's N, taken when a host is found bad."""
    max_attempts: int = 3
    """With ``heal``: attempts at most in one allocation, the first included."""
    on_fail: str = "report"
    """With ``heal``: ``drain`` also drains a host found bad (``scontrol update ... state=drain reason=...``)."""
    run_dir: str | None = None
    """With ``heal``: the run directory (ledger, goodput); default ``.ddpkit-runs/slurm-JOBID`` in the job's cwd."""
    silent_after: float = HEAL_SILENT_DEFAULT_S
    """With ``heal``: seconds without a heartbeat after which a rank's host is lost (the watch's ``silent_stop``)."""
