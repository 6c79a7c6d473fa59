"""Pieces every generated shell script shares: header, strict mode, environment activation, quoting, wrapping."""

from __future__ import annotations

import shlex
from collections.abc import Sequence

from ddpkit.jobs.interpreter import job_interpreter
from ddpkit.jobs.rendering import header
from ddpkit.jobs.spec import JobSpec

__all__ = ["Raw", "preamble", "wrap"]


class Raw(str):
    """A word that is already shell text (it expands a variable on purpose): wrap() does not quote it."""


def preamble(spec: JobSpec, directives: Sequence[str] = ()) -> list[str]:
    """Shebang, header (with the job's Python and why), scheduler directives, strict mode, environment activation
    and exported variables."""
    lines = ["#!/bin/bash", *header(spec).splitlines(), *job_interpreter(spec).header_lines(), *directives,
             "set -euo pipefail", ""]
    if spec.venv:
        lines += ["# The job's Python: a virtual environment (ddpkit recipe venv makes one)",
                  "# shellcheck source=/dev/null",
                  f"source {shlex.quote(spec.venv.rstrip('/') + '/bin/activate')}"]
    elif spec.conda_env:
        lines += ["# The job's Python: a conda environment (ddpkit recipe conda makes one)",
                  'eval "$(conda shell.bash hook)"',
                  f"conda activate {shlex.quote(spec.conda_env)}"]
    for key, value in spec.env:
        lines.append(f"export {key}={shlex.quote(value)}")
    if spec.venv or spec.conda_env or spec.env:
        lines.append("")
    return lines


def wrap(argv: Sequence[str], *, indent: str = "  ") -> str:
    """One command over several lines; each word quoted with shlex.quote unless it is Raw shell text."""
    words = [w if isinstance(w, Raw) else shlex.quote(w) for w in argv]
    out, line = [], words[0]
    for original, word in zip(argv[1:], words[1:], strict=True):
        if original.startswith("-") and len(line) > 40:
            out.append(line)
            line = indent + word
        else:
            line += " " + word
    out.append(line)
    return " \\\n".join(out)
