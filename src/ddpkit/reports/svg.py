"""Charts as inline SVG, written by hand: bars on a time axis, lines with markers, an axis with round ticks and a
legend. The run report's page draws its four figures with these, so ``ddpkit report --html`` works with the
default install (matplotlib is the ``plots`` extra, for bench's PNG and the Markdown report's plots).

A ``Chart`` maps data to pixels inside its margins: x from ``x_range``, y from ``y_range`` (upwards, as on paper);
rows of a timeline are y values too (row r spans r - 0.35 .. r + 0.35)."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Chart", "nice_ticks"]

FONT = 'font-family="system-ui,sans-serif" font-size="11"'
#: Legend entries per row, and the height of one.
LEGEND_COLUMNS, LEGEND_ROW = 3, 16
#: A wide estimate of one character's width at font-size 11 (sans-serif averages ~6 px): a legend label takes as many
#: columns as its words need, so that two labels never print over each other.
CHAR_PX = 6.5


def nice_ticks(low: float, high: float, most: int = 7) -> list[float]:
    """Round values from low to high, at most ``most`` of them: steps of 1, 2, 2.5 or 5 times a power of ten."""
    if not high > low:
        return [low]
    raw = (high - low) / max(most - 1, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    first = math.ceil(low / step - 1e-9) * step
    return [round(first + i * step, 10) for i in range(int((high - first) / step + 1e-9) + 1)]


def _number(value: float) -> str:
    return f"{value:g}"


@dataclass(kw_only=True)
class Chart:
    x_range: tuple[float, float]
    y_range: tuple[float, float]
    width: int = 1000
    plot_height: int = 160
    left: int = 70
    """Room for the y labels."""
    x_label: str = ""
    y_label: str = ""
    y_names: dict[int, str] = field(default_factory=dict)
    """Rows named instead of numbered (a timeline's attempts), by their y value."""
    legend: list[tuple[str, str]] = field(default_factory=list)
    """(colour, words) per entry, drawn below the x axis."""
    _items: list[str] = field(default_factory=list)

    top, right = 14, 16

    def x(self, value: float) -> float:
        low, high = self.x_range
        span = high - low or 1.0
        return self.left + (value - low) / span * (self.width - self.left - self.right)

    def y(self, value: float) -> float:
        low, high = self.y_range
        span = high - low or 1.0
        return self.top + (high - value) / span * self.plot_height

    def bar(self, x0: float, x1: float, y0: float, y1: float, color: str, tip: str = "") -> None:
        """A filled rectangle from (x0, y0) to (x1, y1) in data units; ``tip`` shows on hover."""
        left, right = sorted((self.x(x0), self.x(x1)))
        top, bottom = sorted((self.y(y0), self.y(y1)))
        title = f"<title>{html.escape(tip)}</title>" if tip else ""
        self._items.append(f'<rect x="{left:.1f}" y="{top:.1f}" width="{max(right - left, 0.5):.1f}" '
                           f'height="{bottom - top:.1f}" fill="{color}">{title}</rect>')

    def line(self, points: Sequence[tuple[float, float]], color: str, tip: str = "") -> None:
        """A polyline with a dot at each point."""
        xy = [(self.x(px), self.y(py)) for px, py in points]
        title = f"<title>{html.escape(tip)}</title>" if tip else ""
        if len(xy) > 1:
            path = " ".join(f"{a:.1f},{b:.1f}" for a, b in xy)
            self._items.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.5">'
                               f"{title}</polyline>")
        self._items += [f'<circle cx="{a:.1f}" cy="{b:.1f}" r="2.5" fill="{color}"/>' for a, b in xy]

    def text(self, x: float, y: float, words: str, *, anchor: str = "start", size: int = 11) -> None:
        """Words at a data point (``anchor``: start, middle or end)."""
        self._items.append(f'<text x="{self.x(x):.1f}" y="{self.y(y):.1f}" text-anchor="{anchor}" '
                           f'font-size="{size}">{html.escape(words)}</text>')

    def _axes(self) -> list[str]:
        bottom = self.top + self.plot_height
        right = self.width - self.right
        out = [f'<line x1="{self.left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#444"/>',
               f'<line x1="{self.left}" y1="{self.top}" x2="{self.left}" y2="{bottom}" stroke="#444"/>']
        for tick in nice_ticks(*self.x_range):
            px = self.x(tick)
            out.append(f'<line x1="{px:.1f}" y1="{bottom}" x2="{px:.1f}" y2="{bottom + 4}" stroke="#444"/>'
                       f'<text x="{px:.1f}" y="{bottom + 16}" text-anchor="middle">{_number(tick)}</text>')
        ticks = {float(k): v for k, v in self.y_names.items()} or {t: _number(t) for t in nice_ticks(*self.y_range, 5)}
        for value, name in ticks.items():
            py = self.y(value)
            out.append(f'<line x1="{self.left - 4}" y1="{py:.1f}" x2="{self.left}" y2="{py:.1f}" stroke="#444"/>'
                       f'<text x="{self.left - 7}" y="{py + 4:.1f}" text-anchor="end">{html.escape(name)}</text>')
        if self.x_label:
            out.append(f'<text x="{(self.left + right) / 2:.1f}" y="{bottom + 32}" text-anchor="middle">'
                       f"{html.escape(self.x_label)}</text>")
        if self.y_label:
            middle = self.top + self.plot_height / 2
            out.append(f'<text x="14" y="{middle:.1f}" text-anchor="middle" transform="rotate(-90 14 {middle:.1f})">'
                       f"{html.escape(self.y_label)}</text>")
        return out

    def _legend_places(self) -> list[tuple[int, int]]:
        """(row, first column) of each legend item: columns of a third of the plot's width, a label taking as many
        as its words need (a row holds what fits)."""
        column = (self.width - self.left - self.right) / LEGEND_COLUMNS
        places, row, col = [], 0, 0
        for _, words in self.legend:
            span = min(LEGEND_COLUMNS, max(1, math.ceil((14 + len(words) * CHAR_PX + 8) / column)))
            if col + span > LEGEND_COLUMNS:
                row, col = row + 1, 0
            places.append((row, col))
            col += span
        return places

    def _legend(self, top: float) -> list[str]:
        column = (self.width - self.left - self.right) / LEGEND_COLUMNS
        out = []
        for (color, words), (row, col) in zip(self.legend, self._legend_places(), strict=True):
            px = self.left + col * column
            py = top + row * LEGEND_ROW
            out.append(f'<rect x="{px:.1f}" y="{py:.1f}" width="10" height="10" fill="{color}"/>'
                       f'<text x="{px + 14:.1f}" y="{py + 9:.1f}">{html.escape(words)}</text>')
        return out

    def svg(self) -> str:
        """The chart as one ``<svg>`` element, sized by its content."""
        legend_top = self.top + self.plot_height + (40 if self.x_label else 26)
        places = self._legend_places()
        rows = places[-1][0] + 1 if places else 0
        height = legend_top + rows * LEGEND_ROW + 4
        body = "".join(self._items + self._axes() + self._legend(legend_top))
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{self.width}" height="{height:.0f}" '
                f'viewBox="0 0 {self.width} {height:.0f}" {FONT} fill="#222">{body}</svg>')
