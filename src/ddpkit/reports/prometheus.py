"""A run's headline figures as a node-exporter textfile (``--collector.textfile.directory``), written by
``prometheus_client`` (its ``write_to_textfile`` escapes the labels and renames the file into place whole, so the
exporter never reads half of it): one ``ddpkit_*`` gauge or counter each, labelled with the run directory's name."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ddpkit.goodput.accounting import Category
from ddpkit.reports.run import RunView

__all__ = ["prometheus_text", "write_prometheus"]


class _RunFigures(Collector):
    def __init__(self, view: RunView) -> None:
        self.view = view

    def collect(self) -> Iterator[Metric]:
        split = self.view.split
        run = [self.view.run_dir.name]

        def one(family: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str, helptext: str,
                value: float) -> Metric:
            metric = family(name, helptext, labels=["run"])
            metric.add_metric(run, value)
            return metric

        failed = sum(1 for a in split.attempts if a.exit_code not in (0, None))
        if split.measured:  # a goodput no rank measured is left out, never written as 0
            yield one(GaugeMetricFamily, "ddpkit_goodput_ratio", "Training time over wall-clock time of the run "
                      "(0..1).", split.goodput)
        yield one(GaugeMetricFamily, "ddpkit_wall_seconds",
                  "Wall-clock seconds from the run's start to its last attempt's end.", split.wall_s)
        yield one(CounterMetricFamily, "ddpkit_attempts", "Attempts the run started.", len(split.attempts))
        yield one(CounterMetricFamily, "ddpkit_failed_attempts", "Attempts that ended with a non-zero exit code.",
                  failed)
        yield one(CounterMetricFamily, "ddpkit_live_heals", "Ranks replaced live (--heal live) over the run.",
                  split.live_heals)
        # a figure ddpkit does not know is left out, never written as 0: a user's script that showed no epoch
        yield one(GaugeMetricFamily, "ddpkit_lost_steps_known", "1 where the steps done again after a resume are "
                  "known, else 0 (ddpkit_lost_steps_total is then absent and ddpkit_goodput_ratio an upper bound).",
                  float(split.lost_known))
        if split.lost_steps is not None:
            yield one(CounterMetricFamily, "ddpkit_lost_steps", "Training steps done again after a resume.",
                      split.lost_steps)
        if split.furthest_step is not None:
            yield one(GaugeMetricFamily, "ddpkit_furthest_step", "The furthest training step the run reached.",
                      split.furthest_step)
        seconds = GaugeMetricFamily("ddpkit_time_seconds",
                                    "Wall-clock seconds of the run by category (they add up to the wall).",
                                    labels=["run", "category"])
        for c in Category:
            seconds.add_metric([*run, c.value], split.seconds[c])
        yield seconds


def _registry(view: RunView) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_RunFigures(view))
    return registry


def prometheus_text(view: RunView) -> str:
    return generate_latest(_registry(view)).decode()


def write_prometheus(view: RunView, path: str | Path) -> None:
    write_to_textfile(str(path), _registry(view))
