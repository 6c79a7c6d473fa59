"""The same collectives through MPI (mpi4py on numpy views of the same CPU buffers): ``ddpkit bench --transport mpi``.

Same inputs, same closed-form results, same #wrong count as ``bench/ops.py``, so a user sees side by side what the
process group and the system's MPI give on this cluster. MPI's in-place reduce_scatter leaves a rank's block at the
start of the buffer (torch's leaves it at the rank's offset): the output is taken from there. mpi4py is imported
lazily; ``comm.mpi_transport.open_mpi_world`` has checked the MPI world is torch's before anything runs here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ddpkit.bench.busbw import per_rank_count
from ddpkit.bench.ops import Case, Prepared, buffers

if TYPE_CHECKING:
    import torch

__all__ = ["MPI_BENCH_DTYPES", "mpi_unsupported_reason", "prepare_mpi"]

#: numpy views MPI reduces with its standard types (half precisions have none in MPI 3/4).
MPI_BENCH_DTYPES = ("float32", "float64", "int32", "int64", "int8", "uint8")


def mpi_unsupported_reason(dtype: str, device_type: str) -> str | None:
    """Why MPI cannot run the ops here, known before trying; None when it should run."""
    if device_type != "cpu":
        return f"ddpkit's MPI path works on CPU buffers, not {device_type}"
    if dtype not in MPI_BENCH_DTYPES:
        return f"MPI has no standard {dtype} type to reduce"
    return None


def prepare_mpi(case: Case, device: torch.device, comm: Any) -> Prepared:
    """Allocate the buffers of ``case`` (``ops.buffers``, as the process group's) and bind the mpi4py call that runs
    it on ``comm``."""
    from mpi4py import MPI

    b = buffers(case, device)
    n, r, root = case.world_size, case.rank, case.root
    full, out = b.full, b.output
    full_np, out_np = full.numpy(), out.numpy()  # views: MPI reads and writes the tensors' memory
    redop = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[case.redop]
    if case.op == "reduce_scatter" and case.in_place:  # MPI leaves the rank's block at the buffer's start
        out = full.narrow(0, 0, per_rank_count(case.op, case.count, n))
    gathered = MPI.IN_PLACE if case.in_place or b.block is None else b.block.numpy()  # all_gather's own block

    def reduce() -> None:
        if r == root:
            comm.Reduce(MPI.IN_PLACE, full_np, redop, root)
        else:
            comm.Reduce(full_np, None, redop, root)

    def reduce_scatter() -> None:
        if case.in_place:
            comm.Reduce_scatter_block(MPI.IN_PLACE, full_np, redop)
        else:
            comm.Reduce_scatter_block(full_np, out_np, redop)

    launches: dict[str, Callable[[], object]] = {
        "all_reduce": lambda: comm.Allreduce(MPI.IN_PLACE, full_np, redop),
        "reduce": reduce,
        "broadcast": lambda: comm.Bcast(full_np, root),
        "all_gather": lambda: comm.Allgather(gathered, out_np),
        "reduce_scatter": reduce_scatter,
        "all_to_all": lambda: comm.Alltoall(full_np, out_np),
        "sendrecv": lambda: comm.Sendrecv(full_np, (r + 1) % n, recvbuf=out_np, source=(r - 1) % n),
    }
    if case.op not in launches:
        raise ValueError(f"unknown op {case.op!r}")
    return Prepared(launch=launches[case.op], output=out, reset=b.reset)
