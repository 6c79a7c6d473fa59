"""The world as one launcher describes it: an immutable record, and the helpers that read variables into it."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

import hostlist

from ddpkit.base.errors import EnvConflict
from ddpkit.base.ports import PORT_RANGE, derive_port  # defined once, shared with the job renderers

__all__ = ["PORT_RANGE", "AgentPlan", "RankAndSize", "VarReader", "WorldInfo", "derive_port", "expand_nodelist",
           "is_ip_address", "parse_count", "present"]

# One rule for every number a launcher sets: ASCII digits only, nothing around them, and few enough of them. A
# launcher writes "4", never "+4", " 4", "4.0", "1e3" or "²" (str.isdigit() accepts superscripts; int() accepts
# signs, spaces and underscores): such a value was written by hand and is refused at once (exit 2), never guessed.
_INTEGER = re.compile(r"-?[0-9]{1,18}")  # a minus sign is read, to say "below 0"


def present(environ: Mapping[str, str], name: str) -> bool:
    """Set and not blank: a job script's ``export SLURM_RESTART_COUNT=`` means the variable is absent."""
    value = environ.get(name)
    return value is not None and value.strip() != ""


@dataclass(frozen=True)
class RankAndSize:
    """The ``activated()`` test of most launchers, declared: both their rank and their size variable are set
    (``why``: who sets them, said in the positive answer)."""

    rank: str
    size: str
    why: str
    verb: str = "set"

    @property
    def names(self) -> tuple[str, str]:
        return self.rank, self.size

    def __call__(self, environ: Mapping[str, str]) -> tuple[bool, str]:
        if present(environ, self.rank) and present(environ, self.size):
            return True, f"{self.rank} and {self.size} are {self.verb} ({self.why})"
        return False, f"{self.rank} and {self.size} are not both set"


def parse_count(raw: str) -> int | None:
    """The integer a launcher variable holds, or None when it is not plain decimal digits (see ``_INTEGER``)."""
    return int(raw) if _INTEGER.fullmatch(raw) else None


@dataclass(frozen=True, kw_only=True)
class AgentPlan:
    """How a node agent (ddpkit as a Kubeflow pod's command) starts its ranks: what torchrun would read from the
    pod's PET_* variables."""

    min_nodes: int
    """Fewest nodes the rendezvous waits for (PET_NNODES=MIN:MAX, or N:N)."""
    max_nodes: int
    """Most nodes that may join."""
    nproc_per_node: int
    """Ranks this agent starts (PET_NPROC_PER_NODE, auto/cpu/gpu resolved as torchrun does)."""
    rdzv_endpoint: str | None
    """HOST:PORT of the rendezvous; None for a single node without one (torchrun's standalone run)."""
    rdzv_backend: str
    """c10d, etcd, etcd-v2 or static."""
    rdzv_conf: tuple[tuple[str, str], ...] = ()
    """PET_RDZV_CONF's key=value pairs."""
    run_id: str | None = None
    """PET_RDZV_ID."""
    max_restarts: int = 0
    """PET_MAX_RESTARTS."""
    node_rank: int | None = None
    """PET_NODE_RANK for a static (non-elastic) rendezvous; None where the rendezvous assigns it."""


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
    """Number of processes on this node; where ``local_world_known`` is False, only a lower bound (local rank + 1)
    until ``ddpkit.runtime.init`` counts the ranks on this host."""
    local_world_known: bool = True
    """False where the launcher gives no local world size (a hand-exported RANK/WORLD_SIZE/MASTER_* world, as torch's
    env:// accepts): commands count it at start-up; ``ddpkit run`` leaves LOCAL_WORLD_SIZE unset, as it was."""
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
    agent: AgentPlan | None = None
    """For an agent: the rendezvous and shape it starts its ranks with."""
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
            "local_world_size": self.local_world_size if self.local_world_known else None,
            "node_rank": self.node_rank,
            "num_nodes": self.num_nodes,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
            "hosts": list(self.hosts),
            "restart_count": self.restart_count,
            "run_id": self.run_id,
            "is_agent": self.is_agent,
            "agent": None if self.agent is None else {
                "min_nodes": self.agent.min_nodes, "max_nodes": self.agent.max_nodes,
                "nproc_per_node": self.agent.nproc_per_node, "rdzv_endpoint": self.agent.rdzv_endpoint,
                "rdzv_backend": self.agent.rdzv_backend, "run_id": self.agent.run_id,
                "max_restarts": self.agent.max_restarts},
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
        return any(present(self.environ, n) for n in names)

    def first(self, *names: str) -> str | None:
        """The name of the first variable set and not blank, or None (blank counts as absent)."""
        return next((n for n in names if present(self.environ, n)), None)

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
        value = parse_count(raw)
        if value is None:
            shown = repr(raw) if len(raw) <= 40 else f"{raw[:20]!r}... ({len(raw)} characters)"
            raise EnvConflict(
                f"{name}={shown} is not a whole number ({self.launcher} sets it for the {fld.replace('_', ' ')})",
                f"an integer >= {minimum} in plain decimal digits",
                f"unset {name} or launch with {self.launcher} itself, which sets it correctly",
            )
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

    def port(self, fld: str, *names: str) -> int | None:
        """A TCP port (1..65535) from the first of ``names`` that is set, or None."""
        value = self.integer(fld, *names, minimum=1)
        if value is not None and value > 65535:
            name = self.sources[fld]
            raise EnvConflict(f"{name}={self.environ[name].strip()} is not a TCP port", "a port in 1..65535",
                              f"set {name} to a free port, e.g. 29500")
        return value

    def address(self, fld: str, *names: str) -> str | None:
        """A host name or IP from the first of ``names`` that is set; one with spaces or control characters
        is an error, never a host name."""
        value = self.text(fld, *names)
        if value is None:
            return None
        value = value.strip()
        if any(c.isspace() or not c.isprintable() for c in value) or "/" in value:
            name = self.sources[fld]
            raise EnvConflict(f"{name}={value!r} is not a host name or IP address", "one host name or IP",
                              f"set {name} to rank 0's host")
        return value

    def derived(self, fld: str, rule: str) -> None:
        self.sources[fld] = rule


def expand_nodelist(value: str, variable: str) -> tuple[str, ...]:
    """Expand a compressed Slurm hostlist (``a[1-3,5],b7``) with python-hostlist; malformed lists are errors.

    Whitespace outside brackets separates hosts, as ``scontrol show hostnames "alpha beta"`` reads it (Slurm's
    hostlist parser splits on commas and white space alike); inside brackets it is an error.
    """
    try:
        hosts = hostlist.expand_hostlist(_normalise_separators(value, variable))
    except hostlist.BadHostlist as exc:
        raise EnvConflict(
            f"{variable}={value!r} is not a valid Slurm hostlist ({exc})",
            "a list like node-[001-004] or a[1-3,5],b7",
            f"check how {variable} is set; Slurm sets it correctly inside a job",
        ) from None
    if not hosts:
        raise EnvConflict(f"{variable} is empty", "at least one host", f"check how {variable} is set")
    return tuple(hosts)


def _normalise_separators(value: str, variable: str) -> str:
    out, depth = [], 0
    for ch in value.strip():
        depth += ch == "["
        depth -= ch == "]"
        if ch.isspace():
            if depth:
                raise EnvConflict(f"{variable}={value!r} has white space inside brackets",
                                  "a list like node-[001-004] or a[1-3,5],b7", f"check how {variable} is set")
            ch = ","
        out.append(ch)
    return ",".join(part for part in "".join(out).split(",") if part) if depth == 0 else "".join(out)


def is_ip_address(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True
