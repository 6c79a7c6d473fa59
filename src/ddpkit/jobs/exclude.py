"""``ddpkit submit --exclude-from FILE``: the hosts a ``check`` or ``bench`` JSON report named bad, kept out of the
next job (``#SBATCH --exclude``, the mpirun host list without them, a Kubernetes ``nodeAffinity`` ``NotIn`` rule).
No torch import."""

from __future__ import annotations

import json
from pathlib import Path

from ddpkit.base.errors import ConfigError

__all__ = ["bad_host_names"]


def bad_host_names(path: str, *, backend: str) -> tuple[str, ...]:
    """The report's ``bad_hosts``, by the name the backend knows them by: the Slurm node name for slurm (where the
    report recorded one), the host name elsewhere. An empty list is fine (a healthy run excludes nothing)."""
    fix = "pass the --json file of a ddpkit check or bench run (one that names bad_hosts)"
    try:
        data = json.loads(Path(path).expanduser().read_text())
    except FileNotFoundError:
        raise ConfigError(f"--exclude-from {path}: no such file", "a check or bench --json report", fix) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"--exclude-from {path}: not readable as JSON ({exc})", "a check or bench --json report",
                          fix) from None
    entries = data.get("bad_hosts") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("host"), str)
                                                for e in entries):
        kind = data.get("kind") if isinstance(data, dict) else type(data).__name__
        raise ConfigError(f"--exclude-from {path}: a {kind!r} file without a bad_hosts list",
                          "a check or bench --json report from this ddpkit", fix)
    names = []
    for e in entries:
        name = (e.get("slurm_node") or e["host"]) if backend == "slurm" else e["host"]
        if name not in names:
            names.append(str(name))
    return tuple(names)
