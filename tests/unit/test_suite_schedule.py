"""The suite's distribution over xdist workers (tests/conftest.py): a module in WHOLE runs whole on one worker, the
sleeping module is handed out first, and the rest is spread test by test. Checked on a real
``pytest -n 2 --dist loadgroup`` run of a small tree under this conftest: the xdist_group marks it replaced were
silently ignored under pytest 9.2, which only a run shows."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import FIRST, scope_of

HERE = Path(__file__).resolve().parents[1]

RECORD = '''
import os, time
import pytest


@pytest.mark.parametrize("i", range({n}))
def test_it(i):
    with open(os.environ["RECORD"], "a") as f:
        f.write(f"{{os.environ['PYTEST_XDIST_WORKER']}} {{__name__}} {{i}}\\n")
    time.sleep(0.2)
'''


def test_the_scope_is_the_module_for_whole_modules_else_the_test() -> None:
    assert scope_of("tests/infra/test_heal_slurm.py::test_a[x]") == "tests/infra/test_heal_slurm.py::test_a[x]"
    assert scope_of("tests/multiproc/test_train.py::test_b") == "tests/multiproc/test_train.py"
    assert scope_of("tests/multiproc/test_watch.py::test_c") == "tests/multiproc/test_watch.py::test_c"
    assert scope_of("tests/unit/test_x.py::test_d[tests/infra/y]") == "tests/unit/test_x.py::test_d[tests/infra/y]"


def test_a_real_run_keeps_a_module_on_one_worker_hands_out_the_first_first_and_spreads_the_rest(
        tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    for folder in ("multiproc", "unit"):
        (tests / folder).mkdir(parents=True)
    shutil.copy(HERE / "conftest.py", tests / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tests / "multiproc" / "test_train.py").write_text(RECORD.format(n=6))  # in WHOLE
    first = tmp_path / FIRST[0]
    first.write_text(RECORD.format(n=2))
    (tests / "unit" / "test_spread.py").write_text(RECORD.format(n=8))
    record = tmp_path / "record.txt"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p",
                           "no:cacheprovider", "tests"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RECORD": str(record)})
    assert done.returncode == 0, done.stdout + done.stderr
    runs = [line.split() for line in record.read_text().splitlines()]
    assert len(runs) == 16
    workers = {module: {w for w, m, _ in runs if m == module} for module in ("test_train", "test_spread")}
    assert len(workers["test_train"]) == 1, runs  # one worker: its module fixture would start once
    assert len(workers["test_spread"]) == 2, runs  # two workers, and single tests go to both
    (pauses_worker,) = {w for w, m, _ in runs if m == "test_watch_pauses"}
    assert [m for w, m, _ in runs if w == pauses_worker][:2] == ["test_watch_pauses"] * 2, runs
