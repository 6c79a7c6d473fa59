"""ddpkit train against the loops it replaces, on this machine, 2 ranks, same launcher (torchrun), same data.

    python -m benchmarks.bench_train          # writes benchmarks/results/bench_train.{json,md}

(a) the default job vs the seeds' ddp.py loop (benchmarks/seed_ddp.py): steady-state samples/s, >= 1.0x wanted.
    Judged in the same two processes, alternating (benchmarks/train_interleaved.py: load drift and process placement
    cancel out of each paired ratio); also reported across processes (each under its own torchrun, alternating);
    beside it, the gloo latency that makes the difference (benchmarks/gather_latency.py: all-reduce vs the
    all-gather + local sum that ddpkit's gradient hook uses for small buckets);
(b) --model mlp (4.7M parameters) vs a minimal hand-written DDP loop (benchmarks/minimal_ddp.py): >= 0.98x;
(c) --async-snapshot on a ~100M-parameter model: training-thread stall per snapshot vs a synchronous torch.save,
    <= 20% wanted; (d) seconds from a killed worker to the first resumed step (ddpkit -n 2 --max-restarts);
(e) 2-rank mlp throughput as a fraction of one process using both cores (the ceiling here).
Throughput is the median epoch after the first (start-up, DDP's lazy imports and the first epoch excluded); runs
alternate A/B, ratios are per pair, median reported. The fastest epoch is recorded beside it: on this shared
2-core VM a default-job epoch is ~50 ms and the step ~1.5 ms of gloo all-reduce latency, so the fastest of a few
epochs is an extreme value that moves by tens of percent between runs, while the median of 30 does not.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
REPEATS = int(os.environ.get("BENCH_REPEATS", "3"))
INTERLEAVED_ROUNDS = int(os.environ.get("BENCH_INTERLEAVED_ROUNDS", "15"))
HUGE_WIDTH = 10000  # 256*W + W*W + W + ... = 102.6M parameters at depth 2


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                                                     "TORCHELASTIC", "DDPKIT_", "SLURM_"))}
    env.pop("OMP_NUM_THREADS", None)
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT), **extra)
    return env


def _torchrun(nproc: int, args: list[str], env: dict[str, str] | None = None) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env or _env(), timeout=900, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")


def _steady(epoch_s: list[float], samples_per_epoch: int) -> float:
    """Samples/s of the median epoch after the first (both sides are measured the same way)."""
    return samples_per_epoch / statistics.median(epoch_s[1:])


def _fastest(epoch_s: list[float], samples_per_epoch: int) -> float:
    """Samples/s of the fastest epoch after the first (recorded for comparison with earlier results)."""
    return samples_per_epoch / min(epoch_s[1:])


def _ddpkit(nproc: int, tmp: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    out = tmp / f"ddpkit-{time.monotonic_ns()}.json"
    _torchrun(nproc, ["-m", "ddpkit", "train", "--json", str(out), *args], env)
    return dict(json.loads(out.read_text()))


def _epochs(summary: dict[str, Any]) -> list[float]:
    return [summary["epoch_s"][k] for k in sorted(summary["epoch_s"], key=int)]


def _ddpkit_rate(summary: dict[str, Any], samples: int) -> float:
    return _steady(_epochs(summary), samples)


def _script(nproc: int, tmp: Path, script: str, *args: str) -> list[float]:
    out = tmp / f"script-{time.monotonic_ns()}.json"
    _torchrun(nproc, [str(ROOT / "benchmarks" / script), *args, "--json", str(out)])
    return list(json.loads(out.read_text())["epoch_s"])


def bench_seed_interleaved(tmp: Path) -> dict[str, Any]:
    out = tmp / "interleaved.json"
    _torchrun(2, [str(ROOT / "benchmarks" / "train_interleaved.py"), "--rounds", str(INTERLEAVED_ROUNDS),
                  "--json", str(out)])
    r = json.loads(out.read_text())
    return {"ratio": statistics.median(r["ratios"]), "ratios": r["ratios"], "rounds": INTERLEAVED_ROUNDS,
            "ddpkit_samples_per_s": statistics.median(r["samples_per_s"]["ddpkit"]),
            "seed_samples_per_s": statistics.median(r["samples_per_s"]["seed"]),
            "epochs_per_block": r["epochs_per_block"], "target": ">= 1.0"}


def bench_gather_latency(tmp: Path) -> dict[str, Any]:
    out = tmp / "gather.json"
    _torchrun(2, [str(ROOT / "benchmarks" / "gather_latency.py"), "--json", str(out)])
    r = json.loads(out.read_text())
    return {count: {"all_reduce_us": statistics.median(s["all_reduce"]) * 1e6,
                    "all_gather_sum_us": statistics.median(s["all_gather_sum"]) * 1e6,
                    "speedup": statistics.median(a / b for a, b in zip(s["all_reduce"], s["all_gather_sum"],
                                                                         strict=True))}
            for count, s in r["seconds"].items()}


def bench_seed(tmp: Path) -> dict[str, Any]:
    epochs, samples = "31", 2048
    ours, seeds, ratios, fastest_ratios = [], [], [], []
    for _ in range(REPEATS):
        seed_s = _script(2, tmp, "seed_ddp.py", epochs, "1000", "--snapshot_path", str(tmp / "s.pt"))
        mine_s = _epochs(_ddpkit(2, tmp, "--epochs", epochs))
        seed, mine = _steady(seed_s, samples), _steady(mine_s, samples)
        seeds.append(seed)
        ours.append(mine)
        ratios.append(mine / seed)
        fastest_ratios.append(_fastest(mine_s, samples) / _fastest(seed_s, samples))
    return {"ddpkit_samples_per_s": statistics.median(ours), "seed_samples_per_s": statistics.median(seeds),
            "ratio": statistics.median(ratios), "ratios": ratios, "fastest_epoch_ratio": statistics.median(
                fastest_ratios), "fastest_epoch_ratios": fastest_ratios, "epochs_per_run": int(epochs),
            "target": ">= 1.0"}


def bench_mlp(tmp: Path) -> dict[str, Any]:
    epochs, samples = "6", 2048
    ours, minimal, ratios = [], [], []
    for _ in range(REPEATS):
        low = _steady(_script(2, tmp, "minimal_ddp.py", "--model", "mlp", "--epochs", epochs), samples)
        mine = _ddpkit_rate(_ddpkit(2, tmp, "--model", "mlp", "--epochs", epochs), samples)
        minimal.append(low)
        ours.append(mine)
        ratios.append(mine / low)
    return {"ddpkit_samples_per_s": statistics.median(ours), "minimal_samples_per_s": statistics.median(minimal),
            "ratio": statistics.median(ratios), "ratios": ratios, "target": ">= 0.98"}


def bench_ceiling(tmp: Path, two_rank_rate: float) -> dict[str, Any]:
    """One process, both cores (2 threads), the same global batch (64) as 2 ranks x 32."""
    rates = []
    for _ in range(REPEATS):
        s = _ddpkit(1, tmp, "--model", "mlp", "--epochs", "6", "--batch-size", "64", env=_env(OMP_NUM_THREADS="2"))
        rates.append(_ddpkit_rate(s, 2048))
    one = statistics.median(rates)
    return {"one_process_two_threads_samples_per_s": one, "two_ranks_samples_per_s": two_rank_rate,
            "fraction": two_rank_rate / one}


def bench_snapshot(tmp: Path) -> dict[str, Any]:
    from ddpkit.train.data import make_model

    model = make_model("mlp", HUGE_WIDTH, 2)
    params = sum(p.numel() for p in model.parameters())
    saves = []
    for i in range(REPEATS):
        t0 = time.perf_counter()
        torch.save(model.state_dict(), tmp / f"plain-{i}.pt")
        saves.append(time.perf_counter() - t0)
        (tmp / f"plain-{i}.pt").unlink()
    del model
    stalls: dict[str, list[float]] = {"sync": [], "async": []}
    for _ in range(max(2, REPEATS - 1)):
        for mode in ("sync", "async"):
            d = tmp / f"snap-{mode}-{time.monotonic_ns()}"
            d.mkdir()
            extra = ["--async-snapshot"] if mode == "async" else []
            # 3 steps per epoch, a snapshot every 2 epochs: the background write has 6 steps to finish
            s = _ddpkit(2, tmp, "--model", "mlp", "--width", str(HUGE_WIDTH), "--samples", "192", "--epochs", "6",
                        "--save-every", "2", "--snapshot-path", f"{d}/", "--keep", "1", *extra)
            stalls[mode] += s["snapshot_stall_s"]
            for f in d.iterdir():
                f.unlink()
    plain = statistics.median(saves)
    stall_async, stall_sync = statistics.median(stalls["async"]), statistics.median(stalls["sync"])
    return {"parameters": params, "torch_save_s": plain, "sync_snapshot_stall_s": stall_sync,
            "async_first_snapshot_stall_s": statistics.median(stalls["async"][::3]),
            "async_snapshot_stall_s": stall_async, "async_stall_vs_torch_save": stall_async / plain,
            "async_stall_vs_sync_snapshot": stall_async / stall_sync, "stalls": stalls, "target": "<= 0.20"}


def bench_restart(tmp: Path) -> dict[str, Any]:
    times = []
    for _ in range(REPEATS):
        d = tmp / f"kill-{time.monotonic_ns()}"
        d.mkdir()
        out = d / "summary.json"
        cmd = [sys.executable, "-m", "ddpkit", "train", "-n", "2", "--samples", "512", "--epochs", "4",
               "--max-restarts", "2", "--drill", "kill-worker@epoch=2,rank=1", "--snapshot-path", str(d / "snap.pt"),
               "--json", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600, cwd=ROOT)
        if done.returncode != 0:
            raise RuntimeError(f"kill drill failed:\n{done.stderr[-3000:]}")
        fired = json.loads((d / "snap.drills.json").read_text())
        killed_at = next(iter(fired.values()))["time"]
        times.append(json.loads(out.read_text())["first_step_at"] - killed_at)
    return {"kill_to_first_resumed_step_s": statistics.median(times), "runs_s": times}


def main() -> None:
    """BENCH_PARTS=seed,mlp,snapshot,restart (default all) re-measures only those parts and keeps the others'
    figures from the last results file; each part records when it was measured."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    parts = os.environ.get("BENCH_PARTS", "seed,mlp,snapshot,restart").split(",")
    path = RESULTS / "bench_train.json"
    result: dict[str, Any] = json.loads(path.read_text()) if path.exists() and len(parts) < 4 else {}

    def stamp() -> dict[str, Any]:
        return {"measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "load_average_at_start": round(os.getloadavg()[0], 2)}

    with tempfile.TemporaryDirectory(prefix="bench-train-") as name:
        tmp = Path(name)
        started = time.time()
        if "seed" in parts:
            result["default_vs_seed_interleaved"] = dict(stamp(), **bench_seed_interleaved(tmp))
            result["default_vs_seed"] = dict(stamp(), **bench_seed(tmp))
            result["gather_latency"] = dict(stamp(), **bench_gather_latency(tmp))
        if "mlp" in parts:
            result["mlp_vs_minimal"] = dict(stamp(), **bench_mlp(tmp))
            result["two_ranks_vs_one_process"] = dict(stamp(), **bench_ceiling(tmp, result["mlp_vs_minimal"][
                "ddpkit_samples_per_s"]))
        if "snapshot" in parts:
            result["async_snapshot"] = dict(stamp(), **bench_snapshot(tmp))
        if "restart" in parts:
            result["restart"] = dict(stamp(), **bench_restart(tmp))
    result.update(machine={"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
                  repeats=REPEATS, wall_s=time.time() - started)
    path.write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "bench_train.md").write_text(_markdown(result))
    print(_markdown(result))


def _markdown(r: dict[str, Any]) -> str:
    a, b, c, s, k = (r["default_vs_seed"], r["mlp_vs_minimal"], r["two_ranks_vs_one_process"], r["async_snapshot"],
                     r["restart"])
    ai, g = r["default_vs_seed_interleaved"], r["gather_latency"]
    rows = [
        (f"(a) default job vs the seeds' ddp.py loop, same processes, {ai['rounds']} alternating rounds (samples/s)",
         f"{ai['ddpkit_samples_per_s']:,.0f}", f"{ai['seed_samples_per_s']:,.0f}", f"{ai['ratio']:.2f}x", ">= 1.0x"),
        (f"(a) the same, each under its own torchrun, {len(a['ratios'])} alternating pairs (samples/s)",
         f"{a['ddpkit_samples_per_s']:,.0f}", f"{a['seed_samples_per_s']:,.0f}", f"{a['ratio']:.2f}x", ""),
        ("(a) those pairs judged by their fastest epoch (samples/s ratio)", "", "",
         f"{a['fastest_epoch_ratio']:.2f}x" if "fastest_epoch_ratio" in a else "n/a", ""),
        ("(b) --model mlp (4.7M) vs a minimal DDP loop (samples/s)", f"{b['ddpkit_samples_per_s']:,.0f}",
         f"{b['minimal_samples_per_s']:,.0f}", f"{b['ratio']:.3f}x", ">= 0.98x"),
        (f"(c) --async-snapshot stall per snapshot, {s['parameters'] / 1e6:.0f}M params (s)",
         f"{s['async_snapshot_stall_s']:.3f}", f"torch.save {s['torch_save_s']:.3f}",
         f"{s['async_stall_vs_torch_save']:.1%}", "<= 20%"),
        ("(c) the same, first snapshot of a run (allocates its copy buffers) (s)",
         f"{s['async_first_snapshot_stall_s']:.3f}", f"torch.save {s['torch_save_s']:.3f}",
         f"{s['async_first_snapshot_stall_s'] / s['torch_save_s']:.1%}", ""),
        ("(c) synchronous snapshot stall (checksum, fsync, rename included) (s)", f"{s['sync_snapshot_stall_s']:.3f}",
         f"torch.save {s['torch_save_s']:.3f}", f"{s['sync_snapshot_stall_s'] / s['torch_save_s']:.2f}x", ""),
        ("(d) killed worker -> first resumed step (s)", f"{k['kill_to_first_resumed_step_s']:.1f}", "", "", ""),
        ("2 ranks x 1 thread vs 1 process x 2 threads, mlp (samples/s)", f"{c['two_ranks_samples_per_s']:,.0f}",
         f"{c['one_process_two_threads_samples_per_s']:,.0f}", f"{c['fraction']:.0%}", "the ceiling"),
    ]
    def when(part: dict[str, Any]) -> str:
        load = part.get("load_average_at_start")
        return str(part.get("measured_at", "?")) + (f" (load {load})" if load is not None else "")

    table = "\n".join("| " + " | ".join(row) + " |" for row in rows)
    latency = "\n".join(f"| {int(n):,} | {v['all_reduce_us']:,.0f} | {v['all_gather_sum_us']:,.0f} | "
                        f"{v['speedup']:.2f}x |" for n, v in g.items() if isinstance(v, dict))
    return f"""# bench_train: ddpkit train on this machine

{r['machine']['cpus']} cores, torch {r['machine']['torch']}, 2 gloo ranks under torchrun, {r['repeats']} repeats
(alternating, median). Throughput: the median epoch after the first (start-up and the first epoch excluded).

| comparison | ddpkit | reference | ratio | target |
|---|---|---|---|---|
{table}

Why (a) is faster: the seeds' step is ~0.1 ms of per-sample DataLoader work plus one gloo all-reduce of
Linear(20, 1)'s 21 gradients, which is latency-bound here; ddpkit indexes its batch in one operation and averages
small gradient buckets with an all-gather and a local sum (half the message steps of gloo's ring all-reduce).
2 gloo ranks, same processes, alternating, median per call:

| floats | all_reduce (us) | all_gather + sum (us) | speedup |
|---|---|---|---|
{latency}

Per-round ratios: (a, same processes) {', '.join(f'{x:.2f}' for x in ai['ratios'])};
(a, own torchrun) {', '.join(f'{x:.2f}' for x in a['ratios'])}; (b) {', '.join(f'{x:.3f}' for x in b['ratios'])}.
Restart runs (s): {', '.join(f'{x:.1f}' for x in k['runs_s'])}.
Measured (UTC, 1-minute load average at the start): (a) {when(ai)}, (b) {when(b)}, (c) {when(s)}, (d) {when(k)}.
The machine is a shared 2-core VM: single figures move by tens of percent between runs, ratios of alternating
pairs much less.

"""


if __name__ == "__main__":
    main()
