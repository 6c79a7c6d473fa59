"""Show who this process is, in which world, and from which launcher (``ddpkit env``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import timedelta
from typing import TYPE_CHECKING

from ddpkit.base.inputs import seconds
from ddpkit.env import LAUNCHERS, WorldInfo, explain

if TYPE_CHECKING:
    from ddpkit.env.start import RankStart

_FIELDS = ("launcher", "rank", "local_rank", "world_size", "local_world_size", "node_rank", "num_nodes",
           "master_addr", "master_port", "hosts", "restart_count", "run_id")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the record as one JSON line")
    p.add_argument("--explain", action="store_true", help="list every launcher tried and why it matched or not")
    p.add_argument("--connect", action="store_true",
                   help="also start the process group (ddpkit.init) and verify one all_reduce across the world")
    p.add_argument("--timeout", type=seconds("--timeout"), default=60.0, metavar="S",
                   help="seconds --connect waits for the other ranks")


def _connect(info: WorldInfo, timeout: float, backend: str | None) -> tuple[dict[str, object], list[dict]]:
    """Start the world, verify one all_reduce, and gather every rank's record on rank 0."""
    import socket

    import torch
    import torch.distributed as dist

    from ddpkit.runtime import init, shutdown

    rt = init(backend=backend, timeout=timedelta(seconds=timeout), world=info)
    try:
        t = torch.tensor([float(rt.rank + 1)], device=rt.device)
        dist.all_reduce(t)
        expected = rt.world_size * (rt.world_size + 1) / 2
        result: dict[str, object] = {"backend": rt.backend, "device": str(rt.device), "all_reduce": t.item(),
                  "all_reduce_expected": expected, "all_reduce_ok": t.item() == expected}
        mine = dict(info.as_dict(), host=socket.gethostname(), connect=result)
        gathered: list[dict | None] = [None] * rt.world_size
        dist.all_gather_object(gathered, mine)
        return result, [g for g in gathered if g is not None]
    finally:
        shutdown()


def run(args: argparse.Namespace, start: RankStart) -> int:
    info = start.world
    connected, world = _connect(info, args.timeout, args.backend) if args.connect else (None, [])
    if args.json:
        record = info.as_dict()
        if args.explain:
            record["explain"] = [{"launcher": n, "matched": m, "why": w} for n, m, w in explain()]
        if connected is not None:
            record["connect"] = connected
        # One write per line: ranks share stdout, and a write under PIPE_BUF bytes is never interleaved.
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), (json.dumps(record, sort_keys=True) + "\n").encode())
    elif connected is None:
        _print_table(info, args.explain)
    elif info.rank == 0:  # one table for the whole world, printed once
        _print_world(world)
        if args.explain:
            _print_table(info, True)
    return 0 if connected is None or connected["all_reduce_ok"] else 1


def _print_world(world: list[dict]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    first = world[0]
    # values are text, never rich markup: a host or run id such as '[/bold]' must print as itself (issue 20)
    table = Table(title=escape(f"ddpkit env: a world of {first['world_size']} rank(s) on {first['num_nodes']} node(s), "
                        f"launcher {first['launcher']}, master {first['master_addr']}:{first['master_port']}"))
    for col in ("rank", "local", "node", "host", "per node", "device", "all_reduce (expected)"):
        table.add_column(col)
    for r in sorted(world, key=lambda r: r["rank"]):
        c = r["connect"]
        mark = "OK" if c["all_reduce_ok"] else "WRONG"
        verdict = f"{c['all_reduce']:g} ({c['all_reduce_expected']:g}) {mark}"
        table.add_row(*(escape(str(cell)) for cell in (r["rank"], r["local_rank"], r["node_rank"], r["host"],
                                                        r["local_world_size"], c["device"], verdict)))
    console = Console(file=sys.stdout, soft_wrap=True)
    console.print(table)
    ok = all(r["connect"]["all_reduce_ok"] for r in world)
    console.print(f"backend {first['connect']['backend']}: all_reduce of (rank+1) across the world "
                  f"{'verified on every rank' if ok else 'WRONG on some rank'}")


def _print_table(info: WorldInfo, with_explain: bool) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(file=sys.stdout, soft_wrap=True)
    table = Table(title=escape(f"ddpkit env: rank {info.rank} of {info.world_size} ({info.launcher})"))
    table.add_column("field")
    table.add_column("value")
    table.add_column("from")
    for field in _FIELDS:
        value = getattr(info, field)
        shown = ",".join(value) if isinstance(value, tuple) else ("-" if value is None else str(value))
        table.add_row(field, escape(shown), escape(info.sources.get(field, "-")))
    console.print(table)
    for note in info.notes:
        console.print(f"note: {note}", markup=False)
    if with_explain:
        t = Table(title="launchers tried, in order (the first match wins)")
        t.add_column("launcher")
        t.add_column("matched")
        t.add_column("why")
        for name, matched, why in explain():
            t.add_row(name, "yes" if matched else "no", escape(why))
        console.print(t)
        for lnc in LAUNCHERS:  # every launcher's variables, not only the winner's
            for field, variables in lnc.table.items():
                console.print(f"  {lnc.name:<9} {field:<17} <- {variables}", markup=False, highlight=False)
