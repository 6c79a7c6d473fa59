"""The world as one launcher describes it: an immutable record, and the helpers that read variables into it."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field

import hostlist

from ddpkit.errors import EnvConflict
from ddpkit.ports import PORT_RANGE, derive_port  # defined once, shared with the job renderers

__all__ = ["PORT_RANGE", "VarReader", "WorldInfo", "derive_port", "expand_nodelist", "is_ip_address"]


@dataclass(frozen=True, kw_only=True)
class WorldInfo:
    """Who this process is, in which world, according to the launcher that started it."""

    launcher: str
    """Name of the launcher that matched: torchrun, slurm, openmpi, mpich, kubeflow, env, or none."""
    rank: int
    """Global rank of this process, 0 <= rank < world_size."""
    local_rank: int
    """Rank among the processes on this node."""
    world_size: int
    """Number of processes in the world."""
    local_world_size: int
    """Number of processes on this node."""
    node_rank: int
    """Index of this node, 0 <= node_rank < num_nodes."""
    num_nodes: int
    """Number of nodes taking part."""
    master_addr: str | None = None
    """Host of rank 0's store; None where the launcher gives none and none could be derived."""
    master_port: int | None = None
    """Port of rank 0's store."""
    hosts: tuple[str, ...] = ()
    """Expanded host list, in node-rank order, where the launcher tells."""
    restart_count: int | None = None
    """How many times the workers were restarted (torch elastic), where known."""
    run_id: str | None = None
    """Run or job id, where known."""
    is_agent: bool = False
    """True when this process is a node agent (a Kubeflow pod's command) whose ranks have yet to be started."""
    sources: Mapping[str, str] = field(default_factory=dict)
    """For each field, the variable (or rule) it came from."""
    notes: tuple[str, ...] = ()
    """Things worth telling the user that are not errors: other launchers seen, values derived."""

    def as_dict(self) -> dict[str, object]:
        return {
            "launcher": self.launcher,
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "local_world_size": self.local_world_size,
            "node_rank": self.node_rank,
            "num_nodes": self.num_nodes,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "hosts": list(self.hosts),
            "restart_count": self.restart_count,
            "run_id": self.run_id,
            "is_agent": self.is_agent,
            "sources": dict(self.sources),
            "notes": list(self.notes),
        }


class VarReader:
    """Reads integers and strings from an environment, remembering which variable gave each field."""

    def __init__(self, environ: Mapping[str, str], launcher: str) -> None:
        self.environ = environ
        self.launcher = launcher
        self.sources: dict[str, str] = {}

    def has(self, *names: str) -> bool:
        return any(n in self.environ for n in names)

    def first(self, *names: str) -> str | None:
        """The name of the first variable present, or None."""
        return next((n for n in names if n in self.environ), None)

    def text(self, fld: str, *names: str) -> str | None:
        name = self.first(*names)
        if name is None:
            return None
        self.sources[fld] = name
        return self.environ[name]

    def integer(self, fld: str, *names: str, minimum: int = 0) -> int | None:
        name = self.first(*names)
        if name is None:
            return None
        raw = self.environ[name]
        try:
            value = int(raw.strip())
        except ValueError:
            raise EnvConflict(
                f"{name}={raw!r} is not a whole number ({self.launcher} sets it for the {fld.replace('_', ' ')})",
                f"an integer >= {minimum}",
                f"unset {name} or launch with {self.launcher} itself, which sets it correctly",
            ) from None
        if value < minimum:
            raise EnvConflict(f"{name}={raw!r} is below {minimum}", f"an integer >= {minimum}",
                              f"check how {name} is set in the job script")
        self.sources[fld] = name
        return value

    def required(self, fld: str, *names: str, minimum: int = 0) -> int:
        value = self.integer(fld, *names, minimum=minimum)
        if value is None:
            raise EnvConflict(
                f"{self.launcher} is active but sets none of {', '.join(names)}",
                f"{' or '.join(names)} for the {fld.replace('_', ' ')}",
                f"launch through {self.launcher} itself, or export {names[0]}",
            )
        return value

    def derived(self, fld: str, rule: str) -> None:
        self.sources[fld] = rule


def expand_nodelist(value: str, variable: str) -> tuple[str, ...]:
    """Expand a compressed Slurm hostlist (``a[1-3,5],b7``) with python-hostlist; malformed lists are errors."""
    try:
        hosts = hostlist.expand_hostlist(value)
    except hostlist.BadHostlist as exc:
        raise EnvConflict(
            f"{variable}={value!r} is not a valid Slurm hostlist ({exc})",
            "a list like node-[001-004] or a[1-3,5],b7",
            f"check how {variable} is set; Slurm sets it correctly inside a job",
        ) from None
    if not hosts:
        raise EnvConflict(f"{variable} is empty", "at least one host", f"check how {variable} is set")
    return tuple(hosts)


def is_ip_address(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True
