"""Rank 0's report: a table per node, one line per check, a verdict; the seeds' per-rank lines; the JSON file."""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddpkit.check.outcome import FAIL, PASS, SKIP, WARN, Outcome

__all__ = ["print_checks", "print_nodes", "print_rank_lines", "print_verdict", "verdict_line", "write_json"]

_STYLE = {PASS: "green", FAIL: "bold red", WARN: "yellow", SKIP: "dim"}
_COLUMNS = (("LOCAL_RANK", "local_rank"), ("RANK", "rank"), ("GROUP_RANK", "group_rank"),
            ("LOCAL_WORLD_SIZE", "local_world_size"), ("WORLD_SIZE", "world_size"), ("device", "device"),
            ("pid", "pid"), ("route to master", "iface"))


def _console() -> Any:
    from rich.console import Console

    # Logs and CI capture are not terminals: rich would assume 80 columns and fold the table.
    return Console(file=sys.stdout, soft_wrap=True, highlight=False, width=None if sys.stdout.isatty() else 160)


def print_nodes(records: Sequence[dict[str, Any]]) -> None:
    """One table per node (host and node rank), one row per rank, in rank order."""
    from rich.markup import escape
    from rich.table import Table

    console = _console()
    nodes: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        nodes[(int(r["group_rank"]), str(r["host"]))].append(r)
    for (node_rank, host), rows in sorted(nodes.items()):
        # values are text, never rich markup: a host name such as '[red]x' prints as itself (issue 20)
        table = Table(title=escape(f"node {node_rank}: {host}"), title_justify="left")
        for header, _ in _COLUMNS:
            table.add_column(header, justify="right" if header.isupper() else "left")
        for r in sorted(rows, key=lambda x: (int(x["rank"]), int(x["slot"]))):
            cells = [str(r[key]) for _, key in _COLUMNS]
            cells[-1] = f"{r['iface'] or '?'} {r['ip']}"
            if r.get("gpu_uuid"):
                cells[5] += f" {r['gpu_uuid']}"
            table.add_row(*(escape(c) for c in cells))
        console.print(table)


def print_checks(outcomes: Sequence[Outcome]) -> None:
    from rich.markup import escape

    console = _console()
    width = max((len(o.name) for o in outcomes), default=10)
    for o in outcomes:
        console.print(f"[{_STYLE[o.status]}]{o.status:<4}[/]  {escape(f'{o.name:<{width}}  {o.detail}')}",
                      markup=True)


def verdict_line(outcomes: Sequence[Outcome], code: int, *, world_size: int, hosts: int, backend: str,
                 seconds: float) -> str:
    bad = [o for o in outcomes if o.status == FAIL]
    warns = sum(o.status == WARN for o in outcomes)
    if not bad:
        extra = f", {warns} warning(s)" if warns else ""
        return (f"verdict: PASS: {world_size} rank(s) on {hosts} host(s) are ready for DDP over {backend}{extra} "
                f"({seconds:.1f} s)")
    names = ", ".join(o.name for o in bad)
    return f"verdict: FAIL (exit {code}): {names}"


def print_verdict(text: str) -> None:
    style = "bold green" if text.startswith("verdict: PASS") else "bold red"
    from rich.text import Text

    _console().print(Text(text, style=style))


def print_rank_lines(records: Sequence[dict[str, Any]]) -> None:
    """The seeds' familiar lines, from every rank's record, ordered by rank (never interleaved)."""
    ordered = sorted(records, key=lambda r: (int(r["rank"]), int(r["slot"])))
    lines = [f"Start running basic DDP example on rank {r['rank']}." for r in ordered]
    lines += [f"{r['host']}: {r['rank']} of {r['world_size']}" for r in ordered]
    seen = set()
    for r in ordered:
        for key, value in r["env"].items():
            if "NCCL" in key and (r["host"], key) not in seen:
                seen.add((r["host"], key))
                lines.append(f"{r['host']} {key} : {value}")
    print("\n".join(lines), flush=True)


def write_json(path: str | Path, report: dict[str, Any]) -> None:
    """Write atomically, so a reader never sees half a report."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")
    tmp.replace(path)
