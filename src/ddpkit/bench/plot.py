"""busbw against size, one line per op: a PNG through matplotlib's Agg backend (the ``plots`` extra)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ddpkit.base.errors import ConfigError
from ddpkit.bench.sizes import format_size

__all__ = ["plot_busbw"]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--plot needs matplotlib, which is not installed", "the ddpkit 'plots' extra",
                          "pip install 'ddpkit[plots]' (or matplotlib), or drop --plot") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_busbw(results: Sequence[Mapping[str, Any]], path: str | Path, *, title: str = "") -> Path:
    """Write the plot; each op uses its out-of-place busbw where it has one, else in-place."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=110)
    sizes_seen: set[int] = set()
    for r in results:
        points = []
        for row in r.get("rows", []):
            m = row.get("out_of_place") or row.get("in_place")
            if m:
                points.append((row["size"], m["busbw"]))
        if points:
            xs, ys = zip(*points, strict=True)
            sizes_seen.update(xs)
            ax.plot(xs, ys, marker="o", linewidth=1.5, markersize=4, label=r["op"])
    ax.set_xscale("log", base=2)
    ticks = sorted(sizes_seen)
    if ticks:
        step = max(1, len(ticks) // 10)
        ax.set_xticks(ticks[::step], [format_size(t) for t in ticks[::step]])
    ax.set_xlabel("message size (bytes, nccl-tests convention)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title or "ddpkit bench: bus bandwidth")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
