"""``ddpkit submit --exclude-from REPORT`` (issue 28): the hosts a check or bench report named bad are kept out
of the job, and a report's host names can never become code in the job file. (The rendered files themselves:
golden files, bash -n, shellcheck and the CRD schemas in test_jobs_render.py.)"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import yaml

from ddpkit.cli import main


def _report(tmp_path: Path, *hosts: str, slurm: str | None = None) -> str:
    path = tmp_path / "check.json"
    path.write_text(json.dumps({"kind": "check", "bad_hosts": [
        {"host": h, "slurm_node": slurm, "reasons": ["node-facts: nic.mtu 1500 (others 9000)"]} for h in hosts]}))
    return str(path)


def _submit(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["submit", *argv[:1], "--dry-run", *argv[1:]])
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("host", ["n1; rm -rf /", "n1,n2", "$(id)", "n1\n#SBATCH --uid=0", "-n1", "a'b", ""])
@pytest.mark.parametrize("backend", [["slurm", "-j", "1x2"], ["mpi", "-j", "2x1", "--hosts", "n0,n9"],
                                     ["k8s", "-j", "1x2", "--image", "r/i:1"]])
def test_a_hostile_host_name_in_the_report_is_refused(tmp_path: Path, backend: list[str], host: str) -> None:
    code, out, err = _submit(*backend, "--exclude-from", _report(tmp_path, host), "--", "check")
    assert code == 2 and out == "", out
    assert "ddpkit: error: --exclude-from" in err and repr(host) in err and "Traceback" not in err


def test_slurm_excludes_by_the_slurm_node_name(tmp_path: Path) -> None:
    code, out, _ = _submit("slurm", "-j", "2x1", "--exclude-from", _report(tmp_path, "gpu7.cluster", slurm="gpu7"),
                           "--", "check")
    assert code == 0 and "#SBATCH --exclude=gpu7\n" in out


def test_k8s_keeps_every_pod_off_the_excluded_nodes(tmp_path: Path) -> None:
    code, out, _ = _submit("k8s", "-j", "3x1", "--image", "r/i:1", "--exclude-from", _report(tmp_path, "n2", "n5"),
                           "--", "check")
    assert code == 0
    job = next(d for d in yaml.safe_load_all(out) if d and d["kind"] == "PyTorchJob")
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        terms = replica["template"]["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert terms == [{"matchExpressions": [{"key": "kubernetes.io/hostname", "operator": "NotIn",
                                                "values": ["n2", "n5"]}]}]


def test_a_healthy_report_excludes_nothing(tmp_path: Path) -> None:
    code, out, _ = _submit("slurm", "-j", "2x1", "--exclude-from", _report(tmp_path), "--", "check")
    assert code == 0 and "--exclude" not in out.split("\n", 2)[2]  # the header names the option, nothing else


@pytest.mark.parametrize(("content", "message"), [
    (None, "no such file"), ("{", "not readable as JSON"), ('{"kind": "bench"}', "without a bad_hosts list"),
    ('[1, 2]', "without a bad_hosts list")])
def test_a_bad_report_is_exit_2(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content)
    code, _, err = _submit("slurm", "-j", "1x2", "--exclude-from", str(path), "--", "check")
    assert code == 2 and message in err and "Traceback" not in err


def test_mpi_needs_hosts_to_exclude_from_and_enough_left(tmp_path: Path) -> None:
    report = _report(tmp_path, "n2")
    code, _, err = _submit("mpi", "-j", "2x1", "--exclude-from", report, "--", "check")
    assert code == 2 and "mpi has no --hosts to remove them from" in err
    code, _, err = _submit("mpi", "-j", "2x1", "--hosts", "n1,n2", "--exclude-from", report, "--", "check")
    assert code == 2 and "--hosts names 2 host(s) (1 left after --exclude-from) but -j asks for 2 node(s)" in err
    code, out, _ = _submit("mpi", "-j", "2x1", "--hosts", "n1,n2,n3", "--exclude-from", report, "--", "check")
    assert code == 0 and "--host n1:1,n3:1" in out and "MASTER_ADDR=n1" in out


def _heal_ledger(directory: Path, *hosts: str) -> None:
    from ddpkit.rundir.ledger import HostExcluded, Ledger

    for host in hosts:
        Ledger(directory).append(HostExcluded(attempt=1, time=1.0, host=host, reason="rank 1 stopped answering"))


def test_a_heal_run_directory_keeps_the_hosts_it_took_out(tmp_path: Path) -> None:
    """Issue 38: the next attempt of a healed run (its run directory, or one host's ledger of a run across hosts)
    keeps off the hosts the run took out, a torn last line skipped; a directory with no ledger is refused."""
    _heal_ledger(tmp_path / "run", "n2")
    _heal_ledger(tmp_path / "run" / "h1", "n2", "n5")  # heal.elastic: one ledger per host
    with (tmp_path / "run" / "ledger.jsonl").open("a") as f:
        f.write('{"kind": "host-excluded", "host": "n7"')  # a supervisor killed mid-line
    code, out, _ = _submit("slurm", "-j", "2x1", "--exclude-from", str(tmp_path / "run"), "--", "check")
    assert code == 0 and "#SBATCH --exclude=n2,n5\n" in out
    code, out, _ = _submit("mpi", "-j", "2x1", "--hosts", "n1,n2,n3", "--exclude-from",
                           str(tmp_path / "run" / "h1" / "ledger.jsonl"), "--", "check")
    assert code == 0 and "--host n1:1,n3:1 " in out
    assert "# Left out (--exclude-from: a report's bad hosts, or those a heal run took out): n2, n5" in out
    (tmp_path / "empty").mkdir()
    code, _, err = _submit("k8s", "-j", "2x1", "--image", "r/i:1", "--exclude-from", str(tmp_path / "empty"), "--",
                           "check")
    assert code == 2 and "no heal ledger (ledger.jsonl) there" in err and "Traceback" not in err
