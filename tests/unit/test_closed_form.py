"""The closed forms check and bench verify against: each equals the reduction computed element by element, and a
wrong element is counted and named."""

from __future__ import annotations

import pytest
import torch

from ddpkit.comm.closed_form import BENCH, CHECK, Pattern, mismatches


@pytest.mark.parametrize("pattern", [CHECK, BENCH])
@pytest.mark.parametrize("redop", ["sum", "max", "min"])
@pytest.mark.parametrize("world", [1, 3, 17])
def test_closed_form_equals_the_reduction_of_every_rank_input(pattern: Pattern, redop: str, world: int) -> None:
    inputs = torch.stack([pattern.of_rank(r, 50, torch.float64) for r in range(world)])
    direct = {"sum": inputs.sum(0), "max": inputs.amax(0), "min": inputs.amin(0)}[redop]
    assert torch.equal(pattern.reduced(pattern.base(50, torch.float64), redop, world), direct)


def test_mismatches_counts_and_names_the_first_wrong_element() -> None:
    want = CHECK.reduced(CHECK.base(10), "sum", 3)
    got = want.clone()
    got[4] += 1
    got[7] -= 2
    assert mismatches(want, want, 3) == (0, "")
    assert mismatches(got, want, 3) == (2, f"element 4: got {want[4].item() + 1:g}, expected {want[4].item():g}")


def test_mismatches_compares_integers_in_their_type_and_halves_within_rounding() -> None:
    wide = torch.tensor([300.0, 2.0])
    assert mismatches(wide.to(torch.int8), wide.to(torch.int64), 2)[0] == 0  # 300 wraps alike on every rank
    exact = torch.tensor([2049.0, 3.0], dtype=torch.float64)
    half = torch.tensor([2049.0, 2.0], dtype=torch.float16)  # 2049 rounds to 2048 (within rounding); 2 is wrong
    assert mismatches(half, exact, 2) == (1, "element 1: got 2, expected 3")
