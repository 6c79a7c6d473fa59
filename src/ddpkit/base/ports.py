"""Ports derived from a job id: every rank (``ddpkit.env``) and every generated job script (``ddpkit.jobs.slurm``)
computes the same port from the same id, without talking to each other. No imports beyond the standard library, so
the job renderers can use it without loading launcher detection."""

from __future__ import annotations

import re
import zlib

__all__ = ["PORT_RANGE", "derive_port", "derive_port_shell"]

#: Ports derived from a job id fall in [PORT_RANGE[0], PORT_RANGE[1]): below Linux's ephemeral range
#: (32768-60999), so a derived port does not collide with outgoing connections.
PORT_RANGE = (20000, 30000)


def derive_port(job_id: str) -> int:
    """A port every rank computes alike from the job id, inside PORT_RANGE, without talking to each other.

    Numeric ids map to consecutive ports, so consecutive jobs on one node do not collide.
    """
    low, high = PORT_RANGE
    span = high - low
    # ASCII digits only: str.isdigit() accepts superscripts ("²") that int() refuses
    numeric = re.fullmatch(r"[0-9]{1,18}", job_id.strip())
    key = int(numeric[0]) if numeric else zlib.crc32(job_id.encode(errors="replace"))
    return low + key % span


def derive_port_shell(variable: str) -> str:
    """``derive_port`` as shell arithmetic on a numeric job id held in ``variable`` (Slurm's SLURM_JOB_ID)."""
    low, high = PORT_RANGE
    return f"$(({low} + {variable} % {high - low}))"
