"""Sweeps (simulations/sweep.py, the runner), the validation split, the statistics over seeds and the
comparison (simulations/compare.py): files checked up front, folders per point, selection on validation,
finished points skipped, interrupted ones resumed, parallel == sequential, intervals against scipy."""

import json
import math
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

from simulations import runner
from simulations.compare import compare, load_compared
from simulations.scaling import scaling
from simulations.stats import band, summary
from simulations.summary import load_run, rounds_to_target
from simulations.sweep import format_value, last_value, read_manifest, select_point
from tasks import load_task, partitions, splits, validation_set
from tasks.config import RunConfig
from tasks.partition import dirichlet, hold_out, partition
from tasks.runs.results import code_digest, load_weights, source
from tasks.shakespeare import ShakespeareTask

THREADS = torch.get_num_threads()
BASE = {"task": "digits", "num-rounds": 2, "num-clients": 4, "local-steps": 2, "device": "cpu", "valid-fraction": 0.1,
        "checkpoint-every": 1}


def _file(tmp_path, sweep: str, name: str = "sw", **keys) -> str:
    body = "\n".join(f"{k} = {json.dumps(v)}" for k, v in {**BASE, **keys, "run-name": name}.items())
    path = tmp_path / f"{name}.toml"
    path.write_text(body + "\n\n[sweep]\n" + sweep)
    return str(path)


# --- the [sweep] table ------------------------------------------------------------------------
@pytest.mark.parametrize("table, message", [
    ("learning-rate = [0.1]\n", "neither run-config keys"),
    ("seed = [0, 1]\n", "may not vary"),
    ("lr = []\n", "non-empty list"),
    ("lr = 0.1\n", "non-empty list"),
    ("lr = [0.1, 0.1]\n", "lists a value twice"),
    ("seeds = 0\n", "seeds must be"),
    ("seeds = [1, 1]\n", "distinct"),
    ("seeds = 3\ntune-seeds = 4\n", "tune-seeds must be"),
    ("select = \"test-accuracy\"\n", "select must be one of"),
    ("lr = [0.1, -1.0]\n", "lr"),
    ("lr = [0.1]\ntune = { seed = 3 }\n", "tune must be a table"),
])
def test_bad_sweep_tables_are_refused_before_any_run(tmp_path, table, message):
    path = _file(tmp_path, table)
    with pytest.raises(ValueError, match=message):
        runner.load_plan(path, results_dir=tmp_path / "res")
    assert not (tmp_path / "res").exists()


def test_a_grid_needs_a_validation_set(tmp_path):
    path = _file(tmp_path, "lr = [0.1, 0.3]\n", **{"valid-fraction": 0.0})
    with pytest.raises(ValueError, match="needs a validation set: set valid-fraction"):
        runner.load_plan(path, results_dir=tmp_path)


def test_points_names_and_stages(tmp_path):
    plan = runner.load_plan(_file(tmp_path, 'lr = [0.1, 0.3]\nclip = [0.5, "off"]\nseeds = 3\ntune-seeds = 2\n'),
                            results_dir=tmp_path)
    names = [p.name(plan.name) for p in plan.points]
    assert len(names) == 8 and names[0] == "sw-lr=0.1-clip=0.5-seed=0" and names[3] == "sw-lr=0.1-clip=off-seed=1"
    assert [p.name(plan.name) for p in plan.final(plan.grid_points()[1])] == ["sw-lr=0.1-clip=off-seed=2"]
    assert plan.values_for(plan.points[2])["clip"] == "off" and plan.values_for(plan.points[2])["seed"] == 0
    short = runner.load_plan(_file(tmp_path, "lr = [0.1, 0.3]\nseeds = 2\ntune-seeds = 1\ntune = { num-rounds = 1 }\n",
                                   name="short"), results_dir=tmp_path)
    assert short.points[0].name("short") == "short-tune-lr=0.1-seed=0"
    assert short.values_for(short.points[0])["num-rounds"] == 1
    assert [p.seed for p in short.final(short.grid_points()[0])] == [0, 1]  # every seed at the file's budget
    assert format_value(math.inf) == "off" and format_value(1e-5) == "1e-05" and format_value(True) == "true"


def test_select_point_best_mean_missing_is_worst_ties_first():
    grid = {"lr": [0.1, 0.3, 1.0]}
    key = lambda v: (("lr", v),)  # noqa: E731
    assert select_point(grid, "valid-accuracy", {key(0.1): [0.5, 0.7], key(0.3): [0.9, None], key(1.0): [0.6, 0.6]}) \
        == key(0.1)
    assert select_point(grid, "valid-loss", {key(0.1): [2.0], key(0.3): [1.0], key(1.0): [1.0]}) == key(0.3)
    assert select_point(grid, "valid-accuracy", {}) == key(0.1)


# --- running a sweep --------------------------------------------------------------------------
def test_sweep_runs_selects_on_validation_skips_and_resumes(tmp_path, capsys):
    path = _file(tmp_path, "lr = [0.05, 0.5]\nseeds = 3\ntune-seeds = 2\n")
    res = tmp_path / "res"
    code = runner.main([path, "--backend", "engine", "--results-dir", str(res), "--jobs", "2"])
    assert code == 0
    manifest = read_manifest(res / "sw.sweep.json")
    scores = {lr: np.mean([last_value(res / f"sw-lr={lr}-seed={s}", "valid-accuracy") for s in (0, 1)])
              for lr in (0.05, 0.5)}
    best = max(scores, key=lambda lr: (scores[lr], lr == 0.05))  # ties: the first point
    assert manifest["selected"] == {"lr": best}
    assert sorted(manifest["runs"]) == sorted([f"sw-lr={lr}-seed={s}" for lr in (0.05, 0.5) for s in (0, 1)]
                                              + [f"sw-lr={best}-seed=2"])
    assert all(e["elapsed"] > 0 for e in manifest["runs"].values())
    row = load_run(res / f"sw-lr={best}-seed=2").rows[-1]
    assert row["round"] == 2 and 0 <= row["valid-accuracy"] <= 1 and "valid-loss" in row
    out = capsys.readouterr().out
    assert "sweep sw: 5 run, 0 skipped" in out

    # again: every point finished, nothing runs
    before = (res / f"sw-lr={best}-seed=2" / "results.jsonl").read_text()
    assert runner.main([path, "--backend", "engine", "--results-dir", str(res)]) == 0
    assert "sweep sw: 0 run, 5 skipped" in capsys.readouterr().out
    assert (res / f"sw-lr={best}-seed=2" / "results.jsonl").read_text() == before

    # an interrupted point (killed in round 2, before its checkpoint): only it runs again, to the same end
    target = res / "sw-lr=0.5-seed=1" / "results.jsonl"
    full = target.read_text()
    target.write_text("".join(full.splitlines(keepends=True)[:-1]))
    (target.parent / "checkpoint.pt").unlink()
    assert runner.main([path, "--backend", "engine", "--results-dir", str(res)]) == 0
    assert "sweep sw: 1 run, 4 skipped" in capsys.readouterr().out
    again = load_run(target.parent).rows[-1]
    assert again["test-accuracy"] == json.loads(full.splitlines()[-1])["test-accuracy"]
    kept = list(res.glob("sw-lr=0.5-seed=1.interrupted-*"))  # the partial run is kept aside, not deleted
    assert len(kept) == 1 and len(load_run(kept[0]).rows) == 2
    # a folder holding another config's run is reported and left as it was
    other = tmp_path / "other.toml"
    other.write_text((tmp_path / "sw.toml").read_text().replace('"num-clients" = 4', "num-clients = 4")
                     .replace("num-clients = 4", "num-clients = 2"))
    assert runner.main([str(other), "--backend", "engine", "--results-dir", str(res)]) == 1
    assert "holds a run of another config" in capsys.readouterr().out
    assert (res / f"sw-lr={best}-seed=2" / "results.jsonl").read_text() == before


def test_a_diverged_point_is_an_outcome_scored_the_worst(tmp_path, capsys):
    path = _file(tmp_path, "lr = [100.0, 0.1]\nseeds = 2\n", algorithm="local-sgd", clip="off")
    res = tmp_path / "res"
    assert runner.main([path, "--backend", "engine", "--results-dir", str(res), "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert "sweep sw: 2 run, 0 skipped (finished before), 2 diverged, 0 failed; selected on valid-accuracy: lr=0.1" in out
    manifest = read_manifest(res / "sw.sweep.json")
    assert manifest["selected"] == {"lr": 0.1} and manifest["runs"]["sw-lr=100-seed=0"]["status"] == "diverged"
    assert last_value(res / "sw-lr=100-seed=0", "valid-accuracy") is None  # it stopped before its last round
    assert runner.main([path, "--backend", "engine", "--results-dir", str(res)]) == 0  # the same outcome: skipped
    assert "sweep sw: 0 run, 4 skipped" in capsys.readouterr().out


def test_parallel_sweep_equals_sequential(tmp_path):
    """The same points at --jobs 2 (pool workers) and --jobs 1 (this process): every run gets one torch
    thread either way (recorded in its header), so the rows and models are identical, bit for bit."""
    path = _file(tmp_path, "lr = [0.1, 0.3]\nseeds = 2\n")
    torch.set_num_threads(2)  # this process's own count must not leak into its runs
    try:
        runner.run_all([path], "engine", results_dir=tmp_path / "par", jobs=2)
        runner.run_all([path], "engine", results_dir=tmp_path / "seq", jobs=1)
        assert torch.get_num_threads() == 2  # restored after the runs
    finally:
        torch.set_num_threads(THREADS)
    for name in ("sw-lr=0.1-seed=0", "sw-lr=0.1-seed=1", "sw-lr=0.3-seed=0", "sw-lr=0.3-seed=1"):
        a, b = load_run(tmp_path / "par" / name), load_run(tmp_path / "seq" / name)
        assert a.header["torch-threads"] == b.header["torch-threads"] == 1
        same_code = {k: source()[k] for k in ("version", "code")}  # ("dirty" follows any file, tests too)
        assert {k: a.header["source"][k] for k in same_code} == {k: b.header["source"][k] for k in same_code} == same_code
        assert [{k: v for k, v in r.items() if k != "wall-clock"} for r in a.rows] == \
            [{k: v for k, v in r.items() if k != "wall-clock"} for r in b.rows]
        wa, wb = load_weights(a.folder / "model.pt"), load_weights(b.folder / "model.pt")
        assert all(torch.equal(wa[k], wb[k]) for k in wa)


def _rewrite_header(folder, change):
    results = folder / "results.jsonl"
    header, *rows = map(json.loads, results.read_text().splitlines())
    change(header, rows)
    results.write_text("".join(json.dumps(line) + "\n" for line in [header, *rows]))


@pytest.mark.parametrize("made_by, why", [
    (lambda h, rows: h["source"].update(code="0" * 64, commit="f" * 40), "made by other code: started by version"),
    (lambda h, rows: h.pop("source"), "recorded no source"),
    (lambda h, rows: h.update({"torch-threads": 2}), "with 2 torch thread(s), this runs with 1"),
    (lambda h, rows: rows[2].update({"resumed-from-round": 1, "resumed-by": {
        "source": {**h["source"], "code": "1" * 64}, "torch-threads": 1}}), "resumed at round 1 by version"),
])
def test_a_finished_point_made_by_other_code_is_refused_then_rerun(tmp_path, capsys, made_by, why):
    """A finished sweep point is reused only when this code (and thread count) made it; else the runner
    refuses it, naming why and the command that reruns it, and that command keeps the old run aside."""
    path = _file(tmp_path, "seeds = 1\n")
    res, name = tmp_path / "res", "sw-seed=0"
    assert runner.main([path, "--backend", "engine", "--results-dir", str(res)]) == 0
    assert "sweep sw: 1 run, 0 skipped" in capsys.readouterr().out
    _rewrite_header(res / name, made_by)
    before = (res / name / "results.jsonl").read_text()
    assert runner.main([path, "--backend", "engine", "--results-dir", str(res)]) == 1
    out = capsys.readouterr().out
    assert "sweep sw: 0 run, 0 skipped" in out and "1 failed" in out
    assert "StaleRun" in out and why in " ".join(out.split())
    command = f"python -m simulations.runner {path} --backend engine --results-dir {res} --stale rerun"
    assert command in " ".join(out.replace("│", " ").split())
    assert (res / name / "results.jsonl").read_text() == before  # left as it was
    assert runner.main([path, "--backend", "engine", "--results-dir", str(res), "--stale", "rerun"]) == 0
    assert "sweep sw: 1 run, 0 skipped" in capsys.readouterr().out
    kept = list(res.glob(f"{name}.stale-*"))
    assert len(kept) == 1 and (kept[0] / "results.jsonl").read_text() == before
    header = load_run(res / name).header
    assert header["source"] == source() and header["torch-threads"] == 1
    assert runner.main([path, "--backend", "engine", "--results-dir", str(res)]) == 0  # now it is this code's
    assert "sweep sw: 0 run, 1 skipped" in capsys.readouterr().out


def test_the_code_digest_follows_every_python_file_of_the_project(tmp_path):
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "a.py").write_text("x = 1\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("y = 1\n")
    first = code_digest(tmp_path)
    (tmp_path / "tests" / "test_a.py").write_text("y = 2\n")  # tests do not change a result
    assert code_digest(tmp_path) == first
    (tmp_path / "tasks" / "a.py").write_text("x = 2\n")
    assert code_digest(tmp_path) != first
    (tmp_path / "tasks" / "a.py").write_text("x = 1\n")
    assert code_digest(tmp_path) == first
    (tmp_path / "tasks" / "b.py").write_text("")  # a new (untracked) module counts
    assert code_digest(tmp_path) != first
    assert source()["code"] == code_digest() and source()["version"]


# --- the validation split ----------------------------------------------------------------------
def test_hold_out_is_seeded_disjoint_and_off_by_default():
    part = np.arange(100, 200)
    kept, held = hold_out(part, 0.1, seed=3, partition_id=2)
    assert len(held) == 10 and len(kept) == 90 and not set(kept) & set(held)
    assert sorted([*kept, *held]) == list(part) and list(kept) == sorted(kept)  # the rest in its order
    assert np.array_equal(held, hold_out(part, 0.1, seed=3, partition_id=2)[1])
    assert not np.array_equal(held, hold_out(part, 0.1, seed=4, partition_id=2)[1])
    kept0, held0 = hold_out(part, 0.0, seed=3, partition_id=2)
    assert kept0 is part and len(held0) == 0
    with pytest.raises(ValueError, match="too few"):
        hold_out(np.arange(1), 0.1, 0, 0)


def test_valid_fraction_zero_leaves_partitions_identical_and_a_split_covers_the_data():
    off = RunConfig.from_mapping({"partitioner": "dirichlet", "dirichlet-alpha": 0.3, "seed": 2})
    on = off.replace(valid_fraction=0.2)
    reference = partition(load_task(off).labels, 8, "dirichlet", 2, alpha=0.3)
    assert all(np.array_equal(a, b) for a, b in zip(partitions(off), reference, strict=True))
    assert validation_set(off) is None
    valid = validation_set(on)
    union = np.concatenate([*partitions(on), valid])
    assert sorted(union) == list(range(load_task(on).train_size))  # disjoint, nothing lost
    assert all(abs(len(h) - 0.2 * (len(k) + len(h))) <= 1 for k, h in splits(on))


def test_valid_metrics_are_the_held_out_examples_and_equal_on_both_backends(tmp_path):
    from simulations.engine.run import run_engine
    from simulations.loopback import run_in_process

    values = {"num-rounds": 2, "num-clients": 2, "device": "cpu", "valid-fraction": 0.15, "results-dir": str(tmp_path),
              "node-wait": 5.0}
    engine = run_engine(RunConfig.from_mapping({**values, "run-name": "engine"}), show_progress=False)
    run_in_process({**values, "run-name": "flower"})
    flower = load_run(tmp_path / "flower").rows
    assert [r["valid-accuracy"] for r in engine.rows] == [r["valid-accuracy"] for r in flower]
    assert [r["valid-loss"] for r in engine.rows] == [r["valid-loss"] for r in flower]
    cfg = RunConfig.from_mapping(values)
    task = load_task(cfg)
    model = task.build_model()
    model.load_state_dict(engine.state)
    direct = task.evaluate_indices(model, __import__("torch").device("cpu"), validation_set(cfg))
    assert direct["eval-accuracy"] == engine.rows[-1]["valid-accuracy"]


@pytest.mark.parametrize("bad", [-0.1, 0.5, "half"])
def test_valid_fraction_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="valid-fraction"):
        RunConfig.from_mapping({"valid-fraction": bad})


def test_language_tasks_refuse_valid_fraction(tmp_path, monkeypatch):
    import tasks

    cfg = RunConfig.from_mapping({"task": "ptb", "valid-fraction": 0.1, "data-dir": str(tmp_path)})
    monkeypatch.setattr(tasks, "cached_task", lambda c: SimpleNamespace(client_partitions=lambda c: [np.arange(10)]))
    with pytest.raises(ValueError, match="own validation stream"):
        splits.__wrapped__(cfg)  # uncached: the stand-in task, a stream of its own and no hold_out


def test_shakespeare_holds_out_each_roles_last_windows_behind_a_gap():
    fake = SimpleNamespace(seq_len=80)
    part = np.arange(1000, 3000)
    kept, held = ShakespeareTask.hold_out(fake, part, 0.05, 0, 0)
    assert list(held) == list(range(2900, 3000)) and kept[-1] == 2900 - 80  # no training window holds a valid target
    with pytest.raises(ValueError, match="too few"):
        ShakespeareTask.hold_out(fake, np.arange(50), 0.1, 0, 3)


def test_local_data_nodes_refuse_valid_fraction(tmp_path):
    from client.local_data import KEY, export_partition, local_data

    cfg = RunConfig.from_mapping({"num-clients": 2})
    export_partition(cfg, 0, tmp_path)
    assert local_data({KEY: str(tmp_path)}, cfg) is not None
    with pytest.raises(ValueError, match="valid-fraction"):
        local_data({KEY: str(tmp_path)}, cfg.replace(valid_fraction=0.1))


def test_eval_subsample_keeps_every_kth_test_example():
    full = load_task(RunConfig())
    sub = load_task(RunConfig.from_mapping({"eval-subsample": 3}))
    assert len(sub.test_y) == len(full.test_y[::3]) and bool((sub.test_y == full.test_y[::3]).all())
    assert len(sub.train_y) == len(full.train_y)
    with pytest.raises(ValueError, match="eval-subsample must be an integer >= 1"):
        RunConfig.from_mapping({"eval-subsample": 0})


def test_dirichlet_min_size_redraws_and_zero_is_the_old_rule():
    labels = np.repeat(np.arange(10), 50)
    assert all(np.array_equal(a, b) for a, b in zip(dirichlet(labels, 8, 0.05, 1), dirichlet(labels, 8, 0.05, 1, 0),
                                                     strict=True))
    parts = dirichlet(labels, 8, 0.05, 1, min_size=30)
    assert min(len(p) for p in parts) >= 30 and sorted(np.concatenate(parts)) == list(range(500))
    with pytest.raises(ValueError, match="dirichlet-min-size must be"):
        dirichlet(labels, 8, 0.05, 1, min_size=100)
    with pytest.raises(ValueError, match="dirichlet-min-size must be an integer >= 0"):
        RunConfig.from_mapping({"dirichlet-min-size": -1})


# --- statistics and the comparison ---------------------------------------------------------------
def test_summary_and_band_match_scipy():
    x = [0.91, 0.95, 0.93, 0.97, 0.90]
    s = summary(x)
    low, high = scipy_stats.t.interval(0.95, len(x) - 1, loc=np.mean(x), scale=scipy_stats.sem(x))
    assert s.n == 5 and s.mean == pytest.approx(np.mean(x)) and s.std == pytest.approx(np.std(x, ddof=1))
    assert (s.low, s.high) == (pytest.approx(low), pytest.approx(high))
    assert summary([0.5]).low is None and summary([]).mean is None
    with pytest.raises(ValueError, match="non-finite"):
        summary([1.0, math.nan])
    mean, lo, hi = band([[1.0, 2.0], [3.0, 2.0], [2.0, 2.0]])
    assert list(mean) == [2.0, 2.0] and lo[1] == hi[1] == 2.0 and lo[0] < 2.0 < hi[0]


def test_compare_reports_the_selected_point_over_seeds_with_intervals(tmp_path):
    pytest.importorskip("matplotlib")
    path = _file(tmp_path, "lr = [0.05, 0.5]\nseeds = 3\ntune-seeds = 2\n", clip=0.1)  # γ/η 0.2 or 2: clipping in some steps
    res = tmp_path / "res"
    runner.run_all([path], "engine", results_dir=res, jobs=1)
    text, data = compare([res], tmp_path / "cmp", target=0.5)
    manifest = read_manifest(res / "sw.sweep.json")
    lr = manifest["selected"]["lr"]
    finals = [load_run(res / f"sw-lr={lr}-seed={s}").rows[-1]["test-accuracy"] for s in range(3)]
    row = data[0]
    assert row["selected"] == {"lr": lr} and row["seeds"] == 3 and row["final"] == finals
    assert row["final-summary"]["mean"] == pytest.approx(np.mean(finals))
    low, _ = scipy_stats.t.interval(0.95, 2, loc=np.mean(finals), scale=scipy_stats.sem(finals))
    assert row["final-summary"]["low"] == pytest.approx(low)
    assert row["sweep-runs"] == 5 and row["sweep-compute-seconds"] > 0 and row["reached"] <= 3
    assert f"η {format_value(lr)}" in text and "digits-homogeneous" in text
    assert (tmp_path / "cmp" / "digits-homogeneous-bands.png").stat().st_size > 0
    assert (tmp_path / "cmp" / "by-setting.png").is_file()
    # the share of clipped steps: per run the mean of its rows' clip-fraction, then over the seeds
    shares = [np.mean([r["clip-fraction"] for r in load_run(res / f"sw-lr={lr}-seed={s}").rows if "clip-fraction" in r])
              for s in range(3)]
    assert row["clip-share"] == pytest.approx(np.mean(shares)) and 0 < row["clip-share"] <= 1
    assert f"| {row['clip-share'] * 100:.0f} % |" in next(t for t in text.splitlines() if "digits-homogeneous" in t)
    # every tuning point with its validation score (mean over the 2 tuning seeds) and its clipped share
    assert [p["values"] for p in row["tuning"]] == [{"lr": 0.05}, {"lr": 0.5}]
    for p in row["tuning"]:
        folders = [res / f"sw-lr={format_value(p['values']['lr'])}-seed={s}" for s in range(2)]
        assert p["scores"] == [last_value(f, "valid-accuracy") for f in folders]
        assert p["selected"] == (p["values"]["lr"] == lr)
        line = f"| η {format_value(p['values']['lr'])} | {np.mean(p['scores']) * 100:.4g} | {p['clip-share'] * 100:.0f} % |"
        assert line in text
    # a manifest whose selection disagrees with the results is refused
    manifest["selected"] = {"lr": 0.5 if lr == 0.05 else 0.05}
    (res / "sw.sweep.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="not the best on valid-accuracy"):
        load_compared(res / "sw.sweep.json")
    shutil.rmtree(res / f"sw-lr={lr}-seed=2")


def test_compare_reports_epsilon_of_a_dp_sweep_and_tells_it_from_the_same_method_without_dp(tmp_path):
    """docs/EXPERIMENTS.md's DP table: the ε at δ of each private sweep's runs, read from their last rows."""
    dp = {"dp-noise-multiplier": 1.0, "dp-buffers": "frozen"}
    files = [_file(tmp_path, "lr = [0.05, 0.5]\nseeds = 2\ntune-seeds = 1\n", name="dp", **dp),
             _file(tmp_path, "seeds = 2\n", name="plain")]
    res = tmp_path / "res"
    runner.run_all(files, "engine", results_dir=res, jobs=1)
    text, data = compare([res], tmp_path / "cmp", plots=False)
    private, plain = sorted(data, key=lambda row: "DP" not in row["method"])
    lr = private["selected"]["lr"]
    last = [load_run(res / f"dp-lr={format_value(lr)}-seed={s}").rows[-1] for s in range(2)]
    assert private["dp-epsilon"] == [row["dp-epsilon"] for row in last] and plain["dp-epsilon"] == [None, None]
    assert all(row["dp-private"] for row in last) and last[0]["dp-epsilon"] == last[1]["dp-epsilon"] > 0
    assert private["method"] == plain["method"] + " + DP z=1"
    assert "| ε at δ |" in text.splitlines()[0]
    line = next(t for t in text.splitlines() if "+ DP z=1" in t)
    assert f"| {last[0]['dp-epsilon']:.3g} (δ {last[0]['dp-delta']:.2g}) |" in line and "NOT private" not in line
    assert "| no DP |" in next(t for t in text.splitlines()[2:] if "+ DP" not in t)
    # the privacy table: S and the update norms (each run's mean over its rounds, then over the seeds), epsilon
    # by both accountants for the run's (z, K, M, rounds, delta)
    runs = [load_run(res / f"dp-lr={format_value(lr)}-seed={s}") for s in range(2)]
    per_run = [np.mean([r["dp-update-norm-max"] for r in run.rows if "dp-update-norm-max" in r]) for run in runs]
    norms, eps = private["dp-norms"], private["dp-accounted"]
    assert norms["norm-max"] == pytest.approx(np.mean(per_run)) and norms["sensitivity"] == last[0]["dp-sensitivity"]
    assert 0 < norms["norm-mean"] <= norms["norm-q90"] <= norms["norm-max"] <= norms["norm-max-max"]
    assert eps["rdp"] == pytest.approx(last[0]["dp-epsilon"]) and 0 < eps["pld"] < eps["rdp"]
    line = next(t for t in text.splitlines() if t.startswith("| digits-homogeneous") and f"| {eps['pld']:.3g} |" in t)
    assert f"| {norms['sensitivity']:.3g} | {norms['norm-mean']:.3g} / " in line
    assert "dp-norms" not in plain and all(p["dp-norms"] is None for p in plain["tuning"])
    assert all(p["dp-norms"]["norm-max"] > 0 for p in private["tuning"])
    # no private sweep: no ε column, no privacy table
    text, data = compare([res / "plain.sweep.json"], tmp_path / "cmp2", plots=False)
    assert "ε" not in text and "dp-epsilon" not in data[0] and "Privacy" not in text


def test_compare_tells_apart_one_method_at_several_n_and_orders_naturally(tmp_path):
    """An N-sweep of one method in one setting: each sweep's label gets its N; I=2 sorts before I=16."""
    pytest.importorskip("matplotlib")
    files = [_file(tmp_path, "seeds = 1\n", name=f"n{n}", **{"num-clients": n}) for n in (4, 2)]
    files.append(_file(tmp_path, "seeds = 1\n", name="i16", **{"local-steps": 16, "num-rounds": 1}))
    res = tmp_path / "res"
    runner.run_all(files, "engine", results_dir=res, jobs=1)
    _, data = compare([res], tmp_path / "cmp", target=0.5, plots=False)
    assert [(row["method"], row["selected"]) for row in data] == [
        ("CELGC I=2, N=2", {}), ("CELGC I=2, N=4", {}), ("CELGC I=16", {})]
    # the scaling tool: rounds and local steps to the target per sweep, as rounds_to_target finds them
    text, rows = scaling([res], tmp_path / "sc", "local-steps", target=0.3)
    for row, name in zip(rows, ("n2", "n4", "i16"), strict=True):
        run = load_run(res / f"{name}-seed=0")
        hit = rounds_to_target(run, 0.3)
        assert row["reached"] == (hit is not None) and row["seeds"] == 1
        assert row["rounds"]["mean"] == (hit and hit["round"])
        assert row["steps"]["mean"] == (hit and hit["round"] * row["local-steps"])
        assert row["final"]["mean"] == run.rows[-1]["test-accuracy"]
        clipped = [r["clip-fraction"] for r in run.rows if "clip-fraction" in r]
        assert row["clip-fraction"] == pytest.approx(sum(clipped) / len(clipped))
    cfg = load_run(res / "i16-seed=0").config
    assert f"| digits-homogeneous | CELGC I=16 | 16 | 4 | {format_value(cfg['lr'])}, {format_value(cfg['clip'])} | 1 |" in text
    assert (tmp_path / "sc" / "digits-homogeneous-to-target.png").stat().st_size > 0
    assert (tmp_path / "sc" / "digits-homogeneous-curves.png").stat().st_size > 0
    with pytest.raises(ValueError, match="--against must be one of"):
        scaling([res], tmp_path / "sc", "lr", target=0.3)


def test_compare_tells_apart_one_method_at_two_points_by_its_selected_values(tmp_path):
    """One method twice in one setting: a tuned sweep and a fixed point of another clip (its clipping-active
    point) are labelled by the values that differ between their selected points, as the label and the
    figure show them; values they share stay out of the label."""
    files = [_file(tmp_path, "seeds = 1\nclip = [0.5, 2.0]\n", name="tuned", lr=0.3),
             _file(tmp_path, "seeds = 1\n", name="active", lr=0.3, clip=0.05)]
    res = tmp_path / "res"
    runner.run_all(files, "engine", results_dir=res, jobs=1)
    text, data = compare([res], tmp_path / "cmp", target=0.5, plots=False)
    tuned = next(row for row in data if row["selected"])
    assert tuned["method"] == f"CELGC I=2, γ={format_value(tuned['selected']['clip'])}"
    assert [row["method"] for row in data if not row["selected"]] == ["CELGC I=2, γ=0.05"]
    assert all("η=" not in row["method"] for row in data)
    assert f"| {tuned['method']} |" in text and "| CELGC I=2, γ=0.05 |" in text
