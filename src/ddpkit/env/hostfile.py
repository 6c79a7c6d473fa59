"""Host lists that batch systems hand out as files (LSF's LSB_DJOB_RANKFILE, PBS's PBS_NODEFILE)."""

from __future__ import annotations

from collections.abc import Mapping

from ddpkit.base.errors import EnvConflict

__all__ = ["read_hostfile"]

_MAX_BYTES = 16 << 20  # a node file of 16 MiB is a million hosts: anything larger is not one


def read_hostfile(environ: Mapping[str, str], variable: str, *, skip_first: bool = False) -> tuple[str, ...]:
    """The distinct hosts named in the file ``environ[variable]`` points to, in first-seen order.

    One host per line (a host repeats once per slot); ``skip_first`` drops the first line's host when it is the
    launch node and not a compute node (LSF). A missing or unreadable file is an error naming the variable.
    """
    path = environ[variable].strip()
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_BYTES + 1)
    except OSError as exc:
        raise EnvConflict(f"{variable}={path!r} cannot be read ({exc.strerror})",
                          "the host file the batch system writes for the job",
                          f"run inside the job, where {variable} names a readable file") from None
    if len(data) > _MAX_BYTES:
        raise EnvConflict(f"{variable}={path!r} is larger than {_MAX_BYTES >> 20} MiB", "one host per line",
                          f"check how {variable} is set")
    lines = [line.split()[0] for line in data.decode(errors="replace").splitlines() if line.strip()]
    if skip_first:
        lines = lines[1:]
    hosts = tuple(dict.fromkeys(lines))
    if not hosts:
        raise EnvConflict(f"{variable}={path!r} names no compute host", "one host per line",
                          f"check how {variable} is set")
    return hosts
