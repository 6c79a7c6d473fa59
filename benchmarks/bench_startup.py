"""Whole commands, timed from outside: the reference job end to end against the seeds' script, start-up and exit.

    python -m benchmarks.bench_startup        # writes benchmarks/results/bench_startup.{json,md}

(a) end to end: ``ddpkit train -n 2 --epochs 50 --save-every 10 --snapshot-path DIR/snap.pt`` against the seeds'
    ``ddp.py`` as the seeds run it (``torchrun --standalone --nproc-per-node 2 seed_ddp.py 50 10``; the benchmark's
    faithful copy, benchmarks/seed_ddp.py): >= 1.5x wanted;
(b) fixed cost: ``ddpkit train -n 2`` with one step (``--epochs 1 --samples 64``, no snapshot) against
    ``ddpkit check -n 2``: within 1.1x wanted;
(c) exit: seconds from a command's last output line to its return, <= 0.3 s wanted.

Each comparison runs alternating pairs (the order swaps every pair, so drift in the machine's load falls on both
sides), one whole process per run; ratios are per pair, medians reported, with the 1-minute load average at the
start and the end. train's own ``--json`` phases (startup_s, teardown_s, phases_s) are recorded beside the timings.
"""

from __future__ import annotations

import json
import os
import platform
import selectors
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
REPEATS = int(os.environ.get("BENCH_REPEATS", "7"))
PHASES = ("launch", "build_job", "process_group", "resume_and_wrap", "first_step", "training", "teardown")


def clean_env() -> dict[str, str]:
    """The benchmark's own environment: no launcher variables leaking in, no thread cap, unbuffered."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                                                     "TORCHELASTIC", "DDPKIT_", "SLURM_"))}
    env.pop("OMP_NUM_THREADS", None)
    env.update(PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT))
    return env


def timed(cmd: list[str], timeout: float = 600) -> dict[str, float]:
    """Run ``cmd``; seconds from its start to its first and last output line (stdout or stderr) and to its exit."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env(), cwd=ROOT)
    assert proc.stdout is not None and proc.stderr is not None
    sel = selectors.DefaultSelector()
    for stream in (proc.stdout, proc.stderr):
        sel.register(stream, selectors.EVENT_READ)
    first = last = None
    tails: dict[int, bytes] = {}
    open_streams = 2
    while open_streams:
        if time.monotonic() - t0 > timeout:
            proc.kill()
            raise RuntimeError(f"{' '.join(cmd)} ran past {timeout} s")
        for key, _ in sel.select(timeout=1.0):
            data = os.read(key.fd, 65536)
            now = time.monotonic() - t0
            if not data:
                sel.unregister(key.fileobj)
                open_streams -= 1
                continue
            tails[key.fd] = (tails.get(key.fd, b"") + data)[-3000:]
            if b"\n" in data:
                first = now if first is None else first
                last = now
    code = proc.wait()
    end = time.monotonic() - t0
    if code != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({code}):\n" + b"".join(tails.values()).decode(errors="replace"))
    if last is None or first is None:
        raise RuntimeError(f"{' '.join(cmd)} printed nothing")
    return {"wall_s": end, "first_line_s": first, "last_line_s": last, "exit_after_last_line_s": end - last}


def _seed(tmp: Path) -> dict[str, float]:
    return timed([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                  str(ROOT / "benchmarks" / "seed_ddp.py"), "50", "10", "--snapshot_path", str(tmp / "seed.pt")])


def _train(tmp: Path, *args: str, snapshots: bool) -> dict[str, Any]:
    run = tmp / f"train-{time.monotonic_ns()}"
    run.mkdir()  # a fresh snapshot directory: the run trains from the start, never "already complete"
    out = run / "summary.json"
    snapshot = ["--snapshot-path", str(run / "snap.pt")] if snapshots else []
    result: dict[str, Any] = timed([sys.executable, "-m", "ddpkit", "train", "-n", "2", *args, *snapshot,
                                    "--json", str(out)])
    summary = json.loads(out.read_text())
    result["train"] = {k: summary.get(k) for k in ("startup_s", "teardown_s", "phases_s", "wall_s")}
    return result


def _check() -> dict[str, Any]:
    return timed([sys.executable, "-m", "ddpkit", "check", "-n", "2"])


def pairs(a: Any, b: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """REPEATS runs of each, alternating, the order swapped every pair."""
    runs_a, runs_b = [], []
    for i in range(REPEATS):
        if i % 2 == 0:
            runs_a.append(a())
            runs_b.append(b())
        else:
            runs_b.append(b())
            runs_a.append(a())
    return runs_a, runs_b


def _median(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def _train_phases(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"startup_s": statistics.median(r["train"]["startup_s"] for r in runs),
            "teardown_s": statistics.median(r["train"]["teardown_s"] for r in runs),
            "phases_s": {p: statistics.median(r["train"]["phases_s"][p] or 0.0 for r in runs) for p in PHASES}}


def bench_end_to_end(tmp: Path) -> dict[str, Any]:
    seed, ours = pairs(lambda: _seed(tmp),
                       lambda: _train(tmp, "--epochs", "50", "--save-every", "10", snapshots=True))
    ratios = [s["wall_s"] / o["wall_s"] for s, o in zip(seed, ours, strict=True)]
    return {"ratio": statistics.median(ratios), "ratios": ratios, "target": ">= 1.5",
            "ddpkit_wall_s": _median(ours, "wall_s"), "seed_wall_s": _median(seed, "wall_s"),
            "ddpkit_exit_after_last_line_s": _median(ours, "exit_after_last_line_s"),
            "seed_exit_after_last_line_s": _median(seed, "exit_after_last_line_s"),
            "ddpkit_first_line_s": _median(ours, "first_line_s"), "seed_first_line_s": _median(seed, "first_line_s"),
            "ddpkit_phases": _train_phases(ours), "runs": {"seed": seed, "ddpkit": ours}}


def bench_fixed_cost(tmp: Path) -> dict[str, Any]:
    ours, check = pairs(lambda: _train(tmp, "--epochs", "1", "--samples", "64", snapshots=False), _check)
    ratios = [o["wall_s"] / c["wall_s"] for o, c in zip(ours, check, strict=True)]
    return {"ratio": statistics.median(ratios), "ratios": ratios, "target": "<= 1.1",
            "train_wall_s": _median(ours, "wall_s"), "check_wall_s": _median(check, "wall_s"),
            "train_exit_after_last_line_s": _median(ours, "exit_after_last_line_s"),
            "check_exit_after_last_line_s": _median(check, "exit_after_last_line_s"),
            "train_first_line_s": _median(ours, "first_line_s"), "check_first_line_s": _median(check, "first_line_s"),
            "train_phases": _train_phases(ours), "runs": {"train": ours, "check": check}}


def main() -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {}

    def load() -> float:
        return round(os.getloadavg()[0], 2)

    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as name:
        tmp = Path(name)
        for part, bench in (("end_to_end", bench_end_to_end), ("fixed_cost", bench_fixed_cost)):
            at, before = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), load()
            result[part] = dict(bench(tmp), measured_at=at, load_average_at_start=before, load_average_at_end=load())
    import torch

    result.update(machine={"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
                  repeats=REPEATS, wall_s=time.time() - started)
    (RESULTS / "bench_startup.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "bench_startup.md").write_text(markdown(result))
    print(markdown(result))


def markdown(r: dict[str, Any]) -> str:
    a, b = r["end_to_end"], r["fixed_cost"]
    exits = [*(x["exit_after_last_line_s"] for x in a["runs"]["ddpkit"]),
             *(x["exit_after_last_line_s"] for x in b["runs"]["train"]),
             *(x["exit_after_last_line_s"] for x in b["runs"]["check"])]
    rows = [
        ("(a) train -n 2 --epochs 50 --save-every 10 vs the seeds' ddp.py under torchrun, end to end (s)",
         f"{a['ddpkit_wall_s']:.2f}", f"{a['seed_wall_s']:.2f}", f"{a['ratio']:.2f}x", ">= 1.5x"),
        ("(b) train -n 2, one step, vs check -n 2, end to end (s)", f"{b['train_wall_s']:.2f}",
         f"{b['check_wall_s']:.2f}", f"{b['ratio']:.2f}x", "<= 1.1x"),
        ("(c) last line -> return, train (a) / seeds' ddp.py (s)", f"{a['ddpkit_exit_after_last_line_s']:.2f}",
         f"{a['seed_exit_after_last_line_s']:.2f}", "", "<= 0.3 s"),
        ("(c) last line -> return, train one step (b) / check (s)", f"{b['train_exit_after_last_line_s']:.2f}",
         f"{b['check_exit_after_last_line_s']:.2f}", "", "<= 0.3 s"),
        ("first output line (a): train / seeds' ddp.py (s)", f"{a['ddpkit_first_line_s']:.2f}",
         f"{a['seed_first_line_s']:.2f}", "", ""),
        ("first output line (b): train / check (s)", f"{b['train_first_line_s']:.2f}",
         f"{b['check_first_line_s']:.2f}", "", ""),
    ]
    table = "\n".join("| " + " | ".join(row) + " |" for row in rows)
    phase_rows = "\n".join(f"| {p} | {a['ddpkit_phases']['phases_s'][p]:.3f} | "
                           f"{b['train_phases']['phases_s'][p]:.3f} |" for p in PHASES)

    startup_b = b["train_phases"]["startup_s"]

    def when(part: dict[str, Any]) -> str:
        return f"{part['measured_at']} (load {part['load_average_at_start']} -> {part['load_average_at_end']})"

    return f"""# bench_startup: whole commands, start-up and exit

{r['machine']['cpus']} cores, torch {r['machine']['torch']}, 2 gloo ranks, {r['repeats']} alternating pairs per
comparison (order swapped every pair), whole processes timed from outside, medians; ratios per pair.

| comparison | ddpkit | reference | ratio | target |
|---|---|---|---|---|
{table}

Where train's time goes, from its own `--json` (medians, s; `launch` is the agent's start to the rank's: Python,
torch, the preloaded torch._dynamo, rendezvous, fork):

| phase | (a) 50 epochs | (b) one step |
|---|---|---|
{phase_rows}
| startup_s (command start -> first step) | {a['ddpkit_phases']['startup_s']:.3f} | {startup_b:.3f} |

Per-pair ratios: (a) {', '.join(f'{x:.2f}' for x in a['ratios'])}; (b) {', '.join(f'{x:.2f}' for x in b['ratios'])}.
Last line -> return, every ddpkit run (s): {', '.join(f'{x:.2f}' for x in exits)}.
Measured (UTC, 1-minute load average at the start -> the end): (a) {when(a)}, (b) {when(b)}.
The machine is a shared 2-core VM: other sessions' tests ran during the measurement; single figures move by tens
of percent with the load, ratios of alternating pairs much less.
"""


if __name__ == "__main__":
    main()
