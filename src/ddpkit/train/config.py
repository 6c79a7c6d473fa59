"""What a training run is asked to do: one frozen, keyword-only dataclass validated on construction.

Every check here runs before any process group starts, so a bad option costs the user a message and exit
code 2, never a half-started job.
"""

from __future__ import annotations

import importlib
import os
import re
import signal
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ddpkit.base.errors import ConfigError

__all__ = ["MODELS", "PREEMPT_SIGNALS", "Drill", "TrainConfig", "check_job_spec", "parse_drill",
           "snapshot_location"]

MODELS = ("linear", "toy", "mlp")
PREEMPT_SIGNALS = {"TERM": signal.SIGTERM, "USR1": signal.SIGUSR1, "USR2": signal.SIGUSR2}
_DRILL = re.compile(r"^(?P<kind>kill-worker|preempt)@(?P<params>[a-z]+=\d+(?:,[a-z]+=\d+)*)$")


@dataclass(frozen=True, kw_only=True)
class Drill:
    """A fault injected once, on purpose, to prove the job survives it."""

    kind: str
    """``kill-worker`` (SIGKILL one rank) or ``preempt`` (send the preemption signal to rank 0)."""
    epoch: int
    """Epoch in which it fires, half-way through the epoch's steps."""
    rank: int | None = None
    """Rank that is killed (kill-worker); None: the last rank."""

    def __str__(self) -> str:
        rank = f",rank={self.rank}" if self.rank is not None else ""
        return f"{self.kind}@epoch={self.epoch}{rank}"


def parse_drill(text: str) -> Drill:
    """``kill-worker@epoch=3[,rank=1]`` or ``preempt@epoch=3``."""
    m = _DRILL.match(text.strip())
    if m is None:
        raise ConfigError(f"--drill {text!r} is not understood", "kill-worker@epoch=E[,rank=R] or preempt@epoch=E",
                          "write --drill kill-worker@epoch=3,rank=1")
    params = dict(pair.split("=") for pair in m["params"].split(","))
    unknown = set(params) - ({"epoch", "rank"} if m["kind"] == "kill-worker" else {"epoch"})
    if unknown or "epoch" not in params:
        what = f"unknown keys {', '.join(sorted(unknown))}" if unknown else "no epoch"
        raise ConfigError(f"--drill {text!r} has {what}",
                          "epoch=E (and rank=R for kill-worker)", "write --drill preempt@epoch=3")
    rank = int(params["rank"]) if "rank" in params else None
    return Drill(kind=m["kind"], epoch=int(params["epoch"]), rank=rank)


def snapshot_location(path: str) -> tuple[Path, str, str]:
    """``DIR/NAME.EXT`` -> (DIR, NAME, EXT); a directory (existing, or ending in /) -> (DIR, snapshot, .pt).

    Snapshots are kept as ``DIR/NAME.<global step>.EXT`` so that several can be kept and the newest found.
    """
    p = Path(path).expanduser()
    if path.endswith(("/", os.sep)) or p.is_dir():
        return p, "snapshot", ".pt"
    return p.parent, p.stem if p.suffix else p.name, p.suffix or ".pt"


def _check_writable_dir(directory: Path, option: str) -> None:
    """A directory ddpkit writes into: an existing one this user can write, or one it will create (``mkdir -p``, as
    for every output path) below the nearest existing directory, which this user must be able to write."""
    existing = next(p for p in (directory, *directory.parents, Path(".")) if p.exists())
    if not existing.is_dir():
        what = "not a directory" if existing == directory else f"so no directory {str(directory)!r} can be made in it"
        raise ConfigError(f"{option}: {str(existing)!r} is a file, {what}",
                          "a directory, or a path where one can be created",
                          f"choose another {option}, or move the file {str(existing)!r} away")
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == directory else f" (to create {str(directory)!r} in)"
        raise ConfigError(f"{option}: directory {str(existing)!r}{where} is not writable by this user",
                          "a directory this user can create files in",
                          f"choose another {option} or fix the permissions")


def check_job_spec(spec: str) -> None:
    """``package.module:function`` must import and name a callable; else ConfigError (exit 2)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"--make-job {spec!r} is not MODULE:FUNCTION", "a spec such as my_pkg.my_module:make_job",
                          "write --make-job my_pkg.my_module:make_job")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time failure of user code is the user's to fix
        raise ConfigError(f"--make-job {spec!r}: module {module_name!r} cannot be imported "
                          f"({type(exc).__name__}: {exc})",
                          "an importable module on PYTHONPATH", "check the name, install the package, or set "
                          "PYTHONPATH") from None
    if not callable(getattr(module, attr, None)):
        raise ConfigError(f"--make-job {spec!r}: {module_name} has no callable {attr!r}",
                          "a function returning a ddpkit.train.TrainJob", f"define def {attr}(config) in {module_name}")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run: the job, the loop, snapshots, faults and reporting."""

    model: str = "linear"
    """Built-in model: linear (the seeds' Linear(20,1)), toy (the DDP tutorial's), mlp (width x depth)."""
    width: int = 2048
    """Hidden width of the mlp model."""
    depth: int = 2
    """Hidden layers of the mlp model (width 2048, depth 2: about 4.7M parameters)."""
    samples: int = 2048
    """Synthetic samples (the same seeded data on every rank)."""
    batch_size: int = 32
    """Samples per step on each rank."""
    epochs: int = 10
    """Total epochs, counting those done before a resume."""
    lr: float = 1e-3
    """SGD learning rate."""
    seed: int = 0
    """Seeds the data, the model, the sampler order and each rank's random generators."""
    snapshot_path: str | None = None
    """Snapshot file (DIR/NAME.pt, kept as DIR/NAME.<step>.pt) or directory (DIR/); None: no snapshots. A missing
    DIR is created by rank 0."""
    save_every: int = 1
    """Write a snapshot every N epochs (and after the last one)."""
    keep: int = 2
    """Snapshots kept on disk; older ones are removed after a newer one is safely written."""
    async_snapshot: bool = False
    """Serialise and write snapshots on a background thread; training blocks only for an in-memory copy."""
    preempt_signal: str = "TERM"
    """Signal that asks for a snapshot and a clean stop: TERM, USR1 or USR2 (SIGTERM is always honoured)."""
    requeue: bool = False
    """After a preemption snapshot, rank 0 runs ``scontrol requeue $SLURM_JOB_ID``."""
    drills: tuple[Drill, ...] = ()
    """Faults to inject once each (remembered in the snapshot directory)."""
    job: str | None = None
    """``module:function`` that builds a TrainJob from this config; None: the built-in model and data."""
    json_path: str | None = None
    """Write the run summary as JSON here (rank 0)."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms(True) (and the cuDNN/cuBLAS settings it needs on CUDA)."""
    collective_timeout: float = 60.0
    """Seconds a collective may wait for a peer before the rank gives up, names who stopped answering and exits 3."""
    progress: bool | None = None
    """Progress bar on rank 0: None means only when stdout is a terminal."""
    extra: dict[str, str] = field(default_factory=dict)
    """Free-form settings a --make-job function may read (not validated)."""

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ConfigError(f"--model {self.model!r} is unknown", f"one of {', '.join(MODELS)}",
                              "pass --model linear, toy or mlp, or --make-job for your own")
        for name in ("width", "depth", "samples", "batch_size", "epochs", "save_every", "keep"):
            value = getattr(self, name)
            if value < 1:
                option = "--" + name.replace("_", "-")
                raise ConfigError(f"{option} {value}", "a positive integer", f"pass {option} 1 or more")
        if self.batch_size > self.samples:
            raise ConfigError(f"--batch-size {self.batch_size} is larger than --samples {self.samples}",
                              "a batch no larger than the data", "lower --batch-size or raise --samples")
        if not self.lr > 0:
            raise ConfigError(f"--lr {self.lr}", "a positive learning rate", "pass --lr 1e-3")
        if self.preempt_signal not in PREEMPT_SIGNALS:
            raise ConfigError(f"--preempt-signal {self.preempt_signal!r}", f"one of {', '.join(PREEMPT_SIGNALS)}",
                              "pass --preempt-signal USR1 to match Slurm's --signal=USR1@60")
        if self.snapshot_path is not None:
            directory, _, _ = snapshot_location(self.snapshot_path)
            _check_writable_dir(directory, "--snapshot-path")
        elif self.drills or self.async_snapshot:
            raise ConfigError("--drill and --async-snapshot need snapshots but no --snapshot-path was given",
                              "a snapshot location", "add --snapshot-path DIR/snapshot.pt")
        for drill in self.drills:
            if drill.epoch >= self.epochs:
                raise ConfigError(f"--drill {drill} fires after the last epoch ({self.epochs - 1})",
                                  "an epoch the run reaches", f"use an epoch below {self.epochs}")
        if not self.collective_timeout > 0:
            raise ConfigError(f"--collective-timeout {self.collective_timeout}", "a positive number of seconds",
                              "pass --collective-timeout 60")
        if self.json_path is not None:
            _check_writable_dir(Path(self.json_path).expanduser().parent, "--json")
        if self.job is not None:
            check_job_spec(self.job)

    @property
    def preempt_signum(self) -> signal.Signals:
        return PREEMPT_SIGNALS[self.preempt_signal]

    def snapshot_due(self, done: int) -> bool:
        """Whether a snapshot is due once ``done`` epochs are done: every ``save_every``, and after the last."""
        return done > 0 and (done % self.save_every == 0 or done == self.epochs)

    def fingerprint(self) -> dict[str, object]:
        """The settings a snapshot must share with the run that resumes it (epochs may grow; faults may change)."""
        keys = ("model", "samples", "batch_size", "lr", "seed", "job")
        out = {k: getattr(self, k) for k in keys}
        if self.model == "mlp" and self.job is None:
            out.update(width=self.width, depth=self.depth)
        return out

    def as_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["drills"] = [str(d) for d in self.drills]
        return out
