"""Known inputs and the closed-form results of collectives on them: how ``ddpkit check`` and ``ddpkit bench`` verify
every element without a reference run.

Rank ``r`` contributes ``base(i) + add(r)`` at element ``i``, with ``base(i) = i mod 7`` and ``add(r) = r mod M + 1``.
Every value is a small integer, so a sum, a max, a min or a copy of them is known exactly: a reduction over ``n``
ranks is ``base * n + sum(add)`` (sum) or ``base + max/min(add)``. The modulus ``M`` is the pattern's trade-off:
a larger one tells more ranks apart (a misplaced chunk from a rank ``M`` away looks right), a smaller one keeps sums
exact in narrow types. torch is imported only when a tensor is made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["BENCH", "CHECK", "Pattern", "mismatches"]

REDUCTIONS = ("sum", "max", "min")


@dataclass(frozen=True)
class Pattern:
    """Inputs ``base(i) + add(r)`` for rank ``r``; ``add(r) = r mod rank_modulus + 1``."""

    rank_modulus: int

    def add(self, rank: int) -> int:
        """What rank ``rank`` adds to every element of the base."""
        return rank % self.rank_modulus + 1

    def base(self, n: int, dtype: torch.dtype | None = None, device: torch.device | None = None,
             offset: int = 0) -> torch.Tensor:
        """``(offset + i) mod 7`` for i in 0..n-1, in ``dtype`` (default float32)."""
        import torch

        return (torch.arange(offset, offset + n, device=device, dtype=torch.int64) % 7).to(dtype or torch.float32)

    def of_rank(self, rank: int, n: int, dtype: torch.dtype | None = None,
                device: torch.device | None = None) -> torch.Tensor:
        """Rank ``rank``'s input: ``base + add(rank)``."""
        return self.base(n, dtype, device) + self.add(rank)

    def reduced(self, base: torch.Tensor, redop: str, world_size: int) -> torch.Tensor:
        """The closed form of reducing ``base + add(r)`` with ``redop`` (sum, max, min) over ranks 0..world_size-1."""
        adds = [self.add(r) for r in range(world_size)]
        total = {"sum": sum(adds), "max": max(adds), "min": min(adds)}[redop]
        return (base * world_size if redop == "sum" else base) + total


#: ``ddpkit check``: float32 only, so a wide modulus: ranks up to 13 apart hold different values.
CHECK = Pattern(rank_modulus=13)
#: ``ddpkit bench``: every dtype down to int8 and float16, so sums stay small.
BENCH = Pattern(rank_modulus=4)


def mismatches(got: torch.Tensor, want: torch.Tensor, world_size: int) -> tuple[int, str]:
    """How many elements of ``got`` differ from the closed form ``want``, and the first one in words.

    Integer results are compared in their own type (a sum that wraps wraps alike on every rank); float16 and bfloat16
    within their rounding over ``world_size`` additions; every other float exactly.
    """
    import torch

    got = got.detach().reshape(-1)
    want = want.to(got.device).reshape(-1)  # compared where the result is: no copy of a large buffer to the host
    if not got.dtype.is_floating_point:
        bad = got != want.to(got.dtype)
    elif got.dtype in (torch.float16, torch.bfloat16):
        wide = got.to(want.dtype)
        bad = ~torch.isclose(wide, want, rtol=torch.finfo(got.dtype).eps * world_size, atol=0.0)
    else:
        bad = got.to(want.dtype) != want
    wrong = int(bad.sum().item())
    if wrong == 0:
        return 0, ""
    i = int(bad.to(torch.uint8).argmax().item())  # the first wrong element, without listing every index
    return wrong, f"element {i}: got {got[i].item():g}, expected {want[i].item():g}"
