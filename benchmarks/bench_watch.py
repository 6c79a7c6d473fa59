"""The watch (``ddpkit.watch``): its cost on the step, whether it names injected faults, and how small a straggler
it names. Writes benchmarks/results/bench_watch.{json,md}.

    python -m benchmarks.bench_watch                 # all parts (about 15 minutes on 2 shared cores)
    python -m benchmarks.bench_watch --parts overhead

(a) overhead: ddpkit train's reference job (``--model linear``) and ``--model mlp`` on gloo under torchrun, and the
    reference job with the MPI transport under mpirun; watched and unwatched blocks alternate in the same two
    processes (benchmarks/watch_interleaved.py), ratio = watched / unwatched median epoch per round, median of the
    rounds reported (target <= 1.01);
(b) attribution: each fault of tests/multiproc/watch_user_job.py injected under torchrun (2 and 4 ranks) and mpirun
    (2 ranks), --hang-after 4: whether the report names the right rank (and, for a desync, the extra call), and the
    seconds from the fault to the report (the events file's time minus the time the faulty rank printed);
(c) straggler sensitivity: rank 1 sleeps MS in every forward of a ~25 ms step, --report-every 2; the smallest MS
    named (as rank 1), and clean runs with nothing named;
(d) longrun (``--parts longrun``, not in the default set: 5 minutes): the issue's no-false-alarm run at full length.
(e) pairs: the added time per step with watched and unwatched steps alternating one by one in one process
    (benchmarks/watch_step_pairs.py), resolved to about a microsecond.
(f) p2p (``--parts p2p``, not in the default set: about 5 minutes, more with ``--p2p-before REV``): the same
    for a two-stage pipeline whose step makes 4 point-to-point calls per rank (benchmarks/watch_p2p_pairs.py,
    torchrun, 2 ranks), each run followed by one of a no-op wrapper (the floor of any Python code in front of the
    calls); ``--p2p-before REV`` runs REV's watch too, alternating job by job with this one.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers import ddpkit_env  # noqa: E402
from tests.watch_jobs import mpirun, run_watched, torchrun  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
HANG_AFTER = 4.0


def overhead(rounds: int) -> list[dict[str, Any]]:
    cases = [("reference job (linear), gloo", torchrun(2), ["--model", "linear", "--epochs", "40"]),
             ("--model mlp, gloo", torchrun(2), ["--model", "mlp", "--epochs", "4", "--samples", "1024"])]
    if shutil.which("mpirun"):
        cases.append(("reference job (linear), MPI transport", mpirun(2), ["--model", "linear", "--epochs", "30",
                                                                            "--transport", "mpi"]))
    out = []
    for name, launcher, extra in cases:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "r.json"
            cmd = [*launcher, str(ROOT / "benchmarks" / "watch_interleaved.py"), "--rounds", str(rounds),
                   "--json", str(path), *extra]
            done = subprocess.run(cmd, capture_output=True, text=True, env=ddpkit_env(PYTHONPATH=str(ROOT)),
                                  timeout=1800, cwd=ROOT)
            if done.returncode != 0:
                raise RuntimeError(f"{name}: {done.stderr[-3000:]}")
            data = json.loads(path.read_text())
        ratio = statistics.median(data["ratios"])
        low, high = _median_ci(data["ratios"])
        out.append({"case": name, "transport": data["transport"], "rounds": rounds, "median_ratio_ci95": [low, high],
                    "median_epoch_plain_s": statistics.median(data["median_epoch_s"]["plain"]),
                    "median_epoch_watched_s": statistics.median(data["median_epoch_s"]["watched"]),
                    "ratios": data["ratios"], "median_ratio": ratio, "within_1pct": ratio <= 1.01,
                    "watch_threads_cpu_share": data.get("watch_threads_cpu_share")})
        print(f"overhead {name}: watched/unwatched {ratio:.4f} over {rounds} rounds", flush=True)
    return out


def _median_ci(values: list[float], resamples: int = 4000) -> tuple[float, float]:
    """A 95% percentile-bootstrap interval of the median (fixed seed: the same data give the same interval)."""
    import random

    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def added_cost() -> dict[str, Any]:
    """Microseconds the watch adds to one DDP step (benchmarks/watch_cost.py: one process, no communication)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.json"
        done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "watch_cost.py"), "--json", str(path)],
                              capture_output=True, text=True, env=ddpkit_env(PYTHONPATH=str(ROOT)), timeout=900,
                              cwd=ROOT)
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-3000:])
        data = json.loads(path.read_text())
    for label, figure in data["added"].items():
        print(f"added cost {label}: {figure['median_us']:.1f} us per step", flush=True)
    return data


def step_pairs(processes: int = 6, pairs: int = 10000) -> dict[str, Any]:
    """Microseconds the watch adds to one step, watched and unwatched models alternating step by step
    (benchmarks/watch_step_pairs.py), in ``processes`` processes per model: one process's mean is precise to about
    a microsecond, but processes differ from each other by more (2.6 us apart in two runs of the same code: where
    each model's memory lies), so the figure is the mean of the processes' means, its 95% interval from their
    spread (Student's t)."""
    out: dict[str, Any] = {"processes": processes, "pairs": pairs}
    for model in ("ours", "hookless"):
        runs = []
        for _ in range(processes):
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "p.json"
                done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "watch_step_pairs.py"), "--model",
                                       model, "--pairs", str(pairs), "--json", str(path)], capture_output=True,
                                      text=True, env=ddpkit_env(PYTHONPATH=str(ROOT)), timeout=1200, cwd=ROOT)
                if done.returncode != 0:
                    raise RuntimeError(done.stderr[-3000:])
                print(done.stdout, end="", flush=True)
                runs.append(json.loads(path.read_text()))
        out.setdefault("counted", {})[model] = all(r["counted"][model] for r in runs)
        out.setdefault("unwatched_step_cpu_us", {})[model] = statistics.median(
            r["unwatched_step_cpu_us"][model] for r in runs)
        out.setdefault("added", {})[model] = {kind: _pooled([r["added"][model][kind]["mean_us"] for r in runs])
                                              for kind in ("cpu", "wall")}
        out["params"] = runs[0]["params"]
    return out


def _p2p_run(pairs: int, *extra: str, tree: Path = ROOT) -> dict[str, Any]:
    """One torchrun job of benchmarks/watch_p2p_pairs.py, with ``tree``'s watch and script (a checkout of an
    earlier revision: ``_p2p_tree``)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "p.json"
        path_env = str(ROOT) if tree == ROOT else f"{tree / 'src'}:{tree}"  # that tree's ddpkit first
        done = subprocess.run([*torchrun(2), str(tree / "benchmarks" / "watch_p2p_pairs.py"), "--pairs", str(pairs),
                               "--json", str(path), *extra], capture_output=True, text=True,
                              env=ddpkit_env(PYTHONPATH=path_env), timeout=900, cwd=ROOT)
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-3000:])
        print(done.stdout, end="", flush=True)
        return dict(json.loads(path.read_text()))


def _p2p_tree(revision: str, into: Path) -> Path:
    """``revision``'s ``src`` and benchmark script, unpacked into ``into``."""
    archive = subprocess.run(["git", "archive", revision, "src", "benchmarks/watch_p2p_pairs.py"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def _p2p_summary(data: list[dict[str, Any]]) -> dict[str, Any]:
    """Per rank, over runs: the mean of the runs' means with its 95% interval, and each run's added CPU as a
    share of that run's unwatched step (wall), with their min and median."""
    out: dict[str, Any] = {}
    for rank in (0, 1):
        per_run = [d["ranks"][rank] for d in data]
        shares = [r["added"]["cpu"]["mean_us"] / r["unwatched_step_us"]["wall"] for r in per_run]
        out[str(rank)] = {
            "watched_p2p_calls": [r["watched_p2p_calls"] for r in per_run],
            "unwatched_step_us": {k: statistics.median(r["unwatched_step_us"][k] for r in per_run)
                                  for k in ("wall", "cpu")},
            "runs_step_wall_us": [r["unwatched_step_us"]["wall"] for r in per_run],
            "added": {k: _pooled([r["added"][k]["mean_us"] for r in per_run]) for k in ("cpu", "wall")},
            "share_of_step": {"runs": shares, "min": min(shares), "median": statistics.median(shares)}}
    return out


def p2p_pairs(runs: int = 5, pairs: int = 2000, spin_us: float = 2.0, before: str | None = None) -> dict[str, Any]:
    """Microseconds the watch adds to a step of point-to-point calls (benchmarks/watch_p2p_pairs.py), in ``runs``
    torchrun jobs of 2 ranks: per rank, the mean of the runs' means with its 95% interval from their spread, and
    each run's share of its own step. With ``before`` (a git revision), that revision's watch runs too, a job of
    it before each job of this one, so both are measured on the same machine at the same time. Then one control
    run: ``spin_us`` of busy Python before each call instead of the watch (what a known delay reads as, the peer's
    longer wait included)."""
    data, earlier, floor = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        tree = _p2p_tree(before, Path(tmp)) if before else None
        for _ in range(runs):
            if tree is not None:
                earlier.append(_p2p_run(pairs, tree=tree))
            data.append(_p2p_run(pairs))
            floor.append(_p2p_run(pairs, "--spin-us", "0"))
    control = _p2p_run(pairs, "--spin-us", str(spin_us))
    out: dict[str, Any] = {"runs": runs, "pairs": pairs, "p2p_calls_per_step": data[0]["p2p_calls_per_step"],
                           "activation_bytes": data[0]["activation_bytes"], "ranks": _p2p_summary(data),
                           "floor": {"ranks": _p2p_summary(floor)},
                           "control": {"spin_us": spin_us, "added_cpu_us": {
                               str(r["rank"]): r["added"]["cpu"] for r in control["ranks"]}}}
    if earlier:
        out["before"] = {"revision": before, "ranks": _p2p_summary(earlier)}
    return out


#: Student's t, 97.5% quantile, by degrees of freedom (2-9)
_T975 = {2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def _pooled(means: list[float]) -> dict[str, Any]:
    """The mean of per-process means, with its 95% interval from their spread."""
    mean = statistics.fmean(means)
    half = _T975[len(means) - 1] * statistics.stdev(means) / len(means) ** 0.5
    return {"mean_us": mean, "ci95_us": [mean - half, mean + half], "process_means_us": means}


def _named(run: Any, fault: str, n: int) -> tuple[bool, float | None]:
    """(named correctly, seconds from the fault to the report)."""
    fault_at = next((float(x.split()[2]) for x in run.proc.stdout.splitlines() if x.startswith("FAULT ")), None)
    if fault == "kill":
        line = "rank 1 on host" in run.output and ("is gone" in run.output or "exited on signal 9" in run.output)
        failed = [e for e in run.events if e["event"] == "collective-failed"]
        delay = failed[0]["time"] - fault_at if failed and fault_at else None
        return line, delay
    hangs = [e for e in run.events if e["event"] == "hang"]
    if len(hangs) != 1 or fault_at is None:
        return False, None
    hang = hangs[0]
    live = [r for r in range(n) if not (fault == "stop" and r == 1)]
    ok = sorted(int(r) for r in hang.get("stacks", {})) == live
    if fault == "sleep":
        ok = ok and hang["behind"] == [1] and hang["stopped"] == []
    elif fault == "stop":
        ok = ok and hang["behind"] == [1] and hang["stopped"] == [1]
    else:
        desync = hang.get("desync") or {}
        ok = ok and [c["ranks"] for c in desync.get("calls", []) if c["op"] == "broadcast"] == [[1]]
    return ok, hang["time"] - fault_at


def attribution() -> list[dict[str, Any]]:
    rows = []
    launchers = [("torchrun", 2, torchrun(2)), ("torchrun", 4, torchrun(4))]
    if shutil.which("mpirun"):
        launchers.append(("mpirun", 2, mpirun(2)))
    for name, n, launcher in launchers:
        for fault in ("sleep", "stop", "kill", "extra"):
            with tempfile.TemporaryDirectory() as tmp:
                run = run_watched(launcher, Path(tmp), "--hook", "--fault", fault, "--steps", "400",
                                  watch=("--hang-after", str(HANG_AFTER)))
            ok, delay = _named(run, fault, n)
            rows.append({"launcher": name, "ranks": n, "fault": fault, "named": ok,
                         "fault_to_report_s": None if delay is None else round(delay, 2),
                         "exit": run.proc.returncode})
            print(f"attribution {name} -n {n} {fault}: named={ok} delay={delay}", flush=True)
    return rows


def sensitivity(slow_ms: list[float], clean_runs: int) -> dict[str, Any]:
    def run(*extra: str) -> list[dict[str, Any]]:
        with tempfile.TemporaryDirectory() as tmp:
            done = run_watched(torchrun(2), Path(tmp), "--steps", "250", *extra, watch=("--report-every", "2"))
        if done.proc.returncode != 0:
            raise RuntimeError(done.output[-3000:])
        return [e for e in done.events if e["event"] in ("straggler", "summary")]

    points = []
    for ms in slow_ms:
        events = run("--slow-rank", "1", "--slow-ms", str(ms))
        named = [e for e in events if e["event"] == "straggler"]
        summary = next(e for e in events if e["event"] == "summary")
        step = statistics.median(r["step_p50_s"] for r in summary["ranks"].values())
        points.append({"slow_ms": ms, "step_p50_ms": round(step * 1e3, 2), "reports": len(named),
                       "named_rank_1": bool(named) and all(e.get("rank") == 1 for e in named),
                       "wrong_names": sum(e.get("rank") != 1 for e in named)})
        print(f"sensitivity {ms} ms: {points[-1]}", flush=True)
    clean = []
    for _ in range(clean_runs):
        clean.append(len([e for e in run() if e["event"] == "straggler"]))
    smallest = next((p["slow_ms"] for p in points if p["named_rank_1"]), None)
    return {"points": points, "clean_runs": clean_runs, "false_reports_in_clean_runs": sum(clean),
            "smallest_named_ms": smallest}


def long_clean_run() -> dict[str, Any]:
    """The issue's no-false-alarm run at full length: a ~5-minute job under torchrun (2 ranks), an unmarked 20 s
    first step, and rank 0 'writing a checkpoint' for 120 s inside ddpkit.watch.phase while rank 1 waits in a
    barrier, with --hang-after 30 (the checkpoint is 4x the deadline): no hang may be reported."""
    with tempfile.TemporaryDirectory() as tmp:
        started = time.monotonic()
        run = run_watched(torchrun(2), Path(tmp), "--steps", "5000", "--step-s", "0.02", "--first-step-s", "20",
                          "--checkpoint-at", "2500", "--checkpoint-s", "120",
                          watch=("--hang-after", "30", "--report-every", "60"), timeout=900)
        seconds = time.monotonic() - started
    hangs = [e for e in run.events if e["event"] == "hang"]
    out = {"seconds": round(seconds, 1), "exit": run.proc.returncode, "hang_reports": len(hangs),
           "events": sorted({e["event"] for e in run.events})}
    print(f"long clean run: {out}", flush=True)
    return out


def write(result: dict[str, Any]) -> None:
    RESULTS.mkdir(exist_ok=True)
    old = json.loads((RESULTS / "bench_watch.json").read_text()) if (RESULTS / "bench_watch.json").exists() else {}
    result = {**old, **result} if set(result) - {"machine", "torch", "when", "parts_when"} else {**result, **old}
    result["parts_when"] = {**old.get("parts_when", {}), **result.get("parts_when", {})}
    (RESULTS / "bench_watch.json").write_text(json.dumps(result, indent=1) + "\n")
    md = ["# bench_watch: the watch's cost, attribution and straggler sensitivity", "",
          f"Machine: {result['machine']}; torch {result['torch']}; {result['when']}. "
          "Produced by `python -m benchmarks.bench_watch` (method in its docstring).", ""]
    if len(set(result["parts_when"].values())) > 1:  # parts merged from separate runs: say which ran when
        runs: dict[str, list[str]] = {}
        for part, when in sorted(result["parts_when"].items()):
            runs.setdefault(when, []).append(part)
        md += ["Parts from separate runs: " + "; ".join(f"{', '.join(p)} at {w}" for w, p in sorted(runs.items()))
               + ".", ""]
    if "overhead" in result:
        md += ["## Cost on the step (watched / unwatched, same processes, alternating blocks)", "",
               "| job | transport | rounds | unwatched epoch | watched epoch | median ratio | 95% interval | "
               "ratios p25-p75 | within 1% |", "|---|---|---|---|---|---|---|---|---|"]
        for o in result["overhead"]:
            q = statistics.quantiles(o["ratios"], n=4)
            ci = o.get("median_ratio_ci95") or _median_ci(o["ratios"])
            verdict = "yes" if ci[1] <= 1.01 else ("not shown (interval too wide)" if ci[0] <= 1.01 else "NO")
            md.append(f"| {o['case']} | {o['transport']} | {o['rounds']} | {o['median_epoch_plain_s'] * 1e3:.1f} ms | "
                      f"{o['median_epoch_watched_s'] * 1e3:.1f} ms | {o['median_ratio']:.4f} | "
                      f"{ci[0]:.3f}-{ci[1]:.3f} | {q[0]:.3f}-{q[2]:.3f} | {verdict} |")
        md += ["", "Within 1% means the 95% bootstrap interval of the median ratio lies at or below 1.01. The rounds' "
               "ratios spread with the machine's other load (the p25-p75 column); the section below measures the "
               "watch's added time per step where communication adds no noise.", ""]
        threads = [o for o in result["overhead"] if o.get("watch_threads_cpu_share")]
        if threads:
            md += ["The watch's own threads (`ddpkit-watch*`: heartbeat, store reads, diagnosis), their CPU time per "
                   "second of a watched block, by rank: the median block and the largest. With a core to spare this "
                   "costs the step nothing; where the ranks fill every core it is what they lose at most.", "",
                   "| job | " + " | ".join(f"rank {r}: median, max" for r in
                                            range(len(threads[0]["watch_threads_cpu_share"]))) + " |",
                   "|---|" + "---|" * len(threads[0]["watch_threads_cpu_share"])]
            for o in threads:
                cells = [f"{statistics.median(s) * 100:.3f}%, {max(s) * 100:.3f}% of a core"
                         for s in o["watch_threads_cpu_share"]]
                md.append(f"| {o['case']} | " + " | ".join(cells) + " |")
            md.append("")
    if "cost" in result:
        c = result["cost"]
        added = c["added"]
        md += ["## Added time per step, without communication noise (benchmarks/watch_cost.py)", "",
               f"One process, a gloo group of one, a {c['params']}-parameter model; {c['blocks']} alternating blocks "
               f"of {c['steps_per_block']} steps per model. CPU = the main thread's CPU time per step (the load of the "
               "machine does not count), wall = elapsed; median of the block pairs, [p25, p75].", "",
               "| what | unwatched step (CPU) | added CPU per step | added wall per step |", "|---|---|---|---|"]
        rows = (("hookless model: watched (counted, C++ path) - unwatched", "counted - cpp", "cpp"),
                ("model with its own Python hook (pending Future): watched (wrapped) - unwatched", "wrapped - hook",
                 "hook"),
                ("hook whose Future is done on return (the MPI transport's shape): watched - unwatched",
                 "done-wrapped - done", "done"),
                ("ddpkit's own hook (train, check): watched (unwrapped, counted) - unwatched", "ours-counted - ours",
                 "ours"),
                ("torch's Python allreduce_hook itself - DDP's C++ path (no watch)", "hook - cpp", "cpp"))
        for text, label, base in rows:
            if f"{label} cpu" not in added:
                continue
            cpu, wall = added[f"{label} cpu"], added[f"{label} wall"]
            md.append(f"| {text} | {c['step_us'][base]['cpu']:.0f} us | **{cpu['median_us']:.1f} us** "
                      f"[{cpu['p25_us']:.1f}, {cpu['p75_us']:.1f}] | {wall['median_us']:.1f} us "
                      f"[{wall['p25_us']:.1f}, {wall['p75_us']:.1f}] |")
        md.append("")
        # which path each overhead job takes: train's own hook on the small reference job (gloo-gather or MPI:
        # unwrapped and counted, whatever its transport), DDP's C++ path for --model mlp (above
        # PYTHON_HOOK_MAX_PARAMS)
        paths = {"reference job (linear), gloo": (32, "ours-counted - ours", "train's hook, counted"),
                 "--model mlp, gloo": (16, "counted - cpp", "no hook, counted"),
                 "reference job (linear), MPI transport": (32, "ours-counted - ours", "train's MPI hook, counted")}
        for o in result.get("overhead", []):
            if o["case"] in paths:
                steps, label, path = paths[o["case"]]
                if f"{label} cpu" not in added:
                    continue
                step_us = o["median_epoch_plain_s"] / steps * 1e6
                md.append(f"- {o['case']} ({path}): a 2-rank step is about {step_us:.0f} us, so the added CPU is "
                          f"{added[f'{label} cpu']['median_us'] / step_us:.2%} of it.")
        md.append("")
    if "step_pairs" in result:
        sp = result["step_pairs"]
        md += ["## Added time per step, watched and unwatched steps alternating (benchmarks/watch_step_pairs.py)", "",
               f"One process under one installed watch, a gloo group of one, a {sp['params']}-parameter model; "
               f"{sp['pairs']} pairs of steps, the watched and the unwatched model alternating step by step (the "
               f"unwatched one runs torch's own forward and hook); {sp['processes']} processes per model. Mean of "
               "the processes' mean per-step differences, 95% interval from their spread (Student's t), and the "
               "processes' means.",
               "", "| model | unwatched step (CPU) | added CPU per step | processes' means | added wall per step |",
               "|---|---|---|---|---|"]
        names = {"ours": "ddpkit's own hook (train, check): counted", "hookless": "no hook (DDP's C++ path): counted"}
        for name, d in sp["added"].items():
            cpu, wall = d["cpu"], d["wall"]
            spread = ", ".join(f"{m:.1f}" for m in cpu["process_means_us"])
            md.append(f"| {names.get(name, name)} | {sp['unwatched_step_cpu_us'][name]:.0f} us | "
                      f"**{cpu['mean_us']:.2f} us** [{cpu['ci95_us'][0]:.2f}, {cpu['ci95_us'][1]:.2f}] | "
                      f"{spread} | {wall['mean_us']:.2f} us [{wall['ci95_us'][0]:.2f}, {wall['ci95_us'][1]:.2f}] |")
        md.append("")
        steps = {"reference job (linear), gloo": (32, "ours"), "--model mlp, gloo": (16, "hookless"),
                 "reference job (linear), MPI transport": (32, "ours")}
        for o in result.get("overhead", []):
            if o["case"] in steps:
                per_epoch, name = steps[o["case"]]
                step_us = o["median_epoch_plain_s"] / per_epoch * 1e6
                high = sp["added"][name]["cpu"]["ci95_us"][1]
                md.append(f"- {o['case']}: a 2-rank step is about {step_us:.0f} us; the added CPU's upper 95% bound "
                          f"is {high / step_us:.2%} of it ({'within' if high / step_us <= 0.01 else 'above'} 1%).")
        md.append("")
    if "p2p_pairs" in result:
        pp = result["p2p_pairs"]
        md += ["## Added time per step of point-to-point calls (benchmarks/watch_p2p_pairs.py)", "",
               f"torchrun, 2 ranks on gloo: a two-stage pipeline, {pp['p2p_calls_per_step']} point-to-point calls "
               f"per rank and step (send, recv, isend and irecv with wait; {pp['activation_bytes']} B each); "
               f"{pp['pairs']} pairs of steps, watched and unwatched alternating step by step; {pp['runs']} runs. "
               "Mean of the runs' mean per-step differences, 95% interval from their spread (Student's t), its "
               "upper end against the runs' median step; each run's added CPU as a share of that run's own "
               "unwatched step (wall), min and median over the runs (the machine's load moves the step). The "
               "CPU is the rank's main thread's, waits included: a rank slowed by its watch also keeps its peer "
               "waiting longer, so the figure bounds the watch's own work from above.", ""]
        versions = [("this revision", pp["ranks"])]
        if "floor" in pp:
            versions.append(("no-op wrapper (control)", pp["floor"]["ranks"]))
            md += ["Each run of the watch is followed by a run of a control, the floor of any Python code in front "
                   "of these calls: instead of the watch, a function that reads the clock twice and calls torch's "
                   "(the shape of the watch's wrapper without its work).", ""]
        if "before" in pp:
            versions.insert(0, (f"before ({pp['before']['revision']})", pp["before"]["ranks"]))
            md += [f"Each run of this revision's watch came right after a run of {pp['before']['revision']}'s "
                   "(same machine, same minutes), so the two are compared within one benchmark run.", ""]
        md += ["| watch | rank | unwatched step (wall; CPU) | added CPU per step | runs' means | added wall per step | "
               "upper bound / step wall | added CPU / step wall, min; median of runs |",
               "|---|---|---|---|---|---|---|---|"]
        for label, ranks in versions:
            for rank, d in ranks.items():
                cpu, wall, step = d["added"]["cpu"], d["added"]["wall"], d["unwatched_step_us"]
                spread = ", ".join(f"{m:.1f}" for m in cpu["process_means_us"])
                share = d.get("share_of_step") or {"min": cpu["mean_us"] / step["wall"],
                                                   "median": cpu["mean_us"] / step["wall"]}
                md.append(f"| {label} | {rank} | {step['wall']:.0f} us; {step['cpu']:.0f} us | "
                          f"**{cpu['mean_us']:.2f} us** [{cpu['ci95_us'][0]:.2f}, {cpu['ci95_us'][1]:.2f}] | "
                          f"{spread} | {wall['mean_us']:.2f} us [{wall['ci95_us'][0]:.2f}, {wall['ci95_us'][1]:.2f}] "
                          f"| {cpu['ci95_us'][1] / step['wall']:.2%} | {share['min']:.2%}; **{share['median']:.2%}** |")
        if "control" in pp:
            c = pp["control"]
            spent = c["spin_us"] * pp["p2p_calls_per_step"]
            read = "; ".join(f"rank {r}: {a['mean_us']:.1f} us [{a['ci95_us'][0]:.1f}, {a['ci95_us'][1]:.1f}]"
                             for r, a in c["added_cpu_us"].items())
            md += ["", f"Control (one run): {c['spin_us']:g} us of busy Python before each call instead of the watch, "
                   f"{spent:g} us a step spent, read as {read} added CPU a step."]
        md.append("")
    if "attribution" in result:
        rows = result["attribution"]
        md += ["## Attribution (--hang-after 4)", "",
               f"Named correctly: {sum(r['named'] for r in rows)} / {len(rows)} injected.", "",
               "| launcher | ranks | fault | named | fault -> report | exit |", "|---|---|---|---|---|---|"]
        for r in rows:
            delay = "-" if r["fault_to_report_s"] is None else f"{r['fault_to_report_s']:.1f} s"
            md.append(f"| {r['launcher']} | {r['ranks']} | {r['fault']} | {'yes' if r['named'] else 'NO'} | {delay} | "
                      f"{r['exit']} |")
        md.append("")
    if "longrun" in result:
        lr = result["longrun"]
        md += ["## A long clean run (the issue's durations)", "",
               f"torchrun, 2 ranks, --hang-after 30: an unmarked 20 s first step, then rank 0 in a marked 120 s "
               f"'checkpoint' while rank 1 waits in a barrier; {lr['seconds']:.0f} s in all: exit {lr['exit']}, "
               f"{lr['hang_reports']} hang reports (events: {', '.join(lr['events']) or 'none'}).", ""]
    if "sensitivity" in result:
        s = result["sensitivity"]
        md += ["## Straggler sensitivity (rank 1 slowed in every forward; --report-every 2)", "",
               f"Smallest slowdown named: {s['smallest_named_ms']} ms; false reports in {s['clean_runs']} clean runs: "
               f"{s['false_reports_in_clean_runs']}.", "",
               "| slowdown | step p50 | reports | all name rank 1 |", "|---|---|---|---|"]
        for p in s["points"]:
            md.append(f"| {p['slow_ms']:g} ms | {p['step_p50_ms']:.1f} ms | {p['reports']} | "
                      f"{'yes' if p['named_rank_1'] else 'no'} |")
        md.append("")
    (RESULTS / "bench_watch.md").write_text("\n".join(md))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default="cost,pairs,overhead,attribution,sensitivity")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--p2p-before", metavar="REV", default=None,
                        help="p2p: run REV's watch too, alternating with this one (e.g. a commit before a change)")
    parser.add_argument("--p2p-runs", type=int, default=5)
    args = parser.parse_args()
    import torch

    parts = args.parts.split(",")  # "none": rewrite the Markdown from the JSON
    result: dict[str, Any] = {"machine": f"{platform.node()} ({platform.machine()}, 2 shared cores)",
                              "torch": torch.__version__, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    # --parts name -> (key in the results, how it runs), in the order they run
    runners: dict[str, tuple[str, Callable[[], Any]]] = {
        "overhead": ("overhead", lambda: overhead(args.rounds)), "cost": ("cost", added_cost),
        "pairs": ("step_pairs", step_pairs), "attribution": ("attribution", attribution),
        "sensitivity": ("sensitivity", lambda: sensitivity([1, 2, 3, 5, 10], clean_runs=3)),
        "longrun": ("longrun", long_clean_run),
        "p2p": ("p2p_pairs", lambda: p2p_pairs(args.p2p_runs, before=args.p2p_before))}
    result["parts_when"] = {}
    for part, (key, run) in runners.items():
        if part in parts:
            result[key] = run()
            result["parts_when"][key] = result["when"]
    write(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
