"""A Kubernetes pod's log (a PyTorchJob's: one torchrun agent and its ranks, under ``ddpkit step --show-all``):
its events, the rank it ran (the first ``[POD:RANK]`` its own ranks' lines carry) and that rank's last traceback,
never torchrun's own report of a failed worker (its ``ChildFailedError``)."""

from __future__ import annotations

from ddpkit.launcher_output.events import Event, RankOnHost
from ddpkit.launcher_output.torchrun import TorchrunReader
from ddpkit.launcher_output.tracebacks import rank_traceback

__all__ = ["pod_events"]

#: torchrun's agent ends a failed pod with this exception's traceback (its report of a worker, not the program's)
_LAUNCHER_ERROR = "ChildFailedError"


def pod_events(pod: str, log: str, index: int) -> tuple[int, list[Event]]:
    """(the pod's rank, the events of its log); the rank is ``index`` where no line of its own names one."""
    lines = log.splitlines()
    events = [event for _, event in TorchrunReader().read_all(lines)]
    rank = next((e.rank for e in events if isinstance(e, RankOnHost) and e.host == pod), index)
    said = rank_traceback(rank, pod, lines)
    if said is not None and _LAUNCHER_ERROR not in said.exception:
        events.append(said)
    return rank, events

