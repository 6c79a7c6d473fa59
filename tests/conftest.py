"""Suite-wide collection and distribution rules.

``make test`` runs the suite on three pytest-xdist workers on two cores (``-n 3 --dist loadgroup``), in two lanes.
Most multi-process tests spend much of their time waiting (a deadline, a hang held on purpose, a launcher's
teardown): with two workers the cores were 76% busy over the parallel phase (sampled from /proc/stat every 5 s),
and under 50% for its first five minutes, where two waiting modules ran side by side. So one worker, the last, takes
only the modules in ``WAITING`` (measured at about half a core each while they run, and none of the load-sensitive
tests of the ``serial`` mark), and the others take the rest, which keeps two cores busy: a third worker running the
busy tests too would oversubscribe the cores and slow the tests that time something. When the busy lane is empty
its workers take what is left of the waiting lane; when the waiting lane is empty its worker stops. Under ``-n 2``
there are no lanes (every worker takes anything, in order).

The unit of work is one test, except for the modules in ``WHOLE``, which run whole on one worker, in order
(``scope_of``): their tests read what one module fixture ran (jobs of a minute or more), which a second worker
would run again. An infrastructure module is spread test by test like the rest: each worker starts the module's
fixtures (a Slurm cluster, namespace hosts, an etcd, a Kubernetes harness) for the tests it gets, side by side,
since every cluster, host and network lives in namespaces named from a run id of its own, with ports derived from
it. Measured on 2 cores: with every infrastructure module whole on one worker, the parallel phase took 31:12; spread,
27:25 (two of its clusters' start-ups cost less than its heavy modules running back to back beside each other).

The rule is this conftest's scheduler (``pytest_xdist_make_scheduler``), not ``xdist_group`` marks: xdist's
loadgroup carries a mark to the scheduler by rewriting the test's node id, which pytest 9.2 no longer lets it do,
so such marks are silently ignored (pytest-dev/pytest-xdist#1386).

Work is handed out in collection order (xdist's reordering by test count is off), and ``FIRST`` is collected
first: its jobs mostly sleep through pauses of 75 to 150 s.
"""

from __future__ import annotations

from typing import Any

import pytest

#: Multi-process modules whose module fixture runs jobs that all its tests read.
WHOLE = frozenset({"tests/multiproc/test_watch_pauses.py", "tests/multiproc/test_train.py",
                   "tests/multiproc/test_goodput.py"})
#: Modules that mostly wait: at most about 0.6 of a core on average while they run (estimated from /proc/stat
#: samples over a two-worker run, by least squares over which modules ran in each 5 s), and nothing load-sensitive.
WAITING = frozenset({
    "tests/multiproc/test_watch_pauses.py", "tests/infra/test_heal_multihost.py",
    "tests/infra/test_multihost_drills.py", "tests/infra/test_heal_mpi.py", "tests/multiproc/test_watch_p2p.py",
    "tests/infra/test_env_launchers_real.py", "tests/multiproc/test_heal_silent.py",
    "tests/multiproc/test_run_goodput.py", "tests/multiproc/test_watch.py", "tests/multiproc/test_rendezvous_wait.py",
    "tests/multiproc/test_worker_dies_with_agent.py", "tests/multiproc/test_train_disk_full.py",
    "tests/multiproc/test_watch_store.py", "tests/multiproc/test_watch_first_steps.py"})
#: Modules collected (and so handed out) first.
FIRST = ("tests/multiproc/test_watch_pauses.py",)
#: Fewer workers than this: no lanes.
LANES_FROM = 3


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def scope_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its module for one in ``WHOLE``, else the test alone."""
    module = module_of(nodeid)
    return module if module in WHOLE else nodeid


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: module_of(item.nodeid) not in FIRST)  # stable: the rest as collected


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup":
        return None  # xdist's own
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        """xdist's scope scheduling with ``scope_of`` as the scope, and the waiting lane on the last worker."""

        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            """xdist's own hand-out of the queue's first unit, once this node's lane's first is put at the front."""
            nodes = self.nodes
            lanes = len(nodes) >= LANES_FROM
            waits = lanes and node is nodes[-1]
            scope = next((scope for scope in self.workqueue
                          if not lanes or (module_of(scope) in WAITING) == waits), None)
            if scope is None and not waits:
                scope = next(iter(self.workqueue), None)  # the busy lane is done: help with what waits
            if scope is None:
                if not self._pending_of(self.assigned_work[node]):
                    node.shutdown()  # the waiting lane is done; two workers keep the cores busy
                return
            self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)

    config.option.loadscopereorder = False  # in collection order: FIRST first
    return Lanes(config, log)
