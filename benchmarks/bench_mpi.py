"""Gradients through MPI against gloo, on this machine, 2 ranks under ``mpirun -np 2`` (Open MPI, shared memory).

    python -m benchmarks.bench_mpi                 # writes benchmarks/results/bench_mpi.{json,md}
    python -m benchmarks.bench_mpi --parts floor   # only (d), the other figures kept

(a) the default ``ddpkit train`` job (the seeds' Linear(20,1)): ``--grad-transport mpi`` vs ``gloo``, median step
    (the trainer's own step p50 over 320 steps); >= 5x wanted;
(b) ``--model mlp`` (4.7M parameters): the same; >= 1.2x wanted;
(c) small all-reduce latency through ddpkit's MPI transport (the Sum the gradient hook calls) vs raw mpi4py in the
    same processes (benchmarks/mpi_latency.py), alternating batches: within 2x wanted;
(d) where the default job's step goes (benchmarks/mpi_step_floor.py): no DDP, DDP with each transport, DDP's own
    all-reduce, in the same processes.
(a) and (b) are whole ``mpirun ... ddpkit train`` runs, alternating gloo/mpi in pairs (the order flips every pair), so
load drift on this shared 2-core machine hits both sides alike; the ratio is taken per pair and the median reported.
The load average is recorded around every run.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(os.environ.get("BENCH_RESULTS_DIR", ROOT / "benchmarks" / "results"))
PAIRS = int(os.environ.get("BENCH_PAIRS", "3"))
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                                                     "TORCHELASTIC", "DDPKIT_", "SLURM_", "OMPI_",
                                                                     "PMI", "OMP_NUM_THREADS"))}
    # ddpkit from this checkout (src/, for a machine without the editable install) and the benchmarks package;
    # CPU only: where CUDA is visible ddpkit would pick NCCL
    path = os.pathsep.join([str(ROOT), str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=path, CUDA_VISIBLE_DEVICES="")
    return env


def _train(tmp: Path, transport: str, *args: str) -> dict[str, Any]:
    out = tmp / f"summary-{transport}.json"
    load = os.getloadavg()[0]
    done = subprocess.run([*MPIRUN, sys.executable, "-m", "ddpkit", "train", "--grad-transport", transport,
                           "--json", str(out), *args], capture_output=True, text=True, timeout=900, env=_env(),
                          cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"train --grad-transport {transport} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    summary = json.loads(out.read_text())
    assert summary["grad_transport"] == ("mpi" if transport == "mpi" else summary["grad_transport"])
    return {"step_ms_p50": summary["step_ms_p50"], "step_ms_p95": summary["step_ms_p95"],
            "samples_per_s": summary["samples_per_s"], "grad_transport": summary["grad_transport"],
            "load_before": load, "load_after": os.getloadavg()[0]}


def bench_train(tmp: Path, *args: str) -> dict[str, Any]:
    pairs = []
    for i in range(PAIRS):
        order = ("gloo", "mpi") if i % 2 == 0 else ("mpi", "gloo")
        runs = {t: _train(tmp, t, *args) for t in order}
        pairs.append({"order": list(order), **runs,
                      "ratio": runs["gloo"]["step_ms_p50"] / runs["mpi"]["step_ms_p50"]})
    return {"args": list(args), "pairs": pairs, "ratio_median": statistics.median(p["ratio"] for p in pairs),
            "gloo_step_ms_median": statistics.median(p["gloo"]["step_ms_p50"] for p in pairs),
            "mpi_step_ms_median": statistics.median(p["mpi"]["step_ms_p50"] for p in pairs)}


def bench_latency() -> dict[str, Any]:
    done = subprocess.run([*MPIRUN, sys.executable, "-m", "benchmarks.mpi_latency"], capture_output=True, text=True,
                          timeout=600, env=_env(), cwd=ROOT)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"mpi_latency failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return dict(json.loads(line[len("RESULT "):]))


def bench_floor() -> dict[str, Any]:
    done = subprocess.run([*MPIRUN, sys.executable, "-m", "benchmarks.mpi_step_floor"], capture_output=True,
                          text=True, timeout=900, env=_env(), cwd=ROOT)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        raise RuntimeError(f"mpi_step_floor failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return {"load_after": os.getloadavg()[0], **json.loads(line[len("RESULT "):])}


FLOOR_ROWS = (("local", "no DDP, no communication: the floor"),
              ("flat_mpi", "no DDP: flat gradient buffer, one MPI.Allreduce after backward (not run by ddpkit)"),
              ("ddp_noop", "DDP + a hook that returns each bucket untouched: no transport at all"),
              ("ddp_mpi", "DDP + ddpkit's hook, `mpi` transport (`--grad-transport mpi`)"),
              ("ddp_mpi_static", "the same with `static_graph=True`"),
              ("ddp_gloo_gather", "DDP + ddpkit's hook, `gloo-gather` transport (`--grad-transport gloo`)"),
              ("ddp_allreduce", "DDP's own gloo all-reduce, no hook (the issue's baseline)"))


def _floor_markdown(f: dict[str, Any]) -> list[str]:
    lines = ["", "## Where the default job's step goes (benchmarks/mpi_step_floor.py)", "",
             "The seeds' Linear(20,1), batch 32, SGD, 2 ranks under `mpirun -np 2`, the same processes, variants "
             "alternating over 15 rounds (400 steps each, 100 for the gloo ones); median over rounds of each round's "
             f"median step; load average {f['load_after']:.1f} after the run.", "",
             "| step | us | x the `ddp_mpi` step |", "|---|---|---|"]
    lines += [f"| {label} | {f[key]:.0f} | {f[key] / f['ddp_mpi']:.2f} |" for key, label in FLOOR_ROWS if key in f]
    return lines


def _markdown(r: dict[str, Any]) -> str:
    lines = ["# Gradients through MPI vs gloo (benchmarks/bench_mpi.py)", "",
             f"{r['machine']}; {r['mpi']}; 2 ranks under `mpirun -np 2`; load average {r['load_start']:.1f} at the "
             f"start, {r['load_end']:.1f} at the end (the machine is shared by several engineers).", "",
             "| job | gloo step p50 (median of pairs) | mpi step p50 | ratio per pair (gloo/mpi) | median | wanted |",
             "|---|---|---|---|---|---|"]
    for key, label, want in (("default", "default train job (Linear(20,1))", ">= 5x"),
                             ("mlp", "`--model mlp` (4.7M params)", ">= 1.2x")):
        b = r[key]
        ratios = ", ".join(f"{p['ratio']:.2f}" for p in b["pairs"])
        lines.append(f"| {label} | {b['gloo_step_ms_median']:.2f} ms | {b['mpi_step_ms_median']:.2f} ms | {ratios} | "
                     f"**{b['ratio_median']:.2f}x** | {want} |")
    lines += ["", "Small all-reduce through ddpkit's MPI transport (MPI.Allreduce on the tensor's numpy view, then the "
              "Future DDP's hook API requires) vs raw mpi4py, same processes, alternating batches of 200 calls, "
              "41 rounds, medians:", "",
              "| message | ddpkit path | raw mpi4py, prepared numpy buffer | ratio | raw mpi4py on `tensor.numpy()` | "
              "ratio |", "|---|---|---|---|---|---|"]
    for size, v in r["latency"].items():
        lines.append(f"| {size} | {v['ddpkit_us']:.2f} us | {v['raw_us']:.2f} us | {v['ratio_vs_raw']:.2f}x | "
                     f"{v['raw_tensor_us']:.2f} us | {v['ratio_vs_raw_tensor']:.2f}x |")
    lines += ["", "Each train row: whole `mpirun -np 2 python -m ddpkit train --grad-transport gloo|mpi` runs, "
              "alternating in pairs (order flipped every pair); step p50 is the trainer's own (320 steps for the "
              "default job).", ""]
    if "floor" in r:
        lines += [*_floor_markdown(r["floor"]), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse

    from ddpkit.comm.mpi_transport import library_name

    ap = argparse.ArgumentParser(prog="bench_mpi")
    ap.add_argument("--parts", choices=["all", "floor"], default="all",
                    help="floor: only the step breakdown (mpi_step_floor), the other figures kept")
    parts = {"train", "latency", "floor"} if ap.parse_args(argv).parts == "all" else {"floor"}
    RESULTS.mkdir(parents=True, exist_ok=True)
    if parts == {"floor"}:  # the step breakdown alone; the hand-written reading of the figures is kept
        kept: dict[str, Any] = json.loads((RESULTS / "bench_mpi.json").read_text())
        kept["floor"] = bench_floor()
        old = (RESULTS / "bench_mpi.md").read_text()
        reading = old[old.index("## Reading these figures"):] if "## Reading these figures" in old else ""
        (RESULTS / "bench_mpi.json").write_text(json.dumps(kept, indent=2) + "\n")
        (RESULTS / "bench_mpi.md").write_text(_markdown(kept) + ("\n" + reading if reading else ""))
        print(_markdown(kept))
        return
    result: dict[str, Any] = {"machine": f"{platform.node()} {os.cpu_count()} cores", "load_start": os.getloadavg()[0],
                              "mpi": library_name(), "pairs": PAIRS}
    with tempfile.TemporaryDirectory() as tmp:
        result["default"] = bench_train(Path(tmp))
        print(f"default job: gloo/mpi median step ratio {result['default']['ratio_median']:.2f}x", flush=True)
        result["mlp"] = bench_train(Path(tmp), "--model", "mlp", "--epochs", "4")
        print(f"mlp: gloo/mpi median step ratio {result['mlp']['ratio_median']:.2f}x", flush=True)
    result["latency"] = bench_latency()
    result["floor"] = bench_floor()
    result["load_end"] = os.getloadavg()[0]
    (RESULTS / "bench_mpi.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "bench_mpi.md").write_text(_markdown(result))
    print(_markdown(result))


if __name__ == "__main__":
    main()
