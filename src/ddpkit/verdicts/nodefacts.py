"""What a node is made of, read once per node at the roll-call: cores, memory, NUMA, kernel, the interface that
routes to the master, and the GPUs (no torch import).

psutil reads cores, memory and each interface's link speed and MTU (portable beyond Linux); the interface's driver
and the NUMA nodes come from sysfs where it exists. GPU facts come from NVML through ``nvidia-ml-py`` (the ``gpu``
extra), the library nvidia-smi and DCGM are built on; without it, or without a driver, ``gpus`` is None and
``gpu_source`` says why. Every value is JSON-ready::

    >>> sorted(gather(master="127.0.0.1"))[:4]
    ['cores', 'gpu_source', 'gpus', 'kernel']
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

from ddpkit.base.fault_injection import fault
from ddpkit.base.netinfo import route_to

__all__ = ["gather", "gpu_facts", "nic_facts"]

Facts = dict[str, Any]


def gather(*, master: str | None, rank: int = 0) -> Facts:
    """This node's facts; ``master`` picks the interface reported (the one that routes to it)."""
    import psutil

    try:
        cores = len(os.sched_getaffinity(0))  # what this process may use (a cgroup or taskset narrows it)
    except AttributeError:  # not Linux
        cores = psutil.cpu_count() or 0
    facts: Facts = {
        "cores": cores,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "numa_nodes": _numa_nodes(),
        "kernel": platform.release(),
        "os": platform.system(),
        "nic": nic_facts(master),
    }
    facts["gpus"], facts["gpu_source"] = gpu_facts()
    forged = fault("facts", rank=rank)  # test hook: pretend this node's NIC runs another MTU or speed
    if forged and facts["nic"] is not None:
        facts["nic"].update({k: int(v) for k, v in forged.items() if k in ("mtu", "speed_mbps")})
    return facts


def _numa_nodes() -> int | None:
    nodes = Path("/sys/devices/system/node")
    if not nodes.is_dir():
        return None
    return sum(1 for p in nodes.iterdir() if p.name.startswith("node") and p.name[4:].isdigit()) or None


def nic_facts(master: str | None) -> dict[str, Any] | None:
    """The interface that routes to ``master``: name, link speed (Mb/s; 0 where the driver reports none, as
    virtual devices do), MTU, driver (sysfs; None for a virtual device). None when no route is found."""
    import psutil

    try:
        name, _ = route_to(master or "127.0.0.1")
    except OSError:
        return None
    if name is None:
        return None
    stats = psutil.net_if_stats().get(name)
    driver = None
    link = Path("/sys/class/net") / name / "device" / "driver"
    if link.exists():
        driver = os.path.basename(os.path.realpath(link))
    return {"name": name, "speed_mbps": stats.speed if stats else None, "mtu": stats.mtu if stats else None,
            "up": stats.isup if stats else None, "driver": driver}


def gpu_facts() -> tuple[list[dict[str, Any]] | None, str]:
    """Each GPU NVML sees (model, driver, CUDA, PCIe generation and width current/max, ECC and retired pages),
    and where the figures came from; ``(None, why)`` without NVML."""
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None, "no NVML bindings (pip install 'ddpkit[gpu]' for GPU facts)"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return None, f"NVML unavailable: {exc}"
    try:
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        cuda = _optional(pynvml.nvmlSystemGetCudaDriverVersion_v2)
        cuda_text = f"{cuda // 1000}.{cuda % 1000 // 10}" if isinstance(cuda, int) else None
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            gpus.append({
                "index": i, "model": _text(pynvml.nvmlDeviceGetName(h)), "uuid": _text(pynvml.nvmlDeviceGetUUID(h)),
                "driver": driver, "cuda_driver": cuda_text,
                "pcie_gen": _optional(pynvml.nvmlDeviceGetCurrPcieLinkGeneration, h),
                "pcie_gen_max": _optional(pynvml.nvmlDeviceGetMaxPcieLinkGeneration, h),
                "pcie_width": _optional(pynvml.nvmlDeviceGetCurrPcieLinkWidth, h),
                "pcie_width_max": _optional(pynvml.nvmlDeviceGetMaxPcieLinkWidth, h),
                # volatile: since the driver loaded; uncorrected errors make results wrong
                "ecc_uncorrected": _optional(pynvml.nvmlDeviceGetTotalEccErrors, h,
                                             pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC),
                "retired_pages": _retired_pages(pynvml, h),
                "remapped_rows_failed": _remap_failed(pynvml, h),
            })
        return gpus, f"NVML (driver {driver})"
    except pynvml.NVMLError as exc:  # a GPU fallen off the bus answers the basic queries with errors
        return None, f"NVML error: {exc}"
    finally:
        pynvml.nvmlShutdown()


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _optional(call: Any, *args: Any) -> Any:
    """NVML answers NotSupported for what a GPU lacks (ECC on consumer cards, page retirement on H100): None."""
    import pynvml

    try:
        return call(*args)
    except pynvml.NVMLError:
        return None


def _retired_pages(pynvml: Any, h: Any) -> int | None:
    total = 0
    for cause in (pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
                  pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR):
        pages = _optional(pynvml.nvmlDeviceGetRetiredPages, h, cause)
        if pages is None:
            return None
        total += len(pages)
    return total


def _remap_failed(pynvml: Any, h: Any) -> bool | None:
    """Row remapping (A100 and later replace page retirement with it): True when a remap failed."""
    rows = _optional(pynvml.nvmlDeviceGetRemappedRows, h)  # (corrected, uncorrected, pending, failure)
    return bool(rows[3]) if rows else None
