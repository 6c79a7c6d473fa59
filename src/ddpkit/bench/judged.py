"""Rank 0's last word on a bench run: the baseline's verdict, the hosts to blame, what to do about them, and the
baseline to keep (``--baseline``, ``--on-fail``, ``--save-baseline``). Pure over the report's JSON shape, except
``act``, which prints, drains and writes."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ddpkit.verdicts.remedy import drain, merge, report_lines

__all__ = ["act", "judge", "slow_hosts"]


def slow_hosts(pairs: dict[str, Any] | None) -> list[tuple[str, str | None, str]]:
    """(host, None, reason) for each endpoint the slow-link finder named; ``rank N (host)`` labels give the host."""
    if not pairs:
        return []
    out: list[tuple[str, str | None, str]] = []
    for name in pairs["slow_endpoints"]:
        host = name.rsplit(" (", 1)[-1].rstrip(")") if name.startswith("rank ") else name
        out.append((host, None, f"slow {pairs['mode'].rstrip('s')}: every link of {name} below "
                                f"{pairs['threshold']:g} x the reference bandwidth"))
    return out


def judge(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Add the baseline's verdict (``report["baseline"]``), and ``bad_hosts``; ``passed``/``reasons`` updated."""
    entries = slow_hosts(report.get("pairs"))
    if args.baseline:
        from ddpkit.verdicts.baseline import facts_of, judge_bench, load
        from ddpkit.verdicts.nodejudge import compare_to_baseline

        base = load(args.baseline)
        result = judge_bench(report, base, args.tolerance)
        facts = compare_to_baseline(report["world"]["members"], facts_of(base))
        result["facts"] = facts.as_dict()
        report["baseline"] = {"file": str(args.baseline), "made": base.get("made"), **result}
        if result["regressions"]:
            report["passed"] = False
            report["reasons"].append(f"{len(result['regressions'])} regression(s) against the baseline "
                                     f"(tolerance {args.tolerance:g}%): " + "; ".join(result["regressions"]))
        if facts.status == "FAIL":
            report["passed"] = False
            report["reasons"].append(facts.detail)
        named = facts.data.get("bad_hosts")
        for host, reasons in {**result["bad_hosts"], **(named if isinstance(named, dict) else {})}.items():
            entries += [(host, None, f"baseline: {r}") for r in reasons]
    slurm = {str(m["host"]): m.get("slurm_node") for m in report["world"]["members"]}
    report["bad_hosts"] = merge((h, slurm.get(h), r) for h, _, r in entries)


def act(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """Print the baseline comparison and the bad hosts' commands; drain on request; save the baseline."""
    base = report.get("baseline")
    if base:
        worst = sorted(base["compared"], key=lambda c: c["change_pct"])[:3]
        shown = ", ".join(f"{c['what']} {c['change_pct']:+.0f}%" for c in worst) or "nothing comparable"
        print(f"# baseline {base['file']} (made {base['made']}): {len(base['compared'])} figure(s) compared, "
              f"{len(base['regressions'])} regression(s) beyond {base['tolerance_pct']:g}%; worst: {shown}")
        for line in base["regressions"]:
            print(f"#   regression: {line}")
        for line in base["notes"]:
            print(f"#   note: {line}")
    lines = report_lines("bench", report["bad_hosts"])
    if report["bad_hosts"] and args.on_fail == "drain":
        lines += drain("bench", report["bad_hosts"])
    if lines:
        print("\n".join(f"# {line}" for line in lines))
    if args.save_baseline:
        if not report["passed"]:
            print(f"# not saved as a baseline: this run failed ({args.save_baseline} left as it was)",
                  file=sys.stderr)
            return
        from ddpkit.verdicts.baseline import from_bench, save

        facts = {str(m["host"]): m["facts"] for m in report["world"]["members"] if m.get("facts")}
        save(args.save_baseline, from_bench(report, argv=sys.argv[1:], facts=facts))
        print(f"# wrote baseline {args.save_baseline}")
