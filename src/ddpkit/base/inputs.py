"""Command-line values checked at parse time, before any rank starts or anything is written.

Each factory returns an argparse ``type=`` function; a bad value raises ConfigError (exit code 2, a message that
says what was found, what was expected and what to do). No torch import: ``ddpkit env`` and ``submit`` use these.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ddpkit.base.errors import ConfigError

__all__ = ["HEAL_MODES", "HEAL_SILENT_DEFAULT_S", "add_heal_flag", "check_local_ranks", "check_output_path",
           "check_run_directory", "endpoint", "local_rank_limit", "local_ranks", "output_path", "program_words",
           "run_directory", "seconds", "shape_text"]

#: ``--heal MODE``: ``restart`` (a bare ``--heal``) or ``live``.
HEAL_MODES = ("restart", "live")
#: ``--silent-after``'s default under every --heal backend: a rank silent 10 s is a lost host (a heartbeat is stale
#: after 3 s); the agent tells its ranks as ``process.worker_context.HEAL_SILENT_S``.
HEAL_SILENT_DEFAULT_S = 10.0


def add_heal_flag(group: Any, help: str) -> None:
    """``--heal [restart|live]`` on ``group`` (an argparse group), as every command that heals takes it."""
    group.add_argument("--heal", nargs="?", const="restart", default=None, choices=HEAL_MODES, help=help)


#: Beyond this many digits a count is a typo, and Python's int() refuses 4300 digits with a traceback.
_MAX_DIGITS = 6


def program_words(words: Sequence[str], missing: ConfigError | None = None) -> list[str]:
    """A program and its arguments as argparse kept them (``nargs=REMAINDER``), without the ``--`` that ends
    ddpkit's own options; ``missing`` is raised where no word is left."""
    program = list(words)
    if program[:1] == ["--"]:
        program = program[1:]
    if not program and missing is not None:
        raise missing
    return program


def seconds(option: str) -> Callable[[str], float]:
    """A duration in seconds: finite and above zero (``nan`` compares false to everything, ``inf`` never ends)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{option} {text!r}", "a finite number of seconds above zero", f"write {option} 30")
        return value

    return parse


#: Memory a local rank needs at least (a forked gloo rank with torch imported: about 100-200 MiB resident).
RANK_MEMORY_BYTES = 128 << 20


def local_rank_limit() -> tuple[int, str]:
    """How many ranks ddpkit starts on this machine at most, and why: as many as the available memory holds at
    RANK_MEMORY_BYTES each (at least 8), or DDPKIT_MAX_LOCAL_RANKS. Cores do not bound it: 64 ranks run on 2
    cores here (benchmarks/bench_scale.py), slowly. A typo such as -n 99999 would fork until the machine stops
    answering."""
    override = os.environ.get("DDPKIT_MAX_LOCAL_RANKS", "")
    if re.fullmatch(r"[0-9]{1,6}", override) and int(override) > 0:
        return int(override), "DDPKIT_MAX_LOCAL_RANKS"
    available = _available_memory()
    if available is None:
        return 64, "64 where the available memory cannot be read; DDPKIT_MAX_LOCAL_RANKS raises it"
    limit = max(8, available // RANK_MEMORY_BYTES)
    return limit, (f"{available >> 20} MiB of memory available at {RANK_MEMORY_BYTES >> 20} MiB per rank; "
                   "DDPKIT_MAX_LOCAL_RANKS raises it")


def _available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes; None where there is none (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_local_ranks(count: int, option: str) -> None:
    limit, why = local_rank_limit()
    if count > limit:
        most = limit if option == "-n" else f"1x{limit}"
        raise ConfigError(f"{option} asks for {count} ranks on this machine", f"at most {limit} ({why})",
                          f"pass {option} {most} or fewer, or spread the ranks over nodes with -j NNODESxNPROC")


def local_ranks(option: str) -> Callable[[str], int]:
    """A count of ranks started here: 1 up to local_rank_limit()."""
    def parse(text: str) -> int:
        if not re.fullmatch(rf"\s*[0-9]{{1,{_MAX_DIGITS}}}\s*", text) or int(text) < 1:
            raise ConfigError(f"{option} {text!r}", "a whole number of ranks, 1 or more", f"write {option} 2")
        check_local_ranks(int(text), option)
        return int(text)

    return parse


def shape_text(option: str) -> Callable[[str], str]:
    """``-j`` text with no number longer than 6 digits (the shape itself is parsed by parse_job_shape)."""
    def parse(text: str) -> str:
        if re.search(rf"[0-9]{{{_MAX_DIGITS + 1},}}", text) or len(text) > 64:
            raise ConfigError(f"{option} {text[:40]!r}{'...' if len(text) > 40 else ''} has a number of more than "
                              f"{_MAX_DIGITS} digits", "NNODESxNPROC such as 2x4", f"write {option} 1x2")
        return text

    return parse


def endpoint(option: str) -> Callable[[str], str]:
    """``HOST:PORT`` with a port in 1..65535 (IPv6 hosts in brackets: ``[::1]:29400``)."""
    def parse(text: str) -> str:
        host, sep, port = text.rpartition(":")
        if (not sep or not host.strip("[]") or not re.fullmatch(r"[0-9]{1,5}", port)
                or not 1 <= int(port) <= 65535 or not text.isprintable() or " " in text):
            raise ConfigError(f"{option} {text!r}", "HOST:PORT with a port in 1..65535",
                              f"write {option} node1:29400")
        return text

    return parse


def output_path(option: str, *, directory_ok: bool = False) -> Callable[[str], str]:
    """A file ddpkit will write: see check_output_path. Returns the text as given."""
    def parse(text: str) -> str:
        check_output_path(text, option, directory_ok=directory_ok)
        return text

    return parse


def check_output_path(text: str, option: str, *, directory_ok: bool = False) -> Path:
    """Refuse, before the run, an output path that cannot be written: an unknown ``~user``, a name longer than
    the filesystem allows, an existing directory, or a directory this user cannot create files in (tried with
    a real file, since permissions say nothing of /proc or a read-only mount). Missing parent directories are
    fine where the nearest existing one is writable (the commands create them)."""
    def refuse(found: str, expected: str, fix: str = f"choose another {option}") -> ConfigError:
        return ConfigError(f"{option} {_shown(text)}: {found}", expected, fix)

    if not text or not text.isprintable():
        raise refuse("not a usable path", "a file name without line breaks or control characters")
    path = Path(os.path.expanduser(text))
    if str(path).startswith("~"):
        raise refuse(f"no user {text[1:].split('/', 1)[0]!r} on this machine", "~/PATH, ~USER/PATH or a path")
    name_max = 255  # NAME_MAX of Linux filesystems; the real one is read below, where a directory exists
    if (any(len(part.encode(errors="surrogateescape")) > name_max for part in path.parts)
            or len(str(path).encode(errors="surrogateescape")) >= 4096):
        raise refuse(f"a name longer than this filesystem allows ({name_max} bytes a name, 4095 a path)",
                     "shorter names")
    existing = path if path.exists() else next((p for p in path.parents if p.exists()), Path("."))
    name_max = _name_max(existing if existing.is_dir() else existing.parent)
    if any(len(part.encode(errors="surrogateescape")) > name_max for part in path.parts):
        raise refuse(f"a name longer than this filesystem allows ({name_max} bytes)", "shorter names")
    if path.is_dir() and not directory_ok and not text.endswith("/"):
        raise refuse("is a directory", "a file name", f"write {option} {text.rstrip('/')}/out")
    directory = path if path.is_dir() else existing if existing != path else path.parent
    if not directory.is_dir():
        raise refuse(f"{str(directory)!r} is not a directory", "a path inside a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".ddpkit-probe-", dir=directory)
    except OSError as exc:
        raise refuse(f"cannot create files in {str(directory)!r} ({exc.strerror})",
                     "a directory this user can write") from None
    os.close(fd)
    os.unlink(probe)
    return path


def run_directory(option: str) -> Callable[[str], str]:
    """A directory ddpkit will create (or reuse) and write in: see check_run_directory. Returns the path with
    ``~`` expanded (the run directory is opened as a path, never through a shell)."""
    def parse(text: str) -> str:
        return str(check_run_directory(text, option))

    return parse


def check_run_directory(text: str, option: str) -> Path:
    """Refuse, before the run, a directory ddpkit cannot create or write in: everything check_output_path refuses
    (an unknown ``~user``, an over-long name, a place this user cannot create files in such as /proc), and an
    existing file that is not a directory. A missing directory is fine where its nearest existing parent is
    writable (the run creates it)."""
    path = check_output_path(text, option, directory_ok=True)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{option} {_shown(text)}: an existing file, not a directory",
                          "a directory, existing or to be created", f"choose another {option}, or move the file away")
    return path


def _shown(text: str) -> str:
    """``text`` as a message quotes it: whole up to 80 characters, else its start and its length."""
    return repr(text) if len(text) <= 80 else repr(text[:60]) + f"... ({len(text)} characters)"


def _name_max(directory: Path) -> int:
    try:
        return os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255
