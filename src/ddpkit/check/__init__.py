"""Prove a cluster is ready for PyTorch distributed, and name what is broken: `ddpkit check`.

    ddpkit check -n 4                                  # 4 local ranks (torch's elastic agent starts them)
    torchrun --nproc-per-node 8 -m ddpkit check        # any launcher: torchrun, srun, mpirun, a Kubeflow pod
    srun -N 2 --ntasks-per-node 4 ddpkit check --json check.json --rank-lines

Phases, each under a deadline (``--timeout`` for the roll-call, ``--phase-timeout`` for every later one), kept by
ddpkit's watch (``ddpkit.watch.phase(name, deadline=S)``, from the roll-call on):
roll-call in rank 0's store (missing, duplicate, disagreeing ranks, shared GPUs; versions and settings) ->
process group -> verified collectives -> DDP synchronisation -> report. Rank 0 prints a table per node, one
line per check and a verdict. Exit codes: 0 all passed; 1 a check failed; 2 usage or environment error
(duplicate ranks, world sizes that disagree, two ranks on one GPU); 3 ranks missing or a deadline expired.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ddpkit.base.errors import EXIT_MISSING, ConfigError, DeadlineExpired, first_line
from ddpkit.base.fault_injection import fault
from ddpkit.base.inputs import output_path, seconds
from ddpkit.base.log import get_logger
from ddpkit.check import collectives, ddpsync, render
from ddpkit.check.consistency import judge_consistency, judge_network
from ddpkit.check.rollcall import check_in, collect, judge, local_record, read_all
from ddpkit.env import WorldInfo
from ddpkit.env.evidence import lone_world_evidence
from ddpkit.verdicts.baseline import baseline_path
from ddpkit.verdicts.nodejudge import bad_hosts, judge_nodes, node_facts
from ddpkit.verdicts.outcome import FAIL, Outcome, failed, verdict_code
from ddpkit.verdicts.remedy import add_on_fail_argument, drain, report_lines

if TYPE_CHECKING:
    import torch.distributed as dist

    from ddpkit.env.start import RankStart
    from ddpkit.watch.records import AbortOrder

__all__ = ["add_arguments", "run"]

log = get_logger(__name__)
MARGIN_S = 5.0  # gloo's own timeout and the other ranks' store waits trail a phase's deadline by this much
#: A rank whose interpreter is wedged (the watch's thread cannot run) dumps its stacks and ends (faulthandler, exit 1)
#: this long after its phase's deadline: later than the watch's report and abort (a few seconds) on a live rank.
BACKSTOP_S = 20.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--timeout", type=seconds("--timeout"), default=30.0, metavar="S",
                   help="seconds rank 0 waits for every rank to check in (default 30)")
    p.add_argument("--phase-timeout", type=seconds("--phase-timeout"), default=60.0, metavar="S",
                   help="deadline of every later phase: init, each collective, DDP, report (default 60)")
    p.add_argument("--json", type=output_path("--json"), default=None, metavar="PATH",
                   help="write the full report: every rank's record, every check, timings")
    p.add_argument("--per-rank", action="store_true",
                   help="print every rank's row (default: one row per node, ranks folded, the ones that differ named)")
    p.add_argument("--grad-transport", choices=("auto", "gloo", "mpi", "nccl"), default="auto",
                   help="how the DDP-sync check averages gradients, as train does (default auto: through MPI on CPU "
                        "where an MPI launcher started the ranks and mpi4py is installed)")
    p.add_argument("--rank-lines", action="store_true",
                   help="also print the seeds' per-rank lines (hello from rank N, host: rank of size, NCCL_*)")
    p.add_argument("--baseline", type=baseline_path, default=None, metavar="FILE",
                   help="flag nodes whose facts changed since FILE (bench --save-baseline, or a check --json)")
    add_on_fail_argument(p)


class Report:
    """What rank 0 knows so far; printed once, at the end or when a deadline aborts the run."""

    def __init__(self, args: argparse.Namespace, world: WorldInfo, backend: str, device: str) -> None:
        self.args = args
        self.device = device
        self.world = world
        self.backend = backend
        self.records: list[dict[str, Any]] = []
        self.outcomes: list[Outcome] = []
        self.timings: dict[str, float] = {}
        self.start = time.monotonic()
        self._lock = threading.Lock()
        self._emitted = False

    def emit(self, code: int | None = None, deadline: str | None = None) -> int:
        with self._lock:
            if self._emitted:
                return code or 0
            self._emitted = True
            outcomes = list(self.outcomes)
            if deadline is not None:
                outcomes.append(failed("deadline", deadline, code=EXIT_MISSING))
            code = verdict_code(outcomes) if code is None else code
            seconds = time.monotonic() - self.start
            if self.records:
                render.print_nodes(self.records, per_rank=getattr(self.args, "per_rank", False))
            render.print_checks(outcomes)
            hosts = len({r["host"] for r in self.records}) or 1
            verdict = render.verdict_line(outcomes, code, world_size=self.world.world_size, hosts=hosts,
                                          backend=self.backend, seconds=seconds)
            render.print_verdict(verdict)
            if self.args.rank_lines and self.records:
                render.print_rank_lines(self.records)
            bad = bad_hosts(outcomes, self.records, hosts=self.world.hosts,
                            local_world_size=self.world.local_world_size)
            lines = report_lines("check", bad)
            if bad and getattr(self.args, "on_fail", "print") == "drain":
                lines += drain("check", bad)
            if lines:
                print("\n".join(lines), flush=True)
            self.timings["report"] = time.monotonic() - self.start - seconds
            # wall clock (one host's clock for the local ranks): where a run's time goes, outside the phases too
            arrivals = [float(r["checked_in_at"]) for r in self.records if "checked_in_at" in r]
            clock = {"first_check_in": min(arrivals, default=None), "last_check_in": max(arrivals, default=None),
                     "report_done": time.time()}
            if self.args.json:
                render.write_json(self.args.json, {
                    "kind": "check", "verdict": verdict, "exit_code": code, "passed": code == 0,
                    "backend": self.backend, "device": self.device,
                    "world": self.world.as_dict(), "seconds": round(seconds, 3), "timings": self.timings,
                    "clock": clock,
                    "checks": [o.as_dict() for o in outcomes], "ranks": self.records, "deadline": deadline,
                    "nodes": node_facts(self.records), "bad_hosts": bad,
                })
            return code


def _consult_faults(phase: str, rank: int) -> None:
    """Test hooks: ``hang:phase=P:rank=R`` never enters P; ``slow:phase=P:rank=R:ms=N`` enters it late."""
    if fault("hang", phase=phase, rank=rank) is not None:
        log.warning("test fault: rank %d hangs before phase %s", rank, phase)
        threading.Event().wait()
    slow = fault("slow", phase=phase, rank=rank)
    if slow is not None:
        time.sleep(float(slow.get("ms", "1000")) / 1e3)


def _open_store(world: WorldInfo, seconds: float) -> tuple[WorldInfo, dist.Store]:
    """Export the world for torch and connect to rank 0's store; the world returned names the master chosen."""
    from ddpkit.runtime import export_world, open_store

    export_world(world)
    # a single process picks a free port: keep it, so init() exports the same one
    world = replace(world, master_addr=os.environ["MASTER_ADDR"], master_port=int(os.environ["MASTER_PORT"]))
    try:
        store = open_store(world, timedelta(seconds=seconds))
        if not world.local_world_known:  # the launcher gave no local world: count it before the roll-call
            from ddpkit.runtime import count_local_world

            world = count_local_world(store, world, timedelta(seconds=seconds))
        return world, store
    except Exception as exc:  # DistStoreError / RuntimeError: rank 0's store never answered
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        raise DeadlineExpired(f"rank {world.rank} could not reach rank 0's store at {where} within {seconds:g} s "
                              f"({first_line(exc)})",
                              "rank 0 started, listening on MASTER_ADDR:MASTER_PORT, reachable from this host",
                              "check that rank 0 runs and that MASTER_ADDR/MASTER_PORT name it") from None


def _store_errors() -> tuple[type[BaseException], ...]:
    import torch.distributed as dist

    return (dist.DistError,) if hasattr(dist, "DistError") else (RuntimeError,)


def run(args: argparse.Namespace, start: RankStart) -> int:
    if args.timeout <= 0 or args.phase_timeout <= 0:
        raise ConfigError(f"--timeout {args.timeout} / --phase-timeout {args.phase_timeout}", "positive seconds",
                          "pass e.g. --timeout 30 --phase-timeout 60")
    from ddpkit.runtime import device_identity, pick_backend, pick_device

    world = start.world
    backend = pick_backend(args.backend)
    device = pick_device(backend, world.local_rank)
    from ddpkit.comm.gradients import plan_transport

    # DDP-sync verifies the gradient path train would use here (MPI's world checked before any store or group)
    transport = plan_transport(args.grad_transport, backend=backend, rank=world.rank, world_size=world.world_size)
    world, store = _open_store(world, args.timeout + MARGIN_S)
    report = Report(args, world, backend, str(device))
    # a world of one proves nothing about a larger job it may belong to (ddpkit.env.evidence)
    report.outcomes += [failed("world", reason) for reason in lone_world_evidence(world)]
    rank, size = world.rank, world.world_size
    # The watch keeps the deadlines, on a connection of its own (Store.clone, torch >= 2.5): the main thread may be
    # blocked in a store call when a deadline passes. Older torch shares the connection; the gloo timeout and the
    # faulthandler backstop remain.
    from ddpkit import watch

    session = watch.install(watch.WatchOptions(hang_after=args.phase_timeout + MARGIN_S, summary=False),
                            store=getattr(store, "clone", lambda: store)(), rank=rank, world_size=size)

    def on_abort(order: AbortOrder) -> None:  # rank 0 prints what it knows before every rank exits 3
        if rank == 0:
            report.emit(EXIT_MISSING, deadline=order.deadline or order.reason)

    session.on_abort(on_abort)

    @contextmanager
    def phase(name: str, seconds: float | None = None) -> Iterator[None]:
        _consult_faults(name, rank)
        seconds = seconds or args.phase_timeout
        faulthandler.dump_traceback_later(seconds + BACKSTOP_S, exit=True)
        try:
            with watch.phase(name, deadline=seconds):
                yield
        finally:
            faulthandler.cancel_dump_traceback_later()

    try:
        name, ident = device_identity(device)
        with phase("roll-call", args.timeout + MARGIN_S):
            t = time.monotonic()
            go = _roll_call(store, report, local_record(world, device=name, gpu_uuid=ident), args.timeout)
            report.timings["roll-call"] = time.monotonic() - t
        if go != "go":
            return _finish(store, report, rank, int(go))
        _verify(store, report, world, backend, phase, transport)
        return _finish(store, report, rank, None)
    except _store_errors() as exc:  # rank 0 (and its store) went away, or a wait outlived every deadline
        raise DeadlineExpired(f"rank {rank} lost rank 0's store ({first_line(exc)})", "rank 0 alive until the report",
                              "look at rank 0's output: it failed or was killed first") from None
    finally:
        watch.uninstall()


def _roll_call(store: dist.Store, report: Report, record: dict[str, Any], timeout: float) -> str:
    """Check in; rank 0 judges the world and publishes 'go' or the exit code everyone ends with."""
    check_in(store, record)
    world = report.world
    if world.rank != 0:
        store.wait(["rollcall/verdict"], timedelta(seconds=timeout + 2 * MARGIN_S))
        return store.get("rollcall/verdict").decode()
    records, waited = collect(store, world.world_size, timeout)
    report.records = records
    found = judge(records, world_size=world.world_size, hosts=world.hosts,
                  local_world_size=world.local_world_size, timeout=timeout, waited=waited)
    report.outcomes += found + judge_consistency(records) + [judge_network(records)] + judge_nodes(records)
    if report.args.baseline:
        from ddpkit.verdicts.baseline import facts_of, load
        from ddpkit.verdicts.nodejudge import compare_to_baseline

        report.outcomes.append(compare_to_baseline(records, facts_of(load(report.args.baseline))))
    fatal = verdict_code(found)
    verdict = "go" if fatal == 0 else str(fatal)
    store.set("rollcall/verdict", verdict)
    if records:  # rank 0's own cost: from the last rank's arrival to the verdict the others wait for
        report.timings["roll-call-after-last"] = time.time() - max(float(r["checked_in_at"]) for r in records)
    return verdict


def _verify(store: dist.Store, report: Report, world: WorldInfo, backend: str, phase: Any,
            transport: str | None = None) -> None:
    """Process group, collectives, DDP; each rank's results go to the store, rank 0 judges them all."""
    from ddpkit.runtime import init, shutdown

    rank, size = world.rank, world.world_size
    try:
        with phase("init"):
            t = time.monotonic()
            rt = init(backend=backend, timeout=timedelta(seconds=report.args.phase_timeout + MARGIN_S),
                      store=store, world=world)
            report.timings["init"] = time.monotonic() - t
        ops = []
        for name in collectives.OPS:
            with phase(name):
                ops.append(collectives.run_op(name, rank, size, rt.device))
                report.timings[name] = ops[-1].seconds
        with phase("ddp"):
            ddp = ddpsync.run_ddp(rank, size, rt.device, transport=transport)
            report.timings["ddp"] = ddp.seconds
        with phase("report"):
            store.set(f"results/{rank}", json.dumps({"ops": [o.as_dict() for o in ops], "ddp": ddp.as_dict()}))
            if rank == 0:
                _judge_results(store, report, size, backend, transport)
    finally:
        shutdown()


def _judge_results(store: dist.Store, report: Report, size: int, backend: str, transport: str | None = None) -> None:
    raw = read_all(store, [f"results/{r}" for r in range(size)], timeout=report.args.phase_timeout + MARGIN_S)
    results = [json.loads(v) for v in raw]
    for i, name in enumerate(collectives.OPS):
        per_rank = [collectives.OpResult(**res["ops"][i]) for res in results]
        report.outcomes.append(collectives.combine(name, per_rank, backend))
    ddp = ddpsync.combine([ddpsync.DdpResult(**res["ddp"]) for res in results])
    if transport is not None:
        ddp = replace(ddp, detail=f"{ddp.detail}; gradients averaged through {transport.upper()}")
    report.outcomes.append(ddp)


def _finish(store: dist.Store, report: Report, rank: int, code: int | None) -> int:
    """Rank 0 prints and publishes the exit code; everyone leaves with it. Rank 0 (it may host the store) goes last."""
    if rank == 0:
        code = report.emit(code)
        store.set("verdict", str(code))
        deadline = time.monotonic() + MARGIN_S
        others = int(store.add("rollcall/count", 0)) - 1  # the ranks that checked in, duplicates included
        while int(store.add("finished", 0)) < others and time.monotonic() < deadline:
            time.sleep(0.02)
    else:
        store.wait(["verdict"], timedelta(seconds=report.args.phase_timeout + MARGIN_S))
        code = int(store.get("verdict").decode())
        from ddpkit import watch

        watch.uninstall()  # rank 0 may leave with its store now: that is the end, not a lost host
        store.add("finished", 1)
    if code:
        failures = [o.name for o in report.outcomes if o.status == FAIL]
        log.debug("rank %d on %s ends with exit code %d (%s)", rank, socket.gethostname(), code, failures)
    return int(code or 0)
