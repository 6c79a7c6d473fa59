"""Start local ranks through torch's own elastic launcher, for worker commands run where no launcher is.

``ddpkit check -n 4`` becomes four ``python -m ddpkit check -n 4`` workers under torch's elastic agent
(standalone c10d rendezvous on a free port); each worker then sees torchrun's variables and does the work.
``-j 2x4 --rdzv-endpoint HOST:PORT`` joins a multi-node c10d rendezvous, one agent per node, as torchrun does.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import uuid
from dataclasses import dataclass

from ddpkit.env import thread_count
from ddpkit.errors import EXIT_PREEMPTED, ConfigError, DeadlineExpired
from ddpkit.log import get_logger
from ddpkit.rendezvous import RendezvousWatch, describe_missing

__all__ = ["JobShape", "LaunchOptions", "die_with_agent", "launch", "parse_job_shape"]

log = get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class JobShape:
    """``[MIN:]NNODESxNPROC`` as in TorchX: nodes (elastic between min and max) and processes per node."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: int

    def __str__(self) -> str:
        nodes = f"{self.min_nodes}:{self.max_nodes}" if self.min_nodes != self.max_nodes else str(self.max_nodes)
        return f"{nodes}x{self.nproc_per_node}"


_SHAPE = re.compile(r"^(?:(?P<min>\d+):)?(?P<nodes>\d+)x(?P<nproc>\d+)$")


def parse_job_shape(text: str) -> JobShape:
    """Parse ``NPROC``, ``NNODESxNPROC`` or ``MIN:MAXxNPROC``; bad shapes are a ConfigError (exit code 2)."""
    text = text.strip()
    if text.isdigit():
        text = f"1x{text}"
    m = _SHAPE.match(text)
    if m is None:
        raise ConfigError(f"job shape {text!r} is not understood", "NNODESxNPROC such as 2x4, or MIN:MAXxNPROC "
                          "such as 1:2x4", "write -j 1x2 for one node with two ranks")
    nodes, nproc = int(m["nodes"]), int(m["nproc"])
    low = int(m["min"]) if m["min"] else nodes
    if nodes < 1 or nproc < 1 or low < 1:
        raise ConfigError(f"job shape {text!r} asks for zero nodes or processes", "at least 1x1",
                          "give a positive number of nodes and processes per node")
    if low > nodes:
        raise ConfigError(f"job shape {text!r} has a minimum above its maximum", "MIN <= MAX",
                          f"write {nodes}:{low}x{nproc}")
    return JobShape(min_nodes=low, max_nodes=nodes, nproc_per_node=nproc)


@dataclass(frozen=True, kw_only=True)
class LaunchOptions:
    shape: JobShape
    """Nodes and processes per node."""
    rdzv_endpoint: str | None = None
    """HOST:PORT of the c10d rendezvous; None for a standalone single-node run on a free port."""
    rdzv_backend: str = "c10d"
    """Rendezvous backend: c10d, etcd-v2, etcd or static."""
    rdzv_conf: tuple[tuple[str, str], ...] = ()
    """Extra rendezvous settings (is_host, last_call_timeout, ...)."""
    run_id: str | None = None
    """Rendezvous id shared by every node's agent; random for standalone runs."""
    max_restarts: int = 0
    """Worker-group restarts the agent allows after a failure."""
    local_addr: str | None = None
    """This node's address as the other nodes reach it."""
    rdzv_timeout: int = 120
    """Seconds to wait for all nodes to join."""
    preload: tuple[str, ...] = ()
    """Modules the agent imports once and its workers inherit by fork (``ddpkit check`` preloads torch._dynamo,
    which DistributedDataParallel imports at 1.5-2.5 s per worker). Empty, or DDPKIT_START_METHOD=spawn: every
    worker is a fresh ``python -m ddpkit`` process."""


def launch(argv: list[str], options: LaunchOptions) -> int:
    """Run ``python -m ddpkit ARGV`` on this node's ranks; return the exit code of the first failed rank, or 0."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    shape = options.shape
    threads, message = thread_count(shape.nproc_per_node)
    if threads is not None and shape.nproc_per_node > 1:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        log.warning(message)
    # The agent's shared rendezvous store keeps a failed attempt's addresses, so restarted workers cannot
    # connect (pytorch/pytorch#135712); a store per attempt makes restarts reliable.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ["DDPKIT_LAUNCHED"] = "1"  # tells the workers their -n/-j were already honoured
    # The agent forwards these to the workers (and stops them) instead of dying and orphaning them; USR1/USR2
    # are what Slurm's --signal sends before a preemption, so the workers can snapshot first.
    os.environ.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2")
    mark_dir = tempfile.mkdtemp(prefix="ddpkit-launch-")
    mark = os.path.join(mark_dir, "preempted")
    os.environ["DDPKIT_PREEMPTED_MARK"] = mark  # a worker that stopped cleanly after a preemption creates it
    results = os.path.join(mark_dir, "results")
    os.mkdir(results)
    os.environ[RESULT_DIR] = results  # where verdict commands' workers leave their exit code (verdict_exit_code)
    endpoint = options.rdzv_endpoint
    conf: dict[str, object] = dict(options.rdzv_conf)
    local_addr = options.local_addr
    if endpoint is None:  # standalone
        conf.setdefault("is_host", True)
    else:
        local_addr = local_addr or _local_addr_towards(endpoint)
        if options.rdzv_backend == "c10d" and "is_host" not in conf and _hosts_endpoint(endpoint):
            conf["is_host"] = True
    # torch's dynamic rendezvous reads join_timeout (default 600 s), not LaunchConfig.rdzv_timeout
    conf.setdefault("join_timeout", options.rdzv_timeout)
    # Fork is safe here: the agent has not touched CUDA, and the preloaded modules start no threads.
    forked = bool(options.preload) and os.environ.get("DDPKIT_START_METHOD", "fork") == "fork"
    for name in options.preload if forked else ():
        importlib.import_module(name)
    if forked and _cuda_initialized():  # a forked child cannot use a CUDA context its parent created
        log.warning("CUDA was initialised while preloading %s: starting fresh rank processes instead",
                    ", ".join(options.preload))
        forked = False
    if forked:
        logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_drop_exit_tracebacks)
    config = LaunchConfig(
        min_nodes=shape.min_nodes,
        max_nodes=shape.max_nodes,
        nproc_per_node=shape.nproc_per_node,
        run_id=options.run_id or f"ddpkit-{uuid.uuid4().hex[:12]}",
        rdzv_endpoint=endpoint or "127.0.0.1:0",
        rdzv_backend=options.rdzv_backend,
        rdzv_configs=conf,
        rdzv_timeout=options.rdzv_timeout,
        max_restarts=options.max_restarts,
        monitor_interval=0.1,
        start_method="fork" if forked else "spawn",
        local_addr=local_addr,
    )
    watch = RendezvousWatch(endpoint, config.run_id) if endpoint and options.rdzv_backend == "c10d" else None
    try:
        with watch or contextlib.nullcontext():
            if forked:
                elastic_launch(config, entrypoint=_forked_worker)(argv)
            else:
                elastic_launch(config, entrypoint=sys.executable)("-m", "ddpkit", *argv)
        code = _worker_result(results)
    except ChildFailedError as exc:
        return _root_cause(exc)
    except SignalException as exc:
        preempted = os.path.exists(mark)
        log.warning("received %s: the workers were stopped%s", exc.sigval.name,
                    " after saving their state" if preempted else "")
        return EXIT_PREEMPTED if preempted else 128 + int(exc.sigval)
    except RendezvousError as exc:
        who = f"; {describe_missing(watch.nodes, shape.min_nodes, shape.max_nodes, shape.nproc_per_node)}" \
            if watch is not None else ""
        raise DeadlineExpired(f"the rendezvous at {config.rdzv_endpoint} did not complete within "
                              f"{conf['join_timeout']} s{who} ({type(exc).__name__}{f': {exc}' if str(exc) else ''})",
                              f"{shape} node agents (NODESxRANKS) to join",
                              "start ddpkit on every node with the same --rdzv-endpoint, --run-id and -j, check "
                              "each can reach the endpoint, or give them longer with --timeout") from None
    finally:
        os.environ.pop(RESULT_DIR, None)  # this agent's own exit code is not a worker's result
        shutil.rmtree(mark_dir, ignore_errors=True)
    return code


RESULT_DIR = "DDPKIT_RESULT_DIR"


def verdict_exit_code(code: int) -> int:
    """The exit code for a worker of ddpkit's launcher whose verdict command (check, bench, env) returned ``code``.

    The verdict is left in a file for the agent and the worker exits 0. torch's agent waits for the other nodes'
    agents (its exit barrier) only when its workers succeeded: on a failure the node hosting the rendezvous store
    left at once, and the other nodes, still finishing, lost the store, had their workers stopped and reported a
    rendezvous error instead of their verdict. A verdict is no reason to restart the group either. train keeps the
    failure path: there a non-zero code (a peer is gone) must make the group restart.
    """
    directory = os.environ.get(RESULT_DIR)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if code == EXIT_PREEMPTED or not directory or attempt is None or not attempt.isdigit():
        return code
    name = f"{int(attempt):06d}.rank-{os.environ.get('RANK', '0')}"
    tmp = os.path.join(directory, f".{name}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(str(code))
        os.replace(tmp, os.path.join(directory, name))
    except OSError:
        return code
    return 0


def _worker_result(directory: str) -> int:
    """The verdict the workers of the last attempt left: the lowest rank's non-zero code, or 0."""
    try:
        names = [n for n in os.listdir(directory) if not n.startswith(".")]
    except OSError:
        return 0
    if not names:
        return 0
    last = max(n.split(".")[0] for n in names)
    codes = []
    for name in (n for n in names if n.startswith(last + ".")):
        with open(os.path.join(directory, name)) as f:
            codes.append((int(name.split("rank-")[1]), int(f.read().strip() or 1)))
    return next((code for _, code in sorted(codes) if code), 0)


def _cuda_initialized() -> bool:
    import torch

    return bool(torch.cuda.is_initialized())


def die_with_agent() -> None:
    """In a worker of ddpkit's launcher: have the kernel SIGKILL this process when its agent dies.

    torch starts workers in their own session, so a killed agent (SIGKILL, out of memory, a lost host) leaves
    them running: they hold ports and GPU memory, and keep the other hosts' ranks in a collective that no
    restart can join. Linux only (prctl PR_SET_PDEATHSIG); elsewhere nothing changes.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
        log.debug("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
        return
    if parent == 1 or os.getppid() != parent:  # the agent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


def _endpoint_host(endpoint: str) -> str:
    host, _, port = endpoint.rpartition(":")
    return (host if port.isdigit() else endpoint).strip("[]")


def _local_addr_towards(endpoint: str) -> str | None:
    """This node's address on the interface that routes to the rendezvous host: the address the other nodes
    (and this node's workers, as MASTER_ADDR when it is node 0) use for it. None (torch's default, the
    hostname) where no route is found or the endpoint is loopback."""
    from ddpkit.netinfo import route_to

    host = _endpoint_host(endpoint)
    try:
        ifname, local_ip = route_to(host)
    except OSError as exc:
        log.warning("no route to the rendezvous host %s (%s): the other nodes will be told this host's name, %s",
                    host, exc, socket.gethostname())
        return None
    if ifname == "lo":
        return None
    log.info("local address %s (on %s): it routes to the rendezvous host %s", local_ip, ifname, host)
    return local_ip


def _hosts_endpoint(endpoint: str) -> bool:
    """True when the c10d rendezvous endpoint is one of this host's own addresses, so this agent must host the
    rendezvous store. torch decides that from the hostname's addresses only, which miss the interface addresses
    where the hostname resolves to 127.0.1.1: then no agent hosts the store and every agent times out."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    from ddpkit.netinfo import is_local_address, resolve

    host = _endpoint_host(endpoint)
    try:
        address = resolve(host)
    except OSError:
        return False
    if _matches_machine_hostname(host) or not is_local_address(address):
        return False  # torch finds it by itself (loopback, the hostname), or another host serves it
    port = int(endpoint.rpartition(":")[2]) if endpoint.rpartition(":")[2].isdigit() else 29400
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store does: TIME_WAIT is no owner
        try:
            s.bind((address, port))
        except OSError:  # another agent on this host serves it already
            return False
    log.warning("hosting the rendezvous store: %s is this host's own address (is_host=true; pass "
                "--rdzv-conf is_host=false to leave it to another process)", host)
    return True


def _drop_exit_tracebacks(record: logging.LogRecord) -> bool:
    """Forked ranks that exit non-zero make torch log a traceback of its own join(); ``_root_cause`` says it in
    one line, so the traceback (not the user's problem, and not ddpkit's) is dropped."""
    exc = record.exc_info[1] if record.exc_info else None
    return type(exc).__name__ != "ProcessExitedException"


def _forked_worker(argv: list[str]) -> None:
    """A forked worker runs the CLI as ``python -m ddpkit ARGV`` would, and exits with its code."""
    from ddpkit import cli
    from ddpkit import log as ddpkit_log

    # The agent configured logging before its rank existed; configure afresh so lines carry this rank.
    for handler in list(logging.getLogger("ddpkit").handlers):
        logging.getLogger("ddpkit").removeHandler(handler)
    ddpkit_log._configured = False
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit():  # the agent's torch sized its thread pool before the variable was set
        import torch

        torch.set_num_threads(int(threads))
    code = cli.main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        sys.exit(code)


def _root_cause(exc: object) -> int:
    """The first failure (by time) names the root cause: rank, pid and exit code; its code becomes ours."""
    failures = getattr(exc, "failures", {})
    if not failures:
        return 1
    # Timestamps have one-second resolution; within a second, a rank that exited on its own comes before one
    # the agent then stopped with a signal (SIGTERM is what the survivors of a failure receive).
    rank, first = min(failures.items(), key=lambda kv: (kv[1].timestamp, kv[1].exitcode < 0, kv[0]))
    code = int(first.exitcode)
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
        log.error("rank %d (pid %d) was killed by %s first", rank, first.pid, name)
        return 128 - code
    if code == EXIT_PREEMPTED and all(f.exitcode in (EXIT_PREEMPTED, -signal.SIGTERM) for f in failures.values()):
        log.warning("the workers stopped after a preemption signal and wrote a snapshot (exit %d): run the same "
                    "command again to resume", code)
        return code
    others = sorted(r for r in failures if r != rank)
    log.error("rank %d (pid %d) failed first with exit code %d%s", rank, first.pid, code,
              f"; then ranks {others}" if others else "")
    return code
