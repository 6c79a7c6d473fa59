"""Print a Slurm job's output file (``ddpkit logs JOBID [-f]``); ``-f`` follows it until the job ends.

The path comes from ``scontrol show job`` (StdOut). A requeued job appends to the same file when it was
submitted with ``--requeue`` (``--open-mode=append``), so its log reads first run, then resumed run.
Exit codes: 0 printed; 2 unknown job, or the file is not there (and not following).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ddpkit.base.errors import ConfigError
from ddpkit.jobs import slurmctl

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_id", metavar="JOBID", help="Slurm job id")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    p.add_argument("--poll", type=float, default=0.5, help="seconds between reads with -f")


def run(args: argparse.Namespace) -> int:
    st = slurmctl.job_state(args.job_id)
    if not st.stdout:
        raise ConfigError(f"Slurm reports no output file for job {args.job_id} (answered by {st.source})",
                          "StdOut in scontrol show job", "look for logs/<name>_<id>.out in the submit directory")
    path = Path(st.stdout)
    if not args.follow:
        if not path.exists():
            raise ConfigError(f"job {args.job_id} ({st.state}) has no output file yet at {path}",
                              "the file Slurm writes once the job starts", f"use ddpkit logs {args.job_id} -f")
        sys.stdout.write(path.read_text(errors="replace"))
        return 0
    offset = 0
    while True:
        if path.exists():
            size = path.stat().st_size
            if size < offset:  # truncated (a requeued job without --open-mode=append)
                offset = 0
            with path.open("rb") as f:
                f.seek(offset)
                chunk = f.read()
            offset += len(chunk)
            if chunk:
                sys.stdout.write(chunk.decode(errors="replace"))
                sys.stdout.flush()
        if not st.active:
            return 0
        time.sleep(args.poll)
        st = slurmctl.job_state(args.job_id)
