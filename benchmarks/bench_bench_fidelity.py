"""Fidelity of ddpkit bench: its all_reduce busbw against an independent minimal loop, measured in the same run.

    python -m benchmarks.bench_bench_fidelity            # writes benchmarks/results/bench_bench_fidelity.{json,md}

For 2-rank gloo all_reduce at 1 MiB, 16 MiB and 64 MiB, two comparisons in one run:
- interleaved (judged): ddpkit bench's measurement code (``prepare`` + ``time_launch``, what every rank of
  ``ddpkit bench`` runs) and the minimal back-to-back loop, alternated in the same two processes
  (``benchmarks/fidelity_interleaved.py``), order swapped every round; the judged figure is the median over rounds
  of the paired ratio ddpkit / minimal, target within 10%. The two halves of a pair are well under a second apart,
  so the load of the other jobs on this shared machine cancels out of the ratio.
- cross-process (reported): ``ddpkit bench`` under its own launcher, then benchmarks/minimal_allreduce.py under
  torchrun, the order swapped every round. Pairs are tens of seconds apart; on a loaded 2-core machine single
  rounds swing 2-3x either way, so this ratio is noise-dominated there; on an idle machine it is the stricter check.
Before each cross-process round the benchmark waits (up to 45 s) for half the CPU to be idle, and records what it
saw. As root, the benchmark and both sides run at nice -10 (the same for both).
Next to each figure: the machine's single-process memory-copy bandwidth (a torch copy of a large buffer, the
physical ceiling for traffic between processes on one machine) and the achieved fraction of it.

The minimal loop times two ways: back-to-back (barrier, ``iters`` calls in a row, slowest rank's total / iters:
nccl-tests' loop and ddpkit's, written again independently; the comparison that is judged) and per-iteration
(barrier, one call, slowest rank of each iteration, averaged; ddpkit's definition before 2026-11-22, shown beside
it). At small sizes the two differ: per-iteration adds each barrier's exit skew to every call.
"""

from __future__ import annotations

import json
import os
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
SIZES = (1 << 20, 16 << 20, 64 << 20)
ROUNDS = int(os.environ.get("FIDELITY_ROUNDS", "11"))
INTERLEAVED_ROUNDS = int(os.environ.get("FIDELITY_INTERLEAVED_ROUNDS", "15"))
ITERS = 20
WARMUP = 5
TOLERANCE = 0.10
NICE = -10 if os.geteuid() == 0 else 0
QUIET_IDLE = 0.5  # before each round, wait for half the CPU to be idle ...
QUIET_WAIT_S = float(os.environ.get("FIDELITY_QUIET_WAIT_S", "45"))  # ... but no longer than this


def _raise_priority() -> None:
    if NICE:
        os.nice(NICE)


def _idle_fraction(seconds: float = 1.0) -> float:
    """Share of CPU time the machine spent idle over ``seconds`` (from /proc/stat; 1.0 elsewhere)."""
    try:
        def sample() -> list[int]:
            return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        a = sample()
        time.sleep(seconds)
        b = sample()
    except OSError:
        return 1.0
    delta = [y - x for x, y in zip(a, b, strict=True)]
    return (delta[3] + delta[4]) / max(1, sum(delta))


def _wait_for_quiet(limit_s: float = QUIET_WAIT_S) -> float:
    """Wait (at most ``limit_s``) until at least QUIET_IDLE of the CPU is idle; return the last idle share seen."""
    deadline = time.monotonic() + limit_s
    idle = _idle_fraction()
    while idle < QUIET_IDLE and time.monotonic() < deadline:
        idle = _idle_fraction()
    return idle


def _env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DDPKIT_FAULTS")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["OMP_NUM_THREADS"] = "1"  # both sides: 2 ranks on 2 cores, as torchrun and ddpkit both choose
    return env


def memcpy_gbps(nbytes: int = 256 << 20, repeats: int = 10) -> float:
    """Bytes copied per second by one process (torch tensor copy), best of ``repeats``."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def run_ddpkit(tmp: Path, round_no: int) -> dict[int, float]:
    out = tmp / f"ddpkit-{round_no}.json"
    cmd = [sys.executable, "-m", "ddpkit", "bench", "-n", "2", "--ops", "all_reduce", "-b", "1M", "-e", "64M",
           "-f", "4", "--iters", str(ITERS), "-w", str(WARMUP), "--json", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, env=_env(), timeout=600)
    rows = json.loads(out.read_text())["ops"][0]["rows"]
    return {row["size"]: row["in_place"]["busbw"] for row in rows if row["size"] in SIZES}


def run_minimal() -> dict[int, dict[str, float]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "benchmarks" / "minimal_allreduce.py"), "--sizes", ",".join(map(str, SIZES)),
           "--iters", str(ITERS), "--warmup", str(WARMUP)]
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True, env=_env(), timeout=600)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return {int(k): v for k, v in json.loads(line[len("RESULT "):]).items()}


def run_interleaved() -> dict[int, dict[str, list[float]]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "benchmarks" / "fidelity_interleaved.py"), "--sizes", ",".join(map(str, SIZES)),
           "--rounds", str(INTERLEAVED_ROUNDS), "--iters", str(ITERS), "--warmup", str(WARMUP)]
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True, env=_env(), timeout=900)
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return {int(k): v for k, v in json.loads(line[len("RESULT "):]).items()}


def _summary(runs: list[float], ceiling: float) -> dict[str, object]:
    return {"best": max(runs), "median": statistics.median(runs), "runs": runs, "best_of_memcpy": max(runs) / ceiling}


def main() -> int:
    _raise_priority()  # inherited by every subprocess: both sides and the memcpy ceiling alike
    ceiling_before = memcpy_gbps()
    runs: dict[str, dict[int, list[float]]] = {k: {s: [] for s in SIZES}
                                               for k in ("ddpkit", "per_iteration", "back_to_back")}
    loads: list[float] = []
    idle: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_no in range(ROUNDS):
            idle.append(_wait_for_quiet())
            loads.append(os.getloadavg()[0])
            theirs = run_minimal() if round_no % 2 else None
            ours = run_ddpkit(Path(tmp), round_no)
            theirs = theirs or run_minimal()
            for size in SIZES:
                runs["ddpkit"][size].append(ours[size])
                for method in ("per_iteration", "back_to_back"):
                    runs[method][size].append(theirs[size][method])
            print(f"round {round_no + 1}/{ROUNDS} done", flush=True)
    interleaved = run_interleaved()
    ceiling = max(ceiling_before, memcpy_gbps())
    rows = []
    for size in SIZES:
        row: dict[str, object] = {"size": size}
        row.update({k: _summary(runs[k][size], ceiling) for k in runs})
        paired = [a / b for a, b in zip(runs["ddpkit"][size], runs["back_to_back"][size], strict=True)]
        quartiles = statistics.quantiles(paired, n=4)
        ratio = statistics.median(paired)
        row["cross_process_paired_ratios"] = paired
        row["cross_process_ratio"] = ratio
        row["cross_process_ratio_iqr"] = [quartiles[0], quartiles[2]]
        same = interleaved[size]
        paired_same = [a / b for a, b in zip(same["ddpkit"], same["minimal"], strict=True)]
        q_same = statistics.quantiles(paired_same, n=4)
        row["interleaved"] = {"ddpkit": _summary(same["ddpkit"], ceiling),
                              "minimal": _summary(same["minimal"], ceiling), "paired_ratios": paired_same}
        row["ratio"] = statistics.median(paired_same)
        row["ratio_iqr"] = [q_same[0], q_same[2]]
        row["best_ratio"] = max(runs["ddpkit"][size]) / max(runs["back_to_back"][size])
        row["median_ratio"] = statistics.median(runs["ddpkit"][size]) / statistics.median(runs["back_to_back"][size])
        row["paired_ratio_to_per_iteration"] = statistics.median(
            a / b for a, b in zip(runs["ddpkit"][size], runs["per_iteration"][size], strict=True))
        row["within_tolerance"] = abs(row["ratio"] - 1) <= TOLERANCE
        rows.append(row)
    passed = all(r["within_tolerance"] for r in rows)
    result = {"benchmark": "bench_fidelity", "rounds": ROUNDS,
              "interleaved_rounds": INTERLEAVED_ROUNDS, "iters": ITERS, "warmup": WARMUP, "ranks": 2,
              "backend": "gloo", "tolerance": TOLERANCE, "nice": NICE, "memcpy_gbps": ceiling,
              "torch": torch.__version__, "cpus": os.cpu_count(), "load_avg_per_round": loads,
              "idle_before_round": idle, "rows": rows,
              "passed": passed, "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_bench_fidelity.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "bench_bench_fidelity.md").write_text(_markdown(result))
    print(_markdown(result))
    return 0 if passed else 1


def _markdown(result: dict[str, Any]) -> str:
    ceiling = result["memcpy_gbps"]
    tol = result["tolerance"]
    md = [
        "# ddpkit bench fidelity: all_reduce busbw vs an independent minimal loop",
        "",
        f"2 ranks, gloo on CPU, {result['cpus']} cores, torch {result['torch']}, {result['iters']} timed iterations "
        f"after {result['warmup']} warm-up, everything at nice {result['nice']}. Measured {result['measured_at']} on a "
        f"shared machine (1-minute load average per cross-process round: "
        f"{', '.join(f'{x:.1f}' for x in result['load_avg_per_round'])}).",
        "",
        f"Single-process memory-copy bandwidth (torch copy of 256 MiB, best of 10): **{ceiling:.2f} GB/s**.",
        "",
        f"## Judged: interleaved in the same two processes ({result['interleaved_rounds']} rounds)",
        "",
        "ddpkit's measurement code (`prepare` + `time_launch`) and the minimal back-to-back loop, alternated, order "
        "swapped every round (`benchmarks/fidelity_interleaved.py`).",
        "",
        f"| size | ddpkit busbw, median (best) GB/s | of memcpy | minimal back-to-back, median (best) GB/s | of memcpy "
        f"| paired ratio, median [IQR] | within {tol:.0%} |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        ours, theirs = r["interleaved"]["ddpkit"], r["interleaved"]["minimal"]
        md.append(f"| {r['size'] >> 20} MiB | {ours['median']:.3f} ({ours['best']:.3f}) | "
                  f"{ours['median'] / ceiling:.1%} | {theirs['median']:.3f} ({theirs['best']:.3f}) | "
                  f"{theirs['median'] / ceiling:.1%} | {r['ratio']:.3f} [{r['ratio_iqr'][0]:.2f}, "
                  f"{r['ratio_iqr'][1]:.2f}] | {'yes' if r['within_tolerance'] else 'NO'} |")
    md += ["", f"Verdict: {'PASS' if result['passed'] else 'FAIL'} (median paired ratio within {tol:.0%} of 1 at "
           "every size).", "",
           f"## Reported: cross-process ({result['rounds']} rounds)", "",
           "`ddpkit bench -n 2` (its own launcher) and `benchmarks/minimal_allreduce.py` under torchrun, back to back, "
           "order swapped every round; the minimal script times back-to-back (nccl-tests) and per-iteration (a "
           "barrier before every call, ddpkit's definition before 2026-11-22).", "",
           "| size | ddpkit busbw, median (best) GB/s | of memcpy | minimal back-to-back, median (best) GB/s "
           "| paired ratio, median [IQR] | minimal per-iteration, median (best) GB/s | paired ratio to per-iteration |",
           "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ours, theirs, other = r["ddpkit"], r["back_to_back"], r["per_iteration"]
        iqr = r["cross_process_ratio_iqr"]
        md.append(f"| {r['size'] >> 20} MiB | {ours['median']:.3f} ({ours['best']:.3f}) | "
                  f"{ours['median'] / ceiling:.1%} | {theirs['median']:.3f} ({theirs['best']:.3f}) | "
                  f"{r['cross_process_ratio']:.3f} [{iqr[0]:.2f}, {iqr[1]:.2f}] | "
                  f"{other['median']:.3f} ({other['best']:.3f}) | {r['paired_ratio_to_per_iteration']:.3f} |")
    md += ["", "Per-round busbw (GB/s), interleaved ddpkit / minimal:", ""]
    for r in result["rows"]:
        pairs = zip(r["interleaved"]["ddpkit"]["runs"], r["interleaved"]["minimal"]["runs"], strict=True)
        md.append(f"- {r['size'] >> 20} MiB: " + ", ".join(f"{a:.3f}/{b:.3f}" for a, b in pairs))
    md += ["", "Per-round busbw (GB/s), cross-process ddpkit / minimal back-to-back / minimal per-iteration:", ""]
    for r in result["rows"]:
        triples = zip(r["ddpkit"]["runs"], r["back_to_back"]["runs"], r["per_iteration"]["runs"], strict=True)
        md.append(f"- {r['size'] >> 20} MiB: " + ", ".join(f"{a:.3f}/{b:.3f}/{c:.3f}" for a, b, c in triples))
    return "\n".join(md) + "\n"


if __name__ == "__main__":
    sys.exit(main())
