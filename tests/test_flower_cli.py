"""End-to-end check of simulations.flower against the real Flower CLI (flwr 1.42).

One throw-away Flower App (Message API, 2-round FedAvg on a numpy array) is written into
tmp_path and run twice on one LocalSuperLink: once normally (must be detected as
``finished:completed``) and once with a ServerApp that raises (must raise RunFailed with
``finished:failed``). Bounded: every wait has a timeout; the whole file takes ~30-45 s.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from simulations.flower import STATUS_COMPLETED, STATUS_FAILED, LocalSuperLink, RunFailed, cli, format_overrides, run_app
from simulations.flower.processes import process_tree

pytest.importorskip("flwr")
pytestmark = pytest.mark.realproc  # real processes: skip with -m "not realproc"

NUM_SUPERNODES = 3

PYPROJECT = """\
[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "fcliprobe"
version = "1.0.0"
description = "throw-away app for tests/test_flower_cli.py"
license = "Apache-2.0"
dependencies = ["flwr[simulation]>=1.42.0", "numpy"]

[tool.flwr.app]
publisher = "tests"

[tool.flwr.app.components]
serverapp = "fcliprobe_app.server:app"
clientapp = "fcliprobe_app.client:app"

[tool.flwr.app.config]
num-server-rounds = 2
out-dir = ""
fail = false
"""

SERVER = """\
import json
import os

import numpy as np
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    print("FCLI-PROBE serverapp started", flush=True)
    if cfg["fail"]:
        raise RuntimeError("FCLI-PROBE intentional failure")
    strategy = FedAvg(fraction_evaluate=0.0, min_train_nodes=3, min_available_nodes=3)  # all 3: no race with their start
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord([np.zeros(3, dtype=np.float64)]),
        num_rounds=int(cfg["num-server-rounds"]),
    )
    out = {
        "final": result.arrays.to_numpy_ndarrays()[0].tolist(),
        "num_nodes": len(list(grid.get_node_ids())),
        "cwd": os.getcwd(),
    }
    os.makedirs(cfg["out-dir"], exist_ok=True)
    with open(os.path.join(cfg["out-dir"], "result.json"), "w") as fh:
        json.dump(out, fh)
"""

CLIENT = """\
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    arr = msg.content["arrays"].to_numpy_ndarrays()[0]
    pid = int(context.node_config["partition-id"])
    content = RecordDict({
        "arrays": ArrayRecord([arr + pid + 1]),
        "metrics": MetricRecord({"num-examples": 10}),
    })
    return Message(content, reply_to=msg)
"""


@pytest.fixture(scope="module")
def app_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("flwrapp") / "fcliprobe"
    pkg = root / "fcliprobe_app"
    pkg.mkdir(parents=True)
    (root / "pyproject.toml").write_text(PYPROJECT)
    (pkg / "__init__.py").write_text("")
    (pkg / "server.py").write_text(textwrap.dedent(SERVER))
    (pkg / "client.py").write_text(textwrap.dedent(CLIENT))
    return root


@pytest.fixture(scope="module")
def superlink(tmp_path_factory: pytest.TempPathFactory):
    cwd = tmp_path_factory.mktemp("serverapp-cwd")
    with LocalSuperLink(cwd=cwd, startup_timeout=60, shutdown_timeout=10) as sl:
        yield sl
    # every process of this SuperLink (SuperExec, flwr-simulation, Ray) is gone
    assert sl.process is None
    assert process_tree((), sl.tag) == {}


def test_format_overrides() -> None:
    assert format_overrides({"a": 1, "b": 0.5, "c": True, "d": "x y", "e": "it's"}) == [
        "a=1",
        "b=0.5",
        "c=true",
        "d='x y'",
        'e="it\'s"',
    ]
    assert format_overrides(["k=1 j='s'"]) == ["k=1 j='s'"]
    with pytest.raises(TypeError):
        format_overrides({"a": [1, 2]})


def test_successful_run_is_completed(app_dir: Path, superlink: LocalSuperLink, tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "out dir"  # absolute path with a space, via run config
    # the log comes from the one stream that followed the run, not from a second fetch
    monkeypatch.setattr(cli, "fetch_logs", lambda *a, **k: pytest.fail("the log was fetched again"))
    run = run_app(
        app_dir,
        {"out-dir": str(out)},
        {"num-supernodes": NUM_SUPERNODES},
        timeout=75,
        superlink=superlink,
        poll_interval=1.0,
    )
    assert run["status"] == STATUS_COMPLETED
    assert "FCLI-PROBE serverapp started" in run["logs"]  # ServerApp stdout reaches `flwr log`
    result = json.loads((out / "result.json").read_text())
    # each client adds partition-id + 1; equal weights -> mean (N + 1) / 2 per round
    assert result["final"] == pytest.approx([2 * (NUM_SUPERNODES + 1) / 2] * 3)
    assert result["num_nodes"] == NUM_SUPERNODES
    assert Path(result["cwd"]) == superlink.server_cwd


def test_failing_serverapp_raises_run_failed(app_dir: Path, superlink: LocalSuperLink) -> None:
    with pytest.raises(RunFailed) as info:
        run_app(app_dir, {"fail": True}, {"num-supernodes": 2}, timeout=75, superlink=superlink, poll_interval=1.0)
    assert info.value.status == STATUS_FAILED
    assert "FCLI-PROBE intentional failure" in info.value.details + info.value.logs_tail
