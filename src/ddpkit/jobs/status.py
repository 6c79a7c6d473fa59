"""Show a Slurm job's state (``ddpkit status JOBID``): squeue/scontrol for live jobs, sacct for old ones.

Exit codes: 0 the job is known (whatever its state); 2 unknown job or no Slurm client.
"""

from __future__ import annotations

import argparse
import json

from ddpkit.jobs import slurmctl

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_id", metavar="JOBID", help="Slurm job id (as ddpkit submit printed it)")
    p.add_argument("--json", action="store_true", help="one JSON object")


def run(args: argparse.Namespace) -> int:
    st = slurmctl.job_state(args.job_id)
    record = {"job_id": st.job_id, "name": st.name, "state": st.state, "reason": st.reason, "nodes": st.nodes,
              "restarts": st.restarts, "exit_status": st.exit_status, "exit_signal": st.exit_signal,
              "exit_code": None if st.active else slurmctl.job_exit_code(st), "log": st.stdout, "source": st.source}
    if args.json:
        print(json.dumps(record, sort_keys=True))
        return 0
    width = max(len(k) for k in record)
    for key, value in record.items():
        print(f"{key:<{width}}  {'-' if value in (None, '') else value}")
    return 0
