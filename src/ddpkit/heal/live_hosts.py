"""``ddpkit run|train -j [MIN:]NxP --rdzv-endpoint HOST:PORT --heal live`` on every host (``--standby`` on a standby
host): live healing across hosts without Slurm, the supervisor's side.

The host the endpoint names (or the one given ``--rdzv-conf is_host=true``) leads: it listens on the endpoint, runs
the live agent (``live.agent.hosts``) and this run's attempt loop (``heal.attempts``, its ledger under the run
directory); every other host is a member (``live.agent.member``) that connects to it and forks the ranks it is
given. The first attempt starts once N hosts that are not standbys joined (``--rdzv-timeout``; down to MIN where
``-j MIN:N`` allows it). A lost host's ranks move live to a standby host and the lost host is excluded; an attempt
that cannot go on live (no standby left, a rank that raised) ends, and the next one runs on the hosts that are left:
N again where standbys are, down to MIN. The endpoint's host cannot be healed away: it holds the job's stores.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ddpkit.base.errors import EXIT_MISSING, ConfigError
from ddpkit.goodput.records import ATTEMPT_VAR
from ddpkit.heal.attempts import EXIT_NO_HOSTS, Adapter, Attempts, Ended
from ddpkit.heal.elastic_round import EXIT_HOST_EXCLUDED
from ddpkit.heal.lines import Style, say
from ddpkit.heal.nodepool import NodePool
from ddpkit.heal.policy import HealPolicy
from ddpkit.heal.progress import newest_snapshot_step
from ddpkit.heal.request import HealRequest
from ddpkit.launch.result import orders_of
from ddpkit.rundir import RunDir
from ddpkit.rundir.ledger import Ledger, LiveHook, SupervisorStarted
from ddpkit.rundir.verdict import Classification

if TYPE_CHECKING:
    from ddpkit.launch.agent import LaunchOptions
    from ddpkit.live.agent.host import _Forker
    from ddpkit.live.agent.hosts import Member, Members

__all__ = ["supervise_live_hosts"]

_TRUE = ("1", "true", "yes", "y", "on")


def supervise_live_hosts(request: HealRequest, options: LaunchOptions, fork_for: Callable[[LaunchOptions], _Forker],
                         start_goodput: Callable[[Path, str], None]) -> int:
    """This host's part of the job (the module's docstring); its exit code."""
    shape = options.shape
    if not options.rdzv_endpoint:
        raise ConfigError(f"--heal live with -j {shape} and no --rdzv-endpoint", "--rdzv-endpoint HOST:PORT, the "
                          "same on every host: its host runs the live agent", "add --rdzv-endpoint HOST:PORT")
    if options.rdzv_backend != "c10d":
        raise ConfigError(f"--heal live with --rdzv-backend {options.rdzv_backend}", "c10d (the default): under "
                          "--heal live across hosts the endpoint's host holds the job's stores and its live agent",
                          "drop --rdzv-backend")
    if options.max_restarts:
        raise ConfigError(f"--heal live with --max-restarts {options.max_restarts}", "one of them: --heal restarts "
                          "the ranks itself", "drop --max-restarts (--max-attempts N bounds the attempts)")
    host, _, port = options.rdzv_endpoint.rpartition(":")
    host = host.strip("[]")
    server = _listen(host, int(port), dict(options.rdzv_conf))
    fork = fork_for(options)  # torch and the program imported before joining: a standby is ready when it joins
    here = socket.gethostname().split(".", 1)[0]
    try:
        if server is None:
            return _member(options, host, int(port), here, fork, standby=request.standby)
        return _lead(request, options, server, host, here, fork, start_goodput)
    finally:
        fork.end()


def _listen(host: str, port: int, conf: dict[str, str]) -> socket.socket | None:
    """The endpoint's listening socket where this host leads (it names one of this host's addresses, or
    ``is_host=true``); None: this host is a member."""
    said = conf.get("is_host")
    if said is not None and said.strip().lower() not in _TRUE:
        return None
    try:
        socket.create_server((host, port)).close()  # the endpoint is this host's, and free
    except OSError as exc:
        if said is None and exc.errno in (errno.EADDRNOTAVAIL, errno.EADDRINUSE):
            return None  # another host's address, or the agent of this machine listens there already
        raise ConfigError(f"--rdzv-endpoint {host}:{port} on this host ({exc.strerror})", "a port this host can "
                          "listen on, where it leads (is_host=true or the endpoint names it)",
                          "free the port, or name another HOST:PORT on every host") from exc
    return socket.create_server(("", port), backlog=128)  # every address: the members reach it from outside


def _member(options: LaunchOptions, host: str, port: int, here: str, fork: _Forker, *, standby: bool) -> int:
    from ddpkit.live.agent.member import connect, serve

    endpoint = f"{host}:{port}"
    try:
        wire = connect(host, port, {"hello": here, "per_node": options.shape.nproc_per_node, "standby": standby,
                                    "pid": os.getpid()}, timeout=options.rdzv_timeout)
    except TimeoutError as exc:
        print(f"ddpkit live: error: {exc}; start the job on the endpoint's host too", file=sys.stderr, flush=True)
        return EXIT_MISSING
    print(f"ddpkit live: {here} joined the live agent at {endpoint}{' as a standby' if standby else ''}",
          file=sys.stderr, flush=True)
    return serve(wire, fork, endpoint, tail_of=fork.stderr_tail)


def _lead(request: HealRequest, options: LaunchOptions, server: socket.socket, host: str, here: str,
          fork: _Forker, start_goodput: Callable[[Path, str], None]) -> int:
    from ddpkit.live.agent.hosts import Member, Members

    shape, per_node = options.shape, options.shape.nproc_per_node
    run_id = request.run_id or f"live-{here}-{os.getpid()}"
    members = Members(server, Member(name=here, address=host, per_node=per_node, standby=request.standby),
                      run_id=run_id)
    code = EXIT_MISSING
    adapter: _HostAttempts | None = None
    try:
        say(f"ddpkit live: run {run_id}: the live agent listens on {here} ({options.rdzv_endpoint}); waiting for "
            f"{shape.max_nodes} host(s) x {per_node} rank(s) (hosts started with --standby stand by), up to "
            f"{options.rdzv_timeout} s")
        if not members.wait_for(shape.max_nodes, options.rdzv_timeout):
            ready = [m for m in members.alive() if not m.standby]
            if len(ready) < shape.min_nodes:
                names = ", ".join(f"{m.name} ({m.address})" for m in ready)
                say(f"ddpkit live: error: the job did not start within {options.rdzv_timeout} s; {len(ready)} of "
                    f"{shape.max_nodes} host(s) joined: {names or 'none'}; ranks {len(ready) * per_node}-"
                    f"{shape.max_nodes * per_node - 1} of {shape.max_nodes * per_node} have no host")
                return EXIT_MISSING
        run_dir = Path(request.run_dir) if request.run_dir else RunDir.default(run_id).path
        ledger = Ledger(run_dir)
        policy = HealPolicy(max_attempts=request.max_attempts)
        ledger.append(SupervisorStarted(time=time.time(), pid=os.getpid(), host=here,
                                        max_attempts=policy.max_attempts, command=request.argv))
        start_goodput(run_dir, here)
        pool = NodePool(allocation=_order(members), want=shape.max_nodes, least=shape.min_nodes)
        adapter = _HostAttempts(request=request, members=members, pool=pool, address=host, here=here, fork=fork,
                                run_id=run_id)
        attempts = Attempts(ledger=ledger, policy=policy, style=Style.HOSTS, pool=pool, here=here)
        code = attempts.run(adapter, ranks_per_host=per_node)
        return code
    finally:
        members.end(adapter.code_of(code) if adapter is not None else lambda m: (code, None))


def _order(members: Members) -> tuple[str, ...]:
    """The hosts an attempt takes first: those that are not standbys, in the order they joined; then the standbys."""
    alive = members.alive()
    return tuple(m.name for m in alive if not m.standby) + tuple(m.name for m in alive if m.standby)


class _HostAttempts(Adapter):
    """Each attempt on the pool's hosts, the others standing by (``live.agent.hosts``)."""

    style = Style.HOSTS
    live_moves_host = True  # a lost host's ranks go on on a standby host: the lost host is out

    def __init__(self, *, request: HealRequest, members: Members, pool: NodePool, address: str, here: str,
                 fork: _Forker, run_id: str) -> None:
        self.request, self.members, self.pool = request, members, pool
        self.address, self.here, self.fork, self.run_id = address, here, fork, run_id

    def prepare(self, attempt: int, hosts: tuple[str, ...]) -> tuple[str, ...] | None:
        self.pool.allocation = tuple(dict.fromkeys((*self.pool.allocation, *_order(self.members))))
        alive = {m.name for m in self.members.alive()}
        for name in self.pool.healthy:
            if name not in alive:
                self.pool.exclude(name, "its member's connection to the live agent ended")
        return self.pool.take()

    def start(self, attempt: int, of_session: int, hosts: tuple[str, ...], heard: LiveHook) -> Ended:
        from ddpkit.heal.gather import gather
        from ddpkit.live.agent.hosts import run_hosts_attempt

        world = tuple(m for name in hosts if (m := self.members.named(name)) is not None)
        def spares() -> tuple[Member, ...]:  # a host that joins during the attempt stands by at once
            return tuple(m for m in self.members.alive() if m.name not in hosts and m.name not in self.pool.bad)

        os.environ[ATTEMPT_VAR] = str(attempt)  # train's rank 0 writes its goodput lines under this attempt
        self.members.take_evidence()  # an earlier attempt's
        result, where = run_hosts_attempt(members=self.members, world=world, spares=spares, address=self.address,
                                          run_id=f"{self.run_id}-{attempt}", on_heal=heard, fork_here=self.fork)
        if not result.exit_code:
            return Ended(exit_code=0)
        # the failed ranks' tracebacks and the watch's orders: another host's, as its member sent them; this host's
        # from its ranks' logs (the orders of this host's ranks are in the result already)
        tails, orders = self.members.take_evidence()
        tails += [(f.rank, tail) for f in result.failures
                  if where.get(f.rank) == self.here and (tail := self.fork.stderr_tail(f.rank))]
        result = dataclasses.replace(result, watch_orders=(*result.watch_orders, *orders_of(orders)))
        return Ended(exit_code=result.exit_code,
                     evidence=gather(result.exit_code, result, None, self.here, where, tails=tails))

    def progress(self) -> int | None:
        return newest_snapshot_step(self.request.progress_path)

    def excluded(self, found: Classification, going_on: bool) -> None:
        for name in found.culprit_hosts:
            member = self.members.named(name)
            if member is not None and member.wire is not None:
                member.wire.send({"end": EXIT_HOST_EXCLUDED, "why": f"this host was excluded from run {self.run_id} "
                                  f"({found.reason}); the job goes on without it"})

    def no_hosts(self, of_session: int) -> int:
        left = ", ".join(self.pool.healthy) or "none"
        say(f"ddpkit live: fewer than {self.pool.least} healthy host(s) are left ({left}; out: "
            f"{', '.join(sorted(self.pool.bad))}): no attempt can run")
        return EXIT_NO_HOSTS

    def code_of(self, code: int) -> Callable[[Member], tuple[int, str | None]]:
        """Each member's exit code at the end: the job's, or 95 for a host the job left out."""

        def of(member: Member) -> tuple[int, str | None]:
            if member.name in self.pool.bad:
                why = self.pool.bad[member.name]
                return EXIT_HOST_EXCLUDED, f"this host was excluded from run {self.run_id} ({why})"
            return code, None

        return of
