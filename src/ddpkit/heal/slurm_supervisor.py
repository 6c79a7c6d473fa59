"""The heal supervisor of a Slurm job: ``ddpkit submit slurm -j [MIN:]NxP --spare-nodes K --heal -- COMMAND``.

The batch script that ``submit`` renders allocates N+K nodes and runs this module in the batch shell::

    python -m ddpkit.heal.slurm_supervisor --nodes N --min-nodes MIN --per-node P --max-attempts 3 \\
        [--on-fail drain] [--run-dir DIR] -- PYTHON -m ddpkit train ...

Each attempt is one ``srun`` step on N healthy nodes of the allocation (``heal.slurm_step``); a failed attempt is
classified (``heal.classify``), recorded in the run's ledger (``rundir.ledger``: the fault as first seen, the attempt's
end with its class, culprits, evidence and action, each host taken out) and acted on (``heal.policy``):

- a host fault takes the culprit host(s) out for the rest of the job (``--on-fail drain`` also drains them in
  Slurm with the reason); a quick ``ddpkit check`` on the new node set (an srun step, short deadlines) proves it;
  the next attempt starts from the newest snapshot (``train --snapshot-path`` resumes on its own);
- with no spare left, an attempt runs on fewer nodes where ``-j MIN:N`` allows it; else the job requeues itself
  (``scontrol requeue``; its bad hosts drained with ``--on-fail drain``, so that the next allocation cannot hold
  them) and a requeued supervisor keeps every host its ledger names out; a job that cannot requeue exits 94;
- a job fault, a preemption, the no-progress rule and ``--max-attempts`` end the run as ``policy`` says (93: do not
  requeue), the first failing rank's traceback printed again right before the last line.

Every decision is one ``ddpkit heal:`` line in the job's log. The ranks are told ``DDPKIT_HEAL_SILENT_S`` (the watch
stops a job whose rank went silent within seconds, naming it), ``DDPKIT_RUN_DIR`` and ``DDPKIT_ATTEMPT`` (train's
goodput lines), and a ``MASTER_PORT`` of their own per step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ddpkit.base.errors import ConfigError, DdpkitError
from ddpkit.base.inputs import program_words
from ddpkit.goodput.records import ATTEMPT_VAR, RUN_DIR_VAR
from ddpkit.heal.attempts import EXIT_NO_HOSTS, Adapter, Attempts, Conclusion, Ended, LiveHook
from ddpkit.heal.classify import Classification, FailureClass, classify
from ddpkit.heal.gather import gather
from ddpkit.heal.lines import Style, say
from ddpkit.heal.nodepool import NodePool
from ddpkit.heal.policy import DEFAULT_MAX_ATTEMPTS, HealPolicy
from ddpkit.heal.progress import program_progress
from ddpkit.heal.scontrol import SCONTROL_S, drain, hostnames, release
from ddpkit.heal.slurm_step import StepPlan, StepRun, run_step
from ddpkit.launch.steplog import full_log_path
from ddpkit.launch.stepscreen import StepScreen
from ddpkit.process.worker_context import HEAL_SILENT_DEFAULT_S, HEAL_SILENT_S
from ddpkit.rundir import RunDir
from ddpkit.rundir.ledger import (
    Action,
    FaultSeen,
    HostExcluded,
    Ledger,
    PreflightEnded,
    SupervisorStarted,
    ranks_command,
)

__all__ = ["main"]

#: Seconds srun gets to end a step after a task failed before the supervisor ends srun.
TEARDOWN_S = 5.0
#: The preflight check's deadlines (roll-call and every later phase) and the step's own bound.
PREFLIGHT_S = 20.0


@dataclass
class _Signals:
    """A signal from outside (scancel, a preemption, a requeue) seen by the supervisor."""

    name: str | None = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, self._seen)

    def _seen(self, signum: int, _frame: object) -> None:
        self.name = self.name or signal.Signals(signum).name


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m ddpkit.heal.slurm_supervisor",
                                description="ddpkit's heal supervisor inside a Slurm batch script")
    p.add_argument("--nodes", type=int, required=True, help="N: nodes per attempt")
    p.add_argument("--min-nodes", type=int, default=None, help="MIN: fewest nodes an attempt may run on")
    p.add_argument("--per-node", type=int, required=True, help="P: ranks per node")
    p.add_argument("--max-attempts", type=int, default=DEFAULT_MAX_ATTEMPTS)
    p.add_argument("--on-fail", choices=("report", "drain"), default="report")
    p.add_argument("--run-dir", default=None)
    p.add_argument("--silent-after", type=float, default=HEAL_SILENT_DEFAULT_S)
    p.add_argument("--requeue", action="store_true", help="the job may requeue itself (#SBATCH --requeue)")
    p.add_argument("--live", action="store_true", help="a lost rank replaced live by a spare's standby "
                   "(ddpkit.live.agent.slurm)")
    p.add_argument("program", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    args.program = program_words(args.program, ConfigError("no program after --", "the ranks' command line",
                                                           "render the job with ddpkit submit"))
    args.min_nodes = args.min_nodes or args.nodes
    if not (1 <= args.min_nodes <= args.nodes and args.per_node >= 1 and args.max_attempts >= 1
            and 4 <= args.silent_after <= 3600):
        raise ConfigError(f"--nodes {args.nodes} --min-nodes {args.min_nodes} --per-node {args.per_node} "
                          f"--max-attempts {args.max_attempts} --silent-after {args.silent_after:g}",
                          "1 <= MIN <= N, P >= 1, attempts >= 1, 4 to 3600 s", "render the job with ddpkit submit")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        return supervise(parse(list(sys.argv[1:] if argv is None else argv)))
    except DdpkitError as exc:
        print(f"ddpkit heal: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code


def supervise(args: argparse.Namespace) -> int:
    job = os.environ.get("SLURM_JOB_ID", "")
    if not job.isdigit():
        raise ConfigError("SLURM_JOB_ID is not set: this is not a Slurm batch script",
                          "the batch script that ddpkit submit slurm --heal renders",
                          "submit the job with ddpkit submit slurm --heal -- COMMAND")
    signals = _Signals()
    signals.install()
    allocation = hostnames(os.environ.get("SLURM_JOB_NODELIST", ""))
    run_dir = Path(args.run_dir) if args.run_dir else RunDir.default(f"slurm-{job}").path
    ledger = Ledger(run_dir)
    pool = NodePool(allocation=allocation, want=args.nodes, least=args.min_nodes)
    for record in ledger.records():  # a requeued job: the hosts found bad before stay out
        if isinstance(record, HostExcluded):
            pool.exclude(record.host, record.reason)
    policy = HealPolicy(max_attempts=args.max_attempts)
    ledger.append(SupervisorStarted(time=time.time(), pid=os.getpid(), host=socket.gethostname().split(".")[0],
                                    max_attempts=policy.max_attempts, command=ranks_command(tuple(args.program))))
    restart = os.environ.get("SLURM_RESTART_COUNT", "0")
    spare = len(allocation) - args.nodes
    out = f", out: {', '.join(sorted(pool.bad))} (the ledger's)" if pool.bad else ""
    say(f"ddpkit heal: job {job} (restart {restart}) holds {', '.join(allocation)}: attempts on {args.nodes} "
        f"node(s) x {args.per_node} rank(s), {max(spare, 0)} spare{out}; up to {policy.max_attempts} attempt(s); "
        f"ledger {ledger.path}")
    os.environ[RUN_DIR_VAR] = str(run_dir.resolve())
    attempts = Attempts(ledger=ledger, policy=policy, style=Style.ALLOCATION, pool=pool)
    return attempts.run(_StepAttempts(args, job, signals, ledger, pool, policy), ranks_per_host=args.per_node)


class _StepAttempts(Adapter):
    """One ``srun`` step per attempt on the pool's nodes; after a host fault, a preflight check proves the next set
    (the first attempt runs on what Slurm allocated)."""

    style = Style.ALLOCATION
    live_moves_host = True  # a lost rank's replacement runs on a spare node's standby

    def __init__(self, args: argparse.Namespace, job: str, signals: _Signals, ledger: Ledger, pool: NodePool,
                 policy: HealPolicy) -> None:
        self.args, self.job, self.signals = args, job, signals
        self.ledger, self.pool, self.policy = ledger, pool, policy
        self.steps = 0  # srun steps so far: each its own MASTER_PORT
        self.proven = True
        self.step: StepRun | None = None

    def prepare(self, attempt: int, hosts: tuple[str, ...]) -> tuple[str, ...] | None:
        nodes: tuple[str, ...] | None = hosts
        if not self.proven:
            self.steps += 1
            nodes = _preflight(self.args, self.job, self.steps, attempt, hosts, self.pool, self.ledger)
            self.proven = True
        return nodes

    def start(self, attempt: int, of_session: int, hosts: tuple[str, ...], heard: LiveHook) -> Ended:
        args, run_dir = self.args, self.ledger.run_dir
        if args.live:
            return self._live(attempt, hosts, heard)
        self.steps += 1
        env = {"MASTER_PORT": str(step_port(int(self.job), self.steps)), HEAL_SILENT_S: f"{args.silent_after:g}",
               ATTEMPT_VAR: str(attempt), RUN_DIR_VAR: str(run_dir.resolve())}
        with AttemptScreen(full_log_path()) as screen:
            step = run_step(StepPlan(nodes=hosts, per_node=args.per_node, program=tuple(args.program), env=env,
                                     name=f"attempt-{attempt}"), teardown_s=TEARDOWN_S,
                            outside=lambda: self.signals.name, echo=screen.line)
            screen.ended(failed=bool(step.exit_code))
        self.step = step
        if step.fault_at is not None and step.fault_line is not None:
            self.ledger.append(FaultSeen(attempt=attempt, time=step.fault_at, line=step.fault_line))
        return Ended(exit_code=step.exit_code, evidence=step.evidence)

    def _live(self, attempt: int, hosts: tuple[str, ...], heard: LiveHook) -> Ended:
        """The attempt with a standby on each spare node: a lost rank replaced live (``ddpkit.live.agent.slurm``);
        ``heard`` records each heal and takes its lost host out (``Attempts.live_healed``)."""
        from ddpkit.live.agent.slurm import run_live_attempt

        env = {ATTEMPT_VAR: str(attempt), RUN_DIR_VAR: str(self.ledger.run_dir.resolve())}
        spares = tuple(h for h in self.pool.healthy if h not in hosts)
        result, where = run_live_attempt(job=self.job, program=tuple(self.args.program), hosts=hosts, spares=spares,
                                         env=env, on_heal=heard, marks_in=str(self.ledger.run_dir.resolve()),
                                         per_node=self.args.per_node)
        return Ended(exit_code=result.exit_code,
                     evidence=gather(result.exit_code, result, None, socket.gethostname().split(".", 1)[0], where)
                     if result.exit_code else None)

    def progress(self) -> int | None:
        return program_progress(self.args.program)

    def drain(self, attempt: int, host: str, reason: str) -> bool:
        return self.args.on_fail == "drain" and drain(host, f"ddpkit heal: {reason}")

    def excluded(self, found: Classification, going_on: bool) -> None:
        if going_on:  # going on here: give the bad hosts back (a requeue gives back everything)
            release(self.pool, self.ledger.run_dir)
        self.proven = not found.culprit_hosts

    def no_hosts(self, of_session: int) -> int:
        return _no_nodes(self.args, self.job, self.pool, of_session, self.policy)

    def ended(self, conclusion: Conclusion) -> None:
        if conclusion.found is not None and conclusion.decision.action is not Action.RETRY and self.step is not None:
            _cause_first(self.step)


def _preflight(args: argparse.Namespace, job: str, steps: int, attempt: int, nodes: tuple[str, ...],
               pool: NodePool, ledger: Ledger) -> tuple[str, ...] | None:
    """``ddpkit check`` on ``nodes`` (short deadlines); a host it names bad is taken out and the next set tried
    (bounded by the allocation). Returns the set to run on, or None when too few nodes are left."""
    report = ledger.run_dir.resolve() / f"preflight-{attempt}-{steps}.json"
    program = [*args.program[:args.program.index("ddpkit") + 1], "check", "--timeout", f"{PREFLIGHT_S:g}",
               "--phase-timeout", f"{PREFLIGHT_S:g}", "--json", str(report)] if "ddpkit" in args.program else None
    if program is None:
        return nodes
    began = time.time()
    step = run_step(StepPlan(nodes=nodes, per_node=1, program=tuple(program), name=f"preflight-{attempt}",
                             env={"MASTER_PORT": str(step_port(int(job), steps)), HEAL_SILENT_S: "5"}),
                    teardown_s=5.0, deadline_s=3 * PREFLIGHT_S, echo=lambda line: None)
    bad: tuple[str, ...] = ()
    if step.exit_code:
        bad = _named_bad(report, nodes)
        found = classify(step.evidence) if step.evidence is not None else None
        if not bad and found is not None and found.kind is FailureClass.HOST:  # a rank killed, one silent
            bad = found.culprit_hosts
    ledger.append(PreflightEnded(attempt=attempt, start=began, end=step.ended, hosts=nodes,
                                 exit_code=step.exit_code, bad_hosts=bad))
    if not step.exit_code:
        say(f"ddpkit heal: preflight check passed on {', '.join(nodes)} in {step.ended - began:.1f} s")
        return nodes
    if not bad:
        say(f"ddpkit heal: preflight check on {', '.join(nodes)} failed (exit {step.exit_code}) without naming a "
            "host; the attempt runs on them and its own failure will be classified")
        return nodes
    for host in bad:
        if pool.exclude(host, f"preflight check failed on {host}"):
            ledger.append(HostExcluded(attempt=attempt, time=time.time(), host=host,
                                       reason=f"preflight check failed (exit {step.exit_code})",
                                       drained=args.on_fail == "drain" and drain(host, "ddpkit heal: preflight "
                                                                                "check failed")))
    nxt = pool.take()
    say(f"ddpkit heal: preflight check named {', '.join(bad)}: excluded; "
        + (f"trying {', '.join(nxt)}" if nxt else "no node set left"))
    return _preflight(args, job, steps + 1, attempt, nxt, pool, ledger) if nxt else None


def _named_bad(report: Path, nodes: tuple[str, ...]) -> tuple[str, ...]:
    """The hosts the preflight check's report names in ``bad_hosts`` (by Slurm node name), among ``nodes``."""
    try:
        data = json.loads(report.read_text())
    except (OSError, ValueError):
        return ()
    entries = data.get("bad_hosts") if isinstance(data, dict) else None
    names = [str(e.get("slurm_node") or e.get("host")) for e in entries or () if isinstance(e, dict)]
    return tuple(n for n in dict.fromkeys(names) if n in nodes)


def _no_nodes(args: argparse.Namespace, job: str, pool: NodePool, of_session: int, policy: HealPolicy) -> int:
    """Fewer healthy nodes than the job needs: requeue it with every bad host in its ``--exclude`` (hold, update,
    release: Slurm refuses ExcNodeList on a running job but takes it on one requeued and held), else end with 94."""
    bad = ",".join(sorted(pool.bad))
    head = f"ddpkit heal: no attempt {of_session} here"
    left = f"{len(pool.healthy)} healthy node(s) left of {len(pool.allocation)} ({bad} out), {pool.least} needed"
    if args.requeue:
        say(f"{head}: {left}: requeuing job {job} with --exclude={bad} (Slurm starts it again after its requeue "
            "delay; its supervisor goes on with the same ledger)")
        failed, held = "", False
        for argv in (["scontrol", "requeuehold", job], ["scontrol", "update", f"JobId={job}", f"ExcNodeList={bad}"],
                     ["scontrol", "release", job]):
            # Slurm sends SIGTERM to every process of the job at the requeue: scontrol must live through it
            res = subprocess.run(argv, capture_output=True, text=True, timeout=SCONTROL_S, check=False,
                                 preexec_fn=_ignore_term)
            if res.returncode != 0:
                failed = f"{' '.join(argv)}: exit {res.returncode} {(res.stderr or res.stdout).strip()}"
                break
            held = held or argv[1] == "requeuehold"
        if not failed:
            return 0  # Slurm ends this batch script (SIGTERM, then SIGKILL); the job runs again, pending first
        if held:
            say(f"ddpkit heal: the requeue failed ({failed}); job {job} is requeued and held: release it with "
                f"scontrol update JobId={job} ExcNodeList={bad} && scontrol release {job}")
            return EXIT_NO_HOSTS
        say(f"ddpkit heal: the requeue failed ({failed})")
    say(f"{head}: {left}, and the job cannot requeue itself: stopping with exit {EXIT_NO_HOSTS}; resubmit with "
        f"--exclude {bad}")
    return EXIT_NO_HOSTS


def _ignore_term() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _cause_first(step: StepRun) -> None:
    """The first failing rank's traceback again, right before the last line: the cause where a person looks."""
    if not step.tracebacks:
        return
    failed = step.evidence.ranks if step.evidence is not None else ()
    first = next((r.rank for r in sorted(failed, key=lambda r: (not r.first, r.rank)) if r.rank in step.tracebacks),
                 min(step.tracebacks))
    say(f"ddpkit heal: the first failure, rank {first}:")
    say(step.tracebacks[first])


def step_port(job: int, step: int) -> int:
    """A port of its own for each step's store (a new rank 0 never meets the last one's socket)."""
    return 20000 + (job * 10 + step) % 10000


class AttemptScreen:
    """An attempt's output as the job's log shows it: every line whole in the full log beside it (``NAME_ID.full.log``,
    appended across attempts and requeues, as ``ddpkit step`` keeps it), and on the screen without torch's C++
    frames and repeated warnings, its tracebacks held once a rank failed (``StepScreen``): the supervisor's own
    lines and its cause-first summary say the failure. Lines come from the step reader's thread."""

    def __init__(self, log: str) -> None:
        self.log = log
        self.full = open(log, "ab")  # noqa: SIM115 (closed by __exit__)
        self.screen = StepScreen(sys.stdout, sys.stdout, agents=False, ranks_per_task=1)

    def __enter__(self) -> AttemptScreen:
        return self

    def __exit__(self, *exc: object) -> None:
        self.full.close()

    def line(self, text: str) -> None:
        self.full.write(text.encode(errors="replace") + b"\n")
        self.full.flush()
        if text.startswith("ddpkit heal:"):  # the supervisor's own word: always on the screen
            print(text, flush=True)
            return
        self.screen.take(text, to_stderr=True)
        self.screen.tick()

    def ended(self, *, failed: bool) -> None:
        """A clean attempt shows what it held; a failed one names where all of it is."""
        if not failed:
            self.screen.release()
        else:
            print(f"ddpkit heal: every line of the attempt's ranks and srun, in full: {self.log}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
