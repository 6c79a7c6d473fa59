"""Live healing across hosts without Slurm (issue 53, item 3 and 4), on namespace hosts of this machine.

    sudo python -m benchmarks.bench_live_heal_hosts            # ~25 minutes on 2 cores; root: network namespaces
    python -m benchmarks.bench_live_heal_hosts --render        # results/bench_live_heal_hosts.md from its .json

``train -j 2x2 --rdzv-endpoint H1:PORT --heal live`` on h1 and h2, the same with ``--standby`` on h3 (the drill of
``tests/infra/test_heal_live_hosts.py``): h2 struck once two snapshots are written, ``BENCH_HOSTS_DRILLS`` (10)
times each: its member and ranks killed (SIGKILL), its cable pulled (link). From the leader's ledger
(``RankReplaced``) on this machine's one clock: the fault -> the agent decided (detection), -> the later of the two
replacements' first steps (the survivors' stall ends with it). Growth: 2, 3, 4 hosts x 2 ranks plus one standby,
the last world host killed, ``BENCH_HOSTS_GROWTH`` (3) drills each, each heal split in its parts (detection, the
hand-over: the replacements' start, the store, the group, the state's broadcast; the first step). Fault-free:
``BENCH_HOSTS_CLEAN`` (20) short runs (no replacement, exit 0 on every host), and the cost: step p50 under ``--heal
live`` over ``--heal`` (torch elastic's agents, the restart heal across hosts), ``BENCH_HOSTS_PAIRS`` (10)
alternating pairs of one run each.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scripts.nshosts import create
from tests.infra.conftest import Hosts, new_run_id
from tests.infra.live_hosts_drill import RUN_TIMEOUT, heals_of, start, strike

RESULTS = Path(__file__).parent / "results"
DRILLS = int(os.environ.get("BENCH_HOSTS_DRILLS", "10"))
GROWTH = int(os.environ.get("BENCH_HOSTS_GROWTH", "3"))
CLEAN = int(os.environ.get("BENCH_HOSTS_CLEAN", "20"))
PAIRS = int(os.environ.get("BENCH_HOSTS_PAIRS", "10"))
SHORT = ("train", "--epochs", "5", "--samples", "1536", "--model", "toy")
#: The cost pairs' job: the mlp (4.7M parameters, a step of tens of ms), whose step a 2-core machine's noise moves by
#: a few percent, where the toy model's 4 ms step moved by 30% (benchmarks/results/bench_live_heal.md).
COST = ("train", "--epochs", "3", "--samples", "3072", "--model", "mlp")


def _drill(hosts: Hosts, fault: str, nodes: int = 2) -> dict[str, Any]:
    where = Path(tempfile.mkdtemp(prefix=f"live-hosts-{fault}-"))
    try:
        run = strike(hosts, where, fault, target=nodes - 1, nodes=nodes)
    except BaseException as exc:  # a drill that failed (pytest.fail inside): counted, said
        return {"fault": fault, "hosts": nodes, "ok": False, "why": str(exc)[-2000:]}
    finally:
        hosts.cluster.link(hosts[nodes - 1], up=True)
        hosts.cluster.kill_all()
    heals = run["heals"]
    summary = json.loads((where / "summary.json").read_text()) if (where / "summary.json").exists() else {}
    fault_at = run["fault_at"]
    return {"fault": fault, "hosts": nodes, "ok": all(r.returncode == 0 for r in run["runs"] if r.host is not
                                                      run["victim"]),
            "detect_s": max(h.decided_at or h.lost_at for h in heals) - fault_at,
            "handover_s": max(h.joined_at or 0 for h in heals) - max(h.decided_at or h.lost_at for h in heals),
            "first_step_s": max(h.first_step_at or 0 for h in heals) - fault_at,
            "ranks": sorted(h.rank for h in heals), "generations": sorted({h.gen for h in heals}),
            "replacement_hosts": sorted({str(h.replacement_host) for h in heals}),
            "survivors_kept": bool(run["kept"]) and run["alive"] == run["kept"],
            "steps": summary.get("global_step"), "loaded": summary.get("snapshots_loaded"),
            "replicas_equal": len(set(summary.get("replica_digests", ["a", "b"]))) == 1}


def _clean(hosts: Hosts) -> dict[str, Any]:
    where = Path(tempfile.mkdtemp(prefix="live-hosts-clean-"))
    runs = start(hosts, where, job=SHORT)
    codes = [r.wait(RUN_TIMEOUT).returncode for r in runs]
    hosts.cluster.kill_all()
    return {"codes": codes, "replaced": len(heals_of(where))}


def _cost(hosts: Hosts, live: bool) -> dict[str, Any]:
    where = Path(tempfile.mkdtemp(prefix="live-hosts-cost-"))
    if live:
        runs = start(hosts, where, job=COST)
    else:  # the restart heal across hosts: torch elastic's agent on each host
        args = [*COST, "-j", "2x2", "--rdzv-endpoint", hosts.endpoint(29600), "--run-id", new_run_id(), "--heal",
                "--run-dir", str(where / "run"), "--json", str(where / "summary.json")]
        runs = [hosts.ddpkit(h, *args) for h in hosts.hosts[:2]]
    codes = [r.wait(RUN_TIMEOUT).returncode for r in runs]
    hosts.cluster.kill_all()
    summary = json.loads((where / "summary.json").read_text()) if (where / "summary.json").exists() else {}
    return {"live": live, "codes": codes, "step_ms_p50": summary.get("step_ms_p50")}


def _med(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}" if values else "-"


def render(data: dict[str, Any]) -> str:
    lines = ["# Live healing across hosts without Slurm (issue 53)", "",
             f"Measured {data['when']} on this machine (2 cores; namespace hosts on one switch, gloo on CPU): "
             "`train -j 2x2 --rdzv-endpoint H1:PORT --heal live` on h1 and h2, `--standby` on h3 (`--model toy "
             "--samples 1536 --epochs 80`); `python -m benchmarks.bench_live_heal_hosts`. Seconds on one clock: "
             "the bench's fault and the leader's ledger.", "",
             "| fault on h2 | drills | exit 0 on h1, h3 | detection (median, max) | fault -> both replacements' "
             "first step (median, max) | on | one generation | h1's ranks kept | steps (of 960) | snapshots "
             "loaded | replicas equal |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for fault, words in (("kill", "member and ranks killed"), ("link", "cable pulled")):
        runs = [r for r in data["drills"] if r["fault"] == fault]
        good = [r for r in runs if "detect_s" in r]
        det, first = [r["detect_s"] for r in good], [r["first_step_s"] for r in good]
        lines.append(f"| {words} | {len(runs)} | {sum(r['ok'] for r in runs)} | {_med(det)}, "
                     f"{max(det, default=0):.2f} | {_med(first)}, {max(first, default=0):.2f} | "
                     f"{sorted({h for r in good for h in r['replacement_hosts']})} | "
                     f"{sum(r['generations'] == [1] and r['ranks'] == [2, 3] for r in good)} | "
                     f"{sum(r['survivors_kept'] for r in good)} | {sorted({str(r['steps']) for r in good})} | "
                     f"{sorted({str(r['loaded']) for r in good})} | {sum(r['replicas_equal'] for r in good)} |")
    lines += ["", "Growth: N hosts x 2 ranks and one standby, the last world host killed (its two ranks lost at "
              "once). Seconds, medians:", "",
              "| hosts | ranks | drills ok | detection | hand-over (start, store, group, state) | first step | "
              "fault -> first step (max) |", "|---|---|---|---|---|---|---|"]
    sizes = sorted({r["hosts"] for r in data.get("growth", [])})
    medians: dict[str, list[tuple[int, float]]] = {"handover_s": [], "first_step_s": []}
    for n in sizes:
        runs = [r for r in data["growth"] if r["hosts"] == n]
        good = [r for r in runs if "detect_s" in r]
        parts = {k: [r[k] for r in good] for k in ("detect_s", "handover_s", "first_step_s")}
        after = [r["first_step_s"] - r["detect_s"] - r["handover_s"] for r in good]
        lines.append(f"| {n} | {2 * n} | {sum(r['ok'] for r in runs)} of {len(runs)} | {_med(parts['detect_s'])} | "
                     f"{_med(parts['handover_s'])} | {_med(after)} | {_med(parts['first_step_s'])} "
                     f"({max(parts['first_step_s'], default=0):.2f}) |")
        for key in medians:
            if parts[key]:
                medians[key].append((2 * n, statistics.median(parts[key])))
    for key, points in medians.items():
        if len(points) >= 2:
            slope, intercept = statistics.linear_regression([p[0] for p in points], [p[1] for p in points])
            lines.append(f"\nFitted, {key.removesuffix('_s').replace('_', ' ')}: {intercept:.3f} + {slope:.4f} x "
                         f"ranks s ({1000 * slope:.1f} ms a rank).")
    clean = data.get("clean", [])
    if clean:
        lines += ["", f"Fault-free (`{' '.join(SHORT)}`, h1 h2 and the standby h3): {len(clean)} runs, "
                  f"{sum(r['codes'] == [0, 0, 0] for r in clean)} with exit 0 on all three hosts, "
                  f"{sum(r['replaced'] == 0 for r in clean)} with no replacement."]
    pairs = data.get("cost", [])
    ratios = [lv["step_ms_p50"] / rs["step_ms_p50"] for lv, rs in zip(pairs[0::2], pairs[1::2], strict=False)
              if lv.get("step_ms_p50") and rs.get("step_ms_p50")]
    if ratios:
        when = f", measured {data['cost_when']}" if data.get("cost_when") else ""
        lines += ["", f"Fault-free cost (`{' '.join(COST)} -j 2x2`{when}): step p50 under `--heal live` over `--heal` "
                  f"(torch elastic's agent on each host), {len(ratios)} alternating pairs: median "
                  f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})."]
    lines += ["", "Detection: a killed host's member connection ends (its kernel closes the socket), seen at once; a "
              "host cut off: its member's beat (every 0.25 s) standing still 3 s (SILENT_S), 1 s more (STOPPED_S), "
              "then its ranks count as ended 1 s after their SIGKILL (UNREACHED_S), while h1's ranks shut their "
              "connections to it 0.5 s after the plan (UNBLOCK_AFTER_S)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    path = RESULTS / "bench_live_heal_hosts.json"
    if "--render" in sys.argv:
        data = json.loads(path.read_text())
    elif os.environ.get("BENCH_HOSTS_ONLY") == "cost":  # the cost pairs again, the other rows kept
        data = json.loads(path.read_text())
        data["cost"], data["cost_when"] = [], time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        hosts = Hosts(create(3, new_run_id()))
        try:
            for _ in range(PAIRS):
                for live in (True, False):
                    data["cost"].append(_cost(hosts, live=live))
                    print("cost", json.dumps(data["cost"][-1]), flush=True)
                    path.write_text(json.dumps(data, indent=1) + "\n")
        finally:
            hosts.cluster.down()
    else:
        data = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "drills": [], "growth": [],
                "clean": [], "cost": []}

        def save(key: str, row: dict[str, Any]) -> None:
            data[key].append(row)
            print(key, json.dumps(row), flush=True)
            path.write_text(json.dumps(data, indent=1) + "\n")

        clusters = []
        try:
            hosts = Hosts(create(5, new_run_id()))
            clusters.append(hosts.cluster)
            three = Hosts(hosts.cluster)
            for _ in range(DRILLS):
                for fault in ("kill", "link"):
                    three.hosts = hosts.cluster.hosts[:3]
                    save("drills", _drill(three, fault))
            for _ in range(GROWTH):
                for n in (2, 3, 4):
                    three.hosts = hosts.cluster.hosts[: n + 1]
                    save("growth", _drill(three, "kill", nodes=n))
            three.hosts = hosts.cluster.hosts[:3]
            for _ in range(CLEAN):
                save("clean", _clean(three))
            for _ in range(PAIRS):
                save("cost", _cost(three, live=True))
                save("cost", _cost(three, live=False))
        finally:
            for cluster in clusters:
                with contextlib.suppress(Exception):
                    cluster.down()
    text = render(data)
    path.write_text(json.dumps(data, indent=1) + "\n")
    (RESULTS / "bench_live_heal_hosts.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
