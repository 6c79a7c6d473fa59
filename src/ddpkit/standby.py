"""A rank's process under Slurm with ``--heal live``: one srun step of one task, started by the supervisor's live
agent (``ddpkit.heal.slurm_live``).

    python -m ddpkit.standby --store HOST:PORT --slot NAME -- train --epochs 40 ...

It imports what the command's ranks import (torch, the trainer: ``Command.preload``), says its pid and starts its
heartbeat, then waits for its assignment in the agent's store: there at once for a rank of the first group; on a
spare node (a standby) only once a rank is lost. Given one, it takes the assignment's variables (torchrun's
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``... and live healing's generation) and runs the command in this process, as
``python -m ddpkit ARGV`` would. An empty assignment ends it (the job is over, no rank was lost).

Its keys in the agent's store (beside ``ddpkit.process.live``'s):

=============================  ======================================================================
``ddpkit-live/assign/SLOT``    the agent: a JSON object of variables, or "" (end, unused)
``ddpkit-live/proc/SLOT``      this process, once it imported: ``{"host": H, "pid": P}``
``ddpkit-live/beat/SLOT``      a counter this process adds 1 to every ``BEAT_S`` while it runs; a stopped
                               process (SIGSTOP) stops adding, which is how the agent, on another host, sees it
=============================  ======================================================================
"""

from __future__ import annotations

import argparse
import importlib
import os
import socket
import sys
import threading
import time
from datetime import timedelta

from ddpkit.cli import COMMANDS, program
from ddpkit.process.live import LiveStore

__all__ = ["main"]

#: How often the heartbeat counter moves (seconds).
BEAT_S = 0.25
#: How long one wait for the assignment lasts before the store is asked again (seconds); a store that is gone ends
#: the wait (the supervisor ended): the standby never waits on its own.
WAIT_S = 30.0
#: How long the first connection to the agent's store may take (seconds).
CONNECT_S = 60.0


def _beat(host: str, port: int, slot: str) -> None:
    import torch.distributed as dist

    store = LiveStore(dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=CONNECT_S),
                                    wait_for_workers=False))
    while True:
        try:
            store.beat(slot)
        except (RuntimeError, dist.DistError):
            return  # the agent's store is gone: the job is ending
        time.sleep(BEAT_S)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddpkit.standby", description=__doc__.split("\n")[0])
    p.add_argument("--store", required=True, help="HOST:PORT of the live agent's store")
    p.add_argument("--slot", required=True, help="this process's name in the store")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ARGS: what ddpkit runs once assigned")
    args = p.parse_args(argv)
    words = args.command[1:] if args.command[:1] == ["--"] else args.command
    known = {c.name: c for c in COMMANDS}
    if not words or words[0] not in known:
        print(f"ddpkit standby: error: no ddpkit command after -- (found {' '.join(words) or 'nothing'}); expected "
              "one of train, run", file=sys.stderr)
        return 2
    host, _, port = args.store.rpartition(":")
    import torch.distributed as dist

    for name in known[words[0]].preload:
        importlib.import_module(name)
    store = LiveStore(dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=CONNECT_S),
                                    wait_for_workers=False))
    store.say_proc(args.slot, socket.gethostname().split(".", 1)[0], os.getpid())
    threading.Thread(target=_beat, args=(host, int(port), args.slot), name="ddpkit-beat", daemon=True).start()
    key = store.assign_key(args.slot)
    while True:
        try:
            store.store.wait([key], timedelta(seconds=WAIT_S))
            break
        except dist.DistNetworkError as exc:
            print(f"ddpkit standby: the live agent's store at {args.store} is gone ({str(exc)[:160]}): ending",
                  file=sys.stderr)
            return 1
        except dist.DistStoreError:
            continue  # WAIT_S went by: ask again
    assigned = store.assignment(args.slot)
    if assigned is None:
        return 0  # not needed: the job ended without a lost rank
    os.environ.update(assigned)
    del store
    program(words)


if __name__ == "__main__":
    sys.exit(main())
