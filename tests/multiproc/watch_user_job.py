"""A plain DDP training script as a user writes it (torch only; ddpkit appears only where the user marks a phase),
with the faults the watch's tests inject:

    --fault sleep|stop|kill|extra --fault-rank R --fault-step S   rank R, at step S: sleeps for an hour, stops
        itself (SIGSTOP), is killed (SIGKILL), or calls one broadcast the others do not (a desync)
    --others-idle-s T [--idle-in-store]   at the fault step the other ranks sleep T s first, in no collective
        (time.sleep; or waiting in the job's store for a key that never comes: a call in C that no signal ends)
    --slow-rank R --slow-ms MS       rank R sleeps MS in every forward (a straggler)
    --busy-ms MS                     every rank computes MS of CPU time per step (a busy loop): on a host with
        less CPU it takes longer
    --checkpoint-at S --checkpoint-s T   at step S rank 0 "writes a checkpoint" for T s inside
        ``ddpkit.watch.phase("checkpoint")`` while the others wait in a barrier
    --first-step-s T                 every rank spends T s before its first step (unmarked: compilation, loading)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--step-s", type=float, default=0.02, help="extra time per step (pacing)")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--hook", action="store_true",
                   help="register torch's allreduce_hook as the script's own Python comm hook (the watch wraps it and "
                        "sees each bucket); without it DDP's C++ path, which the watch counts")
    p.add_argument("--fault", choices=("sleep", "stop", "kill", "extra"))
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-step", type=int, default=20)
    p.add_argument("--others-idle-s", type=float, default=0.0,
                   help="at the fault step the other ranks sleep this long, in no collective")
    p.add_argument("--idle-in-store", action="store_true")
    p.add_argument("--slow-rank", type=int)
    p.add_argument("--slow-ms", type=float, default=0.0)
    p.add_argument("--busy-ms", type=float, default=0.0)
    p.add_argument("--checkpoint-at", type=int)
    p.add_argument("--checkpoint-s", type=float, default=0.0)
    p.add_argument("--no-phase", action="store_true", help="the checkpoint left unmarked")
    p.add_argument("--first-step-s", type=float, default=0.0)
    p.add_argument("--tag", default="", help="ignored: lets a test find this job's processes")
    p.add_argument("--watch-in-code", choices=("init", "with"),
                   help="watch from the script itself: ddpkit.init(watch=...) or with ddpkit.watch(...)")
    return p.parse_args()


def fault(kind: str) -> None:
    print(f"FAULT {kind} {time.time():.3f}", flush=True)
    if kind == "sleep":
        time.sleep(3600)
    elif kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "extra":
        dist.broadcast(torch.ones(1), src=dist.get_rank())


def main() -> None:
    args = parse()
    if args.watch_in_code == "init":
        import ddpkit
        from ddpkit.watch import WatchOptions

        ddpkit.init(backend="gloo", watch=WatchOptions(hang_after=4, events=Path(os.environ["WATCH_EVENTS"])))
        train(args)
    elif args.watch_in_code == "with":
        import ddpkit

        with ddpkit.watch(hang_after=4, events=Path(os.environ["WATCH_EVENTS"])):
            dist.init_process_group("gloo")
            train(args)
    else:
        dist.init_process_group("gloo")
        train(args)


def train(args: argparse.Namespace) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, args.width), torch.nn.ReLU(), torch.nn.Linear(args.width, 1)))
    if args.hook:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        model.register_comm_hook(None, allreduce_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    time.sleep(args.first_step_s)
    for step in range(args.steps):
        if args.fault and rank == args.fault_rank and step == args.fault_step:
            fault(args.fault)
        elif args.fault and step == args.fault_step and args.idle_in_store:
            with contextlib.suppress(RuntimeError):  # its timeout
                dist.distributed_c10d._get_default_store().wait(["never"], timedelta(seconds=args.others_idle_s))
        elif args.fault and step == args.fault_step:
            time.sleep(args.others_idle_s)
        if rank == args.slow_rank:
            time.sleep(args.slow_ms / 1e3)
        until = time.thread_time() + args.busy_ms / 1e3
        while time.thread_time() < until:
            pass
        loss = model(torch.randn(16, 32)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(args.step_s)
        if step == args.checkpoint_at:
            import ddpkit.watch

            with contextlib.nullcontext() if args.no_phase else ddpkit.watch.phase("checkpoint"):
                if rank == 0:
                    time.sleep(args.checkpoint_s)
                dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)


if __name__ == "__main__":
    main()
