"""Results -> verdict, nccl-tests-style tables, CSV rows, and the busbw gate. Pure functions over the JSON shape.

An op result is ``{"op", "supported", "reason", "rows": [{"size", "count", "type", "redop", "root",
"out_of_place": {"time_us", "algbw", "busbw", "wrong"} | None, "in_place": {...} | None}]}``.
"""

from __future__ import annotations

import csv
import io
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ddpkit.base.errors import ConfigError
from ddpkit.bench.busbw import OPS

__all__ = ["CSV_FIELDS", "avg_busbw", "csv_text", "format_table", "gate_failures", "parse_gate", "total_wrong",
           "verdict"]

PLACEMENTS = ("out_of_place", "in_place")
CSV_FIELDS = ("op", "size", "count", "type", "redop", "root", "placement", "time_us", "algbw_gbps", "busbw_gbps",
              "wrong")
ALL = "*"


def _measurements(result: Mapping[str, Any]) -> Iterable[dict[str, Any]]:
    for row in result.get("rows", []):
        for placement in PLACEMENTS:
            if row.get(placement):
                yield row[placement]


def avg_busbw(results: Sequence[Mapping[str, Any]]) -> float | None:
    """nccl-tests' "Avg bus bandwidth": the mean busbw over every measured row and placement."""
    values = [m["busbw"] for r in results for m in _measurements(r)]
    return statistics.fmean(values) if values else None


def total_wrong(results: Sequence[Mapping[str, Any]]) -> int:
    return sum(int(m["wrong"]) for r in results for m in _measurements(r))


def parse_gate(spec: str | None) -> dict[str, float]:
    """``"2.5"`` (the average over every op) or ``"all_reduce=1.0,broadcast=2"`` (per op), GB/s; mixing is allowed."""
    if not spec:
        return {}
    gate: dict[str, float] = {}
    for item in spec.split(","):
        key, sep, value = item.strip().rpartition("=")
        op = key.strip() if sep else ALL
        if op != ALL and op not in OPS:
            raise ConfigError(f"--min-busbw names op {op!r}", f"one of {', '.join(OPS)}",
                              "write --min-busbw all_reduce=1.0,broadcast=2 or a bare number for every op")
        try:
            gate[op] = float(value)
        except ValueError:
            raise ConfigError(f"--min-busbw value {value!r} is not a number", "GB/s as a number, e.g. 1.5",
                              "write --min-busbw 1.5 or --min-busbw all_reduce=1.5") from None
    return gate


def gate_failures(results: Sequence[Mapping[str, Any]], gate: Mapping[str, float]) -> list[str]:
    """Each gate the results miss, as a sentence; a gated op that did not run misses its gate."""
    failures = []
    for op, floor in gate.items():
        picked = results if op == ALL else [r for r in results if r["op"] == op and r.get("supported")]
        value = avg_busbw(picked)
        label = "average bus bandwidth" if op == ALL else f"{op} average bus bandwidth"
        if value is None:
            failures.append(f"{label}: not measured (gate {floor:g} GB/s)")
        elif value < floor:
            failures.append(f"{label} {value:.3f} GB/s is below the gate {floor:g} GB/s")
    return failures


def verdict(results: Sequence[Mapping[str, Any]], gate: Mapping[str, float]) -> tuple[bool, list[str]]:
    """(passed, reasons): fails on any wrong element or any missed gate."""
    reasons = []
    for r in results:
        bad = [row["size"] for row in r.get("rows", []) for p in PLACEMENTS if (row.get(p) or {}).get("wrong")]
        if bad:
            wrong = sum(int(m["wrong"]) for m in _measurements(r))
            reasons.append(f"{r['op']}: {wrong} wrong elements (sizes {', '.join(map(str, sorted(set(bad))))} B)")
    reasons += gate_failures(results, gate)
    return not reasons, reasons


def _cells(m: Mapping[str, Any] | None) -> str:
    if not m:
        return f"{'n/a':>10} {'':>8} {'':>8} {'':>7}"
    return f"{m['time_us']:>10.1f} {m['algbw']:>8.3f} {m['busbw']:>8.3f} {m['wrong']:>7d}"


def format_table(result: Mapping[str, Any], world_size: int) -> str:
    """One op's rows in nccl-tests' columns: out-of-place, then in-place."""
    op = result["op"]
    if not result.get("supported"):
        return f"# {op}: skipped ({result.get('reason')})\n"
    lines = [
        f"# {op} ({world_size} ranks)",
        f"# {'':>46} {'out-of-place':>35} {'in-place':>35}",
        f"# {'size':>10} {'count':>12} {'type':>8} {'redop':>6} {'root':>5} " + " ".join(
            [f"{'time':>10} {'algbw':>8} {'busbw':>8} {'#wrong':>7}"] * 2),
        f"# {'(B)':>10} {'(elements)':>12} {'':>8} {'':>6} {'':>5} " + " ".join(
            [f"{'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8} {'':>7}"] * 2),
    ]
    for row in result.get("rows", []):
        root = row["root"] if row.get("root") is not None else -1
        lines.append((f"  {row['size']:>10d} {row['count']:>12d} {row['type']:>8} {row.get('redop') or 'none':>6} "
                     f"{root:>5} {_cells(row.get('out_of_place'))} {_cells(row.get('in_place'))}").rstrip())
    avg = avg_busbw([result])
    lines.append(f"# {op} avg bus bandwidth: {avg:.3f} GB/s" if avg is not None else f"# {op}: no rows")
    return "\n".join(line.rstrip() for line in lines) + "\n"


def csv_text(results: Sequence[Mapping[str, Any]]) -> str:
    """Every measurement as one CSV line (long format: one line per op, size and placement)."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for r in results:
        for row in r.get("rows", []):
            for placement in PLACEMENTS:
                m = row.get(placement)
                if m:
                    writer.writerow({"op": r["op"], "size": row["size"], "count": row["count"], "type": row["type"],
                                     "redop": row.get("redop") or "", "root": "" if row.get("root") is None
                                     else row["root"], "placement": placement, "time_us": f"{m['time_us']:.3f}",
                                     "algbw_gbps": f"{m['algbw']:.6f}", "busbw_gbps": f"{m['busbw']:.6f}",
                                     "wrong": m["wrong"]})
    return out.getvalue()
