"""The experiment runner: reading files, paths, in-process runs, failures, summary, and one
run through the real Flower CLI (SuperLink + Ray) with the naive strategy."""

import json
from pathlib import Path

import pytest

from simulations import runner
from simulations.summary import load_run

EXPERIMENTS = Path(__file__).resolve().parents[1] / "simulations" / "experiments"
QUICK = {"num-rounds": 2, "num-clients": 2, "node-wait": 5.0}




def test_load_experiment_makes_paths_absolute_and_names_the_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exp = tmp_path / "grp" / "my-exp.toml"
    exp.parent.mkdir()
    exp.write_text('task = "digits"\nlr = 0.1\ndata-dir = "data"\n')
    values = runner.load_experiment(exp, {"lr": 0.2})
    assert values["lr"] == 0.2 and values["run-name"] == "grp-my-exp"
    assert values["data-dir"] == str(tmp_path / "data") and values["results-dir"] == str(tmp_path / "results")
    assert runner.load_experiment(exp, results_dir="out")["results-dir"] == str(tmp_path / "out")
    exp.write_text('task = "digits"\nlearning-rate = 0.1\n')
    with pytest.raises(ValueError, match=r"my-exp.toml: unknown config key"):
        runner.load_experiment(exp)
    exp.write_text('[tool.flwr.app.config]\ntask = "digits"\n')
    with pytest.raises(ValueError, match="flat"):
        runner.load_experiment(exp)


def test_parse_overrides():
    assert runner.parse_overrides(["num-rounds=3 lr=0.5", "task='digits'", "clip=off"]) == {
        "num-rounds": 3, "lr": 0.5, "task": "digits", "clip": "off"}
    with pytest.raises(ValueError, match="key=value"):
        runner.parse_overrides(["oops"])


def test_runs_in_process_reports_failures_and_writes_the_summary(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text(f'task = "cifar10"\ndata-dir = "{tmp_path / "nowhere"}"\nnum-clients = 2\n')
    files = [str(EXPERIMENTS / "digits" / "naive.toml"), str(bad), str(EXPERIMENTS / "digits" / "celgc-I8.toml")]
    sets = [f"{k}={v}" for k, v in QUICK.items()]
    code = runner.main([*files, "--backend", "inprocess", "--results-dir", str(tmp_path / "res"),
                        *[x for s in sets for x in ("--set", s)]])
    assert code == 1
    lines = json.loads((tmp_path / "res" / "summary.json").read_text())
    assert [line["status"] for line in lines] == ["ok", "failed", "ok"]
    assert "FileNotFoundError" in lines[1]["error"] and "cifar-10-batches-py" in lines[1]["error"]
    assert lines[0]["method"] == "naive parallel clipping" and lines[2]["method"] == "CELGC I=8"
    assert lines[0]["rounds"] == 2 and lines[0]["metric"] == "test-accuracy" and lines[0]["bytes"] > 0
    out = capsys.readouterr().out
    assert "digits-naive" in out and "failed" in out
    assert runner.main(["--summarize", str(tmp_path / "res")]) == 0
    assert "CELGC I=8" in capsys.readouterr().out


def test_invalid_file_fails_before_any_run(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("local-steps = 0\n")
    assert runner.main([str(EXPERIMENTS / "digits" / "naive.toml"), str(bad), "--backend", "inprocess",
                        "--results-dir", str(tmp_path)]) == 2
    assert "local-steps must be an integer >= 1" in capsys.readouterr().err
    assert not (tmp_path / "digits-naive").exists()


@pytest.mark.realproc
def test_naive_through_the_flower_cli(tmp_path):
    """`flwr run` on a private SuperLink (Ray backend): the naive round trip of gradients."""
    lines = runner.run_all([EXPERIMENTS / "digits" / "naive.toml"], "flower", QUICK, tmp_path, timeout=240)
    assert lines[0]["status"] == "ok", lines[0].get("error")
    run = load_run(tmp_path / "digits-naive")
    assert [r["round"] for r in run.rows] == [0, 1, 2] and run.rows[-1]["replies"] == 2
    assert (tmp_path / "digits-naive" / "flower.log").stat().st_size > 0
    # the same run in-process gives the same numbers (deterministic clients)
    runner.run_all([EXPERIMENTS / "digits" / "naive.toml"], "inprocess", {**QUICK, "run-name": "again"}, tmp_path)
    again = load_run(tmp_path / "again")
    assert again.rows[-1]["test-accuracy"] == run.rows[-1]["test-accuracy"]
    assert again.rows[-1]["train-loss"] == pytest.approx(run.rows[-1]["train-loss"], rel=1e-6)


def test_demo_runs_both_methods_and_writes_figures(tmp_path):
    pytest.importorskip("matplotlib")
    from simulations.demo import print_report, run_demo

    report = run_demo(tmp_path / "res", tmp_path / "fig", target=0.5, rounds_scale=0.05)
    assert report["naive"]["run"].rows[-1]["round"] == 8 and report["celgc"]["run"].rows[-1]["round"] == 1
    assert report["celgc"]["hit"]["round"] == 1  # one round of 8 local steps reaches 50 %
    assert len(report["figures"]) == 5 and all(p.is_file() for p in report["figures"])
    print_report(report, 0.5)
