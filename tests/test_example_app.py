"""The example app (examples/quickstart-celgc) and the "own Flower app" tutorial's code.

docs/tutorials/flower-app.md shows the example's client.py and server.py; these tests run the
page's code as written (in this process, on the loopback grid) and the example with a real
`flwr run` under Flower's default federation.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from docs_support import blocks

from simulations.loopback import LoopbackGrid, run_server_app

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "quickstart-celgc"
USER_MODULES = ("client", "server", "task")
CONFIG = {"num-server-rounds": 10, "local-steps": 8, "batch-size": 32, "lr": 1.0, "clip": 0.3}


def readme_blocks() -> dict[str, str]:
    """The tutorial's Python blocks that include an example file (``--8<-- "examples/..."``) -> their code."""
    page = ROOT / "docs" / "tutorials" / "flower-app.md"
    names = re.findall(r'```python\n--8<-- "(examples/[^"]+)"\n```', page.read_text())
    shown = [b.code for b in blocks(page) if b.lang == "python"]
    assert len(names) == len(shown)
    return dict(zip(names, shown))


@contextmanager
def user_app(app_dir: Path):
    """Import an app's top-level client/server/task modules (they shadow this project's
    packages only inside the block; everything is restored after)."""
    saved = {k: v for k, v in sys.modules.items() if k.split(".")[0] in USER_MODULES}
    for k in saved:
        del sys.modules[k]
    sys.path.insert(0, str(app_dir))
    try:
        yield importlib.import_module("client").app, importlib.import_module("server").app
    finally:
        sys.path.remove(str(app_dir))
        for k in [k for k in sys.modules if k.split(".")[0] in USER_MODULES]:
            del sys.modules[k]
        sys.modules.update(saved)


def check_results(path: Path, rounds: int) -> None:
    results = json.loads(path.read_text())
    train, test = results["train"], results["test"]
    assert sorted(map(int, train)) == list(range(1, rounds + 1))
    assert all(m["clip-fraction"] > 0.5 for m in train.values())  # clipping is active
    assert all(m["replies"] == 2 and m["num-steps"] == 2 * CONFIG["local-steps"] for m in train.values())
    first, last = test["0"]["test-accuracy"], test[str(rounds)]["test-accuracy"]
    assert first < 0.3 and last > 0.8  # 10 classes: from chance to a trained model


def test_readme_shows_the_example_files_as_they_are():
    blocks = readme_blocks()
    assert set(blocks) == {"examples/quickstart-celgc/client.py", "examples/quickstart-celgc/server.py"}
    for name, code in blocks.items():
        assert code == (ROOT / name).read_text(), f"the tutorial's block {name} differs from the file"


def test_readme_snippet_runs_as_written(tmp_path):
    for name, code in readme_blocks().items():
        (tmp_path / Path(name).name).write_text(code)
    shutil.copy(EXAMPLE / "task.py", tmp_path / "task.py")
    out = tmp_path / "results.json"
    with user_app(tmp_path) as (client_app, server_app):
        run_server_app(server_app, LoopbackGrid(client_app, {**CONFIG, "results-file": str(out)}, 2))
    check_results(out, CONFIG["num-server-rounds"])
    assert hasattr(importlib.import_module("client"), "__path__")  # this project's package again, not client.py


def test_example_config_is_what_the_tests_run():
    import tomllib

    config = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert {k: config[k] for k in CONFIG} == CONFIG


@pytest.mark.realproc
def test_example_runs_with_flwr_run_and_flowers_default_federation(tmp_path):
    from simulations.flower import run_app

    out = tmp_path / "results.json"
    site = tmp_path / "site"  # only `strategies` of this checkout, as an installed wheel provides it
    site.mkdir()
    (site / "strategies").symlink_to(ROOT / "strategies")
    # no federation config: Flower's default of 2 SuperNodes
    run = run_app(EXAMPLE, {"results-file": str(out)}, None, timeout=300,
                  superlink_kwargs={"cwd": tmp_path, "env": {"PYTHONPATH": str(site)}})
    assert run["status"] == "finished:completed"
    check_results(out, CONFIG["num-server-rounds"])
