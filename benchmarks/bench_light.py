"""The commands a login node runs, timed from outside: they load no torch, so they start in a fraction of a second.

    python -m benchmarks.bench_light        # writes benchmarks/results/bench_light.{json,md}

Each command (`ddpkit env`, `ddpkit --help`, `ddpkit submit slurm --dry-run`) runs alternately with `python -c pass`
(the interpreter's own floor, same Python), REPEATS pairs each, one whole process per run; medians reported, with
the 1-minute load average at the start and the end. Wanted (issue 25): `ddpkit env` median under 0.3 s.
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
REPEATS = int(os.environ.get("BENCH_REPEATS", "15"))
COMMANDS = {
    "ddpkit env": ["-m", "ddpkit", "env"],
    "ddpkit --help": ["-m", "ddpkit", "--help"],
    "ddpkit submit slurm --dry-run": ["-m", "ddpkit", "submit", "slurm", "--dry-run", "-j", "2x2", "--", "check"],
}


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                                                      "TORCHELASTIC", "DDPKIT_", "SLURM_"))}


def _seconds(args: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, *args], check=True, capture_output=True, env=_env(), cwd=ROOT, timeout=120)
    return time.perf_counter() - t0


def main() -> None:
    load_start = os.getloadavg()[0]
    rows = []
    for name, args in COMMANDS.items():
        ours, floor = [], []
        for i in range(REPEATS):
            pair = [(ours, args), (floor, ["-c", "pass"])]
            for sink, cmd in pair if i % 2 == 0 else pair[::-1]:
                sink.append(_seconds(cmd))
        rows.append({"command": name, "median_s": round(statistics.median(ours), 3),
                     "python_c_pass_median_s": round(statistics.median(floor), 3),
                     "p90_s": round(sorted(ours)[int(0.9 * (len(ours) - 1))], 3), "runs": len(ours)})
    result = {"repeats": REPEATS, "python": sys.version.split()[0], "load_start": load_start,
              "load_end": os.getloadavg()[0], "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bench_light.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# Light commands (no torch): start-up from outside", "",
             f"{REPEATS} alternating pairs with `python -c pass`; load average {load_start:.2f} -> "
             f"{result['load_end']:.2f}.", "",
             "| command | median s | p90 s | `python -c pass` median s |", "|---|---|---|---|"]
    lines += [f"| `{r['command']}` | {r['median_s']} | {r['p90_s']} | {r['python_c_pass_median_s']} |" for r in rows]
    (RESULTS / "bench_light.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
