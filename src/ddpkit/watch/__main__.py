"""``python -m ddpkit.watch``: ``ddpkit run`` by its first name, one runner for both::

    torchrun --standalone --nproc-per-node 2 -m ddpkit.watch --hang-after 30 -- train.py --epochs 3
    mpirun -np 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT=29500 python -m ddpkit.watch -- train.py
    python -m ddpkit.watch -m mypackage.train --epochs 3

are ``ddpkit run`` with the same options (``-m MODULE`` is ``run -m -- MODULE``): the world exported from the
launcher's variables, the watch and its SIGTERM report installed, the script run as ``__main__`` in this process,
and the same exit (``ddpkit.run``, ``ddpkit.process.exiting``). Kept so that jobs written for it still run; it
used to be a second runner, which drifted from ``ddpkit run`` in eight steps.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

__all__ = ["main", "run_argv"]


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the watch's own arguments, the script and its arguments / the module's arguments): everything after
    ``--``, after ``-m MODULE``, or from the first word that is not an option of ours, belongs to the program."""
    valued = {"--hang-after", "--stop-after", "--on-hang", "--report-every", "--events"}
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "--":
            return argv[:i], argv[i + 1:]
        if word == "-m":
            return argv[:i + 2], argv[i + 2:]
        if word in valued:
            i += 2
        elif word.startswith("-"):
            i += 1
        else:
            return argv[:i], argv[i:]
    return argv, []


def run_argv(argv: list[str]) -> list[str]:
    """This runner's command line as ``ddpkit run``'s."""
    ours, rest = _split(argv)
    if len(ours) >= 2 and ours[-2] == "-m":
        return ["run", *ours[:-2], "-m", "--", ours[-1], *rest]
    return ["run", *ours, "--", *rest]


def main(argv: list[str] | None = None) -> NoReturn:
    """Become ``python -m ddpkit run ...`` (exec: the same process, as every launcher sees it; nothing imported
    here from above the watch)."""
    words = run_argv(list(sys.argv[1:] if argv is None else argv))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "ddpkit", *words])


if __name__ == "__main__":
    main()
