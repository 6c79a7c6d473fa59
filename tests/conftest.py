"""Suite-wide collection rules.

``make test`` runs the suite on two pytest-xdist workers (``-n 2 --dist loadgroup``): most multi-process tests
spend their time waiting (a deadline, a launcher's teardown), so two run side by side on two cores. An
infrastructure test module runs whole on one worker, in order (``xdist_group("infra:MODULE")``): its tests
share what its fixtures start (a Slurm cluster, namespace hosts, an etcd), which a worker starts once. Two
modules may run at once: every cluster, host and network lives in namespaces named from a run id of its own,
with ports derived from it. Without ``-n`` the marks do nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

INFRA = Path(__file__).parent / "infra"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if INFRA in Path(item.path).parents:
            item.add_marker(pytest.mark.xdist_group(f"infra:{Path(item.path).stem}"))
