"""From every rank's step timings to words (pure: no torch, no store, no processes): the straggler the others wait
for, named while the job runs, and the exit summary. A record is what ``Recorder.record`` published; its
``timings`` are one step in ``recorder.SAMPLE_EVERY``'s (``records.Timings``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from ddpkit.launcher_output.words import rank_list
from ddpkit.watch.records import Heartbeat

__all__ = ["straggler", "summary_lines"]

#: Fewer steps than this on any rank: no straggler verdict (too little to compare).
MIN_STEPS = 5


def _timed(timings: Mapping[str, Any]) -> int:
    """How many steps a rank's timings measured (one in 10 of its ``steps``; older records: ``steps``)."""
    return int(timings.get("timed", timings.get("steps", 0)))


def straggler(records: Mapping[int, Heartbeat], share: float) -> tuple[str, dict[str, Any]] | None:
    """The rank (or host) the others wait for, when they wait more than ``share`` of a step for it.

    In synchronous DDP the slow rank arrives last at each gradient all-reduce, so it waits least there: the others'
    extra time in gradient sync, beyond the least-waiting rank's, is time spent waiting for it."""
    timings = {r: rec["timings"] for r, rec in records.items()}
    if len(timings) < 2 or any(min(_timed(t), t.get("sync_samples", _timed(t))) < MIN_STEPS
                               for t in timings.values()):
        return None
    step = sorted(t["step_mean"] for t in timings.values())[len(timings) // 2]
    if step <= 0:
        return None
    slow = min(timings, key=lambda r: timings[r]["sync_mean"])
    extra = {r: (t["sync_mean"] - timings[slow]["sync_mean"]) / step for r, t in timings.items()}
    host = records[slow]["host"]
    on_host = [r for r in records if records[r]["host"] == host]
    others = [r for r in records if records[r]["host"] != host]
    if len(on_host) > 1 and others:
        waiting_share = sum(extra[r] for r in others) / len(others)
        # the host is the slow one when its own ranks wait little for one another next to what the other hosts
        # wait for them (two ranks sharing a busy CPU are never quite in step: one waits a few % for the other)
        if waiting_share > share and all(extra[r] < max(share / 2, waiting_share / 3) for r in on_host):
            return (f"ddpkit watch: host {host} ({rank_list(on_host, sentence=True)}) is the slowest: the ranks on "
                    f"other hosts wait {waiting_share:.0%} of each step for it",
                    {"event": "straggler", "host": host, "ranks": on_host, "wait_share": round(waiting_share, 4)})
    rest = [r for r in records if r != slow]
    waiting_share = sum(extra[r] for r in rest) / len(rest)
    if waiting_share <= share:
        return None
    return (f"ddpkit watch: rank {slow} on {host} is the slowest: the others wait {waiting_share:.0%} of each "
            "step for it",
            {"event": "straggler", "rank": slow, "host": host, "wait_share": round(waiting_share, 4)})


def summary_lines(records: Mapping[int, Heartbeat]) -> tuple[list[str], dict[str, Any]]:
    """Per rank and per host: steps, step time p50/p99 (ms), the longest step after the first with its number, and
    the share of a step spent in gradient sync (``n/a`` where no gradient sync was sampled). The percentiles come
    from one step in ten (``recorder.SAMPLE_EVERY``) and a p99 passes over a single stall; the longest is every
    step's. A host's p50 is the median of its ranks' p50s, its p99 and longest the largest of its ranks', its wait the
    mean of its sampled ranks'."""
    rows = {r: rec["timings"] for r, rec in sorted(records.items()) if _timed(rec["timings"]) > 0}
    if not rows:
        return [], {}
    lines = ["ddpkit watch: summary (step = one DDP forward to the next; wait = time in gradient sync; longest = the "
             "longest step after the first)",
             f"  {'rank':>4}  {'host':<16} {'steps':>6} {'p50 ms':>9} {'p99 ms':>9} {'longest':>22} {'wait':>6}"]
    event: dict[str, Any] = {"event": "summary", "ranks": {}, "hosts": {}}
    hosts: dict[str, list[int]] = defaultdict(list)
    for r, t in rows.items():
        host = records[r]["host"]
        hosts[host].append(r)
        sampled = t.get("sync_samples", 1) > 0 and t["step_mean"] > 0
        wait = round(t["sync_mean"] / t["step_mean"], 4) if sampled else None
        lines.append(f"  {r:>4}  {host:<16} {t['steps']:>6} {t['step_p50'] * 1e3:>9.2f} {t['step_p99'] * 1e3:>9.2f} "
                     f"{_longest(t):>22} {_share(wait):>6}")
        event["ranks"][str(r)] = {"host": host, "steps": t["steps"], "step_p50_s": t["step_p50"],
                                  "step_p99_s": t["step_p99"], "step_max_s": t.get("step_max"),
                                  "step_max_at": t.get("step_max_at"), "wait_share": wait}
    for host, ranks in sorted(hosts.items()):
        p50 = sorted(rows[r]["step_p50"] for r in ranks)[len(ranks) // 2]
        p99 = max(rows[r]["step_p99"] for r in ranks)
        slowest = max(ranks, key=lambda r: rows[r].get("step_max", 0.0))
        shares = [event["ranks"][str(r)]["wait_share"] for r in ranks]
        shares = [w for w in shares if w is not None]
        wait = round(sum(shares) / len(shares), 4) if shares else None
        longest = f", longest {_longest(rows[slowest], rank=slowest)}" if "step_max" in rows[slowest] else ""
        lines.append(f"  host {host}: {rank_list(ranks, sentence=True)}, step p50 {p50 * 1e3:.2f} ms, "
                     f"p99 {p99 * 1e3:.2f} ms{longest}, wait {_share(wait)}")
        event["hosts"][host] = {"ranks": ranks, "step_p50_s": p50, "step_p99_s": p99,
                                "step_max_s": rows[slowest].get("step_max"), "wait_share": wait}
    return lines, event


def _longest(timings: Mapping[str, Any], rank: int | None = None) -> str:
    """``75.2 s (step 21)``, ``31.40 ms (step 7, rank 1)``; ``n/a`` before a second step ended."""
    if "step_max" not in timings:
        return "n/a"
    seconds = float(timings["step_max"])
    took = f"{seconds:.1f} s" if seconds >= 1 else f"{seconds * 1e3:.2f} ms"
    return f"{took} (step {timings['step_max_at']}{'' if rank is None else f', rank {rank}'})"


def _share(wait: float | None) -> str:
    """A share of a step (``12.5%``), or ``n/a`` where none was measured (no gradient sync sampled)."""
    return "n/a" if wait is None else f"{wait:.1%}"
