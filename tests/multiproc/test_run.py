"""`ddpkit run`: a torchrun-style script (tests/workers/ddp_user.py), unchanged, with ranks ddpkit starts (-n 2) or
torchrun starts; the script's traceback and exit code are the command's; -m runs a module; failures before the
script starts are one error line, exit 2. (mpirun, MPICH and srun: tests/infra/test_run_launchers.py.)"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ddpkit_env, run_ddpkit

pytestmark = pytest.mark.multiproc
SCRIPT = Path(__file__).resolve().parents[1] / "workers" / "ddp_user.py"


def results(stdout: str) -> dict[int, dict[str, str]]:
    """The script's RESULT lines by rank: every key=value it printed (argv as its repr)."""
    rows = {}
    # ranks share one pipe: two lines may arrive run together ("...pyRESULT rank=1 ..."), so match across the text
    for m in re.finditer(r"RESULT rank=(\d+) local=(\d+) world=(\d+) same=(\w+) host=(\S+) main=(\S+) "
                         r"argv=(\[.*?\]) file=(.*?)(?=RESULT|\n|$)", stdout):
        rows[int(m[1])] = dict(zip(("rank", "local", "world", "same", "host", "main", "argv", "file"),
                                   m.groups(), strict=True))
    return rows


def assert_replicas_identical(stdout: str, world: int) -> dict[int, dict[str, str]]:
    rows = results(stdout)
    assert sorted(rows) == list(range(world)), stdout
    assert all(r["same"] == "True" and r["world"] == str(world) and r["main"] == "__main__" for r in rows.values())
    return rows


@pytest.fixture
def script(tmp_path: Path) -> Path:
    """The script in a directory with a space, run by a relative path (argv[0] as written)."""
    target = tmp_path / "my dir" / "ddp_user.py"
    target.parent.mkdir()
    shutil.copy(SCRIPT, target)
    return target


def test_two_local_ranks_run_the_script_unchanged(script: Path) -> None:
    res = run_ddpkit("run", "-n", "2", "--", "my dir/ddp_user.py", "a", "--lr", "1", timeout=180, cwd=script.parents[1])
    assert res.returncode == 0, res.stdout + res.stderr
    rows = assert_replicas_identical(res.stdout, 2)
    for rank, row in rows.items():
        assert row["argv"] == "['my dir/ddp_user.py', 'a', '--lr', '1']"  # sys.argv as `python SCRIPT ARGS` sets it
        assert row["file"] == str(script)  # __file__ absolute, as Python 3.9+ sets it
        assert row["local"] == str(rank)


def test_under_torchrun_the_variables_are_torchruns(script: Path) -> None:
    torchrun = Path(sys.executable).parent / "torchrun"
    res = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", "2", "-m", "ddpkit", "run", "--",
                          str(script)], capture_output=True, text=True, timeout=180, env=ddpkit_env())
    assert res.returncode == 0, res.stdout + res.stderr
    assert_replicas_identical(res.stdout, 2)
    assert "overriding" not in res.stderr  # torchrun's own values, re-exported unchanged


def test_one_process_without_launcher_is_a_world_of_one(script: Path) -> None:
    res = run_ddpkit("run", "--", str(script), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    assert_replicas_identical(res.stdout, 1)


def test_a_script_that_raises_keeps_its_traceback_and_exit_code(tmp_path: Path) -> None:
    boom = tmp_path / "boom.py"
    boom.write_text("import sys\n\ndef f():\n    raise ValueError('boom from the script')\n\nf()\n")
    res = run_ddpkit("run", "--", str(boom), timeout=60)
    assert res.returncode == 1
    assert res.stderr.startswith("Traceback (most recent call last):\n"), res.stderr
    assert f'File "{boom}", line 6, in <module>' in res.stderr
    assert res.stderr.rstrip().endswith("ValueError: boom from the script")
    assert "ddpkit" not in res.stderr.replace(str(tmp_path), "")  # none of ddpkit's frames or words
    broken = tmp_path / "broken.py"  # a SyntaxError: where, as Python shows it, and none of ddpkit's frames
    broken.write_text("import sys\ndef f(:\n    pass\n")
    plain = subprocess.run([sys.executable, str(broken)], capture_output=True, text=True, timeout=60)
    res = run_ddpkit("run", "--", str(broken), timeout=60)
    assert (res.returncode, res.stderr) == (plain.returncode, plain.stderr) == (1, res.stderr), res.stderr
    assert res.stderr.startswith(f'  File "{broken}", line 2') and "SyntaxError" in res.stderr, res.stderr
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\nprint('bye')\nsys.exit(5)\n")
    res = run_ddpkit("run", "--", str(exits), timeout=60)
    assert (res.returncode, res.stdout, res.stderr) == (5, "bye\n", "")


def test_with_ranks_started_by_ddpkit_the_first_failure_is_named(tmp_path: Path) -> None:
    boom = tmp_path / "boom.py"
    boom.write_text("import os, sys\nif os.environ['RANK'] == '1':\n    raise SystemExit(4)\n")
    res = run_ddpkit("run", "-n", "2", "--", str(boom), timeout=120)
    assert res.returncode == 4, res.stderr
    assert "rank 1" in res.stderr and "exit code 4" in res.stderr


def test_a_module_runs_as_python_m_runs_it(tmp_path: Path) -> None:
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "job.py").write_text("import os, sys\nprint('MOD', __name__, sys.argv[1:], os.path.basename(sys.argv[0]),"
                                " os.environ['RANK'], os.environ['WORLD_SIZE'])\n")
    res = run_ddpkit("run", "-m", "--", "mypkg.job", "x", "--y", timeout=60, cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "MOD __main__ ['x', '--y'] job.py 0 1"


@pytest.mark.parametrize(("argv", "needle"), [
    (["run", "--", "no such script.py"], "no script at 'no such script.py'"),
    (["run"], "no script to run"),
    (["run", "-m", "--", "no_such_module_here"], "no module named 'no_such_module_here'"),
])
def test_failures_before_the_script_are_one_error_line(argv: list[str], needle: str) -> None:
    res = run_ddpkit(*argv, timeout=60)
    assert res.returncode == 2
    assert res.stderr.startswith(f"ddpkit: error: {needle}"), res.stderr
    assert "Traceback" not in res.stderr


def test_a_launcher_contradiction_stops_before_the_script(script: Path) -> None:
    env = ddpkit_env(OMPI_COMM_WORLD_RANK="1", OMPI_COMM_WORLD_SIZE="2", RANK="0", WORLD_SIZE="2")
    res = subprocess.run([sys.executable, "-m", "ddpkit", "run", "--", str(script)], capture_output=True, text=True,
                         timeout=60, env=env)
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("ddpkit: error:") and "RESULT" not in res.stdout


@pytest.mark.slow  # a minute or more
def test_a_script_that_destroys_its_group_and_exits_ends_every_time(script: Path) -> None:
    """The script's DDP model must not be freed before the process exits: its Reducer then drops the destroyed
    process group's last reference and the join of gloo's threads hung (3 runs in 10 of `run -n 2`)."""
    for _ in range(4):
        res = run_ddpkit("run", "-n", "2", "--", str(script), timeout=90)
        assert res.returncode == 0, res.stdout + res.stderr
        assert_replicas_identical(res.stdout, 2)


@pytest.mark.parametrize("late", ["", "abort-late:rank=0:ms=1500"])
def test_the_watch_is_on_by_default_and_names_the_stalled_rank(tmp_path: Path, late: str) -> None:
    """``late``: rank 0 leaves 1.5 s after rank 1, whose exit breaks the all-reduce rank 0's backward waits in
    ("Connection closed by peer"): that error is the abort's doing and rank 0 still exits 3, not 1 (CI saw 1)."""
    job = Path(__file__).resolve().parent / "watch_user_job.py"
    events = tmp_path / "events.jsonl"
    res = run_ddpkit("run", "-n", "2", "--hang-after", "4", "--events", str(events), "--", str(job), "--fault",
                     "sleep", "--fault-rank", "1", "--fault-step", "20", timeout=150,
                     env=ddpkit_env(DDPKIT_FAULTS=late) if late else None)
    assert res.returncode == 3, res.stderr[-4000:]
    # the ranks ddpkit stopped are said as such: neither is "the rank that failed first" (issue 36)
    assert "failed first" not in res.stderr and "stopped with exit 3: ddpkit stopped them" in res.stderr, \
        res.stderr[-2000:]
    assert "ddpkit watch: HANG" in res.stderr
    assert "rank 1 on host" in res.stderr and "has not entered" in res.stderr, res.stderr[-4000:]
    assert "--- rank 0 on host" in res.stderr and "--- rank 1 on host" in res.stderr  # every live rank's stack
    assert "time.sleep(3600)" in res.stderr
    # each stack starts in the user's script, not in ddpkit's runner (cli.py, script.py) or torch's worker wrapper
    main_stacks = re.findall(r"Thread MainThread \(0x[0-9a-f]+\), most recent call last:\n(.*)\n", res.stderr)
    assert len(main_stacks) == 2 and all("watch_user_job.py" in first for first in main_stacks), main_stacks
    assert any('"hang"' in line for line in events.read_text().splitlines())
    off = run_ddpkit("run", "--no-watch", "--", str(job), "--steps", "3", timeout=120)
    assert off.returncode == 0, off.stderr
    assert "ddpkit watch" not in off.stderr


# python PROBE MARK CODE [--mpi]: MARK.<rank>.atexit from an atexit handler ("ran"; with --mpi, which starts MPI
# through mpi4py as the MPI transport does, whether MPI was already finalized there), MARK.<rank>.teardown from a
# destructor that only the interpreter's teardown runs (when __main__'s globals are cleared); exits with CODE
TEARDOWN_PROBE = """
import atexit, os, sys
mpi = None
if "--mpi" in sys.argv:
    from mpi4py import MPI as mpi
mark = f"{sys.argv[1]}.{os.environ.get('RANK', '0')}"
class Probe:
    def __del__(self, _open=open, _path=mark + ".teardown"):
        _open(_path, "w").write("reached")
probe = Probe()
atexit.register(lambda path=mark + ".atexit": open(path, "w").write(str(mpi.Is_finalized()) if mpi else "ran"))
print("script done", flush=True)
sys.exit(sys.argv[2] if not sys.argv[2].isdigit() else int(sys.argv[2]))
"""


@pytest.mark.parametrize("runner", [("ddpkit", "run", "--no-watch"), ("ddpkit.watch",)])
@pytest.mark.parametrize(("code", "expected"), [("0", 0), ("7", 7), ("a message", 1)])
def test_a_rank_leaves_with_the_scripts_exit_code_without_the_interpreters_teardown(
        runner: tuple[str, ...], code: str, expected: int, tmp_path: Path) -> None:
    """`ddpkit run` and `python -m ddpkit.watch` end a rank after the script's atexit handlers, with its exit code
    (sys.exit's message printed as Python prints it), and never reach the interpreter's teardown, where torch 2.13's
    gloo can abort a rank that succeeded (src/ddpkit/process/exiting.py). `python SCRIPT` is the control: the probe
    sees it."""
    script = tmp_path / "probe.py"
    script.write_text(TEARDOWN_PROBE)
    mark = tmp_path / "mark"
    plain = subprocess.run([sys.executable, str(script), str(mark) + "-plain", code], capture_output=True,
                           text=True, timeout=60)
    assert plain.returncode == expected and Path(f"{mark}-plain.0.teardown").exists(), plain.stderr  # the probe works
    done = subprocess.run([sys.executable, "-m", *runner, "--", str(script), str(mark), code], capture_output=True,
                          text=True, timeout=120, env=ddpkit_env())
    assert done.returncode == expected, done.stdout + done.stderr
    assert "script done" in done.stdout and Path(f"{mark}.0.atexit").read_text() == "ran"
    assert not Path(f"{mark}.0.teardown").exists(), "the interpreter's teardown ran"
    assert ("a message" in done.stderr) == (code == "a message"), done.stderr
