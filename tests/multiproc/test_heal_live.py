"""`ddpkit train -n 3 --heal live` (issue 46): rank 1's process SIGKILLed or SIGSTOPped from outside mid-run. The job
exits 0 with the step count of an uninterrupted run, no snapshot loaded, ranks 0 and 2 the same processes from
before the fault to the end, a `ddpkit heal` line naming the peer the state came from, every rank's final weights
equal (their digests), and the loss history equal, bitwise, to an uninterrupted run's."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ddpkit.rundir.ledger import RankReplaced, read_records
from tests.helpers import ddpkit_env, killed_if_left, wait_until

pytestmark = pytest.mark.multiproc
JOB = ("--epochs", "60", "--samples", "1536", "--model", "toy")


def _train(cwd: Path, *extra: str) -> subprocess.Popen[bytes]:
    out = open(cwd / "out.txt", "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen([sys.executable, "-m", "ddpkit", "train", "-n", "3", *JOB, "--json", "summary.json",
                             *extra], cwd=cwd, env=ddpkit_env(), stdout=out, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    cwd = tmp_path_factory.mktemp("plain")
    assert _train(cwd).wait(timeout=240) == 0, (cwd / "out.txt").read_text()
    summary: dict[str, Any] = json.loads((cwd / "summary.json").read_text())
    return summary


def _pids(run: Path) -> dict[int, int]:
    try:
        return {int(k): v for k, v in json.loads((run / "attempt-1" / "pids.json").read_text()).items()}
    except (OSError, ValueError):
        return {}


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_lost_rank_rejoins_from_a_live_peer_and_no_step_is_lost(
        tmp_path: Path, sig: signal.Signals, uninterrupted: dict[str, Any]) -> None:
    out = tmp_path / "out.txt"
    with killed_if_left(_train(tmp_path, "--heal", "live", "--run-dir", "run")) as agent:
        wait_until(lambda: "[RANK 0] Epoch 3 " in out.read_text() and len(_pids(tmp_path / "run")) == 3, agent, out,
                   poll=0.05)
        before = _pids(tmp_path / "run")
        os.kill(before[1], sig)
        code = agent.wait(timeout=240)
    text = out.read_text()
    assert code == 0, text
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["global_step"] == uninterrupted["global_step"], text
    assert summary["snapshots_loaded"] == 0 and "Snapshots: 0 written, 0 loaded" in text, text
    after = _pids(tmp_path / "run")
    assert after[0] == before[0] and after[2] == before[2] and after[1] != before[1], (before, after)
    why = "SIGKILL" if sig == signal.SIGKILL else r"stopped \(SIGSTOP\) for \d+\.\d s"
    line = re.search(rf"ddpkit heal: rank 1 on \S+ lost \({why}\); a replacement \(pid {after[1]}\) took its state "
                     r"from rank (?P<source>[02]) at step \d+ [\d.]+ s after the loss was found; its first step "
                     r"[\d.]+ s after; rank\(s\) 0, 2 kept their processes; replicas equal after it; no step lost",
                     text)
    assert line, text
    heals = [r for r in read_records(tmp_path / "run" / "ledger.jsonl") if isinstance(r, RankReplaced)]
    # the source: the lowest rank of those that applied the most steps (0, or 2 where only it finished the step in
    # flight)
    assert [(h.rank, h.source, h.kept, h.replacement_pid) for h in heals] == [(1, int(line["source"]), (0, 2),
                                                                                after[1])]
    assert re.fullmatch(why, heals[0].why)
    assert heals[0].lost_at <= heals[0].decided_at <= heals[0].joined_at <= heals[0].first_step_at  # type: ignore
    digests = summary["replica_digests"]
    assert summary["live_heals"] == 1 and len(digests) == 3 and len(set(digests)) == 1, digests
    assert summary["loss_history"] == uninterrupted["loss_history"]  # bitwise: the same floats, every epoch
    report = subprocess.run([sys.executable, "-m", "ddpkit", "report", "run", "--html", "run/report.html", "--trace",
                             "run.trace.json"],
                            cwd=tmp_path, env=ddpkit_env(), capture_output=True, text=True, timeout=120)
    assert "1 rank(s) replaced live (" in report.stdout and "0 step(s) lost)" in report.stdout, report.stdout
    assert "live heal (a rank lost to its replacement" in (tmp_path / "run" / "report.html").read_text()
    events = json.loads((tmp_path / "run.trace.json").read_text())["traceEvents"]
    assert [e["name"] for e in events if e["name"].startswith("live heal")] == [
        "live heal (a rank replaced; no step lost)"]


def test_a_clean_live_run_replaces_nobody(tmp_path: Path, uninterrupted: dict[str, Any]) -> None:
    assert _train(tmp_path, "--heal", "live", "--run-dir", "run").wait(timeout=240) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["live_heals"] == 0 and len(set(summary["replica_digests"])) == 1
    assert summary["loss_history"] == uninterrupted["loss_history"]
    assert not [r for r in read_records(tmp_path / "run" / "ledger.jsonl") if isinstance(r, RankReplaced)]


def test_the_seeds_ddp_py_with_the_documented_change_rejoins_a_killed_rank_from_a_peer(tmp_path: Path) -> None:
    """The seeds' ``ddp.py`` with docs/heal.md's few lines, under ``ddpkit run -n 3 --heal live``: rank 1 SIGKILLed
    mid-run; its replacement takes its state from a peer, the job ends with exit 0 and the replicas' weights equal."""
    script = tmp_path / "ddp.py"
    script.write_text((Path(__file__).parent / "seeds_ddp_live.py").read_text())
    with open(tmp_path / "out.txt", "wb") as out:
        agent = subprocess.Popen([sys.executable, "-m", "ddpkit", "run", "-n", "3", "--heal", "live", "--run-dir",
                                  "run", "--", "ddp.py", "60", "50"], cwd=tmp_path, env=ddpkit_env(), stdout=out,
                                 stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while "[RANK 0] Epoch 3 " not in (tmp_path / "out.txt").read_text() or len(_pids(tmp_path / "run")) != 3:
                assert agent.poll() is None and time.monotonic() < deadline, (tmp_path / "out.txt").read_text()
                time.sleep(0.05)
            before = _pids(tmp_path / "run")
            os.kill(before[1], signal.SIGKILL)
            code = agent.wait(timeout=240)
        finally:
            if agent.poll() is None:
                agent.kill()
    text = (tmp_path / "out.txt").read_text()
    assert code == 0, text
    after = _pids(tmp_path / "run")
    assert after[0] == before[0] and after[2] == before[2] and after[1] != before[1], (before, after)
    assert re.search(rf"ddpkit heal: rank 1 on \S+ lost \(SIGKILL\); a replacement \(pid {after[1]}\) took its state "
                     r"from rank [02] at step \d+ .*no step lost", text), text
    digests = re.findall(r"done: weights ([0-9a-f]+) moved ([-+.\de]+)", text)
    assert len(digests) == 3 and len(set(digests)) == 1, text
    assert float(digests[0][1]) > 1e-3, digests  # the script trains (the seeds' loss over one output would not)
    assert "still running" not in text, text  # each rank left by itself (run.live holds its replicas: no hung teardown)


def _one_step_epochs_with_a_drill(cwd: Path, rank: int) -> tuple[str, dict[str, Any]]:
    """``train -n 3 --heal live``, one step an epoch, five epochs, a snapshot each; the drill kills ``rank`` in
    epoch 2. The output (exit 0, one live heal asserted) and the summary."""
    res = subprocess.run([sys.executable, "-m", "ddpkit", "train", "-n", "3", "--heal", "live", "--run-dir", "run",
                          "--epochs", "5", "--samples", "96", "--batch-size", "32", "--snapshot-path", "snaps/",
                          "--drill", f"kill-worker@epoch=2,rank={rank}", "--json", "summary.json"], cwd=cwd,
                         env=ddpkit_env(), capture_output=True, text=True, timeout=240)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and f"killing rank {rank}" in out and "Live heals: 1" in out, out
    return out, json.loads((cwd / "summary.json").read_text())


def test_a_rank_lost_after_an_epochs_last_step_still_gets_that_epochs_snapshot(tmp_path: Path) -> None:
    """One step an epoch: the drill kills rank 1 right after epoch 2's only step, before the epoch's end (its loss
    line, its snapshot). The survivors go on at the end of epoch 2, and its snapshot is taken before epoch 3."""
    out, summary = _one_step_epochs_with_a_drill(tmp_path, 1)
    assert summary["snapshots_written"] == 5 and summary["snapshots_loaded"] == 0, out
    assert [Path(p).name for p in summary["snapshot_paths"]][2] == "snapshot.000000003.pt", summary["snapshot_paths"]
    assert sorted(summary["loss_history"]) == ["0", "1", "2", "3", "4"], summary["loss_history"]


def test_a_replaced_rank_0_counts_the_run_s_snapshots_and_drills(tmp_path: Path) -> None:
    """The drill kills rank 0 itself: its replacement's summary counts the five snapshots the run wrote (three by the
    lost rank 0) and says the drill line, as rank 0 of an uninterrupted run would."""
    out, summary = _one_step_epochs_with_a_drill(tmp_path, 0)
    assert "Snapshots: 5 written, 0 loaded" in out, out
    assert re.search(r"Drill kill-worker@epoch=2,rank=0: injected kill-worker of rank 0 at epoch 2 "
                     r"\(global step \d+\); resumed at step \d+; lost 0 steps", out), out
    assert summary["snapshots_written"] == 5 and len(summary["snapshot_paths"]) == 5, summary


def test_a_rank_lost_as_a_snapshot_s_gather_begins_is_replaced_live_at_once(tmp_path: Path) -> None:
    """``train -n 4 --heal live``: rank 2 kills itself as the snapshot of step 24 begins (12 steps an epoch), while
    the others enter the snapshot's gather. Ranks 1 and 3 exchange with rank 2 in the gather's all-gather ring and
    fail; rank 0 waits on rank 3. Before: ranks 1 and 3 left still holding the old group in the frames of the
    failed gather (the watch's wrapper's, taken out of the traceback but not out of its callers' chain), so its
    connections stayed open and rank 0 waited out the watch's deadline (60 s) before the restart heal resumed from
    a snapshot (three times: the fault fires in each attempt's first generation). Now: one attempt, one live heal,
    nothing loaded, every snapshot of the run written."""
    res = subprocess.run([sys.executable, "-m", "ddpkit", "train", "-n", "4", "--heal", "live", "--run-dir", "run",
                          "--epochs", "5", "--samples", "1536", "--model", "toy", "--snapshot-path", "snaps/",
                          "--json", "summary.json"], cwd=tmp_path,
                         env=ddpkit_env(DDPKIT_FAULTS="kill:phase=snapshot:rank=2:step=24:gen=0"),
                         capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert re.search(r"ddpkit heal: rank 2 on \S+ lost \(SIGKILL\); a replacement \(pid \d+\) took its state from "
                     r"rank \d at step 24 ", out), out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["live_heals"] == 1 and summary["restarts"] == 0 and summary["snapshots_loaded"] == 0, out
    assert summary["global_step"] == 5 * 12 and summary["snapshots_written"] == 5, summary
    assert len(set(summary["replica_digests"])) == 1, summary
    heals = [r for r in read_records(tmp_path / "run" / "ledger.jsonl") if isinstance(r, RankReplaced)]
    assert [(h.rank, h.kept) for h in heals] == [(2, (0, 1, 3))], heals
