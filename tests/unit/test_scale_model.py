"""The scale model of issue 46 (benchmarks/scale_model.py): its arithmetic, its inputs, its ranking."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from benchmarks.scale_model import Scenario, Strategy, build, effective_fraction, main, parse

HOUR = 3600.0


def scenario(**kw: float) -> Scenario:
    base = {"mtbi_s": 3 * HOUR, "snapshot_interval_s": 30 * 60, "snapshot_stall_s": 0.0, "step_s": 1e-9,
            "hang_fraction": 0.5, "useful_days": 54.0, "gpus": 16_384}
    return Scenario(**(base | kw))


def free(name: str = "free", **kw: float | bool) -> Strategy:
    base = {"detect_kill_s": 0.0, "detect_stop_s": 0.0, "recover_kill_s": 0.0, "recover_stop_s": 0.0,
            "startup_at_scale_s": 0.0, "load_s": 0.0, "resumes_from_snapshot": False}
    return Strategy(name=name, **(base | kw))


def defaults(tmp_path: Path, *argv: str):
    # a file that does not exist: the labelled defaults, whatever benchmarks/results holds today
    return build(parse(["--measured", str(tmp_path / "absent.json"), *argv]))


def test_a_strategy_that_costs_nothing_trains_all_the_time() -> None:
    b = effective_fraction(scenario(), free())
    assert b.effective == pytest.approx(1.0, abs=1e-12)
    assert b.wall_days == pytest.approx(54.0)


def test_a_restart_redoes_half_the_snapshot_interval() -> None:
    b = effective_fraction(scenario(), free(resumes_from_snapshot=True))
    assert b.lost_s == 900.0
    # 900 s lost every 3 hours, nothing else: dropping the half-interval term would give 1.0
    assert b.effective == pytest.approx(1 - 900 / (3 * HOUR))
    longer = effective_fraction(scenario(snapshot_interval_s=3600), free(resumes_from_snapshot=True))
    assert b.effective - longer.effective == pytest.approx(900 / (3 * HOUR))


def test_live_heal_redoes_half_a_step_not_half_the_interval() -> None:
    b = effective_fraction(scenario(step_s=6.0), free())
    assert b.lost_s == 3.0


def test_every_term_of_an_interruption_adds_up() -> None:
    s = free(detect_kill_s=1, detect_stop_s=11, recover_kill_s=2, recover_stop_s=4, startup_at_scale_s=100,
             load_s=5, resumes_from_snapshot=True)
    b = effective_fraction(scenario(hang_fraction=0.25), s)
    assert b.detect_s == pytest.approx(0.75 * 1 + 0.25 * 11)
    assert b.recover_s == pytest.approx(0.75 * 2 + 0.25 * 4)
    assert b.per_interruption_s == pytest.approx(b.detect_s + b.recover_s + 100 + 5 + 900)
    assert b.effective == pytest.approx(1 - b.per_interruption_s / (3 * HOUR))


def test_steady_costs_come_off_with_or_without_faults() -> None:
    b = effective_fraction(scenario(snapshot_stall_s=18.0), free(step_overhead=0.01))
    assert b.snapshot_cost == pytest.approx(18 / 1800)
    assert b.effective == pytest.approx(1 - 0.01 - 0.01)


def test_the_work_takes_longer_and_meets_more_interruptions() -> None:
    b = effective_fraction(scenario(), free(resumes_from_snapshot=True, load_s=180))  # 1080 s of 10,800: 90%
    assert b.effective == pytest.approx(0.9)
    assert b.wall_days == pytest.approx(60.0)
    assert b.interruptions == pytest.approx(60 * 24 / 3)
    assert b.gpu_hours_lost == pytest.approx(6 * 24 * 16_384)


def test_a_loss_beyond_the_time_between_interruptions_never_finishes() -> None:
    b = effective_fraction(scenario(mtbi_s=600), free(resumes_from_snapshot=True))
    assert b.effective == 0.0 and b.wall_days == float("inf")


def test_default_inputs_rank_live_over_restart_over_torchrun(tmp_path: Path) -> None:
    model = defaults(tmp_path)
    live, restart, torchrun = (effective_fraction(model.scenario, s).effective for s in model.strategies)
    assert live > restart > torchrun
    # live pays a new communicator at scale (150 s) but redoes no progress; restart near Meta's "more than 90%"
    assert 0.97 < live < 0.99 and 0.85 < torchrun < restart < 0.95


def test_every_input_has_a_unit_a_kind_and_a_source(tmp_path: Path) -> None:
    model = defaults(tmp_path)
    kinds = {"cited", "issue 46", "derived", "assumption", "measured here", "command line"}
    for i in model.inputs:
        assert i.unit and i.source and i.kind in kinds, i
    by_name = {i.name: i for i in model.inputs}
    assert by_name["mean time between interruptions"].value == 3.0
    assert by_name["torchrun: detect, stop"].value == 600.0  # NCCL's default collective timeout
    assert by_name["restart heal: detect, kill"].value + by_name["restart heal: recover, kill"].value == \
        pytest.approx(7.2)
    assert by_name["restart heal: detect, stop"].value + by_name["restart heal: recover, stop"].value == \
        pytest.approx(20.1)


def test_measured_times_replace_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "live_heal.json"
    path.write_text(json.dumps({"live": {"stop": {"detect_s_median": 3.5, "recover_s_median": 0.4},
                                         "source": "bench_live_heal at abc123"}}))
    model = build(parse(["--measured", str(path)]))
    live = model.strategies[0]
    assert (live.detect_stop_s, live.recover_stop_s) == (3.5, 0.4)
    assert live.recover_kill_s == 1.0  # not in the file: the target
    rows = {i.name: i for i in model.inputs}
    assert rows["live heal: detect, stop"].kind == "measured here"
    assert rows["live heal: detect, stop"].source == "bench_live_heal at abc123"
    assert rows["live heal: recover, kill"].kind == "issue 46"


def test_the_command_line_moves_the_inputs(tmp_path: Path) -> None:
    model = defaults(tmp_path, "--mtbi-hours", "1.5", "--snapshot-minutes", "10", "--hang-fraction", "1")
    assert model.scenario.mtbi_s == 1.5 * HOUR
    assert model.scenario.snapshot_interval_s == 600
    assert model.scenario.hang_fraction == 1.0
    # half the GPUs, no --mtbi-hours: half the failures
    assert defaults(tmp_path, "--gpus", "8192").scenario.mtbi_s == 6 * HOUR


def test_bad_inputs_are_refused_with_the_value(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match=r"hang_fraction is 1\.5"):
        replace(scenario(), hang_fraction=1.5)
    with pytest.raises(SystemExit, match=r"hang_fraction is 2\.0"):
        main(["--measured", str(tmp_path / "absent.json"), "--hang-fraction", "2", "--no-write"])


def test_main_prints_the_table_and_its_sources(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["--measured", str(tmp_path / "absent.json"), "--no-write"])
    out = capsys.readouterr().out
    for text in ("| live heal |", "| restart heal (ddpkit today) |", "| plain torchrun restart |",
                 "## Inputs", "## Sources", "datacenterdynamics.com", "nvidia-resiliency-ext", "assumption"):
        assert text in out
