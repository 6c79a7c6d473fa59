"""Reliability of kill-and-resume: N runs in a row (default 20), each killing one worker once, mid-epoch.

    python scripts/reliability_kill_resume.py [--runs 20]

Each run is ``ddpkit train -n 2 --max-restarts 3 --drill kill-worker@epoch=2,rank=R`` (R alternates 1, 0) and
must: exit 0, restart the worker group, resume from the last snapshot, lose no more than the snapshot interval,
and end with parameters, optimizer and RNG states bitwise equal to one uninterrupted run. It also counts how
often the rendezvous had to retry (more than one restart for one kill, or a rendezvous/connection error in the
log). Not part of ``make test`` (about 10 minutes here); the result is committed in
benchmarks/results/reliability_kill_resume.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from ddpkit.train.snapshot import SnapshotDir, read_snapshot  # noqa: E402

JOB = ["--samples", "512", "--epochs", "4", "--seed", "11"]
RETRY_SIGNS = re.compile(r"connectFullMesh|RendezvousError|RendezvousTimeout|Connection refused|rendezvous.*retry",
                         re.IGNORECASE)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "TORCHELASTIC", "DDPKIT_", "SLURM_"))}
    env.pop("OMP_NUM_THREADS", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _train(directory: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], float]:
    directory.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "ddpkit", "train", "-n", "2", *JOB, "--snapshot-path", str(directory / "snap.pt"),
           "--json", str(directory / "summary.json"), *extra]
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600, cwd=ROOT)
    return done, time.monotonic() - t0


def _final(directory: Path) -> dict[str, Any]:
    (_, newest), *_ = SnapshotDir(directory, "snap", ".pt", keep=1).candidates()
    return read_snapshot(newest)[1]


def _equal(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_equal(x[k], y[k]) for k in x)
    if isinstance(x, list | tuple):
        return len(x) == len(y) and all(_equal(a, b) for a, b in zip(x, y, strict=True))
    return bool(x == y)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "reliability_kill_resume"))
    args = parser.parse_args()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ddpkit-reliability-") as name:
        tmp = Path(name)
        done, _ = _train(tmp / "baseline")
        if done.returncode != 0:
            print(done.stderr[-3000:])
            return 1
        reference = _final(tmp / "baseline")
        for i in range(args.runs):
            rank = 1 - i % 2
            directory = tmp / f"run{i}"
            done, wall = _train(directory, "--max-restarts", "3", "--drill", f"kill-worker@epoch=2,rank={rank}")
            summary = json.loads((directory / "summary.json").read_text()) if done.returncode == 0 else {}
            drills = summary.get("drills", [{}])
            fired = json.loads((directory / "snap.drills.json").read_text()) if (directory / "snap.drills.json"
                                                                                   ).exists() else {}
            killed_at = next(iter(fired.values()))["time"] if fired else None
            record = {
                "run": i, "killed_rank": rank, "exit_code": done.returncode, "wall_s": round(wall, 2),
                "restarts": summary.get("restarts"), "resumed_step": (summary.get("resumed_from") or {}).get(
                    "global_step"), "lost_steps": drills[0].get("lost_steps") if drills else None,
                "within_interval": bool(drills and drills[0].get("within_interval")),
                "bitwise_equal": done.returncode == 0 and all(
                    _equal(_final(directory)[k], reference[k]) for k in ("model", "optimizer", "rng")),
                "kill_to_first_step_s": round(summary["first_step_at"] - killed_at, 2) if summary and killed_at
                else None,
                "rendezvous_retry_signs": len(RETRY_SIGNS.findall(done.stderr)),
            }
            record["ok"] = bool(record["exit_code"] == 0 and record["restarts"] and record["within_interval"]
                                and record["bitwise_equal"])
            runs.append(record)
            print(json.dumps(record), flush=True)
            if not record["ok"]:
                (tmp.parent / f"reliability-run{i}.log").write_text(done.stdout + "\n----\n" + done.stderr)
    ok = sum(r["ok"] for r in runs)
    retried = sum(1 for r in runs if (r["restarts"] or 0) > 1 or r["rendezvous_retry_signs"])
    times = sorted(r["kill_to_first_step_s"] for r in runs if r["kill_to_first_step_s"] is not None)
    result = {"runs": len(runs), "succeeded": ok, "rendezvous_retried": retried,
              "extra_restarts": sum(max(0, (r["restarts"] or 0) - 1) for r in runs),
              "kill_to_first_step_s_median": times[len(times) // 2] if times else None,
              "kill_to_first_step_s_max": times[-1] if times else None, "details": runs,
              "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "torch": torch.__version__,
              "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1 (set by ddpkit's local launcher)"}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# Kill-and-resume reliability ({result['when']})", "",
             f"{ok} of {len(runs)} runs succeeded in a row (exit 0, group restarted, resumed from the last snapshot, "
             "final parameters, optimizer and RNG states bitwise equal to an uninterrupted run).",
             f"Rendezvous had to retry in {retried} of {len(runs)} runs ({result['extra_restarts']} extra restarts).",
             f"Killed worker -> first resumed step: median {result['kill_to_first_step_s_median']} s, "
             f"max {result['kill_to_first_step_s_max']} s.", "",
             "| run | killed rank | exit | restarts | resumed at step | lost steps | bitwise equal "
             "| kill -> step (s) |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['run']} | {r['killed_rank']} | {r['exit_code']} | {r['restarts']} | {r['resumed_step']} | "
              f"{r['lost_steps']} | {r['bitwise_equal']} | {r['kill_to_first_step_s']} |" for r in runs]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:5]))
    return 0 if ok == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
