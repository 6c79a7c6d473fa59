"""Roll-call: every rank checks in to rank 0's store before any collective, so a missing rank is named, not waited for.

Each rank takes a slot with an atomic ``add`` (two processes claiming one rank get two slots, so duplicates are
seen) and writes its record there. Rank 0 waits, in one store call, until the first world-size slots are
written or the deadline passes, reads every record in one ``multi_get`` (``read_all``), judges the world
(``judge``, a pure function) and publishes a verdict the others wait for. Rank 0's store traffic is a constant
number of requests whatever the world size (it polled and read slot by slot before: 2N round trips, and a
request every 50 ms while it waited).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ddpkit import __version__
from ddpkit.base.errors import EXIT_MISSING, EXIT_USAGE
from ddpkit.base.fault_injection import fault
from ddpkit.base.netinfo import route_to
from ddpkit.env import WorldInfo
from ddpkit.runtime import shared_gpus
from ddpkit.verdicts.outcome import PASS, Outcome, failed

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["ENV_PREFIXES", "check_in", "collect", "expected_host", "judge", "local_record", "read_all"]

Record = dict[str, Any]
ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_")
ENV_NAMES = ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
VERSION_FIELDS = ("python", "torch", "ddpkit", "cuda")


def distributed_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that change how torch.distributed behaves: NCCL_*, GLOO_*, TORCH_*, threads, visible devices."""
    environ = os.environ if environ is None else environ
    return {k: v for k, v in sorted(environ.items()) if k.startswith(ENV_PREFIXES) or k in ENV_NAMES}


def local_record(world: WorldInfo, *, device: str, gpu_uuid: str | None) -> Record:
    """This rank's roll-call record (JSON-ready)."""
    import torch

    master = os.environ.get("MASTER_ADDR", world.master_addr or "127.0.0.1")
    try:
        iface, ip = route_to(master)
    except OSError as exc:
        iface, ip = None, f"no route to {master}: {exc}"
    from ddpkit.runtime import interface_choice

    choice = interface_choice()
    facts, facts_s = None, None
    if world.local_rank == 0:  # once per node: its other ranks share the machine
        from ddpkit.verdicts.nodefacts import gather

        t = time.perf_counter()
        facts = gather(master=master, rank=world.rank)
        facts_s = round(time.perf_counter() - t, 4)
    record: Record = {
        "host": socket.gethostname(), "ip": ip, "iface": iface,
        "iface_why": choice.reason if choice and choice.chosen_by_ddpkit else None,
        "pid": os.getpid(), "launcher": world.launcher,
        "rank": world.rank, "local_rank": world.local_rank, "group_rank": world.node_rank,
        "local_world_size": world.local_world_size, "world_size": world.world_size, "num_nodes": world.num_nodes,
        "hosts": list(world.hosts), "master": f"{master}:{os.environ.get('MASTER_PORT', world.master_port)}",
        "device": device, "gpu_uuid": gpu_uuid, "threads": torch.get_num_threads(),
        "python": platform.python_version(), "torch": torch.__version__, "ddpkit": __version__,
        "cuda": torch.version.cuda or getattr(torch.version, "hip", None) or "none",
        "env": distributed_env(), "slurm_node": os.environ.get("SLURMD_NODENAME") or None,
        "facts": facts, "facts_seconds": facts_s,
    }
    forged = fault("version", rank=world.rank)  # test hook: pretend this rank runs other versions
    if forged:
        record.update({k: v for k, v in forged.items() if k in VERSION_FIELDS})
    return record


def check_in(store: dist.Store, record: Record) -> int:
    """Write ``record`` to a fresh slot; return the slot number."""
    slot = int(store.add("rollcall/count", 1)) - 1
    # wall clock, so rank 0 can tell how long the roll-call took after the last rank arrived (one clock per host)
    store.set(f"rollcall/slot/{slot}", json.dumps({**record, "checked_in_at": time.time()}))
    return slot


def read_all(store: dist.Store, keys: Sequence[str], timeout: float) -> list[bytes]:
    """Wait for every key, then read them all: two requests to the store, whatever the number of keys.

    ``multi_get`` arrived in torch 2.5 (TCPStore, PrefixStore); older stores are read key by key."""
    from datetime import timedelta

    if not keys:
        return []
    store.wait(list(keys), timedelta(seconds=timeout))
    if hasattr(store, "multi_get"):
        return list(store.multi_get(list(keys)))
    return [store.get(k) for k in keys]


def collect(store: dist.Store, world_size: int, timeout: float) -> tuple[list[Record], float]:
    """Rank 0: wait until ``world_size`` records arrived or ``timeout`` passed; return them and the seconds waited."""
    from datetime import timedelta

    start = time.monotonic()
    # one blocking request: the store answers when the last of the slots is written. A timeout (DistStoreError,
    # a RuntimeError) means ranks are missing: judge() names them.
    with contextlib.suppress(RuntimeError):
        store.wait([f"rollcall/slot/{s}" for s in range(world_size)], timedelta(seconds=timeout))
    waited = time.monotonic() - start
    count = int(store.add("rollcall/count", 0))  # duplicates may have claimed slots beyond the world size
    # a claimed slot's record follows within microseconds of its claim
    raw = read_all(store, [f"rollcall/slot/{s}" for s in range(count)], timeout=5.0)
    return [{**json.loads(v), "slot": slot} for slot, v in enumerate(raw)], waited


def expected_host(rank: int, records: Sequence[Record], hosts: Sequence[str], local_world_size: int) -> str:
    """Where a missing rank should have run: from the launcher's host list, else from its node's other ranks."""
    node = rank // max(1, local_world_size)
    if node < len(hosts):
        return f"node {node} ({hosts[node]})"
    seen = sorted({r["host"] for r in records if r["group_rank"] == node})
    return f"node {node} ({', '.join(seen)})" if seen else f"node {node} (host unknown: no rank of it checked in)"


def judge(records: Sequence[Record], *, world_size: int, hosts: Sequence[str], local_world_size: int,
          timeout: float, waited: float) -> list[Outcome]:
    """Roll-call outcomes: missing ranks (exit 3), duplicate ranks, world-size disagreement, shared GPUs (exit 2)."""
    out: list[Outcome] = []
    by_rank: dict[int, list[Record]] = defaultdict(list)
    for r in records:
        by_rank[int(r["rank"])].append(r)
    missing = [r for r in range(world_size) if r not in by_rank]
    if missing:
        where = "; ".join(f"rank {r} on {expected_host(r, records, hosts, local_world_size)}" for r in missing)
        out.append(failed("roll-call", f"{len(missing)} of {world_size} ranks never checked in within "
                          f"{timeout:g} s: {where}", bad_ranks=missing, code=EXIT_MISSING,
                          seconds=waited, data={"missing": missing}))
    dups = {r: rs for r, rs in by_rank.items() if len(rs) > 1}
    if dups:
        text = "; ".join(f"rank {r} claimed by " + ", ".join(f"{x['host']} pid {x['pid']}" for x in rs)
                         for r, rs in sorted(dups.items()))
        out.append(failed("unique-ranks", f"two processes claim one rank: {text}", bad_ranks=dups, code=EXIT_USAGE))
    sizes: dict[int, list[int]] = defaultdict(list)
    for r in records:
        sizes[int(r["world_size"])].append(int(r["rank"]))
    outside = sorted(int(r["rank"]) for r in records if not 0 <= int(r["rank"]) < world_size)
    if len(sizes) > 1 or outside:
        text = "; ".join(f"WORLD_SIZE={s} on ranks {sorted(rs)}" for s, rs in sorted(sizes.items()))
        bad = [r for s, rs in sizes.items() if s != world_size for r in rs] + outside
        out.append(failed("world-size", f"ranks disagree on the world size (rank 0 says {world_size}): {text}",
                          bad_ranks=bad, code=EXIT_USAGE))
    gpus = [(int(r["rank"]), str(r["host"]), str(r["gpu_uuid"] or r["device"])) for r in records
            if r["device"] != "cpu"]
    shared = shared_gpus(gpus)
    if shared:
        out.append(failed("one-gpu-per-rank", f"two ranks bound to one GPU: {'; '.join(shared)}",
                          bad_ranks=[r for rs in shared.values() for r in rs], code=EXIT_USAGE))
    elif gpus:
        out.append(Outcome(name="one-gpu-per-rank", status=PASS, detail=f"{len(gpus)} distinct GPUs"))
    if not out:
        nodes = len({r["host"] for r in records})
        out.append(Outcome(name="roll-call", status=PASS, seconds=waited,
                           detail=f"{world_size}/{world_size} ranks on {nodes} host(s) in {waited:.2f} s"))
    return out
