"""Talking to Slurm's client commands: sbatch, squeue, scontrol, sacct, each with a timeout.

``wait`` polls ``squeue`` every 0.5 s rather than using ``sbatch --wait``, whose backoff made a 12 s job return
after 42 s here; it follows a job through requeues (a requeued job is pending again, not finished) and returns
the final state, whose exit code becomes ddpkit's.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ddpkit.base.errors import ConfigError, DeadlineExpired
from ddpkit.base.log import get_logger

__all__ = ["JobState", "describe", "job_exit_code", "job_state", "reason_text", "sbatch", "wait"]

log = get_logger(__name__)
CALL_TIMEOUT = 30.0
_ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
           "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "RESV_DEL_HOLD"}


@dataclass(frozen=True, kw_only=True)
class JobState:
    """What Slurm knows about one job."""

    job_id: str
    """The job id."""
    state: str
    """PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT, NODE_FAIL, PREEMPTED, OUT_OF_MEMORY, ..."""
    exit_status: int | None = None
    """The batch script's exit status, where the job ended."""
    exit_signal: int | None = None
    """The signal that ended it, where one did."""
    name: str = ""
    """Job name."""
    reason: str = ""
    """Why it is pending or how it ended (Slurm's Reason)."""
    nodes: str = ""
    """Allocated node list."""
    restarts: int = 0
    """How many times it was requeued."""
    stdout: str | None = None
    """Path of its output file."""
    source: str = "scontrol"
    """Which command answered: scontrol, sacct or squeue."""
    fields: dict[str, str] = field(default_factory=dict)
    """Everything the answering command said."""

    @property
    def active(self) -> bool:
        return self.state in _ACTIVE


def _run(argv: list[str], *, timeout: float = CALL_TIMEOUT, stdin: str | None = None,
         cwd: Path | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    if shutil.which(argv[0]) is None:
        raise ConfigError(f"{argv[0]} is not on PATH", "the Slurm client commands (sbatch, squeue, scontrol)",
                          "run on a Slurm login node, install slurm-client, or use --dry-run -o job.sbatch")
    try:
        res = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired:
        raise DeadlineExpired(f"{' '.join(argv[:3])} did not answer within {timeout:.0f} s",
                              "slurmctld answering", "check the controller with sinfo / scontrol ping") from None
    if check and res.returncode != 0:
        raise ConfigError(f"{argv[0]} failed (exit code {res.returncode}): {res.stderr.strip() or res.stdout.strip()}",
                          f"{argv[0]} to accept the request", "fix what Slurm reports above")
    return res


def sbatch(script: str, *, cwd: Path, script_path: Path | None = None) -> str:
    """Submit the script (the file when written, else on stdin); return the job id."""
    argv = ["sbatch", "--parsable"]
    res = _run([*argv, str(script_path)], cwd=cwd) if script_path is not None else _run(argv, stdin=script, cwd=cwd)
    job_id = res.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise ConfigError(f"sbatch answered {res.stdout.strip()!r}", "a job id", "check sbatch's output above")
    return job_id


_KV = re.compile(r"(\w[\w:/]*)=(\S*)")
#: What Slurm prints in its Reason fields when there is no reason (squeue %r, scontrol Reason=, sacct Reason).
_NO_REASON = ("", "None", "(null)")


def reason_text(raw: str) -> str:
    """Slurm's Reason as ddpkit shows it: empty where Slurm gives none (it writes ``None`` there)."""
    reason = raw.strip()
    return "" if reason in _NO_REASON else reason


def describe(squeue_line: str) -> str:
    """An ``squeue -o '%T %r'`` line as ddpkit prints it: ``PENDING Resources``, ``RUNNING`` (never ``None``)."""
    state, _, reason = squeue_line.strip().partition(" ")
    reason = reason_text(reason)
    return f"{state} {reason}" if reason else state


def _scontrol(job_id: str) -> JobState | None:
    res = _run(["scontrol", "show", "job", "-o", job_id], check=False)
    if res.returncode != 0 or "JobId=" not in res.stdout:
        return None
    line = res.stdout.strip().splitlines()[0]
    kv = dict(_KV.findall(line))
    status, sig = ([*kv.get("ExitCode", "0:0").split(":"), "0"])[:2]
    state = kv.get("JobState", "UNKNOWN")
    ended = state not in _ACTIVE
    return JobState(job_id=job_id, state=state, exit_status=int(status) if ended else None,
                    exit_signal=int(sig) if ended and sig != "0" else None, name=kv.get("JobName", ""),
                    reason=reason_text(kv.get("Reason", "")), nodes=kv.get("NodeList", ""),
                    restarts=int(kv.get("Restarts", 0)),
                    stdout=kv.get("StdOut"), source="scontrol", fields=kv)


def _sacct(job_id: str) -> JobState | None:
    if shutil.which("sacct") is None:
        return None
    res = _run(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "JobID,JobName,State,ExitCode,NodeList,Reason"],
               check=False)
    rows = [r.split("|") for r in res.stdout.strip().splitlines() if r.startswith(job_id + "|")]
    if res.returncode != 0 or not rows:
        return None
    _, name, state, code, nodes, reason = (rows[-1] + [""] * 6)[:6]
    status, sig = ([*code.split(":"), "0"])[:2]
    state = state.split()[0]
    return JobState(job_id=job_id, state=state, exit_status=int(status or 0), exit_signal=int(sig) or None,
                    name=name, nodes=nodes, reason=reason_text(reason), source="sacct")


def job_state(job_id: str) -> JobState:
    """scontrol first (it knows the output file), then sacct (it remembers old jobs); unknown ids are errors."""
    if not job_id.isdigit():
        raise ConfigError(f"job id {job_id!r}", "a Slurm job id such as 1234", "take the id ddpkit submit printed")
    found = _scontrol(job_id) or _sacct(job_id)
    if found is None:
        raise ConfigError(f"Slurm knows no job {job_id}", "a job id from squeue or ddpkit submit",
                          "finished jobs are forgotten after MinJobAge unless accounting (sacct) is enabled")
    return found


def job_exit_code(state: JobState) -> int:
    """The job's exit code as a process's: its status, else 128 + signal, else 1 for a job that did not complete."""
    if state.exit_status:
        return state.exit_status
    if state.exit_signal:
        return 128 + state.exit_signal
    return 0 if state.state == "COMPLETED" else 1


def wait(job_id: str, *, poll: float = 0.5, timeout: float | None = None,
         on_change: Callable[[str], None] | None = None) -> JobState:
    """Poll squeue every ``poll`` s until the job leaves the queue for good; return its final state."""
    deadline = None if timeout is None else time.monotonic() + timeout
    last = ""
    while True:
        res = _run(["squeue", "-h", "-j", job_id, "-o", "%T %r"], check=False)
        now = res.stdout.strip()
        if now != last and on_change is not None and now:
            on_change(describe(now))
        last = now or last
        if not now:  # finished (or, with an error, unknown: job_state says which)
            final = job_state(job_id)
            if not final.active:  # squeue can lag scontrol for an instant at the end of a job
                return final
        if deadline is not None and time.monotonic() > deadline:
            raise DeadlineExpired(f"job {job_id} still {last or 'queued'} after {timeout:.0f} s",
                                  "the job to finish", f"look at it with ddpkit status {job_id}")
        time.sleep(poll)
