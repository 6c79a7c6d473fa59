"""``ddpkit submit mpi -j [MIN:]NxP --hosts A,B,C,... --heal -- COMMAND``: each attempt one ``mpirun`` on N healthy
hosts of ``--hosts``; a host-class failure takes its host out for the rest of the run, and the next attempt's host
list leaves it out (a host beyond the first N is a spare; with none left the job shrinks down to MIN, else it
stops with exit 94 and one line saying so).

``submit mpi --heal`` renders a script that runs this module (``python -m ddpkit.heal.mpi SUBMIT-ARGV``: the same
``ddpkit submit`` command line, re-read here with ``jobs.cli``); each attempt is ``jobs.mpi``'s own script for the
hosts it runs on, run with ``bash`` and its output echoed as it comes and kept in ``RUN_DIR/attempt-N/mpirun.log``.

Evidence (Open MPI's ``--tag-output`` prefixes say which rank wrote a line; rank r runs on host ``r // P`` of the
attempt's list, ``--map-by ppr:P:node``):

- the watch's line naming a rank that stopped answering (``DDPKIT_HEAL_SILENT_S`` is forwarded to every rank:
  a silent rank stops the job within seconds, not at the hang deadline);
- mpirun's "process rank R ... on node H exited on signal S";
- each rank's last traceback (the program's own failure: retried once, then 93).

The classes and the policy are the one-host supervisor's (``classify``, ``policy``); the ledger is the run's
(``RUN_DIR/ledger.jsonl``, default ``.ddpkit-runs/mpi-RUN_ID``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ddpkit.base.errors import DdpkitError
from ddpkit.base.shape import JobShape
from ddpkit.goodput.records import ATTEMPT_VAR, RUN_DIR_VAR
from ddpkit.heal.attempts import EXIT_NO_HOSTS, Adapter, Attempts, Ended, LiveHook
from ddpkit.heal.classify import Evidence, RankEvidence
from ddpkit.heal.evidence import rank_ended, tracebacks_of, watch_of, with_exceptions
from ddpkit.heal.lines import Style, say
from ddpkit.heal.nodepool import NodePool
from ddpkit.heal.policy import HealPolicy
from ddpkit.heal.progress import program_progress
from ddpkit.jobs.spec import DDPKIT_COMMANDS
from ddpkit.launcher_output import RankEnded, SilentRank, WatchLine
from ddpkit.launcher_output.openmpi import OpenMpiReader
from ddpkit.process.worker_context import HEAL_SILENT_S
from ddpkit.rundir import RunDir
from ddpkit.rundir.ledger import HostExcluded, Ledger, SupervisorStarted

if TYPE_CHECKING:
    from ddpkit.jobs.spec import JobSpec


__all__ = ["EXIT_NO_HOSTS", "MpiAttempt", "evidence_of", "main", "supervise"]

#: The attempt's last lines the supervisor keeps for its evidence (the failure is said at the end: a rank's
#: exception, the watch's report, mpirun's word on the process that died); every line is in the attempt's log.
KEPT_LINES = 20_000


@dataclasses.dataclass
class MpiAttempt:
    """What one mpirun left: its exit code and its last lines (``KEPT_LINES``), by rank where Open MPI tagged
    them."""

    exit_code: int
    hosts: tuple[str, ...]
    nproc: int
    lines: Sequence[str]

    def host_of(self, rank: int) -> str:
        index = rank // self.nproc
        return self.hosts[index] if 0 <= index < len(self.hosts) else "?"


def evidence_of(run: MpiAttempt) -> Evidence:
    """The attempt's evidence for ``classify`` (hosts by their ``--hosts`` names), from Open MPI's reader (the
    digest's): the ranks mpirun saw a signal end (the first of them failed first), the ranks the watch says stopped
    answering, each rank's last traceback. mpirun's first process with a non-zero exit code is not read: under
    ``--heal`` the watch's stop (exit 3) is often that one."""
    reader = OpenMpiReader()
    by_rank: dict[int, list[str]] = {}
    watch: list[str] = []
    silent: list[SilentRank] = []
    ranks: dict[int, RankEvidence] = {}
    for raw in run.lines:
        reading = reader.read(raw)
        if reading.source is not None:
            by_rank.setdefault(reading.source, []).append(reading.text)
        for event in reading.events:
            if isinstance(event, WatchLine) and event.headline:
                watch.append(event.text.strip())
            elif isinstance(event, SilentRank):
                watch.append(event.line)
                silent.append(event)
            elif isinstance(event, RankEnded) and event.signal is not None:
                ranks[event.rank] = rank_ended(event.rank, run.host_of(event.rank), event, first=not ranks)
    with_exceptions(ranks, tracebacks_of(by_rank, run.host_of), exit_code=run.exit_code)
    report = watch_of(silent, lines=watch, host_of=lambda s: run.host_of(s.rank), most=10) if watch else None
    return Evidence(exit_code=run.exit_code, ranks=tuple(ranks.values()), watch=report)


def supervise(spec: JobSpec, *, run_dir: Path | None = None) -> int:
    """Attempts until one succeeds or the policy stops (the module's docstring); the run's exit code."""
    shape, policy = spec.shape, HealPolicy(max_attempts=spec.max_attempts)
    pool = NodePool(allocation=spec.hosts, want=shape.max_nodes, least=shape.min_nodes)
    run_dir = run_dir or (Path(spec.run_dir) if spec.run_dir else RunDir.default(f"mpi-{spec.run_id}").path)
    ledger = Ledger(run_dir)
    for entry in _excluded_before(ledger):  # a rerun on the same run directory keeps the bad hosts out
        pool.exclude(entry, "excluded by an earlier attempt of this run")
    say(f"ddpkit heal: run directory {run_dir} (ledger {ledger.path.name}); hosts {', '.join(spec.hosts)}, "
        f"{shape.max_nodes} per attempt ({shape.min_nodes} at least); up to {policy.max_attempts} attempt(s)")
    ledger.append(SupervisorStarted(time=time.time(), pid=os.getpid(), host=os.uname().nodename.split(".")[0],
                                    max_attempts=policy.max_attempts,
                                    command=spec.command if spec.command[0] in DDPKIT_COMMANDS
                                    else ("run", "--", *spec.command)))
    attempts = Attempts(ledger=ledger, policy=policy, style=Style.HOSTS, pool=pool)
    return attempts.run(_MpirunAttempts(spec, RunDir(run_dir), pool, policy), ranks_per_host=shape.nproc_per_node)


class _MpirunAttempts(Adapter):
    """One ``mpirun`` per attempt on the hosts the pool gives, its output echoed and kept in the attempt's log."""

    style = Style.HOSTS

    def __init__(self, spec: JobSpec, run_dir: RunDir, pool: NodePool, policy: HealPolicy) -> None:
        self.spec, self.run_dir, self.pool, self.policy = spec, run_dir, pool, policy

    def logs(self, attempt: int) -> str:
        return str(self.run_dir.attempt(attempt))

    def start(self, attempt: int, of_session: int, hosts: tuple[str, ...], heard: LiveHook) -> Ended:
        from ddpkit.jobs.mpi import render

        spec = self.spec
        logs = self.run_dir.attempt(attempt)
        logs.mkdir(parents=True, exist_ok=True)
        env = dict(spec.env)
        env.setdefault(HEAL_SILENT_S, f"{spec.silent_after:g}")
        env.update({RUN_DIR_VAR: str(self.run_dir.path.resolve()), ATTEMPT_VAR: str(attempt)})
        one = dataclasses.replace(spec, heal=False, hosts=hosts, spare_nodes=0, run_dir=None,
                                  shape=JobShape(min_nodes=len(hosts), max_nodes=len(hosts),
                                                 nproc_per_node=spec.shape.nproc_per_node),
                                  port=(spec.port or 29500) + attempt - 1,  # a fresh port: the last one may linger
                                  env=tuple(env.items()))
        say(f"ddpkit heal: attempt {of_session} of {self.policy.max_attempts} on {', '.join(hosts)}")
        run = _run(render(one, step=False), logs / "mpirun.log", hosts, spec.shape.nproc_per_node)
        return Ended(exit_code=run.exit_code, evidence=evidence_of(run) if run.exit_code else None)

    def progress(self) -> int | None:
        return program_progress(self.spec.command)

    def no_hosts(self, of_session: int) -> int:
        pool = self.pool
        say(f"ddpkit heal: attempt {of_session} of {self.policy.max_attempts}: {len(pool.healthy)} healthy host(s) "
            f"left of {len(pool.allocation)} ({', '.join(sorted(pool.bad))} out), -j needs {pool.least} at least: "
            f"stopping with exit {EXIT_NO_HOSTS}; rerun with more --hosts")
        return EXIT_NO_HOSTS


def _run(script: str, log: Path, hosts: tuple[str, ...], nproc: int) -> MpiAttempt:
    """``bash`` the attempt's script; every line kept in ``log`` as it comes, and shown through ``ddpkit step``'s
    screen (without Open MPI's tags and boxes, torch's C++ frames, and, once a rank failed, the peers' tracebacks:
    the supervisor's lines say the failure, and a failed attempt names ``log``). SIGTERM/SIGINT to the supervisor go
    to mpirun (which ends its ranks), and the attempt ends as mpirun ends."""
    from ddpkit.launch.stepscreen import StepScreen

    screen = StepScreen(sys.stdout, sys.stdout, agents=False, ranks_per_task=1, launcher="mpirun")
    with tempfile.NamedTemporaryFile("w", suffix=".sh", prefix="ddpkit-heal-mpi-", delete=False) as f:
        f.write(script)
    lines: deque[str] = deque(maxlen=KEPT_LINES)  # a long job's output stays in its log, not in memory
    try:
        with open(log, "w", encoding="utf-8") as out:
            proc = subprocess.Popen(["bash", f.name], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, text=True, errors="replace", bufsize=1)
            forward = {s: signal.signal(s, lambda n, _f: proc.send_signal(n)) for s in (signal.SIGTERM, signal.SIGINT)}
            try:
                assert proc.stdout is not None
                for line in proc.stdout:
                    out.write(line)
                    out.flush()
                    lines.append(line.rstrip("\n"))
                    screen.take(lines[-1], to_stderr=True)
                    screen.tick()
                code = proc.wait()
            finally:
                for s, old in forward.items():
                    signal.signal(s, old)
    finally:
        os.unlink(f.name)
    if code == 0:
        screen.release()
    else:
        say(f"ddpkit heal: every line of the attempt's ranks and mpirun, in full: {log}")
    return MpiAttempt(exit_code=code, hosts=hosts, nproc=nproc, lines=lines)


def _excluded_before(ledger: Ledger) -> list[str]:
    """Hosts an earlier supervisor on this run directory took out."""
    return [r.host for r in ledger.records() if isinstance(r, HostExcluded)]


def main(argv: list[str] | None = None) -> int:
    """``python -m ddpkit.heal.mpi submit mpi ... --heal -- COMMAND``: the submit command line, re-read."""
    from ddpkit.base.log import configure
    from ddpkit.jobs.cli import add_arguments, build_spec

    words = list(sys.argv[1:] if argv is None else argv)
    if words[:2] == ["submit", "mpi"]:
        words = words[1:]
    parser = argparse.ArgumentParser(prog="python -m ddpkit.heal.mpi")
    add_arguments(parser)
    configure(0)
    try:
        spec = build_spec(parser.parse_args(words), ["submit", *words])
        return supervise(spec)
    except DdpkitError as exc:
        print(f"ddpkit: error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
