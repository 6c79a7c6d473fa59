"""ddpkit train: the seeds' DDP job done right: it trains, snapshots safely, resumes exactly, survives faults.

Runbook (2 local ranks here; the same command runs under torchrun, srun, mpirun or a Kubeflow pod)::

    ddpkit train -n 2 --epochs 5 --snapshot-path run/snapshot.pt            # train; a snapshot each epoch
    ddpkit train -n 2 --epochs 5 --snapshot-path run/snapshot.pt            # again: "already complete"
    ddpkit train -n 2 --epochs 8 --snapshot-path run/snapshot.pt --max-restarts 3 \\
        --drill kill-worker@epoch=6,rank=1                                   # kill rank 1 once; resume
    ddpkit train -n 2 --model mlp --async-snapshot --snapshot-path run/     # 4.7M parameters
    ddpkit train -n 2 --make-job my_pkg.my_module:make_job --snapshot-path run/   # your model and data
    mpirun -np 2 ddpkit train --grad-transport mpi                          # gradients through MPI (ddpkit[mpi])

Exit codes: 0 trained; 2 bad options, a snapshot of another job, or an unimportable --make-job (before any
training); 3 a peer stopped answering (a lost rank or host; the message names it, the collective and the snapshot
to resume from); 74 a snapshot did not fit on its filesystem (the previous one is intact; the message names it);
75 stopped by a preemption signal with a snapshot to resume from (rerun to resume); 76 stopped by a preemption
signal with no snapshot (none configured): the progress is lost. A SIGTERM from ddpkit's own agent (which stops
its workers after a failure elsewhere) is not a preemption: the rank ends as SIGTERM ends a process.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpkit.base.errors import EXIT_CHECK_FAILED, ConfigError
from ddpkit.base.inputs import check_output_path, output_path, seconds
from ddpkit.base.log import get_logger
from ddpkit.comm import GRAD_TRANSPORTS
from ddpkit.process.stopping import RunOutcome, leave_preempted_code
from ddpkit.process.worker_context import WorkerContext
from ddpkit.train.config import MODELS, PREEMPT_SIGNALS, TrainConfig, check_job_spec, parse_drill
from ddpkit.train.output import say
from ddpkit.train.summary import RunSummary

if TYPE_CHECKING:
    from ddpkit.env.start import RankStart
    from ddpkit.goodput.records import GoodputLog
    from ddpkit.train.stops import LostPeerReport
    from ddpkit.train.trainer import Trainer
    from ddpkit.watch.records import AbortOrder

__all__ = ["add_arguments", "check_arguments", "config_from_args", "run"]

log = get_logger(__name__)


def _count(option: str, minimum: int = 1) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise ConfigError(f"{option} {text}", f"an integer >= {minimum}", f"pass {option} {max(minimum, 1)}")
        return value

    return parse


def _snapshot_path(text: str) -> str:
    check_output_path(text, "--snapshot-path", directory_ok=True)  # ~nouser, over-long names, /proc
    TrainConfig(snapshot_path=text)  # checks, before any rank starts, that the directory is writable or creatable
    return text


def _job_spec(text: str) -> str:
    check_job_spec(text)
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("job")
    g.add_argument("--model", choices=MODELS, default="linear",
                   help="linear: the seeds' Linear(20,1); toy: Linear(10,10)-ReLU-Linear(10,5); mlp: width x depth")
    g.add_argument("--width", type=_count("--width"), default=2048, help="mlp hidden width (default 2048)")
    g.add_argument("--depth", type=_count("--depth"), default=2, help="mlp hidden layers (default 2: 4.7M params)")
    g.add_argument("--samples", type=_count("--samples"), default=2048, help="synthetic samples (default 2048)")
    g.add_argument("--batch-size", type=_count("--batch-size"), default=32, help="per rank (default 32)")
    g.add_argument("--epochs", type=_count("--epochs"), default=10, help="total epochs (default 10)")
    g.add_argument("--lr", type=float, default=1e-3, help="SGD learning rate (default 1e-3)")
    g.add_argument("--seed", type=int, default=0, help="seeds data, model, sampler and RNGs (default 0)")
    g.add_argument("--make-job", dest="make_job", type=_job_spec, default=None, metavar="MODULE:FUNCTION",
                   help="your own job: FUNCTION(config) returns a ddpkit.train.TrainJob")
    g.add_argument("--deterministic", action="store_true", help="torch.use_deterministic_algorithms(True)")
    g.add_argument("--grad-transport", choices=GRAD_TRANSPORTS, default="auto",
                   help="how DDP averages gradients: mpi (MPI.Allreduce of each bucket; ranks started by mpirun, "
                        "mpiexec or srun --mpi=pmix; needs ddpkit[mpi]), gloo, nccl, or auto (default: mpi on CPU "
                        "where an MPI launcher started the ranks and mpi4py is installed, else the backend's own)")
    s = p.add_argument_group("snapshots and faults")
    s.add_argument("--snapshot-path", type=_snapshot_path, default=None, metavar="FILE|DIR/",
                   help="DIR/NAME.pt (kept as DIR/NAME.<step>.pt) or a directory, DIR/; a missing DIR is created; "
                        "default: no snapshots")
    s.add_argument("--save-every", type=_count("--save-every"), default=1, metavar="N",
                   help="snapshot every N epochs and after the last (default 1)")
    s.add_argument("--keep", type=_count("--keep"), default=2, metavar="K", help="snapshots kept (default 2)")
    s.add_argument("--async-snapshot", action="store_true",
                   help="write snapshots on a background thread; training blocks only for an in-memory copy")
    s.add_argument("--preempt-signal", choices=list(PREEMPT_SIGNALS), default="TERM",
                   help="signal meaning 'snapshot and stop' besides SIGTERM (Slurm --signal=USR1@60: USR1)")
    s.add_argument("--requeue", action="store_true", help="after a preemption snapshot, scontrol requeue the job")
    s.add_argument("--collective-timeout", type=seconds("--collective-timeout"), default=60.0, metavar="S",
                   help="seconds a collective waits for a lost peer before every rank names it and exits 3 "
                        "(default 60); the agent exits within S + 60 s")
    s.add_argument("--drill", action="append", type=parse_drill, default=[], metavar="KIND@epoch=E[,rank=R]",
                   help="inject a fault once: kill-worker@epoch=3[,rank=1] or preempt@epoch=3 (repeatable)")
    o = p.add_argument_group("output")
    o.add_argument("--json", dest="json_path", type=output_path("--json"), default=None, metavar="PATH",
                   help="write the run summary as JSON")
    o.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar on rank 0 (default: only on a terminal)")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(model=args.model, width=args.width, depth=args.depth, samples=args.samples,
                       batch_size=args.batch_size, epochs=args.epochs, lr=args.lr, seed=args.seed,
                       snapshot_path=args.snapshot_path, save_every=args.save_every, keep=args.keep,
                       async_snapshot=args.async_snapshot, preempt_signal=args.preempt_signal, requeue=args.requeue,
                       drills=tuple(args.drill), job=args.make_job, json_path=args.json_path,
                       deterministic=args.deterministic, progress=args.progress,
                       collective_timeout=args.collective_timeout)


def check_arguments(args: argparse.Namespace) -> None:
    """Every option checked once where the command starts, before any rank does: otherwise each rank said it, and a
    ``--heal`` supervisor took the error for a failed attempt and started the ranks again."""
    config_from_args(args)


#: The process group's own timeout trails --collective-timeout by this much: the watch names the lost peer first.
BACKSTOP_S = 30.0


def _on_watch_abort(trainer: Trainer, lost: LostPeerReport) -> None:
    """When the watch stops the job after a stall, leave train's lost-peer report (rank, host, phase, snapshot)."""
    from ddpkit.watch import active

    session = active()
    if session is not None:
        session.on_abort(lambda order: lost.hand_over(_lost_in_stall(trainer, order)))


def _lost_peer(trainer: Trainer, exc: BaseException) -> str:
    """After a collective failed: find who stopped answering (the watch's heartbeats) and say it, with the phase
    and the snapshot."""
    from ddpkit.base.errors import first_line
    from ddpkit.train.stops import PROBE_S
    from ddpkit.watch import active

    trainer.summary.outcome = RunOutcome.PEER_LOST
    session = active()
    answered = session.answering(PROBE_S) if session is not None else None
    return _describe(trainer, answered, first_line(exc)[-300:])


def _lost_in_stall(trainer: Trainer, order: AbortOrder) -> str:
    """The lost-peer message when the watch's hang report stops the job (its abort ``order``)."""
    trainer.summary.outcome = RunOutcome.PEER_LOST
    answered = None if order.silent is None else set(range(trainer.world)) - set(order.silent)
    return _describe(trainer, answered, order.reason, stalled=True)


def _describe(trainer: Trainer, answered: set[int] | None, error: str, *, stalled: bool = False) -> str:
    import socket

    from ddpkit.train.stops import describe_lost_peer

    return describe_lost_peer(rank=trainer.rank, hosts=trainer.hosts or [socket.gethostname()] * trainer.world,
                              phase=trainer.phase, snapshot=trainer.snapshots.last, answered=answered, error=error,
                              stalled=stalled)


def _check_restartable(config: TrainConfig, context: WorkerContext) -> None:
    from ddpkit.goodput.records import ATTEMPT_VAR

    healed = bool(os.environ.get(ATTEMPT_VAR))  # under --heal the supervisor starts the next attempt
    if any(d.kind == "kill-worker" for d in config.drills) and context.max_restarts < 1 and not healed:
        raise ConfigError("--drill kill-worker needs an elastic agent that restarts workers, and none allows "
                          "a restart here", "torch elastic with --max-restarts 1 or more",
                          "add --max-restarts 3 (with -n N) or --heal, or torchrun --max-restarts 3")


def _goodput_log(args: argparse.Namespace, rank: int, world_size: int, context: WorkerContext) -> GoodputLog | None:
    """This rank's goodput writer in the run directory (the supervisor's under --heal, else --run-dir), or None:
    rank 0 writes the ledger, every other rank its own step times beside it."""
    from ddpkit.goodput.records import GoodputLog, attempt_from_environ, run_dir_from_environ
    from ddpkit.process.worker_context import process_started_at

    run_dir = run_dir_from_environ() or getattr(args, "run_dir", None)
    if not run_dir:
        return None
    log_ = GoodputLog(run_dir, attempt=attempt_from_environ(context.restart_count), rank=rank)
    first = context.restart_count == 0  # a restarted worker group's process starts at its fork
    log_.started(time=time.time(), process=context.started_at if first else process_started_at(),
                 world_size=world_size)
    if rank == 0 and os.environ.get("SLURM_JOB_ID"):
        from ddpkit.goodput.queue import record_queue_wait

        record_queue_wait(log_)  # once per Slurm job: its submission to its start, as scontrol says
    return log_


def _live_group(context: WorkerContext, world: Any, backend: str | None, timeout: Any) -> Any:
    """This rank's live group under ``--heal live`` (ddpkit.live.rank.group), else None."""
    if context.live_gen is None:
        return None
    from ddpkit.live.rank.group import LiveGroup
    from ddpkit.runtime import pick_backend

    return LiveGroup(context, rank=world.rank, world_size=world.world_size, backend=pick_backend(backend),
                     timeout=timeout, pg_prefix="pg/")  # ddpkit.init's prefix


def _deterministic() -> None:
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


def _report(summary: RunSummary) -> None:
    history = summary.loss_history
    if history and summary.steps_ran:
        verb = "stopped by a preemption signal after" if summary.preempted else "finished at"
        say(f"Training {verb} epoch {max(history)} of {summary.epochs}: {summary.global_step} steps, "
            f"loss {summary.final_loss:.4f} (epoch {min(history)}: {summary.first_loss:.4f}), "
            f"{summary.samples_per_s:,.0f} samples/s, step p50 {summary.step_ms_p50:.2f} ms "
            f"p95 {summary.step_ms_p95:.2f} ms")
    resumed = summary.resumed_from
    say(f"Snapshots: {summary.snapshots_written} written, {summary.snapshots_loaded} loaded"
        + (f" (resumed at epoch {resumed.epoch}, step {resumed.global_step})" if resumed else "")
        + f"; restarts: {summary.restarts}")
    digests = summary.replica_digests
    if digests is not None:
        from ddpkit.live.rank.group import equal_line

        say(f"Live heals: {summary.live_heals}; replicas: {equal_line(digests)}")
    for d in summary.drills:
        if d.resumed_at_step is None:
            say(f"Drill {d.drill}: injected {d.injected}; the run has not resumed since")
            continue
        say(f"Drill {d.drill}: injected {d.injected}; resumed at step {d.resumed_at_step}; lost {d.lost_steps} "
            f"steps ({'within' if d.within_interval else 'BEYOND'} the snapshot interval)")


def run(args: argparse.Namespace, start: RankStart) -> int:
    context = start.context
    marks = {"launched": context.started_at, "worker": time.time()}
    config = config_from_args(args)
    _check_restartable(config, context)
    if config.deterministic:
        _deterministic()

    from datetime import timedelta

    import ddpkit
    from ddpkit.comm.gradients import plan_transport
    from ddpkit.live.rank.group import ReplicasDiverged
    from ddpkit.runtime import pick_backend
    from ddpkit.train.jobs import load_job
    from ddpkit.train.stops import LostPeerReport
    from ddpkit.train.trainer import Trainer
    from ddpkit.watch import WatchOptions

    job = load_job(config)  # user code fails here, before any process group or training
    marks["job"] = time.time()
    world = start.world
    # before the process group: MPI is initialised and its world checked against torch's here (exit 2 if not)
    transport = plan_transport(args.grad_transport, backend=pick_backend(args.backend), rank=world.rank,
                               world_size=world.world_size)
    # The watch names a lost peer (ddpkit.train.stops): a hang after --collective-timeout, a failed collective at
    # once. The group's own timeout is only the backstop behind it.
    options = WatchOptions(hang_after=config.collective_timeout, on_hang="abort", summary=False)
    timeout = timedelta(seconds=config.collective_timeout + BACKSTOP_S)
    live = _live_group(context, world, args.backend, timeout)
    # under --heal live the group is re-formed in the same processes; the watch goes on across it, on the agent's store
    rt = ddpkit.init(backend=args.backend, timeout=timeout, world=world, watch=options,
                     store=None if live is None else live.store())
    marks["group"] = time.time()
    goodput = _goodput_log(args, rt.rank, rt.world_size, context)
    trainer = Trainer(job, config, rt, transport=transport, context=context, goodput=goodput, live=live)
    lost = LostPeerReport(rt.rank, context)
    _on_watch_abort(trainer, lost)
    try:
        summary = trainer.fit()
    except ReplicasDiverged as exc:  # under --heal live: said by the agent, recorded; the attempt ends
        log.error("%s", exc)
        return EXIT_CHECK_FAILED
    except RuntimeError as exc:  # torch's DistBackendError and gloo's timeouts are RuntimeErrors
        from ddpkit.process.exiting import collective_failed

        if not collective_failed(exc):
            raise
        # a peer died mid-collective (a killed worker, a lost host): name it; the agent restarts the group or exits 3
        from ddpkit.watch import note_exception

        note_exception()  # the watch's failure report: the ranks gone on this host, at once
        lost.hand_over(_lost_peer(trainer, exc))
        return RunOutcome.PEER_LOST.exit_code
    finally:
        ddpkit.shutdown()
        if goodput is not None:
            goodput.close()
    if summary.outcome is RunOutcome.STOPPED_BY_AGENT:
        if summary.signal:  # end as the agent's SIGTERM asked: the agent reports the failure behind it
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
        return summary.exit_code
    summary.marks.update(marks, finished=time.time())
    if rt.rank == 0:
        timeline = summary.as_json()
        log.info("phases (s): %s; startup %.2f, teardown %.2f", ", ".join(
            f"{name} {value:.2f}" for name, value in timeline["phases_s"].items() if value is not None),
            timeline["startup_s"], timeline["teardown_s"])
        _report(summary)
        if config.json_path:
            path = Path(config.json_path).expanduser()
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(timeline, indent=2, default=str) + "\n")
    # ddpkit's launcher only sees that it was signalled: this file tells it how the workers ended (75 or 76)
    leave_preempted_code(context.preempted_mark, summary.outcome)
    return summary.exit_code
