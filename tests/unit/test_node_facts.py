"""Node facts judged across nodes and against a baseline; bad hosts and the commands that take them out; bench
baselines (issue 28). Pure logic, plus this machine's own facts read for real."""

from __future__ import annotations

import copy
import json
import os
import shlex
from pathlib import Path
from typing import Any

import pytest

from ddpkit.base.errors import ConfigError
from ddpkit.bench.judged import slow_hosts
from ddpkit.verdicts import baseline
from ddpkit.verdicts.nodefacts import gather
from ddpkit.verdicts.nodejudge import bad_hosts, compare_to_baseline, judge_nodes, node_facts
from ddpkit.verdicts.outcome import FAIL, PASS, WARN, failed
from ddpkit.verdicts.remedy import commands, drain, report_lines

FACTS = {"cores": 8, "memory_gib": 62.8, "numa_nodes": 1, "kernel": "6.1.0", "os": "Linux",
         "nic": {"name": "eth0", "speed_mbps": 25000, "mtu": 9000, "up": True, "driver": "mlx5_core"},
         "gpus": None, "gpu_source": "no NVML bindings"}
GPU = {"index": 0, "model": "NVIDIA H100 80GB HBM3", "driver": "550.54", "cuda_driver": "12.4", "pcie_gen": 5,
       "pcie_gen_max": 5, "pcie_width": 16, "pcie_width_max": 16, "ecc_uncorrected": 0, "retired_pages": None,
       "remapped_rows_failed": False}


def _records(*facts: dict[str, Any] | None, lws: int = 1) -> list[dict[str, Any]]:
    """One record per rank; node i is host n{i+1}; the node's facts on its local rank 0 only."""
    out = []
    for node, f in enumerate(facts):
        for local in range(lws):
            rank = node * lws + local
            out.append({"rank": rank, "host": f"n{node + 1}", "group_rank": node, "local_rank": local,
                        "slurm_node": f"node{node + 1}", "facts": f if local == 0 else None})
    return out


def _with(**changes: Any) -> dict[str, Any]:
    f = copy.deepcopy(FACTS)
    for key, value in changes.items():
        if key.startswith("nic_"):
            f["nic"][key[4:]] = value
        else:
            f[key] = value
    return f


def test_identical_nodes_pass_and_facts_are_read_once_per_node() -> None:
    records = _records(FACTS, FACTS, FACTS, lws=4)
    nodes = node_facts(records)
    assert [(n["host"], n["ranks"], n["facts"] is not None) for n in nodes] == [
        ("n1", [0, 1, 2, 3], True), ("n2", [4, 5, 6, 7], True), ("n3", [8, 9, 10, 11], True)]
    out = judge_nodes(records)
    assert [(o.name, o.status) for o in out] == [("node-facts", PASS)]
    assert "3 nodes agree where it matters: 8 cores, 62.8 GiB, 1 NUMA node(s), eth0 25000 Mb/s MTU 9000" \
        in out[0].detail


def test_a_different_mtu_fails_and_names_the_host_and_the_field() -> None:
    out = {o.name: o for o in judge_nodes(_records(FACTS, FACTS, _with(nic_mtu=1500)))}
    facts = out["node-facts"]
    assert facts.status == FAIL
    assert "nic.mtu: 1500 on n3 (9000 on n1, n2)" in facts.detail
    assert facts.data["bad_hosts"] == {"n3": ["nic.mtu 1500 (others 9000)"]}
    assert "node-notes" not in out  # nothing else differs: the text shows only what differs


def test_on_a_tie_rank_zeros_node_is_the_reference() -> None:
    facts = judge_nodes(_records(FACTS, _with(nic_speed_mbps=10000)))[0]
    assert facts.status == FAIL and facts.data["bad_hosts"] == {"n2": ["nic.speed_mbps 10000 (others 25000)"]}


def test_unusual_fields_are_notes_not_failures() -> None:
    out = {o.name: o for o in judge_nodes(_records(FACTS, FACTS, _with(kernel="6.5.0", cores=4)))}
    assert out["node-facts"].status == PASS
    assert out["node-notes"].status == WARN
    assert "cores: 4 on n3 (8 on n1, n2)" in out["node-notes"].detail
    assert "kernel: 6.5.0 on n3 (6.1.0 on n1, n2)" in out["node-notes"].detail


def test_memory_within_five_percent_is_the_same_memory() -> None:
    out = judge_nodes(_records(FACTS, _with(memory_gib=61.9), _with(memory_gib=63.0)))
    assert [(o.name, o.status) for o in out] == [("node-facts", PASS)]
    out = {o.name: o for o in judge_nodes(_records(FACTS, FACTS, _with(memory_gib=31.4)))}
    assert "memory_gib: 31.4 on n3" in out["node-notes"].detail


def test_gpu_facts_narrow_pcie_ecc_and_a_missing_gpu() -> None:
    narrow = {**GPU, "pcie_width": 8}
    out = judge_nodes(_records(_with(gpus=[GPU, GPU]), _with(gpus=[GPU, narrow]), _with(gpus=[GPU])))
    facts = out[0]
    assert facts.status == FAIL
    assert "gpu.count: 1 on n3 (2 on n1, n2)" in facts.detail
    assert "n2: GPU 0 (NVIDIA H100 80GB HBM3) PCIe link x8 of x16" in facts.detail
    assert set(facts.data["bad_hosts"]) == {"n2", "n3"}  # type: ignore[arg-type]
    ecc = judge_nodes(_records(_with(gpus=[GPU]), _with(gpus=[{**GPU, "ecc_uncorrected": 3}])))[0]
    assert ecc.status == FAIL and "n2: GPU 0 (NVIDIA H100 80GB HBM3) 3 uncorrected ECC error(s)" in ecc.detail
    lost = judge_nodes(_records(_with(gpus=[GPU]), _with(gpu_source="NVML error: GPU is lost")))[0]
    assert lost.status == FAIL and "n2: NVML error: GPU is lost" in lost.detail


def test_nodes_without_facts_are_not_compared() -> None:
    assert judge_nodes(_records(None, None)) == []
    out = judge_nodes(_records(FACTS, None))
    assert out[0].status == PASS and out[0].detail.startswith("1 node:")


def test_facts_against_a_baseline() -> None:
    then = {"n1": FACTS, "n2": FACTS, "n9": FACTS}
    same = compare_to_baseline(_records(FACTS, FACTS), {"n1": FACTS, "n2": FACTS})
    assert same.status == PASS and "facts unchanged" in same.detail
    changed = compare_to_baseline(_records(FACTS, _with(nic_mtu=1500, kernel="6.5.0")), then)
    assert changed.status == FAIL
    assert "n2 nic.mtu 1500 (baseline 9000)" in changed.detail and "n2 kernel 6.5.0 (baseline 6.1.0)" in changed.detail
    assert "in the baseline but not in this run: n9" in changed.detail
    assert changed.data["bad_hosts"] == {"n2": ["nic.mtu 1500 (baseline 9000)"]}
    noted = compare_to_baseline(_records(FACTS, _with(kernel="6.5.0")), {"n1": FACTS, "n2": FACTS})
    assert noted.status == WARN


def test_bad_hosts_from_facts_bad_ranks_and_missing_ranks() -> None:
    records = _records(FACTS, _with(nic_mtu=1500), lws=2)[:3]  # rank 3 never checked in
    outcomes = [*judge_nodes(records), failed("all_reduce_sum", "wrong", bad_ranks=[1]),
                failed("roll-call", "missing", bad_ranks=[3]), failed("deadline", "no ranks named")]
    bad = bad_hosts(outcomes, records, hosts=("n1", "n2"), local_world_size=2)
    assert bad == [
        {"host": "n2", "slurm_node": "node2", "reasons": ["node-facts: nic.mtu 1500 (others 9000)",
                                                          "roll-call missing on rank(s) 3"]},
        {"host": "n1", "slurm_node": "node1", "reasons": ["all_reduce_sum failed on rank(s) 1"]},
    ]
    assert bad_hosts([o for o in outcomes if o.status == PASS], records, hosts=(), local_world_size=2) == []


def test_commands_quote_every_value() -> None:
    hostile = [{"host": "n1; rm -rf /", "slurm_node": None, "reasons": ["it's \"bad\" $(id)\nnext"]}]
    cmds = commands("check", hostile)
    assert shlex.split(cmds["slurm"][0]) == [
        "scontrol", "update", "NodeName=n1; rm -rf /", "State=DRAIN", "Reason=ddpkit check: it's \"bad\" $(id) next"]
    assert shlex.split(cmds["kubernetes"][0]) == ["kubectl", "cordon", "n1; rm -rf /"]
    assert shlex.split(cmds["kubernetes"][1]) == [
        "kubectl", "taint", "nodes", "n1; rm -rf /", "ddpkit.io/unhealthy=check:NoSchedule", "--overwrite"]
    good = [{"host": "gpu7", "slurm_node": "gpu7", "reasons": ["node-facts: nic.mtu 1500 (others 9000)"]}]
    assert commands("check", good)["slurm"] == [
        "scontrol update NodeName=gpu7 State=DRAIN 'Reason=ddpkit check: node-facts: nic.mtu 1500 (others 9000)'"]
    lines = report_lines("check", good)
    assert lines[0] == "bad hosts: 1" and "  kubectl cordon gpu7" in lines
    assert report_lines("check", []) == []


def test_drain_refuses_outside_a_slurm_job_and_says_what_to_run() -> None:
    bad = [{"host": "gpu7", "slurm_node": "gpu7", "reasons": ["x"]}]
    lines = drain("check", bad, environ={"PATH": os.environ.get("PATH", "")})
    assert lines[0].startswith("--on-fail drain: nothing drained: ")
    assert "scontrol update NodeName=gpu7 State=DRAIN" in lines[1]
    assert drain("check", [], environ={}) == []


def _bench(busbw: float, links: list[list[float | None]] | None = None) -> dict[str, Any]:
    names = ["h1", "h2", "h3"]
    pairs = None
    if links is not None:
        pairs = {"mode": "nodes", "names": names, "bandwidth_gbps": links, "threshold": 0.5,
                 "latency_us": [[0 if i == j else 50.0 for j in range(3)] for i in range(3)], "slow_endpoints": []}
    row = {"size": 16 << 20, "out_of_place": {"busbw": busbw, "time_us": 1000.0, "wrong": 0, "algbw": busbw}}
    small = {"size": 1024, "out_of_place": {"busbw": busbw / 100, "time_us": 10.0, "wrong": 0, "algbw": 0.0}}
    return {"version": "0.1.0", "backend": "gloo", "device": "cpu", "dtype": "float32",
            "world": {"world_size": 3, "members": [{"host": h, "facts": FACTS, "python": "3.11.7", "torch": "2.13.0",
                                                    "cuda": "none"} for h in names]},
            "ops": [{"op": "all_reduce", "supported": True, "rows": [small, row]}], "pairs": pairs}


def _links(slow: float = 1.0) -> list[list[float | None]]:
    """h3's links at ``slow`` x 1 GB/s, the others at 1 GB/s."""
    return [[0, 1.0, slow], [1.0, 0, slow], [slow, slow, 0]]


def test_bench_against_its_baseline_names_regressions_and_the_slow_node() -> None:
    base = baseline.from_bench(_bench(1.31, _links()), argv=["bench"], facts={"h1": FACTS})
    assert base["nodes"] == {"h1": {"best_link_gbps": 1.0}, "h2": {"best_link_gbps": 1.0},
                             "h3": {"best_link_gbps": 1.0}}
    same = baseline.judge_bench(_bench(1.25, _links()), base, 20)
    assert same["regressions"] == [] and same["bad_hosts"] == {}
    worse = baseline.judge_bench(_bench(0.82, _links(0.7)), base, 20)
    assert worse["regressions"] == [
        "all_reduce 16 MiB: 0.82 GB/s, baseline 1.31 GB/s, -37%",
        "link h1 <-> h3: 0.7 GB/s, baseline 1 GB/s, -30%", "link h2 <-> h3: 0.7 GB/s, baseline 1 GB/s, -30%",
        "node h3 (fastest link): 0.7 GB/s, baseline 1 GB/s, -30%"]
    assert list(worse["bad_hosts"]) == ["h3"]  # h1 and h2 keep one healthy link each
    # latency-bound sizes are recorded, not judged; a tolerance above the change forgives it
    assert not any("1 KiB" in r for r in worse["regressions"])
    assert baseline.judge_bench(_bench(0.82, _links(0.7)), base, 40)["regressions"] == []
    newer = _bench(1.31, _links())
    for m in newer["world"]["members"]:
        m["torch"] = "2.14.0"
    assert "torch 2.14.0; baseline measured with 2.13.0" in baseline.judge_bench(newer, base, 20)["notes"]


def test_median_of_repeats_takes_each_rows_middle_time() -> None:
    def sweep(t: float) -> list[dict[str, Any]]:
        return [{"op": "all_reduce", "supported": True,
                 "rows": [{"size": 8, "out_of_place": {"time_us": t, "busbw": 1 / t, "algbw": 1 / t, "wrong": 0},
                           "in_place": None}]}]

    merged = baseline.median_rows([sweep(5.0), sweep(1.0), sweep(9.0)])
    assert merged[0]["rows"][0]["out_of_place"]["time_us"] == 5.0 and merged[0]["repeats"] == 3


def test_baseline_files_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        baseline.load(tmp_path / "none.json")
    (tmp_path / "bench.json").write_text(json.dumps({"kind": "bench"}))
    with pytest.raises(ConfigError, match="a 'bench' file"):
        baseline.load(tmp_path / "bench.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not readable as JSON"):
        baseline.load(tmp_path / "bad.json")
    check = {"kind": "check", "nodes": [{"host": "n1", "facts": FACTS}, {"host": "n2", "facts": None}]}
    (tmp_path / "check.json").write_text(json.dumps(check))
    assert baseline.facts_of(baseline.load(tmp_path / "check.json")) == {"n1": FACTS}


def test_slow_hosts_from_the_slow_link_finder() -> None:
    assert slow_hosts({"mode": "ranks", "slow_endpoints": ["rank 3 (gpu2)"], "threshold": 0.5})[0][0] == "gpu2"
    assert slow_hosts({"mode": "nodes", "slow_endpoints": ["gpu2"], "threshold": 0.5})[0][:2] == ("gpu2", None)
    assert slow_hosts(None) == []


def test_this_machines_facts_are_read() -> None:
    facts = gather(master="127.0.0.1")
    assert facts["cores"] == len(os.sched_getaffinity(0))
    assert facts["nic"]["name"] == "lo"
    assert facts["nic"]["mtu"] == int(Path("/sys/class/net/lo/mtu").read_text())
    assert facts["memory_gib"] > 0 and facts["kernel"] == os.uname().release
    assert facts["gpus"] is None or isinstance(facts["gpus"], list)


def test_report_shows_a_run_beside_its_baseline(tmp_path: Path) -> None:
    from ddpkit.reports.markdown import render

    base = tmp_path / "base.json"
    baseline.save(base, baseline.from_bench(_bench(1.31, _links()), argv=["bench"], facts={"h1": FACTS}))
    run = tmp_path / "bench.json"
    run.write_text(json.dumps({**_bench(0.82, _links(0.7)), "kind": "bench", "bad_hosts": [
        {"host": "h3", "slurm_node": None, "reasons": ["baseline: fastest link 0.7 GB/s"]}]}))
    text = render([run], tmp_path / "r.md", plots=False, baseline=str(base), tolerance=20)
    assert f"#### beside the baseline {base}" in text and "tolerance 20%" in text
    assert "| all_reduce 16 MiB | 0.820 | 1.310 | -37.4% | **regression** |" in text
    assert "| h3 |  | baseline: fastest link 0.7 GB/s |" in text
