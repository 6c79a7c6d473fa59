"""Render check and bench JSON files into one Markdown report, with the bench plots embedded.

    ddpkit check -n 2 --json check.json
    ddpkit bench -n 2 --json bench.json
    ddpkit report check.json bench.json -o report.md      # plots land in report_files/, linked from report.md
    ddpkit report RUN_DIR --html run.html --trace run.trace.json --prometheus run.prom   # a run's ledgers

A run directory (``ddpkit train --run-dir DIR``, ``ddpkit run|train --heal``) is rendered by ``ddpkit.reports``:
one self-contained HTML page, a Chrome/Perfetto trace, a node-exporter textfile (with none of the three named:
``RUN_DIR/report.html``).

Reading is tolerant: a file's ``kind`` picks the section (``check``: a list of checks with name, status and
detail; ``bench``: ddpkit bench's rows); unknown fields are ignored and an unknown kind is summarised by its
top-level values. Exit codes: 0 written; 2 a file is missing or not JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ddpkit.base.errors import EXIT_OK, ConfigError
from ddpkit.base.inputs import output_path, seconds
from ddpkit.reports.markdown import render
from ddpkit.verdicts.baseline import DEFAULT_TOLERANCE, baseline_path

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("files", nargs="+", metavar="FILE.json|RUN_DIR",
                   help="check or bench JSON files (--json of each command), or one run directory")
    p.add_argument("-o", "--output", default="report.md", help="Markdown file to write (default report.md)")
    p.add_argument("--title", default="ddpkit report", help="first heading of the report")
    p.add_argument("--no-plots", action="store_true",
                   help="do not draw the bench plots (they need matplotlib: pip install 'ddpkit[plots]')")
    p.add_argument("--baseline", type=baseline_path, default=None, metavar="FILE",
                   help="show each bench run beside this baseline (bench --save-baseline) where the run was not "
                        "judged against one already; check runs: node facts that changed")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE, metavar="PCT",
                   help=f"with --baseline: a figure more than PCT percent worse is a regression "
                        f"(default {DEFAULT_TOLERANCE:g})")
    r = p.add_argument_group("a run directory")
    r.add_argument("--html", type=output_path("--html"), default=None, metavar="PATH",
                   help="one self-contained HTML page (inline SVG: no plotting library needed): attempts and causes, "
                        "the goodput split, step times")
    r.add_argument("--trace", type=output_path("--trace"), default=None, metavar="PATH",
                   help="a Chrome/Perfetto trace (JSON traceEvents) of the attempts, phases and rank 0's steps")
    r.add_argument("--prometheus", type=output_path("--prometheus"), default=None, metavar="PATH",
                   help="a node-exporter textfile of the headline figures (ddpkit_goodput_ratio, ...)")
    r.add_argument("--window", type=seconds("--window"), default=None, metavar="S",
                   help="goodput per window of S seconds (default 60; a run under 10 minutes: a tenth of it)")



def _run_dir_report(args: argparse.Namespace, run_dir: Path) -> int:
    from ddpkit.reports.run import load_run

    view = load_run(run_dir, window_s=args.window or 60.0)
    if args.window is None and view.split.wall_s < 600:  # a short run: ten windows, not one
        view = load_run(run_dir, window_s=max(view.split.wall_s / 10, 0.1))
    html = args.html or (None if args.trace or args.prometheus else str(run_dir / "report.html"))
    written = []
    if html:
        from ddpkit.reports.html import render_html

        Path(html).write_text(render_html(view, title=args.title if args.title != "ddpkit report" else "ddpkit run"))
        written.append(html)
    if args.trace:
        from ddpkit.reports.trace import trace_events

        Path(args.trace).write_text(json.dumps(trace_events(view)) + "\n")
        written.append(args.trace)
    if args.prometheus:
        from ddpkit.reports.prometheus import write_prometheus

        write_prometheus(view, args.prometheus)  # node-exporter may read at any moment: written whole, then renamed
        written.append(args.prometheus)
    split = view.split
    goodput = f"goodput {100 * split.goodput:.1f}%" if split.lost_known else \
        f"goodput at most {100 * split.goodput:.1f}% (steps done again not known)"
    if not split.measured:
        goodput = "goodput not known (no rank recorded its steps)"
    heals, said = split.live_heals, ""
    if heals:
        from ddpkit.goodput.accounting import Category

        waited = f"{split.seconds[Category.LIVE_HEAL]:.1f} s waiting for them" if split.measured else \
            "the time waiting for them not known"
        said = (f"; {heals} rank(s) replaced live ({waited}, "
                + (f"{split.lost_steps} step(s) lost)" if split.lost_known else "steps lost not known)"))
    print(f"{run_dir}: {len(split.attempts)} attempt(s), {goodput} of {split.wall_s:.1f} s{said}; wrote "
          f"{', '.join(written)}")
    return EXIT_OK


def run(args: argparse.Namespace) -> int:
    if any(Path(f).is_dir() for f in args.files):
        if len(args.files) != 1:
            raise ConfigError(f"{len(args.files)} paths with a run directory among them", "one run directory, or "
                              "check and bench JSON files", "run ddpkit report once per run directory")
        return _run_dir_report(args, Path(args.files[0]))
    if args.html or args.trace or args.prometheus:
        raise ConfigError("--html/--trace/--prometheus with JSON files", "a run directory (its ledgers)",
                          "pass the run directory (--run-dir of train, or .ddpkit-runs/RUN_ID)")
    output = Path(args.output)
    render([Path(f) for f in args.files], output, title=args.title, plots=not args.no_plots,
           baseline=args.baseline, tolerance=args.tolerance)
    print(f"wrote {output}")
    return EXIT_OK
