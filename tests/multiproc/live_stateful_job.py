"""A torchrun-style DDP script whose loop carries state beyond model and optimizer, written as docs/heal.md shows for
``ddpkit run --heal live``: a per-batch LR scheduler (``--scheduler onecycle|step``), a GradScaler-style loss scaler
that grows its scale every few steps, and an EMA of the weights. ``--leave-out`` passes only the model and the
optimizer to ``live.Replica`` (the mistake the verification must catch).

    ddpkit run -n 3 --heal live -- live_stateful_job.py --epochs 40 [--scheduler step] [--leave-out]
    ddpkit run -n 3 --heal live -- live_stateful_job.py --raise-at 30      # rank 1 raises its own RuntimeError

At the end each rank prints ``done: weights W ema E lr L moved M`` (W, E: digests; M: how far the weights moved from
their start, so a test knows that the script trains) and rank 0 writes its weights to ``--out``."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.run import live


class LossScaler:
    """GradScaler's shape on CPU: a scale that doubles every ``interval`` good steps (its state is the scale and
    the count); the loss is multiplied by it and the gradients divided by it again, so it changes no arithmetic
    result, only its own state, as GradScaler's does on a healthy run."""

    def __init__(self, interval: int = 7) -> None:
        self.scale, self.good, self.interval = 1.0, 0, interval

    def update(self) -> None:
        self.good += 1
        if self.good % self.interval == 0:
            self.scale = min(self.scale * 2.0, 2.0 ** 16)

    def state_dict(self) -> dict[str, float | int]:
        return {"scale": self.scale, "good": self.good}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        self.scale, self.good = float(state["scale"]), int(state["good"])


class Ema:
    """An exponential moving average of the weights."""

    def __init__(self, model: torch.nn.Module, decay: float = 0.9) -> None:
        self.decay = decay
        self.shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}

    def update(self, model: torch.nn.Module) -> None:
        with torch.no_grad():
            for k, v in model.state_dict().items():
                self.shadow[k].mul_(self.decay).add_(v, alpha=1 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.shadow.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.shadow = {k: v.clone() for k, v in state.items()}


class Counting:
    """A comm hook's state: how many buckets it reduced (``process_group`` None: the default group)."""

    def __init__(self) -> None:
        self.calls = self.epoch_calls = 0
        self.process_group = None


def counting_hook(state, bucket):  # type: ignore[no-untyped-def]  # torch reads the annotations; these would be text
    state.calls += 1
    return default_hooks.allreduce_hook(state.process_group, bucket)


def digest(tensors: dict[str, torch.Tensor]) -> str:
    return hashlib.sha256(b"".join(t.detach().numpy().tobytes() for _, t in sorted(tensors.items()))).hexdigest()[:12]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--scheduler", choices=("onecycle", "step"), default="onecycle")
    p.add_argument("--leave-out", action="store_true")
    p.add_argument("--raise-at", type=int, default=None, help="rank 1 raises its own RuntimeError at this step")
    p.add_argument("--hang-at", type=int, default=None, help="rank 1 of the first generation sleeps at this step")
    p.add_argument("--pause-at", type=int, default=None, help="rank 0 pauses --pause-s at this step (a checkpoint)")
    p.add_argument("--pause-s", type=float, default=150.0)
    p.add_argument("--plain", action="store_true", help="no live.Replica: the script as torchrun runs it")
    p.add_argument("--out", default=None)
    p.add_argument("--ddp-extras", action="store_true", help="DDP(find_unused_parameters=True, bucket_cap_mb=1) and a "
                   "comm hook that counts its calls")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    data = torch.randn(512, 16)
    target = data @ torch.randn(16, 1) + 0.1 * torch.randn(512, 1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    hook = Counting()
    if args.ddp_extras:
        ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=1)
        ddp.register_comm_hook(hook, counting_hook)
    else:
        ddp = DDP(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    per_epoch = 512 // world // 32
    if args.scheduler == "onecycle":
        scheduler: torch.optim.lr_scheduler.LRScheduler = torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=0.1, total_steps=args.epochs * per_epoch)
    else:
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.8)
    scaler, ema = LossScaler(), Ema(model)
    carried = () if args.leave_out else (scheduler, scaler, ema)
    replica = None if args.plain else live.Replica(ddp, optimizer, *carried)
    shard = data[rank::world], target[rank::world]
    batches = [(shard[0][i:i + 32], shard[1][i:i + 32]) for i in range(0, per_epoch * 32, 32)]

    def train_step(x: torch.Tensor, y: torch.Tensor) -> None:
        if args.raise_at is not None and rank == 1 and replica is not None and replica.done == args.raise_at:
            raise RuntimeError("timeout talking to my database")
        done = -1 if replica is None else replica.done
        if done == args.hang_at and rank == 1 and os.environ.get("DDPKIT_LIVE_GEN") == "0":
            time.sleep(3600)  # running, no progress: the watch names it, the agent replaces it
        if done == args.pause_at and rank == 0:
            time.sleep(args.pause_s)  # a healthy pause (rank 0 writing a checkpoint): never replaced
        optimizer.zero_grad()
        (F.mse_loss(ddp(x), y) * scaler.scale).backward()
        for param in ddp.parameters():
            assert param.grad is not None
            param.grad.div_(scaler.scale)
        optimizer.step()
        scheduler.step()
        scaler.update()
        ema.update(model)

    for epoch in range(args.epochs) if replica is None else replica.epochs(0, args.epochs):
        for x, y in batches if replica is None else replica.batches(batches):
            if replica is None:
                train_step(x, y)
            else:
                replica.step(train_step, x, y)
        if rank == 0:
            print(f"[RANK {rank}] Epoch {epoch} done", flush=True)
        hook.epoch_calls, hook.calls = hook.calls, 0
    moved = max(float((v - start[k]).abs().max()) for k, v in model.state_dict().items())
    print(f"[RANK {rank}] done: weights {digest(model.state_dict())} ema {digest(ema.shadow)} "
          f"lr {optimizer.param_groups[0]['lr']:.6g} moved {moved:.6g}", flush=True)
    if args.ddp_extras:
        print(f"[RANK {rank}] ddp: hooks {len(ddp._comm_hooks)} find_unused {ddp.find_unused_parameters} bucket "
              f"{ddp.bucket_bytes_cap} last epoch's hook calls {hook.epoch_calls}", flush=True)
    if args.out and rank == 0:
        with open(args.out, "w") as f:
            json.dump({k: v.flatten().tolist() for k, v in model.state_dict().items()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
