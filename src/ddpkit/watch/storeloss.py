"""When the job's store stops answering: this rank watches on alone, from what it saw last.

The watch's heartbeats, claims and abort orders go through the job's store. Its host is torchrun's agent, or rank 0
itself (env:// under ``ddpkit run -n``, mpirun, srun: rank 0 creates the store at MASTER_ADDR:MASTER_PORT). A rank 0
that is stopped (SIGSTOP), or whose host froze, takes the store along: every other rank's watch lost its only way
to report, and the job hung in silence (issue 36: nothing in 125 s with ``--hang-after 10``).

So a rank whose store stopped answering watches its own progress, unless the store's holder left on its own (its
last record was final, or its process on this host is gone): then, as before, watching ends. While it progresses,
nothing is said. When it has made no progress past the hang deadline, it reports on its own:
the store's host (and, on this host, whether that process is stopped or gone, from /proc), the other ranks as last
seen, this rank's stacks; at the stop deadline it stops (exit 3) and a stopped peer on this host is killed. Each rank
decides for itself: with no store there is nothing to agree through, and a rank whose collective then fails
("Connection reset by peer") is reported by the failure path as usual.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ddpkit.base.netinfo import is_local_address, resolve
from ddpkit.process.worker_context import WorkerContext
from ddpkit.watch.options import WatchOptions, hang_deadline, stop_deadline
from ddpkit.watch.processes import listening_pid, process_state, python_stacks
from ddpkit.watch.records import AbortOrder, Heartbeat

__all__ = ["KILL_AFTER_S", "Peer", "StoreHost", "StoreLoss", "holder_left", "store_host"]

#: How long after this rank has gone a stopped peer on its host is killed (its launcher sees this rank leave first).
KILL_AFTER_S = 1.0


@dataclass(frozen=True)
class StoreHost:
    """Who holds the job's store: rank 0's process, or the launcher's agent (torchrun's shared store)."""

    address: str
    """HOST:PORT, as the ranks connect to it."""
    rank: int | None
    """0 when rank 0 holds it; None when the launcher's agent does."""
    host: str | None = None
    port: int | None = None
    """MASTER_ADDR and MASTER_PORT, where given."""

    def local_port(self) -> int | None:
        """The store's port when it listens on this host (a loopback address, or one of this host's own), else
        None."""
        if self.port is None or not self.host:
            return None
        try:
            return self.port if is_local_address(resolve(self.host)) else None
        except (OSError, ValueError):
            return None

    def describe(self, peers: dict[int, Peer]) -> str:
        if self.rank is None:
            return f"the job's store at {self.address} (held by the launcher's agent)"
        peer = peers.get(self.rank)
        where = f" on host {peer.host}, pid {peer.pid}" if peer else ""
        return f"the job's store at {self.address} (held by rank {self.rank}{where})"


@dataclass(frozen=True)
class Peer:
    """Another rank as this rank knows it once the store is silent: from its last record, or (the store's holder,
    never read) from the process that listens on the store's port. ``step`` None: no record of it was read.
    ``state``: ``running``, ``stopped`` or ``gone`` on this host (``process_state``), ``finished`` (its last record
    says it ended well), ``elsewhere`` (another host: unknown)."""

    host: str
    pid: int
    step: int | None
    state: str


def store_host(context: WorkerContext | None = None) -> StoreHost:
    """From how this rank was started: torchrun's workers share the agent's store unless
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (ddpkit's agent sets it); then, and under every other launcher, rank 0
    creates it at MASTER_ADDR:MASTER_PORT."""
    ctx = context or WorkerContext.from_environ()
    address = f"{ctx.master_addr or '?'}:{ctx.master_port or '?'}"
    return StoreHost(address=address, rank=None if ctx.agent_store else 0, host=ctx.master_addr, port=ctx.master_port)


def holder_left(records: dict[int, Heartbeat | None], host: str) -> bool:
    """Whether the store's holder left on its own: its last record says it finished (the watch's final record), or it
    ran on this host and its process is gone (it finished between two reads, or died: then this rank's collective
    with it fails and the failure report says so). Either way there is nothing to watch for alone."""
    holder = store_host()
    last = records.get(holder.rank) if holder.rank is not None else None
    if last is None:
        return False
    return bool(last.get("final")) or (last["host"] == host and process_state(last["pid"]) == "gone")


class StoreLoss:
    """One rank's watch while the job's store does not answer (``Monitor`` calls ``tick`` from its loop)."""

    def __init__(self, *, rank: int, host: str, options: WatchOptions, records: dict[int, Heartbeat | None],
                 progress: Callable[[], tuple[Any, ...]], emit: Callable[[list[str], dict[str, Any]], None],
                 stop: Callable[[str | None], object], abort_handlers: Callable[[AbortOrder], object], error: str,
                 since: float, slowest_gap: float, first_step_done: bool) -> None:
        self.rank, self.host, self.options = rank, host, options
        self.records = records  # as last read: who was where, with pids and hosts
        self.progress = progress
        self.emit, self.stop = emit, stop
        self.abort_handlers = abort_handlers  # the command's own last words (train's lost-peer report) before exit 3
        self._headline = ""
        self.error = error
        self.lost_at = since
        self._last = progress()
        self._last_at = since
        self._reported = False
        # whether the job made a step: this rank's own word counts (the store may have gone before it read anyone's)
        self.report_after = hang_deadline(options, slowest_gap=slowest_gap, first_step_done=first_step_done)
        self.stop_after = stop_deadline(options, report_deadline=self.report_after)
        self.holder = store_host()
        if options.silent_stop is not None:  # under --heal: a store silent that long is its holder lost, at once
            self.report_after = self.stop_after = options.silent_stop

    def tick(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        current = self.progress()
        if current != self._last:
            if self._reported:
                self.emit([f"ddpkit watch: rank {self.rank} on host {self.host}: progress resumed after "
                           f"{now - self._last_at:.0f} s, with the job's store still silent"],
                          {"event": "resumed", "reporter": self.rank, "store_lost": self.error})
                self._reported = False
            self._last, self._last_at = current, now
            return
        idle = now - self._last_at
        if not self._reported and idle >= self.report_after:
            self._reported = True
            self._report(idle)
        if self.stop_after is not None and idle >= self.stop_after:
            self._stop()

    def _peers(self) -> dict[int, Peer]:
        """The other ranks as last seen, with their state where they run on this host. The store's holder, when this
        rank never read its record (the store went silent first: a fault in the job's first second), is the process
        on this host that listens on the store's port."""
        out = {}
        for r, rec in sorted(self.records.items()):
            if rec is None or r == self.rank:
                continue
            state = "finished" if rec.get("finished") else \
                process_state(rec["pid"]) if rec["host"] == self.host else "elsewhere"
            out[r] = Peer(host=rec["host"], pid=rec["pid"], step=rec["step"], state=state)
        holder = self.holder.rank
        port = self.holder.local_port() if holder is not None and holder != self.rank and holder not in out else None
        if holder is not None and port is not None:
            pid = listening_pid(port)
            if pid is not None:
                out[holder] = Peer(host=self.host, pid=pid, step=None, state=process_state(pid))
        return dict(sorted(out.items()))

    def _report(self, idle: float) -> None:
        peers = self._peers()
        holder = self.holder.describe(peers)
        stopped = [r for r, peer in peers.items() if peer.state in ("stopped", "gone")]
        culprit = ""
        if self.holder.rank is not None and self.holder.rank in stopped:
            state = peers[self.holder.rank].state
            culprit = f": rank {self.holder.rank} is {state}" + (" (SIGSTOP)" if state == "stopped" else "")
        elif stopped:
            culprit = "; on this host " + ", ".join(f"rank {r} is {peers[r].state}" for r in stopped)
        until = ""
        if self.stop_after is not None:
            at = time.strftime("%H:%M:%S", time.localtime(time.time() + self.stop_after - idle))
            until = f"; this rank stops at {at} unless progress resumes"
        lines = [f"ddpkit watch: HANG: rank {self.rank} on host {self.host} has made no progress for {idle:.0f} s and "
                 f"{holder} has not answered for {time.monotonic() - self.lost_at:.0f} s{culprit}{until}"]
        silent = self._silent_holder(peers)
        if silent is not None:  # under --heal: the holder named as a silent rank, for the supervisor to take out
            lines[0] = (f"ddpkit watch: {silent} stopped answering: {holder} has not answered rank {self.rank} on "
                        f"host {self.host} for {time.monotonic() - self.lost_at:.0f} s (under --heal a silent rank "
                        f"is a lost host after {self.options.silent_stop:g} s); this rank stops now (exit 3)")
        self._headline = lines[0]
        for r, peer in peers.items():
            seen = {"stopped": "stopped (SIGSTOP)", "gone": "gone (its process no longer runs)",
                    "finished": "finished (its script ended well)", "running": "running",
                    "elsewhere": "on another host: state unknown"}[peer.state]
            last = f"last seen at step {peer.step}" if peer.step is not None else \
                "the process that holds the job's store (the store went silent before this rank read its record)"
            lines.append(f"  rank {r} on host {peer.host} (pid {peer.pid}): {seen}; {last}")
        lines += [f"--- rank {self.rank} on host {self.host} (pid {os.getpid()}): Python stacks", python_stacks()]
        self.emit(lines, {"event": "hang", "reporter": self.rank, "store_lost": self.error, "idle": round(idle, 1),
                          "stopped": stopped, "holder": self.holder.rank})

    def _silent_holder(self, peers: dict[int, Peer]) -> str | None:
        """Under --heal, ``rank 0 on host H (pid P)`` when rank 0 holds the store and is not seen running on this
        host (stopped or gone here, or on another host, where its silence is all this rank can know)."""
        if self.options.silent_stop is None or self.holder.rank is None or self.holder.rank not in peers:
            return None
        peer = peers[self.holder.rank]
        if peer.state in ("running", "finished"):
            return None
        return f"rank {self.holder.rank} on host {peer.host} (pid {peer.pid})"

    def _stop(self) -> None:
        """This rank stops, exit 3, and a stopped peer on this host is killed a moment later (it cannot end itself;
        once continued it would find no abort order in a store it holds). Later, so that the launcher sees this
        rank's exit 3 first: killed first, its death reached the launcher before and was named the job's first
        failure. By a child of this rank, since this rank is gone by then; left to itself, torch's agent waited 30 s
        before it SIGKILLed a stopped process its SIGTERM could not end."""
        self.abort_handlers(AbortOrder.from_headline(self.rank, self._headline or "HANG: no progress and no store",
                                                     silent=None, store_lost=self.error))
        stopped = [peer.pid for peer in self._peers().values() if peer.state == "stopped"]
        parent = os.getpid()
        if stopped and os.fork() == 0:  # the child only sleeps and signals: nothing that a lock could hold
            # its copies of this rank's descriptors closed: the launcher's sentinel pipe of this rank (torch's
            # forked workers) reads "exited" only once every copy of it is closed
            os.closerange(3, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 4096)
            until = time.monotonic() + 10.0
            while os.getppid() == parent and time.monotonic() < until:  # this rank gone first
                time.sleep(0.05)
            time.sleep(KILL_AFTER_S)
            for pid in stopped:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            os._exit(0)
        self.stop(f"ddpkit watch: rank {self.rank} on host {self.host} stops (no progress and no store; exit 3)")
