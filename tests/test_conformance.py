"""One conformance harness for every method: the registry's and one outside the project
(``algorithm = "package.module:Class"``) go through the same checks --

* the engine one client after another == the real ServerApp + ClientApp in process, bit for bit;
* the vectorised engine (vmap) == the Flower path within float32 rounding (a method that does not
  vectorise is refused with its reason);
* multi-client nodes (2 nodes for 3 clients) == one client a node, bit for bit;
* a resumed run == the uninterrupted one, bit for bit (server state checkpointed);
* a misspelled key of the method is refused naming the closest key;
* real processes: torchrun 2 gloo processes == 1, ``flwr run`` == in process (``realproc``).

A method added to strategies/methods/ is picked up with no edit here (``SPECIAL`` only holds the
constraints a method states itself: naive one step a round, single one client). Per-method test
files keep what is specific: the reference from the paper.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from strategies.methods import METHODS, method
from tasks.config import RunConfig

pytest.importorskip("flwr")

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE_MODULE = "conformance_outside_method"
OUTSIDE = f"{OUTSIDE_MODULE}:Damped"
OUTSIDE_SOURCE = '''
from dataclasses import dataclass

from strategies.methods.algorithm import own_key
from strategies.methods.celgc import CELGC


@dataclass(frozen=True)
class DampedSettings:
    damping: float = own_key("damping", "factor on the clients' lr", default=0.5, check=lambda v: 0 < v <= 1,
                             rule="in (0, 1]")


class Damped(CELGC):
    name = "damped"
    Settings = DampedSettings

    @classmethod
    def client(cls, exchange, group):
        exchange.settings = exchange.settings.replace(lr=exchange.settings.lr * cls.options_of(exchange.settings).damping)
        return super().client(exchange, group)
'''

#: the constraints a method states itself (its ``problems``), not choices of this harness
SPECIAL = {"naive": {"local-steps": 1, "num-rounds": 3}, "single": {"num-clients": 1}}
BASE = {"num-clients": 3, "num-rounds": 2, "local-steps": 2, "batch-size": 8}
ALL = [*METHODS, OUTSIDE]


@pytest.fixture(autouse=True)
def outside_method(tmp_path_factory, monkeypatch):
    folder = tmp_path_factory.getbasetemp() / "conformance-outside"
    folder.mkdir(exist_ok=True)
    (folder / f"{OUTSIDE_MODULE}.py").write_text(textwrap.dedent(OUTSIDE_SOURCE))
    monkeypatch.syspath_prepend(str(folder))


def case(name: str, **more) -> dict:
    return {**BASE, **SPECIAL.get(name, {}), "algorithm": name, **more}


def own_key_of(name: str) -> str | None:
    return next(iter(method(name).run_config_keys()), None)


@pytest.mark.parametrize("name", ALL)
def test_engine_equals_the_flower_path_bit_for_bit(runs, name):
    config = case(name)
    runs.same(runs.flower("flower", **config), runs.engine("engine", "sequential", **config), exact=True)


@pytest.mark.parametrize("name", ALL)
def test_vmap_equals_the_flower_path_to_rounding(runs, mlp_digits, name):
    config = case(name)
    if not method(name).vectorises:
        with pytest.raises(ValueError, match=f"engine-path=vmap does not run algorithm '{method(name).name}'"):
            runs.engine("vmap", "vmap", **config)
        return
    runs.same(runs.flower("flower", **config), runs.engine("vmap", "vmap", **config), exact=False)


@pytest.mark.parametrize("name", [n for n in ALL if SPECIAL.get(n, {}).get("num-clients", 3) > 1])
def test_multi_client_nodes_equal_one_client_a_node(runs, name):
    config = case(name)
    spread, single = runs.flower("two-nodes", num_nodes=2, **config), runs.flower("three-nodes", **config)
    for key, value in single[0].items():
        assert torch.equal(spread[0][key], value), key


@pytest.mark.parametrize("name", ALL)
def test_resume_equals_the_uninterrupted_run(runs, name):
    config = case(name, **{"num-rounds": 3})
    whole = runs.engine("whole", "sequential", **config)
    runs.engine("part", "sequential", **{**config, "num-rounds": 2})
    resumed = runs.engine("part", "sequential", **{**config, "resume": True})
    for key, value in whole[0].items():
        assert torch.equal(resumed[0][key], value), key


@pytest.mark.parametrize("name", ALL)
def test_resume_on_the_flower_path_equals_the_uninterrupted_run(runs, name):
    """The ServerApp's checkpoint holds the method's server state (SCAFFOLD: c and every c_i)."""
    config = case(name, **{"num-rounds": 3, "checkpoint-every": 1})
    whole = runs.flower("whole", **config)
    runs.flower("part", **{**config, "num-rounds": 2})
    resumed = runs.flower("part", **{**config, "resume": True})
    for key, value in whole[0].items():
        assert torch.equal(resumed[0][key], value), key


@pytest.mark.parametrize("name", ALL)
def test_a_misspelled_key_is_named(name):
    key = own_key_of(name) or "local-steps"
    typo = key[:-1] + key[-1] * 2
    with pytest.raises(ValueError, match=f"did you mean '{key}' for '{typo}'"):
        RunConfig.from_mapping({"algorithm": name, typo: 1})


@pytest.mark.realproc
@pytest.mark.parametrize("name", [n for n in METHODS if SPECIAL.get(n, {}).get("num-clients", 3) > 1])
def test_two_engine_processes_equal_one(tmp_path, command, one_process, name):
    keys = {**RunConfig().to_mapping(), **case(name), "device": "cpu", "results-dir": str(tmp_path)}
    overrides = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in case(name).items())
    command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
             "simulations.engine", "--config", str(ROOT / "pyproject.toml"), "--quiet",
             "--run-config", f"{overrides} device='cpu' results-dir={str(tmp_path)!r} run-name='two'"])
    one_process(tmp_path, "two", keys)


@pytest.mark.realproc
@pytest.mark.parametrize("name", list(METHODS))
def test_flwr_run_equals_in_process(tmp_path, runs, name):
    from simulations.flower import LocalSuperLink, run_app
    from tasks.runs.results import load_weights

    config = {**case(name), "device": "cpu", "results-dir": str(tmp_path), "run-name": "flwr"}
    (tmp_path / "superlink").mkdir()
    with LocalSuperLink(cwd=tmp_path / "superlink") as superlink:
        run = run_app(ROOT, config, {"num-supernodes": config["num-clients"]}, timeout=400, superlink=superlink)
    assert run["status"] == "finished:completed"
    flower = load_weights(tmp_path / "flwr" / "model.pt")
    loop, _ = runs.flower("loop", **{**config, "run-name": "loop"})
    for key in flower:
        torch.testing.assert_close(flower[key], loop[key], rtol=0, atol=1e-6)
