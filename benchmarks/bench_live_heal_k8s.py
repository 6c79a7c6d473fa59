"""``submit k8s -j 2x2 --spare-nodes 1 --heal live`` on the project's Kubernetes harness (issue 53): fault-free runs.

    sudo python -m benchmarks.bench_live_heal_k8s      # ~6 minutes on 2 cores; root: network namespaces

The PyTorchJob ``ddpkit submit k8s --dry-run`` renders, run by ``tests/infra/k8s_operator.py`` (one namespace host a
pod, the operator's environment), ``BENCH_K8S_CLEAN`` (20) times: every pod's exit code, and the live heals its
ledger (on the shared volume) records: a clean run uses no standby. The drill with a pod killed is
``tests/infra/test_heal_k8s.py``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from scripts.nshosts import create
from tests.helpers import run_ddpkit
from tests.infra.conftest import new_run_id
from tests.infra.k8s_operator import Operator, load

from ddpkit.rundir.ledger import Ledger, RankReplaced

RESULTS = Path(__file__).parent / "results"
CLEAN = int(os.environ.get("BENCH_K8S_CLEAN", "20"))
JOB = ("train", "--epochs", "10", "--samples", "1536", "--model", "toy", "--json", "/snapshots/summary.json")
NODES = ["node-a", "node-b", "node-c"]


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


def main() -> None:
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
    (RESULTS / "bench_live_heal_k8s.json").write_text(json.dumps({"when": when, "rows": rows}, indent=1) + "\n")
    (RESULTS / "bench_live_heal_k8s.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
