"""Live healing in a Slurm allocation: ``ddpkit submit slurm -j NxP --spare-nodes K --heal live -- train|run ...``.

The batch script's supervisor (``heal.slurm_supervisor --live``) is the live agent (``live.agent.rules``, in the
session every spawner shares: ``live.agent.session``): it hosts the stores, keeps the stop marks in the run
directory (every node sees it), and each rank is an srun step of one task of its own (``--overlap``, as one host
gives each rank a process context of its own: one rank's end ends no other step). Every step runs ``python -m
ddpkit.standby``, which imports torch and the trainer, then takes its rank from the agent's store; on each spare
node a standby step waits the same way, already imported, until a rank is lost.

- A rank killed (srun's exit code 128 + the signal) is lost at once. A stopped one (SIGSTOP) is seen by its pulse
  (``live.agent.pulse``: a process beside it on its node, reading its ``/proc`` every 0.25 s), a node or a step
  frozen or cut off by the pulse standing still ``SILENT_S``; either, ``STOPPED_S`` later, is ended with ``scancel
  --signal=KILL JOB.STEP`` so that its peers' collectives fail at once. A rank whose Python holds the GIL runs. A
  node cut off: its steps never end for srun, so a killed rank still silent ``UNREACHED_S`` later counts as ended,
  and its peers shut their own connections to it (``live.rank.unblock``).
- The replacement is the standby of a spare node: it is given the lost rank's variables and the next generation's
  store, joins the group the survivors re-form, and takes their state (``ddpkit.live.rank.group``). The lost host is
  excluded for the rest of the job (the ledger's ``host-excluded``, given back to Slurm).
- No standby left, a rank that raised, a second loss during a heal: the attempt ends, and the supervisor's restart
  heal takes over (``heal.attempts``), as without ``live``.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from ddpkit.base.log import get_logger
from ddpkit.launch.result import AttemptResult
from ddpkit.live.agent.proc import Proc, Seen
from ddpkit.live.agent.session import LiveSession
from ddpkit.live.protocol import LiveStore
from ddpkit.process.worker_context import LIVE_GEN
from ddpkit.rundir.ledger import LiveHook

__all__ = ["LiveSteps", "run_live_attempt"]

log = get_logger(__name__)

#: A pulse standing still this long (seconds; it speaks every 0.25 s, ``live.agent.pulse``): the rank's node, or its
#: step, is frozen or cut off. As long as the watch's own word for a rank that stopped answering (its ``STALE_S``).
SILENT_S = 3.0
#: How often the agent looks at its steps (seconds): each look reads every rank's heartbeat from the store.
POLL_S = 0.1
SCANCEL_S = 30.0
#: A rank the agent killed whose step has not ended this long after (seconds), its pulse silent all along: its node
#: is cut off (scancel cannot reach it, srun waits on it), so the rank is taken as ended by the SIGKILL it was sent,
#: and its survivors, which no reset will ever reach, shut their connections to it (``live.rank.unblock``).
UNREACHED_S = 1.0
#: How long a standby that was not needed gets to end on its own before its step is cancelled (seconds).
STANDBY_END_S = 10.0


@dataclass
class _Pulses:
    """Every step's pulse, as the agent last read it: one store round trip for all of them at most every half poll
    (the agent looks at each rank several times a poll; a read a rank each time cost the ranks' CPU on a small node)."""

    store: Any
    slots: list[str] = field(default_factory=list)
    said: dict[str, tuple[int, str, int] | None] = field(default_factory=dict)
    read_at: float = float("-inf")

    def add(self, slot: str) -> None:
        """A step about to start: its key set to "no pulse yet" first."""
        LiveStore(self.store).no_pulse_yet(slot)
        if slot not in self.slots:
            self.slots.append(slot)

    def of(self, slot: str) -> tuple[int, str, int] | None:
        now = time.monotonic()
        if now - self.read_at >= POLL_S / 2:
            self.read_at, self.said = now, LiveStore(self.store).pulses(self.slots)
        return self.said.get(slot)


@dataclass(kw_only=True)
class _Step:
    """One rank's srun step (a ``ddpkit.live.agent.rules.Proc``), seen through its pulse (``live.agent.pulse``)."""

    popen: subprocess.Popen[bytes]
    host: str
    slot: str
    job: str
    store: Any
    pulses: _Pulses
    silent_s: float = SILENT_S
    remote_pid: int | None = None
    count: int = -1
    """The pulse's count when last read."""
    seen: tuple[Seen, int] = (Seen.RUNNING, -1)
    gone: bool = False
    """The pulse said the rank's process is gone (its step's end may not be told yet)."""
    mark: tuple[float, int] | None = None
    """``heard_since``: (since, the pulse's count first read after it)."""
    killed: bool = False
    """The agent sent it SIGKILL (its step may take a moment to end)."""
    killed_at: float | None = None
    cancels: list[subprocess.Popen[bytes]] = field(default_factory=list)
    """The scancel commands sent, not waited for."""
    moved: float = field(default_factory=time.monotonic)
    step_id: str | None = None

    @property
    def pid(self) -> int:
        """The rank's process on its host, once its standby said it (srun's pid until then)."""
        if self.remote_pid is None:
            self.remote_pid = LiveStore(self.store).proc_pid(self.slot)
        return self.remote_pid or self.popen.pid

    def wait(self) -> int | None:
        code = self.popen.poll()
        if code is None:
            unreached = self.killed_at is not None and time.monotonic() - self.killed_at >= UNREACHED_S
            return -int(signal.SIGKILL) if unreached and self.look()[0] is Seen.SILENT else None
        return -(code - 128) if code > 128 else code  # srun: 128 + the signal that killed the task

    def look(self) -> tuple[Seen, int]:
        """What the rank's node says of it (its pulse's last word); ``Seen.SILENT`` once the pulse stood still
        ``silent_s`` after its first word (before it, the step is starting)."""
        now = time.monotonic()
        pulse = self.pulses.of(self.slot)
        if pulse is not None and pulse[0] != self.count:
            self.count, self.moved = pulse[0], now
            self.seen = (Seen.of_state(pulse[1]), pulse[2])
            self.gone = pulse[1] in ("", "Z", "X")
        if self.count > 0 and now - self.moved >= self.silent_s:
            return Seen.SILENT, self.seen[1]
        return self.seen

    def heard_since(self, since: float) -> bool:
        """A pulse counted after the first one read since ``since``: that one may have been written before it."""
        self.look()
        if self.mark is None or self.mark[0] != since:
            self.mark = (since, self.count)
        return self.count > self.mark[1] and not self.gone


    def send(self, sig: signal.Signals) -> None:
        self.killed = self.killed or sig is signal.SIGKILL
        if sig is signal.SIGKILL and self.killed_at is None:
            self.killed_at = time.monotonic()
        step = self._find_step()
        if step is None:
            return
        # not waited for: scancel waits on the node's answer, and a node cut off gives none (12 s here), while the
        # agent has other ranks to look at
        self.cancels = [c for c in self.cancels if c.poll() is None]
        self.cancels.append(subprocess.Popen(["scancel", f"--signal={sig.name.removeprefix('SIG')}", step],
                                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                             stderr=subprocess.DEVNULL))

    def close(self) -> None:
        for cancel in self.cancels:  # a scancel still waiting on a node cut off
            with contextlib.suppress(subprocess.TimeoutExpired):
                cancel.wait(timeout=2)
            if cancel.poll() is None:
                cancel.kill()
                cancel.wait()
        if self.popen.poll() is None:
            if self.killed:  # ended by the agent, still waited on by srun: its node is cut off
                self.popen.kill()
            else:
                self.popen.send_signal(signal.SIGINT)  # srun's way: twice, then it ends the step
                self.popen.send_signal(signal.SIGINT)
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()

    def _find_step(self) -> str | None:
        """``JOB.STEP`` of this step (squeue names the steps of the job), cached."""
        if self.step_id is None:
            res = subprocess.run(["squeue", "-h", "-s", "-j", self.job, "-o", "%i %j"], capture_output=True,
                                 text=True, timeout=SCANCEL_S, check=False)
            for line in res.stdout.splitlines():
                step, _, name = line.strip().partition(" ")
                if name.strip() == self.slot:
                    self.step_id = step
        return self.step_id


@dataclass(kw_only=True)
class LiveSteps:
    """Starts the ranks' steps (a ``live.agent.session.Spawner``): a rank of the first group on its node; a
    replacement, on a standby of a spare node, the ranks of one lost node together on one spare node (a node's ranks
    are replaced in one generation: ``live.agent.rules``). ``standby(host, per_node)`` starts a spare's standbys."""

    job: str
    python: tuple[str, ...]
    """The interpreter's argv before ``-m ddpkit`` (``/venv/bin/python``)."""
    command: tuple[str, ...]
    """ddpkit's command (``train --epochs 40 ...``, ``run train.py``)."""
    store: Any
    address: str
    hosts: dict[int, str]
    """Rank -> its node, for the first group."""
    env: dict[str, str] = field(default_factory=dict)
    """Every rank's extra variables (the attempt's)."""
    standbys: dict[str, list[_Step]] = field(default_factory=dict)
    """A spare node -> its standbys not yet given a rank."""
    moved: dict[tuple[str, str], str] = field(default_factory=dict)
    """(generation, lost node) -> the spare node its ranks go to."""
    per_node: int = 1
    assigned: dict[str, list[_Step]] = field(default_factory=dict)
    """A spare node -> the replacements started there."""
    started: list[_Step] = field(default_factory=list)
    """Every step started (a killed one on a node cut off is ended at the end)."""
    pulses: _Pulses = field(init=False)
    """Every step's pulse, read in one round trip."""

    def __post_init__(self) -> None:
        self.pulses = _Pulses(self.store)

    def _step(self, host: str, slot: str) -> _Step:
        self.pulses.add(slot)
        argv = ["srun", f"--nodelist={host}", "--nodes=1", "--ntasks=1", "--overlap", f"--job-name={slot}",
                *self.python, "-m", "ddpkit.standby", "--store", f"{self.address}:{self.store.port}", "--slot", slot,
                "--", *self.command]
        popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, start_new_session=True)
        self.started.append(_Step(popen=popen, host=host, slot=slot, job=self.job, store=self.store,
                                  pulses=self.pulses))
        return self.started[-1]

    def standby(self, host: str, per_node: int = 1) -> None:
        """``per_node`` standbys on spare node ``host``: one for each rank a lost node held."""
        self.standbys[host] = [self._step(host, f"ddpkit-standby-{host}-{i}") for i in range(per_node)]

    def __call__(self, rank: int, env: dict[str, str]) -> Proc | None:
        env = {**env, **self.env}
        gen = env.get(LIVE_GEN, "0")
        if gen == "0":
            slot = f"ddpkit-rank-{rank}"
            LiveStore(self.store).assign(slot, env)
            return self._step(self.hosts[rank], slot)
        for waiting in self.standbys.values():
            waiting[:] = [step for step in waiting if step.wait() is None]  # a standby that ended is no standby
        lost_node = env.get("GROUP_RANK", str(rank))
        spare = self.moved.get((gen, lost_node))
        if spare is None:
            spare = next((host for host, waiting in self.standbys.items() if waiting
                          and host not in self.moved.values()), None) \
                or next((host for host in self.standbys if self._room(host)), None)
            if spare is None:
                return None
            self.moved[(gen, lost_node)] = spare
        if self.standbys.get(spare):
            step = self.standbys[spare].pop(0)
            LiveStore(self.store).assign(step.slot, env)
        elif self._room(spare):  # a standby spent on a replacement that was superseded: one started afresh
            slot = f"ddpkit-rank-{rank}-gen-{gen}"
            LiveStore(self.store).assign(slot, env)
            step = self._step(spare, slot)
        else:  # that spare is full: the node's ranks go on where another spare has a standby (split, not lost)
            other = next((host for host, waiting in self.standbys.items() if waiting), None)
            if other is None:
                return None
            spare, step = other, self.standbys[other].pop(0)
            LiveStore(self.store).assign(step.slot, env)
        self.assigned.setdefault(spare, []).append(step)
        return step

    def _room(self, host: str) -> bool:
        """Spare node ``host`` runs fewer than ``per_node`` ranks and standbys (a replacement ended, or being ended
        by the agent, counts no more)."""
        running = [step for step in self.assigned.get(host, []) if step.wait() is None and not step.killed]
        self.assigned[host] = running
        return len(running) + len(self.standbys.get(host, [])) < self.per_node

    def end(self) -> None:
        """The job is over: each standby not needed is told so (it ends with exit 0), else its step is ended."""
        left = [step for waiting in self.standbys.values() for step in waiting]
        for step in left:
            LiveStore(self.store).assign(step.slot, None)
        until = time.monotonic() + STANDBY_END_S
        for step in left:
            while step.wait() is None and time.monotonic() < until:
                time.sleep(0.1)
            step.close()
        self.standbys.clear()
        for step in self.started:  # srun still waiting on a node cut off
            if step.killed:
                step.close()


def run_live_attempt(*, job: str, program: tuple[str, ...], hosts: tuple[str, ...], spares: tuple[str, ...],
                     env: dict[str, str], on_heal: LiveHook, marks_in: str, per_node: int = 1,
                     ) -> tuple[AttemptResult, dict[int, str]]:
    """One attempt: ``per_node`` ranks on each of ``hosts`` (rank R on ``hosts[R // per_node]``), as many standbys on
    each of ``spares``; how it ended, and each rank's host. ``marks_in``: a folder every node sees (the run
    directory), where the stop marks are kept."""
    at = program.index("-m")
    python, command = program[:at], program[at + 2:]
    address = socket.gethostname().split(".", 1)[0]

    def steps_for(store: Any) -> LiveSteps:
        steps = LiveSteps(job=job, python=python, command=command, store=store, address=address,
                          hosts={rank: hosts[rank // per_node] for rank in range(len(hosts) * per_node)}, env=env,
                          per_node=per_node)
        for host in spares:
            steps.standby(host, per_node)
        return steps

    session = LiveSession(world=len(hosts) * per_node, address=address, run_id=f"ddpkit-live-{job}",
                          on_heal=on_heal, per_host=per_node, marks_in=marks_in, poll_s=POLL_S)
    try:
        return session.run(steps_for)
    finally:
        sys.stdout.flush()
