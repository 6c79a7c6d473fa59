"""ddpkit's command line: argv -> options -> the command; errors -> exit codes; logging configured once.

Exit codes: 0 success; 1 a check failed; 2 usage or environment error; 3 ranks missing or a deadline expired;
74 a snapshot did not fit on its filesystem; 75 stopped by a preemption signal after saving; 76 preempted with no
snapshot; 130 interrupted (the README's table is the reference).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NoReturn

from ddpkit import __version__
from ddpkit.base.errors import EXIT_USAGE, ConfigError, DdpkitError
from ddpkit.base.inputs import HEAL_MODES, add_heal_flag, endpoint, local_ranks, run_directory, shape_text
from ddpkit.base.log import configure, get_logger
from ddpkit.process.exiting import leave

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
    watched: bool = False
    """The module's ``watch_options(args)`` says how the watch runs on each rank (None: not at all); the rank's
    lifecycle installs it and its SIGTERM report before ``run`` and hands it the exit code after."""
    script_signals: bool = False
    """The rank runs a user's script: the signal dispositions ``python SCRIPT`` gets, not the agent's handlers."""


COMMANDS: tuple[Command, ...] = (
    Command("env", "ddpkit.whoami", "show who this process is, in which world, and from which launcher",
            worker=True, verdict=True),
    Command("check", "ddpkit.check", "prove the cluster is ready for PyTorch distributed, and name what is broken",
            worker=True, verdict=True,
            preload=("torch.nn.parallel", "torch._dynamo", "ddpkit.check.ddpsync", "ddpkit.runtime", "rich.table",
                     "ddpkit.verdicts.nodefacts", "psutil")),
    Command("submit", "ddpkit.jobs.cli", "render a job for torchrun, slurm, mpi or k8s, and submit it"),
    Command("status", "ddpkit.jobs.status", "show a Slurm job's state and exit code"),
    Command("logs", "ddpkit.jobs.logs", "print (or follow, -f) a Slurm job's output"),
    Command("step", "ddpkit.launch.steplog",
            "run a job step (srun) for its job's output: full log kept, a failed step digested on one screen"),
    Command("recipe", "ddpkit.jobs.recipe", "an environment for the cluster: venv, conda, docker or enroot"),
    Command("bench", "ddpkit.bench.cli",
            "benchmark every collective (nccl-tests conventions), verified, gated; --pairs", worker=True,
            verdict=True),
    Command("report", "ddpkit.reports.cli",
            "check and bench JSON -> one Markdown report with plots; a run directory -> HTML, trace, Prometheus"),
    Command("train", "ddpkit.train.cli",
            "the reference DDP job: trains, snapshots safely, resumes exactly, survives faults", worker=True,
            checks_first=True,
            preload=("torch.nn.parallel", "torch._dynamo", "ddpkit.runtime", "ddpkit.train.jobs",
                     "ddpkit.train.trainer", "ddpkit.watch.hooks", "ddpkit.watch.monitor")),
    Command("run", "ddpkit.run", "run your own DDP script, unchanged, under any launcher (or start -n ranks)",
            worker=True, checks_first=True, watched=True, script_signals=True,
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
    add_heal_flag(g, "run, train: after a failed attempt, classify it (host, job, preempted, unknown), "
                     "record it in the run's ledger and relaunch where another attempt can help; a failure of "
                     "the program itself twice in a row ends with exit 93 (do not requeue). -n N on one host; "
                     "-j MIN:MAXxP on every host (a host at fault is excluded from later rounds; its agent "
                     "exits 95). --heal live (-n N, or -j NxP --rdzv-endpoint on every host; run: a script "
                     "using ddpkit.run.live): a lost rank, or a lost host's ranks, replaced while the others keep "
                     "their processes, taking the state from a live peer: no snapshot read, no step lost "
                     "(docs/heal.md)")
    g.add_argument("--standby", action="store_true",
                   help="with -j NxP --rdzv-endpoint HOST:PORT --heal live: this host starts no rank; it stands "
                        "by, torch and the program imported, and takes the ranks of a host that is lost")
    g.add_argument("--max-attempts", type=int, default=3, metavar="N",
                   help="with --heal: attempts at most, the first included (default 3)")
    g.add_argument("--run-dir", type=run_directory("--run-dir"), default=None, metavar="PATH",
                   help="the run directory: the heal ledger and each attempt's rank logs (with --heal), train's "
                        "goodput ledger (goodput.jsonl; ddpkit report RUN_DIR renders it); default with --heal: a new "
                        ".ddpkit-runs/RUN_ID under the current directory; reuse one to continue its ledgers")
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


#: What ``--heal`` may be followed by; alone, it means ``restart``.


def _heal_mode_given(argv: list[str]) -> list[str]:
    """``argv`` with a bare ``--heal`` written ``--heal=restart``: the word after it, where it is no mode, is the
    command's own (``ddpkit run -n 2 --heal job.py``: the script), as it was before ``--heal`` took a mode."""
    out: list[str] = []
    for i, word in enumerate(argv):
        if word == "--":
            return out + argv[i:]
        bare = word == "--heal" and (i + 1 == len(argv) or argv[i + 1] not in HEAL_MODES)
        out.append("--heal=restart" if bare else word)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser(argv)
        args = parser.parse_args(_heal_mode_given(argv))
        configure(args.verbose)
        if args.command is None:
            parser.print_help()
            return EXIT_USAGE
        args.ddpkit_argv = argv  # the command line as given, for the header of generated files
        command = _BY_NAME[args.command]
        module = _load(command.name)
        if command.worker:  # imported here: the rank's lifecycle reads the launchers (env/), which submit never needs
            from ddpkit.lifecycle import run_rank

            return run_rank(command, module, args, argv, main)
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


def program(argv: Sequence[str] | None = None) -> NoReturn:
    """The ``ddpkit`` program (console script and ``python -m ddpkit``): ``main()``, then a prompt exit
    (``exiting.leave``: everything that matters is done when ``main`` returns; the interpreter's teardown after it
    took seconds, and can abort a rank under torch 2.13's gloo)."""
    leave(main(argv))


if __name__ == "__main__":
    program()
