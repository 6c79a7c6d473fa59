"""ddpkit's command line: argv -> options -> the command; errors -> exit codes; logging configured once.

Exit codes: 0 success; 1 a check failed; 2 usage or environment error; 3 ranks missing or a deadline expired;
74 a snapshot did not fit on its filesystem; 75 stopped by a preemption signal after saving; 76 preempted with no
snapshot; 130 interrupted (the README's table is the reference).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import math
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from types import ModuleType
from typing import TYPE_CHECKING, NoReturn

from ddpkit import __version__
from ddpkit.errors import EXIT_USAGE, ConfigError, DdpkitError
from ddpkit.inputs import check_local_ranks, endpoint, local_ranks, shape_text
from ddpkit.log import configure, get_logger

if TYPE_CHECKING:
    from ddpkit.env import WorldInfo
    from ddpkit.launch.agent import LaunchOptions

__all__ = ["main", "program"]

log = get_logger(__name__)

# name -> (module, one-line help). Modules load lazily so `ddpkit env` never imports torch.
# A module provides add_arguments(parser), run(args) -> int, and WORKER = True when it runs on every rank.
COMMANDS: dict[str, tuple[str, str]] = {
    "env": ("ddpkit.env.cli", "show who this process is, in which world, and from which launcher"),
    "check": ("ddpkit.check", "prove the cluster is ready for PyTorch distributed, and name what is broken"),
    "submit": ("ddpkit.jobs.cli", "render a job for torchrun, slurm, mpi or k8s, and submit it"),
    "status": ("ddpkit.jobs.status", "show a Slurm job's state and exit code"),
    "logs": ("ddpkit.jobs.logs", "print (or follow, -f) a Slurm job's output"),
    "recipe": ("ddpkit.jobs.recipe", "an environment for the cluster: venv, conda, docker or enroot"),
    "bench": ("ddpkit.bench.cli", "benchmark every collective (nccl-tests conventions), verified, gated; --pairs"),
    "report": ("ddpkit.report", "render check and bench JSON files into one Markdown report with plots"),
    "train": ("ddpkit.train.cli", "the reference DDP job: trains, snapshots safely, resumes exactly, survives faults"),
}


def _load(name: str) -> ModuleType:
    return importlib.import_module(COMMANDS[name][0])


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        raise ConfigError(message, f"valid options for '{self.prog}'", f"see '{self.prog} --help'")


def add_worker_arguments(p: argparse.ArgumentParser) -> None:
    """Options every rank-running command shares: how to start ranks where no launcher did."""
    g = p.add_argument_group("launch (used only where no launcher started ddpkit)")
    g.add_argument("-n", "--nproc-per-node", type=local_ranks("-n"), default=None, metavar="N",
                   help="start N local ranks through torch's elastic launcher (default 1: run in this process)")
    g.add_argument("-j", "--job", type=shape_text("-j"), default=None, metavar="[MIN:]NNODESxNPROC",
                   help="nodes x ranks per node, as in TorchX; several nodes need --rdzv-endpoint")
    g.add_argument("--rdzv-endpoint", type=endpoint("--rdzv-endpoint"), default=None, metavar="HOST:PORT",
                   help="c10d rendezvous of a multi-node run")
    g.add_argument("--rdzv-backend", default="c10d", choices=["c10d", "etcd-v2", "etcd", "static"])
    g.add_argument("--rdzv-conf", action="append", default=[], metavar="KEY=VALUE",
                   help="extra rendezvous setting, repeatable (is_host=true, last_call_timeout=3)")
    g.add_argument("--run-id", default=None, help="rendezvous id shared by every node (default: random)")
    g.add_argument("--local-addr", default=None, help="this node's address as the other nodes reach it")
    g.add_argument("--max-restarts", type=int, default=0, metavar="N",
                   help="restart the local worker group up to N times after a failure")
    p.add_argument("--backend", default=None, help="process-group backend (default: nccl with CUDA, else gloo)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ddpkit", description="Prove a cluster runs PyTorch DistributedDataParallel.")
    parser.add_argument("--version", action="version", version=f"ddpkit {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name, (_, help_text) in COMMANDS.items():
        module = _load(name)
        p = sub.add_parser(name, help=help_text, description=(module.__doc__ or help_text).strip().split("\n")[0])
        module.add_arguments(p)
        if getattr(module, "WORKER", False):
            add_worker_arguments(p)
    return parser


def _launch_options(args: argparse.Namespace) -> LaunchOptions:
    from ddpkit.launch.agent import LaunchOptions
    from ddpkit.launch.shape import JobShape, parse_job_shape

    if args.job and args.nproc_per_node:
        raise ConfigError("both -n and -j were given", "one of them", "use -j NNODESxNPROC alone")
    shape = parse_job_shape(args.job) if args.job else JobShape(min_nodes=1, max_nodes=1,
                                                                nproc_per_node=args.nproc_per_node or 1)
    check_local_ranks(shape.nproc_per_node, "-j" if args.job else "-n")
    if shape.max_nodes > 1 and not args.rdzv_endpoint:
        raise ConfigError(f"-j {args.job} spans several nodes but no --rdzv-endpoint was given",
                          "HOST:PORT of the rendezvous on the first node",
                          "add --rdzv-endpoint FIRST_NODE:29400 on every node")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts {args.max_restarts}", "0 or more", "pass --max-restarts 0 or more")
    conf = []
    for item in args.rdzv_conf:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--rdzv-conf {item!r}", "KEY=VALUE", "write --rdzv-conf is_host=true")
        conf.append((key, value))
    options = LaunchOptions(shape=shape, rdzv_endpoint=args.rdzv_endpoint, rdzv_backend=args.rdzv_backend,
                            rdzv_conf=tuple(conf), run_id=args.run_id, max_restarts=args.max_restarts,
                            local_addr=args.local_addr)
    collective = getattr(args, "collective_timeout", None)
    if collective:
        # a lost link is given up by the rendezvous store's reads no sooner than by the collectives (plus the
        # workers' probe and a margin for the link to return before a restart: ddpkit.launch.stops)
        options = replace(options, store_timeout=math.ceil(collective) + 60)
    if shape.max_nodes > 1 and getattr(args, "timeout", None):
        # a command's --timeout (seconds to wait for every rank) bounds the node rendezvous too
        options = replace(options, rdzv_timeout=max(1, math.ceil(args.timeout)))
    return options


def _run_worker(module: ModuleType, args: argparse.Namespace, argv: list[str]) -> int:
    from ddpkit.env import detect
    from ddpkit.launch import worker

    world = detect()
    if world.is_agent:  # a Kubeflow pod asked for several processes: be its agent, as torchrun would be
        return _launch(argv, _kubeflow_agent_options(world))
    if world.launcher == "none":
        options = _launch_options(args)
        if options.shape.max_nodes * options.shape.nproc_per_node > 1:
            return _launch(argv, replace(options, preload=tuple(getattr(module, "PRELOAD", ()))))
    elif (args.nproc_per_node or args.job) and worker.LAUNCHED not in os.environ:
        log.warning("started by %s: -n/-j are ignored (the launcher decides the ranks)", world.launcher)
    if world.launcher == "torchrun" and worker.launched_by_ddpkit():
        from ddpkit.launch.worker import die_with_agent, verdict_exit_code

        die_with_agent()  # a worker of ddpkit's own launcher: never outlive the agent
        if getattr(module, "VERDICT", False):
            code = int(module.run(args))
            _linger()
            return verdict_exit_code(code)
    return int(module.run(args))


def _linger() -> None:
    """Test hook (DDPKIT_FAULTS="linger:rank=R:ms=N"): rank R finishes N ms after the others, as a rank on a slower
    node does."""
    from ddpkit.fault_injection import fault

    linger = fault("linger", rank=int(os.environ.get("RANK", "0")))
    if linger is not None:
        time.sleep(float(linger.get("ms", 2000)) / 1e3)


def _kubeflow_agent_options(world: WorldInfo) -> LaunchOptions:
    """The pod's PET_* settings, as ddpkit.env.kubeflow read them, as launch options for this pod's agent: the
    shape (elastic MIN:MAX), rendezvous endpoint, backend, conf, id and restarts torchrun would use."""
    from ddpkit.launch.agent import LaunchOptions
    from ddpkit.launch.shape import JobShape

    plan = world.agent
    if plan is None:  # detect() gives every agent a plan; a hand-built WorldInfo may not
        raise ConfigError(f"{world.launcher} agent without a rendezvous plan", "a Kubeflow pod's PET_* variables",
                          "run inside the pod, or pass -j and --rdzv-endpoint")
    shape = JobShape(min_nodes=plan.min_nodes, max_nodes=plan.max_nodes, nproc_per_node=plan.nproc_per_node)
    conf = plan.rdzv_conf
    if plan.min_nodes == plan.max_nodes and plan.rdzv_backend == "c10d" and plan.node_rank is not None \
            and not any(k == "is_host" for k, _ in conf):
        # a fixed-size job whose endpoint is the master pod: the pod of node rank 0 hosts the store
        conf = (*conf, ("is_host", str(plan.node_rank == 0).lower()))
    return LaunchOptions(shape=shape, rdzv_endpoint=plan.rdzv_endpoint, rdzv_backend=plan.rdzv_backend,
                         rdzv_conf=conf, run_id=plan.run_id, max_restarts=plan.max_restarts)


def _launch(argv: list[str], options: LaunchOptions) -> int:
    """Be this node's agent: every worker runs this module's ``main`` with the same argv."""
    from ddpkit.launch.agent import Entrypoint, launch

    return launch(options, Entrypoint(main=main, module="ddpkit"), argv)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        configure(args.verbose)
        if args.command is None:
            parser.print_help()
            return EXIT_USAGE
        args.ddpkit_argv = argv  # the command line as given, for the header of generated files
        module = _load(args.command)
        if getattr(module, "WORKER", False):
            return _run_worker(module, args, argv)
        return int(module.run(args))
    except DdpkitError as exc:
        print(f"ddpkit: error: {exc.message()}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("ddpkit: interrupted", file=sys.stderr)
        return 130


def program() -> NoReturn:
    """The ``ddpkit`` program (console script and ``python -m ddpkit``): ``main()``, then a prompt exit.

    Once a process has imported torch (and torch._dynamo, which DDP imports), the interpreter's own teardown (module
    clean-up, a last garbage collection of millions of objects) takes 1-5 s on a loaded 2-core machine: after the
    last line was printed and every result written, the command did not return for that long, in the agent and in
    every rank a launcher waits for. Everything that matters is done when ``main`` returns: the atexit handlers
    (logging's flush among them) run here as the interpreter would run them, output is flushed; then the process
    leaves with os._exit. A thread still running (a user's --make-job may start one) gets the ordinary exit, which
    waits for it.
    """
    code = main()
    if "mpi4py" in sys.modules:  # MPI_Finalize runs from a C-level exit hook (Py_AtExit), which os._exit skips
        sys.exit(code)
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.exit(code)
    atexit._run_exitfuncs()  # the interpreter's exit runs these too (after the threads), then tears itself down
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more can reach the reader anyway
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    program()
