"""``submit k8s -j 2x2 --spare-nodes 1 --heal live`` on the project's Kubernetes harness (issue 53): fault-free runs,
and its fault-free cost.

    sudo python -m benchmarks.bench_live_heal_k8s                       # ~6 minutes on 2 cores; root: namespaces
    sudo BENCH_K8S_ONLY=cost python -m benchmarks.bench_live_heal_k8s   # the cost pairs alone (~12 minutes)

The PyTorchJob ``ddpkit submit k8s --dry-run`` renders, run by ``tests/infra/k8s_operator.py`` (one namespace host a
pod, the operator's environment), ``BENCH_K8S_CLEAN`` (20) times: every pod's exit code, and the live heals its
ledger (on the shared volume) records: a clean run uses no standby. The drill with a pod killed is
``tests/infra/test_heal_k8s.py``.

The cost: ``BENCH_K8S_PAIRS`` (10) alternating pairs of fault-free runs of the mlp, ``-j 2x2 --spare-nodes 1 --heal
live`` (ddpkit's agent in each pod, no torchrun) against ``-j 2x2`` (torchrun in each pod: the restart heal of this
shape, torch elastic's); rank 0's step p50 (its ``--json`` summary) of each, the ratio live over restart.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from scripts.nshosts import create
from tests.helpers import run_ddpkit
from tests.infra.conftest import new_run_id
from tests.infra.k8s_operator import Operator, load

from ddpkit.rundir.ledger import Ledger, RankReplaced

RESULTS = Path(__file__).parent / "results"
CLEAN = int(os.environ.get("BENCH_K8S_CLEAN", "20"))
PAIRS = int(os.environ.get("BENCH_K8S_PAIRS", "10"))
JOB = ("train", "--epochs", "10", "--samples", "1536", "--model", "toy", "--json", "/snapshots/summary.json")
NODES = ["node-a", "node-b", "node-c"]
#: The cost pairs' job: the mlp (a step of tens of ms; the toy model's 4 ms step moves 30% run to run here)
COST = ("train", "--epochs", "3", "--samples", "3072", "--model", "mlp", "--json", "/snapshots/summary.json")
SHAPES = {"live": ("-j", "2x2", "--spare-nodes", "1", "--heal", "live"), "restart": ("-j", "2x2")}


def _clean() -> dict[str, object]:
    done = run_ddpkit("submit", "k8s", "--dry-run", "--image", "registry.example/ddpkit:test", "-j", "2x2",
                      "--spare-nodes", "1", "--heal", "live", "--run-id", new_run_id(), "--", *JOB)
    cluster = create(3, new_run_id())
    try:
        op = Operator(cluster, load(done.stdout), max_restarts=0, nodes=NODES)
        started = time.monotonic()
        op.start()
        ended = op.wait(300)
        ledger = op.workdir / "pvc" / "ddpkit-train-snapshots" / "ddpkit-run"
        heals = [r for r in Ledger(ledger).records() if isinstance(r, RankReplaced)] \
            if (ledger / "ledger.jsonl").exists() else []
        return {"ended": ended, "codes": {p.spec.name: p.exit_codes[-1] if p.exit_codes else None for p in op.job},
                "replaced": len(heals), "seconds": round(time.monotonic() - started, 1)}
    finally:
        cluster.down()


def _plain(shape: str) -> dict[str, object]:
    """A fault-free run of the cost job in ``shape`` (``SHAPES``): every pod's exit code and rank 0's step p50."""
    done = run_ddpkit("submit", "k8s", "--dry-run", "--image", "registry.example/ddpkit:test", *SHAPES[shape],
                      "--run-id", new_run_id(), "--", *COST)
    assert done.returncode == 0, done.stderr
    cluster = create(3 if shape == "live" else 2, new_run_id())
    try:
        op = Operator(cluster, load(done.stdout), max_restarts=0, nodes=NODES[:len(cluster.hosts)])
        op.start()
        ended = op.wait(600)
        summary = op.workdir / "pvc" / "ddpkit-train-snapshots" / "summary.json"
        p50 = json.loads(summary.read_text()).get("step_ms_p50") if summary.exists() else None
        return {"shape": shape, "ended": ended, "codes": [p.exit_codes[-1] if p.exit_codes else None for p in op.job],
                "step_ms_p50": p50}
    finally:
        cluster.down()


def cost() -> None:
    """The cost pairs, into the results beside the clean runs (kept)."""
    path = RESULTS / "bench_live_heal_k8s.json"
    data = json.loads(path.read_text())
    pairs: list[dict[str, object]] = []
    for _ in range(PAIRS):
        for shape in ("live", "restart"):
            pairs.append(_plain(shape))
            print(json.dumps(pairs[-1]), flush=True)
    ratios = [float(lv["step_ms_p50"]) / float(rs["step_ms_p50"])  # type: ignore[arg-type]
              for lv, rs in zip(pairs[0::2], pairs[1::2], strict=True) if lv["step_ms_p50"] and rs["step_ms_p50"]]
    data["cost"] = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "job": " ".join(COST),
                    "pairs": pairs, "ratios": ratios}
    path.write_text(json.dumps(data, indent=1) + "\n")
    md = RESULTS / "bench_live_heal_k8s.md"
    text = md.read_text().split("\nFault-free cost (", 1)[0].rstrip("\n") + "\n" + _cost_line(data["cost"])
    md.write_text(text)
    print(text)


def _cost_line(measured: dict[str, Any]) -> str:
    pairs, ratios = measured["pairs"], measured["ratios"]
    if not ratios:
        return "\nFault-free cost: no pair measured.\n"
    ok = sum(set(r["codes"]) == {0} for r in pairs)
    return (f"\nFault-free cost ({measured['when']}, `{measured['job']}`): rank 0's step p50 under `-j 2x2 "
            f"--spare-nodes 1 --heal live` over `-j 2x2` (torchrun in each pod), {len(ratios)} alternating pairs "
            f"({ok} of {len(pairs)} runs with every pod exiting 0): median {statistics.median(ratios):.3f} "
            f"(min {min(ratios):.3f}, max {max(ratios):.3f}).\n")


def main() -> None:
    if os.environ.get("BENCH_K8S_ONLY") == "cost":
        cost()
        return
    rows = []
    for _ in range(CLEAN):
        rows.append(_clean())
        print(json.dumps(rows[-1]), flush=True)
    ok = sum(bool(r["ended"]) and set(r["codes"].values()) == {0} and r["replaced"] == 0  # type: ignore[union-attr]
             for r in rows)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    text = (f"# `submit k8s -j 2x2 --spare-nodes 1 --heal live` on the Kubernetes harness (issue 53)\n\n"
            f"Measured {when} on this machine (2 cores; `tests/infra/k8s_operator.py`: a namespace host a pod); "
            f"`python -m benchmarks.bench_live_heal_k8s`, the job `{' '.join(JOB)}`.\n\n"
            f"Fault-free: {len(rows)} runs, {ok} with every pod (the master, the worker, the standby worker) exiting 0 "
            "and no replacement in the ledger.\n\n"
            "| run | every pod's exit code | replaced | seconds |\n|---|---|---|---|\n"
            + "".join(f"| {i + 1} | {r['codes']} | {r['replaced']} | {r['seconds']} |\n" for i, r in enumerate(rows)))
    path = RESULTS / "bench_live_heal_k8s.json"
    kept = json.loads(path.read_text()).get("cost") if path.exists() else None  # the cost pairs, measured apart
    path.write_text(json.dumps({"when": when, "rows": rows, **({"cost": kept} if kept else {})}, indent=1) + "\n")
    (RESULTS / "bench_live_heal_k8s.md").write_text(text + (_cost_line(kept) if kept else ""))
    print(text)


if __name__ == "__main__":
    main()
