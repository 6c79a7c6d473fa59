"""Node facts judged across nodes, and against a baseline: which node is different, and in what (pure logic).

Each node's facts (``ddpkit.verdicts.nodefacts.gather``, read by its local rank 0) are flattened into fields
(``nic.mtu``, ``gpu.pcie_width``...). A field where one node differs from the others' most common value (on a
tie, rank 0's node's) is named with the hosts that differ. A difference that breaks collectives or throughput
(MTU, link speed, GPU count, PCIe width) is a FAIL; one that is only unusual (kernel, memory, cores...) is a
note (WARN). Some facts fail on one node alone: a GPU whose PCIe link runs narrower than it can, or with
uncorrected ECC errors.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from ddpkit.verdicts.outcome import PASS, WARN, Outcome, failed

__all__ = ["FAIL_FIELDS", "compare_to_baseline", "flatten", "judge_nodes", "node_facts"]

Record = dict[str, Any]
# A different MTU fragments or drops gloo's and NCCL's large messages; a slower link, a missing GPU or a narrower
# PCIe link caps every collective's bandwidth at that node's.
FAIL_FIELDS = ("nic.mtu", "nic.speed_mbps", "gpu.count", "gpu.pcie_width")
MEMORY_TOLERANCE = 0.05  # identical machines differ by the kernel's reservations: under 5% is the same memory


def node_facts(records: Sequence[Record]) -> list[dict[str, Any]]:
    """One entry per node (group rank, host): its ranks, Slurm node name, and the facts its local rank 0 read."""
    nodes: dict[tuple[int, str], dict[str, Any]] = {}
    # tolerant of older reports (report --baseline reads them): no group rank -> grouped by host
    for r in sorted(records, key=lambda r: int(r.get("rank", 0))):
        key = (int(r.get("group_rank", -1)), str(r["host"]))
        node = nodes.setdefault(key, {"node": key[0], "host": key[1], "slurm_node": r.get("slurm_node"),
                                      "ranks": [], "facts": None})
        node["ranks"].append(int(r.get("rank", 0)))
        if r.get("facts") and node["facts"] is None:
            node["facts"] = r["facts"]
    return [nodes[k] for k in sorted(nodes)]


def _label(node: Mapping[str, Any], nodes: Sequence[Mapping[str, Any]]) -> str:
    """The host name; with the node number where several nodes share one host name."""
    shared = sum(n["host"] == node["host"] for n in nodes) > 1
    return f"{node['host']} (node {node['node']})" if shared else str(node["host"])


def flatten(facts: Mapping[str, Any]) -> dict[str, str]:
    """The comparable fields of one node's facts, as text (absent facts are left out, never compared)."""
    out: dict[str, str] = {}
    for key in ("cores", "memory_gib", "numa_nodes", "kernel", "os"):
        if facts.get(key) is not None:
            out[key] = str(facts[key])
    for key in ("name", "speed_mbps", "mtu", "driver"):
        value = (facts.get("nic") or {}).get(key)
        if value is not None:
            out[f"nic.{key}"] = str(value)
    gpus = facts.get("gpus")
    if gpus is not None:
        out["gpu.count"] = str(len(gpus))
        for key, name in (("model", "model"), ("driver", "driver"), ("cuda_driver", "cuda_driver"),
                          ("pcie_width", "pcie_width"), ("pcie_gen_max", "pcie_gen_max")):
            values = sorted({str(g.get(key)) for g in gpus if g.get(key) is not None})
            if values:
                out[f"gpu.{name}"] = ",".join(values)
    return out


def _same(field: str, a: str, b: str) -> bool:
    if field == "memory_gib":
        x, y = float(a), float(b)
        return abs(x - y) <= MEMORY_TOLERANCE * max(x, y)
    return a == b


def _alone(facts: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """(failures, notes) one node's facts show by themselves."""
    fails, notes = [], []
    nic = facts.get("nic") or {}
    if nic.get("up") is False:
        fails.append(f"interface {nic.get('name')} is down")
    if str(facts.get("gpu_source", "")).startswith("NVML error"):
        fails.append(str(facts["gpu_source"]))
    for g in facts.get("gpus") or ():
        gpu = f"GPU {g['index']} ({g.get('model')})"
        width, widest = g.get("pcie_width"), g.get("pcie_width_max")
        if width is not None and widest is not None and width < widest:
            fails.append(f"{gpu} PCIe link x{width} of x{widest}")
        if g.get("ecc_uncorrected"):
            fails.append(f"{gpu} {g['ecc_uncorrected']} uncorrected ECC error(s) since the driver loaded")
        if g.get("remapped_rows_failed"):
            fails.append(f"{gpu} row remapping failed")
        if g.get("retired_pages"):
            notes.append(f"{gpu} {g['retired_pages']} retired page(s)")
    return fails, notes


def judge_nodes(records: Sequence[Record]) -> list[Outcome]:
    """``node-facts`` (PASS, or FAIL naming hosts and fields) and, where only unusual fields differ, ``node-notes``."""
    nodes = [n for n in node_facts(records) if n["facts"]]
    if not nodes:
        return []
    flat = {_label(n, nodes): flatten(n["facts"]) for n in nodes}
    reference = next((_label(n, nodes) for n in nodes if 0 in n["ranks"]), None)
    fails: list[str] = []
    notes: list[str] = []
    bad: dict[str, list[str]] = defaultdict(list)
    for field in sorted({f for fields in flat.values() for f in fields}):
        values: dict[str, list[str]] = defaultdict(list)
        for host, fields in flat.items():
            if field in fields:
                match = next((v for v in values if _same(field, v, fields[field])), fields[field])
                values[match].append(host)
        if len(values) < 2:
            continue
        common = max(values.items(), key=lambda kv: (len(kv[1]), reference in kv[1]))[0]
        others = [(v, hs) for v, hs in values.items() if v != common]
        text = f"{field}: " + "; ".join(f"{v} on {', '.join(hs)}" for v, hs in others) + \
               f" ({common} on {', '.join(values[common])})"
        (fails if field in FAIL_FIELDS else notes).append(text)
        if field in FAIL_FIELDS:
            for v, hs in others:
                for h in hs:
                    bad[h].append(f"{field} {v} (others {common})")
    for n in nodes:
        alone_fails, alone_notes = _alone(n["facts"])
        host = _label(n, nodes)
        fails += [f"{host}: {t}" for t in alone_fails]
        notes += [f"{host}: {t}" for t in alone_notes]
        bad[host] += alone_fails
    out = []
    data: dict[str, object] = {"bad_hosts": {h: rs for h, rs in bad.items() if rs}}
    if fails:
        out.append(failed("node-facts", "nodes differ where it breaks collectives or throughput: " + "; ".join(fails),
                          data=data))
    else:
        out.append(Outcome(name="node-facts", status=PASS, detail=_summary(flat, len(nodes))))
    if notes:
        out.append(Outcome(name="node-notes", status=WARN, detail="unusual, not fatal: " + "; ".join(notes)))
    return out


def _summary(flat: Mapping[str, Mapping[str, str]], count: int) -> str:
    first = next(iter(flat.values()))
    shown = [f"{first[k]} {label}" for k, label in (("cores", "cores"), ("memory_gib", "GiB"),
                                                    ("numa_nodes", "NUMA node(s)")) if k in first]
    if "nic.name" in first:
        speed = first.get("nic.speed_mbps", "0")
        speed = "speed not reported" if speed == "0" else f"{speed} Mb/s"  # virtual devices report none
        shown.append(f"{first['nic.name']} {speed} MTU {first.get('nic.mtu', '?')}")
    if "gpu.count" in first:
        shown.append(f"{first['gpu.count']} GPU(s) {first.get('gpu.model', '')} PCIe x{first.get('gpu.pcie_width')}")
    head = "1 node" if count == 1 else f"{count} nodes agree where it matters"
    return f"{head}: " + ", ".join(shown)


def compare_to_baseline(records: Sequence[Record], baseline: Mapping[str, Mapping[str, Any]]) -> Outcome:
    """``baseline-facts``: each node's facts against the ones recorded for its host (``baseline``: host -> facts).
    A changed field of FAIL_FIELDS fails; other changes, and hosts the baseline does not know, are notes."""
    nodes = [n for n in node_facts(records) if n["facts"]]
    fails: list[str] = []
    notes: list[str] = []
    bad: dict[str, list[str]] = defaultdict(list)
    for n in nodes:
        host = str(n["host"])
        if host not in baseline:
            notes.append(f"{host} is not in the baseline")
            continue
        then, now = flatten(baseline[host]), flatten(n["facts"])
        for field in sorted(set(then) & set(now)):
            if not _same(field, then[field], now[field]):
                text = f"{host} {field} {now[field]} (baseline {then[field]})"
                (fails if field in FAIL_FIELDS else notes).append(text)
                if field in FAIL_FIELDS:
                    bad[host].append(f"{field} {now[field]} (baseline {then[field]})")
    missing = sorted(set(baseline) - {str(n["host"]) for n in nodes})
    if missing:
        notes.append(f"in the baseline but not in this run: {', '.join(missing)}")
    if fails:
        return failed("baseline-facts", "facts changed since the baseline: " + "; ".join(fails + notes),
                      data={"bad_hosts": dict(bad)})  # host -> reasons
    if notes:
        return Outcome(name="baseline-facts", status=WARN, detail="; ".join(notes))
    return Outcome(name="baseline-facts", status=PASS,
                   detail=f"{len(nodes)} node(s): facts unchanged since the baseline")



def bad_hosts(outcomes: Sequence[Outcome], records: Sequence[Record], *, hosts: Sequence[str],
              local_world_size: int) -> list[dict[str, Any]]:
    """Every host a failed check names, with the reasons: the hosts an outcome names itself (node facts), else
    the hosts of its bad ranks (a missing rank's host from the launcher's host list, where it gives one)."""
    from ddpkit.verdicts.outcome import FAIL
    from ddpkit.verdicts.remedy import merge

    by_rank = {int(r["rank"]): r for r in records}
    by_host = {str(r["host"]): r.get("slurm_node") for r in records}
    nodes = [n for n in node_facts(records) if n["facts"]]
    by_label = {_label(n, nodes): n.get("slurm_node") for n in nodes}  # several slurmd on one host: by node
    entries: list[tuple[str, str | None, str]] = []
    for o in outcomes:
        if o.status != FAIL:
            continue
        named = o.data.get("bad_hosts")
        if isinstance(named, dict) and named:
            for label, reasons in named.items():
                host = label.split(" (node ")[0]
                node = by_label.get(label) or by_host.get(host)
                entries += [(host, node, f"{o.name}: {reason}") for reason in reasons]
            continue
        per_host: dict[str, list[int]] = defaultdict(list)
        for rank in o.bad_ranks:
            if rank in by_rank:
                per_host[str(by_rank[rank]["host"])].append(rank)
            elif rank // max(1, local_world_size) < len(hosts):  # a missing rank: where it should have run
                per_host[hosts[rank // max(1, local_world_size)]].append(rank)
        for host, ranks in per_host.items():
            what = "missing" if o.name == "roll-call" else "failed"
            node = by_host.get(host) or (host if host in hosts and host not in by_host else None)
            entries.append((host, node, f"{o.name} {what} on rank(s) {', '.join(map(str, sorted(ranks)))}"))
    return merge(entries)
