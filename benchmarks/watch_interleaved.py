"""The watch's cost on ddpkit train's step, watched and unwatched blocks alternated in the same processes.

    torchrun --standalone --nproc-per-node 2 benchmarks/watch_interleaved.py --model linear --json PATH
    mpirun -np 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29512 python benchmarks/watch_interleaved.py \\
        --transport mpi --json PATH

Each round runs one block of each side, the order swapped every round: a block builds ddpkit's Trainer afresh
(what ``ddpkit train`` runs on every rank) and trains ``--epochs`` epochs. The watched block first installs the
watch (``ddpkit.watch.install``: torch's functions wrapped, the monitor thread publishing every 0.5 s) and
uninstalls it after; the unwatched block runs torch's own functions and no watch thread. The first epoch of a block
is excluded and a block's figure is its median epoch; the ratio of a round is watched / unwatched epoch time.
Each watched block also measures the watch's own threads (``ddpkit-watch*``: the monitor and its store caller):
their CPU time (each thread's CPU clock, ``pthread_getcpuclockid``) per second of the block, on every rank. On a
node with a core to spare it costs the step nothing; where the ranks fill every core (2 busy-polling MPI ranks on
2 cores here) it is taken from them. Rank 0 writes the per-round epoch times, the ratios and those shares as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ddpkit
from ddpkit.comm.gradients import plan_transport
from ddpkit.train.config import TrainConfig
from ddpkit.train.jobs import builtin_job
from ddpkit.train.trainer import Trainer
from ddpkit.watch import WatchOptions, install, uninstall


def _watch_threads_cpu_s() -> dict[int, float]:
    """thread id -> CPU seconds so far, of this process's live watch threads."""
    out = {}
    for t in threading.enumerate():
        if t.name.startswith("ddpkit-watch") and t.ident is not None:
            try:
                out[t.ident] = time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except OSError:  # ended in between
                continue
    return out


def _block(rt: ddpkit.Runtime, config: TrainConfig, transport: str | None, watched: bool,
           thread_share: list[float]) -> list[float]:
    if watched:
        install(WatchOptions(summary=False, report_every=5.0))
        before, start = _watch_threads_cpu_s(), time.monotonic()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            summary = Trainer(builtin_job(config), config, rt, transport=transport).fit()
        if watched:
            after = _watch_threads_cpu_s()
            thread_share.append(sum(cpu - before.get(t, 0.0) for t, cpu in after.items())
                                / (time.monotonic() - start))
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
    thread_share: list[float] = []  # the watch threads' CPU seconds per second, one per watched block
    for r in range(args.rounds):
        for side in (("plain", "watched") if r % 2 == 0 else ("watched", "plain")):
            dist.barrier()
            blocks[side].append(_block(rt, config, transport, side == "watched", thread_share))
    # through the job's store, not a collective: a last gloo all_gather's work freed during the interpreter's
    # teardown aborted a rank (src/ddpkit/process/exiting.py; it happened here under mpirun)
    store = dist.distributed_c10d._get_default_store()
    store.set(f"watch_threads/{rt.rank}", json.dumps(thread_share))
    shares = [json.loads(store.get(f"watch_threads/{r}")) for r in range(rt.world_size)] if rt.rank == 0 else []
    dist.barrier()  # rank 0 has read every rank's before any leaves (the store may be rank 0's or an agent's)
    if rt.rank == 0:
        epoch = {side: [statistics.median(t[1:]) for t in blocks[side]] for side in blocks}
        ratios = [w / p for w, p in zip(epoch["watched"], epoch["plain"], strict=True)]
        Path(args.json).write_text(json.dumps({"epoch_s": blocks, "median_epoch_s": epoch, "ratios": ratios,
                                               "transport": transport or "backend's own", "model": args.model,
                                               "samples": args.samples, "epochs_per_block": args.epochs,
                                               "watch_threads_cpu_share": shares}))
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
