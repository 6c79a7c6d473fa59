"""``python -m ddpkit.standby --store HOST:PORT --slot NAME -- train --epochs 40 ...``: a rank's process under Slurm
with ``--heal live``, one srun step of one task (``ddpkit.live.agent.slurm`` starts it).

It starts its pulse (``ddpkit.live.agent.pulse``: the agent's eyes on this node), imports what the command's ranks
import (torch, the trainer: ``Command.preload``), then waits for its rank (``ddpkit.live.agent.standby``): at once
for a rank of the first group; on a spare node (a standby) only once a rank is lost. Given one, it takes the
assignment's variables (torchrun's ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``... and live healing's generation) and
runs the command in this process, as ``python -m ddpkit ARGV`` would. An empty assignment ends it (the job is over,
no rank was lost)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ddpkit.cli import COMMANDS, program
from ddpkit.live.agent.standby import start_pulse, wait_for_rank

__all__ = ["main"]


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
    start_pulse(args.store, args.slot)  # the agent's eyes on this node, from now until this process ends
    for name in known[words[0]].preload:
        importlib.import_module(name)
    assigned = wait_for_rank(args.store, args.slot)
    if assigned is None:
        return 0  # not needed: the job ended without a lost rank
    os.environ.update(assigned)
    program(words)
    return 0


if __name__ == "__main__":
    sys.exit(main())
