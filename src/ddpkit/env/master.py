"""Where rank 0's store lives: an explicit MASTER_ADDR/MASTER_PORT wins, else derived from what the launcher gives."""

from __future__ import annotations

from ddpkit.env.record import VarReader, derive_port, is_ip_address
from ddpkit.errors import EnvConflict

__all__ = ["resolve_master"]


def resolve_master(
    reader: VarReader,
    *,
    hosts: tuple[str, ...],
    job_id: str | None,
    single_host: bool,
    hint: str,
) -> tuple[str | None, int | None]:
    """Return (address, port).

    ``hosts`` is the expanded node list (first host is the master by default); ``single_host`` says every
    rank runs on this machine, so loopback is correct; ``hint`` tells the user how to pass MASTER_ADDR with
    this launcher when neither holds.
    """
    addr = reader.text("master_addr", "MASTER_ADDR")
    if addr is not None:
        addr = addr.strip()
        if not addr:
            raise EnvConflict("MASTER_ADDR is set but empty", "the host name or IP of rank 0's node",
                              "unset MASTER_ADDR to let ddpkit derive it, or set it to rank 0's host")
        if hosts and not is_ip_address(addr) and _short(addr) not in {_short(h) for h in hosts}:
            raise EnvConflict(
                f"MASTER_ADDR={addr!r} is not one of this job's hosts ({', '.join(hosts[:8])}"
                f"{', ...' if len(hosts) > 8 else ''})",
                "rank 0's host, which is in the job's node list",
                f"unset MASTER_ADDR (ddpkit then uses the first host, {hosts[0]}) or set it to a host of the job",
            )
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

    port = reader.integer("master_port", "MASTER_PORT", minimum=1)
    if port is not None and port > 65535:
        raise EnvConflict(f"MASTER_PORT={port} is not a TCP port", "1..65535", "set MASTER_PORT to a free port")
    if port is None and job_id is not None:
        port = derive_port(job_id)
        reader.derived("master_port", f"derived from job id {job_id} (ddpkit.env.PORT_RANGE)")
    return addr, port


def _short(host: str) -> str:
    return host.split(".", 1)[0]
