"""Lost progress of a user's script (``goodput.positions``): its steps count from 1 in every attempt, so where it
resumed is learned from its epochs (its sampler's ``set_epoch``) or from its having loaded nothing; otherwise it is
said to be not known, never inflated."""

from __future__ import annotations

from ddpkit.goodput.accounting import AttemptSpan, account
from ddpkit.goodput.records import EpochBegan, GoodputRecord, RankStarted, Steps


def _attempt(attempt: int, t0: float, steps: int, *, epoch_len: int | None, first_epoch: int = 0,
             loaded: bool | None = True) -> list[GoodputRecord]:
    """An attempt of ``steps`` steps, one a 0.1 s, its lines a 10 steps each; with ``epoch_len``, a mark per epoch."""
    out: list[GoodputRecord] = [RankStarted(attempt=attempt, time=t0, process=t0, pid=1, host="h", world_size=2,
                                            numbering="attempt", loaded_state=loaded)]
    if epoch_len is not None:
        out += [EpochBegan(attempt=attempt, epoch=first_epoch + i, step=1 + i * epoch_len, time=t0)
                for i in range(-(-steps // epoch_len))]
    for first in range(1, steps + 1, 10):
        last = min(steps, first + 9)
        out.append(Steps(attempt=attempt, start=t0 + first / 10, end=t0 + (last + 1) / 10, first=first, last=last,
                         busy_s=(last - first + 1) / 10, p50_ms=100.0))
    return out


def _spans(*ends: tuple[float, float, int]) -> list[AttemptSpan]:
    return [AttemptSpan(attempt=i, start=s, end=e, exit_code=c) for i, (s, e, c) in enumerate(ends, 1)]


def test_a_script_that_resumed_at_its_saved_epoch_lost_only_the_steps_since_it() -> None:
    # the seeds' ddp.py: 20 steps an epoch, killed 5 steps into epoch 117 (2345 steps), resumed at epoch 100
    records = [*_attempt(1, 0.0, 117 * 20 + 5, epoch_len=20),
               *_attempt(2, 1000.0, 300 * 20, epoch_len=20, first_epoch=100)]
    split = account(_spans((0.0, 500.0, 137), (1000.0, 1700.0, 0)), records)
    assert split.lost_steps == 17 * 20 + 5  # epochs 100..116 and 5 steps of 117: done again
    assert split.attempts[1].resumed_from == 100 * 20
    assert split.furthest_step == 400 * 20
    # the old reading, step numbers from 1 in each attempt, said every step of attempt 1 was done again
    assert split.lost_steps < 117 * 20


def test_five_steps_into_an_epoch_lost_five_steps() -> None:
    records = [*_attempt(1, 0.0, 3 * 49 + 5, epoch_len=49), *_attempt(2, 100.0, 49 * 2, epoch_len=49, first_epoch=3)]
    split = account(_spans((0.0, 50.0, 137), (100.0, 150.0, 0)), records)
    assert split.lost_steps == 5
    assert split.attempts[1].done_again[0] == 5 and not any(split.attempts[1].done_again[1:])


def test_a_script_that_loaded_nothing_did_everything_again() -> None:
    records = [*_attempt(1, 0.0, 100, epoch_len=None, loaded=False),
               *_attempt(2, 100.0, 160, epoch_len=None, loaded=False)]
    split = account(_spans((0.0, 50.0, 137), (100.0, 150.0, 0)), records)
    assert split.lost_steps == 100 and split.lost_known


def test_a_script_that_loaded_state_and_showed_no_epoch_is_not_known() -> None:
    records = [*_attempt(1, 0.0, 100, epoch_len=None), *_attempt(2, 100.0, 160, epoch_len=None)]
    split = account(_spans((0.0, 50.0, 137), (100.0, 150.0, 0)), records)
    assert split.lost_steps is None and not split.lost_known
    assert split.attempts[0].lost_steps == 0  # the first attempt did nothing again, placed or not
    assert split.attempts[1].lost_steps is None and split.attempts[1].done_again == [None] * 16
    assert split.furthest_step is None


def test_epochs_with_no_whole_epoch_seen_are_placed_only_within_one_epoch() -> None:
    # killed in the first epoch and resumed at it: one epoch in the whole run, the length not needed
    records = [*_attempt(1, 0.0, 30, epoch_len=1000), *_attempt(2, 100.0, 50, epoch_len=1000)]
    split = account(_spans((0.0, 50.0, 137), (100.0, 150.0, 0)), records)
    assert split.lost_steps == 30
    # resumed at another epoch with no whole epoch seen anywhere: not known
    records = [*_attempt(1, 0.0, 30, epoch_len=1000), *_attempt(2, 100.0, 50, epoch_len=1000, first_epoch=1)]
    assert account(_spans((0.0, 50.0, 137), (100.0, 150.0, 0)), records).lost_steps is None


def test_trains_global_numbering_is_unchanged() -> None:
    steps = [Steps(attempt=a, start=t, end=t + 1, first=f, last=f + 9, busy_s=1.0, p50_ms=100.0)
             for a, t, f in ((1, 0.0, 1), (1, 1.0, 11), (2, 10.0, 11), (2, 11.0, 21))]
    started = [RankStarted(attempt=a, time=t, process=t, pid=1, host="h", world_size=2) for a, t in ((1, 0.0),
                                                                                                     (2, 10.0))]
    split = account(_spans((0.0, 5.0, 137), (10.0, 15.0, 0)), [*started, *steps])
    assert split.lost_steps == 10 and split.furthest_step == 30


def test_every_output_says_when_the_steps_done_again_are_not_known(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A user's script that loaded state and showed no epoch: the page, the trace and the textfile say "not known"
    and an upper bound; none writes a number of lost steps."""
    import json

    from ddpkit.goodput.records import GoodputLog
    from ddpkit.reports.html import render_html
    from ddpkit.reports.prometheus import prometheus_text
    from ddpkit.reports.run import load_run
    from ddpkit.reports.trace import trace_events
    from ddpkit.rundir.ledger import Action, AttemptEnded, AttemptStarted, Ledger

    run_dir = tmp_path / "run"
    ledger = Ledger(run_dir)
    for attempt, t0, code in ((1, 0.0, 137), (2, 100.0, 0)):
        ledger.append(AttemptStarted(attempt=attempt, time=t0, hosts=("vm",), ranks=2))
        log = GoodputLog(run_dir, attempt=attempt)
        for record in _attempt(attempt, t0, 100 if attempt == 1 else 160, epoch_len=None):
            log.write(record)
        log.close()
        ledger.append(AttemptEnded(attempt=attempt, time=t0 + 50, exit_code=code,
                                   action=Action.RETRY if code else Action.STOP))
    view = load_run(run_dir)
    assert view.split.lost_steps is None
    page = render_html(view)
    assert "at most" in page and "not known" in page
    # the sync caption no longer says a measured statistic is not measured
    assert "Not measured under DDP's own C++ all-reduce (large models)" not in page
    trace = trace_events(view)["otherData"]
    assert trace["lost_steps"] is None and "upper bound" in trace["goodput_is"]
    text = prometheus_text(view)
    assert 'ddpkit_lost_steps_known{run="run"} 0.0' in text and "\nddpkit_lost_steps_total{" not in text
    json.dumps(trace)  # the trace still writes as JSON


def test_an_earlier_attempt_that_left_no_lines_makes_the_steps_done_again_not_known() -> None:
    """Attempt 1 ran 50 s and its rank 0 wrote nothing (killed before its first line): attempt 2 is not the first
    that made steps, it is the first ddpkit saw. "0 steps done again" would be a guess; "not known" is the truth."""
    records = _attempt(2, 100.0, 160, epoch_len=20)
    split = account(_spans((0.0, 50.0, 137), (100.0, 150.0, 0)), records)
    assert split.lost_steps is None and not split.lost_known
    # train numbers its steps across attempts: its figure does not depend on what an earlier attempt wrote
    steps = [Steps(attempt=2, start=100.0, end=101.0, first=11, last=20, busy_s=1.0, p50_ms=100.0)]
    started = [RankStarted(attempt=2, time=100.0, process=100.0, pid=1, host="h", world_size=2)]
    assert account(_spans((0.0, 50.0, 137), (100.0, 150.0, 0)), [*started, *steps]).lost_steps == 0
