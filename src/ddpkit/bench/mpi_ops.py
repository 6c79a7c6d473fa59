"""The same collectives through MPI (mpi4py on numpy views of the same CPU buffers): ``ddpkit bench --transport mpi``.

Same inputs, same closed-form results, same #wrong count as ``bench/ops.py``, so a user sees side by side what the
process group and the system's MPI give on this cluster. MPI's in-place reduce_scatter leaves a rank's block at the
start of the buffer (torch's leaves it at the rank's offset): the output is taken from there. mpi4py is imported
lazily; ``comm.mpi_transport.open_mpi_world`` has checked the MPI world is torch's before anything runs here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ddpkit.bench.busbw import per_rank_count
from ddpkit.bench.ops import Case, Prepared, _torch_dtype, fill_all_to_all_input
from ddpkit.comm.closed_form import BENCH

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
    """Allocate the buffers of ``case`` and bind the mpi4py call that runs it on ``comm``."""
    import torch
    from mpi4py import MPI

    dt = _torch_dtype(case.dtype)
    n, r, op, root = case.world_size, case.rank, case.op, case.root
    c = per_rank_count(op, case.count, n)
    full = torch.empty(case.count, dtype=dt, device=device)
    full_np = full.numpy()  # a view: MPI reads and writes the tensor's memory
    redop = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}[case.redop]

    def fill_full() -> None:
        full.copy_(BENCH.base(case.count, dt, device) + BENCH.add(r))

    if op == "all_reduce":
        return Prepared(launch=lambda: comm.Allreduce(MPI.IN_PLACE, full_np, redop), output=full, reset=fill_full)
    if op == "reduce":
        def reduce() -> None:
            if r == root:
                comm.Reduce(MPI.IN_PLACE, full_np, redop, root)
            else:
                comm.Reduce(full_np, None, redop, root)
        return Prepared(launch=reduce, output=full, reset=fill_full)
    if op == "broadcast":
        def fill_bcast() -> None:
            if r == root:
                fill_full()
            else:
                full.zero_()  # so a broadcast that never arrives shows as wrong
        return Prepared(launch=lambda: comm.Bcast(full_np, root), output=full, reset=fill_bcast)
    if op == "all_gather":
        out = torch.empty(case.count, dtype=dt, device=device)
        inp = out.narrow(0, r * c, c) if case.in_place else torch.empty(c, dtype=dt, device=device)
        out_np, inp_np = out.numpy(), inp.numpy()

        def fill_gather() -> None:
            out.zero_()
            inp.copy_(BENCH.base(c, dt, device) + BENCH.add(r))
        send = MPI.IN_PLACE if case.in_place else inp_np
        return Prepared(launch=lambda: comm.Allgather(send, out_np), output=out, reset=fill_gather)
    if op == "reduce_scatter":
        if case.in_place:
            return Prepared(launch=lambda: comm.Reduce_scatter_block(MPI.IN_PLACE, full_np, redop),
                            output=full.narrow(0, 0, c), reset=fill_full)
        rs_out = torch.empty(c, dtype=dt, device=device)
        rs_np = rs_out.numpy()
        return Prepared(launch=lambda: comm.Reduce_scatter_block(full_np, rs_np, redop), output=rs_out,
                        reset=fill_full)
    if op == "all_to_all":
        a2a_out = torch.empty(case.count, dtype=dt, device=device)
        a2a_np = a2a_out.numpy()

        def fill_a2a() -> None:
            fill_all_to_all_input(full, c, n, r)
            a2a_out.zero_()
        return Prepared(launch=lambda: comm.Alltoall(full_np, a2a_np), output=a2a_out, reset=fill_a2a)
    if op == "sendrecv":
        recv = torch.empty(case.count, dtype=dt, device=device)
        recv_np = recv.numpy()

        def fill_sendrecv() -> None:
            fill_full()
            recv.zero_()
        return Prepared(launch=lambda: comm.Sendrecv(full_np, (r + 1) % n, recvbuf=recv_np, source=(r - 1) % n),
                        output=recv, reset=fill_sendrecv)
    raise ValueError(f"unknown op {op!r}")
