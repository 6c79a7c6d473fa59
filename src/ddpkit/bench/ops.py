"""Each collective: its buffers, how to launch it, and the closed-form result every rank must see.

Inputs follow a fixed pattern so that each result is known without a reference run (``ddpkit.comm.closed_form.BENCH``):
``p[j] = j mod 7``, and rank ``r`` adds ``(r mod 4) + 1`` (all_to_all adds a value per destination chunk). Every
value stays a small integer, exact in every float type for the rank counts ddpkit targets; half precisions are
compared with a tolerance.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ddpkit.base.fault_injection import fault
from ddpkit.bench.busbw import per_rank_count
from ddpkit.comm.closed_form import BENCH, mismatches
from ddpkit.comm.torch_compat import all_gather_single, reduce_scatter_single

if TYPE_CHECKING:
    import torch

__all__ = ["DTYPES", "REDOPS", "Buffers", "Case", "Prepared", "buffers", "count_wrong", "modes", "prepare",
           "unsupported_reason"]

DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "int8", "uint8")
REDOPS = ("sum", "max", "min")
IN_PLACE_ONLY = frozenset({"all_reduce", "broadcast", "reduce"})  # torch's API has no out-of-place form
OUT_OF_PLACE_ONLY = frozenset({"all_to_all", "sendrecv"})
ROOTED = frozenset({"broadcast", "reduce"})
REDUCING = frozenset({"all_reduce", "reduce", "reduce_scatter"})
_A2A_MOD = 31  # all_to_all chunk values wrap here to stay exact in half precision


def fill_all_to_all_input(full: torch.Tensor, count: int, world: int, rank: int) -> None:
    """Rank ``rank``'s all_to_all input: chunk k (sent to rank k) is the base pattern plus (rank*world + k) mod
    _A2A_MOD, so every received chunk says who sent it (``expected`` checks the transpose)."""
    chunk = BENCH.base(count, full.dtype, full.device)
    for k in range(world):
        full.narrow(0, k * count, count).copy_(chunk + (rank * world + k) % _A2A_MOD)


def modes(op: str) -> tuple[bool, ...]:
    """The placements torch offers for ``op``: False = out-of-place, True = in-place."""
    if op in IN_PLACE_ONLY:
        return (True,)
    if op in OUT_OF_PLACE_ONLY:
        return (False,)
    return (False, True)


def unsupported_reason(op: str, backend: str, world_size: int, device_type: str) -> str | None:
    """Why ``op`` cannot run here, known before trying it; None when it should run."""
    if op == "sendrecv" and world_size < 2:
        return "sendrecv needs at least 2 ranks"
    if backend == "gloo" and device_type == "cuda" and op in ("reduce_scatter", "all_to_all"):
        return f"unsupported by gloo on CUDA tensors ({op})"
    return None


@dataclass(frozen=True, kw_only=True)
class Case:
    """One op at one size on this rank."""

    op: str
    """Collective name, one of ddpkit.bench.busbw.OPS."""
    count: int
    """Elements in the full buffer (nccl-tests' count column)."""
    dtype: str
    """Element type name, one of DTYPES."""
    redop: str
    """Reduction for reducing ops, one of REDOPS."""
    root: int
    """Root rank of broadcast and reduce."""
    rank: int
    """This rank."""
    world_size: int
    """Ranks taking part."""
    in_place: bool
    """Whether the output buffer aliases the input."""


@dataclass
class Prepared:
    """Buffers of one case and the call that runs the collective on them."""

    launch: Callable[[], object]
    """Runs the collective once (synchronous on CPU; queued on the stream on GPU)."""
    output: torch.Tensor
    """Where this rank's result lands."""
    reset: Callable[[], None]
    """Refills the inputs with the pattern (in-place ops overwrite them)."""


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


def _redop(name: str) -> object:
    import torch.distributed as dist

    return {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[name]


@dataclass
class Buffers:
    """A case's buffers and the refill that puts the pattern back before each run: the same for every transport
    (``prepare`` here, ``mpi_ops.prepare_mpi``), which binds only the call that runs the collective on them."""

    full: torch.Tensor
    """The input: every rank's pattern (all_to_all: a chunk per destination)."""
    output: torch.Tensor
    """Where this rank's result lands: ``full`` itself (all_reduce, reduce, broadcast), this rank's block of it (an
    in-place reduce_scatter, at the rank's offset as torch leaves it), or a buffer of its own."""
    reset: Callable[[], None]
    block: torch.Tensor | None = None
    """all_gather's input, this rank's block (of ``output`` when in place)."""


def buffers(case: Case, device: torch.device) -> Buffers:
    """Allocate the buffers of ``case`` and the refill of its inputs."""
    import torch

    dt = _torch_dtype(case.dtype)
    n, r, op = case.world_size, case.rank, case.op
    c = per_rank_count(op, case.count, n)
    full = torch.empty(case.count, dtype=dt, device=device)

    def fill_full() -> None:
        full.copy_(BENCH.base(case.count, dt, device) + BENCH.add(r))

    if op == "broadcast":
        def fill_bcast() -> None:
            if r == case.root:
                fill_full()
            else:
                full.zero_()  # so a broadcast that never arrives shows as wrong
        return Buffers(full=full, output=full, reset=fill_bcast)
    if op == "all_gather":
        out = torch.empty(case.count, dtype=dt, device=device)
        block = out.narrow(0, r * c, c) if case.in_place else torch.empty(c, dtype=dt, device=device)

        def fill_gather() -> None:
            out.zero_()
            block.copy_(BENCH.base(c, dt, device) + BENCH.add(r))
        return Buffers(full=full, output=out, reset=fill_gather, block=block)
    if op in ("all_to_all", "sendrecv"):
        received = torch.empty(case.count, dtype=dt, device=device)

        def fill_sent() -> None:
            if op == "all_to_all":
                fill_all_to_all_input(full, c, n, r)
            else:
                fill_full()
            received.zero_()
        return Buffers(full=full, output=received, reset=fill_sent)
    if op == "reduce_scatter":
        mine = full.narrow(0, r * c, c) if case.in_place else torch.empty(c, dtype=dt, device=device)
        return Buffers(full=full, output=mine, reset=fill_full)
    return Buffers(full=full, output=full, reset=fill_full)


def prepare(case: Case, device: torch.device) -> Prepared:
    """Allocate the buffers of ``case`` and bind the torch.distributed call that runs it."""
    import torch.distributed as dist

    b = buffers(case, device)
    full, out = b.full, b.output
    n, r, op = case.world_size, case.rank, case.op
    redop = _redop(case.redop)
    gather, scatter = all_gather_single(), reduce_scatter_single()

    def exchange() -> None:
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, full, (r + 1) % n),
                                       dist.P2POp(dist.irecv, out, (r - 1) % n)])
        for req in reqs:
            req.wait()

    launches: dict[str, Callable[[], object]] = {
        "all_reduce": lambda: dist.all_reduce(full, op=redop),
        "reduce": lambda: dist.reduce(full, case.root, op=redop),
        "broadcast": lambda: dist.broadcast(full, case.root),
        "all_gather": lambda: gather(out, b.block),
        "reduce_scatter": lambda: scatter(out, full, op=redop),
        "all_to_all": lambda: dist.all_to_all_single(out, full),
        "sendrecv": exchange,
    }
    if op not in launches:
        raise ValueError(f"unknown op {op!r}")
    return Prepared(launch=launches[op], output=out, reset=b.reset)


def expected(case: Case, device: torch.device) -> torch.Tensor | None:
    """The result this rank must hold after ``case``; None where the op leaves this rank's buffer undefined."""
    import torch

    dt = _torch_dtype(case.dtype)
    n, r, op = case.world_size, case.rank, case.op
    c = per_rank_count(op, case.count, n)
    wide = torch.float64 if dt.is_floating_point else torch.int64
    p = BENCH.base(case.count, wide, device)
    if op == "all_reduce":
        return BENCH.reduced(p, case.redop, n)
    if op == "reduce":
        return BENCH.reduced(p, case.redop, n) if r == case.root else None
    if op == "broadcast":
        return p + BENCH.add(case.root)
    if op == "all_gather":
        chunk = p[:c]
        return torch.cat([chunk + BENCH.add(k) for k in range(n)]) if n else chunk
    if op == "reduce_scatter":
        return BENCH.reduced(p[r * c:(r + 1) * c], case.redop, n)
    if op == "all_to_all":
        chunk = p[:c]
        return torch.cat([chunk + (k * n + r) % _A2A_MOD for k in range(n)])
    if op == "sendrecv":
        return p + BENCH.add((r - 1) % n)
    raise ValueError(f"unknown op {op!r}")


def count_wrong(case: Case, prepared: Prepared, device: torch.device) -> int:
    """Run ``case`` once on fresh inputs and count this rank's elements that differ from the closed form.

    The ``corrupt`` fault (``DDPKIT_FAULTS=corrupt:op=all_reduce:rank=1``, optional ``n=COUNT``) damages this
    rank's result after the collective, as a faulty link or kernel would.
    """
    import torch

    prepared.reset()
    prepared.launch()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    armed = fault("corrupt", op=case.op, rank=case.rank)
    if armed is not None and prepared.output.numel():
        damaged = min(int(armed.get("n", "1")), prepared.output.numel())
        prepared.output.view(-1)[:damaged] += 3
    want = expected(case, device)
    if want is None:
        return 0
    return mismatches(prepared.output, want, case.world_size)[0]
