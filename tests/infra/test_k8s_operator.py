"""`ddpkit submit k8s` manifests executed, not only rendered: each pod a namespace host (tests/infra/k8s_operator.py).

PyTorchJob (Master + Workers; elastic with c10d; elastic with etcd-v2 and its etcd Deployment) and Trainer v2
TrainJob, rendered by the real CLI, run with the environment the operators inject, the Service names resolvable,
the snapshot PVC shared, and restartPolicy played by the harness as the kubelet would.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ddpkit.train.snapshot import read_header
from tests.helpers import newest_snapshot, require_tools, run_ddpkit, same_state
from tests.infra.conftest import Hosts, new_run_id
from tests.infra.k8s_operator import Manifest, Operator, etcd_pods, job_pods, load

pytestmark = [pytest.mark.infra, pytest.mark.multiproc]
JOB_TIMEOUT = 240
# 8192 samples / 4 ranks / batch 32 = 64 steps per epoch, a snapshot every epoch; summary on the shared volume
EPOCHS = 6
JOB = ("--samples", "8192", "--epochs", str(EPOCHS), "--seed", "7", "--keep", str(EPOCHS))
TRAIN = ("train", *JOB, "--json", "/snapshots/summary.json")


def render(*args: str) -> list[Manifest]:
    done = run_ddpkit("submit", "k8s", "--dry-run", "--image", "registry.example/ddpkit:test", *args)
    assert done.returncode == 0, done.stderr
    return load(done.stdout)


@pytest.fixture
def operator(make_hosts: Callable[[int], Hosts]) -> Iterator[Callable[..., Operator]]:
    """Factory: the pods of rendered manifests on as many namespace hosts, started; torn down with the hosts."""
    def start(objects: list[Manifest], **options: Any) -> Operator:
        hosts = make_hosts(len(etcd_pods(objects)) + len(job_pods(objects)))
        op = Operator(hosts.cluster, objects, **options)
        op.start()
        return op

    yield start


def _finish(op: Operator, timeout: float = JOB_TIMEOUT) -> Operator:
    if not op.wait(timeout):
        pytest.fail(f"the job did not finish within {timeout} s\n{op.logs()}")
    return op


def test_pytorchjob_check(operator: Callable[..., Operator]) -> None:
    op = _finish(operator(render("-j", "2x2", "--run-id", new_run_id(), "--", "check")))
    assert all(p.succeeded for p in op.job), op.logs()
    assert "verdict: PASS: 4 rank(s) on 2 host(s)" in op.job[0].log(), op.logs()


def _pvc(op: Operator) -> Path:
    return op.workdir / "pvc" / "ddpkit-train-snapshots"


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same job uninterrupted, 4 ranks started by ddpkit on one host: the final state every run must reach."""
    tmp = tmp_path_factory.mktemp("baseline")
    done = run_ddpkit("train", "-n", "4", *JOB, "--snapshot-path", f"{tmp}/", timeout=JOB_TIMEOUT)
    assert done.returncode == 0, done.stderr[-3000:]
    return _final(tmp)


def _final(directory: Path) -> dict[str, Any]:
    return newest_snapshot(directory, "snapshot")[1]


def test_pytorchjob_train_snapshots_on_the_shared_volume(operator: Callable[..., Operator],
                                                         baseline: dict[str, Any]) -> None:
    op = _finish(operator(render("-j", "2x2", "--", *TRAIN)))
    assert all(p.succeeded and p.restarts == 0 for p in op.job), op.logs()
    master = op.pod("ddpkit-train-master-0").log()
    assert f"Epoch {EPOCHS - 1} | Training snapshot saved at /snapshots/snapshot.{EPOCHS * 64:09d}.pt" in master
    files = sorted(p.name for p in _pvc(op).glob("snapshot.*.pt"))
    assert files == [f"snapshot.{64 * e:09d}.pt" for e in range(1, EPOCHS + 1)], files
    assert {read_header(_pvc(op) / f)["writer_rank"] for f in files} == {0}
    summary = json.loads((_pvc(op) / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["global_step"] == EPOCHS * 64
    assert same_state(_final(_pvc(op)), baseline)


ELASTIC = {"c10d": (), "etcd": ("--k8s-rdzv", "etcd")}


@pytest.mark.parametrize("rdzv", sorted(ELASTIC))
def test_elastic_pytorchjob_check(operator: Callable[..., Operator], rdzv: str) -> None:
    if rdzv == "etcd":
        require_tools("etcd")
    op = _finish(operator(render("-j", "1:2x2", *ELASTIC[rdzv], "--run-id", new_run_id(), "--", "check")))
    assert all(p.succeeded for p in op.job), op.logs()
    logs = "".join(p.log() for p in op.job)
    assert "verdict: PASS: 4 rank(s) on 2 host(s)" in logs, op.logs()


@pytest.mark.parametrize("rdzv", sorted(ELASTIC))
def test_elastic_pytorchjob_worker_killed_resumes_bitwise(operator: Callable[..., Operator],
                                                          baseline: dict[str, Any], rdzv: str) -> None:
    """Kill every process of worker 1 after the first snapshot: the kubelet restarts the pod (OnFailure), the
    agents meet again, training resumes from the snapshot and ends exactly where the uninterrupted run ends."""
    if rdzv == "etcd":
        require_tools("etcd")
    op = operator(render("-j", "1:2x2", *ELASTIC[rdzv], "--max-restarts", "3", "--run-id", new_run_id(), "--",
                         *TRAIN))
    first = _pvc(op) / "snapshot.000000064.pt"
    if not op.wait(JOB_TIMEOUT, until=first.exists):
        pytest.fail(f"no first snapshot within {JOB_TIMEOUT} s\n{op.logs()}")
    assert not any(p.done for p in op.job), "the job ended before the kill:\n" + op.logs()
    assert op.kill_pod("ddpkit-train-worker-1")
    _finish(op)
    victim = op.pod("ddpkit-train-worker-1")
    assert victim.exit_codes[0] == 137 and victim.restarts >= 1, op.logs()  # SIGKILL, as the runtime reports it
    assert all(p.succeeded for p in op.job), op.logs()
    logs = "".join(p.log() for p in op.job)
    assert "Resuming training from snapshot at Epoch" in logs, op.logs()
    summary = json.loads((_pvc(op) / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["resumed_from"] is not None, summary
    assert same_state(_final(_pvc(op)), baseline)


def test_trainjob_check(operator: Callable[..., Operator]) -> None:
    op = _finish(operator(render("-j", "2x2", "--k8s-kind", "trainjob", "--run-id", new_run_id(), "--", "check")))
    assert [p.spec.name for p in op.job] == ["ddpkit-check-node-0-0", "ddpkit-check-node-0-1"]
    assert all(p.succeeded for p in op.job), op.logs()
    assert "verdict: PASS: 4 rank(s) on 2 host(s)" in op.job[0].log(), op.logs()


def _wrong_command(job: Manifest) -> str:
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    agent = container["command"].index("torchrun")  # the module torchrun runs, not ddpkit step before it
    container["command"] = [a.replace("ddpkit", "ddpkit_typo") if i > agent else a
                            for i, a in enumerate(container["command"])]
    return "No module named ddpkit_typo"


def _wrong_rendezvous(job: Manifest) -> str:
    # a rendezvous host no pod or Service answers to; a short store timeout keeps the failing attempts short
    job["spec"]["elasticPolicy"].update(rdzvHost="ddpkit-check-master-0",
                                        rdzvConf=[{"key": "read_timeout", "value": "5"}])
    return "RendezvousConnectionError"


@pytest.mark.parametrize("mutate", [_wrong_command, _wrong_rendezvous], ids=["command", "rendezvous"])
def test_harness_fails_a_broken_manifest(operator: Callable[..., Operator], mutate: Callable[[Manifest], str]) -> None:
    """The harness can fail: the same manifest with a wrong pod command or rendezvous host ends with every pod
    failed after the kubelet's restarts, and the log says why."""
    objects = render("-j", "1:2x2", "--run-id", new_run_id(), "--", "check")
    expected = mutate(next(o for o in objects if o["kind"] == "PyTorchJob"))
    op = _finish(operator(objects, max_restarts=1))
    assert not any(p.succeeded for p in op.job), op.logs()
    assert all(p.restarts == 1 and len(p.exit_codes) == 2 for p in op.job), op.logs()
    assert expected in "".join(p.log() for p in op.job), op.logs()


def test_pod_environments_are_the_operators() -> None:
    """What each pod is given, from the rendered manifests (no processes): the values the tests above run with."""
    master, worker = job_pods(render("-j", "2x2", "--", "check"))
    assert (master.name, worker.name) == ("ddpkit-check-master-0", "ddpkit-check-worker-0")
    assert {k: worker.env[k] for k in ("MASTER_ADDR", "PET_MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK",
                                       "PET_NODE_RANK", "PET_NNODES", "PET_NPROC_PER_NODE")} == {
        "MASTER_ADDR": "ddpkit-check-master-0", "PET_MASTER_ADDR": "ddpkit-check-master-0", "MASTER_PORT": "23456",
        "WORLD_SIZE": "4", "RANK": "1", "PET_NODE_RANK": "1", "PET_NNODES": "2", "PET_NPROC_PER_NODE": "2"}
    assert master.env["RANK"] == "0" and master.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert master.command == ("ddpkit", "step", "--show-all", "--", "torchrun", "-m", "ddpkit", "check") and \
        master.restart_policy == "OnFailure"
    objects = render("-j", "1:2x2", "--k8s-rdzv", "etcd", "--run-id", "r9", "--", "train")
    (etcd,), pods = etcd_pods(objects), job_pods(objects)
    assert etcd.aliases == ("ddpkit-train-etcd",) and etcd.ready_port == 2379
    assert [p.name for p in pods] == ["ddpkit-train-worker-0", "ddpkit-train-worker-1"]
    assert {k: v for k, v in pods[1].env.items() if k.startswith("PET_")} == {
        "PET_RDZV_ENDPOINT": "ddpkit-train-etcd:2379", "PET_RDZV_BACKEND": "etcd-v2", "PET_NNODES": "1:2",
        "PET_MAX_RESTARTS": "0", "PET_RDZV_ID": "r9", "PET_NPROC_PER_NODE": "2"}
    assert "MASTER_ADDR" not in pods[1].env  # no Master replica: torchrun's c10d/etcd rendezvous names the master
    assert {("pvc", "ddpkit-train-snapshots", "/snapshots"), ("tmpfs", "", "/dev/shm")} <= set(pods[0].mounts)
    _, node1 = job_pods(render("-j", "2x2", "--k8s-kind", "trainjob", "--", "check"))
    assert node1.aliases == ("ddpkit-check-node-0-1.ddpkit-check",)
    assert {k: v for k, v in node1.env.items() if k.startswith("PET_")} == {
        "PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1",
        "PET_MASTER_ADDR": "ddpkit-check-node-0-0.ddpkit-check", "PET_MASTER_PORT": "29400"}


def _user_script(tmp: Path) -> Path:
    from tests.multiproc.test_run import SCRIPT

    target = tmp / "ddp_user.py"
    target.write_text(SCRIPT.read_text())
    return target


def _ranks_agree(op: Operator, world: int) -> None:
    from tests.multiproc.test_run import assert_replicas_identical

    rows = assert_replicas_identical("".join(p.log() for p in op.job), world)
    assert len({r["host"] for r in rows.values()}) == 2, op.logs()


def test_pytorchjob_runs_a_users_script_unchanged(operator: Callable[..., Operator], tmp_path: Path) -> None:
    """A user's torchrun-style script as the job's command: the rendered pods run it as `torchrun -m ddpkit run --
    SCRIPT` (issue 37), so it is watched (the watch's summary) and leaves before the interpreter's teardown, where
    torch 2.13's gloo can abort a rank of plain torchrun: the script ends by sys.exit as written."""
    script = _user_script(tmp_path)
    # the probe of this test only: does a watch run in this rank (the script itself does not know of ddpkit)
    script.write_text(script.read_text().replace(
        "dist.destroy_process_group()", "import sys as _s\n_w = _s.modules.get('ddpkit.watch')\n"
        "_on = _w is not None and _w.active() is not None and _w.active().monitor is not None\n"
        "print(f'WATCHED rank={rank} {_on}', flush=True)\ndist.destroy_process_group()", 1))
    objects = render("-j", "2x2", "--run-id", new_run_id(), "--", str(script))
    commands = [c["command"] for obj in objects for spec in obj.get("spec", {}).get("pytorchReplicaSpecs", {}).values()
                for c in spec["template"]["spec"]["containers"]]
    assert commands and all(c[:9] == ["ddpkit", "step", "--show-all", "--", "torchrun", "-m", "ddpkit", "run", "--"]
                            for c in commands), commands
    op = _finish(operator(objects))
    assert all(p.succeeded for p in op.job), op.logs()
    _ranks_agree(op, 4)
    logs = "".join(p.log() for p in op.job)
    assert sorted(re.findall(r"WATCHED rank=(\d) True", logs)) == ["0", "1", "2", "3"], logs


def test_elastic_pods_whose_command_is_ddpkit_run(operator: Callable[..., Operator], tmp_path: Path) -> None:
    """A PyTorchJob written by hand with `python -m ddpkit run -- script.py` as the command (no torchrun): in each
    elastic pod (PET_* variables, no MASTER_ADDR) ddpkit is the agent, as torchrun would be, and the script runs
    unchanged on every rank."""
    import sys

    script = _user_script(tmp_path)
    objects = render("-j", "1:2x2", "--run-id", new_run_id(), "--", str(script))
    replaced = 0
    for obj in objects:
        for spec in obj.get("spec", {}).get("pytorchReplicaSpecs", {}).values():
            for container in spec["template"]["spec"]["containers"]:
                assert container["command"][4] == "torchrun", container["command"]
                container["command"] = [sys.executable, "-m", "ddpkit", "run", "--", str(script)]
                replaced += 1
    assert replaced
    op = _finish(operator(objects))
    assert all(p.succeeded for p in op.job), op.logs()
    _ranks_agree(op, 4)


def test_a_failed_pods_log_keeps_every_line_and_ends_with_its_digest(operator: Callable[..., Operator],
                                                                     tmp_path: Path) -> None:
    """Rank 1 raises at its fourth all-reduce: each pod runs torchrun under ``ddpkit step --show-all``, so its log
    (the only full log a pod has) keeps every line, torch's ChildFailedError box included, and ends with the digest:
    the worker's names rank 1 and its exception first."""
    from tests.infra.test_jobs_local import RAISES_ON_RANK_1

    script = tmp_path / "raises.py"
    script.write_text(RAISES_ON_RANK_1)
    op = _finish(operator(render("-j", "2x1", "--run-id", new_run_id(), "--", str(script)), max_restarts=0))
    worker = next(p for p in op.job if "worker" in p.spec.name)
    log = worker.log()
    assert worker.exit_codes[-1] == 1, op.logs()
    tail = log[log.index("ddpkit: the job failed (torchrun exit code 1): "):].splitlines()
    assert re.fullmatch(r"ddpkit: the job failed \(torchrun exit code 1\): rank 1 on host \S+ failed first with "
                        r"exit code 1", tail[0]), op.logs()
    assert "    KeyError: 'batch'" in tail[:5] and tail[-1].endswith(": the lines above"), op.logs()
    before = log[:log.index(tail[0])]
    assert "ChildFailedError" in before and "Traceback (most recent call last):" in before, op.logs()
