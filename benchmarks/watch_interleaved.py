"""The watch's cost on ddpkit train's step, watched and unwatched blocks alternated in the same processes.

    torchrun --standalone --nproc-per-node 2 benchmarks/watch_interleaved.py --model linear --json PATH
    mpirun -np 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29512 python benchmarks/watch_interleaved.py \\
        --transport mpi --json PATH

Each round runs one block of each side, the order swapped every round: a block builds ddpkit's Trainer afresh
(what ``ddpkit train`` runs on every rank) and trains ``--epochs`` epochs. The watched block first installs the
watch (``ddpkit.watch.install``: torch's functions wrapped, the monitor thread publishing every 0.5 s) and
uninstalls it after; the unwatched block runs torch's own functions and no watch thread. The first epoch of a block
is excluded and a block's figure is its median epoch; the ratio of a round is watched / unwatched epoch time.
Rank 0 writes the per-round epoch times and the ratios as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ddpkit
from ddpkit.comm.gradients import plan_transport
from ddpkit.train.config import TrainConfig
from ddpkit.train.jobs import builtin_job
from ddpkit.train.trainer import Trainer
from ddpkit.watch import WatchOptions, install, uninstall


def _block(rt: ddpkit.Runtime, config: TrainConfig, transport: str | None, watched: bool) -> list[float]:
    if watched:
        install(WatchOptions(summary=False, report_every=5.0))
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            summary = Trainer(builtin_job(config), config, rt, transport=transport).fit()
    finally:
        if watched:
            uninstall()
    return [summary.epoch_s[e] for e in sorted(summary.epoch_s)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--model", default="linear", choices=("linear", "mlp"))
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--transport", default="auto", choices=("auto", "gloo", "mpi"))
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    from ddpkit.env import detect

    world = detect()
    transport = plan_transport(args.transport, backend="gloo", rank=world.rank, world_size=world.world_size)
    rt = ddpkit.init(backend="gloo", world=world)
    config = TrainConfig(model=args.model, samples=args.samples, epochs=args.epochs, progress=False)
    blocks: dict[str, list[list[float]]] = {"watched": [], "plain": []}
    for r in range(args.rounds):
        for side in (("plain", "watched") if r % 2 == 0 else ("watched", "plain")):
            dist.barrier()
            blocks[side].append(_block(rt, config, transport, side == "watched"))
    if rt.rank == 0:
        epoch = {side: [statistics.median(t[1:]) for t in blocks[side]] for side in blocks}
        ratios = [w / p for w, p in zip(epoch["watched"], epoch["plain"], strict=True)]
        Path(args.json).write_text(json.dumps({"epoch_s": blocks, "median_epoch_s": epoch, "ratios": ratios,
                                               "transport": transport or "backend's own", "model": args.model,
                                               "samples": args.samples, "epochs_per_block": args.epochs}))
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
