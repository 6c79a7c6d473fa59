"""From naming bad hosts to acting on them: ``bad_hosts`` for the JSON, the commands that take them out of a
scheduler, and ``--on-fail drain`` under Slurm (no torch import).

As the cluster tools do it (LBNL NHC, Google's cluster-health-scanner, notes in docs/check.md): Slurm drains a node
with a reason that ``sinfo -R`` shows (``scontrol update NodeName=N State=DRAIN Reason=...``; ``State=RESUME``
undoes it); Kubernetes cordons a node or taints it ``NoSchedule``. ``print`` (the default) only prints those
commands; ``drain`` runs the Slurm one, and only inside a Slurm job where ``scontrol`` exists. ddpkit never
touches a Kubernetes cluster by itself.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["ON_FAIL", "TAINT", "add_on_fail_argument", "commands", "drain", "merge", "report_lines"]

ON_FAIL = ("print", "drain")
TAINT = "ddpkit.io/unhealthy"
REASON_MAX = 200  # a Slurm reason is one line in sinfo -R: keep it readable

BadHost = dict[str, Any]


def add_on_fail_argument(p: Any) -> None:
    p.add_argument("--on-fail", choices=ON_FAIL, default="print",
                   help="what to do about the hosts a failure names: print the commands that drain (Slurm) or "
                        "cordon and taint (Kubernetes) them (default), or drain: run the Slurm command (only "
                        "inside a Slurm job, where scontrol exists)")


def merge(entries: Iterable[tuple[str, str | None, str]]) -> list[BadHost]:
    """``(host, slurm node or None, reason)`` triples -> ``[{host, slurm_node, reasons}]``, hosts in first-seen
    order, each reason once."""
    out: dict[str, BadHost] = {}
    for host, node, reason in entries:
        entry = out.setdefault(host, {"host": host, "slurm_node": node, "reasons": []})
        entry["slurm_node"] = entry["slurm_node"] or node
        if reason not in entry["reasons"]:
            entry["reasons"].append(reason)
    return list(out.values())


def _reason(tool: str, entry: Mapping[str, Any]) -> str:
    text = f"ddpkit {tool}: " + "; ".join(entry["reasons"])
    text = " ".join(text.split())  # one line
    return text if len(text) <= REASON_MAX else text[:REASON_MAX - 3] + "..."


def slurm_argv(tool: str, entry: Mapping[str, Any]) -> list[str]:
    node = entry.get("slurm_node") or entry["host"]
    return ["scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={_reason(tool, entry)}"]


def commands(tool: str, bad: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
    """The exact shell commands, quoted: ``slurm`` (drain), ``kubernetes`` (cordon, then taint)."""
    slurm = [shlex.join(slurm_argv(tool, e)) for e in bad]
    k8s = []
    for e in bad:
        node = shlex.quote(str(e["host"]))
        k8s += [f"kubectl cordon {node}", f"kubectl taint nodes {node} {TAINT}={tool}:NoSchedule --overwrite"]
    return {"slurm": slurm, "kubernetes": k8s}


def report_lines(tool: str, bad: Sequence[Mapping[str, Any]]) -> list[str]:
    """What ``--on-fail print`` prints after the verdict."""
    if not bad:
        return []
    lines = [f"bad hosts: {len(bad)}"]
    lines += [f"  {e['host']}: {'; '.join(e['reasons'])}" for e in bad]
    cmds = commands(tool, bad)
    lines.append("to take them out of Slurm (ddpkit --on-fail drain runs this inside a Slurm job):")
    lines += [f"  {c}" for c in cmds["slurm"]]
    lines.append("of Kubernetes (the host name is the node name where pods run with hostNetwork; "
                 "else: kubectl get pod POD -o wide):")
    lines += [f"  {c}" for c in cmds["kubernetes"]]
    return lines


def drain(tool: str, bad: Sequence[Mapping[str, Any]], environ: Mapping[str, str] | None = None) -> list[str]:
    """Drain each bad host's Slurm node; one line per host saying what happened. Never outside a Slurm job."""
    environ = os.environ if environ is None else environ
    if not bad:
        return []
    scontrol = shutil.which("scontrol")
    if scontrol is None or not environ.get("SLURM_JOB_ID"):
        why = "scontrol is not on PATH" if scontrol is None else "this is not a Slurm job (no SLURM_JOB_ID)"
        return [f"--on-fail drain: nothing drained: {why}; the commands, to run by hand:",
                *(f"  {c}" for c in commands(tool, bad)["slurm"])]
    lines = []
    for entry in bad:
        argv = [scontrol, *slurm_argv(tool, entry)[1:]]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
            ok, said = done.returncode == 0, (done.stderr or done.stdout).strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            ok, said = False, str(exc)
        node = argv[2].removeprefix("NodeName=")
        lines.append(f"--on-fail drain: {node} drained ({argv[-1]})" if ok else
                     f"--on-fail drain: draining {node} failed: {said or 'scontrol exit non-zero'} "
                     "(draining needs a Slurm operator or administrator)")
    return lines
