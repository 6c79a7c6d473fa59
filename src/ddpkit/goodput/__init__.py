"""The goodput ledger: where a run's wall-clock time went (start-up, training steps, checkpoints, failures,
relaunches, lost progress), written as it goes into ``RUN_DIR/goodput.jsonl`` beside the heal ledger.

``records``: the typed lines and ``GoodputLog`` (rank 0's writer: a line per second of steps, not per step, each
fsynced); ``accounting``: pure, records and attempts -> the categories, goodput overall and per window. No torch.
"""

from __future__ import annotations

from ddpkit.goodput.accounting import AttemptSpan, Split, account
from ddpkit.goodput.records import GOODPUT, GoodputLog, read_goodput

__all__ = ["GOODPUT", "AttemptSpan", "GoodputLog", "Split", "account", "read_goodput"]
