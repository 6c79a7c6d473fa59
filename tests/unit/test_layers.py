"""The arrow of docs/architecture.md, enforced: every ``import`` in src/ddpkit (lazy ones in functions included) goes
down the layers or stays in its own package; the commands (check, bench, train, env's and jobs' CLIs) and the
launcher never import one another."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "ddpkit"

#: Bottom first. A module belongs to the layer of its longest listed prefix.
LAYERS: tuple[tuple[str, ...], ...] = (
    # 0: no torch at module level, no ddpkit import above this line
    ("ddpkit", "ddpkit.errors", "ddpkit.log", "ddpkit.worker_context", "ddpkit.stopping", "ddpkit.ports",
     "ddpkit.inputs", "ddpkit.netinfo", "ddpkit.fault_injection", "ddpkit.launch.shape", "ddpkit.nodefacts",
     "ddpkit.baseline", "ddpkit.remedy", "ddpkit.outcome", "ddpkit.nodejudge", "ddpkit.exiting",
     "ddpkit.heal.classify", "ddpkit.heal.ledger", "ddpkit.heal.policy"),
    # 1: who am I in which world
    ("ddpkit.env",),
    # 2: the process group, and the collectives that check, bench and train share; the watch over them
    ("ddpkit.runtime", "ddpkit.comm", "ddpkit.watch"),
    # 3: the commands and the launcher, side by side
    ("ddpkit.check", "ddpkit.bench", "ddpkit.train", "ddpkit.script", "ddpkit.env.cli", "ddpkit.jobs",
     "ddpkit.launch"),
    # 4: what check and bench wrote -> one report; a rank's start (the agent, or the command in this rank); the
    # healing supervisor around the agent (its pure rules, ddpkit.heal.classify/ledger/policy, are in layer 0)
    ("ddpkit.report", "ddpkit.lifecycle", "ddpkit.heal"),
    # 5: argv -> a command (and the package's public entry points, which load lazily)
    ("ddpkit.cli", "ddpkit.__main__", "ddpkit.__init__", "ddpkit.watch.__main__"),
)
#: In layer 3 each of these is its own package: none imports another.
SIBLINGS = LAYERS[3]


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
    """(line, module) of each ddpkit module ``source`` imports."""
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
        elif me == them == 3 and mine != theirs:
            found.append(f"{module}:{line} imports {target}: {mine} and {theirs} are side by side")
    return found


def test_no_module_imports_up_the_arrow_or_across_to_a_sibling() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        name = module_name(path)
        found += violations(name.removesuffix(".__init__") if name != "ddpkit.__init__" else name,
                            path.read_text(), is_package=path.name == "__init__.py")
    assert not found, "\n".join(found)


def test_an_upward_or_sideways_import_is_caught() -> None:
    """The check above can fail: an import of the trainer from the runtime, or of train from check, is reported."""
    assert violations("ddpkit.runtime", "def f():\n    from ddpkit.train.trainer import Trainer\n")
    assert violations("ddpkit.train.cli", "from ddpkit.launch.worker import STOP_DIR\n")
    assert violations("ddpkit.check.ddpsync", "import ddpkit.train.trainer\n")
    assert violations("ddpkit.env.slurm", "from ddpkit import runtime\n")
    assert violations("ddpkit.train.cli", "from ..launch import worker\n")  # relative
    assert violations("ddpkit.stopping", "from ddpkit.launch import stops\n")
    with pytest.raises(AssertionError, match="in no layer"):  # a new module must be placed
        violations("ddpkit.newthing", "import os\n")
    assert not violations("ddpkit.train.trainer", "from ddpkit.comm.gradients import register_gradient_averaging\n"
                          "from ddpkit.train.config import TrainConfig\nimport ddpkit\n")
