"""`ddpkit submit k8s` manifests executed, not only rendered: each pod a namespace host (tests/infra/k8s_operator.py).

PyTorchJob (Master + Workers; elastic with c10d; elastic with etcd-v2 and its etcd Deployment) and Trainer v2
TrainJob, rendered by the real CLI, run with the environment the operators inject, the Service names resolvable,
the snapshot PVC shared, and restartPolicy played by the harness as the kubelet would.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require_tools, run_ddpkit
from tests.infra.conftest import Hosts, new_run_id
from tests.infra.k8s_operator import Manifest, Operator, etcd_pods, job_pods, load

pytestmark = [pytest.mark.infra, pytest.mark.multiproc]
JOB_TIMEOUT = 240
# 2048 samples / 4 ranks / batch 32 = 16 steps per epoch; a snapshot every epoch
TRAIN = ("train", "--samples", "2048", "--epochs", "4", "--seed", "7", "--keep", "8")


def render(*args: str) -> list[Manifest]:
    done = run_ddpkit("submit", "k8s", "--dry-run", "--image", "registry.example/ddpkit:test", *args)
    assert done.returncode == 0, done.stderr
    return load(done.stdout)


@pytest.fixture
def operator(make_hosts: Callable[[int], Hosts]) -> Iterator[Callable[[list[Manifest]], Operator]]:
    """Factory: the pods of rendered manifests on as many namespace hosts, started; torn down with the hosts."""
    def start(objects: list[Manifest]) -> Operator:
        hosts = make_hosts(len(etcd_pods(objects)) + len(job_pods(objects)))
        op = Operator(hosts.cluster, objects)
        op.start()
        return op

    yield start


def _finish(op: Operator, timeout: float = JOB_TIMEOUT) -> Operator:
    if not op.wait(timeout):
        pytest.fail(f"the job did not finish within {timeout} s\n{op.logs()}")
    return op


def test_pytorchjob_check(operator: Callable[[list[Manifest]], Operator]) -> None:
    op = _finish(operator(render("-j", "2x2", "--run-id", new_run_id(), "--", "check")))
    assert all(p.succeeded for p in op.job), op.logs()
    assert "verdict: PASS: 4 rank(s) on 2 host(s)" in op.job[0].log(), op.logs()
