"""``ddpkit submit --exclude-from FILE``: the hosts a ``check`` or ``bench`` JSON report named bad, or a heal run
took out (its run directory or ledger: each ``host-excluded`` line of ``ledger.jsonl``, and of ``HOST/ledger.jsonl``
for a run across hosts), kept out of the next job (``#SBATCH --exclude``, the mpirun host list without them, a
Kubernetes ``nodeAffinity`` ``NotIn`` rule). No torch import; the ledger is read as JSON lines (its record kinds are
``ddpkit.rundir.ledger``'s, which jobs does not import)."""

from __future__ import annotations

import json
from pathlib import Path

from ddpkit.base.errors import ConfigError

__all__ = ["bad_host_names"]


def bad_host_names(path: str, *, backend: str) -> tuple[str, ...]:
    """The report's ``bad_hosts``, by the name the backend knows them by: the Slurm node name for slurm (where the
    report recorded one), the host name elsewhere. An empty list is fine (a healthy run excludes nothing)."""
    fix = "pass the --json file of a ddpkit check or bench run (one that names bad_hosts), or a --heal run directory"
    given = Path(path).expanduser()
    if given.is_dir() or given.name.endswith(".jsonl"):
        return _excluded_by_heal(path, given, fix)
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


def _excluded_by_heal(path: str, given: Path, fix: str) -> tuple[str, ...]:
    """The hosts a heal run's ledgers took out (``host-excluded`` lines), in the order they were taken out."""
    files = [given] if not given.is_dir() else [given / "ledger.jsonl", *sorted(given.glob("*/ledger.jsonl"))]
    found = [f for f in files if f.is_file()]
    if not found:
        raise ConfigError(f"--exclude-from {path}: no heal ledger (ledger.jsonl) there",
                          "a check or bench --json report, or the run directory of a --heal run", fix)
    names: list[str] = []
    for ledger in found:
        try:
            text = ledger.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--exclude-from {path}: {ledger} is not readable ({exc})", "a heal ledger", fix) \
                from None
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except ValueError:  # a torn last line: the ledger's readers skip it too
                continue
            host = record.get("host") if isinstance(record, dict) and record.get("kind") == "host-excluded" else None
            if isinstance(host, str) and host not in names:
                names.append(host)
    return tuple(names)
