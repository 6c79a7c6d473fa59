"""The k8s backend: a Kubeflow PyTorchJob (training-operator v1) or a Kubeflow Trainer v2 TrainJob, as YAML.

PyTorchJob: a fixed shape is a plain job, a Master and N-1 Workers, each pod a torchrun agent on a static
rendezvous at the master's Service (the operator sets ``PET_NNODES``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``).
An elastic shape, or etcd, is Workers only with an ``elasticPolicy``: rendezvous c10d on worker 0, or etcd
(``--k8s-rdzv etcd``: an etcd Deployment and Service are rendered too, and the etcd-v2 protocol is used: more
reliable here than the legacy ``etcd`` backend). The rendezvous id is explicit (``elasticPolicy.rdzvId``): the
operator's default is the literal "none", so two jobs would share an etcd rendezvous (pytorch/pytorch#82160).
Every pod gets a memory-backed ``/dev/shm``; a ``train`` job also gets a shared PVC mounted at ``/snapshots``.
tests/infra/test_k8s_operator.py runs every variant with the operators' pod environment on namespace hosts.

TrainJob: the ``torch-distributed`` runtime; ``numNodes``, ``numProcPerNode``, ``resourcesPerNode``; the same
volumes through ``runtimePatches``.
"""

from __future__ import annotations

from typing import Any

from ddpkit.base.errors import ConfigError
from ddpkit.jobs.rendering import header, torchrun_entry
from ddpkit.jobs.spec import DDPKIT_COMMANDS, JobSpec

__all__ = ["ETCD_IMAGE", "SNAPSHOT_DIR", "manifests", "render"]

ETCD_IMAGE = "quay.io/coreos/etcd:v3.5.17"
SNAPSHOT_DIR = "/snapshots"
#: The port of every PyTorchJob pod's container (training-operator's ``pytorchjob-port``, added where a manifest names
#: none) and of the master's Service: under ``--heal live`` the master pod's live agent listens on it.
PYTORCHJOB_PORT = 23456
Manifest = dict[str, Any]


def _meta(spec: JobSpec, name: str, **labels: str) -> Manifest:
    meta: Manifest = {"name": name}
    if spec.namespace:
        meta["namespace"] = spec.namespace
    meta["labels"] = {"app.kubernetes.io/created-by": "ddpkit", **labels}
    return meta


def _resources(spec: JobSpec) -> Manifest:
    amount: Manifest = {"cpu": spec.cpu, "memory": spec.memory}
    if spec.gpus:
        amount["nvidia.com/gpu"] = spec.gpus
    return {"requests": dict(amount), "limits": dict(amount)}


def _volumes(spec: JobSpec) -> tuple[list[Manifest], list[Manifest]]:
    volumes: list[Manifest] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    mounts: list[Manifest] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if spec.command_name == "train":
        volumes.append({"name": "snapshots", "persistentVolumeClaim": {"claimName": _pvc_name(spec)}})
        mounts.append({"name": "snapshots", "mountPath": SNAPSHOT_DIR})
    return volumes, mounts


def _pvc_name(spec: JobSpec) -> str:
    return f"{spec.job_name}-snapshots"


def _env(spec: JobSpec) -> list[Manifest]:
    # torchrun's shared agent/worker store breaks worker restarts (pytorch/pytorch#135712)
    env = [{"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"}]
    return env + [{"name": k, "value": v} for k, v in spec.env]


def _command(spec: JobSpec) -> list[str]:
    """torchrun reads its shape and rendezvous from the operator's PET_* variables; train snapshots on the PVC.
    It runs under ``ddpkit step --show-all``: the pod's log keeps every line (it is the only full log a pod has)
    and a failed pod's log ends with the digest, cause first."""
    entry = torchrun_entry(spec)
    if spec.command_name == "train" and "--snapshot-path" not in entry:
        entry += ["--snapshot-path", SNAPSHOT_DIR + "/"]  # a trailing slash: train keeps its snapshots in the dir
    return ["ddpkit", "step", "--show-all", "--", "torchrun", *entry]


def _live_command(spec: JobSpec) -> list[str]:
    """Under ``--heal live``: ddpkit's own agent in every pod, no torchrun (``ddpkit.heal.live_hosts``). The master
    pod's listens at its Service (the endpoint) and runs the live agent; each worker pod's connects to it and forks
    the ranks it is given; worker pods beyond the first N-1 stand by (a lost pod's ranks go to one of them)."""
    s = spec.shape
    options = ["-j", f"{s.max_nodes}x{s.nproc_per_node}", "--rdzv-endpoint",
               f"{spec.job_name}-master-0:{PYTORCHJOB_PORT}", "--run-id", spec.run_id or spec.job_name, "--heal",
               "live", "--max-attempts", str(spec.max_attempts)]
    cmd = list(spec.job_command())
    if cmd[0] == "train":
        if "--snapshot-path" not in cmd:
            cmd += ["--snapshot-path", SNAPSHOT_DIR + "/"]
        if spec.run_dir is None:
            options += ["--run-dir", f"{SNAPSHOT_DIR}/ddpkit-run"]  # the ledger where every pod sees it
    if spec.run_dir is not None:
        options += ["--run-dir", spec.run_dir]
    if cmd[0] in DDPKIT_COMMANDS:
        return ["ddpkit", cmd[0], *options, *cmd[1:]]
    return ["ddpkit", "run", *options, "--", *cmd]


def _plain(spec: JobSpec) -> bool:
    """A fixed shape on c10d: Master + Workers, no elasticPolicy (an elastic shape or etcd needs the policy)."""
    return not spec.shape.is_elastic and spec.k8s_rdzv == "c10d"


def pytorchjob(spec: JobSpec) -> Manifest:
    """Plain: a Master and N-1 Workers; the operator gives every pod PET_NNODES, PET_NODE_RANK and
    PET_MASTER_ADDR/PORT (the master's Service), so torchrun's static rendezvous runs on the master pod.
    Elastic: Workers only, the rendezvous from elasticPolicy (c10d on worker 0, or the etcd Service)."""
    s = spec.shape
    volumes, mounts = _volumes(spec)
    env = _env(spec)
    if _plain(spec) and spec.max_restarts:  # the operator sets PET_MAX_RESTARTS only from an elasticPolicy
        env.append({"name": "PET_MAX_RESTARTS", "value": str(spec.max_restarts)})
    container: Manifest = {"name": "pytorch", "image": spec.image, "imagePullPolicy": "IfNotPresent",
                           "command": _live_command(spec) if spec.heal_live else _command(spec), "env": env,
                           "resources": _resources(spec), "volumeMounts": mounts}
    # under --heal live a lost pod stays down: its ranks went on in a standby pod, and the job left its host out
    restart = "Never" if spec.heal_live else "OnFailure"

    def replica(count: int) -> Manifest:
        return {"replicas": count, "restartPolicy": restart,
                "template": {"spec": {"containers": [container], "volumes": volumes, **_affinity(spec)}}}

    job_spec: Manifest = {}
    if _plain(spec):
        replicas = {"Master": replica(1)}
        workers = s.max_nodes - 1 + (spec.spare_nodes if spec.heal_live else 0)  # the standby pods
        if workers:
            replicas["Worker"] = replica(workers)
    else:
        elastic: Manifest = {"rdzvBackend": "c10d", "rdzvId": spec.run_id or spec.job_name,
                             "minReplicas": s.min_nodes, "maxReplicas": s.max_nodes, "maxRestarts": spec.max_restarts}
        if spec.k8s_rdzv == "etcd":
            elastic.update(rdzvBackend="etcd-v2", rdzvHost=_etcd_name(spec), rdzvPort=2379)
        job_spec["elasticPolicy"] = elastic
        replicas = {"Worker": replica(s.max_nodes)}
    job_spec.update(nprocPerNode=str(s.nproc_per_node), pytorchReplicaSpecs=replicas)
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": _meta(spec, spec.job_name),
            "spec": job_spec}


def trainjob(spec: JobSpec) -> Manifest:
    s = spec.shape
    if s.is_elastic:
        raise ConfigError(f"an elastic shape {s} for a TrainJob", "a fixed shape such as -j 2x4 (Trainer v2 "
                          "TrainJobs have a fixed numNodes)", "use -j NNODESxNPROC or --k8s-kind pytorchjob")
    volumes, mounts = _volumes(spec)
    patch_pod = {"volumes": volumes, "containers": [{"name": "node", "volumeMounts": mounts}], **_affinity(spec)}
    patch = {"manager": "ddpkit", "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [
        {"name": "node", "template": {"spec": {"template": {"spec": patch_pod}}}}]}}}}
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob", "metadata": _meta(spec, spec.job_name),
            "spec": {"runtimeRef": {"name": "torch-distributed"},
                     "trainer": {"image": spec.image, "command": _command(spec), "env": _env(spec),
                                 "numNodes": s.max_nodes, "numProcPerNode": s.nproc_per_node,
                                 "resourcesPerNode": _resources(spec)},
                     "runtimePatches": [patch]}}


def _affinity(spec: JobSpec) -> Manifest:
    """Pods kept off the nodes a report named bad (``--exclude-from``): a required nodeAffinity ``NotIn`` rule on
    the well-known ``kubernetes.io/hostname`` label; nothing without exclusions (the manifest stays as it was)."""
    if not spec.exclude:
        return {}
    term = {"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn", "values": list(spec.exclude)}]}
    return {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [term]}}}}


def _etcd_name(spec: JobSpec) -> str:
    return f"{spec.job_name}-etcd"


def etcd(spec: JobSpec) -> list[Manifest]:
    name = _etcd_name(spec)
    labels = {"app": name}
    container = {"name": "etcd", "image": ETCD_IMAGE,
                 "command": ["/usr/local/bin/etcd", "--name", "etcd", "--data-dir", "/var/lib/etcd", "--enable-v2",
                             "--listen-client-urls", "http://0.0.0.0:2379",
                             "--advertise-client-urls", f"http://{name}:2379",
                             "--listen-peer-urls", "http://0.0.0.0:2380", "--initial-cluster-state", "new"],
                 "ports": [{"name": "client", "containerPort": 2379}],
                 "readinessProbe": {"tcpSocket": {"port": 2379}, "periodSeconds": 2}}
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(spec, name, **labels),
                  "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                           "template": {"metadata": {"labels": labels}, "spec": {"containers": [container]}}}}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(spec, name, **labels),
               "spec": {"selector": labels, "ports": [{"name": "client", "port": 2379, "targetPort": 2379}]}}
    return [deployment, service]


def pvc(spec: JobSpec) -> Manifest:
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": _meta(spec, _pvc_name(spec)),
            "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": spec.snapshot_size}}}}


def manifests(spec: JobSpec) -> list[Manifest]:
    """Every object to apply, in order: etcd (if used), the snapshot PVC (train), then the job."""
    out: list[Manifest] = []
    if spec.k8s_kind == "pytorchjob" and spec.k8s_rdzv == "etcd":
        out += etcd(spec)
    if spec.command_name == "train":
        out.append(pvc(spec))
    out.append(trainjob(spec) if spec.k8s_kind == "trainjob" else pytorchjob(spec))
    return out


def render(spec: JobSpec) -> str:
    try:
        import yaml
    except ImportError:
        raise ConfigError("PyYAML is not installed", "the k8s extra", "pip install 'ddpkit[k8s]'") from None
    class _Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:  # no &id001 anchors: plain, readable manifests
            return True

    docs = [yaml.dump(m, Dumper=_Dumper, sort_keys=False, default_flow_style=False) for m in manifests(spec)]
    return header(spec) + "---\n" + "---\n".join(docs)
