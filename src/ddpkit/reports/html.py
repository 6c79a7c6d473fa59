"""One self-contained HTML page of a run: the headline figures, a timeline of attempts and their causes, the
goodput split, each rank's step time and the rolling goodput (inline SVG drawn by ``reports/svg.py``, so the
page needs no plotting library), the attempts and the hosts
at fault. No external script, stylesheet, font or image: the page opens from a mail attachment or an artifact
store as it does from disk. One inline script sets ``data-ddpkit-ready`` on ``<html>`` (the number of figures it
found) so a headless browser proves that the page loaded and ran."""

from __future__ import annotations

import html
from datetime import datetime, timezone
from typing import Any

from ddpkit import __version__
from ddpkit.goodput.accounting import Category, Split
from ddpkit.goodput.straggler import rank_waits
from ddpkit.reports.run import RunView
from ddpkit.reports.svg import Chart
from ddpkit.rundir.ledger import AttemptEnded, RankReplaced, ReplicasDiverged

__all__ = ["COLORS", "render_html"]

#: One colour per category, the same in every figure.
COLORS = {Category.QUEUE_WAIT: "#cfd8dc", Category.STARTUP: "#9e9e9e", Category.CHECKPOINT_LOAD: "#7e57c2",
          Category.TRAINING: "#2e7d32", Category.LOST_PROGRESS: "#ef6c00", Category.STRAGGLER_WAIT: "#ad1457",
          Category.CHECKPOINT_SAVE: "#1565c0", Category.LOOP_OTHER: "#b0bec5", Category.LIVE_HEAL: "#00897b",
          Category.FAILURE: "#c62828",
          Category.TEARDOWN: "#6d4c41", Category.RELAUNCH: "#f9a825", Category.UNMEASURED: "#e0e0e0"}

_STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.6em}table{border-collapse:collapse;margin:.5em 0}
td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}th{background:#f4f4f4}
.num{text-align:right}.figure svg{max-width:100%;height:auto}.bad{color:#c62828}.muted{color:#666}"""


def _timeline(split: Split) -> str:
    attempts = split.attempts
    t0, rows = split.start, len(attempts)
    chart = Chart(x_range=(0.0, split.wall_s * 1.01), y_range=(-0.6, rows - 0.1), plot_height=40 * rows,
                  x_label="seconds since the run started",
                  y_names={rows - 1 - row: f"attempt {a.attempt}" for row, a in enumerate(attempts)},
                  legend=[(COLORS[c], c.words) for c in Category])
    if split.queue is not None and split.seconds[Category.QUEUE_WAIT] > 0:  # drawn on the first attempt's row
        chart.bar(0.0, split.seconds[Category.QUEUE_WAIT], rows - 1.35, rows - 0.65, COLORS[Category.QUEUE_WAIT],
                  Category.QUEUE_WAIT.words)
    for row, a in enumerate(attempts):
        y = rows - 1 - row
        bars: list[tuple[float, float, Category]] = []
        head_end = a.first_step_at if a.first_step_at is not None else a.start + sum(
            a.seconds[c] for c in (Category.STARTUP, Category.CHECKPOINT_LOAD, Category.UNMEASURED))
        bars.append((a.start, head_end, Category.UNMEASURED if a.seconds[Category.UNMEASURED] else Category.STARTUP))
        bars += [(r.start, r.end, Category.CHECKPOINT_LOAD) for r in a.loads]
        for r, again in zip(a.steps, a.done_again, strict=True):  # not known: drawn as training (an upper bound)
            bars.append((r.start, r.end, Category.LOST_PROGRESS if again else Category.TRAINING))
        bars += [(r.start, r.end, Category.CHECKPOINT_SAVE) for r in a.saves]
        bars += [(lost, back, Category.LIVE_HEAL) for lost, back in a.heals]
        tail_from = max([r.end for r in a.steps] + [r.end for r in a.saves] + [head_end])
        tail = Category.FAILURE if a.seconds[Category.FAILURE] > 0 else Category.TEARDOWN
        bars.append((min(tail_from, a.end), a.end, tail))
        for start, end, category in bars:
            chart.bar(start - t0, start - t0 + max(end - start, split.wall_s / 2000), y - 0.35, y + 0.35,
                      COLORS[category], f"attempt {a.attempt}: {category.words} {end - start:.2f} s")
        label = f"exit {a.exit_code}" if a.exit_code is not None else "no end recorded"
        if a.cause:
            label += f": {a.cause}"
        late = a.end - t0 > split.wall_s / 2  # the words run leftwards from a late end, else rightwards from the start
        chart.text(a.end - t0 if late else a.start - t0, y + 0.42, label[:110], anchor="end" if late else "start",
                   size=10)
    return chart.svg()


def _split_bar(split: Split) -> str:
    chart = Chart(x_range=(0.0, max(split.wall_s, 1e-9)), y_range=(0.0, 1.0), plot_height=36,
                  x_label="seconds of wall clock", y_names={0: ""})
    left = 0.0
    for category in Category:
        seconds = split.seconds[category]
        if seconds <= 0:
            continue
        chart.bar(left, left + seconds, 0.15, 0.85, COLORS[category], f"{category.words} {seconds:.2f} s")
        chart.legend.append((COLORS[category], f"{category.words} {seconds:.1f} s"))
        left += seconds
    return chart.svg()


#: A colour per rank's line (ten, then again).
RANK_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
               "#17becf")


def _step_times(view: RunView) -> str | None:
    """Each rank's median step per ledger line, a line per rank and attempt (a gap between attempts)."""
    split = view.split
    if not any(view.rank_steps.values()):
        return None
    top = max(r.p50_ms for lines in view.rank_steps.values() for r in lines)
    chart = Chart(x_range=(0.0, split.wall_s * 1.01), y_range=(0.0, max(top * 1.1, 1e-3)), plot_height=180,
                  x_label="seconds since the run started", y_label="step p50 (ms)")
    for i, (rank, lines) in enumerate(sorted(view.rank_steps.items())):
        color = RANK_COLORS[i % len(RANK_COLORS)]
        chart.legend.append((color, f"rank {rank}"))
        for attempt in sorted({r.attempt for r in lines}):
            mine = [r for r in lines if r.attempt == attempt]
            chart.line([((r.start + r.end) / 2 - split.start, r.p50_ms) for r in mine], color,
                       f"rank {rank}, attempt {attempt}")
    return chart.svg()


def _rank_table(view: RunView) -> str:
    """Per rank: steps, median step, time in the gradient sync and the wait for a slower rank (goodput.straggler)."""
    waits = rank_waits(view.rank_steps)
    if not waits:
        return '<p class="muted">No rank recorded its steps.</p>'

    def share(value: float | None) -> str:
        return "not measured" if value is None else f"{100 * value:.1f}"

    rows = [[w.rank, w.steps, w.p50_ms, w.busy_s, share(w.sync_share), share(w.wait_share)] for w in waits]
    return _rows(["rank", "steps", "step p50 (ms)", "in steps (s)", "gradient sync (% of steps)",
                  "waiting for a slower rank (% of steps)"], rows)


def _live_heals(view: RunView) -> str:
    """Each rank replaced live (rank, host, why, the step and the rank its state came from, where its replacement
    ran, fault -> first step), and replicas found to differ, from the ledger."""
    heals = [r for r in view.ledger if isinstance(r, RankReplaced)]
    diverged = [r for r in view.ledger if isinstance(r, ReplicasDiverged)]
    if not heals and not diverged:
        return '<p class="muted">No rank was replaced live.</p>'
    rows = [[h.attempt, h.gen, h.rank, h.host, h.why, "" if h.step is None else h.step,
             "" if h.source is None else h.source, f"{h.replacement_host or h.host} (pid {h.replacement_pid})",
             ", ".join(map(str, h.together)) or h.rank,
             "" if h.first_step_at is None else f"{h.first_step_at - h.lost_at:.2f}"] for h in heals]
    table = _rows(["attempt", "generation", "rank", "host", "lost", "at step", "state from rank", "replacement",
                   "replaced together", "loss -> first step (s)"], rows) if heals else ""
    said = "".join(f"<p><strong>Replicas differ</strong> (attempt {d.attempt}, generation {d.gen}, step {d.step}, "
                   f"{html.escape(d.where)}): " + html.escape("; ".join(
                       f"rank {r} {digest[:12]}" for r, digest in enumerate(d.digests))) + "</p>" for d in diverged)
    return f"<p>{len(heals)} rank(s) replaced live.</p>{table}{said}"


def _rolling(split: Split) -> str | None:
    if not split.windows:
        return None
    chart = Chart(x_range=(0.0, max(split.wall_s, split.windows[-1][0] - split.start + split.window_s)),
                  y_range=(0.0, 100.0), plot_height=140, y_label="goodput %",
                  x_label=f"seconds since the run started (windows of {split.window_s:.3g} s)")
    for start, goodput in split.windows:
        x = start - split.start
        chart.bar(x, x + split.window_s * 0.9, 0.0, 100 * goodput, COLORS[Category.TRAINING],
                  f"{x:.3g}-{x + split.window_s:.3g} s: goodput {100 * goodput:.1f}%")
    return chart.svg()


def _known(value: int | None, unknown: str = "not known") -> int | str:
    return unknown if value is None else value


def _rows(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(
        f'<td class="num">{c:.2f}</td>' if isinstance(c, float) else f"<td>{html.escape(str(c))}</td>" for c in row)
        + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _figure(title: str, svg: str | None, note: str = "") -> str:
    if svg is None:
        return f"<h2>{html.escape(title)}</h2><p class=\"muted\">{html.escape(note or 'nothing recorded')}</p>"
    caption = f'<p class="muted">{html.escape(note)}</p>' if note else ""
    return f'<h2>{html.escape(title)}</h2><div class="figure">{svg}</div>{caption}'


def render_html(view: RunView, *, title: str = "ddpkit run") -> str:
    split = view.split
    wall = split.wall_s
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    failed = [a for a in split.attempts if a.exit_code not in (0, None)]
    headline = _rows(["figure", "value"], [
        ["goodput (training / wall clock)", "not known (no rank recorded its steps)" if not split.measured else
         f"{100 * split.goodput:.1f} %" if split.lost_known else
         f"at most {100 * split.goodput:.1f} % (the steps done again are not known)"],
        ["ranks replaced live", split.live_heals],
        ["wall clock", f"{wall:.1f} s"], ["attempts", len(split.attempts)], ["failed attempts", len(failed)],
        ["queue wait (the scheduler's)", f"{split.seconds[Category.QUEUE_WAIT]:.1f} s (job {split.queue.job_id})"
         if split.queue is not None else "not recorded (no scheduler said)"],
        ["waiting for a straggler", f"{split.seconds[Category.STRAGGLER_WAIT]:.2f} s"],
        ["furthest step", _known(split.furthest_step)], ["steps done again (lost progress)", _known(
            split.lost_steps, "not known: the script showed no epoch (its sampler's set_epoch) to tell where it "
            "resumed")],
        ["categories add up to", f"{split.accounted_s:.2f} s of {wall:.2f} s"]])
    categories = _rows(["category", "seconds", "% of wall clock"],
                       [[c.words, split.seconds[c], f"{100 * split.seconds[c] / wall:.1f}" if wall else "-"]
                        for c in Category])
    decisions = {r.attempt: r.decision for r in view.ledger if isinstance(r, AttemptEnded)}
    attempts = _rows(["attempt", "start (s)", "length (s)", "exit", "class", "cause", "resumed from",
                      "furthest step", "steps done again", "decision"],
                     [[a.attempt, a.start - split.start, a.end - a.start, "" if a.exit_code is None else a.exit_code,
                       a.failure_class or "", a.cause, "" if a.resumed_from is None else a.resumed_from,
                       "" if not a.steps else _known(a.reached), "" if not a.steps else _known(a.lost_steps),
                       decisions.get(a.attempt, "")]
                      for a in split.attempts])
    faults = (_rows(["host", "attempt", "ranks", "why", "what was done"],
                    [[h.host, h.attempt, ", ".join(map(str, h.ranks)), h.reason, h.decision]
                     for h in view.hosts_at_fault]) if view.hosts_at_fault else
              '<p class="muted">No host-class failure: no host was named at fault.</p>')
    command = " ".join(view.command)
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}: {html.escape(str(view.run_dir))}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}: {html.escape(str(view.run_dir))}</h1>",
        f'<p class="muted">ddpkit {__version__}, {stamp}' + (f"; command: <code>ddpkit {html.escape(command)}</code>"
                                                             if command else "") + "</p>",
        headline,
        _figure("Attempts", _timeline(split), "Each attempt from its start to its end, its cause at its end."),
        _figure("Where the wall clock went", _split_bar(split)), categories,
        _figure("Step time per rank", _step_times(view), "each rank's median step per ledger line (about one a "
                "second); a rank slower than the others is a straggler, the others wait for it"),
        "<h2>Per rank: step time and wait share</h2>", _rank_table(view),
        '<p class="muted">Gradient sync: from a rank\'s last gradient bucket handed to the all-reduce to its end '
        "(a script under ddpkit run: DDP's own statistic, sampled). Waiting for a slower rank: that, less the "
        "least of any rank over the same steps (the slowest rank's, the transfer alone). Not measured: ddpkit "
        "train's models on DDP's C++ all-reduce (above its Python hook's size), shown as such.</p>",
        _figure("Goodput over time", _rolling(split)),
        "<h2>Attempts</h2>", attempts,
        "<h2>Hosts at fault</h2>", faults,
        "<h2>Live heals (--heal live)</h2>", _live_heals(view),
        "<script>document.documentElement.setAttribute('data-ddpkit-ready',"
        " String(document.querySelectorAll('svg').length));</script>",
        "</body></html>"]
    return "\n".join(parts) + "\n"
