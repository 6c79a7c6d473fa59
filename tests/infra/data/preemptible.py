"""A tiny preemptible job for the requeue test: counts steps into a snapshot file, saves it on SIGTERM.

Prints ``resumed from step N`` when a snapshot exists, ``preempted at step N`` on SIGTERM (exit 75), and
``done at step N`` at the end. Run under torchrun by the generated sbatch script, one rank.
"""

import json
import os
import signal
import sys
import time

path = sys.argv[1]
steps = int(sys.argv[2])
step = 0
if os.path.exists(path):
    with open(path) as f:
        step = json.load(f)["step"]
    print(f"resumed from step {step} (SLURM_RESTART_COUNT={os.environ.get('SLURM_RESTART_COUNT', '0')})", flush=True)


def save_and_exit(signum, frame):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"step": step}, f)
    os.replace(tmp, path)
    print(f"preempted at step {step}: snapshot saved", flush=True)
    sys.exit(75)


signal.signal(signal.SIGTERM, save_and_exit)
print(f"started at step {step}", flush=True)
while step < steps:
    time.sleep(0.1)
    step += 1
    if step == 5:
        print("step 5 reached", flush=True)
print(f"done at step {step}", flush=True)
