"""A clean install: the wheel holds only `strategies`; a user app with its own client.py,
server.py and task.py runs beside it in a fresh environment.

The fresh venv sees this environment's site-packages as a plain path (torch, flwr without a
download) but none of its .pth files, so this checkout (an editable install here) is not on
its path: only the installed wheel provides `strategies`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.realproc  # builds a wheel, makes a venv, runs the app in a subprocess

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "quickstart-celgc"

DRIVER = '''
import importlib.util, json, sys
sys.path.insert(0, ".")
import client, server, strategies, task
spec = importlib.util.spec_from_file_location("loopback", sys.argv[1])  # the in-process grid, loaded by path
loopback = importlib.util.module_from_spec(spec)
spec.loader.exec_module(loopback)
config = {"num-server-rounds": 3, "local-steps": 8, "batch-size": 32, "lr": 1.0, "clip": 0.3, "results-file": sys.argv[2]}
loopback.run_server_app(server.app, loopback.LoopbackGrid(client.app, config, 2))
print(json.dumps({m.__name__: m.__file__ for m in (client, server, task, strategies)}))
'''


def run(cmd: list[str], cwd: Path) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{cmd} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_wheel_installs_only_strategies_and_a_user_app_runs_beside_it(tmp_path):
    dist = tmp_path / "dist"
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(ROOT)], tmp_path)
    (wheel,) = dist.glob("celgc-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        tops = {name.split("/")[0] for name in zf.namelist()}
    assert tops == {"strategies", "celgc-0.1.0.dist-info"}, tops

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], tmp_path)
    python = venv / "bin" / "python"
    site = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path).strip())
    (site / "shared.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(wheel)], tmp_path)

    app = tmp_path / "user-app"  # a user's app: its own client.py, server.py, task.py
    app.mkdir()
    for name in ("client.py", "server.py", "task.py", "pyproject.toml"):
        shutil.copy(EXAMPLE / name, app / name)
    out = tmp_path / "results.json"
    files = json.loads(run([str(python), "-c", DRIVER, str(ROOT / "simulations" / "loopback.py"), str(out)],
                           app).strip().splitlines()[-1])
    for name in ("client", "server", "task"):
        assert Path(files[name]).parent == app, files  # the user's own modules, not shadowed
    assert Path(files["strategies"]).is_relative_to(site), files  # the installed wheel, not this checkout
    train = json.loads(out.read_text())["train"]
    assert len(train) == 3 and all(m["clip-fraction"] > 0 for m in train.values())
