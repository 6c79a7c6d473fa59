"""One self-contained HTML page of a run: the headline figures, a timeline of attempts and their causes, the
goodput split, rank 0's step time and the rolling goodput (matplotlib SVG, inline), the attempts and the hosts
at fault. No external script, stylesheet, font or image: the page opens from a mail attachment or an artifact
store as it does from disk. One inline script sets ``data-ddpkit-ready`` on ``<html>`` (the number of figures it
found) so a headless browser proves that the page loaded and ran."""

from __future__ import annotations

import html
import io
from datetime import datetime, timezone
from typing import Any

from ddpkit import __version__
from ddpkit.base.errors import ConfigError
from ddpkit.goodput.accounting import Category, Split
from ddpkit.goodput.straggler import rank_waits
from ddpkit.heal.ledger import AttemptEnded
from ddpkit.reports.run import RunView

__all__ = ["COLORS", "render_html"]

#: One colour per category, the same in every figure.
COLORS = {Category.QUEUE_WAIT: "#cfd8dc", Category.STARTUP: "#9e9e9e", Category.CHECKPOINT_LOAD: "#7e57c2",
          Category.TRAINING: "#2e7d32", Category.LOST_PROGRESS: "#ef6c00", Category.STRAGGLER_WAIT: "#ad1457",
          Category.CHECKPOINT_SAVE: "#1565c0", Category.LOOP_OTHER: "#b0bec5", Category.FAILURE: "#c62828",
          Category.TEARDOWN: "#6d4c41", Category.RELAUNCH: "#f9a825", Category.UNMEASURED: "#e0e0e0"}

_STYLE = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.6em}table{border-collapse:collapse;margin:.5em 0}
td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}th{background:#f4f4f4}
.num{text-align:right}.figure svg{max-width:100%;height:auto}.bad{color:#c62828}.muted{color:#666}"""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--html needs matplotlib for its figures, which is not installed",
                          "the ddpkit 'plots' extra", "pip install 'ddpkit[plots]' (or matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _svg(fig: Any) -> str:
    plt = _pyplot()
    out = io.StringIO()
    fig.savefig(out, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = out.getvalue()
    return text[text.index("<svg"):]  # the XML prolog and doctype do not belong inside HTML


def _timeline(split: Split) -> str:
    plt = _pyplot()
    attempts = split.attempts
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.6 * len(attempts)), dpi=100)
    t0 = split.start
    if split.queue is not None and split.seconds[Category.QUEUE_WAIT] > 0:  # drawn on the first attempt's row
        ax.broken_barh([(0.0, split.seconds[Category.QUEUE_WAIT])], (len(attempts) - 1.35, 0.7),
                       color=COLORS[Category.QUEUE_WAIT])
    for row, a in enumerate(attempts):
        y = len(attempts) - 1 - row
        bars: list[tuple[float, float, Category]] = []
        head_end = a.first_step_at if a.first_step_at is not None else a.start + sum(
            a.seconds[c] for c in (Category.STARTUP, Category.CHECKPOINT_LOAD, Category.UNMEASURED))
        bars.append((a.start, head_end, Category.UNMEASURED if a.seconds[Category.UNMEASURED] else Category.STARTUP))
        bars += [(r.start, r.end, Category.CHECKPOINT_LOAD) for r in a.loads]
        furthest = max((b.last_step or 0 for b in attempts[:row]), default=0)
        for r in a.steps:
            bars.append((r.start, r.end, Category.LOST_PROGRESS if r.first <= furthest else Category.TRAINING))
        bars += [(r.start, r.end, Category.CHECKPOINT_SAVE) for r in a.saves]
        tail_from = max([r.end for r in a.steps] + [r.end for r in a.saves] + [head_end])
        tail = Category.FAILURE if a.seconds[Category.FAILURE] > 0 else Category.TEARDOWN
        bars.append((min(tail_from, a.end), a.end, tail))
        for start, end, category in bars:
            ax.broken_barh([(start - t0, max(end - start, split.wall_s / 2000))], (y - 0.35, 0.7),
                           color=COLORS[category])
        label = f"exit {a.exit_code}" if a.exit_code is not None else "no end recorded"
        if a.cause:
            label += f": {a.cause}"
        ax.text(a.end - t0, y + 0.42, " " + label[:90], fontsize=8, va="bottom", ha="right")
    ax.set_yticks(range(len(attempts)), [f"attempt {a.attempt}" for a in reversed(attempts)])
    ax.set_xlabel("seconds since the run started")
    ax.set_xlim(0, split.wall_s * 1.01)
    ax.set_ylim(-0.6, len(attempts) - 0.1)
    handles = [plt.Rectangle((0, 0), 1, 1, color=COLORS[c]) for c in Category]
    ax.legend(handles, [c.words for c in Category], fontsize=7, ncol=3, loc="upper center",
              bbox_to_anchor=(0.5, -0.35 if len(attempts) < 3 else -0.2), frameon=False)
    return _svg(fig)


def _split_bar(split: Split) -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 1.6), dpi=100)
    left = 0.0
    for category in Category:
        seconds = split.seconds[category]
        if seconds <= 0:
            continue
        ax.barh([0], [seconds], left=[left], color=COLORS[category], label=f"{category.words} {seconds:.1f} s")
        left += seconds
    ax.set_yticks([])
    ax.set_xlabel("seconds of wall clock")
    ax.set_xlim(0, max(split.wall_s, 1e-9))
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.45), frameon=False)
    return _svg(fig)


def _step_times(view: RunView) -> str | None:
    """Each rank's median step per ledger line, a line per rank and attempt (a gap between attempts)."""
    split = view.split
    if not any(view.rank_steps.values()):
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 2.6), dpi=100)
    for rank, lines in view.rank_steps.items():
        color = None
        for attempt in sorted({r.attempt for r in lines}):
            mine = [r for r in lines if r.attempt == attempt]
            drawn = ax.plot([(r.start + r.end) / 2 - split.start for r in mine], [r.p50_ms for r in mine],
                            marker="o", markersize=3, color=color, label=f"rank {rank}" if color is None else None)
            color = drawn[0].get_color()
    ax.set_xlabel("seconds since the run started")
    ax.set_ylabel("step p50 (ms)")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    return _svg(fig)


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


def _rolling(split: Split) -> str | None:
    if not split.windows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 2.2), dpi=100)
    xs = [w[0] - split.start for w in split.windows]
    ax.bar(xs, [100 * w[1] for w in split.windows], width=split.window_s * 0.9, align="edge",
           color=COLORS[Category.TRAINING])
    ax.set_ylim(0, 100)
    ax.set_ylabel("goodput %")
    ax.set_xlabel(f"seconds since the run started (windows of {split.window_s:.3g} s)")
    return _svg(fig)


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
        ["goodput (training / wall clock)", f"{100 * split.goodput:.1f} %"],
        ["wall clock", f"{wall:.1f} s"], ["attempts", len(split.attempts)], ["failed attempts", len(failed)],
        ["queue wait (the scheduler's)", f"{split.seconds[Category.QUEUE_WAIT]:.1f} s (job {split.queue.job_id})"
         if split.queue is not None else "not recorded (no scheduler said)"],
        ["waiting for a straggler", f"{split.seconds[Category.STRAGGLER_WAIT]:.2f} s"],
        ["furthest step", split.furthest_step], ["steps done again (lost progress)", split.lost_steps],
        ["categories add up to", f"{split.accounted_s:.2f} s of {wall:.2f} s"]])
    categories = _rows(["category", "seconds", "% of wall clock"],
                       [[c.words, split.seconds[c], f"{100 * split.seconds[c] / wall:.1f}" if wall else "-"]
                        for c in Category])
    decisions = {r.attempt: r.decision for r in view.ledger if isinstance(r, AttemptEnded)}
    attempts = _rows(["attempt", "start (s)", "length (s)", "exit", "class", "cause", "resumed from",
                      "furthest step", "steps done again", "decision"],
                     [[a.attempt, a.start - split.start, a.end - a.start, "" if a.exit_code is None else a.exit_code,
                       a.failure_class or "", a.cause, "" if a.resumed_from is None else a.resumed_from,
                       "" if a.last_step is None else a.last_step, a.lost_steps, decisions.get(a.attempt, "")]
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
        '<p class="muted">Gradient sync: from a rank\'s last gradient bucket handed to the all-reduce to its end. '
        "Waiting for a slower rank: that, less the least of any rank over the same steps (the slowest rank's, "
        "the transfer alone). Not measured under DDP's own C++ all-reduce (large models).</p>",
        _figure("Goodput over time", _rolling(split)),
        "<h2>Attempts</h2>", attempts,
        "<h2>Hosts at fault</h2>", faults,
        "<script>document.documentElement.setAttribute('data-ddpkit-ready',"
        " String(document.querySelectorAll('svg').length));</script>",
        "</body></html>"]
    return "\n".join(parts) + "\n"
