"""ddpkit report RUN_DIR: the run's ledgers as one self-contained HTML page, a Chrome/Perfetto trace and a
node-exporter textfile; JSON files still make the Markdown report. The run is the simulated one of test_goodput
(three attempts, two killed), with its heal ledger."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from ddpkit.base.errors import ConfigError
from ddpkit.goodput.accounting import Category
from ddpkit.heal.classify import Classification, FailureClass
from ddpkit.reports.cli import add_arguments
from ddpkit.reports.cli import run as report_run
from ddpkit.reports.run import load_run
from ddpkit.rundir.ledger import Action, AttemptEnded, AttemptStarted, Ledger, SupervisorStarted
from tests.unit.test_goodput import _three_attempts


def _run_dir(tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    spans, start, _ = _three_attempts(run_dir)
    ledger = Ledger(run_dir)
    ledger.append(SupervisorStarted(time=start + 0.2, pid=1, host="vm", max_attempts=3, command=("train", "-n", "2")))
    for span in spans:
        ledger.append(AttemptStarted(attempt=span.attempt, time=span.start, hosts=("vm",), ranks=2))
        found = Classification(kind=FailureClass.HOST, reason=span.cause, culprit_ranks=(1,),
                               culprit_hosts=("vm",)) if span.exit_code else None
        assert span.end is not None and span.exit_code is not None
        ledger.append(AttemptEnded(attempt=span.attempt, time=span.end, exit_code=span.exit_code,
                                   action=Action.RETRY if span.exit_code else Action.STOP, classification=found,
                                   decision=f"ddpkit heal: attempt {span.attempt} of 3: ..."))
    return run_dir


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_run_directory_reads_back_its_three_attempts_and_causes(tmp_path: Path) -> None:
    view = load_run(_run_dir(tmp_path))
    assert [a.attempt for a in view.split.attempts] == [1, 2, 3]
    assert [a.failure_class for a in view.split.attempts] == ["host", "host", None]
    assert [(h.host, h.attempt) for h in view.hosts_at_fault] == [("vm", 1), ("vm", 2)]
    assert view.split.lost_steps == 34 and view.command == ("train", "-n", "2")


def test_the_trace_is_complete_events_in_microseconds_one_process_per_attempt(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path)
    trace = tmp_path / "t.json"
    assert report_run(_args(str(run_dir), "--trace", str(trace))) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in complete} == {1, 2, 3}
    assert all(isinstance(e["ts"], float | int) and e["dur"] >= 0 and e["tid"] in (0, 1) for e in complete)
    attempts = [e for e in complete if e["cat"] == "attempt"]
    assert [e["name"] for e in attempts] == ["attempt 1", "attempt 2", "attempt 3"]
    view = load_run(run_dir)
    assert attempts[-1]["ts"] + attempts[-1]["dur"] == pytest.approx(view.split.wall_s * 1e6, abs=1)
    assert sum(e["args"]["done_again"] for e in complete if e["cat"] == "lost-progress") == 34
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert any("rank 1 on host vm was killed by SIGKILL" in n for n in names)


def test_the_prometheus_textfile_has_help_type_and_the_headline_figures(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path)
    prom = tmp_path / "ddpkit.prom"
    report_run(_args(str(run_dir), "--prometheus", str(prom)))
    text = prom.read_text()
    values = dict(re.findall(r"^(ddpkit_\w+)\{run=\"run\"\} (\S+)$", text, re.M))
    view = load_run(run_dir)
    assert float(values["ddpkit_goodput_ratio"]) == pytest.approx(view.split.goodput, rel=1e-6)
    assert float(values["ddpkit_attempts_total"]) == 3 and float(values["ddpkit_failed_attempts_total"]) == 2
    assert float(values["ddpkit_wall_seconds"]) == pytest.approx(view.split.wall_s, rel=1e-6)
    for name in ("ddpkit_goodput_ratio", "ddpkit_attempts_total", "ddpkit_wall_seconds", "ddpkit_time_seconds"):
        assert f"# HELP {name} " in text and f"# TYPE {name} " in text
    assert re.search(r'^ddpkit_time_seconds\{(?=[^}]*run="run")(?=[^}]*category="lost_progress")[^}]*\} ', text, re.M)


def test_the_html_page_is_self_contained_with_its_figures(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path)
    page = tmp_path / "run.html"
    report_run(_args(str(run_dir), "--html", str(page)))
    text = page.read_text()
    assert text.count("<svg") == 4  # timeline, split, step time, goodput over time
    assert not re.search(r"""(src|href)=["']?(https?:|//)""", text)  # nothing fetched from elsewhere
    assert "<link" not in text and "<script src" not in text
    for words in ("attempt 3", "rank 1 on host vm was killed by SIGKILL", "lost progress"):
        assert words in text


def test_a_run_directory_alone_gets_its_page_inside_it(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path)
    report_run(_args(str(run_dir)))
    assert (run_dir / "report.html").read_text().count("<svg") == 4


def test_json_files_with_html_are_refused_and_an_empty_directory_is_no_run(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text("{}")
    with pytest.raises(ConfigError, match="--html"):
        report_run(_args(str(tmp_path / "a.json"), "--html", str(tmp_path / "x.html")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no attempt"):
        report_run(_args(str(tmp_path / "empty")))


def test_a_run_of_a_users_script_under_heal_is_attempts_with_unmeasured_insides(tmp_path: Path) -> None:
    """ddpkit run --heal: the supervisor's ledgers only; the script's steps are not seen, and a successful attempt
    is not called a hang."""
    run_dir = tmp_path / "run"
    ledger = Ledger(run_dir)
    ledger.append(AttemptStarted(attempt=1, time=10.0, hosts=("vm",), ranks=2))
    ledger.append(AttemptEnded(attempt=1, time=14.0, exit_code=137, action=Action.RETRY))
    ledger.append(AttemptStarted(attempt=2, time=14.5, hosts=("vm",), ranks=2))
    ledger.append(AttemptEnded(attempt=2, time=20.0, exit_code=0, action=Action.STOP))
    view = load_run(run_dir)
    seconds = view.split.seconds
    assert seconds[Category.UNMEASURED] == pytest.approx(4.0 + 5.5) and seconds[Category.RELAUNCH] == 0.5
    assert seconds[Category.FAILURE] == 0 and view.split.goodput == 0
    page = tmp_path / "p.html"
    report_run(_args(str(run_dir), "--html", str(page), "--trace", str(tmp_path / "t.json")))
    assert page.read_text().count("<svg") == 3  # no step time recorded: said in words instead


def test_each_ranks_steps_are_its_own_lane_of_the_trace_and_line_of_the_page(tmp_path: Path) -> None:
    from ddpkit.goodput.records import GoodputLog

    run_dir = _run_dir(tmp_path)
    view = load_run(run_dir)
    other = GoodputLog(run_dir, attempt=3, rank=1)
    first = view.split.attempts[2].steps[0]
    other.step(first.start, first.start + 0.05, first.first)  # rank 1: a slow step
    other.close()
    trace = tmp_path / "t.json"
    report_run(_args(str(run_dir), "--trace", str(trace), "--html", str(tmp_path / "p.html")))
    events = json.loads(trace.read_text())["traceEvents"]
    lanes = {(e["pid"], e["tid"]) for e in events if e["ph"] == "X" and e["cat"] in ("steps", "lost-progress")}
    assert (3, 2) in lanes and (3, 1) in lanes and (1, 2) not in lanes
    assert "rank 1" in (tmp_path / "p.html").read_text()


def test_the_straggler_wait_is_on_the_page_and_the_gradient_sync_a_counter_in_the_trace(tmp_path: Path) -> None:
    """Rank 1 the straggler (1 ms sync a step), rank 0 waiting for it (4 ms): the page's per-rank table shows
    rank 0 waiting 30% of its step time, the trace a gradient-sync counter track per rank."""
    from tests.unit.test_goodput import _two_ranks

    run_dir = tmp_path / "run"
    _two_ranks(run_dir, sync_0=0.004, sync_1=0.001)
    page, trace = tmp_path / "p.html", tmp_path / "t.json"
    report_run(_args(str(run_dir), "--html", str(page), "--trace", str(trace)))
    text = page.read_text()
    rows = re.findall(r"<tr><td>(\d)</td><td>100</td>(?:<td[^>]*>[^<]*</td>){3}<td>([^<]*)</td></tr>", text)
    assert rows == [("0", "30.0"), ("1", "0.0")], text[text.index("Per rank"):][:1500]
    assert "waiting for a straggler" in text
    events = json.loads(trace.read_text())["traceEvents"]
    counters = [e for e in events if e["ph"] == "C"]
    assert {e["name"] for e in counters} == {"gradient sync, rank 0", "gradient sync, rank 1"}
    waits = [e["args"]["wait_ms"] for e in counters if e["name"] == "gradient sync, rank 0" and e["args"]["sync_ms"]]
    assert waits and all(w == pytest.approx(3.0) for w in waits)


def test_the_queue_wait_is_a_headline_a_category_and_the_traces_first_lane(tmp_path: Path) -> None:
    from ddpkit.goodput.records import GOODPUT, QueueWaited, to_json

    run_dir = _run_dir(tmp_path)
    start = load_run(run_dir).split.start  # the supervisor's start; Slurm started the job 2 s before, after 28 s
    queued = QueueWaited(scheduler="slurm", job_id="7", submit=start - 30.0, start=start - 2.0)
    with open(run_dir / GOODPUT, "a") as f:
        f.write(to_json(queued) + "\n")
    page, trace, prom = tmp_path / "p.html", tmp_path / "t.json", tmp_path / "d.prom"
    report_run(_args(str(run_dir), "--html", str(page), "--trace", str(trace), "--prometheus", str(prom)))
    assert "28.0 s (job 7)" in page.read_text()
    events = json.loads(trace.read_text())["traceEvents"]
    queue = [e for e in events if e["ph"] == "X" and e["cat"] == "queue"]
    assert len(queue) == 1 and queue[0]["ts"] == 0 and queue[0]["dur"] == pytest.approx(28e6)
    assert 'ddpkit_time_seconds{category="queue_wait",run="run"} 28.0' in prom.read_text()
