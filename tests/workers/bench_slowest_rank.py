"""Worker for test_bench_multiproc: rank r's 'collective' sleeps (1 + 4r) ms; prints what time_launch reports."""

from __future__ import annotations

import json
import time

import torch

from ddpkit import runtime
from ddpkit.bench.sweep import time_launch

rt = runtime.init(backend="gloo")
pause = (1 + 4 * rt.rank) / 1e3
seconds = time_launch(lambda: time.sleep(pause), warmup=1, iters=5, device=torch.device("cpu"))
if rt.rank == 0:
    print("RESULT " + json.dumps({"seconds": seconds, "world_size": rt.world_size}), flush=True)
runtime.shutdown()
