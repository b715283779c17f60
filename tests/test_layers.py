"""The import contracts: layers point down (strategies <- tasks <- client | server <- simulations);
inside strategies/, the Flower adapters (flower_api) -> the algorithm layer (methods) -> the pure
math (core); the engine drives the algorithm layer without server/, client/, Flower or any one
method's module; the run records, the algorithm layer and the math import no Flower, and the math
no torch.distributed (checked here: import-linter cannot forbid a sub-package of torch).

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

from strategies.methods import METHODS

ROOT = Path(__file__).resolve().parents[1]
LINT = ("import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))")


def lint(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LINT], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(cwd)})


def test_the_contracts_are_kept():
    out = lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "4 kept, 0 broken" in out.stdout


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
    ("simulations/engine/bad.py", "import strategies.methods.naive\n",
     "simulations.engine.bad -> strategies.methods.naive"),
    ("strategies/methods/bad.py", "import flwr\n", "strategies.methods.bad -> flwr"),
    ("strategies/core/bad.py", "import flwr\n", "strategies.core.bad -> flwr"),
    ("strategies/core/bad.py", "from strategies.methods import reduce\n", "strategies.core.bad -> strategies.methods"),
    ("strategies/methods/bad.py", "import strategies.flower_api\n", "strategies.methods.bad -> strategies.flower_api"),
    ("simulations/engine/bad.py", "import strategies.flower_api\n", "simulations.engine.bad -> strategies.flower_api"),
    ("tasks/runs/bad.py", "import flwr\n", "tasks.runs.bad -> flwr"),
])
def test_the_contracts_catch_a_forbidden_import(tmp_path, module, source, chain):
    """Each contract can fail: a tree of empty modules with one forbidden import breaks it."""
    _skeleton(tmp_path)
    (tmp_path / module).write_text(source)
    out = lint(tmp_path)
    assert out.returncode != 0
    assert chain in out.stdout, out.stdout


def distributed_imports(path: Path) -> list[str]:
    """Where a module names torch.distributed: imports of it or of names from it, and attribute uses."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.startswith("torch.distributed")]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("torch.distributed") or (
                    node.module == "torch" and any(a.name == "distributed" for a in node.names)):
                found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Attribute) and node.attr == "distributed":
            found.append(f"line {node.lineno}: .distributed")
    return found


def test_the_pure_math_uses_no_torch_distributed():
    for path in sorted((ROOT / "strategies" / "core").rglob("*.py")):
        assert not distributed_imports(path), f"{path.name}: {distributed_imports(path)}"


@pytest.mark.parametrize("source", ["import torch.distributed as dist\n", "from torch import distributed\n",
                                    "from torch.distributed import all_reduce\n",
                                    "import torch\n\ndef f(t):\n    torch.distributed.all_reduce(t)\n"])
def test_the_torch_distributed_check_can_fail(tmp_path, source):
    (tmp_path / "bad.py").write_text(source)
    assert distributed_imports(tmp_path / "bad.py")


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


def test_no_two_modules_share_a_stem():
    """One name, one module: ``episode.py`` here and ``episode.py`` there read as the same thing.
    Allowed: package files and Flower's two app entry points (client/app.py, server/app.py)."""
    allowed = {"__init__", "__main__", "app"}
    seen: dict[str, list[str]] = {}
    packages = [d for d in ROOT.iterdir() if (d / "__init__.py").is_file() and d.name != "tests"]
    for path in sorted(p for d in packages for p in d.rglob("*.py")):
        seen.setdefault(path.stem, []).append(str(path.relative_to(ROOT)))
    clashes = {stem: paths for stem, paths in seen.items() if len(paths) > 1 and stem not in allowed}
    assert not clashes, f"modules sharing a name: {clashes}"
