"""A host's part of a job healed live across hosts (``ddpkit run|train -j NxP --rdzv-endpoint HOST:PORT --heal
live`` on a host that is not the endpoint's): the member. It imported torch and the program once, connects to the
live agent at the endpoint (``live.agent.hosts``), and from then on does what the agent says, over one connection
(``live.agent.wire``): it forks each rank it is given from itself (as one host's agent does: ``live.agent.host``),
signals and closes them when told, and says each one's start, end and what its host's kernel says of it every
``BEAT_S``. A standby host (``--standby``, or a host beyond the world's N) holds no rank until a host is lost.

The agent's end ends the member: its ranks are ended (they die with the member in any case: ``die_with_agent``), and
it exits with the code the agent gave, or, where the connection broke, with 3 and one line saying that the endpoint's
host, which holds the job's store and its agent, is gone (as under torch elastic's c10d: that host cannot be healed
away).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any

from ddpkit.base.errors import EXIT_MISSING
from ddpkit.base.log import get_logger
from ddpkit.live.agent.proc import Proc
from ddpkit.live.agent.wire import BEAT_S, Wire
from ddpkit.process.stopping import mark_outside_signal, mark_own_stop, take_abort_orders
from ddpkit.process.worker_context import PREEMPTED_MARK, STOP_DIR

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["connect", "serve"]

log = get_logger(__name__)

#: How often the member looks at its ranks and the line (seconds).
POLL_S = 0.05
#: How long the member's ranks get to end on a SIGTERM once the agent is gone (seconds), before SIGKILL.
END_GRACE_S = 10.0
TAKEN = ("SIGTERM", "SIGINT", "SIGUSR1")


def connect(host: str, port: int, hello: dict[str, Any], timeout: float) -> Wire:
    """The connection to the live agent at ``host:port``, tried until it answers (the endpoint's host may start
    later), ``timeout`` seconds at most; ``hello`` said first."""
    deadline = time.monotonic() + timeout
    said = False
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=5)
            break
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the live agent at {host}:{port} did not answer within {timeout:.0f} s "
                                   f"({exc})") from exc
            if not said:
                print(f"ddpkit live: waiting for the live agent at {host}:{port} (the endpoint's host), up to "
                      f"{timeout:.0f} s", file=sys.stderr, flush=True)
                said = True
            time.sleep(0.5)
    wire = Wire(sock)
    wire.send(hello)
    return wire


def serve(wire: Wire, spawn: Callable[[int, dict[str, str]], Proc], endpoint: str,
          tail_of: Callable[[int], str | None] = lambda rank: None) -> int:
    """Do what the agent says until it ends the job (its code) or is gone (3, said); ``spawn(rank, env)`` forks a
    rank here; ``tail_of(rank)``: the end of its stderr, sent with a failed rank's end (the agent's host classifies
    the attempt from its traceback)."""
    marks = tempfile.mkdtemp(prefix="ddpkit-live-member-")
    os.environ[STOP_DIR] = os.path.join(marks, "stops")
    os.mkdir(os.environ[STOP_DIR])
    os.environ[PREEMPTED_MARK] = os.path.join(marks, "preempted")
    member = _Member(wire=wire, spawn=spawn, tail_of=tail_of)
    before = {name: signal.signal(getattr(signal, name), member.on_outside_signal) for name in TAKEN}
    try:
        code = member.loop()
        if code is None:
            print(f"ddpkit live: the endpoint's host ({endpoint}) is gone: it holds the job's store and its live "
                  "agent, which cannot be healed away (as under torch elastic's c10d); ending this host's ranks",
                  file=sys.stderr, flush=True)
            return EXIT_MISSING  # its ranks ended below
        return code
    finally:
        for name, handler in before.items():
            signal.signal(getattr(signal, name), handler)
        member.end_all()
        wire.close()
        shutil.rmtree(marks, ignore_errors=True)


class _Member:
    def __init__(self, *, wire: Wire, spawn: Callable[[int, dict[str, str]], Proc],
                 tail_of: Callable[[int], str | None]) -> None:
        self.wire, self.spawn, self.tail_of = wire, spawn, tail_of
        self.procs: dict[int, Proc] = {}
        self.rank_of: dict[int, int] = {}
        self.ended: set[int] = set()
        self.beats = 0

    def loop(self) -> int | None:
        """The agent's code once it ends the job; None where the connection broke."""
        beat_at = 0.0
        while True:
            messages = self.wire.receive(POLL_S)
            if messages is None:
                return None
            for message in messages:
                code = self.on(message)
                if code is not None:
                    return code
            for ident, proc in self.procs.items():
                if ident not in self.ended and (code := proc.wait()) is not None:
                    self.ended.add(ident)
                    # a rank that exited with a code (not one killed): what it said, for the attempt's end
                    self.wire.send({"exit": ident, "code": code, **(self._evidence(ident) if code > 0 else {})})
            now = time.monotonic()
            if now - beat_at >= BEAT_S:
                beat_at = now
                self.beats += 1
                seen = {str(i): [state.name, ticks] for i, p in self.procs.items() if i not in self.ended
                        for state, ticks in (p.look(),)}
                self.wire.send({"seen": seen, "beat": self.beats})

    def _evidence(self, ident: int) -> dict[str, Any]:
        """What a failed rank left here for the attempt's classification: its rank, the end of its stderr, and the
        watch's abort orders this host's ranks left (``process.stopping``)."""
        rank = self.rank_of[ident]
        return {"rank": rank, "tail": self.tail_of(rank) or "", "orders": take_abort_orders(os.environ[STOP_DIR])}

    def on(self, message: dict[str, Any]) -> int | None:
        if "start" in message:
            ident = int(message["start"])
            self.rank_of[ident] = int(message["rank"])
            proc = self.spawn(int(message["rank"]), {str(k): str(v) for k, v in message["env"].items()})
            self.procs[ident] = proc
            self.wire.send({"started": ident, "pid": proc.pid})
        elif "signal" in message:
            signalled = self.procs.get(int(message["signal"]))
            if signalled is not None and int(message["signal"]) not in self.ended:
                if message.get("outside"):
                    mark_outside_signal(os.environ.get(STOP_DIR), str(message["outside"]))
                elif message.get("own"):
                    mark_own_stop(os.environ.get(STOP_DIR), [signalled.pid])
                signalled.send(signal.Signals(int(message["sig"])))
        elif "close" in message:
            closed = self.procs.get(int(message["close"]))
            if closed is not None:
                if closed.wait() is None:
                    closed.send(signal.SIGKILL)
                closed.close()
        elif "end" in message:
            why = message.get("why")
            if why:
                print(f"ddpkit live: {why}", file=sys.stderr, flush=True)
            return int(message["end"])
        return None

    def on_outside_signal(self, signum: int, frame: object) -> None:
        """A signal from outside reached this host: the agent decides for the whole job (it stops every rank)."""
        name = signal.Signals(signum).name
        if not self.wire.send({"outside": name}):  # no agent to tell: this host's ranks stop on their own
            mark_outside_signal(os.environ.get(STOP_DIR), name)
            for ident, proc in self.procs.items():
                if ident not in self.ended:
                    proc.send(signal.Signals(signum))

    def end_all(self) -> None:
        """End every rank still running here: SIGTERM, then SIGKILL after ``END_GRACE_S``."""
        running = [p for i, p in self.procs.items() if i not in self.ended and p.wait() is None]
        mark_own_stop(os.environ.get(STOP_DIR), [p.pid for p in running])
        for proc in running:
            proc.send(signal.SIGTERM)
        deadline = time.monotonic() + END_GRACE_S
        while any(p.wait() is None for p in running) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        for proc in self.procs.values():
            if proc.wait() is None:
                proc.send(signal.SIGKILL)
            proc.close()
        self.procs.clear()
