"""Where rank 0's store lives: an explicit MASTER_ADDR/MASTER_PORT wins, else derived from what the launcher gives."""

from __future__ import annotations

from ddpkit.base.errors import EnvConflict
from ddpkit.env.record import VarReader, derive_port, is_ip_address

__all__ = ["AZURE_MASTER_VARS", "resolve_master"]

#: Azure's own master-node variables, read under MPI where MASTER_ADDR is not set. AZ_BATCH_MASTER_NODE is
#: "IP:port" of the node running a multi-instance task's primary task; its port is Batch's, not ours
#: (https://learn.microsoft.com/azure/batch/batch-compute-node-environment-variables). AzureML's MPI jobs set
#: AZ_BATCHAI_MPI_MASTER_NODE to the master node's address.
AZURE_MASTER_VARS = ("AZ_BATCHAI_MPI_MASTER_NODE", "AZ_BATCH_MASTER_NODE")


def resolve_master(
    reader: VarReader,
    *,
    hosts: tuple[str, ...],
    job_id: str | None,
    single_host: bool,
    hint: str,
    azure: bool = False,
) -> tuple[str | None, int | None]:
    """Return (address, port).

    ``hosts`` is the expanded node list (first host is the master by default); ``single_host`` says every
    rank runs on this machine, so loopback is correct; ``hint`` tells the user how to pass MASTER_ADDR with
    this launcher when neither holds; ``azure`` also accepts Azure's master variables (MPI launchers).
    An empty MASTER_ADDR counts as unset.
    """
    addr = reader.address("master_addr", "MASTER_ADDR")
    if addr is not None:
        if hosts and not is_ip_address(addr) and _short(addr) not in {_short(h) for h in hosts}:
            raise EnvConflict(
                f"MASTER_ADDR={addr!r} is not one of this job's hosts ({', '.join(hosts[:8])}"
                f"{', ...' if len(hosts) > 8 else ''})",
                "rank 0's host, which is in the job's node list",
                f"unset MASTER_ADDR (ddpkit then uses the first host, {hosts[0]}) or set it to a host of the job",
            )
    elif azure and reader.first(*AZURE_MASTER_VARS):
        var = reader.first(*AZURE_MASTER_VARS)
        raw = reader.environ[var or ""].strip()
        host = raw.rsplit(":", 1)[0] if var == "AZ_BATCH_MASTER_NODE" and raw.count(":") == 1 else raw
        addr = reader.address("master_addr", var or "")
        addr = host if addr is not None else None
    elif hosts:
        addr = hosts[0]
        reader.derived("master_addr", "first host of the node list")
    elif single_host:
        addr = "127.0.0.1"
        reader.derived("master_addr", "every rank is on this host: loopback")
    else:
        raise EnvConflict(
            f"{reader.launcher} gives no master address and MASTER_ADDR is not set",
            "MASTER_ADDR naming the host of rank 0",
            hint,
        )

    port = reader.port("master_port", "MASTER_PORT")
    if port is None and job_id is not None:
        port = derive_port(job_id)
        reader.derived("master_port", f"derived from job id {job_id} (ddpkit.env.PORT_RANGE)")
    return addr, port


def _short(host: str) -> str:
    return host.split(".", 1)[0]
