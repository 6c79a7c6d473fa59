"""A rendezvous that cannot be reached: one line says what is awaited, where and until when; the wait ends at the
join timeout (exit 3) with no C++ frames printed, and SIGTERM ends it at once (within a Kubernetes pod's 30 s grace,
even on a loaded machine)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from ddpkit.base.errors import DeadlineExpired
from ddpkit.launch.agent import await_endpoint
from tests.helpers import ddpkit_env, free_port

pytestmark = pytest.mark.multiproc


def test_an_unresolvable_host_ends_at_the_join_timeout_in_one_line() -> None:
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ddpkit", "env", "-j", "2x1", "--rdzv-endpoint",
                           "n1.invalid:29400", "--connect", "--timeout", "4"], capture_output=True, text=True,
                          timeout=120, env=ddpkit_env())
    assert proc.returncode == 3, proc.stderr
    assert "frame #" not in proc.stderr and "Exception raised from" not in proc.stderr, proc.stderr[-3000:]
    assert "waiting for the rendezvous store at n1.invalid:29400" in proc.stderr
    assert "could not be reached within 4 s" in proc.stderr
    assert time.monotonic() - started < 60


def test_a_kubeflow_pod_whose_rendezvous_host_does_not_resolve_stops_on_sigterm() -> None:
    """It stops at the signal, not at the end of its wait (a loaded machine's interpreter exit may take seconds)."""
    env = ddpkit_env(PET_NNODES="2", PET_NPROC_PER_NODE="1", PET_RDZV_ENDPOINT="n1.invalid:29400",
                     PET_RDZV_BACKEND="c10d", PET_RDZV_ID="job1", RANK="1", WORLD_SIZE="2")
    proc = subprocess.Popen([sys.executable, "-m", "ddpkit", "env", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr or []), daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while not any("waiting for the rendezvous store" in line for line in lines) and time.monotonic() < deadline:
        assert proc.poll() is None, "".join(lines)
        time.sleep(0.1)
    assert any("waiting for the rendezvous store at n1.invalid:29400" in line for line in lines), "".join(lines)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    finally:
        proc.kill()
    assert time.monotonic() - sent <= 20
    reader.join(5)
    assert "frame #" not in "".join(lines)


def test_the_wait_ends_when_the_store_starts_listening() -> None:
    port = int(free_port())
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def listen_later() -> None:
        time.sleep(1.5)
        server.bind(("127.0.0.1", port))
        server.listen()

    threading.Thread(target=listen_later, daemon=True).start()
    started = time.monotonic()
    try:
        await_endpoint(f"127.0.0.1:{port}", timeout=30, poll=0.2)
    finally:
        server.close()
    assert 1.0 < time.monotonic() - started < 30


def test_nothing_listening_is_a_deadline() -> None:
    with pytest.raises(DeadlineExpired, match="nothing listens there yet") as exc:
        await_endpoint(f"127.0.0.1:{free_port()}", timeout=1.5, poll=0.2)
    assert exc.value.exit_code == 3
