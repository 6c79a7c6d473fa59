"""Consistency across ranks: versions must agree (a failure); NCCL_*/GLOO_* settings should (a warning, by host)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from ddpkit.verdicts.outcome import PASS, WARN, Outcome, failed

__all__ = ["WARN_PREFIXES", "judge_consistency", "judge_network"]

VERSION_FIELDS = ("python", "torch", "ddpkit", "cuda")
WARN_PREFIXES = ("NCCL_", "GLOO_")


def _ranks_text(ranks: Sequence[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def judge_consistency(records: Sequence[dict[str, Any]]) -> list[Outcome]:
    """One outcome for versions and one for the communication settings."""
    out = []
    differing = []
    bad: set[int] = set()
    for fld in VERSION_FIELDS:
        values: dict[str, list[int]] = defaultdict(list)
        for r in records:
            values[str(r[fld])].append(int(r["rank"]))
        if len(values) > 1:
            # the most common value is the reference; on a tie, rank 0's
            majority = max(values.items(), key=lambda kv: (len(kv[1]), 0 in kv[1]))[0]
            differing.append(f"{fld}: " + ", ".join(f"{v} on {_ranks_text(rs)}" for v, rs in sorted(values.items())))
            bad.update(r for v, rs in values.items() if v != majority for r in rs)
    if differing:
        out.append(failed("versions", "ranks run different versions: " + "; ".join(differing), bad_ranks=bad))
    else:
        r0 = records[0]
        out.append(Outcome(name="versions", status=PASS,
                           detail=f"python {r0['python']}, torch {r0['torch']}, ddpkit {r0['ddpkit']}, "
                                  f"cuda {r0['cuda']} on every rank"))

    names = sorted({k for r in records for k in r["env"] if k.startswith(WARN_PREFIXES)})
    mismatched = []
    for name in names:
        by_host: dict[str, set[str]] = defaultdict(set)
        for r in records:
            by_host[r["host"]].add(r["env"].get(name, "<unset>"))
        if len({v for vs in by_host.values() for v in vs}) > 1:
            per_host = ", ".join(f"{h}={'|'.join(sorted(vs))}" for h, vs in sorted(by_host.items()))
            mismatched.append(f"{name}: {per_host}")
    if mismatched:
        out.append(Outcome(name="comm-settings", status=WARN,
                           detail="NCCL_*/GLOO_* differ between ranks: " + "; ".join(mismatched)))
    else:
        shown = ", ".join(f"{n}={records[0]['env'][n]}" for n in names) or "none set"
        out.append(Outcome(name="comm-settings", status=PASS,
                           detail=f"NCCL_*/GLOO_* identical on every rank ({shown})"))
    return out


def judge_network(records: Sequence[dict[str, Any]]) -> Outcome:
    """The interface each host uses to reach the master; loopback in a multi-host world is a warning."""
    by_host: dict[str, set[str]] = defaultdict(set)
    for r in records:
        by_host[r["host"]].add(f"{r['iface'] or '?'} ({r['ip']})")
    routes = "; ".join(f"{h} via {', '.join(sorted(v))}" for h, v in sorted(by_host.items()))
    master = records[0]["master"]
    if len(by_host) > 1 and any(r["iface"] == "lo" for r in records):
        return Outcome(name="route-to-master", status=WARN,
                       detail=f"several hosts, but some reach the master {master} over loopback: {routes}; "
                              "set MASTER_ADDR to rank 0's routable address")
    chosen = sorted({r["host"] for r in records if r.get("iface_why")})
    why = (f"; GLOO_SOCKET_IFNAME set by ddpkit on {', '.join(chosen)} to the interface that routes to the master "
           "(unset, gloo advertises the address the hostname resolves to)") if chosen else ""
    return Outcome(name="route-to-master", status=PASS, detail=f"master {master}: {routes}{why}")
