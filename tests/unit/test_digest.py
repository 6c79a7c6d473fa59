"""The failure digest's words (src/ddpkit/launch/digest.py): per-rank log texts and exits in, one screen out; and
the ranks' lines on the agent's screen (src/ddpkit/launch/ranklogs.py), from files written here, no processes."""

from __future__ import annotations

import io
import signal
import time
from pathlib import Path

import pytest

from ddpkit.launch.digest import RankEnd, digest, is_noise, last_traceback, rank_list, watch_report
from ddpkit.launch.ranklogs import RankLogs

KEYERROR = """\
[vm:11] WARNING something before
Traceback (most recent call last):
  File "/home/u/train.py", line 40, in <module>
    main()
  File "/home/u/train.py", line 11, in main
    raise KeyError("batch")
KeyError: 'batch'
"""

PEER = """\
Traceback (most recent call last):
  File "/home/u/train.py", line 12, in <module>
    dist.all_reduce(t)
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3252, in all_reduce
    work.wait()
RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer \
[127.0.0.1]:{port}. This is typically caused by a remote worker crashing. Check the logs of the remote worker \
before reporting an error. GLHF!
"""

WATCH = ["ddpkit watch: rank 10 on host vm: all_reduce #4 (called at train.py:12 (<module>)) failed: ...",
         "  rank 11 on host vm (pid 77) is gone (its process no longer runs)"]


def sixteen() -> list[RankEnd]:
    ends = [RankEnd(rank=r, stderr="") for r in range(16)]
    ends[11] = RankEnd(rank=11, exitcode=1, pid=77, stderr=KEYERROR)
    for r in (3, 10, 12):
        ends[r] = RankEnd(rank=r, stderr=PEER.format(port=16000 + r))
    return ends


def test_the_rank_that_failed_first_comes_first_with_its_frame_and_exception() -> None:
    lines = digest(sixteen(), first=11, host="vm", logs="/tmp/ddpkit-run-x/attempt-0/",
                   watch=[(10, line) for line in WATCH])
    assert lines[:4] == ["  rank 11 on host vm:", '    File "/home/u/train.py", line 11, in main',
                         '      raise KeyError("batch")', "    KeyError: 'batch'"]
    assert "  ranks 3, 10, 12: RuntimeError: Connection closed by peer." in lines  # one line for three ranks
    assert "  ranks 0-2, 4-9, 13-15: its exit code not reported, no error on its stderr" in lines
    assert lines[-1] == "  full logs: /tmp/ddpkit-run-x/attempt-0/"
    assert [f"  {w}" for w in WATCH] == lines[-3:-1]
    assert len(lines) <= 10


def test_the_user_frame_is_the_last_outside_libraries() -> None:
    frames, exception = last_traceback(PEER.format(port=1)) or ([], [])
    lines = digest([RankEnd(rank=0, exitcode=1, stderr=PEER.format(port=1))], first=0, host="h", logs="L")
    assert lines[1:3] == ['    File "/home/u/train.py", line 12, in <module>', "      dist.all_reduce(t)"]
    assert exception[0].startswith("RuntimeError:") and len(frames) == 4


def test_signals_and_stops_are_said_by_exit_code() -> None:
    ends = [RankEnd(rank=0, exitcode=-signal.SIGKILL, stderr="[rank0]: last words\n"),
            RankEnd(rank=1, exitcode=-signal.SIGTERM), RankEnd(rank=2, exitcode=-signal.SIGTERM),
            RankEnd(rank=3, exitcode=3), RankEnd(rank=4, exitcode=5)]
    lines = digest(ends, first=0, host="h", logs="L")
    assert lines[:2] == ["  rank 0 on host h:", "    [rank0]: last words"]
    assert "  ranks 1-2: ended by the agent (SIGTERM) after rank 0 failed" in lines
    assert "  rank 3: stopped by ddpkit (exit 3)" in lines and "  rank 4: exit code 5" in lines
    stopped = digest(ends[3:4], first=None, host="h", logs="L")
    assert stopped == ["  rank 3: stopped by ddpkit (exit 3)", "  full logs: L"]  # no rank named first


def test_the_exception_ends_where_a_logged_line_begins() -> None:
    _, exception = last_traceback(KEYERROR + "[vm:11] WARNING the watch stops\n") or ([], [])
    assert exception == ["KeyError: 'batch'"]


def test_a_chained_traceback_says_its_last_exception() -> None:
    text = KEYERROR + "\nDuring handling of the above exception, another exception occurred:\n\n" \
        + PEER.format(port=2)
    _, exception = last_traceback(text) or ([], [])
    assert exception[0].startswith("RuntimeError: [/__w")


def test_noise_watch_lines_and_rank_lists() -> None:
    assert is_noise("frame #12: c10::Error::Error(...) + 0x9d (0x7f in libc10.so)")
    assert is_noise("Exception raised from recvBytes at Utils.hpp:784 (most recent call first):")
    assert not is_noise("KeyError: 'frame #1'")
    held = [(3, "Traceback (most recent call last):"), (3, "  File x"), (10, WATCH[0]), (3, "  File y"),
            (10, WATCH[1]), (12, WATCH[0]), (12, WATCH[1])]  # a rank's indented lines under its own report only
    assert watch_report(held) == WATCH
    assert len(watch_report([(0, f"ddpkit watch: {i}") for i in range(30)], limit=5)) == 5
    told = [(2, "ddpkit watch: rank 2 on host vm is told to stop (SIGTERM)"), (2, "  rank 0 ... is gone"),
            (2, "  rank 1 ... is gone")]
    also = [(5, told[0][1].replace("rank 2", "rank 5")), (5, "  rank 0 ... is gone"),
            (6, told[0][1].replace("rank 2", "rank 6"))]
    assert watch_report([(10, WATCH[0]), (10, WATCH[1]), *told, *also]) == [
        *WATCH, told[0][1], "    the same from ranks 5-6",
        "  ... 3 more lines of the watch's report in the logs"]  # later reports: one headline for all alike
    assert rank_list([3]) == "rank 3" and rank_list([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7-8"


def _two_ranks(tmp_path: Path) -> tuple[RankLogs, io.StringIO, io.StringIO, dict[str, list[str]]]:
    out, err = io.StringIO(), io.StringIO()
    logs = RankLogs(str(tmp_path), "h", out, err, poll_s=0.01)
    dest = logs.specs.reify({r: {"RANK": str(r + 4), "TORCHELASTIC_RESTART_COUNT": "0"} for r in (0, 1)})
    return logs, out, err, {"out": [dest.stdouts[0], dest.stdouts[1]], "err": [dest.stderrs[0], dest.stderrs[1]]}


def _write(path: str, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def test_rank_lines_reach_the_screen_whole_prefixed_and_without_cpp_frames(tmp_path: Path) -> None:
    logs, out, err, files = _two_ranks(tmp_path)
    with logs.started():
        _write(files["out"][0], "RESULT a\nRESU")  # half a line: it waits for the rest
        _write(files["out"][1], "RESULT b\n")
        _write(files["err"][1], "warning\nframe #0: c10::Error::Error() + 0x9d (0x7f in libc10.so)\n")
        deadline = time.monotonic() + 10  # the reader thread shows it before rank 4's traceback is written
        while "[h:5] warning" not in err.getvalue() and time.monotonic() < deadline:
            time.sleep(0.02)
        _write(files["out"][0], "LT c\n")
        _write(files["err"][0], KEYERROR)  # a traceback the script handled: held, then shown
    assert sorted(out.getvalue().splitlines()) == ["[h:4] RESULT a", "[h:4] RESULT c", "[h:5] RESULT b"]
    assert err.getvalue().splitlines()[0] == "[h:5] warning" and "frame #" not in err.getvalue()
    assert "[h:4] KeyError: 'batch'" in err.getvalue().splitlines()
    assert (tmp_path / "attempt-0" / "rank-5.stderr.log").read_text().count("frame #0") == 1  # kept in the file


def test_a_failed_attempt_shows_the_digest_not_the_tracebacks(tmp_path: Path) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from ddpkit.launch.failure import rank_failures

    logs, _, err, files = _two_ranks(tmp_path)
    failure = ChildFailedError("job", {5: ProcessFailure(local_rank=1, pid=77, exitcode=1, error_file="")})
    with pytest.raises(ChildFailedError), logs.started():
        _write(files["err"][1], KEYERROR)
        _write(files["err"][0], "\n".join(WATCH) + "\n" + PEER.format(port=9))
        time.sleep(0.2)
        raise failure
    assert err.getvalue() == ""  # nothing of the failure before the digest
    logs.say_failure(rank_failures(failure.failures), 5)
    lines = err.getvalue().splitlines()
    assert lines[:4] == ["  rank 5 on host h:", '    File "/home/u/train.py", line 11, in main',
                         '      raise KeyError("batch")', "    KeyError: 'batch'"]
    assert lines[4:] == ["  rank 4: RuntimeError: Connection closed by peer.", *[f"  {w}" for w in WATCH],
                         f"  full logs: {tmp_path / 'attempt-0'}/ (rank-R.stdout.log, rank-R.stderr.log)"]


def test_the_digest_never_names_a_rank_ddpkit_or_the_agent_stopped_as_the_first() -> None:
    from types import SimpleNamespace

    from ddpkit.launch.failure import first_failure

    def failed(*codes: int) -> SimpleNamespace:
        return SimpleNamespace(failures={r: SimpleNamespace(exitcode=c, timestamp=100 + r, pid=1000 + r)
                                         for r, c in enumerate(codes)})

    assert first_failure(failed(-signal.SIGTERM, 1)) == 1  # ended by the agent first, by the clock: not the cause
    assert first_failure(failed(3, -signal.SIGTERM)) is None  # the watch's stop: root_cause names no rank
    assert first_failure(failed(75, -signal.SIGTERM)) is None  # a preemption is no failure


def test_a_rank_the_agent_killed_is_said_killed_never_ended_without_error() -> None:
    """Issue 39 item 4: a rank the launcher SIGKILLed (still running after SIGTERM's grace) is said so; one it
    SIGTERMed is said ended by the agent; a rank that logged an error is said by its words."""
    ends = [RankEnd(rank=0, ended_by=signal.SIGKILL), RankEnd(rank=1, exitcode=1, stderr=KEYERROR),
            RankEnd(rank=2, ended_by=signal.SIGTERM), RankEnd(rank=3, ended_by=signal.SIGKILL),
            RankEnd(rank=4, stderr="[vm:4] ERROR rank 4: a collective failed, another rank is gone\n")]
    lines = digest(ends, first=1, host="vm", logs="/tmp/x/")
    assert "  ranks 0, 3: killed by the agent (SIGKILL): still running after SIGTERM and its grace period" in lines
    assert "  rank 2: ended by the agent (SIGTERM) after rank 1 failed" in lines
    assert "  rank 4: rank 4: a collective failed, another rank is gone" in lines
    assert not any("no error" in line for line in lines), lines
