"""ddpkit's command line: argv -> options -> the command; errors -> exit codes; logging configured once.

Exit codes: 0 success; 1 a check failed; 2 usage or environment error; 3 ranks missing or a deadline expired;
74 a snapshot did not fit on its filesystem; 75 stopped by a preemption signal after saving; 76 preempted with no
snapshot; 130 interrupted (the README's table is the reference).
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from types import ModuleType
from typing import TYPE_CHECKING, Any, NoReturn

from ddpkit import __version__
from ddpkit.errors import EXIT_USAGE, ConfigError, DdpkitError
from ddpkit.exiting import leave
from ddpkit.inputs import check_local_ranks, endpoint, local_ranks, shape_text
from ddpkit.log import configure, get_logger

if TYPE_CHECKING:
    from ddpkit.env import WorldInfo
    from ddpkit.launch.agent import LaunchOptions
    from ddpkit.launch.shape import JobShape

__all__ = ["main", "program"]

log = get_logger(__name__)

@dataclass(frozen=True)
class Command:
    """One ``ddpkit`` command. Its module loads only when the command runs (or its own ``--help`` is asked), so
    ``ddpkit --help``, ``env`` and ``submit`` never import torch; a module's ``add_arguments`` must not either."""

    name: str
    module: str
    """Provides ``add_arguments(parser)`` and ``run(args) -> int`` (and ``check_arguments(args)`` where
    ``checks_first``)."""
    help: str
    """The one line ``ddpkit --help`` shows."""
    worker: bool = False
    """Runs on every rank: takes the launch options (-n, -j, --rdzv-*) and becomes an agent where no launcher
    started it."""
    verdict: bool = False
    """A worker whose result is a verdict (check, bench, env): under ddpkit's agent it is handed back in a file and
    the rank exits 0 (``launch.worker.verdict_exit_code``), so that no verdict restarts the group."""
    preload: tuple[str, ...] = ()
    """Modules ddpkit's agent imports once so that the ranks it forks inherit them (each fresh rank paid 1.5-8 s for
    torch and torch._dynamo, which DDP's constructor imports, on a loaded 2-core machine)."""
    checks_first: bool = False
    """The module's ``check_arguments(args)`` checks every input once, before any rank starts."""


COMMANDS: tuple[Command, ...] = (
    Command("env", "ddpkit.env.cli", "show who this process is, in which world, and from which launcher",
            worker=True, verdict=True),
    Command("check", "ddpkit.check", "prove the cluster is ready for PyTorch distributed, and name what is broken",
            worker=True, verdict=True,
            preload=("torch.nn.parallel", "torch._dynamo", "ddpkit.check.ddpsync", "ddpkit.runtime", "rich.table",
                     "ddpkit.nodefacts", "psutil")),
    Command("submit", "ddpkit.jobs.cli", "render a job for torchrun, slurm, mpi or k8s, and submit it"),
    Command("status", "ddpkit.jobs.status", "show a Slurm job's state and exit code"),
    Command("logs", "ddpkit.jobs.logs", "print (or follow, -f) a Slurm job's output"),
    Command("recipe", "ddpkit.jobs.recipe", "an environment for the cluster: venv, conda, docker or enroot"),
    Command("bench", "ddpkit.bench.cli",
            "benchmark every collective (nccl-tests conventions), verified, gated; --pairs", worker=True,
            verdict=True),
    Command("report", "ddpkit.report", "render check and bench JSON files into one Markdown report with plots"),
    Command("train", "ddpkit.train.cli",
            "the reference DDP job: trains, snapshots safely, resumes exactly, survives faults", worker=True,
            preload=("torch.nn.parallel", "torch._dynamo", "ddpkit.runtime", "ddpkit.train.jobs",
                     "ddpkit.train.trainer", "ddpkit.watch.hooks", "ddpkit.watch.monitor")),
    Command("run", "ddpkit.script", "run your own DDP script, unchanged, under any launcher (or start -n ranks)",
            worker=True, checks_first=True,
            preload=("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo")),
)
_BY_NAME = {c.name: c for c in COMMANDS}
#: Packages a command may need that a login node may lack: a missing one is a usage error, not a traceback.
NEEDS_INSTALL = {"torch": "torch", "numpy": "numpy", "mpi4py": "mpi4py", "matplotlib": "matplotlib",
                 "yaml": "pyyaml", "etcd": "python-etcd"}


def _load(name: str) -> ModuleType:
    return importlib.import_module(_BY_NAME[name].module)


def _chosen(argv: Sequence[str]) -> Command | None:
    """The command argv names: its first word that is not one of the top-level options (-v, -h, --version)."""
    for word in argv:
        if word == "--":
            return None
        if not word.startswith("-"):
            return _BY_NAME.get(word)
    return None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        raise ConfigError(message, f"valid options for '{self.prog}'", f"see '{self.prog} --help'")

    def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> Any:
        # One rule for every option: `--opt=--` is refused with the option named (argparse would strip the `--` and
        # hand the option an empty list); any other value, `-x` included, is the option's value as written.
        if action.option_strings and arg_strings == ["--"] and action.nargs in (None, argparse.OPTIONAL):
            self.error(f"argument {'/'.join(action.option_strings)}: '--' is not a value (it ends the options); "
                       f"give {action.option_strings[-1]} a value, or leave it out")
        return super()._get_values(action, arg_strings)


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


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser: every command listed; only the one argv names gets its arguments (its module is loaded)."""
    parser = _Parser(prog="ddpkit", description="Prove a cluster runs PyTorch DistributedDataParallel.")
    parser.add_argument("--version", action="version", version=f"ddpkit {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    chosen = _chosen(argv)
    for command in COMMANDS:
        if command is not chosen:
            sub.add_parser(command.name, help=command.help, description=command.help)
            continue
        module = _load(command.name)
        p = sub.add_parser(command.name, help=command.help,
                           description=(module.__doc__ or command.help).strip().split("\n")[0])
        module.add_arguments(p)
        if command.worker:
            add_worker_arguments(p)
    return parser


def _launch_shape(args: argparse.Namespace) -> JobShape:
    """The local ranks -n/-j ask for (1x1 when neither): checked here, before any launcher module loads."""
    from ddpkit.launch.shape import JobShape, parse_job_shape

    if args.job and args.nproc_per_node:
        raise ConfigError("both -n and -j were given", "one of them", "use -j NNODESxNPROC alone")
    shape = parse_job_shape(args.job) if args.job else JobShape(min_nodes=1, max_nodes=1,
                                                                nproc_per_node=args.nproc_per_node or 1)
    check_local_ranks(shape.nproc_per_node, "-j" if args.job else "-n")
    return shape


def _launch_options(args: argparse.Namespace, shape: JobShape | None = None) -> LaunchOptions:
    from ddpkit.launch.agent import LaunchOptions

    shape = shape or _launch_shape(args)
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


def _run_worker(command: Command, module: ModuleType, args: argparse.Namespace, argv: list[str]) -> int:
    from ddpkit.env import detect
    from ddpkit.launch import worker

    if command.checks_first:  # every input checked once, before any rank starts
        module.check_arguments(args)
    world = detect()
    if world.is_agent:  # a Kubeflow pod asked for several processes: be its agent, as torchrun would be
        return _launch(argv, _kubeflow_agent_options(world))
    if world.launcher == "none":
        shape = _launch_shape(args)
        if shape.max_nodes * shape.nproc_per_node > 1:
            options = _launch_options(args, shape)
            return _launch(argv, replace(options, preload=command.preload))
    elif (args.nproc_per_node or args.job) and worker.LAUNCHED not in os.environ:
        log.warning("started by %s: -n/-j are ignored (the launcher decides the ranks)", world.launcher)
    if world.launcher == "torchrun" and worker.launched_by_ddpkit():
        from ddpkit.launch.worker import die_with_agent, verdict_exit_code

        die_with_agent()  # a worker of ddpkit's own launcher: never outlive the agent
        if command.verdict:
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
        parser = build_parser(argv)
        args = parser.parse_args(argv)
        configure(args.verbose)
        if args.command is None:
            parser.print_help()
            return EXIT_USAGE
        args.ddpkit_argv = argv  # the command line as given, for the header of generated files
        command = _BY_NAME[args.command]
        module = _load(command.name)
        if command.worker:
            return _run_worker(command, module, args, argv)
        return int(module.run(args))
    except DdpkitError as exc:
        print(f"ddpkit: error: {exc.message()}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("ddpkit: interrupted", file=sys.stderr)
        return 130
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] not in NEEDS_INSTALL:
            raise
        what = NEEDS_INSTALL[exc.name.split(".")[0]]
        print(f"ddpkit: error: 'ddpkit {argv[0] if argv else ''}' needs {what}, which this Python "
              f"({sys.executable}) lacks.\n  Fix: pip install {what} (rendering jobs, env and recipe need none).",
              file=sys.stderr)
        return EXIT_USAGE


def program() -> NoReturn:
    """The ``ddpkit`` program (console script and ``python -m ddpkit``): ``main()``, then a prompt exit
    (``exiting.leave``: everything that matters is done when ``main`` returns; the interpreter's teardown after it
    took seconds, and can abort a rank under torch 2.13's gloo)."""
    leave(main())


if __name__ == "__main__":
    program()
