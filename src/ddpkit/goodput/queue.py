"""Queue wait where the scheduler says: under Slurm (``SLURM_JOB_ID`` set), the job's SubmitTime and StartTime from
``scontrol show job -o $SLURM_JOB_ID``, read once with a timeout and silently absent where they cannot be read (no
scontrol, a controller that does not answer in time, a time Slurm prints as ``Unknown``).

Slurm prints its times in the controller's local time without a zone (``2026-11-26T14:03:12``); they are read in
this host's local zone, which is the cluster's on every cluster ddpkit was tried on.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
from collections.abc import Mapping
from datetime import datetime

from ddpkit.goodput.records import GoodputLog, QueueWaited, read_goodput

__all__ = ["SCONTROL_TIMEOUT_S", "parse_scontrol", "record_queue_wait", "slurm_queue_wait"]

log = logging.getLogger(__name__)

SCONTROL_TIMEOUT_S = 5.0
_FIELD = re.compile(r"(?:^|\s)(SubmitTime|StartTime)=(\S+)")


def _when(text: str) -> float | None:
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:  # "Unknown", "None", "N/A"
        return None


def parse_scontrol(text: str, job_id: str) -> QueueWaited | None:
    """The queue wait in ``scontrol show job`` output (one line with ``-o``, or the multi-line form); None where
    either time is missing or unknown, or the job has not started."""
    fields = dict(_FIELD.findall(text))
    submit, start = _when(fields.get("SubmitTime", "")), _when(fields.get("StartTime", ""))
    if submit is None or start is None or start < submit:
        return None
    return QueueWaited(scheduler="slurm", job_id=job_id, submit=submit, start=start)


def slurm_queue_wait(environ: Mapping[str, str] | None = None,
                     timeout_s: float = SCONTROL_TIMEOUT_S) -> QueueWaited | None:
    """The job's queue wait as Slurm says, or None (not under Slurm, or Slurm could not be read)."""
    env = os.environ if environ is None else environ
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        return None
    try:
        done = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                              timeout=timeout_s, check=False, env=None if environ is None else dict(environ))
    except (OSError, subprocess.SubprocessError) as e:
        log.debug("scontrol show job %s: %s; no queue wait recorded", job_id, e)
        return None
    if done.returncode != 0:
        log.debug("scontrol show job %s exited %s; no queue wait recorded", job_id, done.returncode)
        return None
    return parse_scontrol(done.stdout, job_id)


def record_queue_wait(log_: GoodputLog, environ: Mapping[str, str] | None = None,
                      timeout_s: float = SCONTROL_TIMEOUT_S) -> QueueWaited | None:
    """Rank 0's start: append the job's queue wait to its ledger once per scheduler job (a later attempt or a
    requeued job's next start finds it written); returns what was written, or None."""
    env = os.environ if environ is None else environ
    job_id = env.get("SLURM_JOB_ID")
    if log_.rank != 0 or not job_id:
        return None
    if any(isinstance(r, QueueWaited) and r.job_id == job_id for r in read_goodput(log_.path)):
        return None
    found = slurm_queue_wait(env, timeout_s)
    if found is not None:
        log_.write(found)
    return found
