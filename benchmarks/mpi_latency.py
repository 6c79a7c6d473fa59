"""Worker for benchmarks/bench_mpi.py, run under ``mpirun -np 2``: small all-reduce latency through ddpkit's MPI
transport (the Sum that the gradient hook calls: MPI.Allreduce in place, a Future, the ``then`` callback) against
raw mpi4py ``comm.Allreduce`` on the same buffer, in the same processes, alternating batches. Prints one RESULT line
on rank 0."""

from __future__ import annotations

import json
import statistics
import time

import torch

from ddpkit.comm.gradients import TRANSPORTS
from ddpkit.comm.mpi_transport import open_mpi_world

ROUNDS, ITERS = 41, 200


def main() -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    comm = open_mpi_world(comm.Get_rank(), comm.Get_size())
    total = TRANSPORTS["mpi"](comm.Get_size())
    out: dict[str, object] = {}
    for floats in (1, 23, 1024):  # 4 B; the seeds' Linear(20,1) bucket with the stop flag (92 B); 4 KiB
        tensor = torch.ones(floats)
        view = tensor.numpy()

        def ddpkit_path(tensor: torch.Tensor = tensor) -> None:
            total(tensor, lambda t: t).wait()  # the transport alone: the hook divides afterwards either way

        def raw(view: object = view) -> None:
            comm.Allreduce(MPI.IN_PLACE, view)

        def raw_tensor(tensor: torch.Tensor = tensor) -> None:  # what a torch user of mpi4py writes
            comm.Allreduce(MPI.IN_PLACE, tensor.numpy())

        fns = {"ddpkit": ddpkit_path, "raw": raw, "raw_tensor": raw_tensor}
        ratios: dict[str, list[float]] = {"raw": [], "raw_tensor": []}
        per: dict[str, list[float]] = {name: [] for name in fns}
        for r in range(ROUNDS):
            times = {}
            for name in (list(fns) if r % 2 == 0 else list(reversed(fns))):
                fn = fns[name]
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(ITERS):
                    fn()
                times[name] = comm.allreduce((time.perf_counter() - t0) / ITERS, op=MPI.MAX)
                per[name].append(times[name] * 1e6)
            for base in ratios:
                ratios[base].append(times["ddpkit"] / times[base])
        out[f"{floats * 4}B"] = {**{f"{k}_us": statistics.median(v) for k, v in per.items()},
                                 **{f"ratio_vs_{k}": statistics.median(v) for k, v in ratios.items()},
                                 "rounds": ROUNDS, "iters": ITERS}
    if comm.Get_rank() == 0:
        print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
