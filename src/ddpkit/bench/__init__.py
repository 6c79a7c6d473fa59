"""``ddpkit bench``: every collective with nccl-tests' conventions, verified and gated, and a slow-link finder.

Pure parts (no torch): :mod:`~ddpkit.bench.sizes`, :mod:`~ddpkit.bench.busbw`, :mod:`~ddpkit.bench.results`.
Measured parts: :mod:`~ddpkit.bench.ops` (buffers and closed forms), :mod:`~ddpkit.bench.sweep` (timing),
:mod:`~ddpkit.bench.pairs` (point-to-point matrix). The command lives in :mod:`~ddpkit.bench.cli`.
"""

from __future__ import annotations

from ddpkit.bench.busbw import OPS, algbw_gbps, busbw_factor, busbw_gbps
from ddpkit.bench.sizes import format_size, parse_size, size_sweep

__all__ = ["OPS", "algbw_gbps", "busbw_factor", "busbw_gbps", "format_size", "parse_size", "size_sweep"]
