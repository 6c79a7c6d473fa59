"""A run directory as one thing: every file a healed or ``--run-dir`` run keeps, named in one place (as submitit's
``JobPaths`` names a job folder's files), and the record types of its ledgers. The heal wing writes it; the
report reads it without importing heal.

    RUN_DIR/
      ledger.jsonl                  the heal ledger: attempts, causes, decisions (``rundir.ledger``)
      goodput.jsonl                 rank 0's goodput lines (``goodput.records``)
      goodput.rank-R.jsonl          rank R's step lines
      attempt-N/                    attempt N's output: its ranks' logs (``ddpkit run``), mpirun's log
        attempt-M/rank-R.std{out,err}.log   the agent's restart M of attempt N (``launch.ranklogs``)
      preflight-N-S.json            the check before attempt N (Slurm step S)
      report.html                   ``ddpkit report RUN_DIR`` with no other output named
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ddpkit.goodput.records import GOODPUT, rank_file
from ddpkit.rundir.ledger import LEDGER

__all__ = ["RUNS_DIR", "RunDir"]

#: Where a run directory is made when none is named: ``.ddpkit-runs/NAME`` in the current directory.
RUNS_DIR = ".ddpkit-runs"


@dataclass(frozen=True)
class RunDir:
    path: Path

    @classmethod
    def default(cls, name: str) -> RunDir:
        """``.ddpkit-runs/NAME`` in the current directory: a run with no ``--run-dir`` (``NAME``: its id)."""
        return cls(Path(RUNS_DIR) / name)

    @property
    def ledger(self) -> Path:
        return self.path / LEDGER

    @property
    def goodput(self) -> Path:
        return self.path / GOODPUT

    def rank_goodput(self, rank: int) -> Path:
        return self.path / rank_file(rank)

    def rank_goodputs(self) -> Iterator[Path]:
        """Every other rank's step lines, by file name."""
        return iter(sorted(self.path.glob("goodput.rank-*.jsonl")))

    def attempt(self, attempt: int) -> Path:
        return self.path / f"attempt-{attempt}"

    def preflight(self, attempt: int, step: int) -> Path:
        return self.path / f"preflight-{attempt}-{step}.json"

    @property
    def report(self) -> Path:
        return self.path / "report.html"

    def holds_a_run(self) -> bool:
        return self.path.is_dir() and (self.ledger.exists() or self.goodput.exists())
