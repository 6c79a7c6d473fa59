"""The watch's store calls are bounded: a store whose process stops answering (SIGSTOP, as a cut-off host) makes
TCPStore's client block past its own timeout; the watch's wrapper gives up in time and recovers afterwards."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from ddpkit.watch.store import BoundedStore, StoreUnanswered
from tests.helpers import free_port

pytestmark = pytest.mark.multiproc

SERVER = ("import sys, time, torch.distributed as d; "
          "s = d.TCPStore('127.0.0.1', int(sys.argv[1]), is_master=True, wait_for_workers=False); "
          "print('up', flush=True); time.sleep(300)")


def stopped(pid: int, limit: float = 5.0) -> None:
    """Return once every thread of ``pid`` is stopped: kill() returns before a thread busy on another core has
    taken the SIGSTOP, and that thread answered the first call (CI: "DID NOT RAISE")."""
    deadline = time.monotonic() + limit
    while True:
        states = [Path(f"/proc/{pid}/task/{t}/stat").read_text().rsplit(")", 1)[1].split()[0]
                  for t in os.listdir(f"/proc/{pid}/task")]
        if all(s in "Tt" for s in states):
            return
        assert time.monotonic() < deadline, f"process {pid} not stopped after {limit} s: {states}"
        time.sleep(0.01)


def test_a_stopped_store_is_reported_within_the_limit_then_used_again() -> None:
    import torch.distributed as dist

    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, port], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "up"
        client = dist.TCPStore("127.0.0.1", int(port), is_master=False, timeout=timedelta(seconds=1),
                               wait_for_workers=False)
        roomy = BoundedStore(client, limit=10.0)  # the healthy calls: a loaded machine's round trip may take 1 s
        roomy.set("a", "1")
        assert roomy.check(["a"]) and roomy.get("a") == b"1"
        store = BoundedStore(client, limit=1.0)
        os.kill(server.pid, signal.SIGSTOP)
        stopped(server.pid)
        t = time.monotonic()
        with pytest.raises(StoreUnanswered, match="did not answer within 1 s"):
            store.check(["a"])
        assert time.monotonic() - t < 4
        t = time.monotonic()
        with pytest.raises(StoreUnanswered, match="has not answered for over 1 s"):
            store.multi_get(["a"])  # the first call is still blocked: this one fails at once
        assert time.monotonic() - t < 0.9  # not the limit's 1 s
        os.kill(server.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while True:  # the blocked call returns once the server runs again; the store is used again
            try:
                assert store.get("a") == b"1"
                break
            except StoreUnanswered:
                assert time.monotonic() < deadline, "the store was not used again after it answered"
                time.sleep(0.2)
    finally:
        server.kill()
        server.wait()
