"""What the heal supervisor of a Slurm job asks ``scontrol``: the allocation's hosts, a bad host given back to Slurm
or drained. Every call bounded by ``SCONTROL_S``."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

from ddpkit.base.errors import ConfigError
from ddpkit.heal.attempts import say
from ddpkit.heal.nodepool import NodePool

__all__ = ["SCONTROL_S", "drain", "hostnames", "release"]

SCONTROL_S = 30.0


def release(pool: NodePool, run_dir: Path) -> None:
    """Give the bad hosts back to Slurm (``scontrol update JobId=J NodeList=the rest``): the job can never use them
    again, and a host cut off from the network no longer holds the job in COMPLETING at its end. The batch host
    stays in the job (the supervisor runs there): it is only never used again. scontrol writes its resize scripts
    (``slurm_job_J_resize.sh``) into the run directory."""
    job = os.environ.get("SLURM_JOB_ID", "")
    here = socket.gethostname().split(".")[0]
    keep = [n for n in pool.allocation if n not in pool.bad or n == here]
    if len(keep) == len(pool.allocation) or not job:
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["scontrol", "update", f"JobId={job}", f"NodeList={','.join(keep)}"], capture_output=True,
                         text=True, timeout=SCONTROL_S, check=False, cwd=run_dir)
    if res.returncode != 0:
        say(f"ddpkit heal: could not give {', '.join(sorted(set(pool.allocation) - set(keep)))} back to Slurm: "
            f"{(res.stderr or res.stdout).strip()}")
        return


def drain(host: str, reason: str) -> bool:
    res = subprocess.run(["scontrol", "update", f"nodename={host}", "state=drain", f"reason={reason[:200]}"],
                         capture_output=True, text=True, timeout=SCONTROL_S, check=False)
    if res.returncode != 0:
        say(f"ddpkit heal: could not drain {host}: {(res.stderr or res.stdout).strip()}")
    return res.returncode == 0


def hostnames(nodelist: str) -> tuple[str, ...]:
    if not nodelist:
        raise ConfigError("SLURM_JOB_NODELIST is empty", "the job's node list", "run inside a Slurm allocation")
    res = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                         timeout=SCONTROL_S, check=False)
    names = tuple(res.stdout.split())
    if res.returncode != 0 or not names:
        raise ConfigError(f"scontrol show hostnames {nodelist} failed: {res.stderr.strip()}", "the job's hosts",
                          "check that scontrol works in the batch script")
    return names
