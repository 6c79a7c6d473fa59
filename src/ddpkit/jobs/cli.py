"""Render one job for torchrun, Slurm, mpirun or Kubernetes, and submit it where a scheduler CLI exists.

    ddpkit submit slurm -j 2x4 --venv ~/venvs/ddp --dry-run -- check            # print the sbatch script
    ddpkit submit slurm -j 2x4 --venv ~/venvs/ddp --wait -- train --epochs 20   # sbatch, follow, job's exit code
    ddpkit submit torchrun -j 2x4 --rdzv-endpoint node1:29400 -o run.sh -- check
    ddpkit submit mpi -j 2x4 --hosts node1,node2 -- check
    ddpkit submit k8s -j 2x4 --image registry/ddpkit:cpu --dry-run -- train

Exit codes: 0 submitted (or, with --wait, the job succeeded); the job's own exit code with --wait; 2 bad input
or no scheduler (nothing is submitted); 3 --wait-timeout expired.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from ddpkit.base.errors import ConfigError
from ddpkit.base.inputs import (
    HEAL_SILENT_DEFAULT_S,
    add_heal_flag,
    endpoint,
    output_path,
    program_words,
    seconds,
    shape_text,
)
from ddpkit.base.log import get_logger
from ddpkit.jobs.spec import JobSpec

__all__ = ["add_arguments", "build_spec", "render", "run"]

log = get_logger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("backend", metavar="BACKEND", help="torchrun, slurm, mpi or k8s")
    p.add_argument("-j", "--job", type=shape_text("-j"), required=True, metavar="[MIN:]NNODESxNPROC",
                   help="nodes x ranks per node")
    p.add_argument("--dry-run", action="store_true", help="print what would run or be submitted; submit nothing")
    p.add_argument("-o", "--output-file", type=output_path("-o"), metavar="PATH",
                   help="write the script / manifest to PATH")
    p.add_argument("--name", default="", help="job name (default ddpkit-<command>)")
    p.add_argument("--run-id", default="", help="rendezvous id (default: random for torchrun and k8s, the job id "
                   "under Slurm)")
    p.add_argument("--rdzv-endpoint", type=endpoint("--rdzv-endpoint"), metavar="HOST:PORT",
                   help="torchrun: the first node's rendezvous endpoint")
    p.add_argument("--static", action="store_true", help="torchrun: static rendezvous (NODE_RANK on each node)")
    p.add_argument("--port", type=int, help="rendezvous / master port (default: derived from the Slurm job id; "
                   "29400 torchrun; 29500 MPI)")
    p.add_argument("--max-restarts", type=int, default=0, help="torchrun worker-group restarts")
    p.add_argument("--python", help="interpreter for the ranks (default: python from --venv / --conda-env / the "
                   "image, else the interpreter running ddpkit, by absolute path)")
    p.add_argument("--venv", help="virtual environment to activate first")
    p.add_argument("--conda-env", help="conda environment to activate first")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="variable for the ranks")
    p.add_argument("--exclude-from", metavar="FILE.json", help="keep the hosts a check or bench --json report named "
                   "in bad_hosts out of the job (Slurm --exclude, the mpi host list, a k8s nodeAffinity NotIn)")
    g = p.add_argument_group("slurm")
    g.add_argument("--partition")
    g.add_argument("--time", help="time limit, e.g. 01:00:00")
    g.add_argument("--no-exclusive", action="store_true", help="share nodes (default: --exclusive)")
    g.add_argument("--slurm-output", default="logs/%x_%j.out", metavar="PATTERN", help="sbatch --output pattern")
    g.add_argument("--tasks-per-rank", action="store_true", help="one srun task per rank instead of torchrun per node")
    g.add_argument("--container-image", help="pyxis/enroot image for the step")
    g.add_argument("--container-mounts", help="pyxis mounts SRC:DST[,...]")
    g.add_argument("--signal", help="preemption warning, e.g. USR1@90 (train snapshots on it)")
    g.add_argument("--requeue", action="store_true", help="requeue on preemption; train resumes from its snapshot")
    g.add_argument("--wait", action="store_true", help="follow the job (squeue every 0.5 s); exit with its code")
    g.add_argument("--wait-timeout", type=seconds("--wait-timeout"), default=None, metavar="S",
                   help="give up waiting after S seconds")
    g = p.add_argument_group("heal (slurm, mpi; k8s: --heal live)")
    add_heal_flag(g, "slurm: a supervisor in the batch script runs each attempt as an srun step on healthy nodes "
                     "of the allocation; mpi: a supervisor runs each attempt as an mpirun on healthy hosts of "
                     "--hosts; a host fault takes that host out for the rest of the job and the next attempt "
                     "starts from the newest snapshot; the program's own failure twice in a row ends with exit 93 "
                     "(--heal live: submit slurm -j NxP --spare-nodes K --heal live -- train|SCRIPT.py: a lost "
                     "node's ranks are replaced by the standbys of a spare node, the others keep their processes; "
                     "submit k8s -j NxP --spare-nodes K --heal live: ddpkit's agent in every pod, K standby pods)")
    g.add_argument("--spare-nodes", type=int, default=0, metavar="K",
                   help="with --heal: slurm allocates K nodes beyond N, taken when a host is found bad (mpi: the "
                        "--hosts beyond N are the spares; k8s --heal live: K standby worker pods)")
    g.add_argument("--max-attempts", type=int, default=3, metavar="N",
                   help="with --heal: attempts at most in one allocation, the first included (default 3)")
    g.add_argument("--on-fail", choices=("report", "drain"), default="report",
                   help="with --heal: drain also drains a host found bad, with the reason (scontrol)")
    g.add_argument("--run-dir", default=None, metavar="PATH",
                   help="with --heal: the run directory (ledger.jsonl, goodput.jsonl); default "
                        ".ddpkit-runs/slurm-JOBID in the directory the job runs in")
    g.add_argument("--silent-after", type=seconds("--silent-after"), default=HEAL_SILENT_DEFAULT_S, metavar="S",
                   help="with --heal: a rank without a heartbeat this long is a lost host: every rank stops and "
                        "the supervisor relaunches without it (default %(default)g)")
    g = p.add_argument_group("mpi")
    g.add_argument("--mpi", default="openmpi", choices=["openmpi", "mpich"], dest="mpi_flavour")
    g.add_argument("--hosts", default="", help="comma-separated hosts, the first runs rank 0")
    g.add_argument("--allow-run-as-root", action="store_true", help="Open MPI: allow running as root")
    g = p.add_argument_group("k8s")
    g.add_argument("--image", help="container image")
    g.add_argument("--k8s-kind", default="pytorchjob", help="pytorchjob (Kubeflow v1) or trainjob (Trainer v2)")
    g.add_argument("--k8s-rdzv", default="c10d", help="c10d, or etcd (adds an etcd Deployment and Service)")
    g.add_argument("--namespace")
    g.add_argument("--cpu", default="2")
    g.add_argument("--memory", default="4Gi")
    g.add_argument("--gpus", type=int, default=0)
    g.add_argument("--snapshot-size", default="10Gi", help="shared snapshot PVC size (train)")
    p.add_argument("job_command", nargs="+", metavar="-- COMMAND", help="the job: check, train ..., or script.py ...")


def build_spec(args: argparse.Namespace, argv: list[str]) -> JobSpec:
    from ddpkit.base.shape import parse_job_shape

    command = program_words(args.job_command)
    env = []
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--env {item!r}", "NAME=VALUE", "write --env NCCL_DEBUG=INFO")
        env.append((key, value))
    run_id = args.run_id or (f"ddpkit-{uuid.uuid4().hex[:8]}" if args.backend != "slurm" else "")
    exclude: tuple[str, ...] = ()
    if args.exclude_from:
        from ddpkit.jobs.exclude import bad_host_names

        exclude = bad_host_names(args.exclude_from, backend=args.backend)
    return JobSpec(
        backend=args.backend, shape=parse_job_shape(args.job), command=tuple(command), argv=tuple(argv),
        name=args.name, run_id=run_id, rdzv_endpoint=args.rdzv_endpoint, static=args.static, port=args.port,
        max_restarts=args.max_restarts, python=args.python, venv=args.venv, conda_env=args.conda_env,
        env=tuple(env), partition=args.partition, time=args.time, exclusive=not args.no_exclusive,
        output=args.slurm_output, tasks_per_rank=args.tasks_per_rank, container_image=args.container_image,
        container_mounts=args.container_mounts, signal=args.signal, requeue=args.requeue,
        mpi_flavour=args.mpi_flavour, hosts=tuple(h for h in args.hosts.split(",") if h),
        allow_run_as_root=args.allow_run_as_root, image=args.image, k8s_kind=args.k8s_kind, k8s_rdzv=args.k8s_rdzv,
        namespace=args.namespace, cpu=args.cpu, memory=args.memory, gpus=args.gpus, snapshot_size=args.snapshot_size,
        exclude=exclude, heal=args.heal is not None, heal_live=args.heal == "live", spare_nodes=args.spare_nodes,
        max_attempts=args.max_attempts, on_fail=args.on_fail, run_dir=args.run_dir, silent_after=args.silent_after,
    )


def render(spec: JobSpec) -> str:
    """The artifact for the spec's backend (registry with lazy imports: yaml only for k8s)."""
    import importlib

    healed = spec.heal and spec.backend == "slurm"  # mpi --heal: jobs.mpi renders its supervisor's script
    module = importlib.import_module("ddpkit.jobs.slurm_heal" if healed else f"ddpkit.jobs.{spec.backend}")
    return str(module.render(spec))


def run(args: argparse.Namespace) -> int:
    argv = list(getattr(args, "ddpkit_argv", None) or _argv())
    if args.wait and args.backend != "slurm":
        raise ConfigError(f"--wait with the {args.backend} backend", "--wait only with slurm (torchrun and mpi "
                          "run in the foreground already)", "drop --wait")
    spec = build_spec(args, argv)
    text = render(spec)
    output_file = Path(args.output_file).expanduser() if args.output_file is not None else None
    if output_file is not None:
        output_file.parent.mkdir(parents=True, exist_ok=True)
        # newline="": a carriage return in a job argument stays one (it is inside a quoted word)
        with output_file.open("w", newline="") as f:
            f.write(text)
        if spec.backend != "k8s":
            output_file.chmod(0o755)
        print(f"ddpkit: wrote {output_file}", file=sys.stderr)
    if args.dry_run:
        sys.stdout.write(text)
        return 0
    from ddpkit.jobs.interpreter import placement_notes

    for note in placement_notes(spec):  # what can be known here about the job's Python on its nodes
        print(note, file=sys.stderr, flush=True)
    if spec.backend == "slurm":
        return _submit_slurm(spec, text, args, output_file)
    if spec.backend == "k8s":
        return _apply_k8s(text)
    return _run_here(text, output_file)


def _argv() -> list[str]:
    argv = sys.argv[1:]
    return argv if "submit" in argv else ["submit", "..."]


def _submit_slurm(spec: JobSpec, text: str, args: argparse.Namespace, output_file: Path | None) -> int:
    from ddpkit.jobs import slurmctl

    out_dir = Path(spec.output).parent
    if "%" not in str(out_dir):
        out_dir.mkdir(parents=True, exist_ok=True)  # Slurm does not create it: the job would fail silently
    job_id = slurmctl.sbatch(text, cwd=Path.cwd(), script_path=output_file)
    print(job_id, flush=True)
    if not args.wait:
        return 0
    final = slurmctl.wait(job_id, timeout=args.wait_timeout,
                          on_change=lambda now: print(f"ddpkit: job {job_id} {now}", file=sys.stderr, flush=True))
    code = slurmctl.job_exit_code(final)
    print(f"ddpkit: job {job_id} {final.state} exit code {code} (restarts {final.restarts}); log {final.stdout}",
          file=sys.stderr)
    return code


def _apply_k8s(text: str) -> int:
    import shutil

    if shutil.which("kubectl") is None:
        raise ConfigError("kubectl is not on PATH, so nothing was applied", "kubectl configured for the cluster",
                          "write the manifest with --dry-run -o job.yaml and run kubectl apply -f job.yaml where "
                          "kubectl works")
    return subprocess.run(["kubectl", "apply", "-f", "-"], input=text, text=True, check=False).returncode


def _run_here(text: str, path: Path | None) -> int:
    """torchrun / mpi: run the rendered script on this node, in the foreground; its exit code is ours."""
    if path is not None:
        return subprocess.run(["bash", str(path)], check=False).returncode
    with tempfile.NamedTemporaryFile("w", suffix=".sh", prefix="ddpkit-job-", delete=False) as f:
        f.write(text)
    try:
        return subprocess.run(["bash", f.name], check=False, env=os.environ.copy()).returncode
    finally:
        os.unlink(f.name)
