"""Rank 0's report: a table of nodes (or of every rank), one line per check, a verdict; the seeds' per-rank lines;
the JSON file.

By default each node is one row, its ranks folded into ranges and the fields its ranks share; a rank that differs
from its node's majority (threads, device, route, versions...) is named in the row's last column. At 64 ranks
that is a screen, not 64 rows; ``--per-rank`` prints the full table, one per node.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddpkit.verdicts.outcome import FAIL, PASS, SKIP, WARN, Outcome

__all__ = ["fold_node", "print_checks", "print_nodes", "print_rank_lines", "print_verdict", "rank_ranges",
           "verdict_line", "write_json"]

_STYLE = {PASS: "green", FAIL: "bold red", WARN: "yellow", SKIP: "dim"}
_COLUMNS = (("LOCAL_RANK", "local_rank"), ("RANK", "rank"), ("GROUP_RANK", "group_rank"),
            ("LOCAL_WORLD_SIZE", "local_world_size"), ("WORLD_SIZE", "world_size"), ("device", "device"),
            ("pid", "pid"), ("route to master", "iface"))


def _console() -> Any:
    from rich.console import Console

    # Logs and CI capture are not terminals: rich would assume 80 columns and fold the table.
    return Console(file=sys.stdout, soft_wrap=True, highlight=False, width=None if sys.stdout.isatty() else 160)


# what a node's ranks should share: a rank whose value differs from its node's majority is named as an outlier
_SHARED = (("WORLD_SIZE", "world_size"), ("LOCAL_WORLD_SIZE", "local_world_size"), ("threads", "threads"),
           ("route", "iface"), ("ip", "ip"), ("launcher", "launcher"), ("python", "python"), ("torch", "torch"),
           ("ddpkit", "ddpkit"), ("cuda", "cuda"))


def rank_ranges(ranks: Sequence[int]) -> str:
    """``[0, 1, 2, 3, 8, 9]`` -> ``0-3, 8-9``."""
    out: list[str] = []
    for r in sorted(set(ranks)):
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)


def _device_kind(r: dict[str, Any]) -> str:
    return str(r["device"]).split(":")[0]


def fold_node(rows: Sequence[dict[str, Any]]) -> dict[str, str]:
    """One node's ranks as one row: ranges, the values most ranks share, and the ranks that differ, by name."""
    ranks = [int(r["rank"]) for r in rows]
    row: dict[str, str] = {"ranks": rank_ranges(ranks), "count": str(len(rows))}
    outliers: list[str] = []
    for label, key in (*_SHARED, ("device", None)):
        values: dict[str, list[int]] = defaultdict(list)
        for r in rows:
            values[_device_kind(r) if key is None else str(r.get(key, "?"))].append(int(r["rank"]))
        majority = max(values.items(), key=lambda kv: (len(kv[1]), -min(kv[1])))[0]
        row[label] = majority
        for value, who in sorted(values.items(), key=lambda kv: min(kv[1])):
            if value != majority:
                outliers.append(f"{'rank' if len(who) == 1 else 'ranks'} {rank_ranges(who)}: {label} {value}")
    dups = sorted(r for r, k in Counter(ranks).items() if k > 1)
    if dups:
        outliers.append(f"rank(s) {rank_ranges(dups)} claimed twice")
    gpus = sorted({str(r["gpu_uuid"] or r["device"]) for r in rows if _device_kind(r) != "cpu"})
    if gpus:  # each GPU by its UUID's first 8 digits, as nvidia-smi -L starts it (whole in --per-rank and --json)
        row["device"] += f" x{len(gpus)} ({', '.join(g[:8] for g in gpus)})"
    pids = sorted((str(r["pid"]) for r in rows), key=lambda p: (len(p), p))  # numeric order for numbers
    row["pids"] = str(pids[0]) if len(pids) == 1 else f"{pids[0]}..{pids[-1]}"
    row["outliers"] = "; ".join(outliers) or "-"
    return row


def _nodes(records: Sequence[dict[str, Any]]) -> dict[tuple[int, str], list[dict[str, Any]]]:
    nodes: dict[tuple[int, str], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        nodes[(int(r["group_rank"]), str(r["host"]))].append(r)
    return dict(sorted(nodes.items()))


def print_nodes(records: Sequence[dict[str, Any]], *, per_rank: bool = False) -> None:
    """One row per node (ranks folded, outliers named); ``per_rank``: one table per node, one row per rank."""
    from rich.markup import escape
    from rich.table import Table

    if per_rank:
        _print_rank_tables(records)
        return
    table = Table(title=f"{len(records)} rank(s) on {len(_nodes(records))} node(s) (--per-rank: every rank)",
                  title_justify="left")
    headers = ("node", "host", "RANKS", "LOCAL_WORLD_SIZE", "WORLD_SIZE", "device", "threads", "pids",
               "route to master", "ranks that differ")
    for header in headers:
        table.add_column(header, justify="right" if header.isupper() else "left", overflow="fold")
    for (node_rank, host), rows in _nodes(records).items():
        f = fold_node(rows)
        cells = (str(node_rank), host, f"{f['ranks']} ({f['count']})", f["LOCAL_WORLD_SIZE"], f["WORLD_SIZE"],
                 f["device"], f["threads"], f["pids"], f"{f['route']} {f['ip']}", f["outliers"])
        # values are text, never rich markup: a host name such as '[red]x' prints as itself (issue 20)
        table.add_row(*(escape(c) for c in cells))
    _console().print(table)


def _print_rank_tables(records: Sequence[dict[str, Any]]) -> None:
    from rich.markup import escape
    from rich.table import Table

    console = _console()
    for (node_rank, host), rows in _nodes(records).items():
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
