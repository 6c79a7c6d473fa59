"""``ddpkit step -- srun --label ...`` (or ``-- torchrun ...``): a job step whose output the user reads on one screen.

The rendered batch script (``ddpkit.jobs.slurm``) runs its ``srun`` under this command, and a rendered torchrun
script (``ddpkit.jobs.torchrun``) its ``torchrun``: the same screen for the one agent's stream of that node (its
full log: beside the script's output where that is a file, else ``ddpkit-step-PID.full.log`` in the working
directory). Every line srun writes
(each node's torchrun agent and its ranks, or each rank under ``--tasks-per-rank``, labelled ``T:`` by ``--label``)
goes whole, with its label, to the full log beside the job's output (``logs/NAME_ID.out`` -> ``NAME_ID.full.log``,
appended across requeues). The job's output gets the same lines without the label, except:

- torch's C++ frames and the line that opens them (kept in the full log only);
- torch's C++ warnings (``[W1126 ...] [c10d] sendBytes failed ... Broken pipe``, every 0.5 s while a store is
  gone): each kind shown once, and none once the step fails;
- a usage error every rank prints alike (``ddpkit: error: ...``): shown once;
- from the moment a task prints a Python traceback, or its agent says a rank failed, every task's stderr is held:
  the agents' ``ChildFailedError`` tracebacks and "Root Cause" boxes, the peers' secondary tracebacks. A failed step
  ends with the digest instead (cause first: what the watch found, else the rank that failed first, with its host
  and words; a rank ddpkit stopped, exit 3, is never that rank); a step that goes on shows what was held after
  ``RELEASE_S``.

Its exit code is the launcher's. Under srun it ignores the signals Slurm sends the batch step (SIGTERM on scancel or
requeue, USR1/USR2 of ``--signal``): srun gets them too and ends the step, whose last lines are read to the end.
Another launcher runs in a session of its own, and each of those signals (and Ctrl-C's SIGINT) is passed to it once:
a second copy from the terminal's process group would cut its shutdown of the ranks short.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import subprocess
import sys
import threading
import time

from ddpkit.base.errors import ConfigError
from ddpkit.base.inputs import program_words
from ddpkit.launch.stepscreen import StepScreen

__all__ = ["add_arguments", "full_log_path", "run"]


def full_log_path(job_id: str | None = None) -> str:
    """Beside the job's output, where Slurm opened it as this process's stdout (``NAME_ID.out`` ->
    ``NAME_ID.full.log``); else ``ddpkit-step-JOBID.full.log`` in the working directory."""
    try:
        out = os.readlink("/proc/self/fd/1")
    except OSError:
        out = ""
    if out.startswith("/") and os.path.isfile(out):
        base, ext = os.path.splitext(out)
        return f"{base if ext == '.out' else out}.full.log"
    return os.path.abspath(f"ddpkit-step-{job_id or os.environ.get('SLURM_JOB_ID', os.getpid())}.full.log")


# -- the command -------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log", metavar="PATH", help="the full output's file (default: beside the job's output, "
                                                 "NAME_ID.full.log)")
    p.add_argument("--show-all", action="store_true",
                   help="show every line as it comes, no full log (where the output is kept whole already, a "
                        "Kubernetes pod's log): a failed run still ends with the digest")
    p.add_argument("argv", nargs=argparse.REMAINDER, help="-- srun --label ... or -- torchrun ... (the step to run)")


def run(args: argparse.Namespace) -> int:
    argv = program_words(args.argv, ConfigError(
        "no step to run", "ddpkit step [--log PATH] -- srun --label ARGS... (or -- torchrun ...)",
        "give the launcher's command after --"))
    log = os.devnull if args.show_all else args.log or full_log_path()
    named = "the lines above" if args.show_all else log  # where the digest says the full output is
    agents = any(word.endswith(("torchrun", "torch.distributed.run")) for word in argv)
    name = os.path.basename(argv[0])
    launcher = "srun" if name == "srun" else "torchrun" if agents else \
        "mpirun" if name in ("mpirun", "mpiexec") and "--tag-output" in argv else \
        "mpich" if name.startswith("mpiexec") and "-prepend-rank" in argv else name
    forward: list[subprocess.Popen[bytes]] = []
    passed: list[int] = []  # the signals passed on to the launcher
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP) + \
            ((signal.SIGINT,) if launcher != "srun" else ()):
        # a handler, not SIG_IGN: the launcher (exec'd) gets its own default dispositions
        signal.signal(sig, _ignore if launcher == "srun" else lambda signum, frame: _forward(forward, signum, passed))
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=launcher != "srun")
    except OSError as exc:
        raise ConfigError(f"cannot start {argv[0]}: {exc}", "a launcher command on PATH (srun, torchrun)",
                          "check the job script") from None
    forward.append(proc)
    per_node = next((w.split("=", 1)[1] for w in argv if w.startswith("--nproc-per-node=")), "")
    screen = StepScreen(sys.stdout, sys.stderr, agents=agents, launcher=launcher, show_all=args.show_all,
                        ranks_per_task=int(per_node) if agents and per_node.isdigit() else None if agents else 1)
    lines: queue.Queue[tuple[bool, bytes | None]] = queue.Queue()
    readers = [threading.Thread(target=_read, args=(stream, to_stderr, lines), daemon=True)
               for stream, to_stderr in ((proc.stdout, False), (proc.stderr, True))]
    for reader in readers:
        reader.start()
    with open(log, "ab") as full:
        if launcher == "srun":
            restart = os.environ.get("SLURM_RESTART_COUNT", "0")
            full.write(f"ddpkit step: job {os.environ.get('SLURM_JOB_ID', '?')} restart {restart}: "
                       f"{' '.join(argv)}\n".encode())
        else:
            full.write(f"ddpkit step: {time.strftime('%Y-%m-%dT%H:%M:%S')}: {' '.join(argv)}\n".encode())
        open_streams = len(readers)
        while open_streams:
            try:
                to_stderr, raw = lines.get(timeout=0.5)
            except queue.Empty:
                screen.tick()
                continue
            if raw is None:
                open_streams -= 1
                continue
            full.write(raw)
            full.flush()
            screen.take(raw.decode(errors="replace").rstrip("\r\n"), to_stderr=to_stderr)
            screen.tick()
    code = _wait(proc)
    if code == 0 or not (screen.failing or code):
        screen.release()
        return code
    if passed and not screen.failing:  # ended from outside: that is the cause (the agent's traceback: in the log)
        names = ", ".join(dict.fromkeys(signal.Signals(n).name for n in passed))
        sys.stderr.write(f"ddpkit: {launcher} was ended by {names} from outside (passed on by ddpkit step; exit code "
                         f"{code}); its full output: {named}\n")
        sys.stderr.flush()
        return code if code > 0 else 128 - code
    for text in screen.digest(code, named):
        sys.stderr.write(text + "\n")
    sys.stderr.flush()
    return code if code > 0 else 128 - code


def _read(stream: object, to_stderr: bool, lines: queue.Queue[tuple[bool, bytes | None]]) -> None:
    for raw in iter(stream.readline, b""):  # type: ignore[attr-defined]
        lines.put((to_stderr, raw))
    lines.put((to_stderr, None))


def _wait(proc: subprocess.Popen[bytes]) -> int:
    """srun's exit code once its streams closed (it exits right after; every wait here is bounded)."""
    for _ in range(120):
        try:
            return proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            continue
    proc.kill()
    return proc.wait(timeout=10)


def _forward(procs: list[subprocess.Popen[bytes]], signum: int, passed: list[int]) -> None:
    """A signal for the job, passed to the launcher (in a session of its own, it gets no copy from the terminal)."""
    passed.append(signum)
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signum)


def _ignore(signum: int, frame: object) -> None:
    """Slurm signals every process of the batch step; srun ends the step and this command reads it to the end."""

