"""A survivor blocked on a peer whose node went silent frees itself (``ddpkit.live.rank.unblock``): real sockets,
a real blocked ``recv`` in another thread, the kernel's own connection table."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading

from ddpkit.live.rank.unblock import _remote, addresses_of, shut_connections_to

#: Another process holding the far ends (as the lost rank and the agent's store would), on an address of its own
#: (no other connection of this test process is to it): two listening sockets, the second echoing what it gets;
#: their ports on its first line.
_FAR = """
import socket, sys, threading
peer, store = socket.create_server(("127.0.0.2", 0)), socket.create_server(("127.0.0.2", 0))
print(peer.getsockname()[1], store.getsockname()[1], flush=True)
held = [peer.accept()[0]]
conn = store.accept()[0]
while data := conn.recv(16):
    conn.sendall(data)
"""


def test_a_blocked_receive_on_a_lost_host_s_connection_fails_and_the_store_s_is_spared() -> None:
    far = subprocess.Popen([sys.executable, "-c", _FAR], stdout=subprocess.PIPE, text=True)
    try:
        assert far.stdout is not None
        peer_port, store_port = map(int, far.stdout.readline().split())
        blocked = socket.create_connection(("127.0.0.2", peer_port), timeout=10)
        kept = socket.create_connection(("127.0.0.2", store_port), timeout=10)
        got: list[bytes | BaseException] = []

        def receive() -> None:  # as gloo's loop waits on a pair whose far end will never speak again
            try:
                got.append(blocked.recv(16))
            except OSError as exc:
                got.append(exc)

        waiter = threading.Thread(target=receive)
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive()  # blocked: nothing comes from a node cut off
        assert shut_connections_to({"127.0.0.2"}, spare_ports=(store_port,)) == 1  # none of the suite's
        waiter.join(10)
        assert not waiter.is_alive() and got == [b""], got  # freed: the receive ends as a closed connection does
        kept.sendall(b"x")
        assert kept.recv(1) == b"x"  # the store's connection is untouched
        blocked.close()
        kept.close()
    finally:
        far.kill()
        far.wait()


def test_nothing_is_shut_for_an_address_no_connection_has() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname()[:2], timeout=10)
        accepted, _ = server.accept()
        assert shut_connections_to({"192.0.2.7"}) == 0
        client.sendall(b"y")
        assert accepted.recv(1) == b"y"
        client.close()
        accepted.close()


def test_the_kernel_s_address_columns_are_read_for_both_families() -> None:
    assert _remote("0100007F:1F90") == "127.0.0.1"
    assert _remote("0501A8C0:0050") == "192.168.1.5"
    assert _remote("0000000000000000FFFF00000100007F:1F90") == "127.0.0.1"  # IPv4-mapped, as gloo's sockets show
    assert _remote("00000000000000000000000001000000:1F90") == "::1"
    assert "127.0.0.1" in addresses_of(["localhost"]) and addresses_of(["no-such-host.invalid"]) == set()
