"""The import contract: layers point down (strategies <- tasks <- client | server <- simulations).

The contract lives in pyproject.toml ([tool.importlinter]); type-only imports count too.
A violation fails here with import-linter's report of the offending import chain.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_layers_point_down():
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
         "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 kept, 0 broken" in out.stdout


def test_the_contract_catches_an_upward_import(tmp_path):
    """The check can fail: an import of client from strategies breaks the contract."""
    for pkg in ("strategies", "tasks", "client", "server", "simulations"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "strategies" / "bad.py").write_text("from typing import TYPE_CHECKING\n"
                                                     "if TYPE_CHECKING:\n    import client\n")
    config = (ROOT / "pyproject.toml").read_text()
    (tmp_path / "pyproject.toml").write_text(config[config.index("[tool.importlinter]"):])
    out = subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
         "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert out.returncode != 0
    assert "strategies.bad -> client" in out.stdout, out.stdout
