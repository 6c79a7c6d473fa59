"""Every input is checked before anything runs or is written: exit code 2, a message, no traceback
(issue 20 section 2, issue 15 part 2). Each test is one class of input that once crashed, hung or ran anyway.

In-process: these fail while parsing, before any rank or process group starts.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from ddpkit.base.inputs import local_rank_limit
from ddpkit.check import render
from ddpkit.cli import main
from ddpkit.verdicts.outcome import Outcome


def ddpkit(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def refused(*argv: str, says: str) -> str:
    code, _, err = ddpkit(*argv)
    assert code == 2, (argv, err)
    assert says in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("command", ["env", "check", "train", "bench"])
def test_rdzv_endpoint_port_out_of_range_is_refused(command: str) -> None:
    refused(command, "-j", "2x1", "--rdzv-endpoint", "node1:99999", says="port in 1..65535")


@pytest.mark.parametrize("argv", [["check", "-j", "1x" + "9" * 5000], ["env", "-j", "9" * 5000 + "x1"],
                                  ["bench", "-b", "9" * 5000], ["bench", "-e", "9" * 5000 + "M"],
                                  ["submit", "slurm", "-j", "9" * 5000 + "x1", "--", "check"]],
                         ids=["check-j", "env-j", "bench-b", "bench-e", "submit-j"])
def test_numbers_beyond_the_integer_string_limit_are_refused(argv: list[str]) -> None:
    refused(*argv, says="")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-1", "x"])
@pytest.mark.parametrize(("command", "option"), [("check", "--timeout"), ("check", "--phase-timeout"),
                                                 ("bench", "--timeout")])
def test_timeouts_must_be_finite_and_positive(command: str, option: str, value: str) -> None:
    refused(command, f"{option}={value}", says="a finite number of seconds above zero")


@pytest.mark.parametrize("command", ["train", "check", "env", "bench"])
@pytest.mark.parametrize("count", ["0", "-1", "x"])
def test_zero_or_negative_rank_counts_are_refused(command: str, count: str) -> None:
    """``train -n 0`` once ran silently as one process and exited 0."""
    refused(command, f"-n={count}", says="a whole number of ranks, 1 or more")


@pytest.mark.parametrize("argv", [["env", "-n", "99999"], ["check", "-j", "1x99999"], ["train", "-n", "100000"]])
def test_more_ranks_than_this_machine_runs_are_refused_at_once(argv: list[str]) -> None:
    """``ddpkit env -n 99999`` once forked until it hung past a minute; now: exit 2 naming the limit."""
    limit, _ = local_rank_limit()
    assert limit < 99999
    err = refused(*argv, says="at most ")
    assert "MiB of memory available" in err and "DDPKIT_MAX_LOCAL_RANKS" in err


def test_the_local_rank_limit_can_be_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPKIT_MAX_LOCAL_RANKS", "3")
    refused("env", "-n", "4", says="at most 3")


@pytest.mark.parametrize("ops", ["", ",", " , "])
def test_bench_with_no_ops_is_refused(ops: str) -> None:
    """``bench --ops ''`` once ran nothing and reported PASS."""
    refused("bench", f"--ops={ops}", says="names no collective")


LONG = "a" * 300
PATHS = ["/proc/ddpkit.json", "~nouser-ddpkit/x.json", f"/tmp/{LONG}.json", "/tmp"]


@pytest.mark.parametrize("path", PATHS, ids=["proc", "nouser", "long", "directory"])
@pytest.mark.parametrize("argv", [["check", "--json"], ["bench", "--json"], ["bench", "--csv"], ["bench", "--plot"],
                                  ["train", "--json"], ["submit", "slurm", "-j", "1x1", "--dry-run", "-o"]],
                         ids=lambda a: " ".join(a[:2]))
def test_unwritable_output_paths_are_refused_before_the_run(argv: list[str], path: str) -> None:
    tail = ["--", "check"] if argv[0] == "submit" else []
    refused(*argv, path, *tail, says=argv[-1])


@pytest.mark.parametrize("path", ["/proc/snapshot.pt", "~nouser-ddpkit/s.pt", f"/tmp/{LONG}.pt"],
                         ids=["proc", "nouser", "long"])
def test_snapshot_path_that_cannot_be_written_is_refused_before_training(path: str) -> None:
    """``--snapshot-path /proc/x.pt`` once trained an epoch, then rank 0 died with a traceback and exit 1."""
    refused("train", "--snapshot-path", path, says="--snapshot-path")


def test_env_table_prints_values_as_text_not_markup(monkeypatch: pytest.MonkeyPatch) -> None:
    """``TORCHELASTIC_RUN_ID='[/bold]' ddpkit env`` once crashed rich; ``[red]x`` restyled the table."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}.items():
        monkeypatch.setenv(key, value)
    for run_id in ("[/bold]", "[red]x"):
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
        code, out, err = ddpkit("env")
        assert code == 0, err
        assert run_id in out


def test_check_tables_print_values_as_text_not_markup(capsys: pytest.CaptureFixture[str]) -> None:
    record = {"group_rank": 0, "host": "[/bold]host", "rank": 0, "slot": 0, "iface": "[red]eth0", "ip": "10.0.0.1",
              "gpu_uuid": None}
    record.update({key: f"[/{key}]" for _, key in render._COLUMNS if key not in record})
    render.print_nodes([record])
    render.print_checks([Outcome(name="[/x]", status="PASS", detail="[red]detail[/red] [/bold]")])
    render.print_verdict("verdict: FAIL (exit 1): [/bold]")
    out = capsys.readouterr().out
    for text in ("[/bold]host", "[red]eth0", "[/x]", "[red]detail[/red] [/bold]", "(exit 1): [/bold]"):
        assert text in out


def test_an_existing_writable_output_directory_is_fine(tmp_path: Path) -> None:
    code, _, err = ddpkit("submit", "slurm", "-j", "1x1", "--dry-run", "-o", str(tmp_path / "new" / "job.sbatch"),
                          "--", "check")
    assert code == 0, err
    assert (tmp_path / "new" / "job.sbatch").is_file()


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-1"])
def test_env_timeout_must_be_finite_and_positive(value: str) -> None:
    """``ddpkit env --connect --timeout nan`` once reached init_process_group with a timedelta of nan seconds."""
    refused("env", "--connect", f"--timeout={value}", says="a finite number of seconds above zero")


@pytest.mark.parametrize("endpoint", ["node1:²", "node1:٣٣", "node1:" + "9" * 5000])
def test_split_endpoint_refuses_ports_that_are_not_ascii_digits(endpoint: str) -> None:
    """Python API callers (JobSpec, rendezvous) once got a ValueError from int('²'): a ConfigError says why."""
    from ddpkit.base.errors import ConfigError
    from ddpkit.base.shape import split_endpoint

    with pytest.raises(ConfigError, match="ASCII digits"):
        split_endpoint(endpoint)
    assert split_endpoint("node1:29400") == ("node1", 29400) and split_endpoint("node1") == ("node1", None)
