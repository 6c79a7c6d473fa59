"""A tiny preemptible job for the requeue tests: counts steps into a snapshot file and resumes from it.

- SIGTERM (what ``scontrol requeue`` sends): save the snapshot, print ``preempted at step N``, exit 75.
- SIGUSR1 (what ``sbatch --signal USR1@S`` sends before the time limit): save, requeue itself with
  ``scontrol requeue $SLURM_JOB_ID`` (as ``train --requeue`` does), print ``signalled at step N``, exit 75.
- On start with a snapshot: ``resumed from step N (SLURM_RESTART_COUNT=R)``; at the end ``done at step N``.
"""

import json
import os
import signal
import subprocess
import sys
import time

path = sys.argv[1]
steps = int(sys.argv[2])
step = 0
if os.path.exists(path):
    with open(path) as f:
        step = json.load(f)["step"]
    print(f"resumed from step {step} (SLURM_RESTART_COUNT={os.environ.get('SLURM_RESTART_COUNT', '0')})", flush=True)


def save() -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"step": step}, f)
    os.replace(tmp, path)


def on_term(signum, frame):
    save()
    print(f"preempted at step {step}: snapshot saved", flush=True)
    sys.exit(75)


def on_usr1(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the requeue below sends SIGTERM: we are already stopping
    save()
    print(f"signalled at step {step}: snapshot saved, requeueing the job", flush=True)
    subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=True, timeout=30)
    sys.exit(75)


signal.signal(signal.SIGTERM, on_term)
signal.signal(signal.SIGUSR1, on_usr1)
print(f"started at step {step}", flush=True)
start = step
while step < steps:
    time.sleep(0.1)
    step += 1
    if step == start + 5:
        print(f"running: step {step}", flush=True)
print(f"done at step {step}", flush=True)
