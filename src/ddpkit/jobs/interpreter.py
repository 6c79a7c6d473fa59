"""Which Python runs the job's ranks, why, and what ddpkit can tell about it before the job runs.

With no environment option (``--venv``, ``--conda-env``, a container image), a job on a shared filesystem
(torchrun scripts, Slurm, mpi) runs with the interpreter that submitted it, by absolute path, as submitit and
TorchX's local schedulers do: ``.venv/bin/ddpkit submit ...`` then works without the venv on PATH (calling
``torchrun`` by name failed on every node with ``execve(): torchrun: No such file or directory``). With an
environment, that environment's ``python``; in a container or on Kubernetes, the image's.

Whether the interpreter exists where the job runs can be known only on this host: ddpkit checks that it exists
here and, for jobs that run elsewhere, says when it sits in a node-local place (a temporary directory, tmpfs)
or on a filesystem local to this host; on a network filesystem it says nothing. The generated file's header
always says which interpreter the job expects.
"""

from __future__ import annotations

import os
import shlex
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ddpkit.jobs.fields import JobFields

__all__ = ["STEP_NOTE", "Interpreter", "job_interpreter", "placement_notes", "step_argv"]

#: Filesystem types that every node of a cluster usually mounts at the same path (from /proc/self/mounts).
NETWORK_FILESYSTEMS = ("nfs", "nfs4", "lustre", "gpfs", "cephfs", "ceph", "beegfs", "glusterfs", "fuse.glusterfs",
                       "cifs", "smb3", "panfs", "wekafs", "fuse.sshfs", "afs", "ocfs2", "gfs2", "fuse.juicefs")
_TEMPORARY_FILESYSTEMS = ("tmpfs", "ramfs")


@dataclass(frozen=True)
class Interpreter:
    """The job's Python: a path (or ``python``, looked up in the activated environment) and why."""

    path: str
    """What the job runs: an absolute path, or a name the environment resolves."""
    why: str
    """One sentence for the generated file's header."""
    submitter: bool = False
    """True when this is the interpreter that ran ``ddpkit submit`` (nobody chose it explicitly)."""

    def header_lines(self) -> list[str]:
        lines = [f"# Python: {shlex.quote(self.path)}, {self.why}."]
        if self.submitter:
            lines.append("# Every node that runs the job needs it at this same path (a shared filesystem): else "
                         "pass --venv or --python.")
        return lines


def job_interpreter(spec: JobFields) -> Interpreter:
    """The interpreter the job's ranks run with (see the module docstring)."""
    container = spec.backend == "k8s" or bool(spec.container_image)
    if spec.python:
        where = (" inside the container image" if container else
                 " after activating the environment below" if spec.venv or spec.conda_env else "")
        return Interpreter(spec.python, f"chosen with --python{where}")
    if spec.venv:
        return Interpreter("python", "from the virtual environment activated below (--venv)")
    if spec.conda_env:
        return Interpreter("python", "from the conda environment activated below (--conda-env)")
    if container:
        return Interpreter("python", "from the container image (its interpreter runs every rank)")
    return Interpreter(spec.submitter, "the interpreter that ran ddpkit submit (no --venv, --conda-env or "
                       "container image was given)", submitter=True)


#: The rendered script's comment above a launcher run under ``ddpkit step``.
STEP_NOTE = ("# ddpkit step: the launcher's whole output goes to a .full.log file; a failed run ends with one screen, "
             "cause first.")


def step_argv(spec: JobFields) -> list[str]:
    """``ddpkit step --`` before a rendered torchrun or mpirun: its full output kept in a file, a failed job's
    digest on one screen (``ddpkit.launch.steplog``), as a rendered Slurm job's step has."""
    return [job_interpreter(spec).path, "-m", "ddpkit", "step", "--"]


def runs_elsewhere(spec: JobFields) -> bool:
    """Whether the job (or part of it) may run on another host than this one."""
    if spec.backend == "slurm":
        return True  # the batch script runs on the allocation's first node, rarely the login node
    if spec.backend == "mpi":
        return bool(spec.hosts) or spec.shape.max_nodes > 1
    return spec.shape.max_nodes > 1


def placement_notes(spec: JobFields) -> list[str]:
    """What can be known here about the interpreter on the job's nodes: one line per finding, for stderr."""
    interp = job_interpreter(spec)
    if interp.path == "python" or not os.path.isabs(interp.path) or spec.backend == "k8s" or spec.container_image:
        return []  # the environment or the image provides it: nothing to check from here
    path = interp.path
    if not os.path.exists(path):
        return [f"ddpkit: warning: the job's Python {path} does not exist on this host; the job fails wherever it "
                "is missing (pass --python with a path every node has, or --venv)"]
    if not runs_elsewhere(spec):
        return []
    fstype, mount = filesystem_of(path)
    where = f"{fstype} mounted at {mount}" if fstype else "an unknown filesystem"
    if fstype in _TEMPORARY_FILESYSTEMS or _under_temporary_directory(path):
        return [f"ddpkit: warning: the job's Python {path} is in a temporary directory ({where}), which is usually "
                "local to this host: on other nodes the job fails with 'No such file or directory' unless they "
                "have it at the same path; put the venv on a shared filesystem and pass --venv, or --python"]
    if fstype in NETWORK_FILESYSTEMS:
        return []
    return [f"ddpkit: the job's Python {path} is on {where}, which this host may not share with the job's nodes: "
            "they need it at the same path (the script's header says so too)"]


def filesystem_of(path: str) -> tuple[str, str]:
    """(filesystem type, mount point) of the deepest mount holding ``path``'s directory; ("", "") if unknown."""
    directory = os.path.realpath(os.path.dirname(path))
    best = ("", "")
    try:
        with open("/proc/self/mounts", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                inside = directory == mount or directory.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best[1]):
                    best = (fields[2], mount)
    except OSError:
        return ("", "")
    return best


def _under_temporary_directory(path: str) -> bool:
    real = Path(os.path.realpath(os.path.dirname(path)))
    temporary = {Path(p) for p in ("/tmp", "/var/tmp", "/dev/shm")} | {Path(tempfile.gettempdir()).resolve()}
    return any(real == t or t in real.parents for t in temporary)
