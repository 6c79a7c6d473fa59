"""The watch's added time per step of a job that moves activations point to point, resolved to about a microsecond:
watched and unwatched steps alternate *step by step* in the same two ranks, so the machine's load drifts alike
for both (the method of benchmarks/watch_step_pairs.py, on two ranks).

    torchrun --standalone --nproc-per-node 2 benchmarks/watch_p2p_pairs.py --json PATH [--pairs 4000] [--spin-us US]

The step: a two-stage pipeline on gloo (rank 0 holds the first stage, rank 1 the second), two micro-batches of
32 x 64 activations, one moved with ``send`` / ``recv``, one with ``isend`` / ``irecv`` and ``wait``; each rank
makes 4 point-to-point calls a step (2 activations forward, 2 gradients back), then its optimizer step. Both
ranks run under one installed watch, its thread running throughout. A watched step calls ``torch.distributed``'s
functions, wrapped; an unwatched one calls torch's own (``_ddpkit_original`` on each wrapper) as if nested in a
watched call (``hooks.inside().depth``), so the ``isend`` and ``Work.wait`` that torch's ``send`` makes inside pass
through the watch as they do in a watched step. (Taking the patches off and putting them back between steps was
tried: each change of ``torch.distributed``'s module and of ``Work``'s class slowed the next step by about 60 us of
CPU, more than the watch itself.)

Per step: the main thread's CPU time (``time.thread_time_ns``) and wall time. Figures per rank: the mean per-step
difference (watched - unwatched) with its 95% interval, and the unwatched step's median CPU and wall time.

``--spin-us US`` (a control): the "watched" step is torch's own too, with US microseconds of busy Python before
each call instead of the watch. A rank waiting in gloo spends CPU while it waits, so a delay on one rank shows in
its peer's CPU as well: the control says how much a known delay reads as.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddpkit.watch import WatchOptions, hooks, install, uninstall

WIDTH, BATCH = 64, 32


def _summary(values_ns: list[int]) -> dict[str, float]:
    us = [v / 1e3 for v in values_ns]
    mean = statistics.fmean(us)
    half = 1.96 * statistics.stdev(us) / math.sqrt(len(us))
    return {"mean_us": mean, "ci95_us": [mean - half, mean + half], "median_us": statistics.median(us)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=4000)
    parser.add_argument("--json", required=True)
    parser.add_argument("--spin-us", type=float, default=None, help="a control: busy Python, not the watch")
    args = parser.parse_args()
    torch.set_num_threads(1)
    session = install(WatchOptions(summary=False))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    stage = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH))
    opt = torch.optim.SGD(stage.parameters(), lr=1e-4)
    xs = [torch.randn(BATCH, WIDTH) for _ in range(2)]
    buf = [torch.empty(BATCH, WIDTH) for _ in range(2)]

    watched_ops = [dist.send, dist.isend, dist.recv, dist.irecv]
    torch_ops = [f._ddpkit_original for f in watched_ops]  # type: ignore[attr-defined]

    def run(send: Any, isend: Any, recv: Any, irecv: Any) -> tuple[int, int]:
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        opt.zero_grad()
        if rank == 0:
            outs = [stage(x) for x in xs]
            send(outs[0].detach(), dst=1)
            sent = isend(outs[1].detach(), dst=1)
            recv(buf[0], src=1)
            irecv(buf[1], src=1).wait()
            sent.wait()
            torch.autograd.backward(outs, buf)
        else:
            recv(buf[0], src=0)
            irecv(buf[1], src=0).wait()
            ins = [b.clone().requires_grad_() for b in buf]
            sum(stage(h).square().mean() for h in ins).backward()
            send(ins[0].grad, dst=0)
            isend(ins[1].grad, dst=0).wait()
        opt.step()
        return time.perf_counter_ns() - wall, time.thread_time_ns() - cpu

    def spun(op: Any, ns: float) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            end = time.perf_counter_ns() + ns
            while time.perf_counter_ns() < end:
                pass
            return op(*args, **kwargs)
        return call

    inside = hooks.inside()  # this thread's place in the watched calls

    def step() -> tuple[int, int]:
        if args.spin_us is None:
            return run(*watched_ops)
        inside.depth = True
        try:
            return run(*[spun(op, args.spin_us * 1e3) for op in torch_ops])
        finally:
            inside.depth = False

    def unwatched() -> tuple[int, int]:
        inside.depth = True  # as inside a watched call: torch's nested isend and wait pass through
        try:
            return run(*torch_ops)
        finally:
            inside.depth = False

    rec = session.recorder
    assert rec is not None
    for _ in range(100):  # warm-up, both kinds
        step()
        unwatched()
    posted = sum(sum(d.values()) for d in rec.p2p_posted.values())
    diffs: dict[str, list[int]] = {"wall": [], "cpu": []}
    base: dict[str, list[int]] = {"wall": [], "cpu": []}
    for i in range(args.pairs):
        if i % 2:  # the same order on both ranks: they step in lockstep
            (wa, ca), (wb, cb) = unwatched(), step()
        else:
            (wb, cb), (wa, ca) = step(), unwatched()
        diffs["wall"].append(wb - wa)
        diffs["cpu"].append(cb - ca)
        base["wall"].append(wa)
        base["cpu"].append(ca)
    watched_calls = sum(sum(d.values()) for d in rec.p2p_posted.values()) - posted
    all_ranks: list[dict[str, object] | None] = [None, None]
    mine = {"rank": rank, "pairs": args.pairs, "watched_p2p_calls": watched_calls,
            "unwatched_step_us": {k: statistics.median(v) / 1e3 for k, v in base.items()},
            "added": {k: _summary(v) for k, v in diffs.items()}}
    dist.all_gather_object(all_ranks, mine)
    uninstall()
    dist.destroy_process_group()
    if rank == 0:
        Path(args.json).write_text(json.dumps({"ranks": all_ranks, "p2p_calls_per_step": 4, "spin_us": args.spin_us,
                                               "activation_bytes": BATCH * WIDTH * 4}, indent=1))
        for r in all_ranks:
            assert r is not None
            added = r["added"]["cpu"]  # type: ignore[index]
            print(f"rank {r['rank']}: added CPU per step {added['mean_us']:.2f} us [{added['ci95_us'][0]:.2f}, "
                  f"{added['ci95_us'][1]:.2f}]; unwatched step {r['unwatched_step_us']}")  # type: ignore[index]
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown under gloo (ddpkit.process.exiting: it aborted ranks that succeeded)


if __name__ == "__main__":
    main()
