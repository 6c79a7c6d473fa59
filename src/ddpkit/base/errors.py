"""User-facing errors.

Every error says what was found, what was expected and what to do next, and carries the process exit code
the CLI maps it to. None of them is shown with a traceback: they describe the user's input or environment,
not a bug in ddpkit.
"""

from __future__ import annotations

__all__ = [
    "EXIT_CHECK_FAILED",
    "EXIT_IO",
    "EXIT_MISSING",
    "EXIT_OK",
    "EXIT_PREEMPTED",
    "EXIT_PREEMPTED_UNSAVED",
    "EXIT_USAGE",
    "CheckFailed",
    "ConfigError",
    "DdpkitError",
    "DeadlineExpired",
    "DiskFull",
    "EnvConflict",
    "first_line",
]

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
EXIT_MISSING = 3
#: A file ddpkit must write could not be, for lack of space (sysexits.h EX_IOERR: "an error occurred while doing
#: I/O on some file"). Not 1: nothing failed a check; not 2: the input was fine; the disk was full.
EXIT_IO = 74
#: A run stopped by a preemption signal after writing its snapshot (EX_TEMPFAIL: "try again later").
EXIT_PREEMPTED = 75
#: A run stopped by a preemption signal with no snapshot to resume from (none configured): its progress is lost.
EXIT_PREEMPTED_UNSAVED = 76


class DdpkitError(Exception):
    """Base of ddpkit's user-facing errors."""

    exit_code = EXIT_USAGE

    def __init__(self, found: str, expected: str = "", fix: str = "") -> None:
        self.found = found
        self.expected = expected
        self.fix = fix
        super().__init__(self.message())

    def message(self) -> str:
        parts = [self.found.rstrip(".") + "."]
        if self.expected:
            parts.append(f"Expected: {self.expected.rstrip('.')}.")
        if self.fix:
            parts.append(f"Fix: {self.fix.rstrip('.')}.")
        return "\n  ".join(parts)


class ConfigError(DdpkitError):
    """A command-line option or configuration value is invalid."""


class EnvConflict(DdpkitError):
    """The launcher's environment variables are malformed or contradict each other."""


class CheckFailed(DdpkitError):
    """A verification failed (a wrong collective result, replicas out of sync, versions differ)."""

    exit_code = EXIT_CHECK_FAILED


class DiskFull(DdpkitError):
    """A snapshot (or another output) did not fit on its filesystem; what was there before is intact."""

    exit_code = EXIT_IO


class DeadlineExpired(DdpkitError):
    """Ranks never arrived, or a phase did not finish before its deadline."""

    exit_code = EXIT_MISSING


def first_line(exc: BaseException) -> str:
    """An exception in one line: the first line of its message, else its type's name (``DistStoreError``)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
