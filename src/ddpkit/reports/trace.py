"""A run as Chrome/Perfetto trace events (the JSON ``traceEvents`` format: chrome://tracing, ui.perfetto.dev).

One process per attempt (``pid`` = the attempt number, named "attempt N: exit C, cause"; ``pid`` 0: the
scheduler's queue wait, where it said), and in it: thread 0 the attempt and its phases (start-up, checkpoint load
and save, the failure or teardown tail), thread R + 1 rank R's steps (one complete event per ledger line of that
rank's steps, about one a second). Complete events
(``"ph": "X"``) with ``ts``/``dur`` in microseconds from the run's start; metadata events name the lanes.

The collectives, as counters (``"ph": "C"``, one track per rank in each attempt, a sample per ledger line where the
rank measured its gradient sync: ``goodput.straggler``): "gradient sync, rank R" with ``sync_ms`` (the mean time
per step from its last gradient bucket handed to the all-reduce to the all-reduce's end) and ``wait_ms`` (that
less the least of any rank over the same steps: the wait for a slower rank). Not in the trace: each single
all-reduce or bucket (ddpkit keeps per-second sums, never per-call events), collectives other than the gradients'
(the stop-flag vote, barriers, the watch's store traffic), and ``train``'s sync under DDP's own C++ all-reduce (a
model above ``PYTHON_HOOK_MAX_PARAMS``; a script under ``ddpkit run`` has DDP's own statistic, sampled)."""

from __future__ import annotations

from typing import Any

from ddpkit.goodput.accounting import Category
from ddpkit.goodput.straggler import mean_sync
from ddpkit.reports.run import RunView
from ddpkit.rundir.ledger import RankReplaced

__all__ = ["trace_events"]


def _complete(name: str, cat: str, start: float, end: float, t0: float, pid: int, tid: int,
              args: dict[str, Any] | None = None) -> dict[str, Any]:
    event: dict[str, Any] = {"name": name, "cat": cat, "ph": "X", "ts": round((start - t0) * 1e6, 1),
                             "dur": round(max(0.0, end - start) * 1e6, 1), "pid": pid, "tid": tid}
    if args:
        event["args"] = args
    return event


def _sync_counters(view: RunView, attempt: int, t0: float, pid: int) -> list[dict[str, Any]]:
    """Each rank's gradient sync per ledger line of ``attempt``, as counter samples at the line's start (and a zero
    at the attempt's last line's end, so the track does not run on into the next attempt's time)."""
    lines = {rank: [r for r in rows if r.attempt == attempt] for rank, rows in view.rank_steps.items()}
    events: list[dict[str, Any]] = []
    for rank, mine in lines.items():
        measured = [r for r in mine if r.sync_s is not None]
        for r in measured:
            least = min(m for m in (mean_sync(peer, r.first, r.last) for peer in lines.values()) if m is not None)
            per_step = (r.sync_s or 0.0) / r.count
            events.append({"name": f"gradient sync, rank {rank}", "ph": "C", "pid": pid,
                           "ts": round((r.start - t0) * 1e6, 1),
                           "args": {"sync_ms": round(per_step * 1e3, 4),
                                    "wait_ms": round(max(0.0, per_step - least) * 1e3, 4)}})
        if measured:
            events.append({"name": f"gradient sync, rank {rank}", "ph": "C", "pid": pid,
                           "ts": round((measured[-1].end - t0) * 1e6, 1), "args": {"sync_ms": 0, "wait_ms": 0}})
    return events


def trace_events(view: RunView) -> dict[str, Any]:
    split = view.split
    t0 = split.start
    events: list[dict[str, Any]] = []
    if split.queue is not None:  # process 0: the scheduler's queue, before the first attempt
        q = split.queue
        events += [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
                    "args": {"name": f"{q.scheduler} job {q.job_id}"}},
                   _complete("queue wait", "queue", split.start, split.start + split.seconds[Category.QUEUE_WAIT],
                             t0, 0, 0, {"submit": q.submit, "start": q.start})]
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
        heals = [r for r in view.ledger if isinstance(r, RankReplaced) and r.attempt == a.attempt]
        events += [_complete("live heal (a rank replaced; no step lost)", "phase", h.lost_at,
                             h.first_step_at or h.joined_at or h.lost_at, t0, pid, 0,
                             {"rank": h.rank, "host": h.host, "why": h.why, "step": h.step, "source": h.source,
                              "replacement_host": h.replacement_host or h.host, "together": list(h.together)})
                   for h in heals]
        tail = max([r.end for r in a.steps] + [r.end for r in a.saves] + [head_end])
        tail_name = "hang until detection, teardown" if a.seconds[Category.FAILURE] > 0 else "teardown"
        events.append(_complete(tail_name, "phase", min(tail, a.end), a.end, t0, pid, 0))
        for rank, lines in view.rank_steps.items():
            for r in (r for r in lines if r.attempt == a.attempt):
                again = a.again(r.first, r.last)
                kind = "steps" if again == 0 else "lost-progress" if again else "steps (done again: not known)"
                events.append(_complete(f"steps {r.first}-{r.last}", kind, r.start,
                                        r.end, t0, pid, rank + 1, {"rank": rank, "steps": r.count,
                                                                   "busy_s": round(r.busy_s, 6),
                                                                   "p50_ms": round(r.p50_ms, 3),
                                                                   "done_again": again,
                                                                   "sync_s": r.sync_s}))
        events += _sync_counters(view, a.attempt, t0, pid)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"run_dir": str(view.run_dir), "goodput": round(split.goodput, 6),
                          "goodput_is": ("not known (no rank recorded its steps)" if not split.measured
                                         else "exact" if split.lost_known
                                         else "an upper bound (steps done again not known)"),
                          "live_heals": split.live_heals,
                          "lost_steps": split.lost_steps, "wall_s": round(split.wall_s, 6)}}

