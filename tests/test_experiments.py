"""The experiment files: valid run-config overrides for flwr and RunConfig, the paper's settings,
global-epoch budgets, and single-machine clipped SGD (N = 1) end to end."""

import math
from pathlib import Path

import pytest
import tomllib
import torch
from flwr.common.config import parse_config_args

import client.local_round as local_round
from client.app import app as client_app
from server.app import app as server_app
from server.app import initial_model
from simulations.loopback import LoopbackGrid, run_server_app
from simulations.runner import load_experiment, load_plan
from simulations.sweep import Sweep
from strategies.core.local_update import RoundSettings
from tasks import load_task
from tasks.config import RunConfig
from tasks.runs.results import load_weights, read_results

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "simulations" / "experiments"
FILES = sorted(EXPERIMENTS.rglob("*.toml"))
APP_KEYS = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"])
# Training-set sizes of the real data: images; tokens // bptt (70) for the corpora.
TRAIN_SIZE = {"cifar10": 50_000, "ptb": 929_589 // 70, "wikitext2": 2_088_628 // 70, "digits": 1438}
PAPER = {  # N, local batch, lr, clip, weight decay, milestones, local steps of CELGC runs, global epochs
    "cifar10": (8, 16, 0.1, 1.0, 5e-4, (80.0, 120.0), {2, 4, 8, 16, 32}, 160),  # the authors' scripts
    "ptb": (8, 3, 30.0, 7.5, 1.2e-6, (), {2, 4, 8, 16}, 250),
    "wikitext2": (8, 10, 30.0, 7.5, 1.2e-6, (), {2, 4, 8, 16}, 300),
}




def epochs(cfg: RunConfig) -> float:
    return cfg.num_rounds * cfg.num_clients * cfg.local_steps * cfg.batch_size / TRAIN_SIZE[cfg.task]


def test_files_are_flat_overrides_that_flwr_and_runconfig_read():
    assert len(FILES) > 40
    names = set()
    for path in FILES:
        data = tomllib.loads(path.read_text())
        sweep = data.pop("sweep", None)
        assert set(data) <= APP_KEYS, (path, set(data) - APP_KEYS)
        if sweep is None:  # a plain file is also a `flwr run . --run-config FILE.toml` override file
            flat = parse_config_args([str(path)])
            assert flat == data, path
            cfg = RunConfig.from_toml(path)
            assert cfg == RunConfig.from_mapping(flat)
            assert cfg.run_name and cfg.run_name not in names, path
            names.add(cfg.run_name)
        else:  # a sweep: every point a valid config with a folder of its own
            plan = load_plan(path, results_dir="unused")
            assert isinstance(plan, Sweep) and len(plan.seeds) >= 3, path
            for point in plan.points:
                name = plan.values_for(point)["run-name"]
                assert name not in names, path
                names.add(name)


def test_heterogeneity_sweeps_give_every_method_the_same_budget_and_five_seeds():
    plans = {p.stem: load_plan(p, results_dir="unused") for p in sorted((EXPERIMENTS / "hetero-digits").glob("*.toml"))}
    assert {k.split("-", 1)[0] for k in plans} == {"a0.05", "a0.1", "a1", "iid"}
    for name, plan in plans.items():
        cfg = RunConfig.from_mapping(plan.base)
        assert cfg.num_rounds * cfg.local_steps == 160 and cfg.batch_size == 32, name
        assert plan.seeds == [0, 1, 2, 3, 4] and plan.tune_seeds == 2 and cfg.valid_fraction == 0.1
        assert ("clip" in plan.grid) == cfg.clipping, name  # each tuned on its own grid: lr (and clip when it clips)
        assert len(plan.grid["lr"]) >= 3


def test_i_and_n_sweeps_keep_the_budget_and_one_point_per_protocol():
    """Communication against I: 160 local steps per client at every I in 1..32, N = 8, 5 seeds; Protocol A one
    (lr, clip) per split for every I, Protocol B each I on its own grid. Speedup in N: N in 1..16, the same steps,
    batch and (lr, clip) for every N and both methods."""
    def plans(folder):
        return {p.stem: load_plan(p, results_dir="unused") for p in sorted((EXPERIMENTS / folder).glob("*.toml"))}

    for folder in ("isweep-digits", "isweep-digits-tuned"):
        for name, plan in plans(folder).items():
            cfg = RunConfig.from_mapping(plan.base)
            assert cfg.num_rounds * cfg.local_steps == 160 and cfg.num_clients == 8 and cfg.batch_size == 32, name
            assert plan.seeds == [0, 1, 2, 3, 4] and cfg.valid_fraction == 0.1, name
            assert bool(plan.grid) == (folder.endswith("tuned") or name.endswith("naive")), name
    fixed = plans("isweep-digits")
    for split in ("iid", "a0.1"):
        celgc = [RunConfig.from_mapping(p.base) for k, p in fixed.items() if k.startswith(f"{split}-celgc")]
        assert sorted(c.local_steps for c in celgc) == [1, 2, 4, 8, 16, 32]
        assert len({(c.lr, c.clip) for c in celgc}) == 1
    cfgs = {k: RunConfig.from_mapping(p.base) for k, p in plans("nsweep-digits").items()}
    assert sorted(c.num_clients for c in cfgs.values()) == [1, 2, 2, 4, 4, 8, 8, 16, 16]
    assert {(c.num_rounds * c.local_steps, c.batch_size, c.lr, c.clip) for c in cfgs.values()} == {(240, 32, 1.0, 0.3)}
    assert {c.algorithm for c in cfgs.values()} == {"single", "celgc", "naive"}


@pytest.mark.parametrize("folder", ["cifar10", "cifar10-hetero", "ptb", "ptb-hetero", "wikitext2", "wikitext2-hetero"])
def test_paper_settings_and_equal_epoch_budgets(folder):
    cfgs = {p.stem: RunConfig.from_toml(p) for p in sorted((EXPERIMENTS / folder).glob("*.toml"))}
    task = folder.split("-")[0]
    n, b, lr, clip, wd, milestones, steps, budget = PAPER[task]
    assert {c.local_steps for k, c in cfgs.items() if k.startswith("celgc")} == steps
    assert cfgs["naive"].algorithm == "naive" and cfgs["naive"].local_steps == 1
    for name, c in cfgs.items():
        assert c.task == task and c.batch_size == b and c.lr == lr and c.lr_milestones == milestones
        assert c.num_clients == (1 if name == "single" else n)
        assert c.clip == (math.inf if name.startswith("local-sgd") else clip)
        assert c.algorithm == {"naive": "naive", "local-sgd": "local-sgd", "single": "single"}.get(name.split("-I")[0],
                                                                                                   "celgc")
        per_round = c.num_clients * c.local_steps * c.batch_size / TRAIN_SIZE[task]
        assert budget <= epochs(c) < budget + per_round, name  # the same budget, rounded up to a round
        assert 0.5 <= c.eval_every * per_round <= 1.5  # evaluated about once per global epoch
        assert c.weight_decay == wd and c.momentum == 0
        if task == "cifar10":  # the averaged model on the training set at each evaluation, as the authors
            assert c.eval_train and not c.average_iterates
        else:  # hidden state carried across rounds, averaged iterates after the non-monotone trigger
            assert c.client_state == "keep" and c.average_iterates and c.nonmono == 5
            assert c.text_split == ("blocks" if folder.endswith("hetero") else "contiguous")
    if folder.endswith("hetero"):
        assert all(c.partitioner == "similarity" for c in cfgs.values())
        if task != "cifar10":
            assert all(c.similarity == 0 for c in cfgs.values())  # one contiguous region per client
    else:
        assert all(c.partitioner == "homogeneous" for c in cfgs.values())
        assert "single" in cfgs and {c.local_steps for k, c in cfgs.items() if k.startswith("local-sgd")} == steps


def test_every_preset_header_cites_a_source_for_every_value():
    for path in FILES:
        if path.parent.name == "digits":
            continue
        text = path.read_text()
        header = [line for line in text.splitlines() if line.startswith("#")]
        cited = {line.split(":")[0].strip("# ").strip() for line in header if line.startswith("#   ")}
        keys = set(tomllib.loads(text))
        assert keys <= cited, (path.name, keys - cited)
        assert any("arXiv 2205.05040" in line for line in header), path
        for line in header:
            if line.startswith("#   ") and line.split(":")[0].strip("# ") in keys:
                assert len(line.split(":", 1)[1].strip()) > 10, (path.name, line)  # a source, not a blank


def test_single_machine_file_runs_and_is_plain_clipped_sgd(tmp_path):
    """N = 1: averaging one client is the identity, so R rounds of I steps are R*I steps of
    clipped SGD on one machine (the single-machine baseline), through the real apps."""
    values = load_experiment(EXPERIMENTS / "cifar10" / "single.toml", results_dir=tmp_path, overrides={
        "task": "digits", "num-rounds": 3, "local-steps": 4, "batch-size": 16, "lr-milestones": "",
        "device": "cpu", "node-wait": 2.0, "eval-every": 1})
    assert values["num-clients"] == 1
    grid = LoopbackGrid(client_app, {**RunConfig().to_mapping(), **values}, 1)
    run_server_app(server_app, grid)
    folder = Path(values["results-dir"]) / values["run-name"]
    header, rows = read_results(folder / "results.jsonl")
    assert rows[-1]["replies"] == 1 and rows[-1]["num-steps"] == 4
    assert rows[-1]["test-accuracy"] > rows[0]["test-accuracy"]
    assert all("train-eval-loss" in r for r in rows)  # eval-train of the CIFAR-10 presets

    cfg = RunConfig.from_mapping({**RunConfig().to_mapping(), **values})
    state = initial_model(load_task(cfg), cfg.seed).state_dict()
    hp = {"local-steps": 4, "lr": cfg.lr, "clip": cfg.clip, "weight-decay": cfg.weight_decay, "momentum": 0.0,
          "batch-size": 16}
    for r in range(1, 4):
        state, _ = local_round.train_round(cfg, 0, RoundSettings.from_config({**hp, "server-round": r}), state)
    fed = load_weights(folder / "model.pt")
    assert all(torch.equal(fed[k], state[k]) for k in state)
