"""The watch's added time per DDP step, resolved to about a microsecond on a noisy machine: watched and unwatched
models alternate *step by step* in one process under one installed watch, so the machine's load, the CPU's clock
and the caches drift alike for both, and the per-step differences are averaged over many thousand pairs.

    python benchmarks/watch_step_pairs.py --model ours|hookless --json PATH [--pairs 20000] [--device cuda]

(benchmarks/watch_cost.py alternates blocks of 400 steps with the watch installed and uninstalled; its block pairs
spread by tens to a hundred microseconds, wider than the 5-17 us that 1% of a 0.5-1.7 ms step allows.)

How both run under one watch: the unwatched models are of a DDP subclass whose ``forward`` is torch's own, taken
before the watch wraps ``DistributedDataParallel.forward``, so they mark no step and are never counted; their hook
is ddpkit's own (``GradientAveraging``), registered before the watch was installed, so its all-reduce is torch's
own function too. The watched models take the wrapped forward and the hook the watch counts. One process, a gloo
group of one (no communication), a 1409-parameter model, one thread, one kind of model per process (the watch
counts one job's steps; two watched models in one process would share its step counter). Kinds:

- ``ours``: ddpkit's own hook (what ``train`` and ``check`` register), counted, against the same hook unwatched;
- ``hookless``: no hook (DDP's C++ path), counted, against the same unwatched.

Per step: the main thread's CPU time (``time.thread_time_ns``) and wall time. Figures: the mean per-step difference
with its 95% interval (1.96 standard errors) and the median difference.

``--device cuda`` (a GPU machine: scripts/gpu_check.sh runs it): an NCCL group of one, the models and data on the
GPU, and the benchmark (not the watch) synchronises the device after each step, so the wall time is the step's
real time on the GPU; the watch itself adds no synchronisation (an NCCL collective counts as completed when its
Future completes on the CPU side).
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

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddpkit.comm.gradients import GradientAveraging
from ddpkit.watch import WatchOptions, install, uninstall


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))


def _ours(model: DDP) -> DDP:
    """ddpkit's own hook, registered as ``register_gradient_averaging`` does on more than one rank."""
    GradientAveraging("all-reduce", 1).register(model)
    return model


def _summary(diffs_ns: list[int]) -> dict[str, float]:
    us = [d / 1e3 for d in diffs_ns]
    mean = statistics.fmean(us)
    half = 1.96 * statistics.stdev(us) / math.sqrt(len(us))
    return {"mean_us": mean, "ci95_us": [mean - half, mean + half], "median_us": statistics.median(us)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=20000)
    parser.add_argument("--model", choices=("ours", "hookless"), required=True,
                        help="one kind per process: the watch's recorder counts one job's steps")
    parser.add_argument("--json", required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: an NCCL group of one, models and data on GPU 0, a synchronise after each step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29938"))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if cuda else "gloo", rank=0, world_size=1)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    settle = torch.cuda.synchronize if cuda else (lambda: None)

    class Plain(DDP):
        forward = DDP.forward  # torch's own, taken before the watch wraps DDP's

    x = torch.randn(32, 20, device=device)
    make = {"ours": lambda cls: _ours(cls(_net().to(device))), "hookless": lambda cls: cls(_net().to(device))}[
        args.model]
    plain = {args.model: make(Plain)}  # before the watch: unwrapped, unwatched
    install(WatchOptions(summary=False))
    watched = {args.model: make(DDP)}
    pairs = {name: (plain[name], watched[name]) for name in plain}
    opts = {id(m): torch.optim.SGD(m.parameters(), lr=1e-3) for pair in pairs.values() for m in pair}

    def step(model: DDP) -> tuple[int, int]:
        opt = opts[id(model)]
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        settle()
        return time.perf_counter_ns() - wall, time.thread_time_ns() - cpu

    for pair in pairs.values():  # warm-up: the first forward under the watch counts the model
        for model in pair:
            for _ in range(50):
                step(model)
    diffs: dict[str, dict[str, list[int]]] = {name: {"wall": [], "cpu": []} for name in pairs}
    base: dict[str, list[int]] = {name: [] for name in pairs}
    for i in range(args.pairs):
        for name, (a, b) in pairs.items():
            if i % 2:
                (wa, ca), (wb, cb) = step(a), step(b)
            else:
                (wb, cb), (wa, ca) = step(b), step(a)
            diffs[name]["wall"].append(wb - wa)
            diffs[name]["cpu"].append(cb - ca)
            base[name].append(ca)
    counted = {name: watched[name]._ddpkit_seen is not None for name in watched}  # type: ignore[attr-defined]
    uninstall()
    dist.destroy_process_group()
    out = {"model": args.model, "pairs": args.pairs, "params": 1409, "counted": counted, "device": args.device,
           "backend": "nccl" if cuda else "gloo",
           "unwatched_step_cpu_us": {n: statistics.median(v) / 1e3 for n, v in base.items()},
           "added": {n: {k: _summary(v) for k, v in d.items()} for n, d in diffs.items()}}
    Path(args.json).write_text(json.dumps(out, indent=1))
    for name, d in out["added"].items():
        print(f"{name}: added CPU per step {d['cpu']['mean_us']:.2f} us [{d['cpu']['ci95_us'][0]:.2f}, "
              f"{d['cpu']['ci95_us'][1]:.2f}] (median {d['cpu']['median_us']:.2f}); wall {d['wall']['mean_us']:.2f} us")


if __name__ == "__main__":
    main()
