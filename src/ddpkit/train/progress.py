"""The progress bar on rank 0: rich, on a person's terminal only; the loss is read back (a device synchronisation
on GPU) only when the bar is shown, and at most every REFRESH_S seconds."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

__all__ = ["Progress", "on_terminal"]


def on_terminal() -> bool:
    """Is stdout a person's terminal? Open MPI hands its ranks a pseudo-terminal even when mpirun's own output goes
    to a file or a pipe, so under Open MPI only an explicit --progress shows the bar."""
    return sys.stdout.isatty() and "OMPI_COMM_WORLD_RANK" not in os.environ


class Progress:
    """A rich progress bar when enabled; otherwise nothing. Shown from the first epoch."""

    #: The shown loss is refreshed at most this often (rich redraws 10 times a second).
    REFRESH_S = 0.25

    def __init__(self, enabled: bool) -> None:
        self.bar: Any = None
        self.task: Any = None
        self._shown = 0.0
        if enabled:
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(transient=True)

    def start(self, epoch: int, total: int) -> None:
        if self.bar is not None:
            if self.task is None:
                self.bar.start()
            else:
                self.bar.remove_task(self.task)
            self.task = self.bar.add_task(f"epoch {epoch}", total=total)

    def advance(self, loss: Any) -> None:
        """One step done; ``loss`` (a tensor) is read only when its value is shown."""
        if self.bar is None:
            return
        now = time.monotonic()
        if now - self._shown >= self.REFRESH_S:
            self._shown = now
            self.bar.update(self.task, advance=1, description=f"loss {float(loss.detach()):.4f}")
        else:
            self.bar.update(self.task, advance=1)

    def stop(self) -> None:
        if self.task is not None:  # started
            self.bar.stop()
