"""The torchrun backend: the command to run on every node (c10d rendezvous), as a short bash script.

    ddpkit submit torchrun -j 2x4 --rdzv-endpoint node1:29400 --dry-run -- check   # print it; run it on each node
    ddpkit submit torchrun -j 1x2 -- check                                         # run it here, now

A single node (``-j 1xP``) uses ``--standalone`` (a rendezvous on a free local port). Several nodes share a c10d
rendezvous at ``--rdzv-endpoint`` with one run id, fixed when the script is rendered, so every node that runs the
same script joins the same job (never ``$RANDOM`` per node, which is how the seeds' run ids collide).
"""

from __future__ import annotations

from ddpkit.jobs.shell import preamble, wrap
from ddpkit.jobs.spec import JobSpec, torchrun_entry

__all__ = ["render", "torchrun_argv"]

#: torchrun's agent shares one store with its workers by default, which breaks restarts (pytorch/pytorch#135712).
RESTART_FIX = "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"


def torchrun_argv(spec: JobSpec, *, endpoint: str | None, run_id: str) -> list[str]:
    """``torchrun`` with the job's shape; ``endpoint`` None means a standalone single-node run."""
    argv = ["torchrun", f"--nnodes={spec.nodes_text}", f"--nproc-per-node={spec.shape.nproc_per_node}"]
    if endpoint is None:
        argv.append("--standalone")
    else:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}"]
    argv.append(f"--max-restarts={spec.max_restarts}")
    return argv + torchrun_entry(spec)


def render(spec: JobSpec) -> str:
    endpoint = spec.rdzv_endpoint
    if endpoint is None and spec.shape.max_nodes > 1:  # pragma: no cover (JobSpec rejects it)
        raise AssertionError("multi-node torchrun without an endpoint")
    if endpoint is not None and spec.port is not None:
        endpoint = f"{endpoint.rpartition(':')[0]}:{spec.port}"
    lines = preamble(spec)
    lines += ["# Run this same script on every node; they meet at the rendezvous and agree on ranks.", RESTART_FIX,
              wrap(torchrun_argv(spec, endpoint=endpoint, run_id=spec.run_id or spec.job_name)), ""]
    return "\n".join(lines)
