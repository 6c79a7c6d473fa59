"""How long a user waits for a Slurm job: ``ddpkit submit --wait`` (squeue every 0.5 s) against ``sbatch --wait``.

Same cluster (scripts/slurm_cluster.py: two network-namespace nodes), same rendered script, interleaved, repeats.
The job sleeps 3 s, so the overhead of each way of waiting is (wall time - 3 s). Also timed: the cluster from
nothing to every node idle, and one 2-node x 2-rank ``check`` end to end. Needs root (daemons, namespaces).

    sudo .venv/bin/python -m benchmarks.bench_jobs
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts import slurm_cluster

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results"
REPEATS = 3
SLEEP = 3.0


def _timed(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, subprocess.CompletedProcess[str]]:
    t0 = time.perf_counter()
    res = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    return time.perf_counter() - t0, res


def main() -> int:
    if os.geteuid() != 0:
        print("bench_jobs needs root (Slurm daemons, network namespaces): not run")
        return 0
    module = slurm_cluster
    work = Path(tempfile.mkdtemp(prefix="ddpkit-bench-jobs-"))
    work.chmod(0o755)  # munged (user munge) reaches the cluster directory inside it
    cluster = module.SlurmCluster(work / "cluster", nodes_count=2)
    t0 = time.perf_counter()
    cluster.start(timeout=120)
    start_s = time.perf_counter() - t0
    env = cluster.env({k: v for k, v in os.environ.items() if not k.startswith("SLURM_")})
    prefix = cluster.client_prefix()
    venv = str(Path(sys.executable).parents[1])
    try:
        job = work / "sleeper.py"
        job.write_text(f"import time\ntime.sleep({SLEEP})\n")
        script = work / "sleeper.sbatch"
        ddpkit = [*prefix, sys.executable, "-m", "ddpkit", "submit", "slurm", "-j", "1x1", "--tasks-per-rank",
                  "--no-exclusive", "--venv", venv]
        res = subprocess.run([*ddpkit, "--dry-run", "-o", str(script), "--", str(job)], cwd=work, env=env,
                             capture_output=True, text=True, check=True)
        (work / "logs").mkdir(exist_ok=True)
        ours, theirs = [], []
        for _ in range(REPEATS):
            wall, res = _timed([*ddpkit, "--wait", "--", str(job)], work, env)
            assert res.returncode == 0, res.stderr
            ours.append(wall)
            wall, res = _timed([*prefix, "sbatch", "--wait", str(script)], work, env)
            assert res.returncode == 0, res.stderr
            theirs.append(wall)
        check_wall, res = _timed([*prefix, sys.executable, "-m", "ddpkit", "submit", "slurm", "--wait", "-j", "2x2",
                                  "--venv", venv, "--", "check"], work, env)
        assert res.returncode == 0, res.stderr
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "machine": f"{os.cpu_count()} cores, {os.uname().sysname} {os.uname().release}",
        "cluster_start_to_idle_s": round(start_s, 2),
        "job_sleep_s": SLEEP,
        "ddpkit_submit_wait_s": [round(x, 2) for x in ours],
        "sbatch_wait_s": [round(x, 2) for x in theirs],
        "ddpkit_overhead_median_s": round(statistics.median(ours) - SLEEP, 2),
        "sbatch_wait_overhead_median_s": round(statistics.median(theirs) - SLEEP, 2),
        "check_2x2_end_to_end_s": round(check_wall, 1),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "bench_jobs.json").write_text(json.dumps(result, indent=1) + "\n")
    ours_r = result["ddpkit_submit_wait_s"]
    md = ["# bench_jobs: waiting for a Slurm job", "",
          f"Machine: {result['machine']}. Cluster: scripts/slurm_cluster.py, 2 namespace nodes.", "",
          "| what | seconds |", "|---|---|",
          f"| cluster start to every node idle | {result['cluster_start_to_idle_s']} |",
          f"| `ddpkit submit --wait`, {SLEEP:.0f} s job, runs | {', '.join(map(str, ours_r))} |",
          f"| `sbatch --wait`, same script, runs | {', '.join(map(str, result['sbatch_wait_s']))} |",
          f"| overhead beyond the job, median: ddpkit | {result['ddpkit_overhead_median_s']} |",
          f"| overhead beyond the job, median: sbatch --wait | {result['sbatch_wait_overhead_median_s']} |",
          f"| `submit slurm --wait -j 2x2 -- check`, end to end | {result['check_2x2_end_to_end_s']} |", ""]
    (OUT / "bench_jobs.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
