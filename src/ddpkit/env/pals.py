"""PBS Pro with Cray PALS ``mpiexec`` (Polaris, Aurora).

PALS gives every rank PALS_RANKID, PALS_LOCAL_RANKID, PALS_NODEID and PALS_LOCAL_SIZE, and Cray PMI beside it
PMI_RANK, PMI_SIZE, PMI_LOCAL_RANK and PMI_LOCAL_SIZE (HPE Cray PALS ``mpiexec(1)`` ENVIRONMENT; ALCF's Polaris
and Aurora "Running jobs" pages read PALS_LOCAL_RANKID and PMI_SIZE). PBS writes the job's hosts to the file
PBS_NODEFILE, one line per chunk, in node-id order; PBS_JOBID is the job id. PALS is tried before MPICH,
whose PMI_RANK/PMI_SIZE it shares.
"""

from __future__ import annotations

from collections.abc import Mapping

from ddpkit.env.hostfile import read_hostfile
from ddpkit.env.master import resolve_master
from ddpkit.env.record import VarReader, WorldInfo, present

NAME = "pals"
TABLE = {
    "rank": "PALS_RANKID",
    "local_rank": "PALS_LOCAL_RANKID",
    "world_size": "PMI_SIZE | PALS_SIZE",
    "local_world_size": "PALS_LOCAL_SIZE | PMI_LOCAL_SIZE",
    "node_rank": "PALS_NODEID",
    "hosts": "PBS_NODEFILE",
    "master": "MASTER_ADDR | first host of PBS_NODEFILE; MASTER_PORT | derived from PBS_JOBID",
    "run_id": "PBS_JOBID | PALS_APID",
}
FAMILY = ("PALS_RANKID", "PALS_LOCAL_RANKID", "PALS_NODEID", "PALS_LOCAL_SIZE", "PALS_APID")


def activated(environ: Mapping[str, str]) -> tuple[bool, str]:
    if present(environ, "PALS_RANKID"):
        return True, "PALS_RANKID is set (started by Cray PALS mpiexec)"
    return False, "PALS_RANKID is not set"


def read(environ: Mapping[str, str]) -> WorldInfo:
    r = VarReader(environ, NAME)
    rank = r.required("rank", "PALS_RANKID")
    world = r.required("world_size", "PMI_SIZE", "PALS_SIZE", minimum=1)
    local_rank = r.required("local_rank", "PALS_LOCAL_RANKID", "PMI_LOCAL_RANK")
    local_world = r.required("local_world_size", "PALS_LOCAL_SIZE", "PMI_LOCAL_SIZE", minimum=1)
    hosts: tuple[str, ...] = ()
    if r.first("PBS_NODEFILE") is not None:
        hosts = read_hostfile(environ, "PBS_NODEFILE")
        r.derived("hosts", "PBS_NODEFILE")
    node_rank = r.integer("node_rank", "PALS_NODEID")
    if node_rank is None:
        node_rank = rank // local_world
        r.derived("node_rank", "rank // local size (PALS_NODEID unset)")
    num_nodes = len(hosts) or max(1, -(-world // local_world))
    r.derived("num_nodes", "hosts in PBS_NODEFILE" if hosts else "world size / local size")
    job_id = r.text("run_id", "PBS_JOBID", "PALS_APID")
    addr, port = resolve_master(r, hosts=hosts, job_id=job_id, single_host=local_world == world,
                                hint="export MASTER_ADDR (PBS_NODEFILE is not set), e.g. mpiexec --env MASTER_ADDR=...")
    return WorldInfo(launcher=NAME, rank=rank, local_rank=local_rank, world_size=world,
                     local_world_size=local_world, node_rank=node_rank, num_nodes=num_nodes, master_addr=addr,
                     master_port=port, hosts=hosts, run_id=job_id, sources=r.sources)
