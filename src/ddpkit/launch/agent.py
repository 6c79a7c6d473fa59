"""The agent side of ddpkit's launcher: torch's elastic agent started for one node's ranks.

``launch(options, entrypoint, argv)`` mirrors torch's ``elastic_launch(config, entrypoint)(*args)``: the caller
says what each worker runs (``ddpkit.cli`` passes its own ``main``), so nothing here imports the CLI back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ddpkit.base.errors import EXIT_PREEMPTED, EXIT_PREEMPTED_UNSAVED, DeadlineExpired
from ddpkit.base.log import get_logger
from ddpkit.base.shape import JobShape
from ddpkit.launch import worker
from ddpkit.launch.addresses import hosts_endpoint, local_addr_towards
from ddpkit.launch.failure import (
    TORCH_WORKER_LOGGER,
    drop_exit_tracebacks,
    quiet_late_rendezvous_close,
    rank_failures,
    root_cause_line,
)
from ddpkit.launch.rendezvous import RendezvousWatch, describe_missing
from ddpkit.launch.result import AttemptResult, abort_orders
from ddpkit.launch.stops import FORWARDED, LostPeerBackstop, handle_outside_signals, lost_reports, own_stops_marked
from ddpkit.runtime import share_cores

if TYPE_CHECKING:
    from ddpkit.launch.ranklogs import RankLogs

__all__ = ["Entrypoint", "LaunchOptions", "launch", "preload"]

log = get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class Entrypoint:
    """What every worker runs, in the two ways a worker can start."""

    main: Callable[[list[str]], int]
    """Called with the argv in a worker forked from the agent (which inherits the preloaded modules)."""
    module: str
    """Run as ``python -m MODULE ARGV`` in a fresh worker process."""


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
    store_timeout: int | None = None
    """Seconds one read of the rendezvous store may block (torch's read_timeout, default 60): how long a lost
    link may last before this agent gives the store up (and, with restarts left, how long the link has to
    return for the restart)."""
    preload: tuple[str, ...] = ()
    """Modules the agent imports once and its workers inherit by fork (``ddpkit check`` preloads torch._dynamo,
    which DistributedDataParallel imports at 1.5-2.5 s per worker). Empty, or DDPKIT_START_METHOD=spawn: every
    worker is a fresh ``python -m MODULE`` process."""
    rank_logs: bool | None = None
    """Each rank's stdout and stderr in files of the run's log directory, echoed as ``[host:rank] line``, and a
    failed attempt said in one screen (``ddpkit.launch.ranklogs``). None: for ``ddpkit run`` (a user's script,
    whose ranks share the screen), not for ddpkit's own commands (their reports are written for a terminal: check's
    tables, train's progress bar, and they prefix their own log lines)."""
    log_dir: str | None = None
    """The run's log directory with ``rank_logs``; None: a new ``$TMPDIR/ddpkit-run-XXXX``, removed when the run
    succeeds, kept and named when it fails."""
    rendezvous_guard: Callable[[Any, str], Any] | None = None
    """Wraps this node's rendezvous handler: called with torch's ``RendezvousHandler`` and the name the wrapper's
    ``get_backend()`` must return; torch's agent uses what it returns (``ddpkit.heal.elastic`` keeps excluded hosts
    out of later rounds). None: torch's handler as it is."""


def launch(options: LaunchOptions, entrypoint: Entrypoint, argv: list[str]) -> AttemptResult:
    """Run ``entrypoint`` with ``argv`` on this node's ranks; how it ended, as values (``launch.result``, as torch
    elastic's ``RunResult``): the exit code (the first failed rank's, or 0), torch's typed per-rank failures, a
    signal from outside, the watch's abort orders."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    shape = options.shape
    share_cores(shape.nproc_per_node, announce=True)  # before the workers start: they inherit it
    # The agent's shared rendezvous store keeps a failed attempt's addresses, so restarted workers cannot
    # connect (pytorch/pytorch#135712); a store per attempt makes restarts reliable.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ[worker.LAUNCHED] = "1"
    os.environ[worker.LAUNCHED_AT] = str(worker.process_started_at())
    mark_dir = tempfile.mkdtemp(prefix="ddpkit-launch-")
    stop_dir = os.path.join(mark_dir, "stops")
    os.mkdir(stop_dir)
    os.environ[worker.STOP_DIR] = stop_dir
    # The agent forwards these to the workers (and stops them) instead of dying and orphaning them; USR1/USR2
    # are what Slurm's --signal sends before a preemption, so the workers can snapshot first. ddpkit handles
    # those it forwards itself, to mark them as coming from outside the job (ddpkit.launch.stops); torch keeps
    # the rest (it re-registers its handler for each name in LaunchConfig.signals_to_handle, which it copies to
    # TORCHELASTIC_SIGNALS_TO_HANDLE, whenever it starts workers: torch/distributed/launcher/api.py).
    wanted = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", ",".join(("SIGINT", *FORWARDED))).split(",")
    wanted = [name.strip() for name in wanted if name.strip()]
    torch_signals = ",".join(n for n in wanted if n not in FORWARDED) or "SIGINT"
    handle_outside_signals(stop_dir, [n for n in wanted if n in FORWARDED], _forward)
    mark = os.path.join(mark_dir, "preempted")
    os.environ[worker.PREEMPTED_MARK] = mark
    results = os.path.join(mark_dir, "results")
    os.mkdir(results)
    os.environ[worker.RESULT_DIR] = results
    endpoint = options.rdzv_endpoint
    conf: dict[str, object] = dict(options.rdzv_conf)
    local_addr = options.local_addr
    if endpoint is None:  # standalone
        conf.setdefault("is_host", True)
    else:
        local_addr = local_addr or local_addr_towards(endpoint)
        if options.rdzv_backend == "c10d" and "is_host" not in conf and hosts_endpoint(endpoint):
            conf["is_host"] = True
    # torch's dynamic rendezvous reads join_timeout (default 600 s), not LaunchConfig.rdzv_timeout
    conf.setdefault("join_timeout", options.rdzv_timeout)
    if options.store_timeout is not None:
        conf.setdefault("read_timeout", options.store_timeout)
    forked = preload(options.preload)
    ranks = _rank_logs(options, argv)
    if ranks:  # before ddpkit's own filters: those drop some of the lines that say the attempt is failing
        for name in _TORCH_FAILURE_LOGGERS:
            logging.getLogger(name).addFilter(ranks.failure_seen)
    logging.getLogger(TORCH_WORKER_LOGGER).addFilter(drop_exit_tracebacks)
    logging.getLogger("torch.distributed.elastic.rendezvous.dynamic_rendezvous").addFilter(quiet_late_rendezvous_close)
    config = LaunchConfig(
        min_nodes=shape.min_nodes,
        max_nodes=shape.max_nodes,
        nproc_per_node=shape.nproc_per_node,
        run_id=options.run_id or f"ddpkit-{uuid.uuid4().hex[:12]}",
        rdzv_endpoint=endpoint or "127.0.0.1:0",
        rdzv_backend=_guarded(options.rdzv_backend, options.rendezvous_guard),
        rdzv_configs=conf,
        rdzv_timeout=options.rdzv_timeout,
        max_restarts=options.max_restarts,
        monitor_interval=0.05,
        start_method="fork" if forked else "spawn",
        local_addr=local_addr,
        signals_to_handle=torch_signals,
        logs_specs=ranks.specs if ranks else None,
    )
    watch = RendezvousWatch(endpoint, config.run_id) if endpoint and options.rdzv_backend == "c10d" else None
    backstop = LostPeerBackstop(stop_dir, cleanup=lambda: shutil.rmtree(mark_dir, ignore_errors=True))
    code = 1
    result = AttemptResult(exit_code=code)
    try:
        if endpoint and options.rdzv_backend == "c10d" and not _hosts_store(endpoint, conf):
            await_endpoint(endpoint, float(conf["join_timeout"]))  # type: ignore[arg-type]
        with watch or contextlib.nullcontext(), backstop, own_stops_marked(stop_dir), \
                ranks.started() if ranks else contextlib.nullcontext():
            if forked:
                elastic_launch(config, entrypoint=worker.forked_worker(entrypoint.main))(argv)
            else:
                elastic_launch(config, entrypoint=sys.executable)("-m", entrypoint.module, *argv)
        code = worker.read_verdict(results)
        result = AttemptResult(exit_code=code)
    except ChildFailedError as exc:
        failures = rank_failures(exc.failures)
        level, line, code = root_cause_line(failures)
        log.log(level, "%s", line)
        result = AttemptResult(exit_code=code, failures=failures)
        first = result.first
        if ranks and first is None and code in (EXIT_PREEMPTED, EXIT_PREEMPTED_UNSAVED):
            ranks.release()  # a preemption is no failure: the ranks' own lines say how they stopped
        elif ranks:
            ranks.say_failure(failures, None if first is None else first.rank)
    except SignalException as exc:
        left = _preempted_code(mark)
        log.warning("received %s from outside the job: the workers were stopped%s", exc.sigval.name,
                    {EXIT_PREEMPTED: " after saving their state", None: ""}.get(left, " with no snapshot to resume "
                                                                                "from: their progress is lost"))
        code = left if left is not None else 128 + int(exc.sigval)
        result = AttemptResult(exit_code=code, outside_signal=exc.sigval.name)
    except RendezvousError as exc:
        raise _rendezvous_failure(exc, watch, options, config.rdzv_endpoint, conf, lost_reports(stop_dir)) from None
    finally:
        os.environ.pop(worker.RESULT_DIR, None)  # this agent's own exit code is not a worker's result
        result = dataclasses.replace(result, watch_orders=abort_orders(stop_dir))  # before the stop directory goes
        shutil.rmtree(mark_dir, ignore_errors=True)
        if ranks:
            for name in _TORCH_FAILURE_LOGGERS:
                logging.getLogger(name).removeFilter(ranks.failure_seen)
            if code == 0 and options.log_dir is None:
                shutil.rmtree(ranks.directory, ignore_errors=True)
    return result


#: torch's loggers whose lines say that a worker failed and the others are being ended
_TORCH_FAILURE_LOGGERS = ("torch.multiprocessing.spawn", TORCH_WORKER_LOGGER)


def _rank_logs(options: LaunchOptions, argv: list[str]) -> RankLogs | None:
    """The run's per-rank logs and screen, where ``options.rank_logs`` asks for them (None: for ``ddpkit run``,
    the command argv names: its first word that is not an option)."""
    wanted = options.rank_logs
    if wanted is None:
        words = argv[:argv.index("--")] if "--" in argv else argv
        wanted = next((w for w in words if not w.startswith("-")), None) == "run"
    if not wanted:
        return None
    import socket

    from ddpkit.launch.ranklogs import RankLogs

    directory = options.log_dir or tempfile.mkdtemp(prefix="ddpkit-run-")
    os.makedirs(directory, exist_ok=True)
    return RankLogs(directory, socket.gethostname().split(".", 1)[0], sys.stdout, sys.stderr)


#: The prefix of a guarded backend's name in torch's rendezvous registry (``LaunchOptions.rendezvous_guard``).
_GUARDED = "ddpkit-guarded-"
_guards: dict[str, Callable[[Any, str], Any]] = {}


def _guarded(backend: str, guard: Callable[[Any, str], Any] | None) -> str:
    """The backend name the agent asks torch's registry for: ``backend`` itself, or (with a guard) a name registered
    for this process whose handler is ``guard(the backend's own handler)``: torch's registry is its extension point
    for rendezvous handlers (torch/distributed/elastic/rendezvous/registry.py)."""
    if guard is None:
        return backend
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    name = _GUARDED + backend
    _guards[name] = guard
    rendezvous_handler_registry.register(name, _create_guarded)  # the same creator every time: allowed again
    return name


def _create_guarded(params: Any) -> Any:
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

    inner = rendezvous_handler_registry.create_handler(RendezvousParameters(
        backend=params.backend.removeprefix(_GUARDED), endpoint=params.endpoint, run_id=params.run_id,
        min_nodes=params.min_nodes, max_nodes=params.max_nodes, local_addr=params.local_addr, **params.config))
    return _guards[params.backend](inner, params.backend)


def _hosts_store(endpoint: str, conf: dict[str, object]) -> bool:
    """Whether this agent's rendezvous hosts the c10d store: is_host as given, else torch's own rule (the endpoint
    names this machine's hostname)."""
    if "is_host" in conf:
        return str(conf["is_host"]).strip().lower() in ("1", "true", "yes", "y", "on")
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    return bool(_matches_machine_hostname(endpoint.rpartition(":")[0].strip("[]")))


def await_endpoint(endpoint: str, timeout: float, poll: float = 1.0) -> None:
    """Wait, in Python, until the rendezvous host resolves and its port accepts a connection, at most ``timeout``
    seconds; then torch's store connects at once. torch's own client retries inside C++ (a signal waits until it
    returns: 68 s after SIGTERM was seen here) and logs every retry with a page of C++ frames; here a name lookup
    runs in a thread joined with a timeout, so SIGTERM/SIGINT stop the wait within ``poll`` seconds, and one line
    says what is awaited, where, and until when. Raises DeadlineExpired (exit 3) at the deadline."""
    import socket
    import threading
    import time

    host, _, port_text = endpoint.rpartition(":")
    host, port = host.strip("[]"), int(port_text)
    deadline = time.monotonic() + timeout
    said = ""
    while True:
        found: list[object] = []

        def lookup(found: list[object] = found) -> None:
            try:
                found.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
            except OSError as exc:
                found.append(exc)

        threading.Thread(target=lookup, daemon=True, name="ddpkit-rdzv-lookup").start()
        patience = max(0.5, min(5.0, deadline - time.monotonic()))  # a lookup may block for 40 s and more
        waited = time.monotonic()
        while not found and time.monotonic() - waited < patience:
            time.sleep(0.02)
        result = found[0] if found else TimeoutError(f"the name lookup of {host} took over {patience:.1f} s")
        if not isinstance(result, Exception):
            for family, kind, proto, _, addr in result:  # type: ignore[attr-defined]
                try:
                    with socket.socket(family, kind, proto) as sock:
                        sock.settimeout(poll)
                        sock.connect(addr)
                    return
                except OSError as exc:
                    result = exc
        why = (f"{host} does not resolve ({result})" if not isinstance(result, ConnectionRefusedError | TimeoutError)
               or "lookup" in str(result) else f"nothing listens there yet ({result})")
        if why != said:
            until = time.strftime("%H:%M:%S", time.localtime(time.time() + deadline - time.monotonic()))
            log.warning("waiting for the rendezvous store at %s: %s; waiting until %s (join timeout %d s)",
                        endpoint, why, until, timeout)
            said = why
        if time.monotonic() >= deadline:
            raise DeadlineExpired(f"the rendezvous store at {endpoint} could not be reached within {timeout:.0f} s: "
                                  f"{why}", "the first node's agent listening at --rdzv-endpoint",
                                  "start ddpkit on the first node (it hosts the store), check the name and port "
                                  "from this host, or give it longer with --timeout")
        time.sleep(min(poll, max(0.0, deadline - time.monotonic())))


def _forward(sig: object) -> None:
    """Raise what torch's own handler raises, so its agent forwards the signal to the workers and stops them."""
    from torch.distributed.elastic.multiprocessing import SignalException

    raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)  # type: ignore[arg-type]


def _preempted_code(mark: str) -> int | None:
    """The code the workers left after a preemption (75 with a snapshot, 76 without); None: they left none."""
    try:
        with open(mark) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else EXIT_PREEMPTED


def _rendezvous_failure(exc: Exception, watch: RendezvousWatch | None, options: LaunchOptions, endpoint: str,
                        conf: dict[str, object], lost: list[str]) -> DeadlineExpired:
    """A join that timed out says who joined and who did not; a store lost after the job started says so, with
    what the workers found (the peer that stopped answering)."""
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    shape = options.shape
    detail = f"{type(exc).__name__}{f': {exc}' if str(exc) else ''}"
    timed_out = isinstance(exc, RendezvousTimeoutError)  # a join (perhaps of a restart's round) timed out
    joined = describe_missing(watch.nodes, shape, complete=watch.completed and not timed_out) \
        if watch is not None else ""
    if timed_out:
        return DeadlineExpired(f"the rendezvous at {endpoint} did not complete within {conf['join_timeout']} s"
                               f"{'; ' + joined if joined else ''} ({detail})",
                               f"{shape} node agents (NODESxRANKS) to join",
                               "start ddpkit on every node with the same --rdzv-endpoint, --run-id and -j, check "
                               "each can reach the endpoint, or give them longer with --timeout")
    found = "; ".join(lost) if lost else f"this agent lost the rendezvous store at {endpoint}"
    return DeadlineExpired(f"{found}{'; ' + joined if joined else ''} ({detail})",
                           "every host to keep reaching the rendezvous store and its peers",
                           "check the network between the hosts; rerun the same command to resume from the "
                           "snapshot named above, or pass --max-restarts N to restart when the link returns")


def preload(modules: tuple[str, ...]) -> bool:
    """Import ``modules`` in the agent so forked workers inherit them; True when the workers will be forked."""
    # Fork is safe where torch has no CUDA (a CPU build) and the preloaded modules start no threads. With a CUDA
    # build, asking the driver anything (torch.cuda.is_available(); on an H100 with torch 2.11, something in torch's
    # own start-up too) leaves forked children unable to use CUDA ("Cannot re-initialize CUDA in forked
    # subprocess"), and torch says so only in the child: the workers start afresh instead.
    forked = bool(modules) and os.environ.get(worker.START_METHOD, "fork") == "fork" and not _cuda_build()
    for name in modules if forked else ():
        importlib.import_module(name)
    return forked


def _cuda_build() -> bool:
    import torch

    return bool(torch.backends.cuda.is_built())
