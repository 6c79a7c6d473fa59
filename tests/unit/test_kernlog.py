"""The OOM killer's line for a rank's pid (src/ddpkit/launch/kernlog.py), on kernel log lines as this machine's
kernel wrote them (a python3 in a 64 MiB memory cgroup, 2026-11-26) and as /dev/kmsg gives them."""

from __future__ import annotations

from pathlib import Path

from ddpkit.launch.kernlog import oom_kill_line, read_kernel_log

DMESG = """\
[13789.379169] python3 invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0
[13789.381956] oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,oom_memcg=/ddpkit-oom-dg39,\
task_memcg=/ddpkit-oom-dg39,task=python3,pid=15847,uid=0
[13789.381980] Memory cgroup out of memory: Killed process 15847 (python3) total-vm:75160kB, anon-rss:65152kB, \
file-rss:6624kB, shmem-rss:0kB, UID:0 pgtables:184kB oom_score_adj:0
[13790.000001] Out of memory: Killed process 2210 (python) total-vm:9812345kB, anon-rss:8123456kB, file-rss:0kB, \
shmem-rss:0kB, UID:1000 pgtables:16384kB oom_score_adj:0
"""
KMSG = [
    "6,1336,13789379169,-;python3 invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0\n",
    "6,1340,13789381956,-;oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,"
    "oom_memcg=/x,task_memcg=/x,task=python3,pid=15847,uid=0\n",
    "3,1341,13789381980,-;Memory cgroup out of memory: Killed process 15847 (python3) total-vm:75160kB, "
    "anon-rss:65152kB, file-rss:6624kB, shmem-rss:0kB, UID:0 pgtables:184kB oom_score_adj:0\n",
    "4,1342,13790100000,-;port1 (unregistering): left promiscuous mode\n",
]


def test_the_killed_process_line_of_that_pid_and_no_other() -> None:
    line = oom_kill_line(15847, DMESG.splitlines())
    assert line == ("Memory cgroup out of memory: Killed process 15847 (python3) total-vm:75160kB, anon-rss:65152kB, "
                    "file-rss:6624kB, shmem-rss:0kB, UID:0 pgtables:184kB oom_score_adj:0")
    assert oom_kill_line(2210, DMESG.splitlines()).startswith("Out of memory: Killed process 2210 (python)")  # type: ignore[union-attr]
    assert oom_kill_line(1584, DMESG.splitlines()) is None  # a prefix of a pid is not the pid
    assert oom_kill_line(4242, DMESG.splitlines()) is None


def test_kmsg_records_and_a_reused_pid_before_the_rank_lived() -> None:
    assert oom_kill_line(15847, KMSG).startswith("Memory cgroup out of memory: Killed process 15847")  # type: ignore[union-attr]
    assert oom_kill_line(15847, KMSG, since=13790.0) is None  # that line was another process's with the same pid
    assert oom_kill_line(15847, KMSG[:2]).startswith("oom-kill:constraint=CONSTRAINT_MEMCG")  # type: ignore[union-attr]


def test_a_log_that_cannot_be_read_says_nothing(tmp_path: Path) -> None:
    assert read_kernel_log(str(tmp_path / "no-kmsg")) is None
