"""Baselines: what a healthy cluster measured, kept in a file, and later runs judged against it (no torch import).

    ddpkit bench -n 2 --ops all_reduce --save-baseline base.json       # on the healthy cluster
    ddpkit bench -n 2 --ops all_reduce --baseline base.json            # later: regressions named, exit 1
    ddpkit check -n 2 --baseline base.json                             # nodes whose facts changed

A baseline holds, per op and size, busbw and time; per link (``--pairs``), bandwidth and latency; per node, the
bandwidth of its fastest link; and the hosts, versions and node facts it was measured on. The judgement, as
SuperBench's ``diagnosis --baseline-file`` does it per metric and node: a figure more than ``--tolerance`` percent
worse than its baseline is a regression.

Noise: every figure is already a median or an average over iterations (bench's ``--iters``, ``--pairs-iters``),
and with ``--baseline`` or ``--save-baseline`` bench repeats the whole sweep ``--repeat`` times (default 3) and
keeps each row's median. Sizes under ``JUDGED_FROM`` bytes are recorded but not judged: they measure latency,
which a shared CPU moves by more than any sensible tolerance. A node is named only when even its fastest link
regressed: a slow host slows every link it is on, and a healthy host keeps at least one healthy link.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ddpkit.base.errors import ConfigError

__all__ = ["DEFAULT_TOLERANCE", "JUDGED_FROM", "KIND", "from_bench", "judge_bench", "load", "median_rows", "save"]

KIND = "ddpkit-baseline"
FORMAT = 1
DEFAULT_TOLERANCE = 20.0  # percent
JUDGED_FROM = 1 << 20  # bytes


def _fix(path: str) -> str:
    return f"make one on a healthy cluster: ddpkit bench ... --save-baseline {path}"


def load(path: str | Path) -> dict[str, Any]:
    """A baseline file (or, for node facts only, a ``check --json`` file); ConfigError (exit 2) otherwise."""
    p = Path(path).expanduser()
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--baseline {path}: no such file", "a file written by --save-baseline",
                          _fix(str(path))) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--baseline {path}: not readable as JSON ({exc})", "a file written by --save-baseline",
                          _fix(str(path))) from None
    if not isinstance(data, dict) or data.get("kind") not in (KIND, "check"):
        kind = data.get("kind") if isinstance(data, dict) else type(data).__name__
        raise ConfigError(f"--baseline {path}: a {kind!r} file", f"kind {KIND!r} (or a check --json report)",
                          _fix(str(path)))
    if data["kind"] == KIND and data.get("format") != FORMAT:
        raise ConfigError(f"--baseline {path}: format {data.get('format')!r}", f"format {FORMAT}",
                          "save the baseline again with this ddpkit")
    return data


def baseline_path(text: str) -> str:
    """argparse type: the file is read and checked at parse time, on every rank, before anything starts."""
    load(text)
    return text


def facts_of(data: Mapping[str, Any]) -> dict[str, Any]:
    """host -> node facts, from a baseline or a check report."""
    if data.get("kind") == KIND:
        return dict(data.get("facts") or {})
    return {str(n["host"]): n["facts"] for n in data.get("nodes") or () if n.get("facts")}


def median_rows(sweeps: Sequence[Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Several sweeps of the same ops and sizes -> one, each row's placement the repeat with the median time."""
    out = []
    for results in zip(*sweeps, strict=True):
        first = dict(results[0])
        if first.get("supported") and first.get("rows"):
            rows = []
            for row_set in zip(*(r["rows"] for r in results), strict=True):
                row = dict(row_set[0])
                for placement in ("out_of_place", "in_place"):
                    runs = [r[placement] for r in row_set if r.get(placement)]
                    if runs:
                        ordered = sorted(runs, key=lambda m: m["time_us"])
                        row[placement] = {**ordered[len(ordered) // 2],
                                          "wrong": sum(int(m["wrong"]) for m in runs)}
                rows.append(row)
            first["rows"] = rows
            first["repeats"] = len(results)
        out.append(first)
    return out


def _op_figures(results: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    out: dict[str, dict[str, dict[str, float]]] = {}
    for r in results:
        if not r.get("supported"):
            continue
        key = r["op"] if r.get("transport", "torch") == "torch" else f"{r['op']}@{r['transport']}"
        for row in r["rows"]:
            m = row.get("out_of_place") or row.get("in_place")
            if m:
                out.setdefault(key, {})[str(row["size"])] = {"busbw": m["busbw"], "time_us": m["time_us"]}
    return out


def _link_figures(pairs: Mapping[str, Any] | None) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Each measured link (``a <-> b``, names sorted) and each endpoint's fastest link, GB/s."""
    if not pairs:
        return {}, {}
    names, bw, lat = pairs["names"], pairs["bandwidth_gbps"], pairs["latency_us"]
    links: dict[str, dict[str, float]] = {}
    best: dict[str, float] = {}
    for i, a in enumerate(names):
        for j in range(i + 1, len(names)):
            if bw[i][j] is None:
                continue
            x, y = sorted((a, names[j]))
            links[f"{x} <-> {y}"] = {"bandwidth_gbps": bw[i][j], "latency_us": lat[i][j]}
            for n in (a, names[j]):
                best[n] = max(best.get(n, 0.0), float(bw[i][j]))
    return links, best


def from_bench(report: Mapping[str, Any], *, argv: Sequence[str], facts: Mapping[str, Any]) -> dict[str, Any]:
    links, best = _link_figures(report.get("pairs"))
    members = report["world"]["members"]
    return {
        "kind": KIND, "format": FORMAT, "made": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": list(argv), "ddpkit": report["version"], "backend": report["backend"],
        "device": report["device"], "dtype": report["dtype"], "world_size": report["world"]["world_size"],
        "hosts": sorted({str(m["host"]) for m in members}),
        "versions": {k: sorted({str(m.get(k)) for m in members}) for k in ("python", "torch", "cuda")},
        "facts": dict(facts), "ops": _op_figures(report["ops"]), "links": links,
        "nodes": {n: {"best_link_gbps": v} for n, v in best.items()},
    }


def save(path: str | Path, baseline: Mapping[str, Any]) -> None:
    p = Path(path).expanduser()
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    tmp.write_text(json.dumps(baseline, indent=2, sort_keys=True) + "\n")
    tmp.replace(p)


def _size_text(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _change(now: float, then: float) -> float:
    return (now - then) / then * 100 if then else 0.0


def judge_bench(report: Mapping[str, Any], baseline: Mapping[str, Any], tolerance: float) -> dict[str, Any]:
    """Every op row, link and node against the baseline: ``{"regressions": [text], "notes": [text],
    "bad_hosts": {host: [reason]}, "compared": [{what, now, baseline, change_pct, regressed}]}``."""
    regressions: list[str] = []
    notes: list[str] = []
    bad: dict[str, list[str]] = {}
    compared: list[dict[str, Any]] = []

    def judge(what: str, now: float, then: float, unit: str) -> bool:
        change = _change(now, then)
        regressed = change < -tolerance
        compared.append({"what": what, "now": now, "baseline": then, "change_pct": round(change, 1),
                         "regressed": regressed})
        if regressed:
            regressions.append(f"{what}: {now:.3g} {unit}, baseline {then:.3g} {unit}, {change:+.0f}%")
        return regressed

    ops_then = baseline.get("ops") or {}
    for op, rows in _op_figures(report["ops"]).items():
        if op not in ops_then:
            notes.append(f"{op}: not in the baseline")
            continue
        for size, fig in rows.items():
            then = ops_then[op].get(size)
            if then and int(size) >= JUDGED_FROM:
                judge(f"{op} {_size_text(int(size))}", fig["busbw"], then["busbw"], "GB/s")
    links_now, best_now = _link_figures(report.get("pairs"))
    for link, fig in links_now.items():
        then = (baseline.get("links") or {}).get(link)
        if then is None:
            notes.append(f"link {link}: not in the baseline")
            continue
        judge(f"link {link}", fig["bandwidth_gbps"], then["bandwidth_gbps"], "GB/s")
        if then.get("latency_us") and fig["latency_us"] and fig["latency_us"] > 2 * then["latency_us"]:
            notes.append(f"link {link}: latency {fig['latency_us']:.0f} us, baseline {then['latency_us']:.0f} us")
    for node, value in best_now.items():
        then = (baseline.get("nodes") or {}).get(node)
        if then and judge(f"node {node} (fastest link)", value, then["best_link_gbps"], "GB/s"):
            bad.setdefault(node.split(" (")[-1].rstrip(")") if node.startswith("rank ") else node, []).append(
                f"fastest link {value:.3g} GB/s, baseline {then['best_link_gbps']:.3g} GB/s "
                f"({_change(value, then['best_link_gbps']):+.0f}%)")
    members = report["world"]["members"]
    for key, then in (baseline.get("versions") or {}).items():
        now = sorted({str(m.get(key)) for m in members})
        if now != then:  # a figure measured under other versions may differ for that reason alone
            notes.append(f"{key} {', '.join(now)}; baseline measured with {', '.join(then)}")
    hosts_now = sorted({str(m["host"]) for m in members})
    if hosts_now != baseline.get("hosts"):
        notes.append(f"hosts {', '.join(hosts_now)}; baseline on {', '.join(baseline.get('hosts') or [])}")
    return {"regressions": regressions, "notes": notes, "bad_hosts": bad, "compared": compared,
            "tolerance_pct": tolerance, "judged_from_bytes": JUDGED_FROM}

