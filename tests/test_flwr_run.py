"""Smoke test of the real path: `flwr run` on this app, a private SuperLink, Ray simulation.

Pass or fail comes from the run's status (`flwr ls`), never from `flwr run`'s exit code
(it exits 0 for failed runs too).
"""

import re
from pathlib import Path

import pytest
import torch

from client.app import app as client_app
from server.app import app as server_app
from simulations.engine import run_engine
from simulations.flower import LocalSuperLink, RunFailed, run_app
from simulations.loopback import LoopbackGrid, run_server_app
from tasks.config import RunConfig
from tasks.runs.results import load_weights, read_results

pytestmark = pytest.mark.realproc  # real processes: skip with -m "not realproc"

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"num-clients": 3, "num-rounds": 2, "local-steps": 2, "seed": 3}


@pytest.fixture(scope="module")
def superlink(tmp_path_factory):
    with LocalSuperLink(cwd=tmp_path_factory.mktemp("superlink")) as sl:
        yield sl


def test_flwr_run_completes_and_matches_the_in_process_app(superlink, tmp_path):
    config = {**SMALL, "results-dir": str(tmp_path), "run-name": "flwr"}
    run = run_app(ROOT, config, {"num-supernodes": 3}, timeout=240, superlink=superlink)
    assert run["status"] == "finished:completed"
    header, rows = read_results(tmp_path / "flwr" / "results.jsonl")
    assert header["config"]["num-clients"] == 3 and [r["round"] for r in rows] == [0, 1, 2]
    assert rows[-1]["replies"] == 3
    flower = load_weights(tmp_path / "flwr" / "model.pt")

    values = {**RunConfig().to_mapping(), **SMALL, "results-dir": str(tmp_path), "run-name": "loop"}
    run_server_app(server_app, LoopbackGrid(client_app, values, 3))
    loop = load_weights(tmp_path / "loop" / "model.pt")
    for key in flower:
        torch.testing.assert_close(flower[key], loop[key], rtol=0, atol=1e-6)


def test_federation_of_the_wrong_size_is_a_failed_run_with_the_fix(superlink, tmp_path):
    # more nodes than clients (fewer are fine: a node then serves several)
    config = {**SMALL, "results-dir": str(tmp_path)}
    with pytest.raises(RunFailed) as info:
        run_app(ROOT, config, {"num-supernodes": 4}, timeout=240, superlink=superlink)
    assert info.value.status == "finished:failed"
    text = f"{info.value}\n{info.value.logs_tail}\n{info.value.details}"
    assert "num-supernodes=3" in text and "num-partitions=4" in text
    # the one-line cause comes first (before Flower's traceback and the status line)
    assert re.match(r'celgc run failed \(CELGC I=\d+ on \w+\): FederationError: run with --federation-config '
                    r'"num-supernodes=3"', str(info.value))


def test_flwr_run_carries_client_state_across_rounds(superlink, tmp_path, corpus):
    """The language model's hidden state and place travel in Flower's Context.state under the
    real simulation runtime: `flwr run` equals the in-process app with state kept, and differs
    from stateless clients (the full-size AWD-LSTM on a tiny corpus)."""
    corpus(tmp_path / "data", words=1500)
    lm = {"task": "ptb", "data-dir": str(tmp_path / "data"), "num-clients": 2, "num-rounds": 3, "local-steps": 2,
          "batch-size": 2, "lr": 5.0, "clip": 0.5, "device": "cpu", "eval-every": 3, "results-dir": str(tmp_path)}
    run = run_app(ROOT, {**lm, "run-name": "flwr-lm"}, {"num-supernodes": 2}, timeout=400, superlink=superlink)
    assert run["status"] == "finished:completed"
    flower = load_weights(tmp_path / "flwr-lm" / "model.pt")
    _, rows = read_results(tmp_path / "flwr-lm" / "results.jsonl")
    assert all(r["train-ce"] < r["train-loss"] for r in rows[1:])
    loops = {}
    for mode in ("keep", "reset"):
        values = {**RunConfig().to_mapping(), **lm, "client-state": mode, "run-name": f"loop-{mode}"}
        run_server_app(server_app, LoopbackGrid(client_app, values, 2))
        loops[mode] = load_weights(tmp_path / f"loop-{mode}" / "model.pt")
    for key in flower:
        torch.testing.assert_close(flower[key], loops["keep"][key], rtol=0, atol=1e-6)
    assert not torch.allclose(flower["encoder.weight"], loops["reset"]["encoder.weight"], rtol=0, atol=1e-6)


def test_plain_flwr_run_serves_the_default_clients_on_flowers_two_nodes(superlink, tmp_path):
    """No num-clients, no federation config: the default 8 clients, 4 on each of Flower's 2
    SuperNodes, give the engine's model and rows (the sequential path on both)."""
    config = {"num-rounds": 2, "local-steps": 2, "results-dir": str(tmp_path), "run-name": "defaults"}
    run = run_app(ROOT, config, None, timeout=240, superlink=superlink)
    assert run["status"] == "finished:completed"
    header, rows = read_results(tmp_path / "defaults" / "results.jsonl")
    assert header["config"]["num-clients"] == 8 and rows[-1]["replies"] == 8
    assert rows[-1]["test-accuracy"] > rows[0]["test-accuracy"]
    engine = run_engine(RunConfig.from_mapping({**config, "run-name": "engine"}), show_progress=False)
    flower = load_weights(tmp_path / "defaults" / "model.pt")
    assert flower.keys() == engine.state.keys()
    for key in flower:
        torch.testing.assert_close(flower[key], engine.state[key], rtol=0, atol=0)
    _, engine_rows = read_results(tmp_path / "engine" / "results.jsonl")
    for ours, theirs in zip(rows, engine_rows, strict=True):
        assert ours.get("train-loss") == theirs.get("train-loss") and ours["test-accuracy"] == theirs["test-accuracy"]


def test_a_dp_run_through_flwr_run_equals_the_engine(superlink, tmp_path):
    """The DP keys through the real `flwr run` (Ray simulation, Flower's 2 nodes for 4 clients, 2 sampled a
    round): in reproducible mode the same noise and sample as the engine, so the same model and epsilon."""
    dp = {"num-clients": 4, "clients-per-round": 2, "dp-noise-multiplier": 1.0, "dp-buffers": "frozen",
          "dp-reproducible": True}
    config = {**SMALL, **dp, "results-dir": str(tmp_path), "run-name": "flwr-dp"}
    run = run_app(ROOT, config, {"num-supernodes": 2}, timeout=240, superlink=superlink)
    assert run["status"] == "finished:completed"
    header, rows = read_results(tmp_path / "flwr-dp" / "results.jsonl")
    assert header["privacy"]["private"] is False and rows[-1]["dp-private"] == 0
    values = {**RunConfig().to_mapping(), **SMALL, **dp, "results-dir": str(tmp_path), "run-name": "engine-dp",
              "device": "cpu"}
    engine = run_engine(RunConfig.from_mapping(values), show_progress=False)
    assert engine.rows[-1]["dp-epsilon"] == rows[-1]["dp-epsilon"] > 0
    assert engine.rows[-1]["dp-noise-std"] == rows[-1]["dp-noise-std"]
    flower = load_weights(tmp_path / "flwr-dp" / "model.pt")
    for key in flower:
        torch.testing.assert_close(flower[key], engine.state[key].cpu(), rtol=0, atol=1e-6)
