"""Why the workers stop, as the agent knows it: a signal from outside the job, or the agent's own doing.

torch's agent sends SIGTERM to its workers in two very different situations (torch/distributed/elastic/agent/
server/api.py, ``SimpleElasticAgent.run`` and ``_invoke_run``): it forwards a signal it received (``SignalException``:
a preemption, a scancel, a Ctrl-C), or it stops the group itself (``_stop_workers`` after a failed worker or before
a restart, and ``_shutdown`` in ``run``'s ``finally`` when the rendezvous store is lost). The workers cannot tell the
two apart from the signal (Python's handlers do not see the sender), so the agent says so: it handles the
signals itself and, before torch forwards one, writes its name to ``STOP_DIR/signal``. A SIGTERM with no such
mark comes from the agent: a failure, reported as one (ddpkit.train.stops). Both halves of that protocol, and the
state machine they make, are written down once in ddpkit.process.stopping; this module is the agent's use of it.

The mark is written in the agent's signal handler, before the SignalException that makes torch forward the signal is
raised: it exists before any worker gets the forwarded signal. When the agent stops its workers on its own, it says
so first as well (``own_stops_marked``: torch's ``PContext.close``, which every stop of the workers goes through,
marks each worker it is about to signal). When the signal reaches the workers directly (Slurm
signals every process of a step), a worker waits for one of the two marks (``OUTSIDE_MARK_GRACE_S`` at most): a
handshake, so a loaded agent that takes seconds to run its handler is still heard.

``LostPeerBackstop`` bounds the agent's life after its workers lost their peers: torch's agent can block for minutes
in reads of a rendezvous store it can no longer reach (each up to the store's read timeout). Once a worker reports
a lost peer with no restart left, the agent exits 3 within ``BACKSTOP_S`` even if torch has not finished.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from ddpkit.base.background import BackgroundLoop
from ddpkit.base.errors import EXIT_MISSING
from ddpkit.base.log import get_logger
from ddpkit.process.stopping import (
    OUTSIDE_MARK_GRACE_S,
    final_lost_report,
    lost_reports,
    mark_outside_signal,
    mark_own_stop,
)

__all__ = ["BACKSTOP_S", "FORWARDED", "OUTSIDE_MARK_GRACE_S", "LostPeerBackstop", "handle_outside_signals",
           "lost_reports", "own_stops_marked"]

log = get_logger(__name__)

#: Signals the agent takes from outside and forwards to its workers (USR1/USR2: Slurm's --signal before a preemption).
FORWARDED = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
#: Seconds the agent may still take, after a worker reported a lost peer with no restart left, before it exits 3.
BACKSTOP_S = 20.0


def handle_outside_signals(stop_dir: str, names: list[str], raise_forward: Callable[[signal.Signals], None]) -> None:
    """In the agent's main thread: on each signal in ``names`` (of FORWARDED) write ``stop_dir/signal``, then
    ``raise_forward(sig)`` (torch's SignalException, so torch forwards it). torch registers its own handler for
    the signals in TORCHELASTIC_SIGNALS_TO_HANDLE each time it starts workers, so those must exclude ``names``.
    Forked workers inherit this handler: in them it only raises, as torch's does."""
    agent = os.getpid()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        if os.getpid() == agent:
            mark_outside_signal(stop_dir, sig.name)
        raise_forward(sig)

    for name in names:
        signal.signal(getattr(signal, name), on_signal)


@contextlib.contextmanager
def own_stops_marked(stop_dir: str) -> Iterator[None]:
    """While torch's agent runs: each time its workers are stopped (``PContext.close``, which every stop goes
    through: the process context's own when a worker failed, the agent's before a restart, at its end, and for a
    forwarded signal) their pids are marked first, unless a signal from outside was (``mark_own_stop``). torch has
    no hook for it, so the method is wrapped for the launch and put back after."""
    from torch.distributed.elastic.multiprocessing.api import PContext

    original = PContext.close

    def close(self: PContext, *args: Any, **kwargs: Any) -> None:
        with contextlib.suppress(AssertionError, AttributeError):  # closed before its processes started
            mark_own_stop(stop_dir, self.pids().values())
        original(self, *args, **kwargs)

    PContext.close = close  # type: ignore[method-assign]
    try:
        yield
    finally:
        PContext.close = original  # type: ignore[method-assign]


class LostPeerBackstop(BackgroundLoop):
    """A daemon thread: once a worker reported a lost peer and said no restart is left (``final`` on its first
    line), the agent has BACKSTOP_S to finish on its own; then it says so and exits 3 (its workers die with it)."""

    def __init__(self, stop_dir: str, cleanup: Callable[[], None], grace: float = BACKSTOP_S) -> None:
        self.stop_dir = stop_dir
        self.cleanup = cleanup
        self.grace = grace
        super().__init__("ddpkit-lost-peer-backstop")

    def loop(self) -> None:
        report = None
        while report is None:
            if self.stopping.wait(0.5):
                return
            report = final_lost_report(self.stop_dir)
        if self.stopping.wait(self.grace):
            return
        log.error("%s\nthis agent could not close the rendezvous within %.0f s after that (its store is "
                  "unreachable): exiting %d; no worker is left on this host", report, self.grace, EXIT_MISSING)
        sys.stderr.flush()
        self.cleanup()
        os._exit(EXIT_MISSING)
