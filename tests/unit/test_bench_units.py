"""Pure parts of ddpkit bench and report: busbw factors, byte counting, sizes, gate, verdicts, pair judging."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest

from ddpkit.base.errors import EXIT_USAGE, ConfigError
from ddpkit.bench.busbw import OPS, algbw_gbps, busbw_factor, busbw_gbps, element_count, per_rank_count
from ddpkit.bench.results import csv_text, format_table, parse_gate, verdict
from ddpkit.bench.schedules import judge
from ddpkit.bench.sizes import format_size, parse_size, size_sweep
from ddpkit.reports.markdown import render
from tests.helpers import run_ddpkit

# nccl-tests doc/PERFORMANCE.md: allreduce 2(n-1)/n; reducescatter, allgather, alltoall (n-1)/n;
# broadcast, reduce, sendrecv 1. Written out for the rank counts people run, so a typo in the formula shows.
PUBLISHED = {
    2: {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "all_to_all": 0.5, "broadcast": 1.0,
        "reduce": 1.0, "sendrecv": 1.0},
    8: {"all_reduce": 1.75, "all_gather": 0.875, "reduce_scatter": 0.875, "all_to_all": 0.875, "broadcast": 1.0,
        "reduce": 1.0, "sendrecv": 1.0},
    16: {"all_reduce": 1.875, "all_gather": 0.9375, "reduce_scatter": 0.9375, "all_to_all": 0.9375,
         "broadcast": 1.0, "reduce": 1.0, "sendrecv": 1.0},
}


@pytest.mark.parametrize("nranks", sorted(PUBLISHED))
def test_busbw_factors_match_nccl_tests(nranks: int) -> None:
    assert set(PUBLISHED[nranks]) == set(OPS)
    for op, factor in PUBLISHED[nranks].items():
        assert busbw_factor(op, nranks) == Fraction(factor), op
    assert busbw_factor("all_reduce", 1) == 0  # one rank moves nothing over the bus


def test_bandwidth_counts_bytes_as_nccl_tests() -> None:
    # 1 GB all_reduce in 0.1 s on 8 ranks: algbw 10 GB/s, busbw 17.5 GB/s.
    assert algbw_gbps(10**9, 0.1) == pytest.approx(10.0)
    assert busbw_gbps("all_reduce", 10**9, 0.1, 8) == pytest.approx(17.5)
    assert busbw_gbps("all_gather", 10**9, 0.1, 8) == pytest.approx(8.75)
    # Chunked ops: the size is the whole gathered buffer, rounded down to a multiple of the rank count.
    assert element_count("all_gather", 1000, 4, 3) == 249
    assert per_rank_count("all_gather", 249, 3) == 83
    assert element_count("all_reduce", 1000, 4, 3) == 250
    assert per_rank_count("all_reduce", 250, 3) == 250
    with pytest.raises(ValueError):
        busbw_factor("gather", 2)


def test_size_parser_and_sweep() -> None:
    assert parse_size("8") == 8
    assert parse_size("1K") == 1024
    assert parse_size("64M") == 64 << 20
    assert parse_size("1G") == 1 << 30
    assert parse_size("4kib") == 4096
    assert parse_size(" 2MB ") == 2 << 20
    for bad in ("", "1.5M", "-1K", "12X", "M", "1 K M"):
        with pytest.raises(ConfigError):
            parse_size(bad)
    assert size_sweep(1024, 16384, factor=4) == [1024, 4096, 16384]
    assert size_sweep(1024, 20000, factor=2) == [1024, 2048, 4096, 8192, 16384]
    assert size_sweep(1 << 20, 3 << 20, increment=1 << 20) == [1 << 20, 2 << 20, 3 << 20]
    assert [format_size(s) for s in (1024, 1536, 64 << 20, 1 << 30)] == ["1K", "1536", "64M", "1G"]
    for kwargs in ({"factor": 1}, {"factor": 2, "increment": 8}, {"increment": 0}):
        with pytest.raises(ConfigError):
            size_sweep(8, 64, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        size_sweep(64, 8, factor=2)


def test_bad_size_on_the_command_line_is_exit_2_without_traceback() -> None:
    proc = run_ddpkit("bench", "-b", "12X", timeout=120)
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert "is not a size" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_ddpkit("bench", "--min-busbw", "allreduce=3", timeout=120)
    assert proc.returncode == EXIT_USAGE and "allreduce" in proc.stderr


def _op(op: str, busbw: float, wrong: int = 0) -> dict[str, object]:
    m = {"time_us": 10.0, "algbw": busbw, "busbw": busbw, "wrong": wrong}
    return {"op": op, "supported": True, "reason": None,
            "rows": [{"size": 1024, "count": 256, "type": "float32", "redop": None, "root": None,
                      "out_of_place": m, "in_place": None}]}


def test_gate_and_verdict() -> None:
    assert parse_gate("2.5") == {"*": 2.5}
    assert parse_gate("all_reduce=1.0,broadcast=2") == {"all_reduce": 1.0, "broadcast": 2.0}
    results = [_op("all_reduce", 1.5), _op("broadcast", 3.0)]
    assert verdict(results, parse_gate("2")) == (True, [])
    ok, reasons = verdict(results, parse_gate("all_reduce=2,broadcast=2"))
    assert not ok and len(reasons) == 1 and "all_reduce average bus bandwidth 1.500" in reasons[0]
    ok, reasons = verdict([_op("all_reduce", 9.0, wrong=3)], {})
    assert not ok and "3 wrong elements" in reasons[0]
    ok, reasons = verdict(results, parse_gate("reduce=1"))
    assert not ok and "not measured" in reasons[0]
    table = format_table(results[0], 2)
    assert "#wrong" in table and "all_reduce avg bus bandwidth: 1.500 GB/s" in table
    assert csv_text(results).splitlines()[0].startswith("op,size,count,type")


def test_pairs_judge_names_the_slow_rank_and_its_links() -> None:
    fast, slow = 1.0, 0.05
    bw = [[0, fast, slow], [fast, 0, slow], [slow, slow, 0]]
    lat = [[0, 50, 9000], [50, 0, 9000], [9000, 9000, 0]]
    ref_bw, ref_lat, links, endpoints = judge(bw, lat, 0.5)
    assert (ref_bw, ref_lat) == (fast, 50)
    assert links == [(0, 2), (1, 2)] and endpoints == [2]
    # One bad cable between healthy endpoints: the link is named, no endpoint is.
    bw4 = [[0, 0.1, 1, 1], [0.1, 0, 1, 1], [1, 1, 0, 1], [1, 1, 1, 0]]
    lat4 = [[0 if i == j else 50 for j in range(4)] for i in range(4)]
    assert judge(bw4, lat4, 0.5)[2:] == ([(0, 1)], [])


def test_report_tolerates_unknown_fields_and_kinds(tmp_path: Path) -> None:
    check = {"kind": "check", "checks": [{"name": "roll-call", "status": "PASS", "detail": "2/2 | ok", "new": 1},
                                         {"name": "ddp-sync", "status": "FAIL", "detail": "diverged"}],
             "something_new": {"x": [1, 2]}}
    other = {"kind": "train", "epochs": 3, "loss": 0.25, "nested": {"a": 1}}
    sentence = {"kind": "check", "verdict": "FAIL: rank 1 on vm: all_reduce wrong", "checks": []}
    (tmp_path / "sentence.json").write_text(json.dumps(sentence))
    (tmp_path / "check.json").write_text(json.dumps(check))
    (tmp_path / "train.json").write_text(json.dumps(other))
    text = render([tmp_path / "check.json", tmp_path / "train.json"], tmp_path / "r.md")
    assert "| roll-call | PASS | 2/2 \\| ok |" in text
    assert "| check.json | check | FAIL |" in text
    assert "| loss | 0.250 |" in text
    text = render([tmp_path / "sentence.json"], tmp_path / "r3.md")
    assert "| sentence.json | check | FAIL |" in text and "> FAIL: rank 1 on vm: all_reduce wrong" in text
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError):
        render([tmp_path / "bad.json"], tmp_path / "r2.md")


def test_pairs_budget_is_checked_against_the_timeout_only_with_pairs() -> None:
    from ddpkit.bench.cli import _options
    from ddpkit.cli import build_parser

    # no pairs measured: no pair budget to fit
    _options(build_parser(["bench"]).parse_args(["bench", "--timeout", "1"]))
    with pytest.raises(ConfigError, match="--pairs-seconds 1 with --timeout 1"):
        _options(build_parser(["bench"]).parse_args(["bench", "--pairs", "--timeout", "1"]))
