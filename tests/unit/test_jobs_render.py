"""Generated job files: golden files per backend (hostile paths included), bash -n and shellcheck on every
script, Kubernetes manifests against the Kubeflow CRDs and the core API schemas, bad input -> exit code 2.

Regenerate the golden files after an intended change: ``DDPKIT_UPDATE_GOLDEN=1 pytest tests/unit/test_jobs_render.py``
(then read the diff).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml

from ddpkit import __version__
from ddpkit.cli import main
from tests.helpers import SHARED, ddpkit_env, require_tools, run_ddpkit

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "jobs"

HOSTILE = "/opt/my envs/it's $HOME"
#: A check report naming two bad hosts (--exclude-from); its path is normalised in the golden files.
BAD_HOSTS = str(GOLDEN / "bad_hosts.json")
#: A heal run whose ledger took node-b out after a host fault (issue 38): the next attempt keeps off it.
HEAL_RUN = str(GOLDEN / "heal_run")
#: The interpreter that "ran ddpkit submit" in the golden files (never this machine's venv path).
SUBMITTER = "/opt/ddpkit venv/it's $HOME/bin/python"
CASES: dict[str, list[str]] = {
    "slurm_check.sbatch": ["slurm", "-j", "2x4", "--venv", HOSTILE, "--partition", "cpu", "--time", "01:00:00",
                           "--", "check"],
    "slurm_train_preempt.sbatch": ["slurm", "-j", "1:4x2", "--conda-env", "ddp env", "--signal", "USR1@90",
                                   "--requeue", "--max-restarts", "3", "--env", "NCCL_DEBUG=INFO", "--", "train",
                                   "--epochs", "20", "--snapshot-path", "/shared/snap shots/it's $job.pt"],
    "slurm_submitter_python.sbatch": ["slurm", "-j", "2x2", "--", "check"],
    "slurm_tasks_container.sbatch": ["slurm", "-j", "2x2", "--tasks-per-rank", "--container-image",
                                     "/images/my image's.sqsh", "--container-mounts", "/data/a b:/data",
                                     "--no-exclusive", "--", "my_train.py", "--data", "/data/a b"],
    "torchrun_multinode.sh": ["torchrun", "-j", "2x4", "--rdzv-endpoint", "node1:29400", "--run-id", "r1",
                              "--venv", "/opt/v $1", "--", "check"],
    "torchrun_standalone.sh": ["torchrun", "-j", "1x2", "--run-id", "r2", "--", "train", "--snapshot-path",
                               "a b'c"],
    "torchrun_static.sh": ["torchrun", "-j", "2x2", "--static", "--rdzv-endpoint", "10.0.0.1:29500", "--python",
                           "/opt/py 3/bin/python", "--", "check"],
    "mpi_openmpi.sh": ["mpi", "-j", "2x2", "--hosts", "n1,n2", "--allow-run-as-root", "--env", "X=a b'c", "--",
                       "check"],
    "mpi_mpich.sh": ["mpi", "-j", "1x2", "--mpi", "mpich", "--venv", "/v w", "--", "check"],
    "mpi_script.sh": ["mpi", "-j", "2x2", "--hosts", "n1,n2", "--venv", HOSTILE, "--", "my dir/ddp's.py", "3", "1",
                      "--data", "$HOME/a b"],
    "k8s_pytorchjob_etcd_train.yaml": ["k8s", "-j", "1:3x2", "--image", "reg/ddpkit:cpu", "--k8s-rdzv", "etcd",
                                       "--run-id", "r3", "--namespace", "ml", "--", "train", "--snapshot-path",
                                       "/snapshots/it's $x.pt"],
    "k8s_pytorchjob_c10d.yaml": ["k8s", "-j", "2x4", "--image", "reg/ddpkit:cuda", "--gpus", "1", "--run-id", "r4",
                                 "--", "check"],
    "k8s_trainjob.yaml": ["k8s", "-j", "2x2", "--image", "reg/ddpkit:cpu", "--k8s-kind", "trainjob", "--run-id",
                          "r5", "--", "train"],
    # issue 37: a user's script runs through `ddpkit run` under torchrun and in a PyTorchJob (watched, a safe exit)
    "torchrun_script.sh": ["torchrun", "-j", "1x2", "--run-id", "r8", "--", "my dir/train's.py", "--lr", "0.1"],
    "k8s_pytorchjob_script.yaml": ["k8s", "-j", "2x2", "--image", "reg/user:cpu", "--run-id", "r9", "--",
                                   "train.py", "--epochs", "3"],
    # issue 28: the hosts a report named bad, kept out of the next job
    "slurm_exclude.sbatch": ["slurm", "-j", "2x2", "--exclude-from", BAD_HOSTS, "--", "check"],
    "mpi_exclude.sh": ["mpi", "-j", "2x2", "--hosts", "n1,n2,n3", "--exclude-from", BAD_HOSTS, "--", "check"],
    "k8s_pytorchjob_exclude.yaml": ["k8s", "-j", "2x2", "--image", "reg/ddpkit:cpu", "--run-id", "r6",
                                    "--exclude-from", BAD_HOSTS, "--", "check"],
    "k8s_trainjob_exclude.yaml": ["k8s", "-j", "2x2", "--image", "reg/ddpkit:cpu", "--k8s-kind", "trainjob",
                                  "--run-id", "r7", "--exclude-from", BAD_HOSTS, "--", "check"],
    # issue 38: a healed Slurm job: N+K nodes, its supervisor in the batch shell, each attempt an srun step
    "slurm_heal_train.sbatch": ["slurm", "-j", "1:2x2", "--spare-nodes", "1", "--heal", "--on-fail", "drain",
                                "--max-attempts", "4", "--run-dir", "/shared/runs/it's $x", "--venv", HOSTILE,
                                "--", "train", "--epochs", "20", "--snapshot-path", "/shared/snap shots/it's $job.pt"],
    # issue 38: the next attempt of a healed run, off the node its ledger took out after a host fault
    "k8s_pytorchjob_healed.yaml": ["k8s", "-j", "2x1", "--image", "reg/ddpkit:cpu", "--run-id", "r10",
                                   "--exclude-from", HEAL_RUN, "--", "train"],
}


def _normalise(text: str) -> str:
    return text.replace(f"ddpkit {__version__}", "ddpkit VERSION").replace(BAD_HOSTS, "bad_hosts.json") \
        .replace(HEAL_RUN, "heal_run")


def _cli(*full: str) -> tuple[int, str]:
    """Run the CLI in-process (fast): exit code and stdout; sys.argv is what the real CLI's header reads, and
    sys.executable the interpreter a job without an environment option runs with."""
    out = io.StringIO()
    with mock.patch.object(sys, "argv", ["ddpkit", *full]), mock.patch.object(sys, "executable", SUBMITTER), \
            contextlib.redirect_stdout(out):
        code = main(list(full))
    return code, out.getvalue()


def _render(argv: list[str]) -> str:
    """In-process; one case also runs as a real process (test_the_real_cli_prints_the_same)."""
    code, out = _cli("submit", *argv[:1], "--dry-run", *argv[1:])
    assert code == 0, argv
    return out


def test_the_real_cli_prints_the_same(rendered: dict[str, str]) -> None:
    argv = CASES["slurm_check.sbatch"]
    res = run_ddpkit("submit", *argv[:1], "--dry-run", *argv[1:], timeout=60)
    assert res.returncode == 0 and res.stdout == rendered["slurm_check.sbatch"], res.stderr


@pytest.fixture(scope="module")
def rendered() -> dict[str, str]:
    return {name: _render(argv) for name, argv in CASES.items()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(rendered: dict[str, str], name: str) -> None:
    text = _normalise(rendered[name])
    golden = GOLDEN / name
    if os.environ.get("DDPKIT_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert golden.exists(), f"no golden file {golden}: run with DDPKIT_UPDATE_GOLDEN=1 and review it"
    assert text == golden.read_text()


def test_every_file_starts_with_version_and_command(rendered: dict[str, str]) -> None:
    for name, text in rendered.items():
        first = text.splitlines()[1 if text.startswith("#!") else 0]
        assert first.startswith(f"# Generated by ddpkit {__version__} from: ddpkit submit {CASES[name][0]} "), name


def test_hostile_values_survive_the_shell(rendered: dict[str, str], tmp_path: Path) -> None:
    """The quoted words come back byte for byte when bash parses the script (no expansion of $HOME or $job)."""
    script = rendered["slurm_train_preempt.sbatch"]
    srun = script[script.index("srun "):]
    echo = tmp_path / "words.sh"
    echo.write_text("printf '%s\\n' " + srun.split("-m ddpkit train", 1)[1].replace("\\\n", " "))
    out = subprocess.run(["bash", str(echo)], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[:4] == ["--epochs", "20", "--snapshot-path", "/shared/snap shots/it's $job.pt"]
    venv_line = next(line for line in rendered["slurm_check.sbatch"].splitlines() if line.startswith("source "))
    probe = tmp_path / "probe.sh"
    probe.write_text(venv_line.replace("source ", "printf '%s' ", 1))
    assert subprocess.run(["bash", str(probe)], capture_output=True, text=True).stdout == HOSTILE + "/bin/activate"


def _scripts(rendered: dict[str, str]) -> dict[str, str]:
    return {n: t for n, t in rendered.items() if not n.endswith(".yaml")}


def test_scripts_pass_bash_n_and_shellcheck(rendered: dict[str, str], tmp_path: Path) -> None:
    require_tools("bash", "shellcheck")
    scripts = dict(_scripts(rendered))
    for kind in ("venv", "enroot"):
        code, scripts[f"recipe_{kind}.sh"] = _cli("recipe", kind, "--path", HOSTILE)
        assert code == 0
    for name, text in scripts.items():
        path = tmp_path / name
        path.write_text(text)
        syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert syntax.returncode == 0, f"{name}: {syntax.stderr}"
        # SC2016 (info: "expressions don't expand in single quotes") is the point: a '$' in a path stays literal
        lint = subprocess.run(["shellcheck", "--shell=bash", "--exclude=SC2016", str(path)], capture_output=True,
                              text=True)
        assert lint.returncode == 0, f"{name}:\n{lint.stdout}"


def _crd_schema(filename: str) -> dict[str, Any]:
    crds = SHARED / "data" / "k8s-crds"
    if not crds.is_dir():
        pytest.skip(f"the Kubeflow CRDs are not at {crds} (shared test data, not copied into the repo)")
    crd = yaml.safe_load((crds / filename).read_text())
    served = [v for v in crd["spec"]["versions"] if v.get("served")]
    return served[0]["schema"]["openAPIV3Schema"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("name", [n for n in CASES if n.endswith(".yaml")])
def test_manifests_validate_against_crds_and_core_schemas(rendered: dict[str, str], name: str) -> None:
    import jsonschema
    import kubernetes_validate

    docs = [d for d in yaml.safe_load_all(rendered[name]) if d]
    kinds = [d["kind"] for d in docs]
    for doc in docs:
        if doc["kind"] == "PyTorchJob":
            jsonschema.validate(doc, _crd_schema("kubeflow.org_pytorchjobs.yaml"))
        elif doc["kind"] == "TrainJob":
            jsonschema.validate(doc, _crd_schema("trainer.kubeflow.org_trainjobs.yaml"))
        else:
            kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)
    if "etcd" in name:
        assert kinds == ["Deployment", "Service", "PersistentVolumeClaim", "PyTorchJob"]
        job = docs[-1]["spec"]
        assert job["elasticPolicy"]["rdzvBackend"] == "etcd-v2"
        assert job["elasticPolicy"]["rdzvHost"] == docs[1]["metadata"]["name"]
        assert job["elasticPolicy"]["rdzvId"] == "r3"  # never the operator's default "none"
        pod = job["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
        claim = next(v for v in pod["volumes"] if "persistentVolumeClaim" in v)
        assert claim["persistentVolumeClaim"]["claimName"] == docs[2]["metadata"]["name"]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]


def test_a_broken_manifest_fails_the_crd_schema(rendered: dict[str, str]) -> None:
    """The schema check can fail: a misspelt field (what envsubst templates drift into) is caught."""
    import jsonschema

    job = next(d for d in yaml.safe_load_all(rendered["k8s_trainjob.yaml"]) if d["kind"] == "TrainJob")
    job["spec"]["trainer"]["numProcPerNode"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(job, _crd_schema("trainer.kubeflow.org_trainjobs.yaml"))


def test_recipes_are_pinned_to_the_versions_in_use(tmp_path: Path) -> None:
    torch_version = metadata.version("torch").split("+")[0]
    assert _cli("recipe", "conda", "--name", "ddp", "-o", str(tmp_path / "environment.yml"))[0] == 0
    env = yaml.safe_load((tmp_path / "environment.yml").read_text())
    pip = env["dependencies"][-1]["pip"]
    assert env["name"] == "ddp" and f"torch=={torch_version}" in pip and f"ddpkit=={__version__}" in pip
    docker = _cli("recipe", "docker", "--cuda", "12.4")[1]
    assert re.search(rf"^RUN pip install torch=={re.escape(torch_version)} --index-url \S+/cu124$", docker, re.M)
    assert docker.splitlines()[0].startswith(f"# Generated by ddpkit {__version__} from: ddpkit recipe docker")
    assert _cli("recipe", "docker")[1].count("/whl/cpu") == 1
    bad = run_ddpkit("recipe", "singularity", timeout=60)
    assert bad.returncode == 2 and "recipe 'singularity' is unknown" in bad.stderr


BAD = [
    (["slurm", "-j", "2x", "--", "check"], "job shape '2x'"),
    (["slurm", "-j", "0x4", "--", "check"], "zero nodes"),
    (["pbs", "-j", "1x2", "--", "check"], "backend 'pbs' is unknown"),
    (["slurm", "-j", "1x2", "--slurm-output", "my logs/%j.out", "--", "check"], "contains a space"),
    (["slurm", "-j", "1x2", "--partition", "a'b", "--", "check"], "contains a space, quote"),
    (["slurm", "-j", "1x2", "--venv", "/a", "--conda-env", "b", "--", "check"], "both --venv and --conda-env"),
    (["slurm", "-j", "1x2", "--container-image", "i.sqsh", "--venv", "/a", "--", "check"], "container"),
    (["slurm", "-j", "1:2x2", "--tasks-per-rank", "--", "check"], "elastic shape"),
    (["torchrun", "-j", "2x2", "--", "check"], "no --rdzv-endpoint"),
    (["torchrun", "-j", "1x2", "--partition", "cpu", "--", "check"], "only apply to the slurm backend"),
    (["mpi", "-j", "2x2", "--hosts", "a", "--", "check"], "one host per node"),
    (["k8s", "-j", "2x2", "--", "check"], "needs a container image"),
    (["slurm", "-j", "1x2", "--signal", "KILL@10", "--", "train"], "--signal 'KILL@10'"),
    (["slurm", "-j", "1x2", "--", "rm", "-rf", "/"], "neither a ddpkit command nor a Python script"),
    (["torchrun", "-j", "1x2", "--wait", "--", "check"], "--wait with the torchrun backend"),
    (["torchrun", "-j", "1:2x2", "--static", "--rdzv-endpoint", "a:1", "--", "check"], "--static with an elastic"),
    (["slurm", "-j", "1x2", "--static", "--", "check"], "--static with the slurm backend"),
    (["slurm", "-j", "2x1", "--spare-nodes", "1", "--", "check"], "--spare-nodes without --heal"),
    (["slurm", "-j", "2x1", "--heal", "--spare-nodes", "-1", "--", "train"], "--spare-nodes -1"),
    (["slurm", "-j", "2x1", "--heal", "--max-attempts", "0", "--", "train"], "--max-attempts 0"),
    (["slurm", "-j", "2x1", "--heal", "--max-restarts", "2", "--", "train"], "--heal with --max-restarts 2"),
    (["slurm", "-j", "2x1", "--heal", "--silent-after", "2", "--", "train"], "--silent-after 2"),
    (["slurm", "-j", "2x1", "--heal", "--container-image", "i.sqsh", "--", "train"], "--heal with --container"),
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_exit_2_with_a_message(argv: list[str], message: str, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "job.out"
    full = ["submit", *argv[:1], "-o", str(out), *argv[1:]]
    with mock.patch.object(sys, "argv", ["ddpkit", *full]):
        code = main(full)
    captured = capsys.readouterr()
    assert code == 2, captured
    assert message in captured.err and "Fix:" in captured.err
    assert not out.exists() and captured.out == ""


def test_bad_input_through_the_real_cli_has_no_traceback(tmp_path: Path) -> None:
    res = run_ddpkit("submit", "slurm", "-j", "2x", "--", "check", timeout=60, cwd=tmp_path)
    assert res.returncode == 2 and "job shape '2x'" in res.stderr and "Traceback" not in res.stderr
    assert res.stdout == "" and not (tmp_path / "logs").exists()


def test_k8s_without_kubectl_says_so(tmp_path: Path) -> None:
    res = run_ddpkit("submit", "k8s", "-j", "1x2", "--image", "i", "--", "check", timeout=60,
                     env=ddpkit_env(PATH=str(tmp_path)))  # a PATH without kubectl
    assert res.returncode == 2 and "kubectl is not on PATH, so nothing was applied" in res.stderr
