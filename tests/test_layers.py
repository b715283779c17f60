"""The import contracts: layers point down (strategies <- tasks <- client | server <- simulations),
the engine drives the algorithm layer without server/, client/, Flower or any one method's
module, and the run records and the algorithm layer import no Flower.

The contracts live in pyproject.toml ([tool.importlinter]); type-only imports count too.
A violation fails here with import-linter's report of the offending import chain. The engine
also names no method in its code: it reads ``algorithm`` from the config and hands it on.
"""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from strategies.algorithms import METHODS

ROOT = Path(__file__).resolve().parents[1]
LINT = ("import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))")


def lint(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LINT], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(cwd)})


def test_the_contracts_are_kept():
    out = lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "3 kept, 0 broken" in out.stdout


def _skeleton(tmp_path: Path) -> None:
    """Empty packages and modules for every name the contracts mention."""
    config = (ROOT / "pyproject.toml").read_text()
    config = config[config.index("[tool.importlinter]"):]
    (tmp_path / "pyproject.toml").write_text(config)
    names = set(re.findall(r'"((?:strategies|tasks|client|server|simulations)(?:\.\w+)*)"', config))
    for name in sorted(names) + ["flwr"]:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):
            folder = tmp_path.joinpath(*parts[:i])
            folder.mkdir(exist_ok=True)
            (folder / "__init__.py").touch()


@pytest.mark.parametrize("module, source, chain", [
    ("strategies/bad.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import client\n", "strategies.bad -> client"),
    ("simulations/engine/bad.py", "import server\n", "simulations.engine.bad -> server"),
    ("simulations/engine/bad.py", "import strategies.algorithms.naive\n",
     "simulations.engine.bad -> strategies.algorithms.naive"),
    ("strategies/algorithms/bad.py", "import flwr\n", "strategies.algorithms.bad -> flwr"),
    ("tasks/runs/bad.py", "import flwr\n", "tasks.runs.bad -> flwr"),
])
def test_the_contracts_catch_a_forbidden_import(tmp_path, module, source, chain):
    """Each contract can fail: a tree of empty modules with one forbidden import breaks it."""
    _skeleton(tmp_path)
    (tmp_path / module).write_text(source)
    out = lint(tmp_path)
    assert out.returncode != 0
    assert chain in out.stdout, out.stdout


def _code_words(path: Path) -> set[str]:
    """Identifiers and string constants of a module's code (docstrings and comments left out)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    words: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words.add(node.id)
        elif isinstance(node, ast.Attribute):
            words.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            words.update(re.findall(r"[A-Za-z][\w-]*", node.value))
        elif isinstance(node, ast.alias):
            words.update(node.name.split("."))
    return {w.lower() for w in words}


def test_the_engine_names_no_method():
    names = {name for name in METHODS} | {cls.__name__.lower() for cls in METHODS.values()}
    for path in sorted((ROOT / "simulations" / "engine").glob("*.py")):
        named = _code_words(path) & names
        assert not named, f"{path.name} names {sorted(named)}: the engine must only drive the method it is given"
