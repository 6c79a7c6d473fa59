"""One failure report per job, also when the store left with the rank that held it (watch/failure.py).

Under ddpkit's agent rank 0 holds the watch's store; when the launcher ends ranks 0 and 2 after rank 1 was killed,
rank 2 can find the store gone and report from its last read: the job's log then had two reports (CI, stop 42).
The reports here are real FailureReport objects over a view with the records and the store's behaviour of that run.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ddpkit.watch.failure import FailureReport


class _Store:
    """The job's store as rank 0 had it, or as rank 2 had it: it answered rank 2's read, and was gone with rank 0
    (which reported and ended meanwhile) when rank 2 claimed the report."""

    def __init__(self, keys: dict[str, str], gone_at_claim: bool = False) -> None:
        self.keys, self.gone_at_claim = keys, gone_at_claim

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        if self.gone_at_claim:
            raise RuntimeError("Connection reset by peer")
        keys = self.keys
        if keys.get(key, "") == expected:
            keys[key] = desired
        return keys[key].encode()

    def check(self, keys: list[str]) -> bool:
        return all(k in self.keys for k in keys)

    def set(self, key: str, value: str) -> None:
        self.keys[key] = value


class _View:
    def __init__(self, rank: int, store: _Store, records: dict[int, Any]) -> None:
        self.rank, self.store, self.last_read = rank, store, records
        self.rec = SimpleNamespace(host="h", failed=None)
        self.seen: dict[int, tuple[Any, float]] = {}
        self.emitted: list[tuple[list[str], dict[str, Any]]] = []

    @property
    def aborting(self) -> bool:
        return False

    def read(self) -> dict[int, Any]:
        return self.last_read

    def emit(self, lines: list[str], event: dict[str, Any]) -> None:
        self.emitted.append((lines, event))


@pytest.fixture
def records() -> dict[int, Any]:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield {r: {"rank": r, "host": "h", "pid": pid} for r, pid in ((0, live.pid), (1, gone.pid), (2, live.pid))}
    finally:
        live.kill()
        live.wait()


def _report_on_sigterm(view: _View) -> None:
    FailureReport(view).on_terminate()


def test_a_peer_that_finds_the_store_gone_writes_no_second_report(records: dict[int, Any], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPKIT_STOP_DIR", str(tmp_path))
    first = _View(0, _Store({}), records)
    _report_on_sigterm(first)
    second = _View(2, _Store(first.store.keys, gone_at_claim=True), records)
    _report_on_sigterm(second)
    assert [e["gone"] for _, e in first.emitted] == [[1]], first.emitted
    assert second.emitted == []


def test_a_later_attempt_reports_again(records: dict[int, Any], tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPKIT_STOP_DIR", str(tmp_path))
    _report_on_sigterm(_View(0, _Store({}), records))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    later = _View(0, _Store({}), records)
    _report_on_sigterm(later)
    assert [e["gone"] for _, e in later.emitted] == [[1]]


def test_without_the_agents_directory_the_store_decides(records: dict[int, Any],
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DDPKIT_STOP_DIR", raising=False)
    shared = _Store({})
    first, second = _View(0, shared, records), _View(2, shared, records)
    _report_on_sigterm(first)
    _report_on_sigterm(second)
    assert len(first.emitted) == 1 and second.emitted == []
