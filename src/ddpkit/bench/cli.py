"""Benchmark every collective with nccl-tests' conventions, verify every result, gate on bus bandwidth.

    ddpkit bench -n 2                                  # every op, 1K..16M, on 2 local ranks (gloo on CPU)
    ddpkit bench -n 2 --ops all_reduce -b 1M -e 64M -f 2 --min-busbw 1.0 --json bench.json --plot bench.png
    ddpkit bench -n 3 --pairs ranks                    # slow-link finder: every pair of ranks
    srun -N 4 ddpkit bench --pairs                     # every pair of nodes, N-1 rounds of simultaneous pairs
    srun -N 64 ddpkit bench --ring                     # quick: ring neighbours (2 rounds), then the suspects
    mpirun -np 2 ddpkit bench --transport both         # the same ops through torch's process group and through MPI

Exit codes: 0 all results right and every gate met; 1 a wrong element or a missed gate; 2 bad options;
3 ranks missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddpkit import __version__
from ddpkit.base.errors import EXIT_CHECK_FAILED, EXIT_OK, ConfigError
from ddpkit.base.inputs import output_path, seconds
from ddpkit.base.log import get_logger
from ddpkit.bench.busbw import OPS
from ddpkit.bench.ops import DTYPES, REDOPS
from ddpkit.bench.pairs import DEFAULT_SECONDS
from ddpkit.bench.sizes import parse_size, size_sweep
from ddpkit.verdicts.baseline import DEFAULT_TOLERANCE, baseline_path
from ddpkit.verdicts.remedy import add_on_fail_argument

if TYPE_CHECKING:
    from ddpkit.env.start import RankStart

__all__ = ["add_arguments", "run"]

log = get_logger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ops", default=None, metavar="OP[,OP...]",
                   help=f"collectives to run (default: all of {','.join(OPS)}; with --pairs: none)")
    p.add_argument("-b", "--begin", default="1K", metavar="SIZE", help="smallest size, e.g. 8, 1K, 64M (default 1K)")
    p.add_argument("-e", "--end", default="16M", metavar="SIZE", help="largest size (default 16M)")
    step = p.add_mutually_exclusive_group()
    step.add_argument("-f", "--factor", type=int, default=None, help="multiply the size by F each step (default 4)")
    step.add_argument("-i", "--increment", default=None, metavar="SIZE", help="add SIZE each step instead")
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="element type (default float32)")
    p.add_argument("--redop", default="sum", choices=REDOPS, help="reduction (default sum)")
    p.add_argument("--root", type=int, default=0, help="root rank of broadcast and reduce (default 0)")
    p.add_argument("-w", "--warmup", type=int, default=5, help="untimed iterations per measurement (default 5)")
    p.add_argument("--iters", type=int, default=20,
                   help="timed iterations per measurement (nccl-tests' -n; -n here is the number of ranks)")
    p.add_argument("--min-busbw", default=None, metavar="GBPS|OP=GBPS,...",
                   help="fail when the average bus bandwidth (or an op's) is below this, GB/s")
    p.add_argument("--pairs", nargs="?", const="nodes", choices=["nodes", "ranks"], default=None,
                   help="slow-link finder: bandwidth and latency of every pair of nodes (default) or ranks")
    schedule = p.add_mutually_exclusive_group()
    schedule.add_argument("--ring", action="store_true",
                          help="quick slow-node finder (implies --pairs): every endpoint against its ring neighbours "
                               "(2 rounds), then every pair among the suspects and a few healthy references")
    schedule.add_argument("--pairs-sequential", action="store_true",
                          help="measure one pair at a time (N(N-1)/2 rounds; the baseline for the round schedule)")
    p.add_argument("--pairs-size", default="4M", metavar="SIZE", help="bytes per pair transfer (default 4M)")
    p.add_argument("--pairs-iters", type=int, default=5, help="exchanges per pair, median taken (default 5)")
    p.add_argument("--pairs-seconds", type=seconds("--pairs-seconds"), default=DEFAULT_SECONDS, metavar="S",
                   help=f"time budget of one pair (default {DEFAULT_SECONDS:g}): a link too slow for --pairs-iters "
                        "whole transfers in S is measured on what it moved, so a slow node does not stretch every "
                        "round")
    p.add_argument("--pairs-threshold", type=float, default=0.5,
                   help="name links below this fraction of the reference bandwidth (default 0.5)")
    p.add_argument("--json", type=output_path("--json"), default=None, metavar="PATH",
                   help="write every row and the verdict as JSON")
    p.add_argument("--csv", type=output_path("--csv"), default=None, metavar="PATH", help="write every row as CSV")
    p.add_argument("--plot", type=output_path("--plot"), default=None, metavar="PATH.png",
                   help="plot busbw against size (needs matplotlib)")
    p.add_argument("--timeout", type=seconds("--timeout"), default=120.0,
                   help="seconds to wait for every rank (default 120)")
    p.add_argument("--save-baseline", type=output_path("--save-baseline"), default=None, metavar="FILE",
                   help="keep this run as the baseline: per op and size busbw and time, per link (--pairs) "
                        "bandwidth and latency, the hosts, versions and node facts")
    p.add_argument("--baseline", type=baseline_path, default=None, metavar="FILE",
                   help="judge each op, link and node against FILE; a regression fails the run (exit 1)")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE, metavar="PCT",
                   help=f"a figure more than PCT percent worse than its baseline is a regression "
                        f"(default {DEFAULT_TOLERANCE:g})")
    p.add_argument("--repeat", type=int, default=None, metavar="N",
                   help="run the sweep N times and keep each row's median (default 3 with --baseline or "
                        "--save-baseline, else 1)")
    add_on_fail_argument(p)
    p.add_argument("--transport", choices=["torch", "mpi", "both"], default="torch",
                   help="run the ops through torch's process group (default), through MPI (mpi4py, ddpkit[mpi]; "
                        "ranks started by mpirun, mpiexec or srun --mpi=pmix), or both, side by side")


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """Validate every option before any rank starts, so bad input is exit code 2 everywhere."""
    from ddpkit.bench.results import parse_gate
    from ddpkit.bench.sweep import SweepConfig

    if getattr(args, "ring", False) and not args.pairs:
        args.pairs = "nodes"
    if getattr(args, "pairs_sequential", False) and not args.pairs:
        raise ConfigError("--pairs-sequential without --pairs", "--pairs [nodes|ranks] --pairs-sequential",
                          "add --pairs, or drop --pairs-sequential")

    if args.ops is None:
        ops: tuple[str, ...] = () if args.pairs else OPS
    elif args.ops.strip() in ("all", "*"):
        ops = OPS
    else:
        ops = tuple(o.strip() for o in args.ops.split(",") if o.strip())
        if not ops:
            raise ConfigError(f"--ops {args.ops!r} names no collective", f"ops among {', '.join(OPS)}, or all",
                              "write --ops all_reduce,all_gather (or drop --ops to run them all)")
        unknown = [o for o in ops if o not in OPS]
        if unknown:
            raise ConfigError(f"--ops names {', '.join(unknown)}", f"ops among {', '.join(OPS)}",
                              "write --ops all_reduce,all_gather")
    sizes = size_sweep(parse_size(args.begin, option="-b"), parse_size(args.end, option="-e"), factor=args.factor
                       if args.factor is not None or args.increment is not None else 4,
                       increment=parse_size(args.increment, option="-i") if args.increment else None)
    for name in ("warmup", "iters", "pairs_iters"):
        if getattr(args, name) < (0 if name == "warmup" else 1):
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)}", "a positive count",
                              f"pass --{name.replace('_', '-')} 5")
    if not 0 < args.tolerance < 100:
        raise ConfigError(f"--tolerance {args.tolerance:g}", "a percentage between 0 and 100", "pass --tolerance 20")
    if args.repeat is None:
        args.repeat = 3 if args.baseline or args.save_baseline else 1
    if args.repeat < 1:
        raise ConfigError(f"--repeat {args.repeat}", "a positive count", "pass --repeat 3")
    if not 0 < args.pairs_threshold < 1:
        raise ConfigError(f"--pairs-threshold {args.pairs_threshold}", "a fraction between 0 and 1",
                          "pass --pairs-threshold 0.5")
    if (args.pairs or args.ring) and args.pairs_seconds * 2 > args.timeout:
        raise ConfigError(f"--pairs-seconds {args.pairs_seconds:g} with --timeout {args.timeout:g}",
                          "a pair's budget at most half the timeout (the ranks not in a pair wait for it)",
                          f"pass --timeout {args.pairs_seconds * 4:g}, or a smaller --pairs-seconds")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("--plot needs matplotlib, which is not installed", "the ddpkit 'plots' extra",
                          "pip install 'ddpkit[plots]' (or matplotlib), or drop --plot")
    cfg = SweepConfig(ops=ops, sizes=tuple(sizes), dtype=args.dtype, redop=args.redop, root=args.root,
                      warmup=args.warmup, iters=args.iters)
    return {"sweep": cfg, "gate": parse_gate(args.min_busbw),
            "pairs_size": parse_size(args.pairs_size, option="--pairs-size")}


def _write_outputs(args: argparse.Namespace, report: dict[str, Any]) -> None:
    from ddpkit.bench.results import csv_text

    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"# wrote {args.json}")
    if args.csv:
        Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
        Path(args.csv).write_text(csv_text(report["ops"]))
        print(f"# wrote {args.csv}")
    if args.plot:
        from ddpkit.bench.plot import plot_busbw

        world = report["world"]
        plot_busbw(report["ops"], args.plot, title=f"ddpkit bench: {world['world_size']} ranks, {report['backend']}"
                   f" on {report['device']}, {report['dtype']}")
        print(f"# wrote {args.plot}")


def _member(rt: Any, device: str, gpu_uuid: str | None) -> dict[str, Any]:
    """This rank in the world's list: where it runs, on what; the node's facts from its local rank 0."""
    import platform

    import torch

    facts = None
    if rt.world.local_rank == 0:
        from ddpkit.verdicts.nodefacts import gather

        facts = gather(master=os.environ.get("MASTER_ADDR"), rank=rt.rank)
    return {"rank": rt.rank, "host": socket.gethostname(), "pid": os.getpid(), "device": device,
            "gpu_uuid": gpu_uuid, "group_rank": rt.world.node_rank,
            "slurm_node": os.environ.get("SLURMD_NODENAME") or None, "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.version.cuda or "none", "facts": facts}


def run(args: argparse.Namespace, start: RankStart) -> int:
    import torch.distributed as dist

    from ddpkit import runtime
    from ddpkit.bench import judged
    from ddpkit.bench.pairs import format_pairs, measure_pairs
    from ddpkit.bench.results import avg_busbw, format_table, total_wrong, verdict
    from ddpkit.bench.sweep import run_sweep
    from ddpkit.verdicts.baseline import median_rows

    opts = _options(args)
    cfg = opts["sweep"]
    comm, world = None, start.world
    if args.transport != "torch":  # MPI's world is checked against torch's before the process group starts
        backend = runtime.pick_backend(args.backend)
        if backend != "gloo":  # MPI gets numpy views of the buffers: host memory only
            raise ConfigError(f"--transport {args.transport} with the process-group backend {backend}",
                              "CPU tensors (backend gloo): ddpkit hands MPI numpy views of host memory",
                              "pass --backend gloo, or --transport torch on GPUs")
        from ddpkit.comm.mpi_transport import open_mpi_world

        comm = open_mpi_world(world.rank, world.world_size, option=f"--transport {args.transport}")
    rt = runtime.init(backend=args.backend, timeout=timedelta(seconds=args.timeout), world=world)
    try:
        if not 0 <= cfg.root < rt.world_size:
            raise ConfigError(f"--root {cfg.root}", f"a rank between 0 and {rt.world_size - 1}", "pass --root 0")
        members: list[Any] = [None] * rt.world_size
        name, uuid = runtime.device_identity(rt.device)
        dist.all_gather_object(members, _member(rt, name, uuid))
        # sweep.time_launch: CUDA events around the batch on a GPU, the host's clock on CPU
        timer = "cuda-events" if rt.device.type == "cuda" else "perf_counter"
        lead = rt.rank == 0
        if lead:
            nodes = len({m["host"] for m in members})
            print(f"# ddpkit bench {__version__}: {rt.world_size} ranks on {nodes} node(s), backend {rt.backend}, "
                  f"dtype {cfg.dtype}, warmup {cfg.warmup}, iters {cfg.iters}, timer {timer}")
            for m in members:
                gpu = f" {m['gpu_uuid']}" if m["gpu_uuid"] else ""
                print(f"#  rank {m['rank']:>3} pid {m['pid']:>7} on {m['host']} device {m['device']}{gpu}")
        results = [] if args.transport == "mpi" else median_rows([
            run_sweep(cfg, rank=rt.rank, world_size=rt.world_size, backend=rt.backend, device=rt.device)
            for _ in range(args.repeat)])
        if lead:
            for result in results:
                print(format_table(result, rt.world_size))
        if comm is not None:
            mpi_results = run_sweep(cfg, rank=rt.rank, world_size=rt.world_size, backend=rt.backend,
                                    device=rt.device, mpi_comm=comm)
            if lead:
                from ddpkit.comm.mpi_transport import library_name

                print(f"# through MPI: {library_name()} (mpi4py)")
                for result in mpi_results:
                    print(format_table(result, rt.world_size))
            results += mpi_results
        pairs: dict[str, Any] | None = None
        if args.pairs:
            schedule = "ring" if args.ring else "sequential" if args.pairs_sequential else "rounds"
            pairs = measure_pairs(mode=args.pairs, size=opts["pairs_size"], iters=args.pairs_iters,
                                  threshold=args.pairs_threshold, rank=rt.rank, world_size=rt.world_size,
                                  device=rt.device, schedule=schedule, seconds=args.pairs_seconds).as_dict()
            if lead:
                print(format_pairs(pairs))
        passed, reasons = verdict(results, opts["gate"])
        if pairs and pairs["slow_endpoints"] + pairs["slow_links"]:
            reasons.append(f"slow {pairs['mode']}: {', '.join(pairs['slow_endpoints']) or 'none'}; slow links: "
                           + ", ".join(f"{a} <-> {b}" for a, b in pairs["slow_links"]))
            passed = False
        report = {"kind": "bench", "version": __version__, "backend": rt.backend, "device": rt.device.type,
                  "timer": timer, "dtype": cfg.dtype, "redop": cfg.redop, "warmup": cfg.warmup, "iters": cfg.iters,
                  "world": {"world_size": rt.world_size, "launcher": rt.world.launcher, "members": members},
                  "gate": opts["gate"], "ops": results, "avg_busbw": avg_busbw(results), "pairs": pairs,
                  "passed": passed, "reasons": reasons, "repeat": args.repeat}
        if lead:
            judged.judge(args, report)
            avg = report["avg_busbw"]
            unsupported = [f"{r['op']} ({r['reason']})" for r in results if not r["supported"]]
            wrong = total_wrong(results)
            if results:
                print(f"# Out of bounds values : {wrong} {'OK' if not wrong else 'ERROR'}")
                print(f"# Avg bus bandwidth    : {avg:.4f} GB/s" if avg is not None else "# Avg bus bandwidth    : -")
            if unsupported:
                print("# unsupported here: " + "; ".join(unsupported))
            passed = report["passed"]
            print("# verdict: PASS" if passed else "# verdict: FAIL\n" + "\n".join(f"#   {r}" for r in reasons))
            judged.act(args, report)
            _write_outputs(args, report)
        # Leave together (a rank that exits with 1 while rank 0 still writes gets rank 0 killed by the agent),
        # with rank 0's verdict: only it judged the baseline.
        verdict_of_lead = [passed]
        dist.broadcast_object_list(verdict_of_lead, src=0)
        return EXIT_OK if verdict_of_lead[0] else EXIT_CHECK_FAILED
    finally:
        runtime.shutdown()
