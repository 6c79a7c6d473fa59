"""Check and bench JSON files (``--json`` of each command) rendered into one Markdown report, with the bench plots
drawn beside it (``ddpkit report check.json bench.json -o report.md``; the command is ``reports.cli``).

Reading is tolerant: a file's ``kind`` picks the section (``check``: a list of checks with name, status and
detail; ``bench``: ddpkit bench's rows); unknown fields are ignored and an unknown kind is summarised by its
top-level values. A file missing or not JSON: ``ConfigError`` (exit 2).
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ddpkit import __version__
from ddpkit.base.errors import ConfigError
from ddpkit.base.log import get_logger
from ddpkit.verdicts.baseline import DEFAULT_TOLERANCE

__all__ = ["file_verdict", "render"]

log = get_logger(__name__)


def _cell(value: Any) -> str:
    text = "" if value is None else f"{value:.3f}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return [*out, ""]


_WORDS = {"PASS", "PASSED", "OK", "FAIL", "FAILED", "WARN", "SKIP", "ERROR"}


def _status_of(entry: Mapping[str, Any]) -> str:
    if isinstance(entry.get("status"), str):
        return str(entry["status"]).upper()
    for key in ("passed", "ok", "success"):
        if isinstance(entry.get(key), bool):
            return "PASS" if entry[key] else "FAIL"
    for key in ("verdict", "result"):  # a sentence such as "PASS: 2 ranks ..." starts with the word
        words = str(entry.get(key) or "").replace(":", " ").split()
        if words and words[0].upper() in _WORDS:
            return words[0].upper()
    return "?"


def _checks_of(data: Mapping[str, Any]) -> list[dict[str, Any]]:
    raw = data.get("checks", data.get("results", data.get("outcomes", [])))
    if isinstance(raw, Mapping):  # {"name": {...}} form
        raw = [{"name": k, **(v if isinstance(v, Mapping) else {"detail": v})} for k, v in raw.items()]
    return [dict(e) for e in raw if isinstance(e, Mapping)] if isinstance(raw, list) else []


def file_verdict(data: Mapping[str, Any]) -> str:
    """PASS / FAIL (or ? when the file does not say), from the top-level fields or the checks."""
    top = _status_of(data)
    if top != "?":
        return top
    statuses = [_status_of(c) for c in _checks_of(data)]
    if statuses:
        return "FAIL" if "FAIL" in statuses else "PASS"
    return "?"


def _check_section(data: Mapping[str, Any]) -> list[str]:
    checks = _checks_of(data)
    lead = [f"> {_cell(data['verdict'])}", ""] if isinstance(data.get("verdict"), str) else []
    if not checks:
        return [*lead, "No checks listed in this file.", ""]
    rows = [[c.get("name", "?"), _status_of(c), c.get("detail", c.get("message", ""))] for c in checks]
    return lead + _table(["check", "status", "detail"], rows)


def _bench_section(data: Mapping[str, Any], plot: str | None) -> list[str]:
    from ddpkit.bench.results import avg_busbw

    world = data.get("world") or {}
    ops = [o for o in data.get("ops") or [] if isinstance(o, Mapping)]
    lines = [f"{world.get('world_size', '?')} ranks, backend {data.get('backend', '?')} on {data.get('device', '?')}, "
             f"dtype {data.get('dtype', '?')}, {data.get('iters', '?')} timed iterations.", ""]
    if ops:
        summary = [[o.get("op"), "yes" if o.get("supported") else f"no: {o.get('reason')}", len(o.get("rows") or []),
                    sum(int((row.get(p) or {}).get("wrong", 0)) for row in o.get("rows") or []
                        for p in ("out_of_place", "in_place")), avg_busbw([o])] for o in ops]
        lines += _table(["op", "ran", "sizes", "#wrong", "avg busbw (GB/s)"], summary)
        avg = data.get("avg_busbw")
        if isinstance(avg, (int, float)):
            lines += [f"Average bus bandwidth: **{avg:.3f} GB/s**.", ""]
    if plot:
        lines += [f"![bus bandwidth against size]({plot})", ""]
    for o in ops:
        rows = o.get("rows") or []
        if not rows:
            continue
        lines += [f"#### {o.get('op')}", ""]
        body = []
        for row in rows:
            cells: list[Any] = [row.get("size"), row.get("count"), row.get("type")]
            for p in ("out_of_place", "in_place"):
                m = row.get(p) or {}
                cells += [m.get("time_us"), m.get("busbw"), m.get("wrong")] if m else ["n/a", "", ""]
            body.append(cells)
        lines += _table(["size (B)", "count", "type", "oop time (us)", "oop busbw", "oop #wrong", "ip time (us)",
                         "ip busbw", "ip #wrong"], body)
    pairs = data.get("pairs")
    if isinstance(pairs, Mapping) and pairs.get("names"):
        names = list(pairs["names"])
        lines += [f"#### point-to-point bandwidth (GB/s) between {pairs.get('mode', '?')}", ""]
        if pairs.get("note"):
            lines += [f"Note: {pairs['note']}", ""]
        bw = pairs.get("bandwidth_gbps") or []
        lines += _table(["", *names], [[n, *("-" if i == j else v for j, v in enumerate(bw[i]))]
                                       for i, n in enumerate(names) if i < len(bw)])
        slow = ", ".join(pairs.get("slow_endpoints") or []) or "none"
        links = ", ".join(f"{a} <-> {b}" for a, b in pairs.get("slow_links") or []) or "none"
        lines += [f"Slow {pairs.get('mode', 'endpoints')}: **{slow}**; slow links: {links} "
                  f"(threshold {pairs.get('threshold', '?')} x reference).", ""]
    for reason in data.get("reasons") or []:
        lines.append(f"- {reason}")
    return [*lines, ""]


def _baseline_section(base: Mapping[str, Any]) -> list[str]:
    """A run beside its baseline: every figure compared, regressions first."""
    lines = [f"#### beside the baseline {_cell(base.get('file'))} (made {_cell(base.get('made'))}, tolerance "
             f"{float(base.get('tolerance_pct') or 0):g}%)", ""]
    compared = sorted(base.get("compared") or [], key=lambda c: (not c.get("regressed"), c.get("change_pct", 0)))
    rows = [[c.get("what"), c.get("now"), c.get("baseline"), f"{c.get('change_pct', 0):+.1f}%",
             "**regression**" if c.get("regressed") else "ok"] for c in compared]
    lines += _table(["figure", "now", "baseline", "change", "verdict"], rows) if rows else ["Nothing comparable.", ""]
    lines += [f"- note: {_cell(n)}" for n in base.get("notes") or []]
    facts = base.get("facts")
    if isinstance(facts, Mapping):
        lines.append(f"- node facts: {_cell(facts.get('status'))}: {_cell(facts.get('detail'))}")
    return [*lines, ""]


def _bad_hosts_section(data: Mapping[str, Any]) -> list[str]:
    bad = [b for b in data.get("bad_hosts") or [] if isinstance(b, Mapping)]
    if not bad:
        return []
    return ["#### bad hosts", "", *_table(["host", "Slurm node", "reasons"], [
        [b.get("host"), b.get("slurm_node") or "", "; ".join(map(str, b.get("reasons") or []))] for b in bad])]


def _against(data: dict[str, Any], base: Mapping[str, Any] | None, path: str | None, tolerance: float) -> None:
    """A run not judged at run time, judged now against ``base`` (``report --baseline``)."""
    if base is None or data.get("baseline"):
        return
    from ddpkit.verdicts.baseline import facts_of, judge_bench
    from ddpkit.verdicts.nodejudge import compare_to_baseline

    if data.get("kind") == "bench" and isinstance(data.get("world"), Mapping):
        result = judge_bench(data, base, tolerance)
        result["facts"] = compare_to_baseline(data["world"].get("members") or [], facts_of(base)).as_dict()
        data["baseline"] = {"file": path, "made": base.get("made"), **result}
    elif data.get("kind") == "check" and data.get("ranks"):
        outcome = compare_to_baseline(data["ranks"], facts_of(base))
        data.setdefault("checks", []).append(outcome.as_dict())


def _other_section(data: Mapping[str, Any]) -> list[str]:
    scalars = [[k, v] for k, v in data.items() if isinstance(v, (str, int, float, bool)) or v is None]
    return _table(["field", "value"], scalars) if scalars else ["(no top-level values)", ""]


def _load(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} does not exist", "a JSON file written by ddpkit check/bench --json",
                          "pass the paths given to --json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not JSON ({exc})", "a JSON file written by ddpkit check/bench --json",
                          "regenerate it with --json PATH") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} holds a JSON {type(data).__name__}", "a JSON object", "pass a --json file")
    return data


def render(files: list[Path], output: Path, *, title: str = "ddpkit report", plots: bool = True,
           baseline: str | None = None, tolerance: float = DEFAULT_TOLERANCE) -> str:
    """Write the Markdown report (and its plots beside it); returns the Markdown. ``baseline``: a baseline file
    the runs are shown beside (runs judged against one at run time keep theirs)."""
    loaded = [(f, _load(f)) for f in files]
    if baseline is not None:
        from ddpkit.verdicts.baseline import load

        base = load(baseline)
        for _, data in loaded:
            _against(data, base, baseline, tolerance)
    draw = plots and any(d.get("kind") == "bench" for _, d in loaded)
    if draw and importlib.util.find_spec("matplotlib") is None:
        log.warning("matplotlib is not installed: the report has no plots (pip install 'ddpkit[plots]')")
        draw = False
    assets = output.with_name(output.stem + "_files")
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# {title}", "", f"Generated by ddpkit {__version__} on {stamp} from {len(loaded)} file(s).", ""]
    lines += _table(["file", "kind", "verdict"], [[f.name, d.get("kind", "?"), file_verdict(d)] for f, d in loaded])
    for index, (f, data) in enumerate(loaded, 1):
        kind = str(data.get("kind", "unknown"))
        lines += [f"## {index}. {kind}: {f.name} ({file_verdict(data)})", ""]
        if kind == "check":
            lines += _check_section(data)
        elif kind == "bench":
            plot_ref = None
            if draw and any(o.get("rows") for o in data.get("ops") or [] if isinstance(o, Mapping)):
                from ddpkit.bench.plot import plot_busbw

                png = plot_busbw(data["ops"], assets / f"{index}-{f.stem}-busbw.png", title=f"{f.name}: bus bandwidth")
                plot_ref = png.relative_to(output.parent).as_posix()
            lines += _bench_section(data, plot_ref)
            if isinstance(data.get("baseline"), Mapping):
                lines += _baseline_section(data["baseline"])
        else:
            lines += _other_section(data)
        lines += _bad_hosts_section(data)
    text = "\n".join(lines).rstrip() + "\n"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    return text
