"""Test-only fault injection, so the failure paths of check, bench and train can be proven on real runs.

Set ``DDPKIT_FAULTS`` to entries separated by ``;``, each ``KIND[:key=value]...``. An entry fires for a call
``fault(KIND, **context)`` when every key it names that is also in the context has the same value; its other
keys are parameters for the fault. Examples::

    DDPKIT_FAULTS="corrupt:op=all_reduce:rank=1"      # rank 1 corrupts its all_reduce result
    DDPKIT_FAULTS="hang:phase=ddp:rank=2"             # rank 2 never enters the DDP phase
    DDPKIT_FAULTS="slow:rank=2:ms=50"                 # rank 2 sleeps 50 ms where 'slow' is consulted

Kinds consulted by ``ddpkit bench``:

- ``corrupt`` (context ``op``, ``rank``; parameter ``n``, default 1): after the verification run of ``op``,
  the rank adds 3 to the first ``n`` elements of its result, so ``#wrong`` counts ``n`` per size.
- ``slow`` (context ``rank``, ``peer``; parameters ``ms``, default 20, and ``measures``): in ``--pairs``, the rank
  stalls ``ms`` before each point-to-point send, so its links read slow; with ``peer=P`` only its link to global
  rank P (a bad cable); with ``measures=K`` only in the first K measurements of a link (a transient stall).

Kinds consulted by ``ddpkit check`` (context: ``rank``, and ``op`` or ``phase``):

- ``corrupt:op=OP:rank=R``: rank R's result of OP is wrong in one element. OP is a check name: barrier,
  all_reduce_sum, all_reduce_max, broadcast, reduce, all_gather, reduce_scatter, all_to_all, send_recv_ring,
  or ``ddp`` (rank R's replica drifts after the DDP steps).
- ``hang:phase=P:rank=R``: rank R never enters phase P (roll-call, init, an op name above, ddp, report).
- ``slow:phase=P:rank=R:ms=N``: rank R enters phase P N ms late.
- ``version:rank=R:torch=X`` (also ``python``, ``ddpkit``, ``cuda``): rank R reports version X at roll-call.

Kind consulted by every verdict command (check, bench, env) under ddpkit's launcher:

- ``linger:rank=R:ms=N``: rank R exits N ms after its command finished (a rank on a slower node).

Kind consulted by ``ddpkit train``:

- ``hang:phase=step:rank=R:step=N[:gen=G][:s=S]``: rank R sleeps S seconds (default 3600) before step N, running
  and making no progress (under ``--heal live``, ``gen=0``: only the first generation's process).
- ``kill:phase=snapshot:rank=R:step=N[:gen=G]``: rank R kills itself (SIGKILL) as the snapshot of step N begins,
  while the others enter its gather.

Kind consulted by the watch (``ddpkit run``, ``train``, ``check``):

- ``abort-late:rank=R:ms=N``: under a hang abort, rank R's watch ends the rank N ms after every rank's abort
  handlers ran (the others leave first and break its collective).

Never set in production; ddpkit logs a warning when any fault is armed.
"""

from __future__ import annotations

import os

from ddpkit.base.log import get_logger

__all__ = ["ENV_VAR", "fault"]

ENV_VAR = "DDPKIT_FAULTS"
log = get_logger(__name__)
_warned = False


def _entries(raw: str) -> list[tuple[str, dict[str, str]]]:
    out = []
    for chunk in raw.split(";"):
        chunk = chunk.strip()
        if not chunk:
            continue
        kind, *pairs = chunk.split(":")
        params = {}
        for pair in pairs:
            key, _, value = pair.partition("=")
            params[key.strip()] = value.strip()
        out.append((kind.strip(), params))
    return out


def fault(kind: str, **context: object) -> dict[str, str] | None:
    """Return the parameters of the first armed fault of ``kind`` matching ``context``, else None."""
    global _warned
    raw = os.environ.get(ENV_VAR)
    if not raw:
        return None
    if not _warned:
        _warned = True
        log.warning("test faults armed: %s=%s", ENV_VAR, raw)
    for entry_kind, params in _entries(raw):
        if entry_kind != kind:
            continue
        if all(str(context[k]) == v for k, v in params.items() if k in context):
            return params
    return None
