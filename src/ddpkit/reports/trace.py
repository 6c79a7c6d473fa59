"""A run as Chrome/Perfetto trace events (the JSON ``traceEvents`` format: chrome://tracing, ui.perfetto.dev).

One process per attempt (``pid`` = the attempt number, named "attempt N: exit C, cause"), and in it: thread 0 the
attempt and its phases (start-up, checkpoint load and save, the failure or teardown tail), thread R + 1 rank R's
steps (one complete event per ledger line of that rank's steps, about one a second). Complete events
(``"ph": "X"``) with ``ts``/``dur`` in microseconds from the run's start; metadata events name the lanes."""

from __future__ import annotations

from typing import Any

from ddpkit.goodput.accounting import Category
from ddpkit.reports.run import RunView

__all__ = ["trace_events"]


def _complete(name: str, cat: str, start: float, end: float, t0: float, pid: int, tid: int,
              args: dict[str, Any] | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {"name": name, "cat": cat, "ph": "X", "ts": round((start - t0) * 1e6, 1),
                             "dur": round(max(0.0, end - start) * 1e6, 1), "pid": pid, "tid": tid}
    if args:
        event["args"] = args
    return event


def trace_events(view: RunView) -> dict[str, Any]:
    split = view.split
    t0 = split.start
    events: list[dict[str, Any]] = []
    furthest = 0
    for a in split.attempts:
        pid = a.attempt
        label = f"attempt {a.attempt}: exit {a.exit_code}" + (f", {a.cause}" if a.cause else "")
        events += [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": label}},
                   {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": pid}},
                   {"name": "thread_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": "attempt and phases"}}]
        events += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": rank + 1, "args": {"name": f"rank {rank}"}}
                   for rank in view.rank_steps]
        events.append(_complete(f"attempt {a.attempt}", "attempt", a.start, a.end, t0, pid, 0,
                                {"exit_code": a.exit_code, "class": a.failure_class, "cause": a.cause,
                                 **{c.value: round(s, 6) for c, s in a.seconds.items()}}))
        head_end = a.first_step_at if a.first_step_at is not None else a.start + sum(
            a.seconds[c] for c in (Category.STARTUP, Category.CHECKPOINT_LOAD, Category.UNMEASURED))
        events.append(_complete("unmeasured" if a.seconds[Category.UNMEASURED] else "start-up", "phase", a.start,
                                head_end, t0, pid, 0))
        events += [_complete("checkpoint load", "phase", r.start, r.end, t0, pid, 0, {"step": r.step})
                   for r in a.loads]
        events += [_complete(f"checkpoint save (step {r.step})", "phase", r.start, r.end, t0, pid, 0,
                             {"step": r.step}) for r in a.saves]
        tail = max([r.end for r in a.steps] + [r.end for r in a.saves] + [head_end])
        tail_name = "hang until detection, teardown" if a.seconds[Category.FAILURE] > 0 else "teardown"
        events.append(_complete(tail_name, "phase", min(tail, a.end), a.end, t0, pid, 0))
        for rank, lines in view.rank_steps.items():
            for r in (r for r in lines if r.attempt == a.attempt):
                again = max(0, min(r.last, furthest) - r.first + 1)
                events.append(_complete(f"steps {r.first}-{r.last}", "lost-progress" if again else "steps", r.start,
                                        r.end, t0, pid, rank + 1, {"rank": rank, "steps": r.count,
                                                                   "busy_s": round(r.busy_s, 6),
                                                                   "p50_ms": round(r.p50_ms, 3),
                                                                   "done_again": again}))
        if a.last_step is not None:
            furthest = max(furthest, a.last_step)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"run_dir": str(view.run_dir), "goodput": round(split.goodput, 6),
                          "wall_s": round(split.wall_s, 6)}}
