"""Growth of `check`, `bench` and `train` with the world: 2 to 64 local ranks, 4 to 16 namespace hosts; and the
cost of `bench --pairs` in rounds, `--ring` and one pair at a time.

    sudo python -m benchmarks.bench_scale        # writes benchmarks/results/bench_scale.{json,md,png}
    SCALE_LOCAL=2,4,8 SCALE_HOSTS=4 sudo python -m benchmarks.bench_scale   # a smaller run
    sudo python -m benchmarks.bench_scale --parts pairs   # only bench --pairs; the other parts' figures are kept

For every world: wall time of the command as a user types it, each phase's time (check's JSON report: roll-call,
the roll-call's cost after the last rank arrived, init, collectives, DDP, report), and the CPU time of every
process it started (getrusage of the waited children) divided by the number of ranks. One run per point: the
machine has 2 cores shared with other engineers, so figures are noisy; ratios are taken within this one run.
Namespace hosts need root (skipped otherwise).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks import scale_pairs

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
LOCAL = [int(x) for x in os.environ.get("SCALE_LOCAL", "2,4,8,16,32,64").split(",") if x]
HOSTS = [int(x) for x in os.environ.get("SCALE_HOSTS", "4,8,16").split(",") if x]
BENCH_ARGS = ["bench", "--ops", "all_reduce,all_gather", "-b", "1K", "-e", "64K", "-f", "8", "-w", "1", "--iters", "5"]
TRAIN_ARGS = ["train", "--model", "toy", "--samples", "2048", "--batch-size", "32", "--epochs", "2", "--no-progress"]


def _env(**extra: str) -> dict[str, str]:
    sys.path.insert(0, str(ROOT))
    from tests.helpers import ddpkit_env

    return ddpkit_env(**extra)


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _run_local(args: list[str], timeout: float = 900) -> dict[str, Any]:
    cpu, t, start = _cpu(), time.perf_counter(), time.time()
    proc = subprocess.run([sys.executable, "-m", "ddpkit", *args], capture_output=True, text=True, env=_env(),
                          timeout=timeout, cwd=ROOT)
    wall = time.perf_counter() - t
    return {"wall_s": wall, "cpu_s": _cpu() - cpu, "exit": proc.returncode, "started": start, "ended": time.time(),
            "tail": (proc.stdout + proc.stderr)[-1500:] if proc.returncode else ""}


def _check_phases(path: Path, run: dict[str, Any] | None = None) -> dict[str, float]:
    report = json.loads(path.read_text())
    timings = report.get("timings", {})
    clock = report.get("clock") or {}
    wall: dict[str, float] = {}
    if run and clock.get("first_check_in"):  # the command's wall time split at the ranks' arrivals and the report
        wall = {"launch": clock["first_check_in"] - run["started"],
                "arrivals": clock["last_check_in"] - clock["first_check_in"],
                "after-last": clock["report_done"] - clock["last_check_in"],
                "teardown": run["ended"] - clock["report_done"]}
    ops = ("barrier", "all_reduce_sum", "all_reduce_max", "broadcast", "reduce", "all_gather", "reduce_scatter",
           "all_to_all", "send_recv_ring")
    return {"roll-call": timings.get("roll-call", 0.0),
            "roll-call-after-last": timings.get("roll-call-after-last", 0.0),
            "init": timings.get("init", 0.0), "collectives": sum(timings.get(o, 0.0) for o in ops),
            "ddp": timings.get("ddp", 0.0), "report": timings.get("report", 0.0), "check_s": report["seconds"],
            **{f"wall:{k}": v for k, v in wall.items()}}


def local_scaling(tmp: Path) -> list[dict[str, Any]]:
    rows = []
    for n in LOCAL:
        for name, args in (("check", ["check"]), ("bench", BENCH_ARGS), ("train", TRAIN_ARGS)):
            extra = ["--json", str(tmp / f"{name}-{n}.json")]
            res = _run_local([*args, "-n", str(n), *extra])
            row = {"where": "local", "ranks": n, "hosts": 1, "command": name, **res, "cpu_per_rank_s": res["cpu_s"] / n}
            if name == "check" and res["exit"] == 0:
                row["phases"] = _check_phases(tmp / f"check-{n}.json", res)
            rows.append(row)
            print(f"local {n:>3} ranks {name:<6} {res['wall_s']:7.1f} s wall, {row['cpu_per_rank_s']:5.2f} s CPU/rank,"
                  f" exit {res['exit']}", flush=True)
    return rows


def _on_hosts(cluster: Any, args: list[str], timeout: float = 900, **env: str) -> dict[str, Any]:
    """``ddpkit ARGS`` on every host at once; wall time until the last exits; CPU of everything they started."""
    argv = [sys.executable, "-m", "ddpkit", *args]
    cpu, t = _cpu(), time.perf_counter()
    procs = [cluster.popen(h, argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_env(OMP_NUM_THREADS="1",
                                                                                                  **env))
             for h in cluster.hosts]
    outs = [p.communicate(timeout=timeout)[0].decode(errors="replace") for p in procs]
    wall = time.perf_counter() - t
    codes = [p.returncode for p in procs]
    return {"wall_s": wall, "cpu_s": _cpu() - cpu, "exit": max(codes), "stdout": outs[0],
            "tail": "" if max(codes) in (0, 1) else outs[0][-1500:]}


def host_scaling(tmp: Path) -> list[dict[str, Any]]:
    from scripts.nshosts import create

    rows = []
    for h in HOSTS:
        cluster = create(h, "scale" + uuid.uuid4().hex[:6])
        try:
            for name, args in (("check", ["check"]), ("bench", BENCH_ARGS), ("train", TRAIN_ARGS)):
                out = tmp / f"{name}-h{h}.json"
                rdzv = ["-j", f"{h}x1", "--rdzv-endpoint", f"{cluster.hosts[0].ip}:29400",
                        "--run-id", uuid.uuid4().hex[:8], "--json", str(out)]
                res = _on_hosts(cluster, [*args, *rdzv])
                res.pop("stdout")
                row = {"where": "namespace hosts", "ranks": h, "hosts": h, "command": name, **res,
                       "cpu_per_rank_s": res["cpu_s"] / h}
                if name == "check" and res["exit"] == 0:
                    row["phases"] = _check_phases(out)
                rows.append(row)
                print(f"hosts {h:>3} x1 {name:<6} {res['wall_s']:7.1f} s wall, {row['cpu_per_rank_s']:5.2f} s "
                      f"CPU/rank, exit {res['exit']}", flush=True)
        finally:
            cluster.down()
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def summary(rows: list[dict[str, Any]], pairs: list[dict[str, Any]]) -> dict[str, Any]:
    def find(where: str, n: int, command: str) -> dict[str, Any]:
        return next((r for r in rows if r["where"] == where and r["ranks"] == n and r["command"] == command), {})

    c8, c64 = find("local", 8, "check"), find("local", 64, "check")
    out: dict[str, Any] = {}
    if c8 and c64:
        out["check_wall_64_over_8"] = _ratio(c64["wall_s"], c8["wall_s"])
        out["check_wall_target"] = "<= 8 (the ratio of ranks)"
        out["rollcall_after_last_64_s"] = c64.get("phases", {}).get("roll-call-after-last")
    out.update(scale_pairs.summary(pairs))
    return out


PHASES = ("roll-call-after-last", "init", "collectives", "ddp", "report", "wall:launch", "wall:arrivals",
          "wall:teardown")


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares t = a + b * n."""
    n = len(points)
    mx, my = sum(p[0] for p in points) / n, sum(p[1] for p in points) / n
    sxx = sum((p[0] - mx) ** 2 for p in points)
    b = sum((p[0] - mx) * (p[1] - my) for p in points) / sxx if sxx else 0.0
    return my - b * mx, b


def projection(rows: list[dict[str, Any]], pairs: list[dict[str, Any]], at: tuple[int, ...] = (256, 1024)
               ) -> dict[str, Any]:
    """Per-phase fits a + b*N over the local check runs from 8 ranks up, and the pairs schedules' per-round and
    per-pair costs, extended to ``at`` endpoints. On 2 cores every phase also grows with N because N processes
    share the cores: these are upper bounds for a cluster where every rank has its own CPU."""
    out: dict[str, Any] = {"check": {}, "pairs": {}}
    local = [r for r in rows if r["where"] == "local" and r["command"] == "check" and "phases" in r and r["ranks"] >= 8]
    if len(local) >= 2:
        for phase in PHASES:
            if not all(phase in r["phases"] for r in local):
                continue
            a, b = _fit([(r["ranks"], r["phases"][phase]) for r in local])
            out["check"][phase] = {"a_s": a, "b_s_per_rank": b, **{str(n): max(a + b * n, 0.0) for n in at}}
    setting = "link" if any(p.get("setting") == "link" for p in pairs) else "cpu"

    def row(hosts: int, mode: str, limited: bool) -> dict[str, Any] | None:
        return next((p for p in pairs if p["hosts"] == hosts and p["mode"] == mode and bool(p["limited"]) == limited
                     and p.get("setting", "cpu") == setting and p["rounds"] and p["measure_s"]), None)

    def per_round(mode: str, limited: bool) -> float | None:
        r = row(8, mode, limited)
        return r["measure_s"] / r["rounds"] if r else None

    # 8 hosts: a healthy round, a healthy pair alone, a round with the slow node in it, a pair with the slow node in
    # it measured one at a time without a budget (the old schedule: it moves all its transfers over the slow link)
    r_h, p_h = per_round("--pairs", False), per_round("--pairs --pairs-sequential", False)
    r_s, p_s = per_round("--pairs", True), per_round("--pairs --pairs-sequential", True)
    old = row(8, "--pairs --pairs-sequential --pairs-seconds 60", True)
    ring = next((p for p in pairs if p["mode"] == "--ring" and p["limited"] and p.get("setting", "cpu") == setting
                 and p["measure_s"]), None)
    if r_h and p_h and r_s and p_s:
        slow_pairs = 8 - 1  # the slow node's pairs among 8 hosts
        slow_pair = (old["measure_s"] - (old["rounds"] - slow_pairs) * p_h) / slow_pairs if old else None
        out["pairs"] = {"setting": setting, "round_s": r_h, "pair_s": p_h, "slow_round_s": r_s,
                        "slow_pair_unbudgeted_s": slow_pair, "ring_s": ring["measure_s"] if ring else None,
                        "ring_rounds": ring["rounds"] if ring else None, **{str(n): {
                            "rounds_s": (n - 1) * r_h, "sequential_s": n * (n - 1) / 2 * p_h,
                            "rounds_slow_s": (n - 1) * r_s, "sequential_slow_s": n * (n - 1) / 2 * p_s,
                            "sequential_slow_unbudgeted_s": (n * (n - 1) / 2 - (n - 1)) * p_h + (n - 1) * slow_pair
                            if slow_pair else None,
                            "ring_slow_s": ring["measure_s"] if ring else None} for n in at}}
    return out


def _when(result: dict[str, Any]) -> str:
    parts = result.get("when_parts") or {}
    if len(set(parts.values())) < 2:
        return str(result["when"])
    return "; ".join(f"{part} part {when}" for part, when in sorted(parts.items()))


def write_markdown(result: dict[str, Any]) -> str:
    lines = ["# ddpkit at scale: 2 to 64 local ranks, 4 to 16 namespace hosts", "",
             f"{result['cores']} cores, torch {result['torch']}, Python {result['python']}; one run per point, "
             f"measured {_when(result)} on a **shared, noisy machine** (other engineers ran tests at the same time; "
             f"load average at the end {', '.join(f'{x:.1f}' for x in result['load_avg'])}). 64 ranks on 2 cores are "
             "32 processes per core: wall time there is process start and CPU contention, not ddpkit's algorithms.",
             "Wall time of a local check split by the ranks' wall-clock arrivals: launch (command start to the first "
             "rank's check-in: agent start, imports, fork), arrivals (first to last check-in), after-last (last "
             "check-in to rank 0's report: every check), teardown (report to the command's exit).",
             "", "| where | ranks | command | wall (s) | CPU per rank (s) | roll-call (s) | after last rank (s) | "
             "init (s) | collectives (s) | DDP (s) | report (s) | launch (s) | arrivals (s) | after-last (s) | "
             "teardown (s) | exit |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ph = r.get("phases", {})
        cell = [f"{ph[k]:.2f}" if k in ph else "" for k in ("roll-call", "roll-call-after-last", "init", "collectives",
                                                            "ddp", "report", "wall:launch", "wall:arrivals",
                                                            "wall:after-last", "wall:teardown")]
        lines.append(f"| {r['where']} | {r['ranks']} | {r['command']} | {r['wall_s']:.1f} | {r['cpu_per_rank_s']:.2f} "
                     f"| {' | '.join(cell)} | {r['exit']} |")
    lines += scale_pairs.markdown(result["pairs"], result.get("link_check", []))
    s = result["summary"]
    lines += ["", "## Ratios (this run)", ""]
    for key, value in s.items():
        lines.append(f"- {key}: {value:.2f}" if isinstance(value, float) else f"- {key}: {value}")
    proj = result.get("projection", {})
    if proj.get("check"):
        lines += ["", "## Projection (fits a + b*N over the local runs from 8 ranks; upper bounds, see docs/scale.md)",
                  "", "| check phase | a (s) | b (ms per rank) | at 256 (s) | at 1,024 (s) |", "|---|---|---|---|---|"]
        for phase, f in proj["check"].items():
            lines.append(f"| {phase} | {f['a_s']:.3f} | {f['b_s_per_rank'] * 1e3:.2f} | {f['256']:.2f} | "
                         f"{f['1024']:.2f} |")
    if proj.get("pairs"):
        pp = proj["pairs"]
        slow_pair = pp.get("slow_pair_unbudgeted_s")
        lines += ["", f"bench --pairs ({pp['setting']} setting, 8 hosts): {pp['round_s']:.2f} s per healthy round, "
                  f"{pp['pair_s']:.2f} s per healthy pair alone, {pp['slow_round_s']:.2f} s per round with the slow "
                  "node in it (within its budget)" + (f", {slow_pair:.2f} s per slow pair without a budget" if
                                                        slow_pair else "")
                  + (f"; --ring at 16 hosts {pp['ring_s']:.2f} s ({pp['ring_rounds']} rounds), the same at any N "
                     "with one slow node" if pp.get("ring_s") else ""), "",
                  "| endpoints | rounds, healthy (s) | sequential, healthy (s) | rounds, 1 slow node (s) | "
                  "sequential, 1 slow node (s) | sequential without a budget, 1 slow node (s) | --ring, 1 slow node "
                  "(s) |", "|---|---|---|---|---|---|---|"]
        for n in ("256", "1024"):
            q = pp[n]
            cells = [f"{q[k]:.0f}" if q.get(k) is not None else "-" for k in
                     ("rounds_s", "sequential_s", "rounds_slow_s", "sequential_slow_s", "sequential_slow_unbudgeted_s")]
            ring_cell = f"{q['ring_slow_s']:.1f}" if q.get("ring_slow_s") is not None else "-"
            lines.append(f"| {n} | {' | '.join(cells)} | {ring_cell} |")
    lines += ["", "![growth](bench_scale.png)", ""]
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (wall, cpu) = plt.subplots(1, 2, figsize=(11, 4.2))
    for where, style in (("local", "-o"), ("namespace hosts", "--s")):
        for command in ("check", "bench", "train"):
            pts = [(r["ranks"], r["wall_s"], r["cpu_per_rank_s"]) for r in result["rows"]
                   if r["where"] == where and r["command"] == command and r["exit"] in (0, 1)]
            if pts:
                xs = [p[0] for p in pts]
                wall.plot(xs, [p[1] for p in pts], style, label=f"{command} ({where})")
                cpu.plot(xs, [p[2] for p in pts], style, label=f"{command} ({where})")
    local = [r for r in result["rows"] if r["where"] == "local" and r["command"] == "check"]
    if local:
        base = local[0]
        xs = [r["ranks"] for r in local]
        wall.plot(xs, [base["wall_s"] * x / base["ranks"] for x in xs], ":", color="grey", label="linear in ranks")
    for ax, title in ((wall, "wall time (s)"), (cpu, "CPU time per rank (s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("ranks")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    wall.legend(fontsize=7)
    fig.suptitle("ddpkit on 2 shared cores: growth with the world")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    import argparse

    import torch

    ap = argparse.ArgumentParser(prog="bench_scale")
    ap.add_argument("--parts", default="local,pairs,hosts",
                    help="comma-separated parts to run (local, pairs, hosts); the others' figures are kept from the "
                         "previous results file")
    parts = set(ap.parse_args(argv).parts.split(","))
    previous: dict[str, Any] = {}
    if parts != {"local", "pairs", "hosts"} and (RESULTS / "bench_scale.json").exists():
        previous = json.loads((RESULTS / "bench_scale.json").read_text())
    keep = {"local": "local", "hosts": "namespace hosts"}
    rows: list[dict[str, Any]] = [r for r in previous.get("rows", []) if r["where"] in
                                  {keep[p] for p in keep if p not in parts}]
    pairs: list[dict[str, Any]] = [] if "pairs" in parts else previous.get("pairs", [])
    link_check: list[dict[str, Any]] = [] if "pairs" in parts else previous.get("link_check", [])
    when = {p: previous.get("when_parts", {}).get(p, previous.get("when")) for p in keep | {"pairs": ""}
            if p not in parts and previous}

    def save() -> dict[str, Any]:  # after every part: a long run cut short still leaves its figures
        now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        result = {"rows": rows, "pairs": pairs, "link_check": link_check, "torch": torch.__version__,
                  "python": platform.python_version(), "cores": len(os.sched_getaffinity(0)),
                  "load_avg": os.getloadavg(), "when": now, "when_parts": {**{p: now for p in parts}, **when}}
        result["summary"] = summary(rows, pairs)
        result["projection"] = projection(rows, pairs)
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "bench_scale.json").write_text(json.dumps(result, indent=1) + "\n")
        (RESULTS / "bench_scale.md").write_text(write_markdown(result))
        plot(result, RESULTS / "bench_scale.png")
        return result

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if "local" in parts:
            rows += local_scaling(tmp)
            save()
        if os.geteuid() == 0 and HOSTS:
            if "pairs" in parts:
                found, check = scale_pairs.pairs_costs(tmp, HOSTS, _on_hosts)
                pairs += found
                link_check += check
                save()
            if "hosts" in parts:
                rows += host_scaling(tmp)
        else:
            print("bench_scale: namespace hosts skipped (need root and SCALE_HOSTS)")
    print(json.dumps(save()["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
