"""One live attempt, the same for every spawner (one host's forker, Slurm's steps): the agent's store, the stop
directory its ranks read (``ddpkit.process.stopping``: a signal from outside marked before it is forwarded, a
preempted rank's exit code), the signals taken from outside and forwarded (SIGINT and ``launch.stops.FORWARDED``, as
ddpkit's torch agent takes them), each rank's variables, the agent's rules (``live.agent.rules``), and the end: every
rank still running killed, the spawner's own left-overs ended (a standby not needed), the marks removed.

A spawner keeps only how it starts a rank and looks at it (``Spawner``): ``live.agent.host`` forks each rank on this
host, ``live.agent.slurm`` starts each as an srun step and keeps a standby on each spare node.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ddpkit.launch.result import AttemptResult, abort_orders
from ddpkit.launch.stops import FORWARDED
from ddpkit.live.agent.proc import Proc, rank_env
from ddpkit.live.agent.rules import POLL_S, LiveAgent
from ddpkit.process.worker_context import PREEMPTED_MARK, STOP_DIR
from ddpkit.rundir.ledger import LiveHook

__all__ = ["TAKEN", "LiveSession", "Spawner"]

#: The signals a live agent takes from outside, marks and forwards to every rank.
TAKEN = ("SIGINT", *FORWARDED)


class Spawner(Protocol):
    """How ranks start: ``spawn(rank, env)`` the rank's process (None: nothing can take a lost rank's place);
    ``end()`` once the attempt is over (the ranks are ended by then): whatever else it started."""

    def __call__(self, rank: int, env: dict[str, str]) -> Proc | None: ...

    def end(self) -> None: ...


@dataclass(kw_only=True)
class LiveSession:
    """One attempt of ``world`` ranks healed live; ``run(spawner_for)`` runs it."""

    world: int
    address: str
    """Where the ranks reach the agent's stores (this host's name, or 127.0.0.1 where every rank runs here)."""
    run_id: str
    on_heal: LiveHook
    """The attempt's ledger: told each heal once its replacements train, and replicas found to differ."""
    per_host: int | None = None
    """Ranks per host (None: all on this one); rank R's host is the group R // per_host."""
    marks_in: str | None = None
    """Where the stop directory is made: a folder every rank's host sees (the run directory under Slurm); None: this
    host's temporary directory."""
    poll_s: float = POLL_S

    def run(self, spawner_for: Callable[[Any], Spawner]) -> tuple[AttemptResult, dict[int, str]]:
        """The attempt, its ranks started by ``spawner_for(the agent's store)``: how it ended, and each rank's host at
        the end."""
        import torch.distributed as dist

        marks = tempfile.mkdtemp(prefix="ddpkit-live-", dir=self.marks_in)
        before_env = {name: os.environ.get(name) for name in (STOP_DIR, PREEMPTED_MARK)}
        agent: LiveAgent | None = None
        spawn: Spawner | None = None
        before: dict[str, Any] = {}
        try:
            os.environ[STOP_DIR] = os.path.join(marks, "stops")
            os.mkdir(os.environ[STOP_DIR])
            os.environ[PREEMPTED_MARK] = os.path.join(marks, "preempted")
            store = dist.TCPStore(self.address, 0, is_master=True, wait_for_workers=False)
            spawn = spawner_for(store)
            agent = LiveAgent(spawn=spawn, on_heal=self.on_heal, store=store, address=self.address,
                              poll_s=self.poll_s)
            before = {name: signal.signal(getattr(signal, name), agent.on_outside_signal) for name in TAKEN}
            per_host = self.per_host or self.world
            result = agent.run({rank: rank_env(rank, self.world, address=self.address, port=store.port,
                                               run_id=self.run_id, per_host=per_host, group_rank=rank // per_host)
                                for rank in range(self.world)})
            # the watch's abort orders (who stopped answering), as torch's agent reads them: a heal that ends the
            # attempt is classified from them (launch.agent)
            result = dataclasses.replace(result, watch_orders=abort_orders(os.environ[STOP_DIR]))
            return result, {rank: r.proc.host for rank, r in agent.ranks.items()}
        finally:
            for name, handler in before.items():
                signal.signal(getattr(signal, name), handler)
            if agent is not None:
                agent.stop_all(signal.SIGKILL)
            if spawn is not None:
                spawn.end()
            for r in agent.ranks.values() if agent is not None else ():
                r.proc.close()
            for name, value in before_env.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            shutil.rmtree(marks, ignore_errors=True)
