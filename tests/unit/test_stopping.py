"""How a run ends, as the agent and the worker both read it: RunOutcome's exit codes, the stop directory's reports,
WorkerContext from a launcher's variables, and RunSummary's --json document."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ddpkit.base.errors import EXIT_MISSING, EXIT_OK, EXIT_PREEMPTED, EXIT_PREEMPTED_UNSAVED
from ddpkit.process.stopping import (
    RunOutcome,
    final_lost_report,
    leave_lost_report,
    leave_preempted_code,
    lost_reports,
    mark_outside_signal,
    signal_from_outside,
)
from ddpkit.process.worker_context import WorkerContext
from ddpkit.train.summary import ResumedFrom, RunSummary


def test_each_outcome_has_the_exit_code_the_readme_promises() -> None:
    codes = {o: o.exit_code for o in RunOutcome}
    assert codes == {RunOutcome.COMPLETED: EXIT_OK, RunOutcome.PREEMPTED_SAVED: EXIT_PREEMPTED,
                     RunOutcome.PREEMPTED_UNSAVED: EXIT_PREEMPTED_UNSAVED,
                     RunOutcome.STOPPED_BY_AGENT: EXIT_MISSING, RunOutcome.PEER_LOST: EXIT_MISSING}
    assert [o for o in RunOutcome if o.preempted] == [RunOutcome.PREEMPTED_SAVED, RunOutcome.PREEMPTED_UNSAVED]


def test_the_worker_reads_what_the_agent_marked_and_the_agent_reads_what_workers_left(tmp_path: Path) -> None:
    stops = str(tmp_path)
    assert not signal_from_outside("SIGUSR1", stops, grace=0.05)
    mark_outside_signal(stops, "SIGUSR1")  # the agent's half (or a preempt drill playing the world outside)
    assert signal_from_outside("SIGUSR1", stops, grace=0.05)
    mark_outside_signal(None, "SIGTERM")  # another launcher: nowhere to mark, nothing raised
    leave_lost_report(stops, 1, "rank 1: rank 0 on h1 stopped answering", restartable=True)
    assert lost_reports(stops) == ["rank 1: rank 0 on h1 stopped answering"] and final_lost_report(stops) is None
    leave_lost_report(stops, 0, "rank 0: rank 1 on h2 stopped answering", restartable=False)
    assert lost_reports(stops)[0].startswith("rank 0:")  # rank order
    assert final_lost_report(stops) == "rank 0: rank 1 on h2 stopped answering"
    mark = tmp_path / "preempted"
    leave_preempted_code(str(mark), RunOutcome.COMPLETED)
    assert not mark.exists()  # only a preempted worker leaves its code
    leave_preempted_code(str(mark), RunOutcome.PREEMPTED_UNSAVED)
    assert mark.read_text() == str(EXIT_PREEMPTED_UNSAVED)


def test_the_worker_context_reads_ddpkits_and_torch_elastics_variables(tmp_path: Path) -> None:
    ctx = WorkerContext.from_environ({"DDPKIT_LAUNCHED": "1", "DDPKIT_LAUNCHED_AT": "1700000000.5",
                                      "DDPKIT_STOP_DIR": str(tmp_path), "DDPKIT_PREEMPTED_MARK": "/m",
                                      "TORCHELASTIC_RESTART_COUNT": "2", "TORCHELASTIC_MAX_RESTARTS": "3",
                                      "TORCHELASTIC_RUN_ID": "job7", "MASTER_ADDR": "node1", "MASTER_PORT": "29500"})
    assert ctx.launched_by_ddpkit and ctx.started_at == 1700000000.5 and ctx.stop_dir == str(tmp_path)
    assert ctx.restart_count == 2 and ctx.max_restarts == 3 and ctx.restartable and ctx.run_id == "job7"
    assert ctx.master == ("node1", 29500) and ctx.preempted_mark == "/m"
    bare = WorkerContext.from_environ({"MASTER_ADDR": "node1", "MASTER_PORT": "x"})  # srun, mpirun: no agent
    assert not bare.launched_by_ddpkit and bare.stop_dir is None and bare.master is None
    assert bare.restart_count == 0 and not bare.restartable and bare.run_id == "run"


def test_the_summary_json_keeps_the_documented_keys_and_says_how_the_run_ended() -> None:
    summary = RunSummary(job="mlp", model="mlp", parameters=10, world_size=2, backend="gloo", device="cpu",
                         epochs=2, batch_size=4, steps_per_epoch=3, restarts=1,
                         resumed_from=ResumedFrom(path="d/s.pt", epoch=1, batch=0, global_step=3),
                         loss_history={0: 1.0, 1: 0.5}, marks={"launched": 10.0, "loop": 12.0})
    doc = json.loads(json.dumps(summary.as_json()))
    assert doc["outcome"] == "completed" and doc["preempted"] is False and "exit_code" not in doc
    assert doc["resumed_from"] == {"path": "d/s.pt", "epoch": 1, "batch": 0, "global_step": 3}
    assert doc["loss_history"] == {"0": 1.0, "1": 0.5} and doc["startup_s"] == 2.0 and doc["launched_at"] == 10.0
    assert not summary.steps_ran and math.isnan(doc["step_ms_p50"])
    summary.outcome, summary.signal = RunOutcome.PREEMPTED_SAVED, "SIGUSR1"
    doc = summary.as_json()
    assert doc["preempted"] and doc["exit_code"] == EXIT_PREEMPTED and doc["signal"] == "SIGUSR1"
