"""The arrow of docs/architecture.md, enforced: every ``import`` in src/ddpkit (lazy ones in functions and type-only
ones included) goes down the layers or stays in its own package; the commands (check, bench, train, run, whoami,
jobs) and the launcher never import one another; no two modules import each other, however indirectly; and the root
of the package holds only its entry points, the command line and the runtime; every module of the live wing is
named by its map and by docs/architecture.md."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "ddpkit"

#: Bottom first: packages (and the few modules left at the root). A module belongs to the layer of its longest
#: listed prefix.
LAYERS: tuple[tuple[str, ...], ...] = (
    # 0: the basement: errors and exit codes, logging, input rules, ports, interfaces, job shapes, test faults
    ("ddpkit", "ddpkit.base"),
    # 1: a process's start and end protocol (what the agent tells its workers, why a run stopped, how a process
    #    leaves) and judging what was measured; the goodput ledger's records and accounting; what launchers print,
    #    read into typed events for the digest and heal alike; no torch at module level
    #    live healing's protocol (the wing's package; its rank side and agent side sit in layers 3 and 5)
    ("ddpkit.process", "ddpkit.verdicts", "ddpkit.goodput", "ddpkit.rundir", "ddpkit.launcher_output", "ddpkit.live"),
    # 2: who am I in which world
    ("ddpkit.env",),
    # 3: the process group, and the collectives that check, bench and train share; the watch over them
    #    live healing's rank side: the group re-formed, the state handed over, the user's Replica
    ("ddpkit.runtime", "ddpkit.comm", "ddpkit.watch", "ddpkit.live.rank"),
    # 4: the commands and the launcher, side by side
    ("ddpkit.check", "ddpkit.bench", "ddpkit.train", "ddpkit.run", "ddpkit.whoami", "ddpkit.jobs", "ddpkit.launch"),
    # 5: what check and bench wrote -> one report; a rank's start (the agent, or the command in this rank), and the
    #    supervisor that heals a job by starting it again (its pure rules, heal.classify, ledger and policy, with it)
    #    a run directory's ledgers -> an HTML page, a trace, a Prometheus textfile (reports)
    #    live healing's agent: its rules, one host's and Slurm's spawners, the standby
    ("ddpkit.reports", "ddpkit.lifecycle", "ddpkit.heal", "ddpkit.live.agent"),
    # 6: argv -> a command (and the package's entry points: ``import ddpkit`` loads lazily, ``python -m ddpkit``
    #    is ``ddpkit``; ``python -m ddpkit.watch`` execs ``python -m ddpkit run``, importing nothing above the watch;
    #    ``python -m ddpkit.standby`` is a rank's process under Slurm's --heal live, which runs ``ddpkit`` once given
    #    its rank)
    ("ddpkit.cli", "ddpkit.__main__", "ddpkit.__init__", "ddpkit.standby"),
)
#: Side by side in their layer: none imports another.
SIBLINGS = LAYERS[4]
#: What may stand loose at the package root (STYLE.md: entry points; everything else grouped by role).
ROOT_MODULES = {"__init__", "__main__", "cli", "runtime", "report", "standby"}


def _owner(module: str, table: tuple[str, ...]) -> str | None:
    hits = [p for p in table if module == p or module.startswith(p + ".")]
    return max(hits, key=len) if hits else None


def layer(module: str) -> int:
    # "ddpkit" itself (``import ddpkit``, ``from ddpkit import __version__``) is exact: a new top-level module must
    # be placed in a layer by hand
    found = [(len(p), i) for i, names in enumerate(LAYERS) for p in names
             if module == p or (p != "ddpkit" and module.startswith(p + "."))]
    if not found:
        raise AssertionError(f"{module} is in no layer of tests/unit/test_layers.py: add it where it belongs")
    return max(found)[1]


def module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    return ".".join(rel.parts)


def imported(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, module) of each ddpkit module ``source`` imports (``TYPE_CHECKING`` blocks included)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "ddpkit"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            if target.split(".")[0] != "ddpkit":
                continue
            for alias in node.names:  # ``from ddpkit import env``: the module ddpkit.env
                sub = f"{target}.{alias.name}"
                out.append((node.lineno, sub if (SRC.parent / sub.replace(".", "/")).exists()
                            or (SRC.parent / (sub.replace(".", "/") + ".py")).exists() else target))
    return out


def violations(module: str, source: str, is_package: bool = False) -> list[str]:
    """Each import of ``source`` (the text of ``module``) that goes up a layer or across to a sibling command."""
    me = layer(module)
    mine = _owner(module, SIBLINGS)
    found = []
    for line, target in imported(source, module, is_package):
        them = layer(target)
        theirs = _owner(target, SIBLINGS)
        if them > me:
            found.append(f"{module}:{line} imports {target} (layer {them}) from layer {me}: upward")
        elif me == them == LAYERS.index(SIBLINGS) and mine != theirs:
            found.append(f"{module}:{line} imports {target}: {mine} and {theirs} are side by side")
    return found


def _sources() -> dict[str, tuple[str, bool]]:
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        name = module_name(path)
        out[name.removesuffix(".__init__") if name != "ddpkit.__init__" else name] = (path.read_text(),
                                                                                     path.name == "__init__.py")
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import one another, directly or not (Tarjan's strongly connected components of
    more than one module, or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph.get(v, ()):
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def import_graph() -> dict[str, set[str]]:
    sources = _sources()
    graph: dict[str, set[str]] = {}
    for name, (source, is_package) in sources.items():
        graph[name] = {t for _, t in imported(source, name, is_package) if t in sources and t != name}
    return graph


def test_no_module_imports_up_the_arrow_or_across_to_a_sibling() -> None:
    found = []
    for name, (source, is_package) in _sources().items():
        found += violations(name, source, is_package=is_package)
    assert not found, "\n".join(found)


def test_no_import_circle_type_only_ones_included() -> None:
    # a package importing its own submodules and being imported by them (``ddpkit.watch`` <-> ``ddpkit.watch.hooks``)
    # is how a package hands its names on: only circles that cross a package's boundary, or two plain modules, count
    found = [group for group in circles(import_graph())
             if len({g.rsplit(".", 1)[0] if g not in _packages() else g for g in group}) > 1
             or not any(g in _packages() for g in group)]
    assert not found, "\n".join(" <-> ".join(group) for group in found)


def _packages() -> set[str]:
    return {module_name(p.parent / "x").rsplit(".", 1)[0] for p in SRC.rglob("__init__.py")}


def test_a_circle_is_caught() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_root_holds_only_entry_points() -> None:
    loose = {p.stem for p in SRC.glob("*.py")}
    assert loose <= ROOT_MODULES, f"loose at the package root: {sorted(loose - ROOT_MODULES)}: put them in a package"
    assert len(loose) <= 6


def test_every_layer_names_packages_or_root_modules() -> None:
    """The table names packages (and the root's modules), not lists of files inside packages."""
    names = [n for group in LAYERS for n in group if n != "ddpkit"]
    packages = _packages()
    for name in names:
        assert name in packages or name.rsplit(".", 1)[0] == "ddpkit" or name.endswith(".__main__"), name


def test_an_upward_or_sideways_import_is_caught() -> None:
    """The check above can fail: an import of the trainer from the runtime, or of train from check, is reported."""
    assert violations("ddpkit.runtime", "def f():\n    from ddpkit.train.trainer import Trainer\n")
    assert violations("ddpkit.train.cli", "from ddpkit.launch.worker import STOP_DIR\n")
    assert violations("ddpkit.check.ddpsync", "import ddpkit.train.trainer\n")
    assert violations("ddpkit.env.slurm", "from ddpkit import runtime\n")
    assert violations("ddpkit.train.cli", "from ..launch import worker\n")  # relative
    assert violations("ddpkit.process.stopping", "from ddpkit.launch import stops\n")
    assert violations("ddpkit.base.log", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                      "    from ddpkit.env import WorldInfo\n")  # type-only imports count too
    with pytest.raises(AssertionError, match="in no layer"):  # a new module must be placed
        violations("ddpkit.newthing", "import os\n")
    assert not violations("ddpkit.train.trainer", "from ddpkit.comm.gradients import register_gradient_averaging\n"
                          "from ddpkit.train.config import TrainConfig\nimport ddpkit\n")


def test_the_live_wing_s_map_and_the_architecture_page_name_every_module_of_it() -> None:
    """Live healing has one address: every module under ``live/`` is named by the wing's map (its ``__init__``) and
    by docs/architecture.md, so a new one cannot come in unnamed."""
    page = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    mapped = (SRC / "live" / "__init__.py").read_text()
    for path in sorted((SRC / "live").rglob("*.py")):
        if path.name == "__init__.py":
            continue
        relative = path.relative_to(SRC).as_posix()
        dotted = relative.removesuffix(".py").replace("/", ".")
        assert f"`{relative}`" in page, f"docs/architecture.md does not name {relative}"
        assert f"``{dotted}``" in mapped, f"ddpkit/live/__init__.py's map does not name {dotted}"


def test_no_module_of_the_package_is_over_400_lines() -> None:
    """A module one person can hold in mind: over 400 lines, it is two."""
    long = {path.relative_to(SRC).as_posix(): n for path in SRC.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > 400}
    assert not long, f"split these modules: {long}"
