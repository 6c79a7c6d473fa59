"""Issue 28 on real gloo ranks: node facts in check's report (read once per node), a baseline made of a check
report, and the bad hosts a failure names, printed or (outside Slurm) refused for draining."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from tests.helpers import ddpkit_env, run_ddpkit

pytestmark = pytest.mark.multiproc


def test_facts_once_per_node_and_a_check_report_as_baseline(tmp_path: Path) -> None:
    first = tmp_path / "first.json"
    res = run_ddpkit("check", "-n", "2", "--json", str(first), timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    report = json.loads(first.read_text())
    assert [(n["host"], n["ranks"]) for n in report["nodes"]] == [(socket.gethostname(), [0, 1])]
    facts = report["nodes"][0]["facts"]
    assert facts["nic"]["name"] == "lo" and facts["cores"] >= 1 and facts["gpus"] is None
    assert [r["rank"] for r in report["ranks"] if r["facts"]] == [0]  # local rank 0 read them; rank 1 did not
    assert report["bad_hosts"] == []
    assert "PASS  node-facts       1 node: " in res.stdout and "bad hosts" not in res.stdout

    again = run_ddpkit("check", "-n", "2", "--baseline", str(first), timeout=240)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "PASS  baseline-facts   1 node(s): facts unchanged since the baseline" in again.stdout


def test_a_wrong_result_names_the_host_and_drain_outside_slurm_drains_nothing(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    env = ddpkit_env(DDPKIT_FAULTS="corrupt:op=all_reduce_sum:rank=1")
    env.pop("SLURM_JOB_ID", None)
    res = run_ddpkit("check", "-n", "2", "--json", str(out), "--on-fail", "drain", env=env, timeout=240)
    assert res.returncode == 1, res.stdout + res.stderr
    host = socket.gethostname()
    assert json.loads(out.read_text())["bad_hosts"] == [
        {"host": host, "slurm_node": None, "reasons": ["all_reduce_sum failed on rank(s) 1"]}]
    assert f"scontrol update NodeName={host} State=DRAIN 'Reason=ddpkit check: all_reduce_sum failed on rank(s) 1'" \
        in res.stdout
    assert "--on-fail drain: nothing drained: this is not a Slurm job (no SLURM_JOB_ID)" in res.stdout \
        or "--on-fail drain: nothing drained: scontrol is not on PATH" in res.stdout


def test_baseline_that_is_not_one_is_exit_2(tmp_path: Path) -> None:
    bogus = tmp_path / "bench.json"
    bogus.write_text(json.dumps({"kind": "bench"}))
    res = run_ddpkit("bench", "-n", "2", "--baseline", str(bogus), timeout=120)
    assert res.returncode == 2 and "a 'bench' file" in res.stderr and "Traceback" not in res.stderr
    res = run_ddpkit("bench", "-n", "2", "--tolerance", "150", timeout=120)
    assert res.returncode == 2 and "--tolerance 150" in res.stderr
