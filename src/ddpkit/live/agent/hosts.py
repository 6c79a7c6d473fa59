"""Live healing across hosts without Slurm (``ddpkit run|train -j NxP --rdzv-endpoint HOST:PORT --heal live`` on every
host, ``--standby`` on the standby hosts): the live agent's side. The endpoint's host runs the agent (the rules of
``live.agent.rules``, in the session every spawner shares: ``live.agent.session``) and hosts its stores; every other
host runs a member (``live.agent.member``) that connects to the endpoint and forks the ranks the agent gives it
(``live.agent.wire``: one connection a host, held for the whole job).

- A member's connection ending (its process killed, its host gone down) is its host's ranks lost, seen at once
  (they die with it: ``launch.worker.die_with_agent``). A rank killed on a live host: its member says its end. A
  rank stopped: its member's beat says so (the kernel's ``T``). A host cut off or frozen: its beat stands still
  ``SILENT_S``; its ranks are then lost as a Slurm node cut off is (``live.agent.slurm``: ended, unreached
  ``UNREACHED_S`` later), and the survivors shut their connections to it (``live.rank.unblock``).
- A lost host's ranks are replaced together in one generation, on one standby host (a host started with
  ``--standby``, or one beyond the world's N), forked by its member from a process that imported torch and the
  program already.
- The endpoint's host holds the stores and the agent: losing it ends the job (its members say so and exit 3), as
  losing the c10d store's host ends a torch elastic job.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ddpkit.base.log import get_logger
from ddpkit.launch.result import AttemptResult
from ddpkit.live.agent.proc import Proc, Seen
from ddpkit.live.agent.session import LiveSession
from ddpkit.live.agent.wire import Wire
from ddpkit.process.stopping import marked_signal
from ddpkit.process.worker_context import LIVE_GEN, STOP_DIR
from ddpkit.rundir.ledger import LiveHook

__all__ = ["Member", "Members", "run_hosts_attempt"]

log = get_logger(__name__)

#: A member's beat standing still this long (seconds; it speaks every ``wire.BEAT_S``): its host is frozen or cut off.
SILENT_S = 3.0
#: A rank the agent killed whose host stayed silent this long after (seconds): its host is cut off, the rank is taken
#: as ended by the SIGKILL it was sent (as under Slurm, ``live.agent.slurm.UNREACHED_S``).
UNREACHED_S = 1.0
#: The longest a member may take to say it started a rank (seconds).
START_S = 30.0
#: The longest a joining host may take to say who it is (seconds).
HELLO_S = 10.0
#: How often the agent looks at its ranks (seconds): as under Slurm (each look reads every rank's keys in its store;
#: a member's end is heard by its reader thread at once, and acted on at the next look).
POLL_S = 0.1


@dataclass(kw_only=True)
class Member:
    """A host of the job as the agent sees it: its member's connection (None: the agent's own host)."""

    name: str
    address: str
    per_node: int
    standby: bool
    wire: Wire | None = None
    pid: int = 0
    procs: dict[int, _Remote] = field(default_factory=dict)
    heard: float = field(default_factory=time.monotonic)
    """When the member last said anything (``time.monotonic``)."""
    gone: bool = False
    """Its connection ended: the member's process, and so its ranks, are gone."""
    said: list[tuple[int, str]] = field(default_factory=list)
    """(rank, the end of its stderr) for each of its ranks that failed, as its member sent them."""
    orders: list[str] = field(default_factory=list)
    """The watch's abort orders its ranks left (JSON), as its member sent them."""

    def listen(self, on_outside: Callable[[str], None]) -> None:
        """Read the member's messages until its connection ends (a thread of its own)."""
        assert self.wire is not None
        while True:
            messages = self.wire.receive(1.0)
            if messages is None:
                self.gone = True
                if any(p.code is None for p in self.procs.values()):
                    log.warning("host %s's member (pid %d) is gone: its connection to the live agent ended",
                                self.name, self.pid)
                return
            now = time.monotonic()
            if messages:
                self.heard = now
            for message in messages:
                self._on(message, now, on_outside)

    def _on(self, message: dict[str, Any], now: float, on_outside: Callable[[str], None]) -> None:
        if "seen" in message:
            for ident, (state, ticks) in message["seen"].items():
                proc = self.procs.get(int(ident))
                if proc is not None:
                    proc.seen, proc.seen_at = (Seen[state], int(ticks)), now
        elif "started" in message:
            proc = self.procs.get(int(message["started"]))
            if proc is not None:
                proc.remote_pid = int(message["pid"])
                proc.seen_at = now
                proc.started.set()
        elif "exit" in message:
            proc = self.procs.get(int(message["exit"]))
            if "rank" in message:  # before the code: the attempt's end reads them
                self.said.append((int(message["rank"]), str(message.get("tail", ""))))
                self.orders.extend(str(order) for order in message.get("orders", ()))
            if proc is not None:
                proc.code = int(message["code"])
        elif "outside" in message:
            on_outside(str(message["outside"]))


@dataclass(kw_only=True)
class _Remote:
    """A rank forked by a member on its host (a ``live.agent.proc.Proc``), seen through the member's messages."""

    ident: int
    member: Member
    host: str
    silent_s: float = SILENT_S
    remote_pid: int = 0
    code: int | None = None
    """Its exit code, as its member said it (negative: a signal)."""
    seen: tuple[Seen, int] = (Seen.RUNNING, -1)
    seen_at: float = 0.0
    killed_at: float | None = None
    started: threading.Event = field(default_factory=threading.Event)

    @property
    def pid(self) -> int:
        return self.remote_pid

    def wait(self) -> int | None:
        if self.code is not None:
            return self.code
        if self.member.gone:  # the member is gone, and its ranks with it
            return -int(signal.SIGKILL)
        unreached = self.killed_at is not None and time.monotonic() - self.killed_at >= UNREACHED_S
        return -int(signal.SIGKILL) if unreached and self.look()[0] is Seen.SILENT else None

    def look(self) -> tuple[Seen, int]:
        if time.monotonic() - self.member.heard >= self.silent_s:
            return Seen.SILENT, self.seen[1]
        return self.seen

    def heard_since(self, since: float) -> bool:
        return self.seen_at > since and self.code is None and not self.member.gone

    def send(self, sig: signal.Signals) -> None:
        if sig is signal.SIGKILL and self.killed_at is None:
            self.killed_at = time.monotonic()
        if self.member.wire is not None and not self.member.gone:
            outside = marked_signal(os.environ.get(STOP_DIR))
            self.member.wire.send({"signal": self.ident, "sig": int(sig), "outside": outside,
                                   "own": outside is None})

    def close(self) -> None:
        if self.member.wire is not None and not self.member.gone:
            self.member.wire.send({"close": self.ident})


class Members:
    """The job's hosts: the agent's own, and each member that connected to the endpoint (``server``), in the order
    they joined."""

    def __init__(self, server: socket.socket, here: Member, *, run_id: str) -> None:
        self.server, self.run_id = server, run_id
        self.joined: list[Member] = [here]
        self.per_node = here.per_node
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        threading.Thread(target=self._accept, name="ddpkit-live-accept", daemon=True).start()

    def next_id(self) -> int:
        return next(self._ids)

    def alive(self) -> list[Member]:
        with self._lock:
            return [m for m in self.joined if not m.gone]

    def named(self, name: str) -> Member | None:
        return next((m for m in self.alive() if m.name == name), None)

    def take_evidence(self) -> tuple[list[tuple[int, str]], list[str]]:
        """What the members sent of their failed ranks since it was last taken: (rank, the end of its stderr) and
        the watch's abort orders (JSON)."""
        with self._lock:
            joined = list(self.joined)
        tails, orders = [], []
        for member in joined:
            tails += member.said
            orders += member.orders
            member.said, member.orders = [], []
        return tails, orders

    def wait_for(self, hosts: int, timeout: float) -> bool:
        """Wait until ``hosts`` hosts that are not standbys joined, ``timeout`` seconds at most."""
        deadline = time.monotonic() + timeout
        while sum(not m.standby for m in self.alive()) < hosts:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        return True

    def end(self, code_of: Callable[[Member], tuple[int, str | None]]) -> None:
        """The job is over: each member told its exit code (and why, where it is not the job's), the server shut."""
        with contextlib.suppress(OSError):
            self.server.close()
        for member in self.alive():
            if member.wire is not None:
                code, why = code_of(member)
                member.wire.send({"end": code, "why": why})
        for member in self.joined:
            if member.wire is not None:
                member.wire.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, peer = self.server.accept()
            except OSError:
                return  # the server was shut: the job is over
            threading.Thread(target=self._greet, args=(sock, peer[0]), name="ddpkit-live-member",
                             daemon=True).start()

    def _greet(self, sock: socket.socket, address: str) -> None:
        wire = Wire(sock)
        deadline = time.monotonic() + HELLO_S
        hello: dict[str, Any] | None = None
        while hello is None and time.monotonic() < deadline:
            messages = wire.receive(0.5)
            if messages is None:
                return
            hello = next((m for m in messages if "hello" in m), None)
        if hello is None:
            wire.close()
            return
        name, per_node = str(hello["hello"]), int(hello.get("per_node", 0))
        refused = None
        if per_node != self.per_node:
            refused = f"host {name} asked for {per_node} rank(s) a host; the job's -j says {self.per_node}"
        elif self.named(name) is not None:
            refused = f"a host named {name} is in the job already"
        if refused is not None:
            print(f"ddpkit live: {refused}: not taken", file=sys.stderr, flush=True)
            wire.send({"end": 2, "why": f"{refused}: this host was not taken into run {self.run_id}"})
            wire.close()
            return
        member = Member(name=name, address=address, per_node=per_node, standby=bool(hello.get("standby")),
                        wire=wire, pid=int(hello.get("pid", 0)))
        with self._lock:
            self.joined.append(member)
        print(f"ddpkit live: host {name} ({address}) joined run {self.run_id}"
              f"{' as a standby' if member.standby else ''}", file=sys.stderr, flush=True)
        member.listen(lambda name: os.kill(os.getpid(), getattr(signal, name)))  # as if it reached the agent


@dataclass(kw_only=True)
class _Spawner:
    """Starts the ranks on the job's hosts (a ``live.agent.session.Spawner``): rank R of the first group on
    ``world[R // per_node]``; a lost host's ranks together on one standby host (another where it is full)."""

    members: Members
    world: tuple[Member, ...]
    spares: Callable[[], tuple[Member, ...]]
    """The standby hosts now (a host may join while the attempt runs: a pod started late)."""
    per_node: int
    fork_here: Callable[[int, dict[str, str]], Proc]
    moved: dict[tuple[str, str], Member] = field(default_factory=dict)
    """(generation, lost host's group rank) -> the standby host its ranks go to."""
    placed: dict[str, list[Proc]] = field(default_factory=dict)
    """A standby host -> the replacements started there."""

    def __call__(self, rank: int, env: dict[str, str]) -> Proc | None:
        gen = env.get(LIVE_GEN, "0")
        if gen == "0":
            return self._start(self.world[rank // self.per_node], rank, env)
        lost = env.get("GROUP_RANK", str(rank))
        spare = self.moved.get((gen, lost))
        if spare is None or not self._room(spare):
            free = [m for m in self.spares() if not m.gone and self._room(m)]
            spare = next((m for m in free if m not in self.moved.values()), None) or next(iter(free), None)
            if spare is None:
                return None
            self.moved[(gen, lost)] = spare
        started = self._start(spare, rank, env)
        if started is not None:
            self.placed.setdefault(spare.name, []).append(started)
        return started

    def _room(self, member: Member) -> bool:
        running = [p for p in self.placed.get(member.name, [])
                   if p.wait() is None and getattr(p, "killed_at", None) is None]
        self.placed[member.name] = running
        return len(running) < self.per_node

    def _start(self, member: Member, rank: int, env: dict[str, str]) -> Proc | None:
        if member.wire is None:
            return self.fork_here(rank, env)
        remote = _Remote(ident=self.members.next_id(), member=member, host=member.name)
        member.procs[remote.ident] = remote
        if not member.wire.send({"start": remote.ident, "rank": rank, "env": env}) \
                or not remote.started.wait(START_S):
            log.error("host %s did not start rank %d within %.0f s", member.name, rank, START_S)
            return None
        return remote

    def end(self) -> None:
        """Nothing of its own to end: each rank is closed by the session."""


def run_hosts_attempt(*, members: Members, world: tuple[Member, ...], spares: Callable[[], tuple[Member, ...]],
                      address: str,
                      run_id: str, on_heal: LiveHook, fork_here: Callable[[int, dict[str, str]], Proc],
                      ) -> tuple[AttemptResult, dict[int, str]]:
    """One attempt: ``per_node`` ranks on each of ``world``, ``spares()`` standing by; how it ended, and each
    rank's host. ``address``: where the ranks reach the agent's stores (the endpoint's host)."""
    per_node = members.per_node
    session = LiveSession(world=len(world) * per_node, address=address, run_id=run_id, on_heal=on_heal,
                          per_host=per_node, poll_s=POLL_S)
    try:
        return session.run(lambda store: _Spawner(members=members, world=world, spares=spares, per_node=per_node,
                                                  fork_here=fork_here))
    finally:
        sys.stdout.flush()
