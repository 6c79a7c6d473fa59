"""Queue wait where the scheduler says: Slurm's SubmitTime and StartTime read from ``scontrol show job`` as Slurm
22.05 prints it (one line with -o, and the multi-line form), absent where Slurm cannot be read; written once per
Slurm job into the goodput ledger."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from ddpkit.goodput.queue import parse_scontrol, record_queue_wait, slurm_queue_wait
from ddpkit.goodput.records import GoodputLog, QueueWaited, read_goodput

# scontrol show job 7 (Slurm 22.05) of a batch job that waited 28 s in the queue, multi-line
SHOW_JOB = """JobId=7 JobName=ddpkit-train
   UserId=root(0) GroupId=root(0) MCS_label=N/A
   Priority=4294901754 Nice=0 Account=(null) QOS=(null)
   JobState=RUNNING Reason=None Dependency=(null)
   Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0
   RunTime=00:00:03 TimeLimit=UNLIMITED TimeMin=N/A
   SubmitTime=2026-11-26T14:03:12 EligibleTime=2026-11-26T14:03:12
   AccrueTime=2026-11-26T14:03:12
   StartTime=2026-11-26T14:03:40 EndTime=Unknown Deadline=N/A
   SuspendTime=None SecsPreSuspend=0 LastSchedEval=2026-11-26T14:03:40 Scheduler=Main
   Partition=debug AllocNode:Sid=node1:2841
   ReqNodeList=(null) ExcNodeList=(null)
   NodeList=node[1-2]
   BatchHost=node1
   NumNodes=2 NumCPUs=2 NumTasks=2 CPUs/Task=1 ReqB:S:C:T=0:0:*:*
   TRES=cpu=2,node=2,billing=2
   Command=/tmp/run dir/job.sh
   WorkDir=/tmp/run dir
   StdOut=/tmp/run dir/logs/ddpkit-train_7.out
"""
# the same job pending, with -o (one line): no start yet
PENDING = ("JobId=8 JobName=ddpkit-train UserId=root(0) GroupId=root(0) MCS_label=N/A Priority=4294901753 Nice=0 "
           "Account=(null) QOS=(null) JobState=PENDING Reason=Resources Dependency=(null) Requeue=1 Restarts=0 "
           "BatchFlag=1 Reboot=0 ExitCode=0:0 RunTime=00:00:00 TimeLimit=UNLIMITED TimeMin=N/A "
           "SubmitTime=2026-11-26T14:05:01 EligibleTime=2026-11-26T14:05:01 AccrueTime=2026-11-26T14:05:01 "
           "StartTime=Unknown EndTime=Unknown Deadline=N/A SuspendTime=None SecsPreSuspend=0 "
           "LastSchedEval=2026-11-26T14:05:02 Scheduler=Main Partition=debug AllocNode:Sid=node1:2841\n")


def _at(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S").timestamp()


def test_submit_and_start_are_read_from_scontrols_show_job() -> None:
    found = parse_scontrol(SHOW_JOB, "7")
    assert found == QueueWaited(scheduler="slurm", job_id="7", submit=_at("2026-11-26T14:03:12"),
                                start=_at("2026-11-26T14:03:40"))
    assert found.start - found.submit == 28.0
    one_line = " ".join(line.strip() for line in SHOW_JOB.splitlines())
    assert parse_scontrol(one_line, "7") == found


def test_a_job_not_started_or_without_times_has_no_queue_wait() -> None:
    assert parse_scontrol(PENDING, "8") is None
    assert parse_scontrol("slurm_load_jobs error: Invalid job id specified\n", "9") is None


def test_outside_slurm_or_where_slurm_cannot_be_read_nothing_is_recorded(tmp_path: Path) -> None:
    assert slurm_queue_wait({}) is None
    # no scontrol on PATH: silently none
    assert slurm_queue_wait({"SLURM_JOB_ID": "7", "PATH": str(tmp_path)}) is None
    # no slurm.conf to find the controller by: scontrol retries for a minute; the timeout ends the wait
    env = {"SLURM_JOB_ID": "7", "SLURM_CONF": str(tmp_path / "missing.conf"), "PATH": "/usr/bin:/bin"}
    log = GoodputLog(tmp_path, attempt=1)
    assert record_queue_wait(log, env, timeout_s=1.0) is None
    log.close()
    assert read_goodput(tmp_path) == []


def test_the_queue_wait_is_written_once_per_slurm_job(tmp_path: Path) -> None:
    """A later attempt of the same job finds the line written and does not ask Slurm again."""
    found = parse_scontrol(SHOW_JOB, "7")
    assert found is not None
    log = GoodputLog(tmp_path, attempt=1)
    log.write(found)
    log.close()
    again = GoodputLog(tmp_path, attempt=2)
    # no scontrol on PATH: were Slurm asked, nothing could be written; the answer is "already there"
    assert record_queue_wait(again, {"SLURM_JOB_ID": "7", "PATH": str(tmp_path)}) is None
    again.close()
    assert [r.job_id for r in read_goodput(tmp_path) if isinstance(r, QueueWaited)] == ["7"]
