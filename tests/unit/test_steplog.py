"""``ddpkit step``'s screen and digest (src/ddpkit/launch/steplog.py) on lines as srun --label wrote them in a real
job of the test cluster (tests/infra/test_step_digest_slurm.py; C++ frames and library frames trimmed): rank 1 on
node2 raises, rank 0 on node1 fails after it, each node's torchrun agent prints its ChildFailedError box."""

from __future__ import annotations

import io
import socket

from ddpkit.launch.stepscreen import StepScreen

STDERR = """\
1: [W1126 13:31:38.483399377 socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved. err=-3
0: [W1126 13:31:38.857130971 socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved. err=-3
1: [node2:1] WARNING setting GLOO_SOCKET_IFNAME=vjcd55feb: vjcd55feb (10.213.0.12) routes to the master
0: [node1:0] WARNING setting GLOO_SOCKET_IFNAME=vjcd55fea: vjcd55fea (10.213.0.11) routes to the master
1: Traceback (most recent call last):
1:   File "/tmp/t/keyerror.py", line 11, in <module>
1:     raise KeyError("batch")
1: KeyError: 'batch'
0: ddpkit watch: rank 0 on host node1: all_reduce #4 (called at keyerror.py:12 (<module>)) failed: [/__w/pytorch/\
pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.213.0.12]:50413. GLHF!
0:   no rank on this host is gone; the failed peer is on another host (see its lines)
0: Traceback (most recent call last):
0:   File "/tmp/t/keyerror.py", line 12, in <module>
0:     dist.all_reduce(t)
0: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer \
[10.213.0.12]:50413
0: Exception raised from recvBytes at /__w/pytorch/pytorch/torch/csrc/distributed/c10d/Utils.hpp:787 (most recent \
call first):
0: frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7f5cc6379b8d in libc10.so)
1: E1126 13:31:44.551000 20007 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) \
local_rank: 0 (pid: 20080) of binary: /venv/bin/python
1: Traceback (most recent call last):
1:   File "/venv/bin/torchrun", line 6, in <module>
1:     sys.exit(main())
1:   File "/venv/lib/python3.11/site-packages/torch/distributed/launcher/api.py", line 383, in launch_agent
1:     raise ChildFailedError(
1: torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
1: ============================================================
1: ddpkit FAILED
1: ------------------------------------------------------------
1: Root Cause (first observed failure):
1: [0]:
1:   time      : 2026-11-26_13:31:44
1:   host      : node2
1:   rank      : 1 (local_rank: 0)
1:   exitcode  : 1 (pid: 20080)
1:   error_file: <N/A>
1:   traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
1: ============================================================
0: E1126 13:31:46.551000 20006 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) \
local_rank: 0 (pid: 20079) of binary: /venv/bin/python
0: Root Cause (first observed failure):
0: [0]:
0:   time      : 2026-11-26_13:31:46
0:   host      : node1
0:   rank      : 0 (local_rank: 0)
0:   exitcode  : 1 (pid: 20079)
0:   error_file: <N/A>
srun: error: node2: task 1: Exited with exit code 1
[rank1]:[W1126 13:31:46.846898291 TCPStore.cpp:106] [c10d] sendBytes failed on SocketImpl(fd=9, addr=[::]:60287): \
Broken pipe
"""


def _screen() -> tuple[StepScreen, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    screen = StepScreen(out, err)
    screen.take("0: [RANK 0] Epoch 0 | Batchsize: 32 | Steps: 256", to_stderr=False)
    for line in STDERR.splitlines():
        screen.take(line, to_stderr=True, now=0.0)
    return screen, err


def test_the_screen_holds_the_tracebacks_boxes_and_frames_and_says_each_warning_once() -> None:
    screen, err = _screen()
    shown = err.getvalue()
    assert shown.count("The hostname of the client socket") == 1, shown
    assert "[node2:1] WARNING setting GLOO_SOCKET_IFNAME" in shown and "1: [node2" not in shown  # label off
    for held in ("Traceback", "frame #", "ChildFailedError", "Root Cause", "sendBytes failed", "failed (exitcode"):
        assert held not in shown, (held, shown)
    assert screen.failing


def test_the_digest_names_the_rank_that_failed_first_with_its_frame_never_the_agents() -> None:
    screen, _ = _screen()
    lines = screen.digest(1, "/logs/job_3.full.log")
    assert lines[:4] == ["ddpkit: the job step failed (srun exit code 1): rank 1 on host node2 failed first with "
                         "exit code 1", '    File "/tmp/t/keyerror.py", line 11, in <module>',
                         '      raise KeyError("batch")', "    KeyError: 'batch'"], lines
    assert "  rank 0 (node1): RuntimeError: Connection closed by peer" in lines, lines
    assert lines[-1] == "  full output of every node and rank: /logs/job_3.full.log"
    assert not any("torchrun" in line or "ChildFailedError" in line for line in lines), lines


def test_a_rank_ddpkit_stopped_is_never_the_one_that_failed_first() -> None:
    screen = StepScreen(io.StringIO(), io.StringIO())
    for line in ("0: ddpkit watch: HANG: no rank has made progress for 10 s (deadline 10 s); reported by rank 0 on "
                 "host node1; every rank stops now (exit 3)",
                 "0:   rank 1 on host node2 has not entered the group's collective #322; it stopped answering",
                 "0: [node1:0] ERROR rank 0: the job stalled: rank 1 on node2 (10.213.0.12) stopped answering",
                 "0: E1126 13:20:37.738000 2658 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
                 "(exitcode: 3) local_rank: 0 (pid: 2666) of binary: /venv/bin/python",
                 "0: [0]:", "0:   time      : 2026-11-26_13:20:37", "0:   host      : node1",
                 "0:   rank      : 0 (local_rank: 0)", "0:   exitcode  : 3 (pid: 2666)",
                 "1: [node2:1] WARNING setting GLOO_SOCKET_IFNAME=vj: vj routes to the master"):
        screen.take(line, to_stderr=True, now=0.0)
    lines = screen.digest(1, "LOG")
    assert lines[0] == ("ddpkit: the job step failed (srun exit code 1); the watch found first: rank 1 on host node2 "
                        "has not entered the group's collective #322; it stopped answering"), lines
    assert "  rank 0 (node1): stopped by ddpkit (exit 3)" in lines, lines
    assert not any("failed first" in line for line in lines), lines


REQUEUE = """\
0: slurmstepd-node1: error: *** STEP 7.0 ON node1 CANCELLED AT 2026-11-26T13:33:40 DUE TO JOB REQUEUE ***
0: W1126 13:33:40.385000 23474 torch/distributed/elastic/agent/server/api.py:753] Received 15 death signal, \
shutting down workers
0: W1126 13:33:40.386000 23474 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 23576 \
closing signal SIGTERM
0: [node1:0] WARNING setting GLOO_SOCKET_IFNAME=vj195c38a: vj195c38a (10.213.0.11) routes to the master
0: Traceback (most recent call last):
0:   File "/venv/bin/torchrun", line 6, in <module>
0: torch.distributed.elastic.multiprocessing.api.SignalException: Process 23474 got signal: 15
srun: error: node1: task 0: Exited with exit code 1
srun: launch/slurm: _step_signal: Terminating StepId=7.0
"""


def test_a_step_slurm_cancelled_for_a_requeue_is_no_rank_failure() -> None:
    """``scontrol requeue`` of a train job (the preemption test's log): the agent exits 1 on SIGTERM, srun says
    task 0 exited 1; no rank failed, and no line says one did (once: "rank 0 ... failed first with exit code 1")."""
    err = io.StringIO()
    screen = StepScreen(io.StringIO(), err, agents=True)
    screen.take("0: Preempted at epoch 1, step 369: snapshot written at step 369; exiting with 75", to_stderr=False)
    for line in REQUEUE.splitlines():
        screen.take(line, to_stderr=True, now=0.0)
    assert screen.digest(1, "LOG") == ["ddpkit: Slurm ended the step (srun exit code 1): STEP 7.0 ON node1 CANCELLED "
                                       "AT 2026-11-26T13:33:40 DUE TO JOB REQUEUE; its full output: LOG"]
    assert "SignalException" not in err.getvalue()


TWO_PER_NODE = """\
1: [node2:2] WARNING setting GLOO_SOCKET_IFNAME=vjb: vjb (10.213.0.12) routes to the master
1: [node2:3] WARNING setting GLOO_SOCKET_IFNAME=vjb: vjb (10.213.0.12) routes to the master
1: Traceback (most recent call last):
1: Traceback (most recent call last):
1:   File "/tmp/t/ke2.py", line 10, in <module>
1:   File "/tmp/t/ke2.py", line 11, in <module>
1:     raise KeyError("batch")
1:     dist.all_reduce(t)
1: KeyError: 'batch'
1: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer
1: E1126 13:55:57.201000 23571 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) \
local_rank: 1 (pid: 23577) of binary: /venv/bin/python
1: Root Cause (first observed failure):
1: [0]:
1:   time      : 2026-11-26_13:55:55
1:   host      : node2
1:   rank      : 3 (local_rank: 1)
1:   exitcode  : 1 (pid: 23577)
1:   error_file: /tmp/torchelastic_p5f9k44w/9fed2bab_dfx9w62e/attempt_0/1/error.json
1:   traceback : Traceback (most recent call last):
1:     File "/tmp/t/ke2.py", line 10, in <module>
1:       raise KeyError("batch")
1:   KeyError: 'batch'
1:
1: ============================================================
"""


def test_two_ranks_on_a_node_the_traceback_comes_from_the_failed_ranks_box() -> None:
    """Two ranks of one node share its stream, their tracebacks interleaved line by line; the rank's own
    traceback is the one torch's box shows for it (``ddpkit run`` writes torch's error file)."""
    screen = StepScreen(io.StringIO(), io.StringIO(), agents=True, ranks_per_task=2)
    for line in TWO_PER_NODE.splitlines():
        screen.take(line, to_stderr=True, now=0.0)
    lines = screen.digest(1, "LOG")
    assert lines[:4] == ["ddpkit: the job step failed (srun exit code 1): rank 3 on host node2 failed first with "
                         "exit code 1", '    File "/tmp/t/ke2.py", line 10, in <module>',
                         '      raise KeyError("batch")', "    KeyError: 'batch'"], lines


def test_a_step_that_failed_with_no_rank_known_says_its_last_traceback() -> None:
    """Nothing says which rank failed (no [host:rank] line, no agent's or srun's line for a task): the digest
    still says the step's own last words, never only that it failed."""
    screen = StepScreen(io.StringIO(), io.StringIO(), agents=False)
    for line in ("0: Traceback (most recent call last):", '0:   File "/a/b.py", line 3, in <module>', "0:     f()",
                 "0: ValueError: x"):
        screen.take(line, to_stderr=True, now=0.0)
    assert screen.digest(4, "LOG") == ["ddpkit: the job step failed (srun exit code 4)",
                                       '    File "/a/b.py", line 3, in <module>', "      f()", "    ValueError: x",
                                       "  full output of every node and rank: LOG"]


TORCHRUN_STDERR = """\
Traceback (most recent call last):
  File "/tmp/t/raise.py", line 8, in <module>
    raise KeyError("batch")
KeyError: 'batch'
ddpkit watch: rank 0 on host vm: all_reduce #5 (called at raise.py:6 (<module>)) failed: Connection closed by peer
  rank 1 on host vm (pid 20758) is gone (its process no longer runs)
0: a line of the user's that starts like srun's label
E1126 17:13:40.261000 20660 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) \
local_rank: 1 (pid: 20758) of binary: /venv/bin/python
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Root Cause (first observed failure):
[0]:
  time      : 2026-11-26_17:13:40
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 20758)
  error_file: /tmp/torchelastic_1/attempt_0/1/error.json
  traceback : Traceback (most recent call last):
    File "/tmp/t/raise.py", line 8, in <module>
      raise KeyError("batch")
  KeyError: 'batch'
============================================================
"""


def test_a_rendered_torchrun_jobs_one_stream_is_read_without_srun_labels() -> None:
    """``ddpkit step -- torchrun ...`` (a rendered torchrun job): no line is a task's label, the box's "localhost"
    is this host, and the digest names the launcher."""
    err = io.StringIO()
    screen = StepScreen(io.StringIO(), err, agents=True, ranks_per_task=2, launcher="torchrun")
    for line in TORCHRUN_STDERR.replace("\\\n", "").splitlines():
        screen.take(line, to_stderr=True)
    assert set(screen.tasks) == {-1}  # "0: a line ..." is the user's, not task 0's
    lines = screen.digest(1, "LOG")
    host = socket.gethostname().split(".", 1)[0]
    assert lines[0] == f"ddpkit: the job failed (torchrun exit code 1): rank 1 on host {host} failed first with " \
                       "exit code 1"
    assert "    KeyError: 'batch'" in lines and lines[-1] == "  full output of this node and its ranks: LOG"
    assert "ChildFailedError" not in err.getvalue() and "Root Cause" not in err.getvalue()


MPIRUN_LINES = """\
[1,0]<stderr>:[vm:0] WARNING OMP_NUM_THREADS set to 1 (2 cores available / 2 ranks on this node)
[1,1]<stderr>:Traceback (most recent call last):
[1,1]<stderr>:  File "/tmp/t/raise.py", line 8, in <module>
[1,1]<stderr>:    raise KeyError("batch")
[1,1]<stderr>:KeyError: 'batch'
--------------------------------------------------------------------------
Primary job  terminated normally, but 1 process returned
a non-zero exit code. Per user-direction, the job has been aborted.
--------------------------------------------------------------------------
[1,0]<stderr>:Traceback (most recent call last):
[1,0]<stderr>:  File "/tmp/t/raise.py", line 6, in <module>
[1,0]<stderr>:    dist.all_reduce(t)
[1,0]<stderr>:RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:12703
--------------------------------------------------------------------------
mpirun detected that one or more processes exited with non-zero status, thus causing
the job to be terminated. The first process to do so was:

  Process name: [[2802,1],1]
  Exit code:    5
--------------------------------------------------------------------------
"""


def test_an_open_mpi_jobs_tagged_lines_name_the_first_process_mpirun_saw() -> None:
    """``ddpkit step -- mpirun --tag-output ...`` (a rendered Open MPI job): each line's tag is its rank, mpirun's
    "Process name: [[J,1],R] / Exit code: N" the rank that failed first, its boxes kept off the screen."""
    err = io.StringIO()
    screen = StepScreen(io.StringIO(), err, agents=False, ranks_per_task=1, launcher="mpirun")
    for line in MPIRUN_LINES.splitlines():
        screen.take(line, to_stderr=True)
    lines = screen.digest(5, "LOG")
    assert lines[0] == "ddpkit: the job failed (mpirun exit code 5): rank 1 failed first with exit code 5"
    assert lines[1:4] == ['    File "/tmp/t/raise.py", line 8, in <module>', '      raise KeyError("batch")',
                          "    KeyError: 'batch'"], lines
    assert lines[4].startswith("  rank 0 (vm): RuntimeError: ") and lines[-1] == "  full output of every node and " \
                                                                                  "rank: LOG", lines
    shown = err.getvalue()
    assert "Process name" not in shown and "Primary job" not in shown and "-----" not in shown, shown
    assert shown.splitlines() == ["[vm:0] WARNING OMP_NUM_THREADS set to 1 (2 cores available / 2 ranks on this node)"]


def test_an_open_mpi_process_ended_by_a_signal_is_named_with_its_node() -> None:
    screen = StepScreen(io.StringIO(), io.StringIO(), agents=False, ranks_per_task=1, launcher="mpirun")
    for line in ("[1,0]<stderr>:[vm:0] WARNING OMP_NUM_THREADS set to 1",
                 "mpirun noticed that process rank 1 with PID 0 on node vm exited on signal 9 (Killed)."):
        screen.take(line, to_stderr=True)
    assert screen.digest(137, "LOG")[0] == ("ddpkit: the job failed (mpirun exit code 137): rank 1 on host vm was "
                                            "killed by SIGKILL")


def test_show_all_shows_every_line_as_it_came_and_still_digests() -> None:
    """``ddpkit step --show-all`` (a Kubernetes pod, whose log is its only full log): nothing held or left out, the
    digest at the end the same."""
    err = io.StringIO()
    screen = StepScreen(io.StringIO(), err, agents=True, ranks_per_task=2, launcher="torchrun", show_all=True)
    lines = TORCHRUN_STDERR.replace("\\\n", "").splitlines()
    for line in lines:
        screen.take(line, to_stderr=True)
    assert err.getvalue().splitlines() == lines
    host = socket.gethostname().split(".", 1)[0]
    assert screen.digest(1, "the lines above")[0].endswith(f"rank 1 on host {host} failed first with exit code 1")


MPICH_LINES = """\
[0] [vm:0] WARNING OMP_NUM_THREADS set to 1 (2 cores available / 2 ranks on this node)
[1] Traceback (most recent call last):
[1]   File "/tmp/t/raise.py", line 8, in <module>
[1]     raise KeyError("batch")
[1] KeyError: 'batch'
[0] ddpkit watch: rank 0 on host vm: all_reduce #5 (called at raise.py:6 (<module>)) failed: Connection closed by peer
[0]   rank 1 on host vm (pid 20899) is gone (its process no longer runs)
[0] Traceback (most recent call last):
[0]   File "/tmp/t/raise.py", line 6, in <module>
[0]     dist.all_reduce(t)
[0] RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:33471
"""


def test_an_mpich_job_names_the_rank_whose_own_exception_came_first() -> None:
    """``ddpkit step -- mpiexec.mpich -prepend-rank ...``: mpiexec names no failed rank, so the rank whose own
    traceback (not a peer's failure) began first is named, as having raised first, with the launcher's code."""
    screen = StepScreen(io.StringIO(), io.StringIO(), agents=False, ranks_per_task=1, launcher="mpich")
    for line in MPICH_LINES.splitlines():
        screen.take(line, to_stderr=True)
    lines = screen.digest(1, "LOG")
    assert lines[:4] == ["ddpkit: the job failed (mpiexec exit code 1): rank 1 raised first",
                         '    File "/tmp/t/raise.py", line 8, in <module>', '      raise KeyError("batch")',
                         "    KeyError: 'batch'"], lines
    assert lines[4].startswith("  rank 0 (vm): RuntimeError: "), lines


def test_a_long_jobs_watch_lines_are_kept_bounded_and_its_first_report_still_leads_the_digest() -> None:
    """A job that runs for days prints a watch line now and then: the screen keeps the first WATCH_KEPT for the
    digest (which shows the first report), not every one."""
    from ddpkit.launch.stepscreen import WATCH_KEPT

    screen = StepScreen(io.StringIO(), io.StringIO())
    screen.take("0: ddpkit watch: SLOW: rank 1 on host node2 is 3.1x the median step", to_stderr=True, now=0.0)
    screen.take("0:   rank 1 on host node2: step 40 ms, median 13 ms", to_stderr=True, now=0.0)
    for i in range(3 * WATCH_KEPT):
        screen.take(f"0: ddpkit watch: SLOW: rank 1 on host node2 (report {i})", to_stderr=True, now=0.0)
    assert len(screen.watch) == WATCH_KEPT
    lines = screen.digest(1, "LOG")
    assert lines[0].startswith("ddpkit: the job step failed (srun exit code 1); the watch found first: rank 1 on "
                               "host node2: step 40 ms"), lines
