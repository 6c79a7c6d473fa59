"""Where a rank starts and stops torch.distributed: backend, device, store, process group. (Live healing re-forms
the group in the same process: ``ddpkit.live.rank.group``, the one other ``init_process_group``.)

    import ddpkit
    rt = ddpkit.init()            # from torchrun, srun, mpirun, Kubeflow, or a single process
    ...                           # rt.rank, rt.world_size, rt.device
    ddpkit.shutdown()
"""

from __future__ import annotations

import json
import os
import socket
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING

from ddpkit.base.errors import ConfigError, EnvConflict
from ddpkit.base.log import get_logger
from ddpkit.base.netinfo import InterfaceChoice, gloo_interface
from ddpkit.env import WorldInfo, detect, thread_count

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from ddpkit.watch.options import WatchOptions

__all__ = ["DEFAULT_TIMEOUT", "Runtime", "claim_gpu", "device_identity", "export_world", "init", "interface_choice",
           "open_store", "share_cores", "shared_gpus", "shutdown"]

log = get_logger(__name__)
DEFAULT_TIMEOUT = timedelta(seconds=60)
BACKENDS = ("gloo", "nccl", "mpi", "ucc")


@dataclass(frozen=True)
class Runtime:
    """A started world: the launcher's record, plus the backend and device this rank uses."""

    world: WorldInfo
    backend: str
    device: torch.device
    interface: InterfaceChoice | None = None
    """The interface gloo uses across hosts, and why (None before export_world ran)."""

    @property
    def rank(self) -> int:
        return self.world.rank

    @property
    def world_size(self) -> int:
        return self.world.world_size

    @property
    def local_rank(self) -> int:
        return self.world.local_rank


def set_env(name: str, value: str) -> None:
    """Export a variable torch reads; warn when that changes a value the user set."""
    old = os.environ.get(name)
    if old is not None and old != value:
        log.warning("overriding %s=%s with %s (from the launcher's variables)", name, old, value)
    os.environ[name] = value


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_interface: InterfaceChoice | None = None  # what the last export_world decided, for Runtime.interface


def interface_choice() -> InterfaceChoice | None:
    """What the last ``export_world`` decided about GLOO_SOCKET_IFNAME, and why (None before it ran)."""
    return _interface


def _export_interface(info: WorldInfo, master_addr: str) -> None:
    """Set GLOO_SOCKET_IFNAME to the interface that routes to the master, where the user set none and the
    master is another host: otherwise gloo advertises what the hostname resolves to, often 127.0.1.1."""
    global _interface
    _interface = choice = gloo_interface(master_addr, os.environ)
    if choice.chosen_by_ddpkit and choice.ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = choice.ifname
        name = socket.gethostname()
        try:
            default = f"{name} resolves to, {socket.gethostbyname(name)}"
        except OSError:
            default = f"{name} resolves to (it does not resolve)"
        (log.warning if info.local_rank == 0 else log.info)(
            "setting GLOO_SOCKET_IFNAME=%s: %s (left unset, gloo would advertise the address %s)",
            choice.ifname, choice.reason, default)


def export_world(info: WorldInfo) -> WorldInfo:
    """Export MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and OMP_NUM_THREADS for torch,
    and GLOO_SOCKET_IFNAME where the master is on another host (see ``_export_interface``)."""
    if info.is_agent:
        raise EnvConflict(
            f"this process is a {info.launcher} node agent for {info.local_world_size} ranks, not a rank",
            "ddpkit.init() inside a rank",
            "start the ranks with the ddpkit CLI (it launches them) or with torchrun",
        )
    addr, port = info.master_addr, info.master_port
    if info.world_size == 1:
        addr = addr or "127.0.0.1"
        port = port or _free_port()
    if addr is None or port is None:
        raise EnvConflict(f"{info.launcher} gives no master {'address' if addr is None else 'port'}",
                          "MASTER_ADDR and MASTER_PORT", "export MASTER_ADDR and MASTER_PORT on every rank")
    exports = [("MASTER_ADDR", addr), ("MASTER_PORT", str(port)), ("RANK", str(info.rank)),
               ("WORLD_SIZE", str(info.world_size))]
    if info.local_world_known:  # else counted once the store is up (count_local_world), never guessed here
        exports += [("LOCAL_RANK", str(info.local_rank)), ("LOCAL_WORLD_SIZE", str(info.local_world_size))]
    elif "assumed" not in info.sources.get("local_rank", ""):
        exports.append(("LOCAL_RANK", str(info.local_rank)))
    for name, value in exports:
        set_env(name, value)
    if info.world_size > 1:
        _export_interface(info, addr)
    if info.local_world_known:
        _share_threads(info)
    return info


def _share_threads(info: WorldInfo) -> None:
    threads = share_cores(info.local_world_size, announce=info.local_rank == 0)
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def count_local_world(store: dist.Store, info: WorldInfo, timeout: timedelta) -> WorldInfo:
    """A world whose launcher gave no local world size: every rank posts its host to the store, and the ranks on
    this host are counted (a roll-call); exports LOCAL_WORLD_SIZE and shares the cores among them."""
    host = socket.gethostname()
    store.set(f"host/{info.rank}", host)
    keys = [f"host/{r}" for r in range(info.world_size)]
    store.wait(keys, timeout)
    hosts = [store.get(k).decode() for k in keys]
    sources = {**info.sources, "local_world_size": "ranks on this host, counted at start-up"}
    local_rank = info.local_rank
    if "assumed" in info.sources.get("local_rank", ""):  # LOCAL_RANK unset too: this rank's place on its host
        local_rank = hosts[:info.rank].count(host)
        sources["local_rank"] = "ranks before this one on its host, counted at start-up"
        set_env("LOCAL_RANK", str(local_rank))
    node_rank, num_nodes = info.node_rank, info.num_nodes
    distinct = list(dict.fromkeys(hosts))  # hosts in the order of their first rank
    if info.sources.get("node_rank", "").startswith("unknown"):  # GROUP_RANK unset too
        node_rank, num_nodes = distinct.index(host), len(distinct)
        sources["node_rank"] = "this host's place among the ranks' hosts, counted at start-up"
    counted = replace(info, local_world_size=hosts.count(host), local_world_known=True, local_rank=local_rank,
                      node_rank=node_rank, num_nodes=max(num_nodes, node_rank + 1), sources=sources)
    if hosts.index(host) == info.rank:  # the first rank on this host says it
        log.warning("LOCAL_WORLD_SIZE was not set: %d rank(s) of %d run on %s (counted at start-up)",
                    counted.local_world_size, info.world_size, host)
    set_env("LOCAL_WORLD_SIZE", str(counted.local_world_size))
    _share_threads(counted)
    return counted


def share_cores(local_ranks: int, *, announce: bool) -> int | None:
    """Export OMP_NUM_THREADS as this rank's share of the node's cores (``env.thread_count``) where the node runs
    several ranks and the user left it unset; warn when ``announce``, since it changes the process environment.
    Returns the thread count set, or None. Called by ranks here and by ddpkit's launcher for its workers."""
    threads, message = thread_count(local_ranks)
    if threads is None or local_ranks <= 1:
        return None
    os.environ["OMP_NUM_THREADS"] = str(threads)
    if announce:
        log.warning(message)
    return threads


def pick_backend(requested: str | None = None) -> str:
    import torch

    requested = requested or os.environ.get("DDPKIT_BACKEND")
    if requested:
        if requested not in BACKENDS:
            raise ConfigError(f"backend {requested!r} is unknown", f"one of {', '.join(BACKENDS)}",
                              "pass --backend gloo on CPU or nccl on NVIDIA GPUs")
        return requested
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "gloo"


def pick_device(backend: str, local_rank: int) -> torch.device:
    import torch

    if backend == "nccl" or (backend != "gloo" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("backend nccl was asked for but no CUDA device is visible",
                              "a CUDA device per rank", "use --backend gloo, or check CUDA_VISIBLE_DEVICES")
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def device_identity(device: torch.device) -> tuple[str, str | None]:
    """The device's name (``cuda:0``) and, for a GPU, its UUID: the same on every process that sees that GPU,
    whatever CUDA_VISIBLE_DEVICES numbers it as (None where torch does not expose it)."""
    import torch

    if device.type != "cuda":
        return str(device), None
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return f"cuda:{device.index}", str(uuid) if uuid is not None else None


def _ranks_text(ranks: list[int]) -> str:
    return f"ranks {', '.join(map(str, ranks[:-1]))} and {ranks[-1]}"


def shared_gpus(claims: Iterable[tuple[int, str, str]]) -> dict[str, list[int]]:
    """Each GPU that several ranks claim, as ``'ranks 0 and 1 share GPU <id> on <host>'`` -> those ranks.

    ``claims``: (rank, host, GPU) with the GPU's UUID where known (global), else its device name (per host)."""
    owners: dict[tuple[str, str], list[int]] = defaultdict(list)
    for rank, host, gpu in claims:
        owners[(gpu, host)].append(rank)
    return {f"{_ranks_text(sorted(ranks))} share GPU {gpu} on {host}": sorted(ranks)
            for (gpu, host), ranks in sorted(owners.items()) if len(ranks) > 1}


def claim_gpu(store: dist.Store, info: WorldInfo, device: torch.device, timeout: timedelta) -> None:
    """Refuse, naming them, ranks bound to one GPU (``EnvConflict``, exit 2), before NCCL starts: NCCL refuses a
    shared device with an error that names no rank ("Duplicate GPU detected"), and other backends would share it
    silently. Every rank posts its GPU to the store and reads everyone's, so every rank stops with the same words."""
    name, uuid = device_identity(device)
    store.set(f"gpu/{info.rank}", json.dumps([socket.gethostname(), uuid or name]))
    keys = [f"gpu/{r}" for r in range(info.world_size)]
    store.wait(keys, timeout)
    claims = [(r, *json.loads(store.get(k))) for r, k in enumerate(keys)]
    shared = shared_gpus(claims)
    if shared:
        import torch

        raise EnvConflict("; ".join(shared), "one GPU per rank (NCCL refuses two ranks on one device)",
                          f"start at most {torch.cuda.device_count()} rank(s) per node (the GPUs it shows), give "
                          "each rank its own GPU (CUDA_VISIBLE_DEVICES), or pass --backend gloo to run on CPU")


def open_store(info: WorldInfo, timeout: timedelta) -> dist.Store:
    """Rank 0's TCPStore (or a client of it). Under torch elastic the agent already hosts it."""
    import torch.distributed as dist

    use_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(host, port, world_size=None if use_agent else info.world_size,
                          is_master=info.rank == 0 and not use_agent, timeout=timeout,
                          wait_for_workers=False, multi_tenant=False)
    prefix = f"ddpkit/{info.run_id or 'run'}/{info.restart_count or 0}/"
    return dist.PrefixStore(prefix, store)


def init(
    *,
    backend: str | None = None,
    timeout: timedelta = DEFAULT_TIMEOUT,
    store: dist.Store | None = None,
    world: WorldInfo | None = None,
    watch: bool | WatchOptions = False,
) -> Runtime:
    """Start the default process group from whatever launcher started this process.

    Picks NCCL when CUDA devices are present, else gloo (``backend`` or DDPKIT_BACKEND override), binds the
    device from the local rank, and initialises with ``timeout`` so a missing rank fails instead of hanging.
    ``watch`` (True or ``WatchOptions``) watches this rank from the moment the group exists: a hung or slow rank
    named live, with its host and every rank's stack (``ddpkit.watch``, docs/watch.md).
    """
    import torch.distributed as dist

    if watch:
        from ddpkit.watch import install

        install(watch if not isinstance(watch, bool) else None)
    info = export_world(world or detect())
    chosen = pick_backend(backend)
    device = pick_device(chosen, info.local_rank)
    if dist.is_initialized():
        return Runtime(world=info, backend=dist.get_backend(), device=device, interface=_interface)
    kwargs: dict[str, object] = {"backend": chosen, "timeout": timeout, "rank": info.rank,
                                 "world_size": info.world_size}
    if not info.local_world_known and info.world_size > 1:
        store = store if store is not None else open_store(info, timeout)
        info = count_local_world(store, info, timeout)
    if device.type == "cuda" and info.world_size > 1:
        store = store if store is not None else open_store(info, timeout)
        claim_gpu(store, info, device, timeout)
    if store is not None:
        kwargs["store"] = dist.PrefixStore("pg/", store)
    else:
        kwargs["init_method"] = "env://"
    if device.type == "cuda":
        kwargs["device_id"] = device
    dist.init_process_group(**kwargs)  # type: ignore[arg-type]
    log.info("process group up: backend %s, rank %d/%d, device %s", chosen, info.rank, info.world_size, device)
    return Runtime(world=info, backend=chosen, device=device, interface=_interface)


def shutdown() -> None:
    """Tear the process group down; safe to call when none was started."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
