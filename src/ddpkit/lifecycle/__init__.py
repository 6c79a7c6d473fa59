"""A rank's start, once per process, for every command that runs on ranks (env, check, bench, train, run).

``run_rank`` reads the world the launcher made (``ddpkit.env.detect``) and how this worker was started
(``WorkerContext``) once, then either becomes this node's agent (no launcher, ``-n``/``-j``; a Kubeflow pod asked
for several processes) or runs the command in this rank with one typed record of both (``RankStart``): no command
reads its launcher a second time. A worker of ddpkit's own agent dies with its agent, and a verdict command hands
its verdict back in a file (``launch.worker.verdict_exit_code``). How the process then leaves is
``ddpkit.process.exiting.leave`` (the program) or ``launch.worker.run_forked_worker`` (a rank forked by the agent).
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable
from dataclasses import replace
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from ddpkit.base.errors import ConfigError
from ddpkit.base.inputs import check_local_ranks
from ddpkit.base.log import get_logger
from ddpkit.env.start import RankStart
from ddpkit.process.worker_context import LAUNCHED, WorkerContext, launched_by_ddpkit

if TYPE_CHECKING:
    from ddpkit.base.shape import JobShape
    from ddpkit.env import WorldInfo
    from ddpkit.launch.agent import LaunchOptions
    from ddpkit.launch.result import AttemptResult
    from ddpkit.rundir.ledger import LiveHook

__all__ = ["RankStart", "WorkerCommand", "run_rank"]

log = get_logger(__name__)


class WorkerCommand(Protocol):
    """What ``run_rank`` reads of a command's record (``ddpkit.cli.Command``)."""

    @property
    def verdict(self) -> bool: ...
    @property
    def preload(self) -> tuple[str, ...]: ...
    @property
    def checks_first(self) -> bool: ...
    @property
    def watched(self) -> bool: ...
    @property
    def script_signals(self) -> bool: ...


def run_rank(command: WorkerCommand, module: ModuleType, args: argparse.Namespace, argv: list[str],
             main: Callable[[list[str]], int]) -> int:
    """Run ``module.run(args, start)`` in this rank, or be the agent that starts the ranks (each of which runs
    ``main(argv)``, the command line again). Returns the exit code."""
    from ddpkit.env import detect

    if command.checks_first:  # every input checked once, before any rank starts
        module.check_arguments(args)
    world = detect()
    if getattr(args, "heal", False) and not launched_by_ddpkit():  # the agent once per attempt (ddpkit.heal)
        from ddpkit.heal import HealRequest, supervise

        request = HealRequest(command=args.command, max_attempts=args.max_attempts, run_dir=args.run_dir,
                              run_id=getattr(args, "run_id", None), snapshot_path=getattr(args, "snapshot_path", None),
                              argv=tuple(getattr(args, "ddpkit_argv", ())), live=args.heal == "live",
                              standby=bool(getattr(args, "standby", False)))
        return supervise(world, request, lambda: replace(launch_options(args), preload=command.preload),
                         lambda options, live: _attempt(argv, options, main, live=live),
                         lambda options: _fork_ranks(argv, options, main))
    if getattr(args, "standby", False) and not launched_by_ddpkit():
        raise ConfigError("--standby without --heal live", "--standby with -j NxP --rdzv-endpoint HOST:PORT --heal "
                          "live: a standby host takes the ranks of a host that is lost", "add --heal live, or drop "
                          "--standby")
    if world.is_agent:  # a Kubeflow pod asked for several processes: be its agent, as torchrun would be
        return _launch(argv, kubeflow_agent_options(world), main)
    if world.launcher == "none":
        shape = launch_shape(args)
        if shape.max_nodes * shape.nproc_per_node > 1:
            return _launch(argv, replace(launch_options(args, shape), preload=command.preload), main)
    elif (args.nproc_per_node or args.job) and LAUNCHED not in os.environ:
        log.warning("started by %s: -n/-j are ignored (the launcher decides the ranks)", world.launcher)
    start = RankStart(world=world, context=WorkerContext.from_environ())
    if world.launcher == "torchrun" and launched_by_ddpkit():
        from ddpkit.launch.worker import die_with_agent, verdict_exit_code

        die_with_agent()  # a worker of ddpkit's own launcher: never outlive the agent
        if command.verdict:
            code = _in_rank(command, module, args, start)
            _linger()
            return verdict_exit_code(code)
    return _in_rank(command, module, args, start)


def _in_rank(command: WorkerCommand, module: ModuleType, args: argparse.Namespace, start: RankStart) -> int:
    """The command in this rank, with what it declares: the dispositions of ``python SCRIPT``, then the watch and
    its SIGTERM report (``watch/sigterm.py`` installs only over SIGTERM's default), which hears the exit code."""
    if command.script_signals:
        _script_signals()
    options = module.watch_options(args) if command.watched else None
    if options is None:
        return int(module.run(args, start))
    from ddpkit.watch import ended, install, sigterm

    install(options)  # a stalled rank is named, with its host and every rank's stack
    sigterm.install()  # the launcher ending this rank: first name a rank on this host that is gone
    code = 1  # a script that raised (a peer gone mid-collective) ends its goodput lines too: the steps it made count
    try:
        code = int(module.run(args, start))
    finally:
        ended(code)  # the last goodput lines, with --run-dir or under --heal (watch.steplines)
    return code


def _script_signals() -> None:
    """The signal dispositions a script gets from ``python SCRIPT``: a rank forked from ddpkit's agent inherits the
    agent's handlers (they forward SIGTERM to the ranks as an exception), and a rank stopped by its agent would
    print that exception as if the script had raised it."""
    import signal

    for name in ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def launch_shape(args: argparse.Namespace) -> JobShape:
    """The local ranks -n/-j ask for (1x1 when neither): checked here, before any launcher module loads."""
    from ddpkit.base.shape import JobShape, parse_job_shape

    if args.job and args.nproc_per_node:
        raise ConfigError("both -n and -j were given", "one of them", "use -j NNODESxNPROC alone")
    shape = parse_job_shape(args.job) if args.job else JobShape(min_nodes=1, max_nodes=1,
                                                                nproc_per_node=args.nproc_per_node or 1)
    check_local_ranks(shape.nproc_per_node, "-j" if args.job else "-n")
    return shape


def launch_options(args: argparse.Namespace, shape: JobShape | None = None) -> LaunchOptions:
    """The agent's options from the command line's launch options (-n/-j, --rdzv-*, --max-restarts)."""
    from ddpkit.launch.agent import LaunchOptions

    shape = shape or launch_shape(args)
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


def kubeflow_agent_options(world: WorldInfo) -> LaunchOptions:
    """The pod's PET_* settings, as ddpkit.env.kubeflow read them, as launch options for this pod's agent: the
    shape (elastic MIN:MAX), rendezvous endpoint, backend, conf, id and restarts torchrun would use."""
    from ddpkit.base.shape import JobShape
    from ddpkit.launch.agent import LaunchOptions

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


def _launch(argv: list[str], options: LaunchOptions, main: Callable[[list[str]], int]) -> int:
    """Be this node's agent: every worker runs ``main`` with the same argv; the exit code."""
    return _attempt(argv, options, main).exit_code


def _attempt(argv: list[str], options: LaunchOptions, main: Callable[[list[str]], int], *,
             live: LiveHook | None = None) -> AttemptResult:
    """One run of this node's agent, its outcome as values (what a heal supervisor classifies); ``live``: under
    ``--heal live``, where each live heal is told (ranks started one by one, a lost one replaced)."""
    from ddpkit.launch.agent import Entrypoint, launch

    entrypoint = Entrypoint(main=main, module="ddpkit")
    if live is not None:
        from ddpkit.live.agent.host import launch_live

        return launch_live(options, entrypoint, argv, live)
    return launch(options, entrypoint, argv)


def _fork_ranks(argv: list[str], options: LaunchOptions, main: Callable[[list[str]], int]) -> Any:
    """This host's rank forker under ``--heal live`` across hosts (``ddpkit.live.agent.host.fork_ranks``)."""
    from ddpkit.launch.agent import Entrypoint
    from ddpkit.live.agent.host import fork_ranks

    return fork_ranks(options, Entrypoint(main=main, module="ddpkit"), argv)


def _linger() -> None:
    """Test hook (DDPKIT_FAULTS="linger:rank=R:ms=N"): rank R finishes N ms after the others, as a rank on a slower
    node does."""
    from ddpkit.base.fault_injection import fault

    linger = fault("linger", rank=int(os.environ.get("RANK", "0")))
    if linger is not None:
        time.sleep(float(linger.get("ms", 2000)) / 1e3)
