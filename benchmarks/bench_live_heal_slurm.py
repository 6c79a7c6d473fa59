"""Live healing under Slurm with a standby spare (issue 46), against today's restart heal, in one run.

    sudo python -m benchmarks.bench_live_heal_slurm     # ~25 minutes on 2 cores; root: Slurm daemons, namespaces

A 3-node namespace Slurm cluster of this machine (``scripts/slurm_cluster.py``), ``submit slurm -j 2x1
--spare-nodes 1 --heal live -- train --epochs 100 --samples 4096``; a few seconds in, node2's rank is killed
(SIGKILL) or stopped (SIGSTOP) from outside, ``BENCH_SLURM_DRILLS`` (10) times each (the drill of
``tests/infra/test_heal_slurm_live.py``). From the ledger's ``rank-replaced`` record on this machine's one clock:
the fault -> the supervisor took the rank for lost (detection), -> the replacement on node3 applied its first step
(the survivors' stall ends with it). A node of two ranks (``-j 2x2``): both of node2's ranks killed or stopped at
once, ``BENCH_SLURM_NODE_DRILLS`` (10) times each: the later of the two replacements' first steps. The same two
faults under ``--heal`` (restart), ``BENCH_SLURM_RESTARTS`` (3)
each: the fault -> the next attempt's first step (the goodput ledger's first ``steps`` window of attempt 2), and the
steps done again.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scripts import slurm_cluster
from tests.infra.slurm_fixture import job_ledger, job_log
from tests.infra.test_heal_slurm import _ranks_on as train_ranks_on
from tests.infra.test_heal_slurm_live import NODE, TRAIN, _idle, _submit, _until, drill, node_drill

from ddpkit.goodput.records import GOODPUT, Steps, read_goodput
from ddpkit.rundir.ledger import AttemptEnded, HostExcluded, Ledger, RankReplaced

RESULTS = Path(__file__).parent / "results"
DRILLS = int(os.environ.get("BENCH_SLURM_DRILLS", "10"))
NODE_DRILLS = int(os.environ.get("BENCH_SLURM_NODE_DRILLS", "10"))
#: Drills of node2's link cut under ``-j 2x2``, each on a cluster of its own (Slurm hears from a node cut off only
#: minutes after its link is back). ``BENCH_SLURM_ONLY=link``: these alone, the other rows kept from the last run.
LINK_DRILLS = int(os.environ.get("BENCH_SLURM_LINK_DRILLS", "5"))
CLEAN = int(os.environ.get("BENCH_SLURM_CLEAN", "20"))
PAIRS = int(os.environ.get("BENCH_SLURM_PAIRS", "10"))
SHORT = ("train", "--epochs", "10", "--samples", "2048")
RESTARTS = int(os.environ.get("BENCH_SLURM_RESTARTS", "3"))


def _live(c: Any, fault: str) -> dict[str, Any]:
    where = Path(tempfile.mkdtemp(prefix=f"live-{fault}-"))
    run = drill(c, where, fault)
    heal = run["heal"]
    summary = json.loads((where / "summary.json").read_text()) if (where / "summary.json").exists() else {}
    return {"fault": fault, "exit_code": run["code"], "detect_s": heal.decided_at - run["fault_at"],
            "first_step_s": heal.first_step_at - run["fault_at"],
            "first_step_after_detect_s": heal.first_step_at - heal.decided_at,
            "replacement_host": heal.replacement_host, "survivor_kept": run["alive"] == run["kept"],
            "steps": summary.get("global_step"), "loaded": summary.get("snapshots_loaded"),
            "replicas_equal": len(set(summary.get("replica_digests", ["a", "b"]))) == 1}


def _node(c: Any, fault: str) -> dict[str, Any]:
    """``-j 2x2``: node2's two ranks killed or stopped at once; both replacements' first step (the later)."""
    where = Path(tempfile.mkdtemp(prefix=f"node-{fault}-"))
    snaps = where / "snaps"
    snaps.mkdir()
    run = node_drill(c, where, fault, *TRAIN, "--snapshot-path", str(snaps / "snap.pt"), "--json",
                     str(where / "summary.json"), ready=lambda w: len(list(snaps.glob("snap.*.pt"))) >= 2)
    heals = run["heals"]
    summary = json.loads((where / "summary.json").read_text()) if (where / "summary.json").exists() else {}
    firsts = [h.first_step_at for h in heals if h.first_step_at is not None]
    return {"fault": fault, "exit_code": run["code"], "ranks": sorted(h.rank for h in heals),
            "generations": sorted({h.gen for h in heals}),
            "detect_s": max(h.decided_at or h.lost_at for h in heals) - run["fault_at"],
            "first_step_s": max(firsts) - run["fault_at"] if len(firsts) == len(heals) else None,
            "replacement_hosts": sorted({str(h.replacement_host) for h in heals}),
            "survivors_kept": run["alive"] == run["kept"], "loaded": summary.get("snapshots_loaded"),
            "replicas_equal": len(set(summary.get("replica_digests", ["a", "b"]))) == 1}


#: The cost pairs' job under ``BENCH_SLURM_ONLY=cost``: the mlp (a step of tens of ms), which a 2-core machine's noise
#: moves by a few percent where the toy model's 4 ms step moved by 30% (0.89 to 1.53 in one run of pairs).
COST = ("train", "--epochs", "3", "--samples", "3072", "--model", "mlp")


def _plain(c: Any, heal: str, job: tuple[str, ...] = SHORT) -> dict[str, Any]:
    """A fault-free ``-j 2x2`` run under ``--heal HEAL``: its exit, replacements, and step p50 (rank 0's summary)."""
    where = Path(tempfile.mkdtemp(prefix=f"plain-{heal}-"))
    from tests.infra.slurm_fixture import submit_healing

    proc = submit_healing(c, where, *job, "--snapshot-path", str(where / "snap.pt"), "--json",
                          str(where / "summary.json"), shape=NODE, heal=("--heal", heal))
    try:
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        _idle(c)
    records = job_ledger(where) if list((where / ".ddpkit-runs").glob("slurm-*")) else []
    summary = json.loads((where / "summary.json").read_text()) if (where / "summary.json").exists() else {}
    return {"heal": heal, "exit_code": proc.returncode, "completed": "COMPLETED exit code 0 (restarts 0)" in out,
            "replaced": sum(isinstance(r, RankReplaced | HostExcluded) for r in records),
            "step_ms_p50": summary.get("step_ms_p50"), "tail": "" if proc.returncode == 0 else job_log(where)[-800:]}


def _restart(c: Any, fault: str) -> dict[str, Any]:
    where = Path(tempfile.mkdtemp(prefix=f"restart-{fault}-"))
    snaps = where / "snaps"
    snaps.mkdir()
    proc = _submit(c, where, *TRAIN, "--snapshot-path", str(snaps / "snap.pt"), heal=("--heal",))
    try:
        _until("two snapshots", lambda: len(list(snaps.glob("snap.*.pt"))) >= 2 and train_ranks_on(c.nodes[1]), proc)
        time.sleep(1)
        fault_at = time.time()
        for pid in train_ranks_on(c.nodes[1]):
            os.kill(pid, signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
        proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in train_ranks_on(c.nodes[1]):
            os.kill(pid, signal.SIGKILL)
    (run,) = list((where / ".ddpkit-runs").glob("slurm-*"))
    windows = [r for r in read_goodput(run / GOODPUT) if isinstance(r, Steps) and r.attempt == 2]
    ended = [r for r in Ledger(run).records() if isinstance(r, AttemptEnded)]
    lost = [r for r in read_goodput(run / GOODPUT) if isinstance(r, Steps) and r.attempt == 1]
    last = max((w.last for w in lost), default=None)
    resumed = ended[0].progress if ended else None
    return {"fault": fault, "exit_code": proc.returncode,
            "first_step_s": min(w.start for w in windows) - fault_at if windows else None,
            "redone": last - resumed if last is not None and resumed is not None else None}


def _links() -> list[dict[str, Any]]:
    """``LINK_DRILLS`` node drills with node2's link cut, each on a fresh 3-node cluster."""
    rows = []
    for _ in range(LINK_DRILLS):
        c = slurm_cluster.SlurmCluster(Path(tempfile.mkdtemp(prefix="ddpkit-bench-link-")), nodes_count=3)
        c.start(timeout=120)
        try:
            rows.append(_node(c, "link"))
            print(json.dumps(rows[-1]), flush=True)
        finally:
            c.stop()
    return rows


def _med(values: list[Any]) -> str:
    got = [v for v in values if isinstance(v, int | float)]
    return f"{statistics.median(got):.2f}" if got else "-"


def render(data: dict[str, Any]) -> str:
    lines = ["# Live healing under Slurm with standbys on a spare node (issues 46, 52, 53)", "",
             f"Measured {data['when']} on this machine (2 cores; a 3-node namespace Slurm cluster, `-j 2x1 "
             "--spare-nodes 1`, and `-j 2x2` for a node of two ranks, gloo on CPU); "
             "`python -m benchmarks.bench_live_heal_slurm`. Times on one clock: the "
             "bench's signal and the run's ledgers.", "",
             "| heal | fault | drills | COMPLETED | detection s (median, max) | fault -> first step s (median, max) "
             "| replacement on | node1's rank kept | steps redone | replicas equal |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for fault in ("kill", "stop"):
        runs = [r for r in data["live"] if r["fault"] == fault]
        det, first = [r["detect_s"] for r in runs], [r["first_step_s"] for r in runs]
        lines.append(f"| live | {fault} | {len(runs)} | {sum(r['exit_code'] == 0 for r in runs)} | {_med(det)}, "
                     f"{max(det, default=0):.2f} | {_med(first)}, {max(first, default=0):.2f} | "
                     f"{sorted({str(r['replacement_host']) for r in runs})} | {sum(r['survivor_kept'] for r in runs)} "
                     f"| 0 (loaded: {sorted({str(r['loaded']) for r in runs})}) | "
                     f"{sum(r['replicas_equal'] for r in runs)} |")
    for fault in ("kill", "stop", "link"):
        runs = [r for r in data.get("node", []) if r["fault"] == fault]
        if not runs:
            continue
        det = [r["detect_s"] for r in runs]
        first = [r["first_step_s"] for r in runs if r["first_step_s"] is not None]
        one_gen = sum(r["generations"] == [1] and r["ranks"] == [2, 3] for r in runs)
        lines.append(f"| live, node of 2 (`-j 2x2`) | {fault} | {len(runs)} | {sum(r['exit_code'] == 0 for r in runs)} "
                     f"| {_med(det)}, {max(det, default=0):.2f} | {_med(first)}, {max(first, default=0):.2f} | "
                     f"{sorted({h for r in runs for h in r['replacement_hosts']})}, both in one generation: "
                     f"{one_gen} | {sum(r['survivors_kept'] for r in runs)} | 0 (loaded: "
                     f"{sorted({str(r['loaded']) for r in runs})}) | {sum(r['replicas_equal'] for r in runs)} |")
    for fault in ("kill", "stop"):
        runs = [r for r in data["restart"] if r["fault"] == fault]
        first = [r["first_step_s"] for r in runs if r["first_step_s"] is not None]
        when = f" (measured {data['restart_when']})" if data.get("restart_when") else ""
        lines.append(f"| restart{when} | {fault} | {len(runs)} | {sum(r['exit_code'] == 0 for r in runs)} | - | "
                     f"{_med(first)}, {max(first, default=0):.2f} | node1, node3 (every rank restarted) | 0 | "
                     f"{[r['redone'] for r in runs]} | - |")
    if data.get("link_when"):
        lines += ["", f"The link rows (node2's link cut) measured {data['link_when']}, the others as above."]
    clean = data.get("clean", [])
    if clean:
        lines += ["", f"Fault-free, `-j 2x2 --spare-nodes 1 --heal live` (`{' '.join(SHORT)}`): {len(clean)} runs, "
                  f"{sum(r['completed'] for r in clean)} COMPLETED in one attempt, "
                  f"{sum(r['replaced'] == 0 for r in clean)} with no replacement and no host excluded."]
    pairs = data.get("cost", [])
    ratios = [lv["step_ms_p50"] / rs["step_ms_p50"] for lv, rs in zip(pairs[0::2], pairs[1::2], strict=False)
              if lv.get("step_ms_p50") and rs.get("step_ms_p50")]
    if ratios:
        job = f" (`{data['cost_job']}`, measured {data['cost_when']})" if data.get("cost_job") else ""
        lines += ["", f"Fault-free cost, `-j 2x2`{job}: step p50 under `--heal live` over `--heal` (restart), "
                  f"{len(ratios)} alternating pairs: median {statistics.median(ratios):.3f} (min "
                  f"{min(ratios):.3f}, max {max(ratios):.3f})."]
    lines += ["", "Detection of a stop: the rank's pulse (`live/agent/pulse.py`, a process beside it on its node, "
              "reading its /proc every 0.25 s) says it is stopped, then 1 s more (STOPPED_S) before it is ended; a "
              "node frozen or cut off: the pulse standing still 3 s (SILENT_S), then 1 s more; a node cut off (link: "
              "its link down, each drill on a fresh cluster) counts as ended 1 s after its SIGKILL (UNREACHED_S) "
              "and its peers shut their connections to it 0.5 s after the plan (UNBLOCK_AFTER_S). The restart heal "
              "finds a stop by the watch's silent rank "
              "(`--silent-after 10`). Steps redone under restart: the last step of attempt 1's goodput windows "
              "less the snapshot attempt 2 resumed from; a window is written as the epoch goes, so a stop (rank 0 "
              "blocked mid-epoch, its window never written) reads 0: a lower bound there."]
    return "\n".join(lines) + "\n"


def main() -> None:
    path = RESULTS / "bench_live_heal_slurm.json"
    if "--render" in sys.argv:
        data = json.loads(path.read_text())
    elif os.environ.get("BENCH_SLURM_ONLY") == "cost":  # the cost pairs again, on the mlp; the other rows kept
        data = json.loads(path.read_text())
        data["cost"], data["cost_when"], data["cost_job"] = [], time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), \
            " ".join(COST)
        c = slurm_cluster.SlurmCluster(Path(tempfile.mkdtemp(prefix="ddpkit-bench-live-")), nodes_count=3)
        c.start(timeout=120)
        try:
            for _ in range(PAIRS):
                for heal in ("live", "restart"):
                    data["cost"].append(_plain(c, heal, COST))
                    print(json.dumps(data["cost"][-1]), flush=True)
                    path.write_text(json.dumps(data, indent=1))
        finally:
            c.stop()
    elif os.environ.get("BENCH_SLURM_ONLY") == "link":
        data = json.loads(path.read_text())
        data["node"] = [r for r in data.get("node", []) if r["fault"] != "link"] + _links()
        data["link_when"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        path.write_text(json.dumps(data, indent=1))
    else:
        c = slurm_cluster.SlurmCluster(Path(tempfile.mkdtemp(prefix="ddpkit-bench-live-")), nodes_count=3)
        c.start(timeout=120)
        try:
            before = json.loads(path.read_text()) if path.exists() else {}
            data = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "live": [], "restart": []}
            for fault in ("kill", "stop") * DRILLS:
                data["live"].append(_live(c, fault))
                print(json.dumps(data["live"][-1]), flush=True)
            data["node"] = []
            for fault in ("kill", "stop") * NODE_DRILLS:
                data["node"].append(_node(c, fault))
                print(json.dumps(data["node"][-1]), flush=True)
            data["clean"] = []
            for _ in range(CLEAN):
                data["clean"].append(_plain(c, "live"))
                print(json.dumps(data["clean"][-1]), flush=True)
            data["cost"] = []
            for _ in range(PAIRS):
                for heal in ("live", "restart"):
                    data["cost"].append(_plain(c, heal))
                    print(json.dumps(data["cost"][-1]), flush=True)
            for fault in ("kill", "stop") * RESTARTS:
                data["restart"].append(_restart(c, fault))
                print(json.dumps(data["restart"][-1]), flush=True)
        finally:
            c.stop()
        data["node"] += _links()
        if not data["restart"] and before.get("restart"):  # BENCH_SLURM_RESTARTS=0: the last run's restart rows
            data["restart"], data["restart_when"] = before["restart"], before.get("restart_when", before["when"])
        path.write_text(json.dumps(data, indent=1))
    text = render(data)
    (RESULTS / "bench_live_heal_slurm.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
