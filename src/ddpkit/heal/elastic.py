"""``--heal`` across hosts: ``ddpkit run|train -j MIN:MAXxP --rdzv-endpoint HOST:PORT --run-id ID --heal`` on
every host. A host whose ranks stop answering, are killed or are cut off is left out, and the job goes on on the
others (down to MIN hosts), from its snapshot.

One torch elastic agent per host for the whole run, with torch's own restarts (``--max-attempts`` - 1): when a
round fails, every host's workers stop and the agents that are left meet in a new round of the same rendezvous
(fewer nodes), where ``train`` resumes from its newest snapshot. ddpkit wraps each agent's rendezvous handler
(``HostGuard``, through ``LaunchOptions.rendezvous_guard``; torch's registry is the extension point):

- At the start of each round after a failed one, the agent classifies what its own ranks left (``elastic_round``,
  ``classify``): the
  exit code or signal torch's agent saw, the watch's abort order (which ranks stopped answering, on which hosts:
  ``process.stopping.leave_abort_order``), and under ``ddpkit run`` the ranks' tracebacks in their logs. The
  attempt goes into this host's ledger (``RUN_DIR/HOST/ledger.jsonl``) and the one-host policy decides
  (``policy.decide``: a job-class failure twice in a row, or no newer snapshot in 3 attempts, ends the run with 93
  on every host, each from its own ranks' evidence).
- A host-class failure names hosts. They go into the run's exclusion list, kept in the rendezvous store
  (``ddpkit-heal/excluded/N``, one JSON record each): every agent reads it before it joins a round and every
  second while its workers run. An agent that finds its own host there leaves the rendezvous (it is never part of
  a later round) and exits ``EXIT_HOST_EXCLUDED`` (95) with one line saying who excluded it and why. A rank
  killed by a signal names its own host: its agent excludes itself.

The store lives with the rendezvous: under c10d, on the host that holds it (``is_host``), which therefore cannot
be healed away (use ``--rdzv-backend etcd-v2`` where that host may fail too).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpkit.base.errors import ConfigError, DdpkitError
from ddpkit.base.log import get_logger
from ddpkit.heal.elastic_round import (
    EXIT_HOST_EXCLUDED,
    ExcludedFromRun,
    ExclusionList,
    HealRun,
    HealStopped,
)
from ddpkit.heal.policy import HealPolicy
from ddpkit.heal.request import HealRequest
from ddpkit.launch.failure import TORCH_WORKER_LOGGER
from ddpkit.process.worker_context import HEAL_SILENT_DEFAULT_S, HEAL_SILENT_S
from ddpkit.rundir import RunDir
from ddpkit.rundir.ledger import SupervisorStarted

if TYPE_CHECKING:
    from ddpkit.heal.request import LaunchAttempt
    from ddpkit.launch.agent import LaunchOptions

__all__ = ["HEALED_BACKENDS", "SILENT_S", "HostGuard", "stop_together", "supervise_across_hosts"]

log = get_logger(__name__)

#: The rendezvous backends whose store the exclusion list can live in (torch's dynamic rendezvous).
HEALED_BACKENDS = ("c10d", "etcd-v2")
#: Under --heal a rank whose heartbeat stopped this long is a lost host (the watch's ``silent_stop``).
SILENT_S = HEAL_SILENT_DEFAULT_S
#: How often a running agent reads the exclusion list (it is read before every round too).
POLL_S = 1.0
#: Rendezvous settings under --heal unless given: a dead agent is dropped after 3 missed 1 s keep-alives, and a
#: round closes 5 s after MIN hosts joined (torch's defaults: 5 s keep-alives, 30 s last call).
HEAL_RDZV_DEFAULTS = (("keep_alive_interval", "1"), ("last_call_timeout", "5"))
#: The run's count of hosts that stopped it (a run stops once).
_STOPPED_KEY = "ddpkit-heal/stopped"
#: How long a host that stops the run waits for the round's other hosts to stop it too (``stop_together``).
STOP_TOGETHER_S = 15.0


class SpareReleased(Exception):
    """This agent waited as a spare (torch's redundancy list: the round was full) and the run ended without it.
    torch's agent ends such a node with ``RendezvousGracefulExitError`` and then fails on its own ``None`` result
    (torch 2.13, launcher/api.py: ``result.is_failed()``); ddpkit ends it here instead, with exit 0."""


class HostGuard:
    """This host's rendezvous handler, wrapped (torch's ``RendezvousHandler`` interface, by delegation): the
    exclusion list read before every round and every ``POLL_S`` while the workers run; the run's bookkeeping at
    each round's start."""

    def __init__(self, inner: Any, name: str, run: HealRun) -> None:
        self._inner, self._name, self._run = inner, name, run
        self._left = False
        self._next_poll = 0.0

    # torch's interface
    def get_backend(self) -> str:
        return self._name

    @property
    def use_agent_store(self) -> bool:
        return bool(self._inner.use_agent_store)

    def next_rendezvous(self) -> Any:
        exclusions = self.exclusions()
        try:
            self._run.round_ended(exclusions)
        except HealStopped:
            stop_together(exclusions.store, self._run.nodes)
            raise
        self._leave_if_excluded(exclusions)
        from torch.distributed.elastic.rendezvous.api import RendezvousGracefulExitError

        try:
            info = self._inner.next_rendezvous()
        except RendezvousGracefulExitError:  # a spare whose run ended without it
            self._left = True
            raise SpareReleased() from None
        self._run.round_started(int(info.rank), int(info.world_size))
        return info

    def num_nodes_waiting(self) -> int:
        waiting = int(self._inner.num_nodes_waiting())
        if time.monotonic() >= self._next_poll:
            self._next_poll = time.monotonic() + POLL_S
            self._leave_if_excluded(self.exclusions())
        return waiting

    def is_closed(self) -> bool:
        return bool(self._inner.is_closed())

    def set_closed(self) -> None:
        self._inner.set_closed()

    def get_run_id(self) -> str:
        return str(self._inner.get_run_id())

    def shutdown(self) -> bool:
        if self._left:  # closing would end the rendezvous for the hosts that go on
            return True
        return bool(self._inner.shutdown())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    # the exclusion list
    def exclusions(self) -> ExclusionList:
        store = getattr(self._inner, "_store", None)  # torch's DynamicRendezvousHandler keeps its backend's store
        if store is None:
            raise ConfigError(f"the {self._name} rendezvous handler has no store", "torch's dynamic rendezvous "
                              f"({', '.join(HEALED_BACKENDS)})", "pass --rdzv-backend c10d")
        return ExclusionList(store)

    def _leave_if_excluded(self, exclusions: ExclusionList) -> None:
        mine = next((e for e in exclusions.read() if e.host == self._run.host), None)
        if mine is None:
            return
        self._leave()
        by = "its own agent" if mine.by == mine.host else mine.by
        line = (f"this host ({mine.host}) was excluded from run {self.get_run_id()} by {by}: {mine.reason}; "
                f"it takes no part in later rounds and leaves with exit {EXIT_HOST_EXCLUDED}; the job goes on on the "
                "other hosts")
        self._run.leaving(mine, f"ddpkit heal: {line}")
        raise ExcludedFromRun(line, "", f"check {mine.host} (ddpkit check, its logs) before it runs a job again")

    def _leave(self) -> None:
        """Out of the rendezvous now: no keep-alive, and off the round's participants, so the others' next round
        completes without waiting for this agent's keep-alive to expire (torch's own exit step, run alone)."""
        self._left = True
        _end_own_workers()
        stop = getattr(self._inner, "_stop_heartbeats", None)
        if stop is not None:
            stop()
        try:
            from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

            self._inner._op_executor.run(_RendezvousExitOp(), time.monotonic() + 10)
        except Exception as exc:  # its keep-alive stopped: the others drop it within seconds anyway
            log.debug("leaving the rendezvous: %r", exc)


def stop_together(store: Any, nodes: int, timeout: float = STOP_TOGETHER_S) -> int:
    """This host stops the run: count it in the store, then wait (at most ``timeout`` s) until the round's ``nodes``
    hosts all have. A job fault is seen on every host, and each stops on its own judgement; but the store lives
    with one of them (c10d), and a host that leaves at once takes it away from the others while they still judge
    their own ranks' failure: they could then say only "the store was lost, exit 3". Returns the hosts counted."""
    try:
        done = int(store.add(_STOPPED_KEY, 1))
        deadline = time.monotonic() + timeout
        while done < nodes and time.monotonic() < deadline:
            time.sleep(0.2)
            done = int(store.add(_STOPPED_KEY, 0))
        return done
    except Exception as exc:  # the store went with its host: the others stopped already, or will on their own
        log.debug("stopping together: %r", exc)
        return 0


def supervise_across_hosts(request: HealRequest, options: LaunchOptions,
                           launch_attempt: LaunchAttempt, *,
                           progress: Callable[[str | None], int | None],
                           start_goodput: Callable[[Path, str], None]) -> int:
    """This host's part of a healed run across hosts (the module's docstring); returns its exit code. ``progress``
    and ``start_goodput``: the one-host supervisor's (the newest snapshot step; the goodput ledger's first line)."""
    shape = options.shape
    if options.rdzv_backend not in HEALED_BACKENDS:
        raise ConfigError(f"--heal with --rdzv-backend {options.rdzv_backend}",
                          f"one of {', '.join(HEALED_BACKENDS)}: the run's exclusion list lives in its store",
                          "pass --rdzv-backend c10d (or etcd-v2)")
    if not request.run_id:
        raise ConfigError("--heal across hosts without --run-id", "the same --run-id on every host (the run's "
                          "rendezvous and its directory)", "add --run-id NAME on every host")
    host = socket.gethostname().split(".", 1)[0]
    policy = HealPolicy(max_attempts=request.max_attempts)
    base = Path(request.run_dir) if request.run_dir else RunDir.default(request.run_id).path
    run_dir = base / host  # one ledger per host: the directory may be shared by every host
    log_dir = run_dir / "logs" if request.keeps_rank_logs else None
    run = HealRun(request, host=host, run_dir=run_dir, nproc=shape.nproc_per_node, policy=policy, log_dir=log_dir,
                  progress=progress)
    conf = dict(options.rdzv_conf)
    for key, value in HEAL_RDZV_DEFAULTS:
        conf.setdefault(key, value)
    options = dataclasses.replace(options, max_restarts=policy.max_attempts - 1, rdzv_conf=tuple(conf.items()),
                                  rendezvous_guard=lambda inner, name: HostGuard(inner, name, run),
                                  log_dir=str(log_dir) if log_dir else options.log_dir)
    os.environ.setdefault(HEAL_SILENT_S, f"{SILENT_S:g}")
    print(f"ddpkit heal: run {request.run_id} on {host}: -j {shape} across hosts; this host's ledger "
          f"{run.ledger.path}; up to {policy.max_attempts} attempt(s); a host whose ranks stop answering, are "
          "killed or are cut off is excluded from later rounds", file=sys.stderr, flush=True)
    run.ledger.append(SupervisorStarted(time=time.time(), pid=os.getpid(), host=host,
                                        max_attempts=policy.max_attempts,
                                        command=request.argv))
    start_goodput(run_dir, host)
    torch_log = logging.getLogger(TORCH_WORKER_LOGGER)
    torch_log.filters.insert(0, run.failures)  # before the agent's filter that drops these lines
    try:
        code = launch_attempt(options, None).exit_code
    except (ExcludedFromRun, HealStopped):
        raise
    except SpareReleased:
        run.released()
        return 0
    except DdpkitError as exc:
        run.finished(exc.exit_code)
        raise
    finally:
        torch_log.removeFilter(run.failures)
    run.finished(code)
    return code


def _end_own_workers() -> None:
    """SIGKILL this agent's own worker processes (its children): an excluded host's ranks belong to a job that
    goes on without them, and a stopped one would hold torch's agent 30 s (SIGTERM waits for SIGCONT)."""
    me = os.getpid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if parent == me:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry), signal.SIGKILL)
