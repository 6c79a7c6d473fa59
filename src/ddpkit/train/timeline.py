"""Where a training run's wall time goes, from the command's start to its process group's end (torch-free).

The trainer and ``ddpkit train`` record marks (epoch seconds) as they pass them; ``phases`` turns them into the
``--json`` fields that make a start-up or exit regression visible::

    launched -> worker -> job -> group -> loop -> first_step ... loop_end -> finished
     launch    build_job  process_group  resume_and_wrap  first_step  training  teardown
"""

from __future__ import annotations

from typing import Any

__all__ = ["MARKS", "phases"]

#: The marks in the order a run passes them.
MARKS = ("launched", "worker", "job", "group", "loop", "first_step", "loop_end", "finished")
_PHASES = {"launch": ("launched", "worker"), "build_job": ("worker", "job"), "process_group": ("job", "group"),
           "resume_and_wrap": ("group", "loop"), "first_step": ("loop", "first_step"),
           "training": ("first_step", "loop_end"), "teardown": ("loop_end", "finished")}


def phases(marks: dict[str, float]) -> dict[str, Any]:
    """The summary fields: ``startup_s`` (command start -> first step begins), ``teardown_s`` (last step or snapshot
    -> process group destroyed), ``phases_s`` (each phase; None where a mark is missing: no step ran) and the marks
    themselves as ``*_at`` epoch seconds."""
    def span(a: str, b: str) -> float | None:
        return marks[b] - marks[a] if a in marks and b in marks else None

    return {"startup_s": span("launched", "loop"), "teardown_s": span("loop_end", "finished"),
            "phases_s": {name: span(a, b) for name, (a, b) in _PHASES.items()},
            **{f"{mark}_at": marks[mark] for mark in MARKS if mark in marks}}
