"""A rank's process under Slurm with ``--heal live`` (``python -m ddpkit.standby``, one srun step of one task,
started by the supervisor's live agent, ``ddpkit.live.agent.slurm``): it starts its pulse (``live.agent.pulse``, a
process beside it that tells the agent what this node's kernel says of it), says its pid, and waits for its
assignment in the agent's store: there at once for a rank of the first group; on a spare node (a standby) only once
a rank is lost. Its keys are the protocol's ``assign`` and ``proc`` (``ddpkit.live.protocol``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from datetime import timedelta

from ddpkit.live.protocol import LiveStore

__all__ = ["start_pulse", "wait_for_rank"]

#: How long one wait for the assignment lasts before the store is asked again (seconds); a store that is gone ends
#: the wait (the supervisor ended): the standby never waits on its own.
WAIT_S = 30.0
#: How long the first connection to the agent's store may take (seconds).
CONNECT_S = 60.0


def _connect(host: str, port: int) -> LiveStore:
    import torch.distributed as dist

    return LiveStore(dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=CONNECT_S),
                                   wait_for_workers=False))


def start_pulse(address: str, slot: str) -> subprocess.Popen[bytes]:
    """This process's pulse (``python -m ddpkit.live.agent.pulse``), started first thing: its interpreter's start
    runs beside this one's imports. It ends with this process."""
    return subprocess.Popen([sys.executable, "-m", "ddpkit.live.agent.pulse", "--store", address, "--slot", slot,
                             "--pid", str(os.getpid())], stdin=subprocess.DEVNULL)


def wait_for_rank(address: str, slot: str) -> dict[str, str] | None:
    """Say this process and wait for its rank's variables at the agent's store ``address``
    (HOST:PORT): the variables, or None where the agent said it is not needed (the job ended with no rank lost).
    A store that is gone ends the wait: ``SystemExit(1)``."""
    import torch.distributed as dist

    host, _, port = address.rpartition(":")
    store = _connect(host, int(port))
    store.say_proc(slot, socket.gethostname().split(".", 1)[0], os.getpid())
    key = store.assign_key(slot)
    while True:
        try:
            store.store.wait([key], timedelta(seconds=WAIT_S))
            break
        except dist.DistNetworkError as exc:
            print(f"ddpkit standby: the live agent's store at {address} is gone ({str(exc)[:160]}): ending",
                  file=sys.stderr)
            raise SystemExit(1) from exc
        except dist.DistStoreError:
            continue  # WAIT_S went by: ask again
    return store.assignment(slot)
