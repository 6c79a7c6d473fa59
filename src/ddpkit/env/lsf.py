"""IBM Spectrum LSF with ``jsrun`` (Summit, Sierra, Lassen).

jsrun's Job Step Manager gives every task JSM_NAMESPACE_RANK, JSM_NAMESPACE_SIZE, JSM_NAMESPACE_LOCAL_RANK and
JSM_NAMESPACE_LOCAL_SIZE (IBM Spectrum LSF / CSM docs, "jsrun" environment variables; Lightning's
``LSFEnvironment`` reads the same). LSF's LSB_DJOB_RANKFILE (else LSB_DJOB_HOSTFILE) lists one line per slot,
the first being the launch node, which runs no task: the compute hosts are the others, in order, and the
first of them is the master. LSB_JOBID is the job id.
"""

from __future__ import annotations

from collections.abc import Mapping

from ddpkit.env.hostfile import read_hostfile
from ddpkit.env.master import resolve_master
from ddpkit.env.record import RankAndSize, VarReader, WorldInfo

NAME = "lsf"
TABLE = {
    "rank": "JSM_NAMESPACE_RANK",
    "local_rank": "JSM_NAMESPACE_LOCAL_RANK",
    "world_size": "JSM_NAMESPACE_SIZE",
    "local_world_size": "JSM_NAMESPACE_LOCAL_SIZE",
    "node_rank": "rank // JSM_NAMESPACE_LOCAL_SIZE (jsrun packs ranks by node)",
    "hosts": "LSB_DJOB_RANKFILE | LSB_DJOB_HOSTFILE, without the launch node (first line)",
    "master": "MASTER_ADDR | first compute host; MASTER_PORT | derived from LSB_JOBID",
    "run_id": "LSB_JOBID",
}
FAMILY = ("JSM_NAMESPACE_RANK", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_LOCAL_RANK", "JSM_NAMESPACE_LOCAL_SIZE")
activated = RankAndSize("JSM_NAMESPACE_RANK", "JSM_NAMESPACE_SIZE", "started by LSF's jsrun")


def read(environ: Mapping[str, str]) -> WorldInfo:
    r = VarReader(environ, NAME)
    rank = r.required("rank", "JSM_NAMESPACE_RANK")
    world = r.required("world_size", "JSM_NAMESPACE_SIZE", minimum=1)
    local_rank = r.required("local_rank", "JSM_NAMESPACE_LOCAL_RANK")
    local_world = r.required("local_world_size", "JSM_NAMESPACE_LOCAL_SIZE", minimum=1)
    node_rank = rank // local_world
    r.derived("node_rank", "rank // JSM_NAMESPACE_LOCAL_SIZE")
    num_nodes = max(1, -(-world // local_world))
    r.derived("num_nodes", "JSM_NAMESPACE_SIZE / JSM_NAMESPACE_LOCAL_SIZE")
    hosts: tuple[str, ...] = ()
    hostfile = r.first("LSB_DJOB_RANKFILE", "LSB_DJOB_HOSTFILE")
    if hostfile is not None:
        hosts = read_hostfile(environ, hostfile, skip_first=True)
        r.derived("hosts", f"{hostfile} without its first line (the launch node)")
    job_id = r.text("run_id", "LSB_JOBID")
    addr, port = resolve_master(r, hosts=hosts, job_id=job_id, single_host=local_world == world,
                                hint="export MASTER_ADDR (LSB_DJOB_RANKFILE is not set)")
    return WorldInfo(launcher=NAME, rank=rank, local_rank=local_rank, world_size=world,
                     local_world_size=local_world, node_rank=node_rank, num_nodes=num_nodes, master_addr=addr,
                     master_port=port, hosts=hosts, run_id=job_id, sources=r.sources)
