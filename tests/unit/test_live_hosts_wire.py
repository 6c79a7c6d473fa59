"""The line across hosts under ``--heal live`` (``live.agent.wire``) on real sockets, and what the agent makes of a
member's words (``live.agent.hosts``): a rank's end as said, its host's connection ending (its ranks gone with it),
a host silent past ``SILENT_S``, a rank the agent killed on a host that stays silent (unreached)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ddpkit.live.agent import hosts
from ddpkit.live.agent.hosts import Member, _Remote
from ddpkit.live.agent.proc import Seen
from ddpkit.live.agent.wire import Wire
from tests.helpers import ChildProc


def _pair() -> tuple[Wire, Wire]:
    """The two ends of a TCP connection on this host's loopback."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    return Wire(a), Wire(b)


def test_messages_arrive_whole_in_order_and_an_end_reads_none() -> None:
    left, right = _pair()
    big = {"start": 1, "rank": 2, "env": {f"K{i}": "v" * 100 for i in range(2000)}}  # > one recv
    assert left.send({"hello": "h2"}) and left.send(big)
    got: list[dict[str, object]] = []
    deadline = time.monotonic() + 5
    while len(got) < 2 and time.monotonic() < deadline:
        got += right.receive(0.5) or []
    assert got == [{"hello": "h2"}, big]
    assert right.receive(0.05) == []  # nothing more: an empty wait, not an end
    left.close()
    assert right.receive(1.0) is None and right.closed
    assert not right.send({"x": 1})


def test_the_agent_reads_a_member_s_words_and_its_silence() -> None:
    agent_end, member_end = _pair()
    member = Member(name="h2", address="10.0.0.2", per_node=2, standby=False, wire=agent_end)
    rank = _Remote(ident=7, member=member, host="h2")
    member.procs[7] = rank
    outside: list[str] = []
    listener = threading.Thread(target=member.listen, args=(outside.append,), daemon=True)
    listener.start()
    member_end.send({"started": 7, "pid": 4242})
    assert rank.started.wait(5) and rank.pid == 4242
    since = time.monotonic()
    member_end.send({"seen": {"7": ["STOPPED", 12]}, "beat": 1})
    deadline = time.monotonic() + 5
    while not rank.heard_since(since) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rank.heard_since(since) and rank.look() == (Seen.STOPPED, 12) and rank.wait() is None
    member_end.send({"outside": "SIGTERM"})
    member_end.send({"exit": 7, "code": -9})
    while rank.wait() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rank.wait() == -9 and outside == ["SIGTERM"]
    other = _Remote(ident=8, member=member, host="h2")
    member.procs[8] = other
    member_end.close()  # the member's process gone: its connection ends
    listener.join(5)
    assert member.gone and other.wait() == -int(signal.SIGKILL) and rank.wait() == -9  # a said end stays said


def test_a_silent_host_s_killed_rank_counts_as_ended_once_unreached() -> None:
    agent_end, _member_end = _pair()
    member = Member(name="h2", address="10.0.0.2", per_node=2, standby=False, wire=agent_end)
    rank = _Remote(ident=1, member=member, host="h2", silent_s=0.2)
    assert rank.look()[0] is Seen.RUNNING
    member.heard = time.monotonic() - 1.0  # nothing heard for a second: the host is cut off
    assert rank.look()[0] is Seen.SILENT and rank.wait() is None  # silent, not yet ended
    rank.send(signal.SIGKILL)  # the agent ends it; the order cannot arrive
    assert rank.wait() is None
    rank.killed_at = time.monotonic() - hosts.UNREACHED_S  # unreached that long after
    assert rank.wait() == -int(signal.SIGKILL)


def test_a_member_sends_a_failed_rank_s_traceback_and_the_watch_s_orders_with_its_end(tmp_path: Path,
                                                                                       monkeypatch: Any) -> None:
    """A member's rank (a real process) fails: the member sends its rank, the end of its stderr and the abort
    orders its host's ranks left with its end; the agent's side keeps them for the attempt's classification
    (``Members.take_evidence``). A rank that ends 0 sends nothing more."""
    from ddpkit.live.agent import member as member_side
    from ddpkit.process.stopping import leave_abort_order
    from ddpkit.process.worker_context import STOP_DIR

    stops = tmp_path / "stops"
    stops.mkdir()
    monkeypatch.setenv(STOP_DIR, str(stops))
    leave_abort_order(str(stops), 0, 2, '{"reporter": 2}')
    agent_end, member_end = _pair()
    procs: list[subprocess.Popen[bytes]] = []

    def spawn(rank: int, env: dict[str, str]) -> Any:
        procs.append(subprocess.Popen([sys.executable, "-c", f"import sys; sys.exit({1 if rank == 2 else 0})"]))
        return ChildProc(procs[-1], host="h2")

    member = member_side._Member(wire=member_end, spawn=spawn, tail_of=lambda rank: f"ValueError: rank {rank}")
    codes: list[int | None] = []
    loop = threading.Thread(target=lambda: codes.append(member.loop()), daemon=True)
    loop.start()
    seen = Member(name="h2", address="10.0.0.2", per_node=2, standby=False, wire=agent_end)
    ranks = {ident: _Remote(ident=ident, member=seen, host="h2") for ident in (1, 2)}
    seen.procs.update(ranks)
    threading.Thread(target=seen.listen, args=(lambda name: None,), daemon=True).start()
    try:
        agent_end.send({"start": 1, "rank": 3, "env": {}})
        agent_end.send({"start": 2, "rank": 2, "env": {}})
        deadline = time.monotonic() + 20
        while any(r.wait() is None for r in ranks.values()) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [ranks[1].wait(), ranks[2].wait()] == [0, 1]
        assert seen.said == [(2, "ValueError: rank 2")] and seen.orders == ['{"reporter": 2}'], (seen.said,
                                                                                                 seen.orders)
        agent_end.send({"end": 0})
        loop.join(10)
        assert codes == [0]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
