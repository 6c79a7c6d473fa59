"""ddpkit.goodput: rank 0's ledger lines (a line per second of steps, never per step, torn lines skipped) and the
accounting: every second of the wall clock in one category, lost progress = the steps done again, goodput per
window. A run of three attempts (two killed, resumed from snapshots) is simulated on a fake clock."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddpkit.goodput import records
from ddpkit.goodput.accounting import AttemptSpan, Category, account
from ddpkit.goodput.records import GOODPUT, GoodputLog, RunStarted, Steps, append_line, read_goodput, to_json

STEP_S = 0.010  # each fake step takes 10 ms
GAP_S = 0.002  # and the loop spends 2 ms between steps


def _attempt(run_dir: Path, attempt: int, t: float, *, resume: int | None, last: int, save_every: int = 32,
             finish: bool) -> float:
    """Rank 0 of one attempt on a fake clock from ``t``: start-up 3 s, a load, steps to ``last`` with a snapshot
    every ``save_every`` steps (0.05 s each); returns the time of its last record."""
    log = GoodputLog(run_dir, attempt=attempt, every_s=1.0)
    t += 3.0
    log.started(time=t, process=t - 3.0, world_size=2)
    log.loaded(t, t + 0.2, resume)
    t += 0.2
    last_record = t
    for step in range((resume or 0) + 1, last + 1):
        log.step(t, t + STEP_S, step)
        last_record = t + STEP_S
        t += STEP_S + GAP_S
        if step % save_every == 0:
            log.saved(t, t + 0.05, step)
            last_record = t + 0.05
            t += 0.05
    if finish:
        log.finished(last_record, last, "completed")
    log.close()
    return last_record


def _three_attempts(run_dir: Path) -> tuple[list[AttemptSpan], float, float]:
    """Attempt 1 killed after step 49 (snapshot 32), attempt 2 after step 113 (snapshot 96), attempt 3 finishes
    at 160. Each failure is found 5 s after the last step, each relaunch takes 0.5 s. Returns the spans (as the heal
    ledger has them), the run's start and its end."""
    run_dir.mkdir(parents=True, exist_ok=True)
    start = 1000.0
    with open(run_dir / GOODPUT, "a") as f:
        f.write(to_json(RunStarted(time=start, pid=1, host="vm")) + "\n")
    a1 = start + 0.4
    e1 = _attempt(run_dir, 1, a1, resume=None, last=49, finish=False) + 5.0
    a2 = e1 + 0.5
    e2 = _attempt(run_dir, 2, a2, resume=32, last=113, finish=False) + 5.0
    a3 = e2 + 0.5
    e3 = _attempt(run_dir, 3, a3, resume=96, last=160, finish=True) + 0.3
    spans = [AttemptSpan(attempt=1, start=a1, end=e1, exit_code=137, cause="rank 1 on host vm was killed by SIGKILL",
                         failure_class="host"),
             AttemptSpan(attempt=2, start=a2, end=e2, exit_code=137, cause="rank 1 on host vm was killed by SIGKILL",
                         failure_class="host"),
             AttemptSpan(attempt=3, start=a3, end=e3, exit_code=0)]
    return spans, start, e3


def test_the_categories_add_up_to_the_wall_clock_and_lost_progress_is_the_steps_done_again(tmp_path: Path) -> None:
    spans, start, end = _three_attempts(tmp_path)
    split = account(spans, read_goodput(tmp_path))
    assert split.wall_s == pytest.approx(end - start)
    assert abs(split.accounted_s - split.wall_s) <= 0.01 * split.wall_s
    s = split.seconds
    # steps 33-49 and 97-113 were done twice: 34 steps, and their time is lost progress, not training
    assert split.lost_steps == (49 - 32) + (113 - 96) == 34
    assert s[Category.LOST_PROGRESS] == pytest.approx(34 * STEP_S)
    assert s[Category.TRAINING] == pytest.approx(160 * STEP_S)  # each of the 160 steps counted once
    assert s[Category.CHECKPOINT_LOAD] == pytest.approx(3 * 0.2)
    assert s[Category.CHECKPOINT_SAVE] == pytest.approx(5 * 0.05)  # 32 (attempt 1), 64, 96, 128, 160
    assert s[Category.FAILURE] == pytest.approx(2 * 5.0)
    assert s[Category.RELAUNCH] == pytest.approx(2 * 0.5)
    assert s[Category.TEARDOWN] == pytest.approx(0.3)
    assert s[Category.STARTUP] == pytest.approx(0.4 + 3 * 3.0)
    # a gap after each step but the last of the two killed attempts (the third ends with a snapshot)
    assert s[Category.LOOP_OTHER] == pytest.approx((49 + 81 + 64 - 2) * GAP_S)
    assert split.goodput == pytest.approx(160 * STEP_S / (end - start))
    assert [a.resumed_from for a in split.attempts] == [None, 32, 96]
    assert [a.lost_steps for a in split.attempts] == [0, 17, 17]
    assert split.furthest_step == 160


def test_a_second_of_steps_is_one_line_not_one_line_per_step(tmp_path: Path) -> None:
    log = GoodputLog(tmp_path, attempt=1, every_s=1.0)
    t = 0.0
    for step in range(1, 1001):  # 1000 steps of 10 ms: 10 s
        log.step(t, t + 0.01, step)
        t += 0.01
    log.close()
    lines = [r for r in read_goodput(tmp_path) if isinstance(r, Steps)]
    assert 9 <= len(lines) <= 11
    assert [r.first for r in lines] == [1] + [r.last + 1 for r in lines[:-1]]  # contiguous, none lost
    assert lines[-1].last == 1000
    assert sum(r.busy_s for r in lines) == pytest.approx(10.0)
    assert lines[0].p50_ms == pytest.approx(10.0)


def test_a_line_is_its_kind_and_fields_sorted_and_reads_back() -> None:
    """The file format other tools read: one JSON object, ``kind`` among the fields, keys sorted."""
    saved = records.Saved(attempt=2, start=1.0, end=2.5, step=7)
    assert to_json(saved) == '{"attempt": 2, "end": 2.5, "kind": "saved", "start": 1.0, "step": 7}'
    assert records.from_json(to_json(saved)) == saved


def test_a_torn_last_line_is_skipped_and_the_next_line_starts_its_own(tmp_path: Path) -> None:
    path = tmp_path / GOODPUT
    path.write_text(to_json(RunStarted(time=1.0, pid=1, host="vm")) + "\n" + '{"kind": "steps", "atte')
    log = GoodputLog(tmp_path, attempt=1)
    log.finished(2.0, 0, "completed")
    log.close()
    kinds = [type(r).__name__ for r in read_goodput(path)]
    assert kinds == ["RunStarted", "Finished"]
    assert all(json.loads(line) for line in path.read_text().splitlines()[2:])


def test_append_line_writes_whole_lines(tmp_path: Path) -> None:
    import os

    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_APPEND | os.O_CREAT)
    append_line(fd, "a")
    append_line(fd, "b")
    os.close(fd)
    assert (tmp_path / "f").read_text() == "a\nb\n"


def test_without_a_heal_ledger_the_attempts_are_rank_0s_records(tmp_path: Path) -> None:
    """ddpkit train --run-dir under torch elastic's restarts: no supervisor, so no heal ledger."""
    _three_attempts(tmp_path)
    split = account([], read_goodput(tmp_path))
    assert [a.attempt for a in split.attempts] == [1, 2, 3]
    assert split.lost_steps == 34
    assert abs(split.accounted_s - split.wall_s) <= 0.01 * split.wall_s
    assert split.attempts[-1].exit_code == 0 and split.attempts[0].exit_code is None


def test_goodput_per_window_is_the_training_inside_each_window(tmp_path: Path) -> None:
    spans, start, end = _three_attempts(tmp_path)
    split = account(spans, read_goodput(tmp_path), window_s=1.0)
    assert len(split.windows) == int(-(-(end - start) // 1.0))
    assert all(0.0 <= g <= 1.0 for _, g in split.windows)
    assert split.windows[0][1] == 0.0  # the first second is start-up
    trained = sum(g * min(1.0, end - lo) for lo, g in split.windows)
    assert trained == pytest.approx(split.seconds[Category.TRAINING], rel=0.01)


def test_a_run_with_no_attempt_cannot_be_accounted() -> None:
    with pytest.raises(ValueError, match="no attempt"):
        account([], [])


def test_another_rank_writes_only_its_steps_in_its_own_file(tmp_path: Path) -> None:
    log = GoodputLog(tmp_path, attempt=2, rank=1)
    log.started(time=1.0, process=0.5, world_size=2)
    log.loaded(1.0, 1.1, 32)
    log.step(2.0, 2.01, 33)
    log.saved(2.1, 2.2, 33)
    log.finished(2.3, 33, "completed")
    log.close()
    assert not (tmp_path / GOODPUT).exists()
    lines = read_goodput(tmp_path / "goodput.rank-1.jsonl")
    assert len(lines) == 1 and isinstance(lines[0], Steps) and (lines[0].rank, lines[0].first) == (1, 33)


def _two_ranks(run_dir: Path, *, sync_0: float | None, sync_1: float | None, steps: int = 100) -> tuple[float, float]:
    """One attempt of two ranks in lockstep, 10 ms steps: each rank's gradient sync per step as given (rank 0 the
    quicker when its sync is the longer). Returns the attempt's start and end."""
    start = 50.0
    logs = [GoodputLog(run_dir, attempt=1, every_s=0.25, rank=rank) for rank in (0, 1)]
    logs[0].started(time=start + 2.0, process=start, world_size=2)
    t = start + 2.0
    for step in range(1, steps + 1):
        for log, sync in zip(logs, (sync_0, sync_1), strict=True):
            log.step(t, t + STEP_S, step, sync)
        t += STEP_S + GAP_S
    logs[0].finished(t, steps, "completed")
    for log in logs:
        log.close()
    return start, t


def test_waiting_for_a_straggler_is_the_spread_of_the_ranks_gradient_sync(tmp_path: Path) -> None:
    """Rank 1 computes 3 ms longer each step: rank 0 waits 4 ms in the sync, rank 1 (the straggler) 1 ms, the
    transfer alone. The job lost 3 ms a step to the straggler, out of training, and the split still adds up."""
    from ddpkit.goodput.straggler import rank_waits
    from ddpkit.reports.run import load_run

    start, end = _two_ranks(tmp_path, sync_0=0.004, sync_1=0.001)
    view = load_run(tmp_path)
    split = view.split
    s = split.seconds
    assert s[Category.STRAGGLER_WAIT] == pytest.approx(100 * 0.003)
    assert s[Category.TRAINING] == pytest.approx(100 * (STEP_S - 0.003))
    assert abs(split.accounted_s - split.wall_s) <= 0.01 * split.wall_s
    assert split.goodput == pytest.approx(100 * (STEP_S - 0.003) / (end - start), rel=0.02)
    waits = {w.rank: w for w in rank_waits(view.rank_steps)}
    assert waits[0].wait_share == pytest.approx(0.3) and waits[1].wait_share == pytest.approx(0.0)
    assert waits[0].sync_share == pytest.approx(0.4) and waits[1].steps == 100


def test_without_the_other_ranks_or_a_measured_sync_no_straggler_wait_is_claimed(tmp_path: Path) -> None:
    _two_ranks(tmp_path / "unmeasured", sync_0=None, sync_1=None)
    spans, *_ = _three_attempts(tmp_path / "rank-0-only")
    from ddpkit.reports.run import load_run

    assert load_run(tmp_path / "unmeasured").split.seconds[Category.STRAGGLER_WAIT] == 0.0
    split = account(spans, read_goodput(tmp_path / "rank-0-only"))
    assert split.seconds[Category.STRAGGLER_WAIT] == 0.0
    assert split.seconds[Category.TRAINING] == pytest.approx(160 * STEP_S)


def test_the_queue_wait_the_scheduler_recorded_comes_before_the_run_and_adds_to_the_wall(tmp_path: Path) -> None:
    from ddpkit.goodput.records import QueueWaited

    spans, start, end = _three_attempts(tmp_path)
    with open(tmp_path / GOODPUT, "a") as f:  # submitted 90 s before Slurm started it, 2 s before the supervisor
        f.write(to_json(QueueWaited(scheduler="slurm", job_id="42", submit=start - 92.0, start=start - 2.0)) + "\n")
    split = account(spans, read_goodput(tmp_path))
    assert split.seconds[Category.QUEUE_WAIT] == pytest.approx(90.0)
    assert split.seconds[Category.STARTUP] == pytest.approx(2.0 + 0.4 + 3 * 3.0)
    assert split.wall_s == pytest.approx(end - start + 92.0)
    assert abs(split.accounted_s - split.wall_s) <= 0.01 * split.wall_s
    assert split.queue is not None and split.queue.job_id == "42"


def test_noisy_windows_of_equal_ranks_are_no_straggler_but_a_slower_rank_is() -> None:
    """Two equal ranks whose sampled sync per window is noisy (one a hundred steps sampled): the spread of each
    window's means is positive on average, and summed it said 10-25% "waiting for a straggler" on a healthy job."""
    import random

    from ddpkit.goodput.accounting import AttemptSpan, Category, account
    from ddpkit.goodput.records import Steps

    rng = random.Random(7)

    def lines(rank: int, extra_ms: float) -> list[Steps]:
        return [Steps(attempt=1, start=float(w), end=w + 1.0, first=1 + 400 * w, last=400 * (w + 1), busy_s=1.0,
                      p50_ms=2.5, rank=rank, sync_s=400 * (1e-3 + rng.uniform(-0.5e-3, 0.5e-3) + extra_ms * 1e-3))
                for w in range(60)]

    span = [AttemptSpan(attempt=1, start=0.0, end=60.0, exit_code=0)]
    zero = lines(0, 0.0)
    healthy = account(span, zero, rank_steps={0: zero, 1: lines(1, 0.0)})
    assert healthy.seconds[Category.STRAGGLER_WAIT] < 0.05 * 60, healthy.seconds  # each window's spread: 13%
    slow = account(span, zero, rank_steps={0: zero, 1: lines(1, 0.5)})  # rank 1 waits 0.5 ms a step for rank 0
    assert abs(slow.seconds[Category.STRAGGLER_WAIT] - 60 * 400 * 0.5e-3) < 0.3 * 60 * 400 * 0.5e-3, slow.seconds


def test_a_live_heal_is_its_own_category_inside_the_loop_and_loses_no_step(tmp_path: Path) -> None:
    """``--heal live``: one attempt whose rank 0 waited 1.5 s between steps 40 and 41 while rank 1 was replaced (the
    ledger's ``RankReplaced``, as ``reports.run.attempt_spans`` hands it on): that wait is the live heal's, not the
    loop's, and no step is lost."""
    log = GoodputLog(tmp_path, attempt=1, every_s=1.0)
    t = 1000.0
    log.started(time=t, process=t, world_size=3)
    heal: tuple[float, float] = (0.0, 0.0)
    for step in range(1, 81):
        log.step(t, t + STEP_S, step)
        t += STEP_S + GAP_S
        if step == 40:
            heal = (t, t + 1.5)
            t += 1.5
    log.finished(t, 80, "completed")
    log.close()
    healed = account([AttemptSpan(attempt=1, start=1000.0, end=t + 0.1, exit_code=0, heals=(heal,))],
                     read_goodput(tmp_path))
    plain = account([AttemptSpan(attempt=1, start=1000.0, end=t + 0.1, exit_code=0)], read_goodput(tmp_path))
    assert healed.seconds[Category.LIVE_HEAL] == pytest.approx(1.5)
    assert healed.seconds[Category.LOOP_OTHER] == pytest.approx(plain.seconds[Category.LOOP_OTHER] - 1.5)
    assert healed.lost_steps == 0 and healed.seconds[Category.LOST_PROGRESS] == 0
    assert healed.accounted_s == pytest.approx(plain.accounted_s)  # the same wall, split otherwise


def test_a_rank_s_steps_count_across_its_processes() -> None:
    """A rank killed under --heal live loses its last unwritten line; its replacement goes on from the step the
    group agreed: train's global numbering counts every step from the first to the last; a user's script, whose
    processes each number their own, counts what its lines say."""
    from ddpkit.goodput.records import Steps
    from ddpkit.goodput.straggler import steps_done

    def line(first: int, last: int, at: float, attempt: int = 1) -> Steps:
        return Steps(attempt=attempt, start=at, end=at + 1, first=first, last=last, busy_s=0.5, p50_ms=1.0, rank=1)

    # train: steps 1-40 written, 41-56 applied and lost with the process, the replacement from 57 on
    assert steps_done([line(1, 20, 0), line(21, 40, 1), line(57, 110, 3)]) == 110
    # a second attempt (the restart heal) counts its own steps again
    assert steps_done([line(1, 40, 0), line(33, 60, 9, attempt=2)]) == 40 + 28
    # a user's script: the replacement numbers from 1 again; the counts are what is known
    assert steps_done([line(1, 30, 0), line(1, 25, 3)]) == 55
