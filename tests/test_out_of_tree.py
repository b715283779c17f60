"""A method outside the project: ``algorithm = "package.module:Class"`` (like ``task``) runs on the
Flower path and the engine with its own keys (``<its name>.<key>``), nothing of the project edited;
a node runs it only when its own run config names it. A key of its own that a registered method
also has (``server-lr``, FedAvgM's) is its own: its default, never FedAvgM's, on the engine, the
runner and ``flwr run``. A method the apps cannot import is an error the user sees."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from strategies.core.settings import ConfigError, RoundSettings
from strategies.methods import LOADED, client_side
from tasks.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]
MODULE = "oot_shrunk_method"
PATH = f"{MODULE}:Shrunk"
SOURCE = '''
from dataclasses import dataclass

from strategies.methods.algorithm import own_key
from strategies.methods.celgc import CELGC


@dataclass(frozen=True)
class ShrunkSettings:
    shrink: float = own_key("shrink", "factor on the clients' lr and clip", default=0.5,
                            check=lambda v: 0 < v <= 1, rule="in (0, 1]")


class Shrunk(CELGC):
    """CELGC's server and exchange kind; clients step with lr and clip times its own key."""

    name = "shrunk"
    Settings = ShrunkSettings

    @classmethod
    def client(cls, exchange, group):
        f = cls.options_of(exchange.settings).shrink
        s = exchange.settings
        exchange.settings = s.replace(lr=s.lr * f, clip=s.clip * f)
        return super().client(exchange, group)


NotAMethod = 3
'''
#: a server optimiser of its own (``strategies.methods.fedopt``) with a key FedAvgM has too, another default
SGD_MODULE = "oot_server_sgd"
SGD = f"{SGD_MODULE}:ServerSGD"
SGD_SOURCE = '''
from dataclasses import dataclass

from strategies.methods.algorithm import own_key
from strategies.methods.fedopt import FedOpt


@dataclass(frozen=True)
class ServerSGDSettings:
    server_lr: float = own_key("server-lr", "eta, the server's step on the averaged update", default=0.1,
                               check=lambda v: v > 0, rule="> 0")


class ServerSGD(FedOpt):
    """FedAvg with a server learning rate: x <- x - eta (x - mean_k x_k)."""

    name = "server-sgd"
    Settings = ServerSGDSettings

    def update(self, x, g, slots):
        return x - self.options.server_lr * g
'''
SMALL = {"num-clients": 3, "num-rounds": 1, "local-steps": 2, "batch-size": 16, "device": "cpu"}


@pytest.fixture
def outside(tmp_path, monkeypatch):
    (tmp_path / f"{MODULE}.py").write_text(textwrap.dedent(SOURCE))
    (tmp_path / f"{SGD_MODULE}.py").write_text(textwrap.dedent(SGD_SOURCE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, MODULE, raising=False)
    monkeypatch.delitem(sys.modules, SGD_MODULE, raising=False)
    monkeypatch.setattr("strategies.methods.LOADED", {})
    return PATH


def test_a_method_by_import_path_runs_on_every_backend(runs, outside):
    config = {"algorithm": outside, "shrunk.shrink": 0.25, "num-clients": 3}
    flower = runs.flower("flower", **config)
    runs.same(flower, runs.engine("engine", "sequential", **config), exact=True)
    celgc = runs.flower("celgc", **{"num-clients": 3})  # its key is unknown to another method's run
    assert any(not torch.equal(flower[0][k], v) for k, v in celgc[0].items())


@pytest.mark.parametrize("values, message", [
    ({"algorithm": PATH, "shrunk.shrnk": 0.3}, r"did you mean 'shrunk.shrink' for 'shrunk.shrnk'\?"),
    ({"algorithm": PATH, "shrunk.shrink": 2}, r"shrunk.shrink must be in \(0, 1\], got 2.0"),
    ({"algorithm": PATH, "shrink": 0.3}, r"'shrink' is a method's own key, written under the method's name: "
                                         r"shrunk.shrink \(the running algorithm 'oot_shrunk_method:Shrunk' reads"),
    ({"algorithm": SGD, "fedavgm.server-lr": 0.3},
     r"fedavgm.server-lr = 0.3 is a setting of algorithm 'fedavgm', not of the running algorithm "
     r"'oot_server_sgd:ServerSGD' .*the running method's own is server-sgd.server-lr"),
    ({"algorithm": f"{MODULE}:NotAMethod"}, r"is not a method: NotAMethod must be a concrete subclass"),
    ({"algorithm": "no_such_module_here:Method"}, r"module 'no_such_module_here' does not import here \(No module "
                                                  r"named 'no_such_module_here'\)\. A method of your own must import "
                                                  r"in every process .*stop-local"),
    ({"algorithm": "fed avg"}, r"algorithm must be one of celgc, .* or an import path"),
])
def test_bad_paths_and_keys_are_named(outside, values, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.from_mapping(values)


def test_a_node_runs_only_the_method_its_run_config_names(outside):
    settings = RoundSettings(server_round=1, local_steps=1, batch_size=4, lr=0.1, clip=1.0, weight_decay=0.0,
                             momentum=0.0, algorithm="shrunk", extra={"shrink": 0.5})
    with pytest.raises(ConfigError, match="'shrunk', which this node does not have"):
        client_side(settings)  # a round naming a method this node's run config did not load
    RunConfig.from_mapping({"algorithm": outside})  # the node's run config names it: loaded
    from strategies import methods

    assert client_side(settings) is methods.LOADED["shrunk"]
    assert LOADED is not methods.LOADED  # the fixture's registry, not the process's


def _trainable_step(x0: dict, fedavg: dict, eta: float) -> dict:
    """One round of FedAvg with a server learning rate, by hand: x1 = x0 + eta (mean - x0)."""
    return {k: x0[k] + eta * (fedavg[k] - x0[k]) for k in x0}


def test_its_own_server_lr_on_the_engine_and_the_runner(tmp_path, outside):
    """The engine reading this project's pyproject.toml (which lists fedavgm.server-lr = 1.0) and the
    runner's in-process backend run the outside method with its own default 0.1: one round is
    x0 + 0.1 (mean - x0), where mean is local SGD's (FedAvg's) model of the same round; FedAvgM
    reads its own 1.0 from the same file."""
    from server.app import initial_model
    from simulations.engine import run_engine
    from simulations.engine.run import parse
    from simulations.runner import load_experiment, run_experiment
    from tasks import load_task
    from tasks.runs.results import load_weights, read_results

    keys = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in SMALL.items())
    where = f"results-dir={str(tmp_path)!r}"

    def engine(algorithm: str, name: str):
        cfg, options, _ = parse(["--config", str(ROOT / "pyproject.toml"), "--run-config",
                                 f"algorithm={algorithm!r} {keys} {where} run-name={name!r}"])
        return cfg, run_engine(cfg, options, show_progress=False).state

    cfg, mine = engine(SGD, "sgd")
    assert cfg.method_options == {"server-lr": 0.1}
    assert engine("fedavgm", "fedavgm")[0].method_options == {"server-momentum": 0.9, "server-lr": 1.0}
    _, fedavg = engine("local-sgd", "fedavg")
    task = load_task(cfg)
    x0 = initial_model(task, cfg.seed).state_dict()
    trainable = [k for k, _ in initial_model(task, cfg.seed).named_parameters()]
    expected = _trainable_step({k: x0[k] for k in trainable}, fedavg, 0.1)
    for k in trainable:
        torch.testing.assert_close(mine[k], expected[k], rtol=0, atol=1e-6)
    header, _ = read_results(tmp_path / "sgd" / "results.jsonl")
    assert header["config"]["server-sgd.server-lr"] == 0.1 and "fedavgm.server-lr" not in header["config"]

    file = tmp_path / "server-sgd.toml"
    file.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in {"algorithm": SGD, **SMALL}.items()))
    values = load_experiment(file, results_dir=tmp_path / "runner")
    folder = run_experiment(values, backend="inprocess")
    header, _ = read_results(folder / "results.jsonl")
    assert header["config"]["server-sgd.server-lr"] == 0.1
    runner = load_weights(folder / "model.pt")
    for k, v in mine.items():
        assert torch.equal(runner[k], v), k  # the Flower path (in process) == the engine, bit for bit


def test_a_node_that_cannot_import_the_method_fails_the_run_naming_it(runs, outside, monkeypatch):
    """A ClientApp whose node lacks the module (a deployed SuperNode without it): its error reaches
    the server, and the run's failure -- the wrapper's `error:` line -- names the module and where it
    must import."""
    import client.app
    from strategies.methods import method

    def without_the_module(context):
        return method("oot_absent_on_the_node:ServerSGD")  # what the node's run config parse raises

    monkeypatch.setattr(client.app, "run_config", without_the_module)
    with pytest.raises(Exception, match=r"module 'oot_absent_on_the_node' does not import here.*stop-local") as info:
        runs.flower("absent", **{"algorithm": SGD, **SMALL})
    assert "round 1" in str(info.value)


def _app_with_the_method(folder: Path, lines: list[str]) -> Path:
    """A user's app: this project's pyproject.toml with the method's keys added to
    [tool.flwr.app.config], and the method's module in the app's folder (flwr run ships it)."""
    folder.mkdir()
    text = (ROOT / "pyproject.toml").read_text()
    marker = "# END generated by simulations.docs_tables\n"
    (folder / "pyproject.toml").write_text(text.replace(marker, marker + "".join(f"{line}\n" for line in lines)))
    (folder / f"{SGD_MODULE}.py").write_text(textwrap.dedent(SGD_SOURCE))
    return folder


@pytest.mark.realproc
def test_plain_flwr_run_takes_the_method_and_its_keys(tmp_path, outside, runs):
    """`flwr run .` in an app whose [tool.flwr.app.config] lists the method's keys (the lines
    `python -m simulations.docs_tables --method ...` prints) and whose folder holds its module:
    run once with its default (0.1, not FedAvgM's 1.0), once with its key set; the model equals the
    in-process apps'. The same app config runs FedAvgM with its own keys (checked by the config)."""
    from simulations.docs_tables import app_config_lines
    from simulations.flower import LocalSuperLink, wait_for_run
    from simulations.flower.cli import app_config, parse_cli_json
    from simulations.flower.processes import exe
    from tasks.runs.results import load_weights, read_results

    lines = app_config_lines(SGD)
    assert lines == ['server-sgd.server-lr = 0.1  # algorithm = "oot_server_sgd:ServerSGD": eta, the server\'s step '
                     'on the averaged update']
    app = _app_with_the_method(tmp_path / "app", lines)
    assert RunConfig.from_app({**app_config(app), "algorithm": "fedavgm"}).method_options["server-lr"] == 1.0
    results = tmp_path / "results"
    keys = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in SMALL.items())
    (tmp_path / "superlink").mkdir()
    with LocalSuperLink(cwd=tmp_path / "superlink") as superlink:
        for name, own in (("default", ""), ("set", "server-sgd.server-lr=0.05")):
            config = f"algorithm={SGD!r} {keys} results-dir={str(results)!r} run-name={name!r} {own}"
            out = subprocess.run([exe("flwr"), "run", ".", superlink.connection, "--run-config", config,
                                  "--federation-config", "num-supernodes=3", "--format", "json"],
                                 cwd=app, env=superlink.env, capture_output=True, text=True, timeout=120)
            run_id = int(parse_cli_json(out.stdout)["run-id"])
            run = wait_for_run(run_id, superlink, timeout=300)
            assert run["status"] == "finished:completed", run.get("logs", "")[-3000:]
    assert read_results(results / "default" / "results.jsonl")[0]["config"]["server-sgd.server-lr"] == 0.1
    header, _ = read_results(results / "set" / "results.jsonl")
    assert header["config"]["server-sgd.server-lr"] == 0.05
    flower = load_weights(results / "set" / "model.pt")
    loop, _ = runs.flower("loop", **{"algorithm": SGD, **SMALL, "server-sgd.server-lr": 0.05})
    for k, v in loop.items():
        torch.testing.assert_close(flower[k], v, rtol=0, atol=1e-6)


@pytest.mark.realproc
def test_the_wrapper_names_a_method_the_apps_cannot_import(tmp_path):
    """The module imports where the wrapper runs (its folder) but not in the apps (not in the app's
    folder, not installed, no PYTHONPATH): exit 1 and an `error:` line naming the module and the fix."""
    (tmp_path / "oot_here_only.py").write_text(textwrap.dedent(SGD_SOURCE))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    keys = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in {**SMALL, "num-clients": 2}.items())
    proc = subprocess.run([sys.executable, "-m", "simulations.flower", str(ROOT), "--quiet", "--timeout", "300",
                           "--run-config", f"algorithm='oot_here_only:ServerSGD' {keys} results-dir={str(tmp_path)!r}",
                           "--federation-config", "num-supernodes=2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors and re.search(r"celgc run failed: ValueError: algorithm 'oot_here_only:ServerSGD': module "
                                r"'oot_here_only' does not import here .*stop-local", errors[-1]), proc.stderr[-3000:]
