"""Rendered Kubernetes manifests run as the operators would, one network-namespace host per pod.

There is no Kubernetes and no container runtime on these machines. What a cluster would do, and what stands in
for it here:

- a pod is a namespace host (scripts/nshosts.py) whose hostname is the pod's; its /etc/hosts is the kubelet's
  (its own name -> its own IP) plus every Service name of the job, which cluster DNS would resolve: here a Service
  name resolves straight to its pod's IP, as a headless Service does (PyTorchJob: one Service per replica named
  like the pod, ``NAME-master-0``, ``NAME-worker-N``; TrainJob: JobSet pod ``NAME-node-0-I`` in subdomain
  ``NAME``; the etcd Service to the etcd pod);
- the pod's environment is what the operator injects (derived below from the operator's source, cited), on top
  of the container's own ``env:``, plus what the kubelet adds (HOSTNAME, KUBERNETES_SERVICE_*);
- no image is pulled: the container's command/args run as written, with this virtual environment's Python (and
  so the ddpkit under test, and its torchrun) first on PATH; the etcd image's binary is the local ``etcd``;
- volumes live in each pod's private mount namespace: an ``emptyDir`` of medium Memory is a fresh tmpfs at its
  mountPath, a PVC is one per-run directory bind-mounted at its mountPath in every pod that mounts it (a mount
  point missing on this machine, such as /snapshots, is created as an empty directory first);
- ``restartPolicy`` OnFailure (any non-zero exit) and ExitCode (exit 128 and above, the training operator's
  "retryable" codes) start the same pod again, same host, same environment, after RESTART_BACKOFF seconds, at
  most MAX_RESTARTS times (the kubelet backs off 10 s doubling to 5 min, without a bound);
- the etcd Deployment is one pod running the manifest's etcd command, started first and waited on until its
  readinessProbe (a TCP connect) passes, as ``kubectl wait`` would.

- scheduling, as far as a rendered job asks for it: each namespace host is a node (its ``kubernetes.io/hostname``
  is the node name given to the Operator, else the host's short name), one pod per node, the first free node in
  order that the pod's required ``nodeAffinity`` admits (``In``/``NotIn`` on ``kubernetes.io/hostname``); a pod
  no node admits is refused as the scheduler leaves it Pending (``Unschedulable``).

Not exercised here: image pulls, resources, other scheduling rules, the operator's own reconcile loop (pod
re-creation when a pod is deleted, job conditions, backoffLimit), Service virtual IPs and kube-proxy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from scripts.nshosts import Cluster, Host

Manifest = dict[str, Any]
MAX_RESTARTS = 3
RESTART_BACKOFF = 1.0
# pkg/apis/kubeflow.org/v1 (training-operator 1.9): PytorchJobDefaultPortName/Port, added to the "pytorch"
# container of every replica by setPytorchDefaultPort (pytorch_defaults.go) when the manifest names no such port
PYTORCHJOB_PORT_NAME, PYTORCHJOB_PORT = "pytorchjob-port", 23456
# kubeflow/trainer pkg/constants: ContainerTrainerPort, the PET_MASTER_PORT of every TrainJob node
TRAINER_PORT = 29400
# the "kubernetes" Service every pod sees as variables (kubelet, enableServiceLinks)
KUBELET_ENV = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
# mount the pod's volumes, then become its command: argv is N (MOUNT_KIND SRC DST)xN CMD...
_POD_ENTRY = r'''n=$1; shift
while [ "$n" -gt 0 ]; do
  mkdir -p "$3"
  if [ "$1" = tmpfs ]; then mount -t tmpfs tmpfs "$3"; else mount --bind "$2" "$3"; fi || exit 125
  shift 3; n=$((n - 1))
done
exec "$@"'''


@dataclass(frozen=True, kw_only=True)
class PodSpec:
    """One pod as the operator would create it."""

    name: str
    """Pod name and hostname."""
    aliases: tuple[str, ...]
    """Other names that resolve to this pod: its Service, its FQDN in a subdomain."""
    command: tuple[str, ...]
    """The container's command + args, as written."""
    env: dict[str, str]
    """The container's env, then the operator's variables (the operator's win on a clash: they come last)."""
    mounts: tuple[tuple[str, str, str], ...]
    """(kind, source, mountPath): kind ``tmpfs`` (emptyDir, Memory) or ``pvc`` (source: the claim name) or ``dir``."""
    restart_policy: str
    ready_port: int | None = None
    """readinessProbe tcpSocket port, waited on before the job's pods start."""
    not_in: tuple[str, ...] = ()
    """Nodes the pod's required nodeAffinity keeps it off (``NotIn`` on ``kubernetes.io/hostname``)."""
    only_in: tuple[str, ...] | None = None
    """Nodes it must run on (``In``), where it says so."""


class Unschedulable(RuntimeError):
    """No node admits a pod: the scheduler leaves it Pending."""


def _node_affinity(pod_spec: Manifest) -> tuple[tuple[str, ...], tuple[str, ...] | None]:
    """(NotIn, In) on ``kubernetes.io/hostname`` of a pod template's required nodeAffinity (one term, as ddpkit
    renders it)."""
    required = pod_spec.get("affinity", {}).get("nodeAffinity", {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution", {})
    not_in: list[str] = []
    only_in: list[str] | None = None
    for term in required.get("nodeSelectorTerms", []):
        for rule in term.get("matchExpressions", []):
            if rule.get("key") != "kubernetes.io/hostname":
                raise ValueError(f"node affinity on {rule.get('key')!r}: the harness places by hostname only")
            if rule["operator"] == "NotIn":
                not_in += rule["values"]
            elif rule["operator"] == "In":
                only_in = [*(only_in or []), *rule["values"]]
            else:
                raise ValueError(f"node affinity operator {rule['operator']!r}: the harness knows In and NotIn")
    return tuple(not_in), None if only_in is None else tuple(only_in)


def load(text: str) -> list[Manifest]:
    """The objects of a rendered multi-document YAML (``ddpkit submit k8s --dry-run``)."""
    return [d for d in yaml.safe_load_all(text) if d]


def _env_list(entries: list[Manifest] | None) -> dict[str, str]:
    return {e["name"]: str(e.get("value", "")) for e in entries or []}


def _mounts(pod_spec: Manifest, container: Manifest) -> tuple[tuple[str, str, str], ...]:
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    out = []
    for m in container.get("volumeMounts", []):
        v = volumes[m["name"]]
        if "persistentVolumeClaim" in v:
            out.append(("pvc", v["persistentVolumeClaim"]["claimName"], m["mountPath"]))
        elif v.get("emptyDir", {}).get("medium") == "Memory":
            out.append(("tmpfs", "", m["mountPath"]))
        else:
            raise ValueError(f"volume {v} is not one the harness maps (emptyDir Memory or a PVC)")
    return tuple(out)


def _container_port(container: Manifest) -> int:
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    return int(ports.get(PYTORCHJOB_PORT_NAME, PYTORCHJOB_PORT))


def pytorchjob_pods(job: Manifest) -> list[PodSpec]:
    """The pods of a PyTorchJob, each with the environment training-operator 1.9 gives it.

    kubeflow/training-operator release 1.9, pkg/controller.v1/pytorch/:
    - envvar.go setPodEnv: PYTHONUNBUFFERED="0"; with a Master replica: master.go's MASTER_ADDR=PET_MASTER_ADDR=
      NAME-master-0 and MASTER_PORT=PET_MASTER_PORT=the master's pytorchjob-port, WORLD_SIZE = all replicas x
      nprocPerNode (1 when not a number, getNprocPerNodeInt), RANK = PET_NODE_RANK = index (+1 for workers);
      PET_NPROC_PER_NODE = spec.nprocPerNode for every pod (kubeflow/trainer PR #1948, in 1.8 and 1.9);
      without an elasticPolicy PET_NNODES = all replicas;
    - elastic.go (with an elasticPolicy): PET_RDZV_ENDPOINT = (rdzvHost or NAME-worker-0):(rdzvPort or the
      worker's pytorchjob-port), PET_RDZV_BACKEND (default c10d), PET_NNODES = MIN:MAX (pytorch_defaults.go fills
      both from the worker replicas when unset), PET_MAX_RESTARTS, PET_RDZV_ID, PET_RDZV_CONF (k=v,k=v).
    """
    name, spec = job["metadata"]["name"], job["spec"]
    replicas: dict[str, Manifest] = spec["pytorchReplicaSpecs"]
    total = sum(int(r.get("replicas", 1)) for r in replicas.values())
    nproc_text = str(spec.get("nprocPerNode", "auto"))  # pytorch_defaults.go: DefaultNprocPerNode = "auto"
    nproc = int(nproc_text) if nproc_text.isdigit() else 1
    elastic = spec.get("elasticPolicy")
    pods = []
    for rtype in ("Master", "Worker"):
        if rtype not in replicas:
            continue
        rs = replicas[rtype]
        pod_spec = rs["template"]["spec"]
        container = next(c for c in pod_spec["containers"] if c["name"] == "pytorch")
        for index in range(int(rs.get("replicas", 1))):
            env = {"PYTHONUNBUFFERED": "0"}
            if "Master" in replicas:
                master = next(c for c in replicas["Master"]["template"]["spec"]["containers"] if c["name"] == "pytorch")
                port, addr = str(_container_port(master)), f"{name}-master-0"
                rank = str(index + (1 if rtype == "Worker" else 0))
                env.update(MASTER_PORT=port, PET_MASTER_PORT=port, MASTER_ADDR=addr, PET_MASTER_ADDR=addr,
                           WORLD_SIZE=str(total * nproc), RANK=rank, PET_NODE_RANK=rank)
            env["PET_NPROC_PER_NODE"] = nproc_text
            if elastic is None:
                env["PET_NNODES"] = str(total)
            else:
                env.update(_elastic_env(name, elastic, replicas["Worker"]))
            pod = f"{name}-{rtype.lower()}-{index}"
            not_in, only_in = _node_affinity(pod_spec)
            pods.append(PodSpec(
                name=pod, aliases=(), command=(*container.get("command", []), *container.get("args", [])),
                env={**_env_list(container.get("env")), **env}, mounts=_mounts(pod_spec, container),
                restart_policy=rs.get("restartPolicy", "OnFailure"),  # PytorchJobDefaultRestartPolicy
                not_in=not_in, only_in=only_in))
    return pods


def _elastic_env(name: str, policy: Manifest, worker: Manifest) -> dict[str, str]:
    workers = int(worker.get("replicas", 1))
    worker_container = next(c for c in worker["template"]["spec"]["containers"] if c["name"] == "pytorch")
    host = policy.get("rdzvHost", f"{name}-worker-0")
    port = policy.get("rdzvPort", _container_port(worker_container))
    env = {"PET_RDZV_ENDPOINT": f"{host}:{port}", "PET_RDZV_BACKEND": policy.get("rdzvBackend", "c10d"),
           "PET_NNODES": f"{policy.get('minReplicas', workers)}:{policy.get('maxReplicas', workers)}"}
    if "maxRestarts" in policy:
        env["PET_MAX_RESTARTS"] = str(policy["maxRestarts"])
    if "rdzvId" in policy:
        env["PET_RDZV_ID"] = policy["rdzvId"]
    if policy.get("rdzvConf"):
        env["PET_RDZV_CONF"] = ",".join(f"{c['key']}={c['value']}" for c in policy["rdzvConf"])
    return env


def trainjob_pods(job: Manifest) -> list[PodSpec]:
    """The pods of a TrainJob on the torch-distributed runtime, as JobSet and Trainer v2's torch plugin make them.

    kubeflow/trainer pkg/runtime/framework/plugins/torch/torch.go EnforceMLPolicy: the trainer's env, then
    (upserted) PET_NNODES = numNodes, PET_NPROC_PER_NODE = numProcPerNode (a number stays as written; only
    auto/cpu are derived from resourcesPerNode), PET_NODE_RANK = the Job completion index, PET_MASTER_ADDR =
    NAME-node-0-0.NAME, PET_MASTER_PORT = 29400. JobSet names the pods NAME-node-0-I, in the headless Service NAME.
    The trainer's command replaces the runtime container's; volumes come from the runtimePatches' pod template.
    The runtime (manifests/base/runtimes/torch_distributed.yaml) sets no restartPolicy: Never here, so that a
    failing node fails the run.
    """
    name, trainer = job["metadata"]["name"], job["spec"]["trainer"]
    patch_pod: Manifest = {"volumes": [], "containers": [{"name": "node"}]}
    for patch in job["spec"].get("runtimePatches", []):
        for rjob in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
            if rjob["name"] == "node":
                patch_pod = rjob["template"]["spec"]["template"]["spec"]
    container = next(c for c in patch_pod["containers"] if c["name"] == "node")
    nodes = int(trainer["numNodes"])
    pods = []
    for index in range(nodes):
        env = {"PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
               "PET_NODE_RANK": str(index), "PET_MASTER_ADDR": f"{name}-node-0-0.{name}",
               "PET_MASTER_PORT": str(TRAINER_PORT)}
        pod = f"{name}-node-0-{index}"
        pods.append(PodSpec(
            name=pod, aliases=(f"{pod}.{name}",), command=(*trainer.get("command", []), *trainer.get("args", [])),
            env={**_env_list(trainer.get("env")), **env}, mounts=_mounts(patch_pod, container),
            restart_policy="Never"))
    return pods


def etcd_pods(objects: list[Manifest]) -> list[PodSpec]:
    """One pod per Deployment (replicas 1), reachable under the names of the Services that select it."""
    services = [o for o in objects if o["kind"] == "Service"]
    pods = []
    for d in (o for o in objects if o["kind"] == "Deployment"):
        labels = d["spec"]["template"]["metadata"]["labels"]
        (container,) = d["spec"]["template"]["spec"]["containers"]
        names = tuple(s["metadata"]["name"] for s in services if s["spec"]["selector"].items() <= labels.items())
        command = [*container.get("command", []), *container.get("args", [])]
        mounts: tuple[tuple[str, str, str], ...] = ()
        if "--data-dir" in command:  # the container's own writable layer: an empty per-pod directory
            mounts = (("dir", "", command[command.index("--data-dir") + 1]),)
        probe = container.get("readinessProbe", {}).get("tcpSocket", {}).get("port")
        pods.append(PodSpec(name=f"{d['metadata']['name']}-0", aliases=names, command=tuple(command),
                            env=_env_list(container.get("env")), mounts=mounts, restart_policy="Always",
                            ready_port=int(probe) if probe else None))
    return pods


def job_pods(objects: list[Manifest]) -> list[PodSpec]:
    (job,) = [o for o in objects if o["kind"] in ("PyTorchJob", "TrainJob")]
    return pytorchjob_pods(job) if job["kind"] == "PyTorchJob" else trainjob_pods(job)


@dataclass
class PodRun:
    """A pod on its host: the current container process, its restarts and its logs (stdout and stderr merged)."""

    spec: PodSpec
    host: Host
    node: str = ""
    """The node it was placed on (``spec.nodeName``)."""
    logs: list[Path] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    restart_at: float | None = None
    exit_codes: list[int] = field(default_factory=list)

    @property
    def done(self) -> bool:
        """Exited, its exit code recorded by the kubelet's look and no restart due (a container that exited after
        the last look is not done yet: its code and its restartPolicy's verdict come with the next)."""
        return (self.proc is not None and self.proc.poll() is not None and self.restart_at is None
                and len(self.exit_codes) == len(self.logs))

    @property
    def succeeded(self) -> bool:
        return self.done and self.exit_codes[-1] == 0

    def log(self, tail: int | None = None) -> str:
        """Every run's log in order; with ``tail``, the first run's first and last ``tail`` characters (its first
        error is often the cause of the later runs' failures, and a launcher's summary at the end hides it) and the
        last ``tail`` of each later run."""
        parts = []
        for i, path in enumerate(self.logs):
            text = path.read_text(errors="replace")
            if tail and len(text) > (2 if i == 0 else 1) * tail:
                text = (text[:tail] + "\n[...]\n" if i == 0 else "[...]\n") + text[-tail:]
            parts.append(f"--- {path.name}\n{text}")
        return "".join(parts)


def _schedule(specs: list[PodSpec], nodes: list[tuple[Host, str]]) -> list[tuple[PodSpec, Host, str]]:
    """Each pod on the first free node its required node affinity admits (one pod per node)."""
    free, placed = list(nodes), []
    for spec in specs:
        slot = next(((h, n) for h, n in free if n not in spec.not_in
                     and (spec.only_in is None or n in spec.only_in)), None)
        if slot is None:
            raise Unschedulable(f"pod {spec.name}: 0/{len(nodes)} nodes are available: none free that matches the "
                                f"pod's node affinity (NotIn {list(spec.not_in)}, In {spec.only_in}); Pending")
        free.remove(slot)
        placed.append((spec, *slot))
    return placed


class Operator:
    """Starts the pods of rendered manifests on a cluster of namespace hosts and plays kubelet for them."""

    def __init__(self, cluster: Cluster, objects: list[Manifest], python_bin: Path | None = None,
                 max_restarts: int = MAX_RESTARTS, nodes: list[str] | None = None) -> None:
        self.cluster, self.objects, self.max_restarts = cluster, objects, max_restarts
        self.workdir = Path(cluster.workdir)
        self.bin = python_bin or Path(sys.executable).parent
        self.etcd = etcd_pods(objects)
        self.pods: list[PodRun] = []
        specs = [*self.etcd, *job_pods(objects)]
        if len(specs) > len(cluster.hosts):
            raise ValueError(f"{len(specs)} pods but only {len(cluster.hosts)} namespace hosts")
        placed = _schedule(specs, list(zip(cluster.hosts, nodes or [h.name for h in cluster.hosts], strict=True)))
        names = {s.name: h.ip for s, h, _ in placed}
        names.update({a: h.ip for s, h, _ in placed for a in s.aliases})
        for spec, host, node in placed:
            hosts_file = self.workdir / f"{spec.name}.hosts"
            own = [f"{host.ip}\t{spec.name} {' '.join(spec.aliases)}".rstrip()]  # the kubelet's entry first
            hosts_file.write_text("\n".join(["127.0.0.1\tlocalhost", *own,
                                             *(f"{ip}\t{n}" for n, ip in names.items() if ip != host.ip)]) + "\n")
            self.pods.append(PodRun(spec=spec, host=dataclasses.replace(host, hostname=spec.name,
                                                                        hosts_file=str(hosts_file)), node=node))

    def pod(self, name: str) -> PodRun:
        return next(p for p in self.pods if p.spec.name == name)

    @property
    def job(self) -> list[PodRun]:
        return [p for p in self.pods if p.spec not in self.etcd]

    def _argv(self, run: PodRun) -> list[str]:
        mounts: list[str] = []
        for kind, source, target in run.spec.mounts:
            if kind == "pvc":
                src = self.workdir / "pvc" / source
            elif kind == "dir":
                src = self.workdir / "pods" / run.spec.name / target.strip("/").replace("/", "_")
            else:
                src = Path()
            if kind != "tmpfs":
                src.mkdir(parents=True, exist_ok=True)
            mounts += ["tmpfs" if kind == "tmpfs" else "bind", str(src), target]
        command = list(run.spec.command)
        if not (self.bin / command[0]).exists() and "/" in command[0]:  # an image path such as /usr/local/bin/etcd
            command[0] = shutil.which(Path(command[0]).name) or command[0]
        return ["sh", "-c", _POD_ENTRY, "pod", str(len(run.spec.mounts)), *mounts, *command]

    def _start(self, run: PodRun) -> None:
        env = {"PATH": f"{self.bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root",
               "HOSTNAME": run.spec.name, **KUBELET_ENV, **run.spec.env}
        cwd = self.workdir / "pods" / run.spec.name
        cwd.mkdir(parents=True, exist_ok=True)
        log = self.workdir / f"{run.spec.name}.{len(run.logs)}.log"
        run.logs.append(log)
        with log.open("wb") as f:
            run.proc = self.cluster.popen(run.host, self._argv(run), stdout=f, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env, cwd=str(cwd))
        run.restart_at = None

    def start(self, ready_timeout: float = 60) -> None:
        """The etcd pods first, until ready (or fail), then every pod of the job at once."""
        for run in self.pods:
            if run.spec in self.etcd:
                self._start(run)
                if run.spec.ready_port is not None:
                    self._wait_ready(run, run.spec.ready_port, ready_timeout)
        for run in self.job:
            self._start(run)

    def _wait_ready(self, run: PodRun, port: int, timeout: float) -> None:
        probe = f"import socket; socket.create_connection(({run.host.ip!r}, {port}), 1).close()"
        deadline = time.monotonic() + timeout
        while self.cluster.run(run.host, [sys.executable, "-c", probe], timeout=10).returncode != 0:
            if (run.proc is not None and run.proc.poll() is not None) or time.monotonic() > deadline:
                raise RuntimeError(f"pod {run.spec.name} never became ready on port {port} "
                                   f"(exit {run.proc.poll() if run.proc else None}):\n{run.log()[-3000:]}")
            time.sleep(0.3)

    def _kubelet(self, run: PodRun) -> None:
        """Restart a container that exited, where its restartPolicy says so."""
        if run.proc is None or run.proc.poll() is None:
            return
        if run.restart_at is not None:
            if time.monotonic() >= run.restart_at:
                run.restarts += 1
                self._start(run)
            return
        code = run.proc.returncode
        code = 128 - code if code < 0 else code  # a signal, as the container runtime reports it: 128 + N
        if len(run.exit_codes) < len(run.logs):
            run.exit_codes.append(code)
        policy = run.spec.restart_policy
        retry = policy == "Always" or (policy == "OnFailure" and code != 0) or (policy == "ExitCode" and code >= 128)
        if retry and run.restarts < self.max_restarts:
            run.restart_at = time.monotonic() + RESTART_BACKOFF

    def wait(self, timeout: float, until: Any = None) -> bool:
        """Play kubelet until every job pod is done (or ``until()`` is true); False at the timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for run in self.pods:
                self._kubelet(run)
            if until is not None and until():
                return True
            if all(run.done for run in self.job):
                return True
            time.sleep(0.2)
        return False

    def kill_pod(self, name: str) -> list[int]:
        """SIGKILL every process of the pod (the container's main process and the workers it started)."""
        run = self.pod(name)
        pids = self.cluster.pids(run.host)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def logs(self) -> str:
        return "\n".join(f"=== pod {r.spec.name} exits {r.exit_codes} restarts {r.restarts}\n"
                         f"{r.log(tail=6000 // len(r.logs) if r.logs else None)}" for r in self.pods)
