"""The suite's distribution over xdist workers (tests/conftest.py): a module in WHOLE runs whole on one worker, the
sleeping module is handed out first, and the rest is spread test by test; from three workers on, the modules in
WAITING go to one worker and the rest to the others. Checked on real ``pytest -n N --dist loadgroup`` runs of a small
tree under this conftest: the xdist_group marks it replaced were silently ignored under pytest 9.2, which only a run
shows."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import FIRST, WAITING, scope_of

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


def _run(tmp_path: Path, workers: int, modules: dict[str, int]) -> list[list[str]]:
    """``pytest -n WORKERS --dist loadgroup`` on a tree of MODULES (path: how many tests) under this conftest: who
    ran what, in order (worker, module, index)."""
    tests = tmp_path / "tests"
    tests.mkdir()
    shutil.copy(HERE / "conftest.py", tests / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    for module, n in modules.items():
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / module).write_text(RECORD.format(n=n))
    record = tmp_path / "record.txt"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", str(workers), "--dist", "loadgroup", "-p",
                           "no:cacheprovider", "tests"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "RECORD": str(record)})
    assert done.returncode == 0, done.stdout + done.stderr
    runs = [line.split() for line in record.read_text().splitlines()]
    assert len(runs) == sum(modules.values()), runs
    return runs


def test_a_real_run_keeps_a_module_on_one_worker_hands_out_the_first_first_and_spreads_the_rest(
        tmp_path: Path) -> None:
    runs = _run(tmp_path, 2, {"tests/multiproc/test_train.py": 6,  # in WHOLE
                              FIRST[0]: 2, "tests/unit/test_spread.py": 8})
    workers = {module: {w for w, m, _ in runs if m == module} for module in ("test_train", "test_spread")}
    assert len(workers["test_train"]) == 1, runs  # one worker: its module fixture would start once
    assert len(workers["test_spread"]) == 2, runs  # two workers, and single tests go to both
    (pauses_worker,) = {w for w, m, _ in runs if m == "test_watch_pauses"}
    assert [m for w, m, _ in runs if w == pauses_worker][:2] == ["test_watch_pauses"] * 2, runs


def test_with_three_workers_the_waiting_modules_get_one_worker_and_the_rest_the_other_two(tmp_path: Path) -> None:
    # the waiting lane's 5 units are all handed out within 3 of its tests (0.6 s); the busy lane's 30 keep its two
    # workers busy for 3 s, so neither of them ever takes a waiting test here
    waiting = sorted(module for module in WAITING if module not in FIRST)[:2]
    runs = _run(tmp_path, 3, {FIRST[0]: 2, waiting[0]: 2, waiting[1]: 2, "tests/unit/test_spread.py": 30})
    by_worker: dict[str, list[str]] = {}
    for w, m, _ in runs:
        by_worker.setdefault(w, []).append(m)
    (lane,) = {w for w, m, _ in runs if m == "test_watch_pauses"}
    waited = {Path(module).stem for module in (FIRST[0], *waiting)}
    assert set(by_worker[lane]) == waited, runs  # the waiting worker ran them all, nothing else
    assert by_worker[lane][:2] == ["test_watch_pauses"] * 2, runs
    assert len(by_worker) == 3 and all(set(m) == {"test_spread"} for w, m in by_worker.items() if w != lane), runs
