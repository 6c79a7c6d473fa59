"""``ddpkit report`` (``cli``): check and bench JSON files rendered into one Markdown report (``markdown``), or a run
directory's ledgers rendered for people and tools: ``run`` (the heal ledger and the goodput ledger read
and accounted), ``html`` (one self-contained page), ``trace`` (Chrome/Perfetto trace events), ``prometheus``
(a node-exporter textfile). ``ddpkit report RUN_DIR --html out.html --trace out.json --prometheus out.prom``."""

from __future__ import annotations

__all__: list[str] = []
