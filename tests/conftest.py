"""Suite-wide collection rules.

``make test`` runs the suite on two pytest-xdist workers (``-n 2 --dist loadgroup``): most multi-process tests
spend their time waiting (a deadline, a launcher's teardown), so two run side by side on two cores. The
infrastructure tests all go to one worker, in order (``xdist_group("infra")``): they share session-wide
daemons (the Slurm cluster, the Kubernetes harness) that one worker starts once, and each is heavy enough to
want the machine for itself. Without ``-n`` the marks do nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest

INFRA = Path(__file__).parent / "infra"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if INFRA in Path(item.path).parents:
            item.add_marker(pytest.mark.xdist_group("infra"))
