"""Every shell example in README.md and docs/*.md runs as written (issue 44).

The examples are read from the pages' fenced blocks: a block with ``$ COMMAND`` lines (each followed by the output
it shows; a trailing backslash continues a command), or a ``bash``/``sh`` block of bare commands. Each page's
examples run in order, in one new empty directory (a reader following the page: a later example may read what an
earlier one wrote), each through ``bash -c`` with this environment's ``ddpkit`` first on PATH and as the default
install has it: no matplotlib, unless the example uses an option the docs say needs it (``--plot``: the ``plots``
extra).

For each command the test checks:

- its exit code: the one the page shows (``$ echo $?`` and its line), 2 where the page shows ``ddpkit: error:``,
  else 0;
- the page's key lines (``KEY``: ddpkit's verdicts, decisions, files written, ``exit N``) appear in its output, in
  the page's order; in them a number with a fraction, a version, a port or a pid (4 digits or more) stands for any
  number, a whole number N also for N.0, and the host ``vm`` for this host.

``NOT_RUN`` lists what cannot run here, each with its reason (bad input that ddpkit refuses before it submits
anything runs: ``submit slurm -j 2x``); each entry must still match an example
(``test_every_exception_names_an_example``), so the list cannot go stale.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import ROOT, ddpkit_env

#: Commands not run here, by a pattern searched in the command, with the reason.
NOT_RUN: dict[str, str] = {
    r"^make (run|test)\b": "runs in the checkout itself (creates .venv there; make test is the whole suite); make "
                           "run's three commands are the README's own examples, run here",
    r"\b(train\.py|job\.py|mypackage\.train)\b": "runs a script of the reader's own (train.py, job.py, "
                                                 "mypackage.train), not in the repository",
    r"^srun\b|^ddpkit (status|logs) \d|^ddpkit submit slurm .*--(wait|heal)\b": "needs a Slurm cluster (tests/infra "
                                                                                 "runs real Slurm daemons)",
    r"^mpirun -np 8\b": "8 ranks under mpirun: more slots than this machine has, or several hosts (tests/infra runs "
                        "real Open MPI and MPICH)",
    r"^torchrun --nnodes 2\b|--rdzv-endpoint|-j \S+ \.\.\.": "several hosts meeting at a rendezvous endpoint "
                                                             "(tests/infra runs them across network namespaces)",
    r"^ddpkit report bench\.json --baseline base\.json": "reads base.json, saved by the 3-host bench above it",
    r"scripts/nshosts\.py": "needs root and network namespaces (scripts/nshosts.py; tests/infra uses it)",
    r"scripts/gpu_check\.sh": "needs a GPU machine",
    r"^ddpkit bench -n 3 --pairs ranks\b": "a healthy 3-rank --pairs run on 2 cores names a link slow in about 1 run "
                                          "of 10, as docs/bench.md says (test_bench.py covers --pairs)",
}
#: Pages whose every example is another machine's output, with the reason.
PAGES_NOT_RUN: dict[str, str] = {
    "docs/gpu.md": "a GPU machine's commands and output (CUDA, NCCL): scripts/gpu_check.sh runs them on one",
}
#: Output lines a page shows that its command must print (ddpkit's verdicts, decisions and files written).
KEY = re.compile(r"(ddpkit heal: attempt \d+ of|ddpkit heal: rank \d+ on|ddpkit: error:|ddpkit env: a world|"
                 r"\w+: \d+ attempt|#? ?wrote |"
                 r"#? ?verdict:|(PASS|FAIL) +\S|Training (finished|already)|Snapshots: |Loading snapshot |"
                 r"Resuming training|Epoch \d+ \| Training snapshot saved|[Dd]rill |exit \d+$|ddpkit_\w+\{|"
                 r"backend \w+: all_reduce)")
#: Numbers in a key line: those that differ from run to run (fractions and versions, sci notation, thousands,
#: ports and pids), and whole ones of up to 3 digits, which must be equal.
NUMBER = re.compile(r"(?P<varying>\d+(\.\d+)+(e[-+]?\d+)?|\d+e[-+]?\d+|\d{1,3}(,\d{3})+|\d{4,})|\d{1,3}")
#: Options that need an extra, and so run with it installed.
NEEDS_PLOTS = re.compile(r"--plot\b")
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


@dataclass(frozen=True, kw_only=True)
class Example:
    page: str
    line: int
    command: str
    shown: tuple[str, ...]
    """The output the page shows for it."""
    exit_code: int

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def not_run(self) -> str | None:
        """Why it does not run here, or None."""
        if self.page in PAGES_NOT_RUN:
            return PAGES_NOT_RUN[self.page]
        return next((why for pattern, why in NOT_RUN.items() if re.search(pattern, self.command)), None)

    def key_lines(self) -> list[re.Pattern[str]]:
        """A pattern per key line the page shows, whitespace collapsed."""
        keys = [" ".join(line.split()) for line in self.shown]
        return [re.compile(_pattern(line)) for line in keys if KEY.match(line)]


def _pattern(line: str) -> str:
    """The line as a regular expression: a varying number as any number, a whole one also as N.0 (a textfile's
    3.0 is the page's 3), the host vm as this host."""
    host = re.escape(socket.gethostname())

    def literal(text: str) -> str:
        return "".join(host if part == "vm" else re.escape(part) for part in re.split(r"\b(vm)\b", text))

    parts, at = [], 0
    for m in NUMBER.finditer(line):
        parts += [literal(line[at:m.start()]), r"[0-9][0-9.,e+-]*" if m["varying"] else m[0] + r"(\.0+)?"]
        at = m.end()
    return "".join([*parts, literal(line[at:])]) + "$"


def _blocks(text: str) -> list[tuple[int, str, list[str]]]:
    """Each fenced block: (line of its opening fence, its language, its lines without the fence's indent)."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(\w*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        indent, body, start = len(m[1]), [], i + 1
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][indent:])
            i += 1
        blocks.append((start, m[2], body))
        i += 1
    return blocks


def _commands(body: list[str], prompt: bool) -> list[tuple[int, str, list[str]]]:
    """(offset in the block, command with continuations joined, output shown) for each command of a block."""
    found: list[tuple[int, str, list[str]]] = []
    i = 0
    while i < len(body):
        line = body[i]
        if prompt and not line.startswith("$ "):
            if found:
                found[-1][2].append(line)
            i += 1
            continue
        if not prompt and (not line.strip() or line.lstrip().startswith("#")):
            i += 1
            continue
        offset, command = i, line[2:] if prompt else line
        while command.rstrip().endswith("\\") and i + 1 < len(body):
            i += 1
            command = command.rstrip()[:-1] + " " + body[i].strip()
        found.append((offset, command.strip(), []))
        i += 1
    return found


def examples(page: Path) -> list[Example]:
    name = page.relative_to(ROOT).as_posix()
    out: list[Example] = []
    for start, language, body in _blocks(page.read_text()):
        prompt = any(line.startswith("$ ") for line in body)
        if not prompt and language not in ("bash", "sh", "shell"):
            continue  # output, code or data
        commands = _commands(body, prompt)
        for n, (offset, command, shown) in enumerate(commands):
            if command == "echo $?":
                continue  # the previous command's exit code, read below
            following = commands[n + 1] if n + 1 < len(commands) else None
            if following is not None and following[1] == "echo $?" and following[2]:
                code = int(following[2][0])
            else:
                code = 2 if any(s.startswith("ddpkit: error:") for s in shown) else 0
            out.append(Example(page=name, line=start + offset + 1, command=command, shown=tuple(shown),
                               exit_code=code))
    return out


def _run(example: Example, cwd: Path, no_plots: Path) -> str | None:
    """Run one example in ``cwd``; what was wrong with it, or None."""
    env = ddpkit_env(PATH=f"{Path(sys.executable).parent}:{ddpkit_env()['PATH']}")
    if not NEEDS_PLOTS.search(example.command):
        env["PYTHONPATH"] = str(no_plots)
    try:
        res = subprocess.run(["bash", "-c", example.command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, errors="replace", timeout=300)
    except subprocess.TimeoutExpired:
        return f"{example.where}: `{example.command}` did not end in 300 s"
    out = res.stdout
    lines = [" ".join(line.split()) for line in out.splitlines()]
    wrong = []
    if res.returncode != example.exit_code:
        wrong.append(f"exit code {res.returncode}, the page shows {example.exit_code}")
    at = 0
    for key in example.key_lines():
        hit = next((i for i in range(at, len(lines)) if key.match(lines[i])), None)
        if hit is None:
            wrong.append(f"no line matching {key.pattern!r} (in the page's order)")
        else:
            at = hit + 1
    if not wrong:
        return None
    return f"{example.where}: `{example.command}`: " + "; ".join(wrong) + "\n--- its output (tail):\n" + out[-4000:]


def _runnable(page: Path) -> list[Example]:
    return [e for e in examples(page) if e.not_run() is None]


def _default_install(tmp_path: Path) -> Path:
    """A PYTHONPATH entry that makes this environment the default install: no matplotlib."""
    no_plots = tmp_path / "default-install"
    no_plots.mkdir()
    # None in sys.modules: import fails and importlib.util.find_spec says "not installed", as without the extra
    (no_plots / "sitecustomize.py").write_text('import sys\nsys.modules["matplotlib"] = None\n')
    return no_plots


@pytest.mark.multiproc
@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", [p for p in PAGES if _runnable(p)], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_example_of_the_page_runs_as_written(page: Path, tmp_path: Path) -> None:
    no_plots = _default_install(tmp_path)
    reader = tmp_path / "reader"
    reader.mkdir()
    failures = [f for f in (_run(e, reader, no_plots) for e in _runnable(page)) if f]
    assert not failures, "\n\n".join(failures)


def test_every_exception_names_an_example() -> None:
    found = [e for page in PAGES for e in examples(page)]
    assert len(found) > 20, [e.where for e in found]
    for pattern, why in NOT_RUN.items():
        assert any(re.search(pattern, e.command) for e in found), f"NOT_RUN {pattern!r} ({why}) matches no example"
    for page in PAGES_NOT_RUN:
        assert (ROOT / page).exists(), f"PAGES_NOT_RUN names {page}, which is gone"


def test_the_heal_and_report_example_is_read_with_the_lines_it_shows() -> None:
    """The extraction itself: the heal example is one command, its drills joined, and its key lines (the heal
    decisions, the report's files, the textfile's figures) match their own run's words with other figures."""
    found = [e for page in PAGES for e in examples(page)]
    train = next(e for e in found if e.command.startswith("ddpkit train -n 2 --heal --run-dir run"))
    assert "--drill kill-worker@epoch=3,rank=1" in train.command and train.exit_code == 0
    assert train.key_lines()[-1].match("ddpkit heal: attempt 3 of 3: completed (exit 0)")
    assert not train.key_lines()[-1].match("ddpkit heal: attempt 2 of 3: completed (exit 0)")
    assert not train.key_lines()[-1].match("ddpkit heal: attempt 3 of 30: completed (exit 0)")
    report = next(e for e in found if e.command.startswith("ddpkit report run --html"))
    assert report.key_lines()[0].match("run: 3 attempt(s), goodput 12.25% of 5.0 s; wrote run.html, run.trace.json, "
                                       "run.prom")
