"""The line the live agent and a host's member speak across hosts (``live.agent.hosts``, ``live.agent.member``): one
TCP connection per host, held for the whole job, JSON objects one per line. The connection is also the member's
life: its end (the member's process gone, its kernel closing the socket) is the host's agent lost, seen at once.

member -> agent   ``{"hello": HOST, "per_node": P, "standby": BOOL, "pid": PID}`` first; then
                  ``{"started": ID, "pid": PID}``, ``{"exit": ID, "code": CODE}`` (negative: a signal; above 0
                  with ``"rank": R, "tail": TEXT, "orders": [JSON]``: the end of its stderr, the watch's orders),
                  ``{"seen": {ID: [STATE, TICKS]}, "beat": N}`` every ``BEAT_S`` (the kernel's word on each rank:
                  ``live.agent.proc.Seen``), ``{"outside": SIGNAL}`` (a signal from outside reached the member)
agent -> member   ``{"start": ID, "rank": R, "env": {...}}``, ``{"signal": ID, "sig": N, "outside": NAME|null,
                  "own": BOOL}`` (the stop marks the rank reads, ``ddpkit.process.stopping``), ``{"close": ID}``,
                  ``{"end": CODE, "why": TEXT}`` (the job is over: the member exits with CODE)
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
from typing import Any

__all__ = ["BEAT_S", "SEND_S", "UNACKED_S", "Wire"]

#: How often a member says what its host's kernel says of its ranks (seconds): as the pulse under Slurm.
BEAT_S = 0.25
#: Data sent and not acknowledged this long ends the connection (seconds; the kernel's ``TCP_USER_TIMEOUT``): a member
#: whose endpoint's host is cut off, not killed, would otherwise wait on it for the kernel's retransmissions (minutes).
#: The member beats every ``BEAT_S``, so a cut is unacknowledged data at once; the agent has replaced the host's ranks
#: long before (its beat still 3 s).
UNACKED_S = 30.0
#: The longest one message may take to leave (seconds): a host cut off fills its socket's buffer, and then the
#: sender gives the message up rather than wait on it (the host is seen silent and ended by its beat's absence).
SEND_S = 2.0


class Wire:
    """One end of the connection: ``send`` from any thread, ``receive`` from one."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.settimeout(SEND_S)
        with contextlib.suppress(OSError):  # each message at once (a TCP socket's; not a local socket's)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with contextlib.suppress(OSError, AttributeError):  # Linux: a far end cut off ends the connection
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(UNACKED_S * 1000))
        self._lock = threading.Lock()
        self._buffer = b""
        self.closed = False

    def send(self, message: dict[str, Any]) -> bool:
        """Send one message; False where it could not leave (the far end gone or unreachable)."""
        data = json.dumps(message, separators=(",", ":")).encode() + b"\n"
        with self._lock:
            if self.closed:
                return False
            try:
                self.sock.sendall(data)
                return True
            except OSError:
                return False

    def receive(self, timeout: float) -> list[dict[str, Any]] | None:
        """The messages that arrived within ``timeout`` seconds (maybe none); None once the far end closed."""
        try:
            if not select.select([self.sock], [], [], timeout)[0]:
                return []
            chunk = self.sock.recv(1 << 16)
        except (OSError, ValueError):  # reset by the far end, or closed here
            chunk = b""
        if not chunk:
            self.closed = True
            return None
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]

    def close(self) -> None:
        with self._lock:
            self.closed = True
            with contextlib.suppress(OSError):
                self.sock.close()
