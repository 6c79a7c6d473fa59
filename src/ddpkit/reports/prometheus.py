"""A run's headline figures as a node-exporter textfile (``--collector.textfile.directory``): HELP and TYPE lines,
one ``ddpkit_*`` gauge or counter each, labelled with the run directory's name."""

from __future__ import annotations

from ddpkit.goodput.accounting import Category
from ddpkit.reports.run import RunView

__all__ = ["prometheus_text"]


def _label(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(view: RunView) -> str:
    split = view.split
    run = f'run="{_label(view.run_dir.name)}"'
    failed = sum(1 for a in split.attempts if a.exit_code not in (0, None))
    lines: list[str] = []

    def metric(name: str, kind: str, helptext: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP {name} {helptext}", f"# TYPE {name} {kind}"])
        lines.extend(f"{name}{{{labels}}} {value:.9g}" for labels, value in samples)

    metric("ddpkit_goodput_ratio", "gauge", "Training time over wall-clock time of the run (0..1).",
           [(run, split.goodput)])
    metric("ddpkit_wall_seconds", "gauge", "Wall-clock seconds from the run's start to its last attempt's end.",
           [(run, split.wall_s)])
    metric("ddpkit_attempts_total", "counter", "Attempts the run started.", [(run, float(len(split.attempts)))])
    metric("ddpkit_failed_attempts_total", "counter", "Attempts that ended with a non-zero exit code.",
           [(run, float(failed))])
    # a figure ddpkit does not know is left out, never written as 0: a user's script that showed no epoch
    metric("ddpkit_lost_steps_known", "gauge", "1 where the steps done again after a resume are known, else 0 "
           "(ddpkit_lost_steps_total is then absent and ddpkit_goodput_ratio an upper bound).",
           [(run, float(split.lost_known))])
    if split.lost_steps is not None:
        metric("ddpkit_lost_steps_total", "counter", "Training steps done again after a resume.",
               [(run, float(split.lost_steps))])
    if split.furthest_step is not None:
        metric("ddpkit_furthest_step", "gauge", "The furthest training step the run reached.",
               [(run, float(split.furthest_step))])
    metric("ddpkit_time_seconds", "gauge", "Wall-clock seconds of the run by category (they add up to the wall).",
           [(f'{run},category="{c.value}"', split.seconds[c]) for c in Category])
    return "\n".join(lines) + "\n"
