"""What a check concluded: one line of the report, and the exit code a set of lines adds up to."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from ddpkit.base.errors import EXIT_CHECK_FAILED, EXIT_MISSING, EXIT_OK, EXIT_USAGE

__all__ = ["FAIL", "PASS", "SKIP", "WARN", "Outcome", "failed", "verdict_code"]

PASS, FAIL, WARN, SKIP = "PASS", "FAIL", "WARN", "SKIP"


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """One check's verdict across the world, as rank 0 reports it."""

    name: str
    """Short name of the check (``roll-call``, ``all_reduce(sum)``, ``ddp-sync``...)."""
    status: str
    """PASS, FAIL, WARN or SKIP (SKIP: not applicable here, e.g. an op the backend does not support)."""
    detail: str
    """The figures, or what was wrong and where."""
    seconds: float | None = None
    """Wall time of the check on rank 0, where measured."""
    bad_ranks: tuple[int, ...] = ()
    """Ranks whose results were wrong (or that were missing)."""
    exit_code: int = EXIT_OK
    """Exit code this outcome asks for when it is not a PASS: 1 check failed, 2 environment, 3 missing/deadline."""
    data: dict[str, object] = field(default_factory=dict)
    """Extra figures for the JSON report."""

    def as_dict(self) -> dict[str, object]:
        return {"name": self.name, "status": self.status, "detail": self.detail, "seconds": self.seconds,
                "bad_ranks": list(self.bad_ranks), "verdict_code": self.exit_code if self.status == FAIL else 0,
                **({"data": self.data} if self.data else {})}


def failed(name: str, detail: str, *, bad_ranks: Iterable[int] = (), code: int = EXIT_CHECK_FAILED,
           seconds: float | None = None, data: dict[str, object] | None = None) -> Outcome:
    return Outcome(name=name, status=FAIL, detail=detail, bad_ranks=tuple(sorted(set(bad_ranks))), exit_code=code,
                   seconds=seconds, data=data or {})


def verdict_code(outcomes: Iterable[Outcome]) -> int:
    """Missing ranks or an expired deadline (3) outrank an environment error (2), which outranks a failure (1)."""
    codes = {o.exit_code for o in outcomes if o.status == FAIL}
    for code in (EXIT_MISSING, EXIT_USAGE, EXIT_CHECK_FAILED):
        if code in codes:
            return code
    return EXIT_OK
