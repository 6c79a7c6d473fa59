"""Shared names for the jobs unit tests (tests/conftest.py's helpers and the golden folder)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import SHARED, ddpkit_env, require_tools, run_ddpkit  # noqa: E402

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "jobs"

__all__ = ["GOLDEN", "SHARED", "ddpkit_env", "require_tools", "run_ddpkit"]
