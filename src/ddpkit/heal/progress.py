"""A run's progress, for the no-progress rule (``policy``): the step of the newest snapshot ``ddpkit train
--snapshot-path`` left. One reading for every backend: the one-host and torch elastic supervisors have the path
(``HealRequest.progress_path``); mpirun's and Slurm's read it from the ranks' command line (``--snapshot-path X`` or
``--snapshot-path=X``)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["newest_snapshot_step", "program_progress"]


def newest_snapshot_step(path: str | None) -> int | None:
    """The run's progress: the global step of the newest snapshot file ``ddpkit train --snapshot-path PATH`` left
    (named ``NAME.<step>.pt``; unverified: the trainer verifies it when it resumes). None for a user's script, or a
    train run without snapshots (``path`` None): its progress is unknown."""
    if not path:
        return None
    from ddpkit.train.config import snapshot_location
    from ddpkit.train.snapshot import SnapshotDir

    directory, name, ext = snapshot_location(path)
    try:
        found = SnapshotDir(directory, name, ext, keep=1).candidates()
    except OSError:
        return None
    return found[0][0] if found else None


def program_progress(words: Sequence[str]) -> int | None:
    """The newest snapshot's step of a ``train --snapshot-path`` command line (the ranks' program, or a job's
    command), else None (progress unknown: a user's script, or train without snapshots)."""
    words = list(words)
    if "train" not in words:
        return None
    path = None
    for i, word in enumerate(words):
        if word == "--snapshot-path" and i + 1 < len(words):
            path = words[i + 1]
        elif word.startswith("--snapshot-path="):
            path = word.split("=", 1)[1]
    return newest_snapshot_step(path)
