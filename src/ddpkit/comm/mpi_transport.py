"""Gradients averaged through MPI: the transport ``mpi`` of ``comm/gradients.py``, and the checks before it is used.

PyTorch's wheels have no MPI backend (``torch.distributed.is_mpi_available()`` is False), so MPI reaches DDP here
as a communication hook: each gradient bucket's flat CPU buffer is handed to ``MPI.Allreduce`` in place, through a
zero-copy numpy view. The process group (gloo) stays for everything else: broadcasts, barriers, snapshots.

Why: on CPU a DDP step of a small model is bound by the collective's latency, and MPI's shared-memory and fabric
transports are far quicker than gloo's TCP (measured on 2 ranks here: 1.6 us against 1.3-2.4 ms for a small
all-reduce; benchmarks/results/bench_mpi.md).

mpi4py is imported lazily (the ``ddpkit[mpi]`` extra), only once this process is known to be one rank of an MPI
launch: a process that no MPI launcher started would initialise a world of its own (a singleton), and the sums
would silently stay local. Then the MPI world must be torch's world, rank for rank (``open_mpi_world``).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ddpkit.base.errors import ConfigError, EnvConflict, first_line
from ddpkit.base.log import get_logger
from ddpkit.env.mpi import mpi_launcher

__all__ = ["MPI_DTYPES", "check_mpi_usable", "mpi_allreduce_sum", "mpi_comm", "mpi_library", "open_mpi_world"]

log = get_logger(__name__)

#: Gradient element types MPI sums here (numpy views; MPI has no standard half-precision sum).
MPI_DTYPES = (torch.float32, torch.float64)
INSTALL_HINT = "pip install 'ddpkit[mpi]' (mpi4py; it uses the system's MPI library, e.g. Debian's libopenmpi-dev)"
LAUNCH_HINT = ("start the ranks with mpirun -np N (Open MPI), mpiexec -n N (MPICH) or srun --mpi=pmix, "
               "or use --grad-transport gloo")

_comm: Any = None  # the checked world communicator, once open_mpi_world succeeded


def mpi4py_installed() -> bool:
    return importlib.util.find_spec("mpi4py") is not None


def library_name() -> str:
    """The MPI library's first line, e.g. ``Open MPI v4.1.4, package: ...`` (Open MPI ends it with a NUL byte,
    which would reach the terminal and files)."""
    from mpi4py import MPI

    return MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip()


def check_mpi_usable(option: str, environ: Mapping[str, str] | None = None) -> str:
    """The MPI launcher kind of this process; ConfigError (exit 2) when none started it or mpi4py is missing."""
    environ = os.environ if environ is None else environ
    launcher = mpi_launcher(environ)
    if launcher is None:
        raise ConfigError(f"{option}: this process was not started by an MPI launcher (no OMPI_COMM_WORLD_RANK, "
                          "PMIX_RANK or PMI_RANK)", "ranks started by mpirun, mpiexec or srun --mpi=pmix",
                          LAUNCH_HINT)
    if not mpi4py_installed():
        raise ConfigError(f"{option}: mpi4py is not installed in this Python ({launcher} started the ranks)",
                          "mpi4py, the Python binding of the system's MPI", INSTALL_HINT)
    return launcher


def mpi_library(launcher: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The libmpi mpi4py should load for ``launcher`` where the user chose none, or None for mpi4py's own choice.

    Under MPICH's Hydra: ``libmpi.so.12`` where the dynamic linker finds one. mpi4py's wheel loads ``libmpi.so``
    first, on Debian Open MPI's, which under Hydra makes every rank a world of one; its MPICH module needs
    ``libmpi.so.12``, which Debian's MPICH names ``libmpich.so.12`` (hence MPICH_HINT). A user's MPI4PY_LIBMPI or
    MPI4PY_MPIABI is respected.
    """
    environ = os.environ if environ is None else environ
    if launcher != "mpich" or "MPI4PY_LIBMPI" in environ or "MPI4PY_MPIABI" in environ:
        return None
    try:
        ctypes.CDLL("libmpi.so.12")
    except OSError:
        return None
    return "libmpi.so.12"


#: How to give mpi4py's MPICH module the library it links (libmpi.so.12) on Debian, where MPICH's is libmpich.so.12.
MPICH_HINT = ("under MPICH's mpiexec, mpi4py needs libmpi.so.12: on Debian make a directory with a link "
              "libmpi.so.12 -> /usr/lib/x86_64-linux-gnu/libmpich.so.12 and run mpiexec -genv LD_LIBRARY_PATH DIR "
              "(or set MPI4PY_LIBMPI to your MPICH's libmpi.so.12)")


def open_mpi_world(rank: int, world_size: int, *, option: str = "--grad-transport mpi",
                   tolerate_singleton: bool = False) -> Any:
    """Initialise MPI (once) and return COMM_WORLD after checking it is torch's world: same size, same rank.

    EnvConflict (exit 2) otherwise, before any process group starts: each rank sees the mismatch by itself.
    With ``tolerate_singleton`` (``--grad-transport auto``), a world of one (the library of another MPI than the
    launcher's: every rank sees the same) returns None with a warning instead.
    """
    global _comm
    if _comm is not None:
        return _comm
    launcher = check_mpi_usable(option)
    library = mpi_library(launcher)
    if library is not None:
        # mpi4py reads this when it loads; logged, not silent (the user's own setting is never overridden)
        os.environ["MPI4PY_LIBMPI"] = library
        if rank == 0:
            log.info("started by MPICH's Hydra: mpi4py loads %s (MPI4PY_LIBMPI)", library)
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError) as exc:  # RuntimeError: mpi4py found no libmpi to load
        raise ConfigError(f"{option}: mpi4py cannot load an MPI library ({first_line(exc)[:200]})",
                          "a system MPI library that mpi4py can load",
                          "install Open MPI or MPICH (Debian: libopenmpi-dev or libmpich-dev), or set "
                          "MPI4PY_LIBMPI to the libmpi.so of the MPI that starts the ranks") from None
    comm = MPI.COMM_WORLD
    mpi_rank, mpi_size = comm.Get_rank(), comm.Get_size()
    if (mpi_rank, mpi_size) != (rank, world_size) and tolerate_singleton and mpi_size == 1:
        if rank == 0:
            log.warning("%s: mpi4py's MPI sees a world of 1 rank, torch's has %d (another MPI's library?): "
                        "gradients go through the process group", option, world_size)
        return None
    if (mpi_rank, mpi_size) != (rank, world_size):
        if "SLURM_STEP_ID" in os.environ:
            hint = "srun --mpi=pmix for Open MPI, srun --mpi=pmi2 for MPICH"
        elif launcher == "mpich":
            hint = MPICH_HINT
        else:
            hint = "the MPI library of the launcher that started the ranks (MPI4PY_LIBMPI=libmpi.so.40 for Open MPI)"
        raise EnvConflict(
            f"{option}: the MPI world (rank {mpi_rank} of {mpi_size}, {library_name()})"
            f" is not torch's world (rank {rank} of {world_size}, from the {launcher} launcher's variables)",
            "one MPI world with the same ranks as torch's", f"use {hint}; or --grad-transport gloo")
    _comm = comm
    return comm


def mpi_comm() -> Any:
    """The world communicator checked by ``open_mpi_world`` (which must have run)."""
    if _comm is None:
        raise RuntimeError("open_mpi_world() has not run in this process")
    return _comm


def mpi_allreduce_sum(world_size: int) -> Callable[..., torch.futures.Future[torch.Tensor]]:
    """The ``mpi`` transport: ``MPI.Allreduce`` in place on the tensor's numpy view; a completed Future.

    Synchronous: MPI's small-message latency is microseconds, and DDP calls the hook for each bucket in the same
    order on every rank. On 2 ranks each element is a + b, as in gloo's all-reduce, so the result is bitwise equal.
    """
    from mpi4py import MPI

    comm = mpi_comm()
    if comm.Get_size() != world_size:
        raise RuntimeError(f"MPI world of {comm.Get_size()} ranks, not {world_size}")

    # torch.futures.Future's Python __init__ (device list handling) costs about as much as a small MPI all-reduce;
    # its C++ base (torch >= 1.6), which DDP takes as is, does not; CPU tensors need no devices
    no_devices: list[torch.device] = []

    def total(tensor: torch.Tensor, then: Callable[[torch.Tensor], torch.Tensor]) -> torch.futures.Future[torch.Tensor]:
        comm.Allreduce(MPI.IN_PLACE, tensor.numpy())  # the view shares the tensor's memory: no copy
        fut: torch.futures.Future[torch.Tensor] = torch._C.Future(no_devices)  # type: ignore[assignment]
        fut.set_result(then(tensor))
        return fut

    return total
