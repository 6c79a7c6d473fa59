"""ddpkit report RUN_DIR --html with the default install: the page's figures are SVG written by hand
(ddpkit.reports.svg), so no plotting library is needed (it exited 2 without the ``plots`` extra)."""

from __future__ import annotations

import itertools
import re
import sys
from pathlib import Path

import pytest

from ddpkit.reports.cli import run as report_run
from ddpkit.reports.svg import Chart, nice_ticks
from tests.unit.test_goodput_report import _args, _run_dir


def test_the_page_is_drawn_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails, as where the extra is not installed
    page = tmp_path / "run.html"
    assert report_run(_args(str(_run_dir(tmp_path)), "--html", str(page))) == 0
    text = page.read_text()
    assert text.count("<svg") == 4  # timeline, split, step time, goodput over time
    timeline = text[text.index("<svg"):text.index("</svg>")]
    for words in ("attempt 1", "attempt 3", "exit 137: rank 1 on host vm was killed by SIGKILL", "lost progress"):
        assert words in timeline
    assert len(re.findall(r"<rect ", timeline)) > 10  # the attempts' bars and the legend's keys


def test_ticks_are_round_and_a_chart_places_data_inside_its_axes() -> None:
    assert nice_ticks(0, 4.5) == [0, 1, 2, 3, 4]
    assert nice_ticks(0, 100, 5) == [0, 25, 50, 75, 100]
    assert nice_ticks(0, 0.012) == [0, 0.002, 0.004, 0.006, 0.008, 0.01, 0.012]
    chart = Chart(x_range=(0.0, 10.0), y_range=(0.0, 1.0), width=500, left=50)
    assert chart.x(0) == 50 and chart.x(10) == 500 - chart.right
    assert chart.y(1) == chart.top and chart.y(0) == chart.top + chart.plot_height
    chart.bar(2, 4, 0.2, 0.8, "#123456", "a <bar> & more")
    svg = chart.svg()
    assert svg.startswith("<svg ") and svg.endswith("</svg>") and "a &lt;bar&gt; &amp; more" in svg


def test_legend_labels_never_print_over_each_other() -> None:
    """The live heal's long label takes the columns its words need; the next label starts after it (a new row where
    the row is full), and the chart grows to hold every row."""
    from ddpkit.goodput.accounting import Category
    from ddpkit.reports.svg import CHAR_PX

    chart = Chart(x_range=(0.0, 10.0), y_range=(0.0, 1.0))
    shown = [Category.TRAINING, Category.LIVE_HEAL, Category.TEARDOWN, *Category]  # a live run's page: the long one
    chart.legend = [("#111", f"{c.words} 1.0 s") for c in shown]
    svg = chart.svg()
    found = re.findall(r'<text x="([\d.]+)" y="([\d.]+)">([^<]*)</text>', svg)
    texts = [(float(x), float(y), words) for x, y, words in found if words.endswith(" s")]
    assert len(texts) == len(shown)
    rows: dict[float, list[tuple[float, str]]] = {}
    for x, y, words in texts:
        rows.setdefault(y, []).append((x, words))
    for row in rows.values():
        row.sort()
        for (x, words), (next_x, _) in itertools.pairwise(row):
            assert x + len(words) * CHAR_PX <= next_x, (words, x, next_x)
        assert row[-1][0] + len(row[-1][1]) * CHAR_PX <= chart.width, row[-1]
    height = float(re.search(r'height="(\d+)"', svg)[1])  # type: ignore[index]
    assert height > max(y for _, y, _ in texts)
