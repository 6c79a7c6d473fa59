"""One job, described once: the shape, the command, and where it runs (its fields are jobs/fields.py). Each backend
renders it (what they all write, the ranks' program and the header, is in jobs/rendering.py; the rules of
``--heal`` in jobs/heal_options.py).

A JobSpec is validated on construction; a bad value is a ConfigError (exit code 2) raised before anything is
written or submitted. The guarantee for generated files: nothing a user passes as data becomes code.

- No option value may hold a control character or a line break (anything ``str.isprintable`` refuses, which
  covers every separator ``str.splitlines`` splits on): those values end up in directives, names and variables.
- Values that end up inside ``#SBATCH`` lines (which sbatch parses itself, without a shell) must not contain
  quotes, spaces, ``$``, ``;``, ``#`` or backslashes; values in the script body are quoted with shlex.quote, so
  any path works there; the job command's own arguments may hold anything (they are quoted words).
- The header's copy of the command line is one comment line whatever it holds: words that are not printable are
  written as bash ``$'...'`` strings, so a line break in an argument never ends the comment (``display_argv``).
- Names are what the target accepts: Slurm job names are plain words; Kubernetes names are RFC 1035 labels
  (``ddpkit-my_train`` is made ``ddpkit-my-train`` when ddpkit derives it, and refused when the user chose it).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ddpkit.base.errors import ConfigError
from ddpkit.base.shape import split_endpoint
from ddpkit.jobs.fields import JobFields
from ddpkit.jobs.heal_options import check_heal, check_mpi_heal
from ddpkit.jobs.interpreter import job_interpreter

__all__ = ["BACKENDS", "DDPKIT_COMMANDS", "JobSpec", "asks_for_mpi"]

BACKENDS = ("torchrun", "slurm", "mpi", "k8s")
#: Job commands that are ddpkit's own (run as ``python -m ddpkit CMD``); anything else must be a ``.py`` script.
DDPKIT_COMMANDS = ("check", "train", "bench", "env")
# Patterns are used with fullmatch: `$` in re.match also matches before a trailing newline.
_SIGNAL = re.compile(r"(?:B:)?(?:SIG)?(?P<name>USR1|USR2|TERM|INT|HUP|URG)(?:@(?P<secs>[0-9]{1,6}))?")
_TIME = re.compile(r"(?:[0-9]{1,6}-)?[0-9]{1,2}(?::[0-9]{2}){0,2}|[0-9]{1,9}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
# Kubernetes: the job name also names a Service (etcd) and the operator's per-worker Services, which must be
# RFC 1035 labels of at most 63 characters; 45 leaves room for the longest suffix ddpkit or the operator adds
# ("-snapshots", "-worker-NNNN"). kubernetes.io/docs/concepts/overview/working-with-objects/names/
_K8S_NAME = re.compile(r"[a-z]([-a-z0-9]{0,43}[a-z0-9])?")
_K8S_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DIRECTIVE_UNSAFE = re.compile(r"[\s'\"\\`$;#]")


@dataclass(frozen=True, kw_only=True)
class JobSpec(JobFields):
    """A distributed job, independent of where it runs: its fields (``JobFields``), validated on construction."""

    @property
    def kept_hosts(self) -> tuple[str, ...]:
        """``hosts`` without the excluded ones, in their order."""
        return tuple(h for h in self.hosts if h not in self.exclude)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend {self.backend!r} is unknown", f"one of {', '.join(BACKENDS)}",
                              "write ddpkit submit slurm|torchrun|mpi|k8s ...")
        if not self.command:
            raise ConfigError("no job command was given", "a command after --, such as -- check",
                              f"write ddpkit submit {self.backend} -j 1x2 -- check")
        first = self.command[0]
        if first not in DDPKIT_COMMANDS and not first.endswith(".py"):
            raise ConfigError(f"job command {first!r} is neither a ddpkit command nor a Python script",
                              f"one of {', '.join(DDPKIT_COMMANDS)}, or a path ending in .py",
                              "write -- check, -- train --epochs 3, or -- my_train.py ARGS")
        _check_printable(self)
        _check_submitter(self)
        if self.name and not _NAME.fullmatch(self.name):
            raise ConfigError(f"job name {self.name!r}", "letters, digits, '-', '_', '.' (up to 63)",
                              "pick a simple name such as ddpkit-check")
        if self.backend == "k8s" and self.name and not _K8S_NAME.fullmatch(self.name):
            raise ConfigError(f"job name {self.name!r} is not a valid Kubernetes name",
                              "lower-case letters, digits and '-', starting with a letter, ending with a letter or "
                              "digit, at most 45 characters (an RFC 1035 label, with room for the operator's suffixes)",
                              f"write --name {_k8s_name(self.name)}")
        _check_combinations(self)
        check_heal(self)
        _check_directive_values(self)
        _check_values(self)

    @property
    def job_name(self) -> str:
        if self.name:
            return self.name
        derived = f"ddpkit-{_stem(self.command[0])}"
        return _k8s_name(derived) if self.backend == "k8s" else derived

    @property
    def command_name(self) -> str:
        return self.command[0]

    @property
    def nodes_text(self) -> str:
        """Node count as torchrun takes it: N, or MIN:MAX for elastic jobs."""
        return self.shape.nodes_text()

    @property
    def signal_name(self) -> str | None:
        if self.signal is None:
            return None
        m = _SIGNAL.fullmatch(self.signal)
        assert m is not None  # validated
        return m["name"]

    def job_command(self) -> tuple[str, ...]:
        """The command with preemption wired in: ``train`` learns the signal (and to requeue) when Slurm sends one."""
        cmd = list(self.command)
        if cmd[0] == "train" and self.backend == "slurm":
            if self.signal_name and "--preempt-signal" not in cmd:
                cmd += ["--preempt-signal", self.signal_name]
            if self.requeue and "--requeue" not in cmd:
                cmd.append("--requeue")
        return tuple(cmd)


def _stem(first: str) -> str:
    base = first.rsplit("/", 1)[-1].removesuffix(".py")
    return re.sub(r"[^A-Za-z0-9_.-]", "-", base)[:56] or "job"


def _k8s_name(name: str) -> str:
    """A name made a valid Kubernetes name: lower case, '-' for anything else, trimmed to 45 characters."""
    label = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:45].rstrip("-")
    if not label or not label[0].isalpha():
        label = ("ddpkit-" + label)[:45].rstrip("-")
    return label


def _check_printable(spec: JobSpec) -> None:
    """Every option value ends up in a directive, a name, a variable or a YAML scalar: refuse line breaks and
    control characters there (the job command's arguments are quoted words and may hold anything)."""
    values: list[tuple[str, str | None]] = [
        ("--name", spec.name), ("--run-id", spec.run_id), ("--rdzv-endpoint", spec.rdzv_endpoint),
        ("--python", spec.python), ("--venv", spec.venv), ("--conda-env", spec.conda_env),
        ("--partition", spec.partition), ("--time", spec.time), ("--slurm-output", spec.output),
        ("--container-image", spec.container_image), ("--container-mounts", spec.container_mounts),
        ("--signal", spec.signal), ("--image", spec.image), ("--namespace", spec.namespace), ("--cpu", spec.cpu),
        ("--memory", spec.memory), ("--snapshot-size", spec.snapshot_size),
        *(("--env", f"{k}={v}") for k, v in spec.env), *(("--hosts", h) for h in spec.hosts),
        *(("--exclude-from", h) for h in spec.exclude)]
    for word in spec.command:
        try:
            word.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(f"job command argument {word!r} is not valid text (undecodable bytes)",
                              "arguments in the system's encoding", "pass the argument as UTF-8 text") from None
    for option, value in values:
        if value is not None and not value.isprintable():
            bad = next(ch for ch in value if not ch.isprintable())
            raise ConfigError(f"{option} {value!r} contains a line break or control character ({bad!r})",
                              "printable text: the value is written into the generated job's directives, names "
                              "or variables, where a line break would start a line of code",
                              f"remove the {bad!r} from {option}")


def asks_for_mpi(command: tuple[str, ...]) -> bool:
    """Does the job command average gradients (train, check: ``--grad-transport mpi``) or run its ops
    (bench: ``--transport mpi|both``) through MPI? Then its ranks must be started by an MPI launcher."""
    words = list(command)
    for i, word in enumerate(words):
        option, eq, value = word.partition("=")
        if not eq:
            value = words[i + 1] if i + 1 < len(words) else ""
        if (option == "--grad-transport" and value == "mpi") or (option == "--transport" and value in ("mpi", "both")):
            return True
    return False


def _check_submitter(spec: JobSpec) -> None:
    """The submitting interpreter is written into the job when nothing else names one: it must be a usable path."""
    if not job_interpreter(spec).submitter:
        return
    if not spec.submitter or not os.path.isabs(spec.submitter) or not spec.submitter.isprintable():
        raise ConfigError(f"the Python running ddpkit is {spec.submitter!r}, which cannot be written into the job",
                          "an absolute path of printable text (the job runs its ranks with it)",
                          "name the job's Python with --python PATH, or its environment with --venv / --conda-env")


def _check_combinations(spec: JobSpec) -> None:
    def clash(found: str, fix: str) -> ConfigError:
        return ConfigError(found, "options that agree with each other", fix)

    if spec.venv and spec.conda_env:
        raise clash("both --venv and --conda-env were given", "activate one environment: --venv PATH or --conda-env")
    if spec.container_image and (spec.venv or spec.conda_env):
        raise clash("--container-image with --venv/--conda-env: the container's Python runs the job, so a host "
                    "environment would not be used", "bake the environment into the image (ddpkit recipe docker)")
    if spec.container_mounts and not spec.container_image:
        raise clash("--container-mounts without --container-image", "add --container-image IMAGE")
    slurm_only = {"--partition": spec.partition, "--time": spec.time, "--tasks-per-rank": spec.tasks_per_rank,
                  "--container-image": spec.container_image, "--signal": spec.signal, "--requeue": spec.requeue}
    if spec.backend != "slurm":
        given = [k for k, v in slurm_only.items() if v]
        if given:
            raise clash(f"{', '.join(given)} only apply to the slurm backend, not {spec.backend}",
                        f"drop {', '.join(given)} or use ddpkit submit slurm")
    if spec.tasks_per_rank and spec.shape.is_elastic:
        raise clash(f"--tasks-per-rank with an elastic shape {spec.shape}", "drop --tasks-per-rank: elastic "
                    "jobs need a torchrun agent per node")
    if spec.static and spec.backend != "torchrun":
        raise clash(f"--static with the {spec.backend} backend", "drop --static: it is a torchrun rendezvous")
    if spec.static and spec.shape.is_elastic:
        raise clash(f"--static with an elastic shape {spec.shape}", "use c10d (drop --static) for elastic jobs")
    if spec.tasks_per_rank and spec.max_restarts:
        raise clash("--tasks-per-rank with --max-restarts", "drop one: restarts are torchrun's (one agent per node)")
    if asks_for_mpi(spec.command) and spec.backend in ("torchrun", "k8s"):
        raise clash(f"the job asks for MPI ({' '.join(spec.command[:1])} --grad-transport/--transport mpi) but the "
                    f"{spec.backend} backend starts its ranks with torchrun, not an MPI launcher",
                    "use ddpkit submit mpi, or submit slurm --tasks-per-rank (srun --mpi=pmix), or --grad-transport "
                    "gloo")
    if asks_for_mpi(spec.command) and spec.backend == "slurm" and not spec.tasks_per_rank:
        raise clash("the job asks for MPI (--grad-transport/--transport mpi) but each Slurm task would be a "
                    "torchrun agent, not an MPI rank", "add --tasks-per-rank: srun then starts every rank as one "
                    "MPI world (--mpi=pmix for Open MPI, --mpi=pmi2 with --mpi mpich)")
    if spec.backend == "mpi" and spec.shape.is_elastic and not spec.heal:
        raise clash(f"mpi with an elastic shape {spec.shape}", "use a fixed shape such as -j 2x4 (with --heal, "
                    "-j MIN:N runs on fewer hosts, down to MIN, once the spares are gone)")
    if spec.backend == "mpi" and spec.exclude and not spec.hosts:
        raise clash(f"--exclude-from names {', '.join(spec.exclude)} but mpi has no --hosts to remove them from",
                    "pass --hosts with the candidate hosts: the job runs on those the report did not name")
    kept = spec.kept_hosts
    if spec.backend == "mpi" and spec.heal:
        check_mpi_heal(spec, kept)
    elif spec.backend == "mpi" and spec.hosts and len(kept) != spec.shape.max_nodes:
        left = f" ({len(kept)} left after --exclude-from)" if len(kept) != len(spec.hosts) else ""
        raise clash(f"--hosts names {len(spec.hosts)} host(s){left} but -j asks for {spec.shape.max_nodes} node(s)",
                    "one host per node")
    if spec.backend == "torchrun" and spec.shape.max_nodes > 1 and not spec.rdzv_endpoint:
        raise ConfigError(f"-j {spec.shape} spans several nodes but no --rdzv-endpoint was given",
                          "HOST:PORT of the rendezvous on the first node", "add --rdzv-endpoint FIRST_NODE:29400")
    if spec.backend == "k8s" and not spec.image:
        raise ConfigError("the k8s backend needs a container image", "--image REGISTRY/IMAGE:TAG",
                          "build one with ddpkit recipe docker, push it, and pass --image")
    if spec.k8s_kind == "trainjob" and spec.k8s_rdzv != "c10d":
        raise clash("--k8s-rdzv etcd with --k8s-kind trainjob", "Trainer v2 runs torchrun with c10d: drop --k8s-rdzv")


def _check_directive_values(spec: JobSpec) -> None:
    """Values written into ``#SBATCH`` lines, which sbatch reads without a shell: no quoting is possible there."""
    for option, value in (("--slurm-output", spec.output), ("--partition", spec.partition), ("--time", spec.time)):
        if value is not None and (_DIRECTIVE_UNSAFE.search(value) or not value or value.startswith("-")):
            raise ConfigError(f"{option} {value!r} contains a space, quote, '$', ';', '#' or backslash",
                              "a plain value: sbatch reads it from an #SBATCH line, where it cannot be quoted",
                              "choose a value without those characters (paths in the job command may have them)")


def _check_values(spec: JobSpec) -> None:
    if spec.signal is not None and not _SIGNAL.fullmatch(spec.signal):
        raise ConfigError(f"--signal {spec.signal!r}", "SIGNAL@SECONDS such as USR1@90 (USR1, USR2, TERM, INT, HUP)",
                          "write --signal USR1@90")
    if spec.time is not None and not _TIME.fullmatch(spec.time):
        raise ConfigError(f"--time {spec.time!r}", "MINUTES, HH:MM:SS or D-HH[:MM[:SS]]", "write --time 01:00:00")
    if spec.port is not None and not 1 <= spec.port <= 65535:
        raise ConfigError(f"--port {spec.port}", "1..65535", "pick a free TCP port such as 29400")
    if spec.max_restarts < 0:
        raise ConfigError(f"--max-restarts {spec.max_restarts}", "0 or more", "pass --max-restarts 0 or more")
    if spec.rdzv_endpoint is not None:
        host, port = split_endpoint(spec.rdzv_endpoint)
        if (port is None or not 1 <= port <= 65535 or not host or _DIRECTIVE_UNSAFE.search(host)
                or host.startswith("-")):
            raise ConfigError(f"--rdzv-endpoint {spec.rdzv_endpoint!r}", "HOST:PORT with a port in 1..65535",
                              "write --rdzv-endpoint node1:29400")
    if spec.mpi_flavour not in ("openmpi", "mpich"):
        raise ConfigError(f"--mpi {spec.mpi_flavour!r}", "openmpi or mpich", "write --mpi openmpi")
    if spec.k8s_kind not in ("pytorchjob", "trainjob"):
        raise ConfigError(f"--k8s-kind {spec.k8s_kind!r}", "pytorchjob or trainjob", "write --k8s-kind pytorchjob")
    if spec.k8s_rdzv not in ("c10d", "etcd"):
        raise ConfigError(f"--k8s-rdzv {spec.k8s_rdzv!r}", "c10d or etcd", "write --k8s-rdzv c10d")
    if spec.gpus < 0:
        raise ConfigError(f"--gpus {spec.gpus}", "0 or more", "pass --gpus 0 on CPU nodes")
    for key, _ in spec.env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ConfigError(f"--env {key!r}", "NAME=VALUE with a shell variable name", "write --env NCCL_DEBUG=INFO")
    if spec.namespace is not None and not _K8S_NAMESPACE.fullmatch(spec.namespace):
        raise ConfigError(f"--namespace {spec.namespace!r} is not a valid Kubernetes namespace",
                          "lower-case letters, digits and '-', starting and ending with a letter or digit, at most 63",
                          "write --namespace ml-team")
    for host in spec.hosts:
        if not host or _DIRECTIVE_UNSAFE.search(host) or "," in host or host.startswith("-"):
            raise ConfigError(f"--hosts entry {host!r}", "host names separated by commas", "write --hosts a,b")
    for host in spec.exclude:
        if not host or _DIRECTIVE_UNSAFE.search(host) or "," in host or host.startswith("-"):
            raise ConfigError(f"--exclude-from names the host {host!r}", "host names (they go into an #SBATCH "
                              "line, a host list or a node name)",
                              "edit the report's bad_hosts, or drop --exclude-from")
