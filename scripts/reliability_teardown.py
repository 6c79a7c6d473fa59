"""How often a DDP script that succeeded is aborted in the interpreter's teardown (torch 2.13's gloo:
"terminate called without an active exception", SIGABRT; src/ddpkit/process/exiting.py has the backtrace), under plain
torchrun and under torchrun with ddpkit's watch runner, which leaves before that teardown.

    python scripts/reliability_teardown.py [--pairs 20] [--nproc 4]

Each pair runs the same torchrun-style script (tests/workers/ddp_user.py: 5 DDP steps, an all_gather, a
destroy_process_group, sys.exit) once as ``torchrun --standalone --nproc-per-node N SCRIPT`` and once as
``torchrun ... -m ddpkit.watch -- SCRIPT``, the order alternating, so both see the same machine. A run counts as
aborted when the launcher reports a rank's exit -6 or the log has "terminate called"; every run must have printed
every rank's RESULT line first (the job's work was done). Not part of ``make test`` (about 4 minutes here); the
result is committed in benchmarks/results/reliability_teardown.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "workers" / "ddp_user.py"
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

from tests.helpers import ddpkit_env  # noqa: E402


def _run(nproc: int, watched: bool) -> dict[str, Any]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    argv += ["-m", "ddpkit.watch", "--", str(SCRIPT)] if watched else [str(SCRIPT)]
    start = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=ddpkit_env(), cwd="/tmp")
    out = done.stdout + done.stderr
    results = len(set(re.findall(r"RESULT rank=(\d+) .*? same=True", out)))
    aborted = "terminate called" in out or "exitcode  : -6" in out or "(exitcode: -6)" in out
    return {"watched": watched, "exit": done.returncode, "results": results, "aborted": aborted,
            "seconds": round(time.monotonic() - start, 2)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--nproc", type=int, default=4)
    args = parser.parse_args()
    runs = []
    for i in range(args.pairs):
        for watched in ((False, True) if i % 2 == 0 else (True, False)):
            runs.append(_run(args.nproc, watched) | {"pair": i})
            r = runs[-1]
            print(f"pair {i} {'watch' if watched else 'plain'}: exit {r['exit']} results {r['results']}/"
                  f"{args.nproc} aborted {r['aborted']}", flush=True)
    summary = {}
    for side, watched in (("plain torchrun", False), ("torchrun -m ddpkit.watch", True)):
        mine = [r for r in runs if r["watched"] == watched]
        summary[side] = {"runs": len(mine), "aborted": sum(r["aborted"] for r in mine),
                         "exit_nonzero": sum(r["exit"] != 0 for r in mine),
                         "all_results": sum(r["results"] == args.nproc for r in mine)}
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "reliability_teardown.json").write_text(json.dumps(
        {"when": when, "nproc": args.nproc, "pairs": args.pairs, "summary": summary, "runs": runs}, indent=1) + "\n")
    md = [f"# A succeeded rank aborted in the interpreter's teardown ({when})", "",
          f"{args.pairs} alternating pairs, `tests/workers/ddp_user.py` on {args.nproc} ranks under torchrun "
          "(`--standalone`), 2 shared cores. Produced by `python scripts/reliability_teardown.py`.", "",
          "| how the ranks ran | runs | every rank printed its result | aborted in teardown | non-zero exit |",
          "|---|---|---|---|---|"]
    for side, s in summary.items():
        md.append(f"| {side} | {s['runs']} | {s['all_results']} | **{s['aborted']}** | {s['exit_nonzero']} |")
    (RESULTS / "reliability_teardown.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    bad = summary["torchrun -m ddpkit.watch"]
    return 0 if bad["aborted"] == 0 and bad["exit_nonzero"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
