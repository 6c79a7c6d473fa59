"""Point-to-point calls in the watch, without processes: how a rank's record shows them and how a report words them."""

from __future__ import annotations

import sys
from typing import Any

from ddpkit.watch.diagnose import diagnose_hang, p2p_lines
from ddpkit.watch.recorder import Recorder


def _record(rank: int, *, waiting: dict[str, Any] | None = None, entered: int = 0,
            p2p: dict[str, dict[str, int]] | None = None) -> dict[str, Any]:
    return {"rank": rank, "host": "vm", "pid": 100 + rank, "beat": 1, "entered": entered, "completed": entered,
            "step": 3, "first_step_done": True, "recent": [], "waiting": waiting, "phase": None, "stage": None,
            "final": False, "failed": False, "group_seq": None, "timings": {"steps": 3, "timed": 0},
            **({"p2p": p2p} if p2p is not None else {})}


RECV = {"seq": 3, "op": "recv", "bytes": None, "site": "job.py:14 (main)", "for": 12.0, "peers": [["recv", 0]]}


def test_a_blocked_receive_is_worded_with_its_peer_and_what_the_peer_does() -> None:
    barrier = {"seq": 5, "op": "barrier", "bytes": None, "site": "job.py:20 (main)", "for": 11.0}
    records = {0: _record(0, waiting=barrier, entered=5, p2p={"send": {"1": 2}, "recv": {}}),
               1: _record(1, waiting=RECV, entered=4, p2p={"send": {}, "recv": {"0": 3}})}
    hang = diagnose_hang(records, {}, idle=12, deadline=5, reporter=1)
    text = "\n".join(hang.lines)
    assert ("  rank 1 on host vm has waited 12 s in recv #3 from rank 0 (called at job.py:14 (main)); rank 0 on host "
            "vm is alive, has posted 2 sends to rank 1 and is in barrier #5 (called at job.py:20 (main))") in text
    assert hang.behind == [1] and "has not entered barrier #5" in text  # the collective picture is unchanged
    assert "DESYNC" not in text and hang.event["p2p"]["1"]["op"] == "recv"


def test_a_receive_from_a_rank_doing_nothing_is_not_called_a_backend_hang() -> None:
    records = {0: _record(0), 1: _record(1, waiting=RECV)}
    hang = diagnose_hang(records, {}, idle=6, deadline=5, reporter=1)
    assert hang.lines[1:] == ["  rank 1 on host vm has waited 12 s in recv #3 from rank 0 (called at job.py:14 "
                              "(main)); rank 0 on host vm is alive, has posted 0 sends to rank 1 and waits in no "
                              "collective or point-to-point call"]


def test_a_batch_names_each_peer_and_a_stopped_or_absent_one() -> None:
    batch = {"seq": 2, "op": "batch_isend_irecv", "bytes": None, "site": "job.py:9 (f)", "for": 7.0,
             "peers": [["send", 2], ["recv", 0], ["recv", None]]}
    lines = p2p_lines({1: batch}, {0: _record(0), 1: _record(1, waiting=batch), 2: None}, {0: 4.0})
    assert lines == ["  rank 1 on host vm has waited 7 s in batch_isend_irecv #2 (send to rank 2, recv from rank 0, "
                     "recv from any rank) (called at job.py:9 (f)); rank 0 stopped answering; rank 2 never reported "
                     "to the watch"]


class _Group:
    def __init__(self) -> None:
        self.seq = 0

    def _get_sequence_number_for_group(self) -> int:
        return self.seq


def test_point_to_point_calls_are_numbered_per_peer_and_kept_out_of_the_groups_count() -> None:
    rec = Recorder(1, 2)
    group = _Group()
    rec._group = rec.p2p.world = group
    here = sys._getframe(0)
    assert rec.p2p_post("recv", (("recv", 0),), here)[2] == 1
    about = rec.p2p_post("recv", (("recv", 0),), here)
    line = here.f_lineno - 1
    assert about[2] == 2 and rec.p2p_post("send", (("send", 0),), here)[2] == 1
    group.seq = 3  # gloo counts each point-to-point operation as one of the group's collectives
    rec.p2p_learn(3, 3)
    call = rec.p2p_block(about)
    record = rec.record(1)
    assert record["waiting"]["op"] == "recv" and record["waiting"]["seq"] == 2
    assert record["waiting"]["site"] == f"test_watch_p2p_units.py:{line} ({here.f_code.co_name})"
    assert record["waiting"]["peers"] == [["recv", 0]] and record["entered"] == 0
    assert record["group_seq"] == 0  # the ranks' collective counts stay comparable
    assert record["p2p"] == {"send": {"0": 1}, "recv": {"0": 2}}
    before = record["completed"]
    rec.p2p_done(call)
    after = rec.record(2)
    assert after["waiting"] is None and after["completed"] == before + 1  # progress the monitor sees
    rec.p2p_post("send", (("send", 0),), here)
    group.seq = 4
    assert rec.record(3)["group_seq"] == 0  # each later operation is taken out of the group's count as posted


class _Work:
    def wait(self, timeout: Any = None) -> bool:
        return True


_FAKE_TORCH = """
def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    return Work()

def irecv(tensor, src=None, group=None, tag=0, group_src=None):
    return Work()

def send(tensor, dst=None, group=None, tag=0, group_dst=None):
    wrapped["isend"](tensor, dst=dst).wait()

def recv(tensor, src=None, group=None, tag=0, group_src=None):
    seen.append(rec.record(len(seen))["waiting"])  # the monitor's view while the call blocks
    return src

def waited(work, timeout=None):
    seen.append(rec.record(len(seen))["waiting"])
    return True
"""


def test_the_per_call_wrappers_name_each_call_at_the_users_line_and_pass_nested_calls_through() -> None:
    """torch's signatures (faked: no process group): a blocked recv is seen with its peer, number and the line that
    called it; a wait on an irecv's request is a wait in that irecv, named at the line that waits; torch's own nested
    calls (the isend inside send) are not counted twice."""
    from ddpkit.watch import p2p
    from ddpkit.watch.recorder import Live

    live, rec, group, seen = Live(), Recorder(1, 2), _Group(), []
    rec.p2p.world = group
    live.recorder = rec

    # torch's functions, faked in a file of their own ("<torch>"), whose frames a call site skips as it skips torch's
    rec.not_user = (*rec.not_user, "<torch>")
    torch: dict[str, Any] = {"Work": _Work, "rec": rec, "seen": seen}
    exec(compile(_FAKE_TORCH, "<torch>", "exec"), torch)
    wrapped = torch["wrapped"] = {name: p2p.point_to_point(live, name, torch[name])
                                  for name in ("send", "isend", "recv", "irecv")}
    wait = p2p.wait(live, torch["waited"])
    assert all(w.__code__.co_filename.startswith(p2p._HERE) for w in wrapped.values())  # the per-call path
    here = sys._getframe(0)
    rec.p2p_learn(1, 1)  # the group's count per operation, learned on a first call
    wrapped["recv"](None, src=0)
    recv_line = here.f_lineno - 1
    assert live.p2p is rec.p2p  # the general path took the first call: the per-call path takes the next
    wrapped["recv"](None, 0)
    request = wrapped["irecv"](None, src=0)
    wait(request)
    wait_line = here.f_lineno - 1
    wrapped["send"](None, dst=0)
    dropped = wrapped["isend"](None, dst=0)
    kept = wrapped["irecv"](None, src=0)
    del dropped
    rec.record(8)
    name = here.f_code.co_name
    assert seen[0] == {"seq": 1, "op": "recv", "bytes": None, "site": f"test_watch_p2p_units.py:{recv_line} ({name})",
                       "for": seen[0]["for"], "peers": [["recv", 0]]}
    assert seen[1]["seq"] == 2 and seen[1]["site"] == f"test_watch_p2p_units.py:{recv_line + 3} ({name})"
    assert seen[2]["op"] == "irecv" and seen[2]["seq"] == 3 and \
        seen[2]["site"] == f"test_watch_p2p_units.py:{wait_line} ({name})"  # where it waits
    assert rec.p2p_posted == {"send": {0: 2}, "recv": {0: 4}}  # send's inner isend and wait pass through
    assert rec.record(9)["waiting"] is None and rec.p2p.returned == 7
    assert list(rec.p2p.requests) == [kept]  # a request nobody holds is forgotten, one held is not
