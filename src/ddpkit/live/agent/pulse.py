"""``python -m ddpkit.live.agent.pulse --store HOST:PORT --slot NAME --pid PID``: the eyes of the live agent on a
rank's node under Slurm (``live.agent.slurm``), where the agent cannot read ``/proc``. A process of its own beside
the rank (``ddpkit.standby`` starts it first thing, in the same srun step): every ``BEAT_S`` it reads the kernel's
state of the rank's process (``/proc/PID/stat``: running, in I/O, stopped) and its CPU time, and writes them to the
agent's store (``LiveStore.pulse``). So a rank whose Python holds the GIL (a long C call) reads as running, a rank
stopped by a signal as stopped within a beat, and a node or step frozen or cut off as a pulse that stands still
(``Seen.SILENT``). It ends when the rank's process is gone (saying so) or the store is.
"""

from __future__ import annotations

import argparse
import os
import select
import sys
import time
from collections.abc import Callable
from datetime import timedelta

from ddpkit.live.agent.proc import stat_of
from ddpkit.live.protocol import LiveStore

__all__ = ["BEAT_S", "main"]

#: How often the pulse looks at the rank (seconds).
BEAT_S = 0.25
#: How long the first connection to the agent's store may take (seconds).
CONNECT_S = 60.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddpkit.live.agent.pulse", description=__doc__.split("\n")[0])
    p.add_argument("--store", required=True, help="HOST:PORT of the live agent's store")
    p.add_argument("--slot", required=True, help="the rank's slot in the store")
    p.add_argument("--pid", type=int, required=True, help="the rank's process")
    args = p.parse_args(argv)
    import torch.distributed as dist

    host, _, port = args.store.rpartition(":")
    try:
        store = LiveStore(dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=CONNECT_S),
                                        wait_for_workers=False))
    except (RuntimeError, dist.DistError) as exc:
        print(f"ddpkit pulse: the live agent's store at {args.store} did not answer ({str(exc)[:160]})",
              file=sys.stderr)
        return 1
    ended = _end_of(args.pid)
    count = 0
    while True:
        count += 1
        state, ticks = stat_of(args.pid)
        try:
            store.pulse(args.slot, count, state, ticks)
        except (RuntimeError, dist.DistError):
            return 0  # the agent's store is gone: the job is ending
        if state in ("", "Z"):  # the rank is gone (or ended, not yet reaped): leave at once (torch's teardown
            os._exit(0)       # takes a moment, and the rank's step may end only with this process)
        ended(BEAT_S)


def _end_of(pid: int) -> Callable[[float], object]:
    """A wait of at most S seconds that returns the moment ``pid`` ends (a pidfd: this process's step ends no later
    than its rank's, and the agent hears of the end at once); a plain sleep where pidfds are not there."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return time.sleep
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return lambda seconds: poller.poll(seconds * 1000)


if __name__ == "__main__":
    sys.exit(main())
