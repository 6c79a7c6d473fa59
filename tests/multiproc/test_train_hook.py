"""The trainer's DDP communication hook on a real 3-rank gloo world: averaged gradients and stop flags.

On gloo, small buckets are all-gathered and summed locally (half the message steps of gloo's all-reduce); larger
ones are all-reduced. Both paths must give the exact average (to float rounding), the same bits on every rank, and
carry one rank's stop flag to all ranks in the same step.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import run_torchrun_worker

pytestmark = pytest.mark.multiproc

WORKER = Path(__file__).resolve().parents[1] / "workers" / "train_gradient_hook.py"


def test_hook_averages_gradients_and_carries_stop_flags_on_both_paths() -> None:
    result = run_torchrun_worker(WORKER, 3)
    assert result["world_size"] == 3
    modes = result["modes"]
    assert modes["all-gather"]["gather"] is True  # the small toy bucket takes the all-gather path on gloo
    assert modes["all-reduce"]["gather"] is False
    for mode in ("all-gather", "all-reduce", "c++"):
        assert modes[mode]["ranks_identical"], mode
        assert modes[mode]["max_error"] < 1e-6, mode  # against the average computed locally from every rank's data
    for mode in ("all-gather", "all-reduce"):
        # rank 1 alone raised its flag before step 2: every rank sees it after that step, none before
        assert modes[mode]["stops"] == [False, False, True], mode
        assert result["vs_cpp"][mode] < 1e-6, mode
