"""Property-based fuzzing of every command's options and of ``submit`` for every backend (issues 15 and 20).

For any command line drawn here: an exit code from the README's table, no traceback, no hang; for ``submit``,
the rendered file parses (bash / sbatch / a YAML loader) to exactly the intended commands, directives and
objects, every value the user gave only as data. In-process (``ddpkit.cli.main``) for speed: worker commands
are only parsed and validated (everything that happens before a rank starts), submit renders for real. A few
drawn command lines also go through the real CLI in a subprocess, under a timeout.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddpkit.base.errors import DdpkitError
from ddpkit.cli import _load, build_parser, main
from ddpkit.lifecycle import launch_options as _launch_options
from tests.helpers import ROOT, ddpkit_env
from tests.unit.rendered import intended, sbatch_directives, shell_commands

#: The README's exit-code table: every code ddpkit itself returns.
README_CODES = {int(c) for c in re.findall(r"^\| (\d+) \|", (ROOT / "README.md").read_text(), re.M)}
FUZZ = settings(max_examples=250, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

# hostile text: separators bash/YAML/sbatch treat as line breaks, quotes, expansions, markup, huge numbers
NASTY = ["\n", "\r", "\x0b", "\x0c", "\x1c", "\x85", "\u2028", "\u2029", "\x00", "\t", "'", '"', "\\", "$", "`",
         ";", "#", "&", "|", "*", "{", "}", "[", "]", ":", "-", " ", "=", "~", "%", "[/bold]", "[red]", "$(id)",
         "#SBATCH --partition=x", "---", "9" * 5000, "nan", "inf", "-1", "0", "²", "٣", "\U0001f600", "x" * 300]
TEXT = st.lists(st.sampled_from(NASTY) | st.text(max_size=6), max_size=4).map("".join)
NUMBER = st.sampled_from(["0", "-1", "1", "2", "3", "65535", "65536", "99999", "1e3", "nan", "inf", "9" * 5000, "²"])
VALUE = st.one_of(TEXT, NUMBER)

WORKER_OPTIONS = ["-n", "-j", "--rdzv-endpoint", "--rdzv-backend", "--rdzv-conf", "--run-id", "--local-addr",
                  "--max-restarts", "--backend"]
COMMAND_OPTIONS = {
    "env": ["--json", "--explain", "--connect", "--timeout"],
    "check": ["--timeout", "--phase-timeout", "--json", "--rank-lines"],
    "bench": ["--ops", "-b", "-e", "-f", "-i", "--dtype", "--redop", "--root", "-w", "--iters", "--min-busbw",
              "--pairs", "--pairs-size", "--pairs-iters", "--pairs-seconds", "--pairs-threshold", "--json", "--csv",
              "--plot", "--timeout"],
    "train": ["--model", "--width", "--depth", "--samples", "--batch-size", "--epochs", "--lr", "--seed",
              "--snapshot-path", "--save-every", "--keep", "--preempt-signal", "--drill", "--json"],
}
FLAGS = {"env": {"--json", "--explain", "--connect"}, "check": {"--rank-lines"}}


def _run(argv: list[str]) -> tuple[int, str]:
    """main(argv) for submit and parse-only commands; worker commands stop before any rank starts."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


def _validate_worker(argv: list[str]) -> int:
    """What ddpkit does with a worker command's line before any rank starts: parse, launch options, and the
    command's own validation. A DdpkitError maps to its exit code; anything else is a bug (the test fails)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args = build_parser(argv).parse_args(argv)
            _launch_options(args)
            module = _load(args.command)
            if args.command == "bench":
                module._options(args)
            elif args.command == "train":
                module.config_from_args(args)
        return 0
    except DdpkitError as exc:
        return exc.exit_code
    except SystemExit as exc:  # --help
        return int(exc.code or 0)


@st.composite
def worker_argv(draw: st.DrawFn) -> list[str]:
    command = draw(st.sampled_from(sorted(COMMAND_OPTIONS)))
    options = draw(st.lists(st.sampled_from(COMMAND_OPTIONS[command] + WORKER_OPTIONS), max_size=4))
    argv = [command]
    for option in options:
        if option in FLAGS.get(command, ()):
            argv.append(option)
        else:
            argv.append(f"{option}={draw(VALUE)}")  # '=': a value that starts with '-' stays a value
    return argv


@FUZZ
@given(worker_argv())
def test_every_worker_command_line_is_an_exit_code_from_the_table(argv: list[str]) -> None:
    assert _validate_worker(argv) in README_CODES


# ---- submit ---------------------------------------------------------------------------------------------------

BACKEND_ARGS = {"slurm": ["slurm", "-j", "2x2"], "slurm-tasks": ["slurm", "-j", "2x2", "--tasks-per-rank"],
                "torchrun": ["torchrun", "-j", "1x2"], "static": ["torchrun", "-j", "2x2", "--static",
                                                                  "--rdzv-endpoint=n1:29500"],
                "mpi": ["mpi", "-j", "2x2", "--hosts=a,b"], "mpich": ["mpi", "-j", "1x2", "--mpi=mpich"],
                "k8s": ["k8s", "-j", "2x2", "--image=reg/i:1"], "trainjob": ["k8s", "-j", "1x2", "--image=r/i",
                                                                             "--k8s-kind=trainjob"]}
#: options whose value is free text in the body or a YAML scalar: a placeholder is valid wherever they are
FREE_TEXT = {"shell": ["--venv", "--python", "--run-id"], "k8s": ["--run-id", "--cpu", "--memory", "--snapshot-size"]}
CHECKED = ["--name", "--signal", "--time", "--partition", "--slurm-output", "--port", "--max-restarts", "--namespace",
           "--gpus", "--rdzv-endpoint", "--container-mounts", "-j"]


@st.composite
def submit_case(draw: st.DrawFn) -> tuple[str, dict[str, str], list[str], list[str]]:
    backend = draw(st.sampled_from(sorted(BACKEND_ARGS)))
    kind = "k8s" if BACKEND_ARGS[backend][0] == "k8s" else "shell"
    free = draw(st.lists(st.sampled_from(FREE_TEXT[kind]), unique=True, max_size=3))
    values = {f"PLACEHOLDER{i}X": "v" + draw(TEXT) for i in range(len(free) + 2)}  # empty: ddpkit's default
    names = list(values)
    options = ["--run-id=fixed"]  # not random per render (a later --run-id wins)
    options += [f"{opt}={names[i]}" for i, opt in enumerate(free)]
    options.append(f"--env=EV={names[-2]}")
    checked = [f"{opt}={draw(VALUE)}" for opt in draw(st.lists(st.sampled_from(CHECKED), max_size=2))]
    job = [draw(st.sampled_from(["check", "train", "my_train.py"])), "--arg", names[-1]]
    return backend, values, options + checked, job


@FUZZ
@given(submit_case())
def test_submit_renders_user_values_only_as_data(case: tuple[str, dict[str, str], list[str], list[str]]) -> None:
    backend, values, options, job = case
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "job"

        def render(mapping: dict[str, str]) -> tuple[int, str | None]:
            def fill(word: str) -> str:
                for placeholder, value in mapping.items():
                    word = word.replace(placeholder, value)
                return word

            out.unlink(missing_ok=True)
            code, _ = _run(["submit", *BACKEND_ARGS[backend], "--dry-run", "-o", str(out),
                            *map(fill, options), "--", *map(fill, job)])
            return code, (out.read_bytes().decode() if out.exists() else None)

        code, text = render(values)
        assert code in README_CODES
        if code != 0:
            assert text is None, "nothing is written when the input is refused"
            return
        t_code, template = render({})
        assert t_code == 0 and template is not None and text is not None
        if BACKEND_ARGS[backend][0] == "k8s":
            docs = list(yaml.safe_load_all(text))
            expected = list(yaml.safe_load_all(_fill_yaml(template, values)))
            assert docs == expected
        else:
            assert shell_commands(text) == intended(template, values)
            assert sbatch_directives(text) == sbatch_directives(template)
        first = 0 if BACKEND_ARGS[backend][0] == "k8s" else 1  # after the shebang
        header = text.splitlines()[first:first + 2]
        assert header[0].startswith("# Generated by ddpkit") and header[1].startswith("# Do not edit"), header


def _fill_yaml(template: str, values: dict[str, str]) -> str:
    """The template's objects with each placeholder replaced, serialised again (values are YAML scalars)."""
    def fill(obj: object) -> object:
        if isinstance(obj, str):
            for placeholder, value in values.items():
                obj = obj.replace(placeholder, value)
            return obj
        if isinstance(obj, list):
            return [fill(x) for x in obj]
        if isinstance(obj, dict):
            return {k: fill(v) for k, v in obj.items()}
        return obj

    return yaml.safe_dump_all([fill(d) for d in yaml.safe_load_all(template)])


# ---- the real CLI, a few lines, bounded -----------------------------------------------------------------------

@settings(max_examples=4, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(worker_argv().filter(lambda a: "\x00" not in "".join(a)))
def test_the_real_cli_answers_bad_lines_without_a_traceback(argv: list[str]) -> None:
    """A subprocess (real argv encoding, real exit): only lines refused before running, so it stays quick."""
    if _validate_worker(argv) != 2:
        return
    res = subprocess.run([sys.executable, "-m", "ddpkit", *argv], capture_output=True, text=True, timeout=60,
                         env=ddpkit_env())
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and "ddpkit: error:" in res.stderr


# ---- one rule for an option's value of `--` or `-...` ------------------------------------------------------------

def _value_options() -> list[tuple[str, str]]:
    """(command, option) for every option that takes one value, read from the real parsers."""
    from ddpkit.cli import COMMANDS

    found = []
    for command in COMMANDS:
        parser = build_parser([command.name])
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        for action in sub.choices[command.name]._actions:
            if action.option_strings and action.nargs in (None, "?") and action.const is None:
                found.append((command.name, action.option_strings[-1]))
    return found


VALUE_OPTIONS = _value_options()


#: What each command needs beside the option under test (its positionals), so only that option can be refused.
POSITIONALS = {"recipe": ["venv"], "status": ["12"], "logs": ["12"], "report": ["x.json"]}


def _line(command: str, option: str, value: str) -> list[str]:
    if command == "submit":
        return ["submit", "slurm", *([] if option == "-j" else ["-j", "1x1"]), f"{option}={value}", "--", "check"]
    return [command, f"{option}={value}", *POSITIONALS.get(command, [])]


def test_every_value_option_was_found() -> None:
    assert len(VALUE_OPTIONS) > 60 and ("submit", "--time") in VALUE_OPTIONS and ("submit", "--hosts") in VALUE_OPTIONS


@pytest.mark.parametrize(("command", "option"), VALUE_OPTIONS)
def test_an_option_whose_value_is_double_dash_is_refused_naming_it(command: str, option: str) -> None:
    code, err = _run(_line(command, option, "--"))
    assert code == 2, err
    assert f"argument {option}" in err or option in err.split("error:", 1)[-1], err
    assert "Traceback" not in err


@FUZZ
@given(st.sampled_from(VALUE_OPTIONS), st.sampled_from(["-", "-x", "--", "---", "-1", "--help", "-- x", "-n"]))
def test_a_value_starting_with_a_dash_is_the_value_or_refused_naming_the_option(
        case: tuple[str, str], value: str) -> None:
    command, option = case
    argv = _line(command, option, value)
    parser = build_parser(argv)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    action = next(a for a in sub.choices[command]._actions if option in a.option_strings)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            args = parser.parse_args(argv)
    except DdpkitError as exc:
        assert exc.exit_code == 2
        assert any(o in exc.message() for o in action.option_strings), exc.message()
        return
    assert value != "--"
    taken = getattr(args, action.dest)
    assert taken == value or (isinstance(taken, list) and value in taken) or action.type is not None
