"""The watch's pure parts: the deadline rule, options, and the words of its reports from given records."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from ddpkit.base.errors import ConfigError
from ddpkit.watch.diagnose import diagnose_deadline, diagnose_hang, find_desync
from ddpkit.watch.options import FIRST_STEP_FACTOR, MIN_HANG_S, MIN_STOP_S, WatchOptions, hang_deadline, stop_deadline
from ddpkit.watch.timings import straggler, summary_lines


def rec(rank: int, host: str = "h1", *, entered: int = 10, step: int = 5, waiting: dict[str, Any] | None = None,
        recent: list[list[Any]] | None = None, timings: dict[str, Any] | None = None,
        phase: dict[str, Any] | None = None) -> dict[str, Any]:
    """A heartbeat record as ``Recorder.record`` publishes it (every key of ``ddpkit.watch.records.Heartbeat``)."""
    return {"rank": rank, "host": host, "pid": 100 + rank, "beat": 1, "entered": entered, "completed": entered,
            "step": step, "first_step_done": True, "recent": recent or [], "waiting": waiting, "phase": phase,
            "stage": None, "final": False, "failed": False, "group_seq": None, "timings": timings or {"steps": 0}}


def wait(seq: int, op: str = "all_reduce", nbytes: int | None = 4096, site: str = "train.py:40 (main)",
         seconds: float = 31.0) -> dict[str, Any]:
    return {"seq": seq, "op": op, "bytes": nbytes, "site": site, "for": seconds}


def test_deadline_fixed_adaptive_and_first_step() -> None:
    fixed = WatchOptions(hang_after=30)
    assert hang_deadline(fixed, slowest_gap=100, first_step_done=True) == 30
    assert hang_deadline(fixed, slowest_gap=0, first_step_done=False) == 30 * FIRST_STEP_FACTOR
    adaptive = WatchOptions()
    assert hang_deadline(adaptive, slowest_gap=1, first_step_done=True) == MIN_HANG_S
    assert hang_deadline(adaptive, slowest_gap=50, first_step_done=True) == 100  # never below the slowest seen


def test_stop_deadline_waits_past_the_report_unless_told() -> None:
    """Left alone the watch reports at the adaptive deadline and stops every rank only after MIN_STOP_S (or the
    report's deadline when that is longer); a given --hang-after stops at the report as before; --stop-after is
    kept, but never before the report; --on-hang report never stops."""
    assert stop_deadline(WatchOptions(), report_deadline=MIN_HANG_S) == MIN_STOP_S == 600
    assert stop_deadline(WatchOptions(), report_deadline=5 * 200) == 1000  # a job whose slow stretches are long
    assert stop_deadline(WatchOptions(hang_after=4), report_deadline=4) == 4
    assert stop_deadline(WatchOptions(hang_after=5, stop_after=20), report_deadline=5) == 20
    assert stop_deadline(WatchOptions(stop_after=20), report_deadline=MIN_HANG_S) == MIN_HANG_S
    assert stop_deadline(WatchOptions(on_hang="report"), report_deadline=MIN_HANG_S) is None


@pytest.mark.parametrize("fields", [{"hang_after": 0}, {"on_hang": "kill"}, {"report_every": -1},
                                    {"straggler_share": 1.5}, {"hang_after": float("inf")},
                                    {"hang_after": float("nan")}, {"stop_after": float("inf")},
                                    {"stop_after": float("nan")}, {"stop_after": 0}, {"report_every": float("inf")},
                                    {"report_every": float("nan")}, {"stop_after": 60, "on_hang": "report"}])
def test_bad_options_refused_with_a_fix(fields: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as caught:
        WatchOptions(**fields)
    assert "Fix:" in str(caught.value)


@pytest.mark.parametrize("argv", [["--hang-after", "inf"], ["--report-every", "inf"], ["--stop-after", "nan"]])
def test_options_from_args_refuse_what_would_turn_the_watch_off(argv: list[str]) -> None:
    """``ddpkit run`` checks the watch's flags in its parent, before any rank starts: a ConfigError, no process."""
    import argparse

    from ddpkit.watch.options import add_arguments, options_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ConfigError):
        options_from_args(parser.parse_args(argv))
    assert options_from_args(parser.parse_args(["--stop-after", "900"])).stop_after == 900


def test_the_runner_takes_stop_after_with_its_value() -> None:
    """``python -m ddpkit.watch --stop-after 900 job.py``: 900 is the option's, not the script."""
    from ddpkit.watch.__main__ import _split

    assert _split(["--stop-after", "900", "job.py", "--lr", "1"]) == (["--stop-after", "900"], ["job.py", "--lr", "1"])


def test_live_rank_the_others_wait_for_is_named_busy_not_a_hang() -> None:
    """Rank 1 answers and runs outside any collective (a checkpoint, an evaluation) while the others wait."""
    records = {0: rec(0, "h1", entered=412, step=21, waiting=wait(412)),
               1: rec(1, "h2", entered=411, step=21),
               2: rec(2, "h1", entered=412, step=21, waiting=wait(412, seconds=33)),
               3: rec(3, "h2", entered=412, step=21, waiting=wait(412, seconds=32))}
    hang = diagnose_hang(records, {}, idle=31, deadline=30, reporter=0,
                         busy_at={1: "torch.save(state, path) at job.py:20 (main)", 0: "loss.backward() at job.py:9"})
    text = "\n".join(hang.lines)
    assert hang.behind == [1] and hang.stopped == [] and hang.busy == [1]
    assert hang.lines[0] == ("ddpkit watch: ranks 0 and 2 on host h1 and rank 3 on host h2 have waited 31 s in "
                             "all_reduce #412 for rank 1 on host h2, which is alive and busy outside any collective "
                             "(its stack below)")
    assert "HANG" not in text
    assert ("rank 1 on host h2 has not entered all_reduce #412 (4 KiB, step 20, called at train.py:40 (main)); last "
            "entered #411, step 20; busy in torch.save(state, path) at job.py:20 (main)") in text
    assert hang.event["waiting"] == [0, 2, 3] and hang.event["collective"]["seq"] == 412
    assert hang.event["busy"] == [1] and hang.event["busy_at"] == {"1": "torch.save(state, path) at job.py:20 (main)"}


def test_rank_behind_with_a_stopped_one_is_a_hang() -> None:
    records = {0: rec(0, "h1", entered=412, step=21, waiting=wait(412)),
               1: rec(1, "h2", entered=411, step=21),
               2: rec(2, "h1", entered=400, step=20),
               3: rec(3, "h2", entered=412, step=21, waiting=wait(412, seconds=32))}
    hang = diagnose_hang(records, {2: 6.0}, idle=31, deadline=30, reporter=0)
    text = "\n".join(hang.lines)
    assert hang.behind == [1, 2] and hang.stopped == [2] and hang.busy == []
    assert hang.lines[0].startswith("ddpkit watch: HANG: no rank has made progress for 31 s (deadline 30 s)")
    assert "rank 1 on host h2 has not entered all_reduce #412 (4 KiB, step 20, called at train.py:40 (main))" in text
    assert "ranks 0 and 3 on h1, h2 have waited 31 s in all_reduce #412" in text


def test_live_rank_behind_by_count_is_named_busy() -> None:
    """A hookless model on DDP's C++ path: rank 1 issued the next gradient all-reduce (counted), rank 0 evaluates."""
    records = {0: {**rec(0, entered=3, step=40), "group_seq": 120},
               1: {**rec(1, entered=3, step=41), "group_seq": 121}}
    hang = diagnose_hang(records, {}, idle=64, deadline=60, reporter=1,
                         busy_at={0: "evaluate(model) at job.py:30 (main)"})
    assert hang.busy == [0] and hang.behind == [0]
    assert hang.lines[0] == ("ddpkit watch: rank 1 on host h1 has waited 64 s in the group's collective #121 for "
                             "rank 0 on host h1, which is alive and busy outside any collective (its stack below)")
    assert hang.lines[-1] == "  rank 1 on h1 has issued it (up to #121) and waits for it to complete"
    assert "busy in evaluate(model) at job.py:30 (main)" in hang.lines[1]


def test_stopped_rank_named_from_its_silence_not_its_old_record() -> None:
    # rank 1's last record (before SIGSTOP) shows it inside #17; the live rank waits in #21
    records = {0: rec(0, entered=21, step=21, waiting=wait(21, seconds=6)),
               1: rec(1, entered=17, step=17, waiting=wait(17, seconds=0))}
    hang = diagnose_hang(records, {1: 6.0}, idle=6, deadline=5, reporter=0)
    text = "\n".join(hang.lines)
    assert hang.behind == [1] and hang.stopped == [1]
    assert "#21" in text and "rank 1 on host h1 (pid 101) stopped answering: no heartbeat for 6 s" in text
    assert "last seen at collective #17, step 16" in text and ", ," not in text


def test_desync_names_both_call_sites() -> None:
    records = {0: rec(0, entered=21, waiting=wait(21, "DDP gradient all-reduce (bucket 0)", 8708, "job.py:66 (main)")),
               1: rec(1, entered=21, waiting=wait(21, "broadcast", 4, "job.py:48 (fault)"))}
    desync = find_desync(records)
    assert desync is not None and desync["seq"] == 21
    assert [(c["ranks"], c["site"]) for c in desync["calls"]] == [([0], "job.py:66 (main)"), ([1], "job.py:48 (fault)")]
    hang = diagnose_hang(records, {}, idle=5, deadline=4, reporter=0)
    assert any("DESYNC at collective #21" in line and "job.py:48 (fault)" in line for line in hang.lines)


def test_same_calls_are_no_desync() -> None:
    recent = [[20, "all_reduce", 16, "a.py:1 (f)"]]
    assert find_desync({0: rec(0, recent=recent), 1: rec(1, recent=[[20, "all_reduce", 16, "a.py:9 (g)"]])}) is None


def timing(sync: float, step: float = 0.1) -> dict[str, Any]:
    return {"steps": 50, "step_p50": step, "step_p99": step * 1.2, "sync_p50": sync, "sync_mean": sync,
            "step_mean": step}


def test_straggler_is_the_rank_that_waits_least() -> None:
    records = {0: rec(0, "h1", timings=timing(0.040)), 1: rec(1, "h1", timings=timing(0.038)),
               2: rec(2, "h2", timings=timing(0.002)), 3: rec(3, "h2", timings=timing(0.041))}
    found = straggler(records, 0.10)
    assert found is not None
    assert found[0] == "ddpkit watch: rank 2 on h2 is the slowest: the others wait 38% of each step for it"


def test_straggler_host_when_all_its_ranks_wait_least() -> None:
    records = {0: rec(0, "h1", timings=timing(0.040)), 1: rec(1, "h1", timings=timing(0.040)),
               2: rec(2, "h2", timings=timing(0.002)), 3: rec(3, "h2", timings=timing(0.003))}
    found = straggler(records, 0.10)
    assert found is not None and found[1]["host"] == "h2" and found[1]["ranks"] == [2, 3]
    assert found[0].startswith("ddpkit watch: host h2 (ranks 2 and 3) is the slowest")


def test_straggler_host_when_its_ranks_wait_a_little_for_each_other() -> None:
    """Two ranks sharing a busy CPU are not quite in step (rank 3 waits 6% for rank 2): the host is still the slow
    one, next to the 25% the other host waits; a rank of it that waits as much as the others is not."""
    records = {0: rec(0, "h1", timings=timing(0.027)), 1: rec(1, "h1", timings=timing(0.027)),
               2: rec(2, "h2", timings=timing(0.002)), 3: rec(3, "h2", timings=timing(0.008))}
    found = straggler(records, 0.10)
    assert found is not None and found[1]["host"] == "h2" and found[1]["ranks"] == [2, 3], found
    records[3] = rec(3, "h2", timings=timing(0.020))
    found = straggler(records, 0.10)
    assert found is not None and found[1].get("rank") == 2 and "ranks" not in found[1], found


def test_no_straggler_within_the_share_or_too_few_steps() -> None:
    even = {0: rec(0, timings=timing(0.010)), 1: rec(1, timings=timing(0.005))}
    assert straggler(even, 0.10) is None
    young = {0: rec(0, timings={"steps": 2}), 1: rec(1, timings=timing(0.0))}
    assert straggler(young, 0.10) is None


def test_summary_per_rank_and_host() -> None:
    lines, event = summary_lines({0: rec(0, "h1", timings=timing(0.02)), 1: rec(1, "h2", timings=timing(0.01, 0.2))})
    assert event["ranks"]["1"]["wait_share"] == 0.05 and event["hosts"]["h2"]["ranks"] == [1]
    assert any(line.startswith("  host h1: rank 0, step p50 100.00 ms") for line in lines)


def test_summary_says_na_where_no_gradient_sync_was_sampled() -> None:
    unsampled = {**timing(0.0), "sync_samples": 0}
    lines, event = summary_lines({0: rec(0, "h1", timings=unsampled), 1: rec(1, "h1", timings=timing(0.01))})
    assert event["ranks"]["0"]["wait_share"] is None and event["ranks"]["1"]["wait_share"] == 0.1
    assert event["hosts"]["h1"]["wait_share"] == 0.1
    assert lines[2].split()[-1] == "n/a" and lines[3].split()[-1] == "10.0%" and lines[-1].endswith("wait 10.0%")
    lines, event = summary_lines({0: rec(0, "h1", timings=unsampled)})
    assert lines[-1].endswith("wait n/a") and event["hosts"]["h1"]["wait_share"] is None


def test_where_main_runs_names_the_users_line() -> None:
    """What a rank posts with its stacks: the line of the user's code its main thread runs (here: this test, in a
    ``join`` of the standard library, which is skipped)."""
    import threading

    from ddpkit.watch.actions import where_main_runs

    seen: list[str | None] = []

    def sample() -> None:  # until the main thread is inside the join (it may still be starting this thread)
        until = time.monotonic() + 5
        while time.monotonic() < until:
            seen[:] = [where_main_runs()]
            if (seen[0] or "").startswith("t.join()"):
                return
            time.sleep(0.01)

    t = threading.Thread(target=sample)
    t.start()
    t.join()
    assert seen[0] is not None and seen[0].startswith("t.join() at test_watch_units.py:"), seen
    assert seen[0].endswith("(test_where_main_runs_names_the_users_line)")


def test_recorder_deadline_phases_are_numbered_and_overdue_only_past_their_deadline() -> None:
    import time

    from ddpkit.watch.recorder import Recorder

    r = Recorder(0, 2)
    assert r.record(1)["stage"] is None and r.overdue() is None
    r.phase_begin("roll-call", 30)
    r.phase_end()
    r.phase_begin("checkpoint")  # a marked phase without a deadline: no number, never overdue
    r.phase_end()
    r.phase_begin("all_gather", 0.05)
    r.phase_begin("inner")  # the innermost phase with a deadline is the one judged
    assert r.record(2)["stage"] == [1, "all_gather", False] and r.overdue() is None
    time.sleep(0.1)
    index, name, seconds, spent = r.overdue()  # type: ignore[misc]
    assert (index, name, seconds) == (1, "all_gather", 0.05) and spent > 0.05
    r.phase_end()
    r.phase_end()
    assert r.record(3)["stage"] == [1, "all_gather", True] and r.overdue() is None


def test_recorder_counts_open_calls_and_completes_them_by_their_future() -> None:
    """The per-step path keeps no counter of completions: ``completed`` is what left the open calls, a Future's call
    leaves when the Future is done (at the next step or heartbeat), and a failed one is reported once."""
    import torch

    from ddpkit.watch.recorder import Recorder

    r = Recorder(0, 2)
    failures: list[int] = []
    r.on_failure = lambda: failures.append(1)
    sync = r.enter(("all_reduce", 4, "job.py:3 (main)"))
    r.done(sync)
    pending, later = r.enter(("DDP gradient all-reduce (bucket 0)", 92, "job.py:9 (train)"), True), \
        torch.futures.Future()
    pending[2] = later
    out = r.record(1)
    assert (out["entered"], out["completed"]) == (2, 1)
    assert out["waiting"]["seq"] == 2 and out["waiting"]["op"] == "DDP gradient all-reduce (bucket 0)"
    assert out["recent"] == [[1, "all_reduce", 4, "job.py:3 (main)"], [2, "DDP gradient all-reduce (bucket 0)", 92,
                                                                      "job.py:9 (train)"]]
    later.set_result(torch.zeros(1))
    r.step()  # a forward: the last step's done buckets leave
    out = r.record(2)
    assert (out["entered"], out["completed"], out["waiting"]) == (2, 2, None) and not out["failed"]
    broken, failing = r.enter(("DDP gradient all-reduce (bucket 0)", 92, "job.py:9 (train)")), torch.futures.Future()
    broken[2] = failing
    failing.set_exception(RuntimeError("Connection reset by peer"))
    r.sweep()  # the heartbeat's (or note_exception's) sweep finds the failed Future
    r.sweep()
    assert failures == [1] and r.failed is not None and r.failed["seq"] == 3
    assert "Connection reset by peer" in r.failed["error"] and r.record(3)["completed"] == 3
    r.fail(r.enter(("barrier", None, "job.py:12 (main)")), RuntimeError("timed out"))
    assert failures == [1, 1] and r.failed["seq"] == 3  # the first failure is the one reported


def test_a_failed_async_collective_never_waited_for_is_reported_after_a_step() -> None:
    """A script's ``dist.all_reduce(..., async_op=True)`` that fails and is never waited for raises nowhere: the next
    DDP forward reports it (only DDP's buckets, whose failure raised in backward, are completed there unchecked)."""
    import torch

    from ddpkit.watch.recorder import Recorder

    r = Recorder(0, 2)
    call, fut = r.enter(("all_reduce", 4, "job.py:5 (main)")), torch.futures.Future()
    call[2] = fut
    fut.set_exception(RuntimeError("Connection closed by peer"))
    r.step()
    out = r.record(1)
    assert out["failed"] and r.failed is not None and r.failed["seq"] == 1 and r.failed["op"] == "all_reduce"
    assert "Connection closed by peer" in r.failed["error"] and out["completed"] == 1


def test_deadline_report_names_the_ranks_short_of_the_phase_and_the_collective() -> None:
    gathering = wait(12, op="all_gather", seconds=4)
    records = {0: {**rec(0, entered=12, waiting=gathering), "stage": [5, "all_gather", False]},
               1: {**rec(1, entered=11), "stage": [4, "reduce", True]},
               2: None}
    hang = diagnose_deadline(records, {}, overdue=(5, "all_gather", 4.0, 4.2), reporter=0)
    assert hang.lines[0] == ("ddpkit watch: DEADLINE: phase 'all_gather' passed its 4 s deadline on rank 0; ranks that "
                             "had not reached it: rank 1 (last: reduce done), rank 2 (never checked in); ranks in it "
                             "and not done: [0] (host h1)")
    text = "\n".join(hang.lines)
    assert "rank 1 on host h1 has not entered all_gather #12" in text and "rank 2 never reported" in text
    assert hang.event["deadline_phase"] == {"index": 5, "phase": "all_gather", "seconds": 4.0, "rank": 0}
    # nobody in a collective (a rank blocked in a store wait): no claim that every rank waits in one
    quiet = diagnose_deadline({0: {**rec(0), "stage": [0, "roll-call", False]}, 1: {**rec(1), "stage": None}}, {},
                              overdue=(0, "roll-call", 4.0, 4.5), reporter=0)
    assert "rank 1 (no phase begun)" in quiet.lines[0] and len(quiet.lines) == 1


@pytest.mark.parametrize("last_count", [None, 40])
def test_counted_rank_that_stopped_short_of_the_others_is_behind(last_count: int | None) -> None:
    """ddpkit's own MPI hook counts its calls: rank 0 waits in count 52, rank 1 stopped answering at 40, or before
    its first step (no count yet); the report names rank 1 behind, with what the counted calls are."""
    counted = {"counted_as": "ddpkit's gradient averaging (mpi)"}
    records = {0: {**rec(0, entered=2, step=30), "group_seq": 52, **counted},
               1: {**rec(1, "h2", entered=2 if last_count else 0, step=20), "group_seq": last_count, **counted}}
    hang = diagnose_hang(records, {1: 5.0}, idle=6, deadline=4, reporter=0)
    text = "\n".join(hang.lines)
    assert hang.behind == [1] and hang.stopped == [1] and hang.event["waiting"] == [0], text
    assert (f"rank 1 on host h2 has not entered the group's collective #{(last_count or 0) + 1} (ddpkit's gradient "
            "averaging (mpi): counted, not seen one by one)") in text and "it stopped answering" in text


def test_counted_ranks_level_with_a_stopped_one_name_none_behind() -> None:
    records = {0: {**rec(0), "group_seq": 52}, 1: {**rec(1), "group_seq": 52}}
    hang = diagnose_hang(records, {1: 5.0}, idle=6, deadline=4, reporter=0)
    assert hang.behind == [] and hang.stopped == [1]


def test_a_report_reaches_the_process_stderr_while_sys_stderr_is_swapped(capfd: pytest.CaptureFixture[str]) -> None:
    """torch's excepthook (set by init_process_group) swaps sys.stderr for a StringIO while the hooks before it run,
    the watch's failure report among them, and writes it out only after: a launcher's SIGTERM in between lost the
    report. The watch writes to the process's own stderr."""
    import io
    import sys

    import torch.distributed as dist

    from ddpkit.watch.monitor import Monitor
    from ddpkit.watch.recorder import Recorder

    monitor = Monitor(Recorder(0, 1), WatchOptions(summary=False), dist.HashStore())
    saved, sys.stderr = sys.stderr, io.StringIO()
    try:
        monitor.emit(["ddpkit watch: rank 1 on host h1 (pid 7) is gone"], {"event": "rank-gone"})
        swapped = sys.stderr.getvalue()
    finally:
        sys.stderr = saved
    assert swapped == "" and "rank 1 on host h1 (pid 7) is gone" in capfd.readouterr().err


def test_an_abort_order_goes_through_the_store_typed_and_comes_back_whole() -> None:
    from ddpkit.watch.records import AbortOrder, StoppedRank

    order = AbortOrder.from_headline(2, "ddpkit watch: HANG: rank 1 on host b stopped answering",
                                     stopped=(StoppedRank(rank=1, host="b", pid=77, by=3),), silent=(1,), live=3,
                                     hosts={0: "a", 1: "b", 2: "a", 3: "b"}, deadline=None)
    back = AbortOrder.from_json(order.to_json().encode())
    assert back == order and back.reason == "HANG: rank 1 on host b stopped answering"
    assert back.headline == "ddpkit watch: HANG: rank 1 on host b stopped answering"
    lost = AbortOrder.from_headline(0, "ddpkit watch: HANG: the store is gone", silent=None, store_lost="reset")
    assert AbortOrder.from_json(lost.to_json()).silent is None  # a rank that lost the store cannot know who is silent


def test_an_events_file_that_cannot_be_written_is_a_warning_not_a_failure(tmp_path: Path, capfd: Any) -> None:
    """``--events`` into a directory removed mid-run: the report still reaches stderr and nothing raises (it failed
    inside the user's destroy_process_group before)."""
    from types import SimpleNamespace

    from ddpkit.watch.monitor import Monitor

    gone = SimpleNamespace(options=SimpleNamespace(events=tmp_path / "removed" / "events.jsonl"))
    Monitor.emit(gone, ["ddpkit watch: a report"], {"event": "hang"})  # type: ignore[arg-type]
    assert "ddpkit watch: a report" in capfd.readouterr().err


def test_a_claim_whose_reporter_stopped_after_progress_resumed_is_freed_by_another_rank(tmp_path: Path) -> None:
    """Rank 1 reported a hang; progress resumed, and rank 1 was stopped before its next poll freed the claim (CI:
    rank 1's SIGSTOP 0.3 s after the pause ended; the later hang was never reported). Rank 0, which saw the progress
    under rank 1's claim, frees it once rank 1 stopped answering and says progress resumed, once; not before."""
    import json
    import time

    import torch.distributed as dist

    from ddpkit.watch.monitor import Monitor
    from ddpkit.watch.recorder import Recorder

    events = tmp_path / "events.jsonl"
    store = dist.HashStore()
    monitor = Monitor(Recorder(0, 2), WatchOptions(summary=False, events=events), store)
    monitor._publish()
    store.set("rec/1", json.dumps(rec(1, entered=10)))
    monitor._poll()  # the job before the pause
    store.set("claim", "1:1:5")  # rank 1's report of the pause
    store.set("rec/1", json.dumps({**rec(1, entered=12), "beat": 2}))  # progress resumed
    monitor._poll()
    assert store.get("claim") == b"1:1:5"  # rank 1 still answers: it frees its claim itself
    monitor.seen[1] = (2, time.monotonic() - 10)  # rank 1 stopped answering since (its record unchanged for 10 s)
    monitor._poll()
    assert store.get("claim") == b"", "the orphaned claim was left in force: a later hang would never be reported"
    (resumed,) = [e for e in map(json.loads, events.read_text().splitlines()) if e["event"] == "resumed"]
    assert resumed["reporter"] == 0 and resumed["freed"] == "1:1:5"
    monitor._poll()
    assert len(events.read_text().splitlines()) == 1, "said once"
