"""Suite-wide collection and distribution rules.

``make test`` runs the suite on two pytest-xdist workers (``-n 2 --dist loadgroup``): most multi-process tests
spend their time waiting (a deadline, a launcher's teardown), so two run side by side on two cores.

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
first: its jobs mostly sleep through pauses of 75 to 150 s, which the other worker's tests then fill. Collected
last, as its name sorts, it left both cores idle for two minutes at the end of the run.
"""

from __future__ import annotations

from typing import Any

import pytest

#: Multi-process modules whose module fixture runs jobs that all its tests read.
WHOLE = frozenset({"tests/multiproc/test_watch_pauses.py", "tests/multiproc/test_train.py",
                   "tests/multiproc/test_goodput.py"})
#: Modules collected (and so handed out) first.
FIRST = ("tests/multiproc/test_watch_pauses.py",)


def scope_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its module for one in ``WHOLE``, else the test alone."""
    module = nodeid.split("::", 1)[0]
    return module if module in WHOLE else nodeid


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.nodeid.split("::", 1)[0] not in FIRST)  # stable: the rest as collected


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup":
        return None  # xdist's own
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScopes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    config.option.loadscopereorder = False  # in collection order: FIRST first
    return ModuleScopes(config, log)
