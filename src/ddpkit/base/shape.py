"""The shape of a job and the address of its rendezvous, as text the user writes: no torch, no launcher.

Shared by the launcher (``ddpkit check -j 2x4 --rdzv-endpoint HOST:PORT``) and the job renderers (``ddpkit
submit``), so rendering an sbatch script loads neither torch nor the rendezvous code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ddpkit.base.errors import ConfigError

__all__ = ["DEFAULT_RDZV_PORT", "JobShape", "endpoint_host", "parse_job_shape", "split_endpoint"]

#: torchrun's default c10d rendezvous port, used where an endpoint names a host only.
DEFAULT_RDZV_PORT = 29400


@dataclass(frozen=True, kw_only=True)
class JobShape:
    """``[MIN:]NNODESxNPROC`` as in TorchX: nodes (elastic between min and max) and processes per node."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: int

    @property
    def is_elastic(self) -> bool:
        """The node count may vary between ``min_nodes`` and ``max_nodes`` (``1:2x4``)."""
        return self.min_nodes != self.max_nodes

    def nodes_text(self, between: str = ":") -> str:
        """The node count: ``N``, or ``MIN:MAX`` when elastic (torchrun's --nnodes; ``between="-"`` gives Slurm's
        --nodes=MIN-MAX, ``" to "`` a sentence)."""
        return f"{self.min_nodes}{between}{self.max_nodes}" if self.is_elastic else str(self.max_nodes)

    def __str__(self) -> str:
        return f"{self.nodes_text()}x{self.nproc_per_node}"


_SHAPE = re.compile(r"^(?:(?P<min>\d+):)?(?P<nodes>\d+)x(?P<nproc>\d+)$")


def parse_job_shape(text: str) -> JobShape:
    """Parse ``NPROC``, ``NNODESxNPROC`` or ``MIN:MAXxNPROC``; bad shapes are a ConfigError (exit code 2)."""
    text = text.strip()
    if text.isdigit():
        text = f"1x{text}"
    m = _SHAPE.match(text)
    if m is None:
        raise ConfigError(f"job shape {text!r} is not understood", "NNODESxNPROC such as 2x4, or MIN:MAXxNPROC "
                          "such as 1:2x4", "write -j 1x2 for one node with two ranks")
    nodes, nproc = int(m["nodes"]), int(m["nproc"])
    low = int(m["min"]) if m["min"] else nodes
    if nodes < 1 or nproc < 1 or low < 1:
        raise ConfigError(f"job shape {text!r} asks for zero nodes or processes", "at least 1x1",
                          "give a positive number of nodes and processes per node")
    if low > nodes:
        raise ConfigError(f"job shape {text!r} has a minimum above its maximum", "MIN <= MAX",
                          f"write {nodes}:{low}x{nproc}")
    return JobShape(min_nodes=low, max_nodes=nodes, nproc_per_node=nproc)


def split_endpoint(endpoint: str) -> tuple[str, int | None]:
    """``HOST:PORT`` -> (host, port); ``[V6]:PORT`` -> (V6, port); a bare host -> (host, None).

    Lenient: the text after the last colon is the port only when it is all digits. Callers that require a port
    check for None and say so. Digits that are not ASCII (``²``, ``٣``: str.isdigit accepts them, int() does not
    always) and numbers too long to be a port are a ConfigError, never a ValueError.
    """
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        return endpoint.strip("[]"), None
    if not port.isascii() or len(port) > 9:
        raise ConfigError(f"endpoint {endpoint!r} has port {port!r}", "HOST:PORT with a port in 1..65535 written in "
                          "ASCII digits", "write node1:29400")
    return host.strip("[]"), int(port)


def endpoint_host(endpoint: str) -> str:
    """The host part of ``HOST[:PORT]``, brackets of an IPv6 address removed."""
    return split_endpoint(endpoint)[0]
