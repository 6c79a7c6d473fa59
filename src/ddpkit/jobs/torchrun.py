"""The torchrun backend: the command to run on every node (c10d rendezvous), as a short bash script; its torchrun
runs under ``ddpkit step`` (a failed job's digest on one screen, the full output in a file).

    ddpkit submit torchrun -j 2x4 --rdzv-endpoint node1:29400 --dry-run -- check   # print it; run it on each node
    ddpkit submit torchrun -j 1x2 -- check                                         # run it here, now

A single node (``-j 1xP``) uses ``--standalone`` (a rendezvous on a free local port). Several nodes share a c10d
rendezvous at ``--rdzv-endpoint`` with one run id, fixed when the script is rendered, so every node that runs the
same script joins the same job (never ``$RANDOM`` per node, which is how the seeds' run ids collide).
``--static``: torch's static rendezvous instead: ``--rdzv-endpoint`` is the master, and each node runs the script
with its own ``NODE_RANK`` (0 on the master's node); no elasticity, no restarts across nodes.
"""

from __future__ import annotations

from ddpkit.base.shape import DEFAULT_RDZV_PORT, split_endpoint
from ddpkit.jobs.interpreter import STEP_NOTE, job_interpreter, step_argv
from ddpkit.jobs.rendering import torchrun_entry
from ddpkit.jobs.shell import Raw, preamble, wrap
from ddpkit.jobs.spec import JobSpec

__all__ = ["render", "torchrun_argv"]

#: torchrun's agent shares one store with its workers by default, which breaks restarts (pytorch/pytorch#135712).
RESTART_FIX = "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"


def launcher(spec: JobSpec) -> list[str]:
    """``torchrun`` from the activated environment, or ``PYTHON -m torch.distributed.run`` when the job's Python is a
    path (the same program, run by that Python; its workers run with it too: torchrun starts them with
    sys.executable)."""
    python = job_interpreter(spec).path
    return ["torchrun"] if python == "python" else [python, "-m", "torch.distributed.run"]


def torchrun_argv(spec: JobSpec, *, endpoint: str | None, run_id: str) -> list[str]:
    """``torchrun`` with the job's shape; ``endpoint`` None means a standalone single-node run."""
    argv = [*launcher(spec), f"--nnodes={spec.nodes_text}", f"--nproc-per-node={spec.shape.nproc_per_node}"]
    if endpoint is None:
        argv.append("--standalone")
    else:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}"]
    argv.append(f"--max-restarts={spec.max_restarts}")
    return argv + torchrun_entry(spec)


def static_argv(spec: JobSpec, endpoint: str) -> list[str]:
    host, port = split_endpoint(endpoint)
    return [*launcher(spec), f"--nnodes={spec.nodes_text}", f"--nproc-per-node={spec.shape.nproc_per_node}",
            Raw('--node-rank="$NODE_RANK"'), f"--master-addr={host}", f"--master-port={port}",
            f"--max-restarts={spec.max_restarts}", *torchrun_entry(spec)]


def _render_static(spec: JobSpec) -> str:
    host, port = split_endpoint(spec.rdzv_endpoint or "127.0.0.1")
    endpoint = f"{host}:{spec.port or port or DEFAULT_RDZV_PORT}"
    last = spec.shape.max_nodes - 1
    node_rank = ('NODE_RANK="${NODE_RANK:-0}"' if last == 0 else
                 f': "${{NODE_RANK:?set NODE_RANK to the index of this node, 0 to {last}}}"')
    lines = preamble(spec)
    lines += ["# Static rendezvous: run this script on every node, NODE_RANK=0 on the master's node, then 1, 2...",
              node_rank, RESTART_FIX, STEP_NOTE, wrap([*step_argv(spec), *static_argv(spec, endpoint)]), ""]
    return "\n".join(lines)


def render(spec: JobSpec) -> str:
    if spec.static:
        return _render_static(spec)
    endpoint = spec.rdzv_endpoint
    if endpoint is not None and spec.port is not None:
        endpoint = f"{endpoint.rpartition(':')[0]}:{spec.port}"
    lines = preamble(spec)
    lines += ["# Run this same script on every node; they meet at the rendezvous and agree on ranks.", RESTART_FIX,
              STEP_NOTE, wrap([*step_argv(spec), *torchrun_argv(spec, endpoint=endpoint,
                                                           run_id=spec.run_id or spec.job_name)]), ""]
    return "\n".join(lines)
