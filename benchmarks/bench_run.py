"""``ddpkit run -n 2 -- script.py`` against ``torchrun --standalone --nproc-per-node 2 script.py``, end to end.

    python -m benchmarks.bench_run        # writes benchmarks/results/bench_run.{json,md}

The script is the tests' torchrun-style DDP script (tests/workers/ddp_user.py: init_process_group("gloo"), DDP, five
steps, an all_gather to compare the replicas); both commands run it unchanged. Alternating pairs (the order swaps
every pair, so drift in the machine's load falls on both sides), one whole command per run, wall time from start
to exit; the ratio is taken per pair and the median reported, with the 1-minute load average at the start and the
end. Wanted (issue 26): ddpkit / torchrun <= 1.0.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SCRIPT = ROOT / "tests" / "workers" / "ddp_user.py"
REPEATS = int(os.environ.get("BENCH_REPEATS", "7"))
BIN = Path(sys.executable).parent


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                                                     "TORCHELASTIC", "DDPKIT_", "SLURM_", "OMP_"))}
    return env


def _seconds(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=600)
    elapsed = time.perf_counter() - t0
    if done.returncode != 0 or done.stdout.count("same=True") != 2:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stdout}\n{done.stderr[-2000:]}")
    return elapsed


def main() -> None:
    ours_cmd = [str(BIN / "ddpkit"), "run", "-n", "2", "--", str(SCRIPT)]
    theirs_cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", str(SCRIPT)]
    load_start = os.getloadavg()[0]
    pairs = []
    for i in range(REPEATS):
        if i % 2 == 0:
            ours, theirs = _seconds(ours_cmd), _seconds(theirs_cmd)
        else:
            theirs, ours = _seconds(theirs_cmd), _seconds(ours_cmd)
        pairs.append({"ddpkit_s": round(ours, 3), "torchrun_s": round(theirs, 3), "ratio": round(ours / theirs, 3)})
    result = {
        "repeats": REPEATS, "load_start": load_start, "load_end": os.getloadavg()[0],
        "ddpkit_median_s": round(statistics.median(p["ddpkit_s"] for p in pairs), 3),
        "torchrun_median_s": round(statistics.median(p["torchrun_s"] for p in pairs), 3),
        "ratio_median": round(statistics.median(p["ratio"] for p in pairs), 3),
        "ratio_max": max(p["ratio"] for p in pairs), "pairs": pairs,
        "commands": {"ddpkit": " ".join(ours_cmd[1:]), "torchrun": " ".join(theirs_cmd[1:])},
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_run.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# `ddpkit run -n 2` vs `torchrun --standalone --nproc-per-node 2`, the same script, end to end", "",
             f"{REPEATS} alternating pairs; load average {load_start:.2f} -> {result['load_end']:.2f}.", "",
             "| | median s |", "|---|---|",
             f"| ddpkit run -n 2 | {result['ddpkit_median_s']} |", f"| torchrun | {result['torchrun_median_s']} |",
             "", f"ratio ddpkit / torchrun per pair: median **{result['ratio_median']}**, max {result['ratio_max']} "
             "(wanted <= 1.0)."]
    (RESULTS / "bench_run.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
