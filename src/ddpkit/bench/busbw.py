"""Bandwidth as nccl-tests counts it: pure functions, no torch.

``size`` is the byte count nccl-tests prints in its first column: the whole buffer of all_reduce, broadcast,
reduce and sendrecv, and the *gathered* (or scattered) buffer of all_gather, reduce_scatter and alltoall, that is
the per-rank count x ranks x type size. ``algbw = size / time``; ``busbw = algbw x factor``, where the factor
(see nccl-tests' doc/PERFORMANCE.md) makes busbw comparable to the hardware's link bandwidth whatever the rank count:

    all_reduce            2(n-1)/n
    all_gather            (n-1)/n
    reduce_scatter        (n-1)/n
    all_to_all            (n-1)/n
    broadcast, reduce     1
    sendrecv              1
"""

from __future__ import annotations

from fractions import Fraction

__all__ = ["OPS", "algbw_gbps", "busbw_factor", "busbw_gbps", "element_count", "per_rank_count"]

#: Every op ddpkit benchmarks, in nccl-tests' order.
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all", "sendrecv")

#: Ops whose buffer is split into one chunk per rank (the count must be a multiple of the rank count).
CHUNKED = frozenset({"all_gather", "reduce_scatter", "all_to_all"})


def busbw_factor(op: str, nranks: int) -> Fraction:
    """nccl-tests' bus bandwidth factor for ``op`` on ``nranks`` ranks, as an exact fraction."""
    if nranks < 1:
        raise ValueError(f"nranks must be >= 1, got {nranks}")
    if op == "all_reduce":
        return Fraction(2 * (nranks - 1), nranks)
    if op in CHUNKED:
        return Fraction(nranks - 1, nranks)
    if op in ("broadcast", "reduce", "sendrecv"):
        return Fraction(1)
    raise ValueError(f"unknown op {op!r}; known: {', '.join(OPS)}")


def element_count(op: str, nbytes: int, itemsize: int, nranks: int) -> int:
    """Elements in the op's full buffer for a requested size, rounded down as nccl-tests does for chunked ops."""
    count = nbytes // itemsize
    if op in CHUNKED:
        count -= count % nranks
    return count


def per_rank_count(op: str, count: int, nranks: int) -> int:
    """Elements each rank contributes (chunked ops) or holds (the others)."""
    return count // nranks if op in CHUNKED else count


def algbw_gbps(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes), as nccl-tests prints it."""
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def busbw_gbps(op: str, nbytes: int, seconds: float, nranks: int) -> float:
    """Bus bandwidth in GB/s: algbw x nccl-tests' factor for the op."""
    return algbw_gbps(nbytes, seconds) * float(busbw_factor(op, nranks))
