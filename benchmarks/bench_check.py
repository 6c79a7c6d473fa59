"""Wall time of `ddpkit check -n 2` against the seeds' bare hello world under torchrun, side by side.

    python -m benchmarks.bench_check             # writes benchmarks/results/bench_check.{json,md}
    CHECK_ROUNDS=3 python -m benchmarks.bench_check

Each round runs both, end to end as a user types them, the order swapped every round:
``ddpkit check -n 2`` (roll-call, 9 verified collectives, DDP sync) and ``torchrun --standalone
--nproc-per-node 2 benchmarks/baseline_hello.py`` (init_process_group and one print per rank). The machine is
shared, so rounds are noisy: the ratio of medians is the figure, with the ratio of best rounds beside it.
Target: ddpkit check within 1.5x of the bare hello world. A third command, the same check with
DDPKIT_START_METHOD=spawn, shows what the agent's preload of torch._dynamo (ddpkit.launch) saves.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ROUNDS = int(os.environ.get("CHECK_ROUNDS", "5"))
TARGET = 1.5


def _env() -> dict[str, str]:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DDPKIT_FAULTS",
            "TORCHELASTIC_RUN_ID", "OMP_NUM_THREADS")
    return {k: v for k, v in os.environ.items() if k not in drop}


COMMANDS = {
    "ddpkit check -n 2": [sys.executable, "-m", "ddpkit", "check", "-n", "2"],
    "torchrun hello (baseline)": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                  "2", str(ROOT / "benchmarks" / "baseline_hello.py")],
    # for reference: the ranks as fresh processes, each importing torch._dynamo for DDP itself
    "ddpkit check -n 2 (DDPKIT_START_METHOD=spawn)": ["env", "DDPKIT_START_METHOD=spawn", sys.executable, "-m",
                                                      "ddpkit", "check", "-n", "2"],
}


def _timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300, cwd=ROOT)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return seconds


def main() -> int:
    names = list(COMMANDS)
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(1):  # warm the page cache for both (not counted)
        for name in names:
            _timed(COMMANDS[name])
    for round_no in range(ROUNDS):
        for name in names if round_no % 2 == 0 else names[::-1]:
            times[name].append(_timed(COMMANDS[name]))
            print(f"round {round_no}: {name}: {times[name][-1]:.2f} s", flush=True)
    check, base = names[:2]
    median = {n: statistics.median(v) for n, v in times.items()}
    ratio = median[check] / median[base]
    spawn_ratio = median[names[2]] / median[base]
    best_ratio = min(times[check]) / min(times[base])
    result = {
        "benchmark": "check wall time vs bare torchrun hello world", "rounds": ROUNDS, "target_ratio": TARGET,
        "seconds": times, "median_s": median, "ratio_of_medians": ratio, "ratio_of_best": best_ratio,
        "spawn_ratio_of_medians": spawn_ratio,
        "passed": ratio <= TARGET, "torch": _torch_version(), "python": platform.python_version(),
        "cores": len(os.sched_getaffinity(0)), "load_avg": os.getloadavg(),
        "when": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_check.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "bench_check.md").write_text(_markdown(result, check, base))
    print(_markdown(result, check, base))
    return 0


def _torch_version() -> str:
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                         text=True, env=_env())
    return out.stdout.strip()


def _markdown(r: dict, check: str, base: str) -> str:  # type: ignore[type-arg]
    rows = "\n".join(f"| {n} | {r['median_s'][n]:.2f} | {min(v):.2f} | {', '.join(f'{x:.2f}' for x in v)} |"
                     for n, v in r["seconds"].items())
    return (f"# ddpkit check vs the seeds' bare hello world\n\n"
            f"2 local ranks, gloo on CPU, {r['cores']} cores, torch {r['torch']}, Python {r['python']}; "
            f"{r['rounds']} alternating rounds after one warm-up of each, end-to-end wall time of the command. "
            f"Measured {r['when']} on a shared machine (load average at the end: "
            f"{', '.join(f'{x:.1f}' for x in r['load_avg'])}).\n\n"
            f"| command | median (s) | best (s) | rounds (s) |\n|---|---|---|---|\n{rows}\n\n"
            f"Ratio `{check}` / `{base}`: **{r['ratio_of_medians']:.2f}x** of medians "
            f"({r['ratio_of_best']:.2f}x of best rounds); target <= {r['target_ratio']}x: "
            f"**{'PASS' if r['passed'] else 'FAIL'}**.\n\n"
            f"Without the preload (every rank a fresh process importing torch._dynamo for DDP): "
            f"{r['spawn_ratio_of_medians']:.2f}x of medians.\n")


if __name__ == "__main__":
    sys.exit(main())
