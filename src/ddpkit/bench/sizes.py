"""Message sizes as nccl-tests writes them: ``1K``, ``64M``, ``1G`` (powers of 1024), and the sweep between two."""

from __future__ import annotations

import re

from ddpkit.base.errors import ConfigError

__all__ = ["format_size", "parse_size", "size_sweep"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
# ASCII digits, at most 15 (int() refuses 4300 digits with a traceback; 15 digits of bytes are 888 TiB)
_SIZE = re.compile(r"(?P<num>[0-9]{1,15})\s*(?P<unit>[KMGT]?)(?:I?B)?", re.IGNORECASE)


def parse_size(text: str, *, option: str = "size") -> int:
    """``"64M"`` -> 67108864. K, M, G, T are powers of 1024 (``KB``, ``KiB`` too); bad text is a ConfigError."""
    m = _SIZE.fullmatch(str(text).strip())
    if m is None:
        raise ConfigError(f"{option} {str(text)[:40]!r} is not a size", "a whole number of bytes with an optional "
                          "unit K, M, G or T (powers of 1024), e.g. 1K, 64M, 1G", f"write {option} 64M")
    return int(m["num"]) * _UNITS[m["unit"].upper()]


def format_size(nbytes: int) -> str:
    """The shortest exact form: 1024 -> ``1K``, 1536 -> ``1536``."""
    for unit in ("T", "G", "M", "K"):
        if nbytes >= _UNITS[unit] and nbytes % _UNITS[unit] == 0:
            return f"{nbytes // _UNITS[unit]}{unit}"
    return str(nbytes)


def size_sweep(begin: int, end: int, *, factor: int | None = None, increment: int | None = None) -> list[int]:
    """Sizes from ``begin`` to ``end`` inclusive, times ``factor`` or plus ``increment`` (nccl-tests' -f, -i)."""
    if factor is not None and increment is not None:
        raise ConfigError("both a factor (-f) and an increment (-i) were given", "one of them",
                          "use -f 2 to double each step or -i 1M to add 1 MiB each step")
    if begin <= 0 or end <= 0:
        raise ConfigError(f"size range {begin}..{end} includes zero bytes", "sizes of at least 1 byte",
                          "pass -b 8 or more")
    if end < begin:
        raise ConfigError(f"end size {format_size(end)} is below the begin size {format_size(begin)}",
                          "-b <= -e", f"pass -b {format_size(end)} -e {format_size(begin)}")
    if increment is not None:
        if increment <= 0:
            raise ConfigError(f"increment {increment}", "a positive number of bytes", "pass -i 1M")
        return list(range(begin, end + 1, increment))
    step = 2 if factor is None else factor
    if step < 2:
        raise ConfigError(f"factor {step}", "2 or more", "pass -f 2")
    sizes = [begin]
    while sizes[-1] * step <= end:
        sizes.append(sizes[-1] * step)
    return sizes
