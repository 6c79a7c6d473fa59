"""Append-only JSON-lines files of typed records: the run's ledgers (``rundir.ledger``, ``goodput.records``).

A record is a frozen, keyword-only dataclass with a ``KIND`` class attribute (``@record(kind)`` makes one); its line
is ``{"kind": KIND, **fields}``, enums by their value, nested dataclasses as objects; ``from_fields`` rebuilds such a
record (or any such dataclass) from its fields by their annotations. A line is written whole with one ``write()`` on
an ``O_APPEND`` descriptor (two writers never interleave within a line) and fsynced before the writer goes on: a
writer killed at any moment leaves every line it finished and at most one torn last line, which a later writer
starts a new line after and reading skips. torch elastic's ``_RoleInstanceInfo`` serialize/deserialize is the model.
Pure: no torch.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import os
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from types import UnionType
from typing import Any, Generic, TypeVar

__all__ = ["JsonFields", "Kinds", "append_line", "append_to", "encode", "from_fields", "record"]

R = TypeVar("R")


@typing.dataclass_transform(frozen_default=True, kw_only_default=True)
def record(kind: str) -> Callable[[type[R]], type[R]]:
    """The class it decorates as a record whose lines are of kind ``kind``: a frozen, keyword-only dataclass with
    ``KIND``, the one shape every ledger line has."""

    def make(cls: type[R]) -> type[R]:
        cls.KIND = kind  # type: ignore[attr-defined]
        return dataclasses.dataclass(frozen=True, kw_only=True)(cls)

    return make


def _plain(value: object) -> object:
    if isinstance(value, enum.Enum):
        return value.value
    raise TypeError(f"{type(value).__name__} is not a ledger value")


def encode(record: Any) -> str:
    """The line of ``record`` (a dataclass with ``KIND``), no newline in it."""
    return json.dumps({"kind": record.KIND, **asdict(record)}, sort_keys=True, default=_plain)


class JsonFields:
    """A dataclass that travels as one JSON object (a store's value, a verdict in a ledger line): its fields by name,
    enums by their value, keys sorted; ``from_json`` reads it back by ``from_fields``."""

    def to_json(self) -> str:
        return json.dumps(asdict(typing.cast(Any, self)), sort_keys=True, default=_plain)

    @classmethod
    def from_json(cls, text: str | bytes) -> typing.Self:
        return from_fields(cls, json.loads(text))


def from_fields(cls: type[R], data: Mapping[str, Any]) -> R:
    """The dataclass ``cls`` from a line's fields, each rebuilt by its annotation (``_reader``): a field the line
    lacks takes its default (a line written before the field was added), one ``cls`` lacks is ignored (a newer
    writer's); a required field missing, or a value that does not read, raises (TypeError, ValueError)."""
    return cls(**{name: read(data[name]) for name, read in _readers(typing.cast(type, cls)) if name in data})


@functools.cache
def _readers(cls: type) -> tuple[tuple[str, Callable[[Any], Any]], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, _reader(hints[f.name])) for f in dataclasses.fields(cls))


def _reader(hint: Any) -> Callable[[Any], Any]:
    """What reads a value of the type ``hint`` names: None where the hint allows it, a tuple from a list, an enum
    from its value, a nested dataclass by ``from_fields``, a number, text or flag cast to its type; anything else as
    it was read."""
    if typing.get_origin(hint) in (UnionType, typing.Union):
        arms = [arm for arm in typing.get_args(hint) if arm is not type(None)]
        read = _reader(arms[0])
        if len(arms) < len(typing.get_args(hint)):
            return lambda value: None if value is None else read(value)
        return read
    if typing.get_origin(hint) is tuple:
        item = _reader(typing.get_args(hint)[0])
        return lambda values: tuple(item(v) for v in values)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return lambda data: from_fields(hint, data)
    if isinstance(hint, type) and issubclass(hint, enum.Enum | bool | int | float | str):
        return hint
    return lambda value: value


class Kinds(Generic[R]):
    """The record types one file holds, by ``KIND``, each read back by ``from_fields``."""

    def __init__(self, what: str, types: Iterable[type]) -> None:
        self.what = what
        self._types: dict[str, type] = {t.KIND: t for t in types}  # type: ignore[attr-defined]

    def decode(self, line: str) -> R:
        """The record of one line; ValueError for a line that is not one (a torn write, an unknown kind)."""
        data = json.loads(line)
        if not isinstance(data, dict) or data.get("kind") not in self._types:
            raise ValueError(f"not a {self.what} record: {line[:80]!r}")
        record: R = from_fields(self._types[data.pop("kind")], data)
        return record

    def read(self, path: str | Path) -> list[R]:
        """Every record of ``path``, oldest first; a line that does not read (the torn last write of a writer killed
        mid-line) is skipped; a missing file holds none."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            return []
        found: list[R] = []
        for line in text.splitlines():
            if line.strip():
                try:
                    found.append(self.decode(line))
                except (ValueError, KeyError, TypeError):
                    continue
        return found


def append_line(fd: int, line: str) -> None:
    """One whole line with one ``write()`` on ``fd`` (opened ``O_RDWR | O_APPEND``), fsynced; a torn last line left
    by a killed writer stays alone on its line."""
    size = os.fstat(fd).st_size
    if size and os.pread(fd, 1, size - 1) != b"\n":
        line = "\n" + line
    os.write(fd, (line + "\n").encode("utf-8"))
    os.fsync(fd)


def append_to(path: str | Path, line: str) -> None:
    """``append_line`` to ``path``, created (with its directory) where missing; a new file's directory is fsynced
    too, so the file's name survives a crash as its line does."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        append_line(fd, line)
    finally:
        os.close(fd)
    if new:
        _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
