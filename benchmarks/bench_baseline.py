"""How reliable are `bench --baseline` verdicts? A host slowed by 30% must be named; an unchanged set must pass.

    sudo python -m benchmarks.bench_baseline            # writes benchmarks/results/bench_baseline.{json,md}
    BASELINE_RUNS=5 sudo python -m benchmarks.bench_baseline

Three namespace hosts x one rank (scripts/nshosts.py), every host's link shaped with tc tbf to 200 Mbit/s (the
"healthy fabric", so figures are the shaper's and not the shared CPU's). One baseline is saved; then
``BASELINE_RUNS`` runs (default 20) of the same bench against it with nothing changed, and as many with the third
host's link at 140 Mbit/s (30% slower), alternating. Each run: ``bench --pairs --ops all_reduce -b 1M -e 1M
--baseline FILE`` with the default tolerance (20%) and repeats (3, median). Targets: the slowed host named (and
only it) in >= 19 of 20; the unchanged set failed in <= 1 of 20. Needs root.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
RUNS = int(os.environ.get("BASELINE_RUNS", "20"))
RATE, SLOW_RATE, BURST = "200mbit", "140mbit", "64kb"
ARGS = ["bench", "--pairs", "--pairs-size", "1M", "--pairs-iters", "5", "--ops", "all_reduce", "-b", "1M", "-e",
        "1M", "--iters", "3", "-w", "1"]


def _run(hosts: Any, *extra: str) -> dict[str, Any]:
    from tests.infra.conftest import new_run_id

    out = Path(hosts.cluster.workdir) / f"bench-{new_run_id()}.json"
    argv = [*ARGS[:1], "-j", f"{len(hosts.hosts)}x1", "--rdzv-endpoint", hosts.endpoint(), "--run-id",
            new_run_id(), "--json", str(out), *ARGS[1:], *extra]
    start = time.perf_counter()
    runs = [hosts.ddpkit(h, *argv, OMP_NUM_THREADS="1") for h in hosts.hosts]
    for r in runs:
        r.proc.wait(timeout=600)
    seconds = time.perf_counter() - start
    if not out.exists():
        return {"exit": runs[0].proc.returncode, "bad_hosts": None, "error": runs[0].output()[-2000:],
                "seconds": seconds}
    report = json.loads(out.read_text())
    base = report.get("baseline") or {}
    return {"exit": runs[0].proc.returncode, "bad_hosts": [b["host"] for b in report["bad_hosts"]],
            "regressions": base.get("regressions", []), "seconds": seconds,
            "worst_pct": min((c["change_pct"] for c in base.get("compared", [])), default=None)}


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from scripts.nshosts import create
    from tests.infra.conftest import Hosts, new_run_id

    hosts = Hosts(create(3, new_run_id()))
    try:
        for h in hosts.hosts:
            hosts.cluster.shape(h, RATE, burst=BURST)
        base = Path(hosts.cluster.workdir) / "baseline.json"
        saved = _run(hosts, "--save-baseline", str(base))
        if saved["exit"] != 0 or not base.exists():
            raise SystemExit(f"the baseline run failed: {saved}")
        slow = hosts[2]
        unchanged: list[dict[str, Any]] = []
        slowed: list[dict[str, Any]] = []
        for i in range(RUNS):
            unchanged.append(_run(hosts, "--baseline", str(base)))
            hosts.cluster.shape(slow, SLOW_RATE, burst=BURST)
            slowed.append(_run(hosts, "--baseline", str(base)))
            hosts.cluster.shape(slow, RATE, burst=BURST)
            print(f"run {i + 1}/{RUNS}: unchanged exit {unchanged[-1]['exit']} {unchanged[-1]['bad_hosts']}; "
                  f"slowed exit {slowed[-1]['exit']} {slowed[-1]['bad_hosts']}", flush=True)
    finally:
        hosts.cluster.down()
    named = sum(r["bad_hosts"] == [slow.hostname] for r in slowed)
    false_fail = sum(r["exit"] != 0 for r in unchanged)
    result = {
        "measured": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "runs": RUNS,
        "python": platform.python_version(), "load_after": os.getloadavg(), "rate": RATE, "slow_rate": SLOW_RATE,
        "slowed_named": named, "unchanged_failed": false_fail,
        "pass": named >= RUNS - RUNS // 20 and false_fail <= max(1, RUNS // 20),
        "unchanged": unchanged, "slowed": slowed, "slow_host": slow.hostname,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_baseline.json").write_text(json.dumps(result, indent=2) + "\n")
    worst_unchanged = [r["worst_pct"] for r in unchanged if r.get("worst_pct") is not None]
    worst_slowed = [r["worst_pct"] for r in slowed if r.get("worst_pct") is not None]
    md = [
        "# Baseline verdicts: a host slowed by 30% against an unchanged set",
        "",
        f"3 namespace hosts x 1 rank, each link shaped to {RATE} with tc tbf; the slowed host at {SLOW_RATE}. "
        f"One baseline, then {RUNS} runs of each kind, alternating; `bench --pairs --ops all_reduce -b 1M -e 1M "
        f"--baseline FILE` (tolerance 20%, 3 repeats, median). Measured {result['measured']} on a shared 2-core "
        f"machine (load average at the end: {', '.join(f'{x:.1f}' for x in result['load_after'])}).",
        "",
        "| set | runs | verdict as expected | worst change per run (%) |",
        "|---|---|---|---|",
        f"| one host slowed by 30% | {RUNS} | {named} named exactly that host | "
        f"{', '.join(f'{x:+.0f}' for x in worst_slowed)} |",
        f"| unchanged | {RUNS} | {RUNS - false_fail} passed ({false_fail} failed) | "
        f"{', '.join(f'{x:+.0f}' for x in worst_unchanged)} |",
        "",
        f"Targets: slowed host named in >= {RUNS - RUNS // 20} of {RUNS}, unchanged set failed in <= "
        f"{max(1, RUNS // 20)}: **{'PASS' if result['pass'] else 'FAIL'}**.",
        "",
    ]
    (RESULTS / "bench_baseline.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
