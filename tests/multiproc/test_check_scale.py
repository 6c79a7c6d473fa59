"""`ddpkit check` at 16 local ranks (8x the usual test world): passes, the node table stays one row, the DDP
loss falls, and `--per-rank` shows every rank."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from tests.helpers import gloo_status, run_ddpkit

pytestmark = pytest.mark.multiproc
NPROC = 16


def test_check_16_ranks_passes_with_one_row_per_node(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    proc = run_ddpkit("check", "-n", str(NPROC), "--json", str(out), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert all(c["status"] == gloo_status(n) for n, c in checks.items()), checks
    assert sorted(r["rank"] for r in report["ranks"]) == list(range(NPROC))
    assert f"verdict: PASS: {NPROC} rank(s) on 1 host(s)" in proc.stdout
    # one row for the node, its ranks folded; no per-rank rows
    host = socket.gethostname()
    rows = [line for line in proc.stdout.splitlines() if line.startswith("│")]
    assert len(rows) == 1 and f"0-{NPROC - 1} ({NPROC})" in rows[0] and host in rows[0], proc.stdout
    ddp = checks["ddp-sync"]
    assert f"identical on {NPROC} ranks" in ddp["detail"] and "(falling every step)" in ddp["detail"]
    per_rank = ddp["data"]["per_rank"]
    assert all(r["loss_falls"] and r["loss_last"] < r["loss_first"] for r in per_rank)
    assert report["timings"]["roll-call-after-last"] >= 0 and "report" in report["timings"]
    clock = report["clock"]
    assert clock["first_check_in"] <= clock["last_check_in"] <= clock["report_done"]


def test_check_per_rank_prints_every_rank() -> None:
    proc = run_ddpkit("check", "-n", "3", "--per-rank", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if line.startswith("│")]
    assert len(rows) == 3 and "LOCAL_RANK" in proc.stdout, proc.stdout
