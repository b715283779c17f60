"""Automatic resumption without Flower running: the policy (server/deploy/restarts.py), submit.sh
--restarts against a stand-in ``flwr`` (FLWR_BIN_DIR) that plays a scripted sequence of runs, and the
wrapper's ``run_app_with_restarts``. The real thing -- a deployed run whose ServerApp is killed and
that submit.sh resumes to the uninterrupted model -- is tests/test_deploy_faults.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from server.deploy import restarts
from server.deploy.restarts import cause_of, fab_hash, stop_reason
from simulations.flower import cli
from simulations.flower.deploy import DEPLOY

DIED = {"status": "finished:failed", "details": "No heartbeat received from the task", "log": "INFO : [ROUND 3/9]"}
DONE = {"status": "finished:completed", "log": "INFO : Final weights"}


def celgc_failed(text: str) -> str:
    return f"\x1b[91mERROR \x1b[0m:     celgc run failed (CELGC I=8 on digits): {text}\nTraceback (most recent call last):"


# --- the policy -------------------------------------------------------------------------------------
def test_the_policy_restarts_faults_and_names_why_it_does_not():
    died = cause_of("finished:failed", "No heartbeat received from the task", "INFO : round 3")
    assert died == "finished:failed: No heartbeat received from the task"
    assert stop_reason("finished:failed", died) is None
    assert stop_reason("finished:failed", died, died) is None  # the ServerApp may die twice: not a verdict on the run
    few = cause_of("finished:failed", "ServerApp raised", celgc_failed("TooFewReplies: round 5: 1 sound replies, 2 required"))
    assert few == "celgc run failed (CELGC I=8 on digits): TooFewReplies: round 5: 1 sound replies, 2 required"
    assert stop_reason("finished:failed", few) is None
    assert stop_reason("finished:failed", few, few) == f"the resumed run failed again with the same cause ({few})"
    lost = cause_of("finished:failed", "", celgc_failed("CheckpointError: x holds results up to round 4 but no checkpoint"))
    assert stop_reason("finished:failed", lost).startswith("it cannot resume from its folder (celgc run failed")
    busy = celgc_failed("RunFolderError: x is in use by another live run (pid 7)")
    assert "cannot resume" in stop_reason("finished:failed", cause_of("finished:failed", "", busy))
    refused = cause_of("finished:failed", "", "ERROR : celgc run failed: ValueError: lr must be > 0, got -1")
    assert stop_reason("finished:failed", refused).startswith("its run config was refused")
    assert stop_reason("finished:stopped", "finished:stopped").startswith("it was stopped")
    assert stop_reason("finished:completed", "") == "it completed"


def test_the_cause_line_is_the_serverapps_own():
    import server.app

    assert restarts.FAILED_MARK == server.app.FAILED_MARK == cli.FAILED_MARK
    assert cli.failure_cause is restarts.failure_cause


# --- submit.sh --restarts against a stand-in flwr ---------------------------------------------------------
FAKE_FLWR = """\
import json, os, sys
from pathlib import Path

d = Path(os.environ["FAKE_FLWR"])
script = json.loads((d / "script.json").read_text())
args = sys.argv[1:]
if args[0] == "run":
    n = len(list(d.glob("run-*.json"))) + 1
    (d / f"run-{n}.json").write_text(json.dumps(args))
    print("Loading project configuration...")
    print(json.dumps({"success": True, "run-id": n, "fab-hash": (d / "fab").read_text()[:8]}))
elif args[0] == "log":
    entry = script[min(int(args[1]), len(script)) - 1]
    print(entry.get("log", ""))
    if entry.get("edit"):  # the operator changes the app while the run goes on
        Path(entry["edit"]).write_text("x = 'changed'\\n")
elif args[0] == "ls":
    n = int(args[args.index("--run-id") + 1])
    entry = script[min(n, len(script)) - 1]
    print(json.dumps({"success": True, "runs": [{"run-id": str(n), "status": entry["status"],
                                                 "status-details": entry.get("details", "")}]}))
else:
    print(json.dumps({"success": True}))
"""

MINI_APP = """\
[project]
name = "miniapp"
version = "1.0.0"

[tool.flwr.app]
publisher = "test"

[tool.flwr.app.components]
serverapp = "app:server"
clientapp = "app:client"

[tool.flwr.app.config]
run-name = ""
resume = false
"""


@pytest.fixture
def fake(tmp_path):
    """A stand-in flwr (and a small app) for submit.sh; ``fake.run(script, *args)``: (exit, stdout, stderr,
    the argv of every `flwr run`)."""
    bin_dir, state, app = tmp_path / "bin", tmp_path / "state", tmp_path / "app"
    for d in (bin_dir, state, app):
        d.mkdir()
    (bin_dir / "flwr").write_text(f"#!{sys.executable}\n{FAKE_FLWR}")
    (bin_dir / "flwr").chmod(0o755)
    (bin_dir / "python").write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")  # flwr's environment (fab-hash)
    (bin_dir / "python").chmod(0o755)
    (app / "pyproject.toml").write_text(MINI_APP)
    (app / "app.py").write_text("x = 1\n")
    (state / "fab").write_text(fab_hash(app))

    class Fake:
        path = app

        @staticmethod
        def run(script, *args, config="num-rounds=9 run-name='r'"):
            (state / "script.json").write_text(json.dumps(script))
            env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "FLWR_HOME": str(tmp_path), "FAKE_FLWR": str(state),
                   "FLWR_BIN_DIR": str(bin_dir), "TMPDIR": str(tmp_path)}
            res = subprocess.run(["bash", str(DEPLOY / "submit.sh"), "--app", str(app), "--poll", "0.1",
                                  "--restart-delay", "0", *args, "--run-config", config],
                                 capture_output=True, text=True, timeout=120, env=env)
            runs = [json.loads(p.read_text()) for p in sorted(state.glob("run-*.json"), key=lambda p: int(p.stem[4:]))]
            return res.returncode, res.stdout, res.stderr, runs

    return Fake


def test_a_run_whose_serverapp_died_is_resumed_and_completes(fake):
    code, out, err, runs = fake.run([DIED, DONE], "--restarts", "2")
    assert code == 0, err
    assert "run-id 1" in out and "run-id 2" in out and json.loads(out.strip().splitlines()[-1])["status"] == DONE["status"]
    assert ("submit.sh: restart 1/2 of run 1 (finished:failed): finished:failed: No heartbeat received from the task; "
            "submitting it again with resume=true in 0s") in err
    assert "resume=true" not in runs[0] and runs[1][runs[1].index("resume=true") - 1] == "--run-config"
    assert len(runs) == 2 and "[ROUND 3/9]" in err  # the log streamed to stderr


def test_restarts_are_bounded_and_each_is_logged(fake):
    code, out, err, runs = fake.run([DIED], "--restarts", "2")
    assert code == 1 and len(runs) == 3
    assert [line.split(" of run")[0] for line in err.splitlines() if "restart " in line and " of run " in line] == \
        ["submit.sh: restart 1/2", "submit.sh: restart 2/2"]
    assert "submit.sh: not restarted: all 2 restart(s) used (finished:failed: No heartbeat received" in err


@pytest.mark.parametrize("ending, reason", [
    ({"status": "finished:failed", "log": celgc_failed("CheckpointError: it cannot be resumed")},
     "not restarted: it cannot resume from its folder (celgc run failed (CELGC I=8 on digits): CheckpointError"),
    ({"status": "finished:stopped"}, "not restarted: it was stopped (flwr stop)"),
    ({"status": "finished:failed", "log": "ERROR : celgc run failed: ValueError: lr must be > 0"},
     "not restarted: its run config was refused"),
])
def test_a_run_that_cannot_or_should_not_resume_is_not_submitted_again(fake, ending, reason):
    code, _, err, runs = fake.run([ending], "--restarts", "3")
    assert code == 1 and len(runs) == 1 and reason in err, err


def test_the_same_failure_twice_stops_the_restarts(fake):
    few = {"status": "finished:failed", "log": celgc_failed("TooFewReplies: round 5: 1 sound replies, 2 required")}
    code, _, err, runs = fake.run([few], "--restarts", "5")
    assert code == 1 and len(runs) == 2
    assert "not restarted: the resumed run failed again with the same cause (celgc run failed" in err


def test_a_changed_app_is_not_resumed(fake):
    code, _, err, runs = fake.run([{**DIED, "edit": str(fake.path / "app.py")}, DONE], "--restarts", "2")
    assert code == 1 and len(runs) == 1
    assert "not restarted: the app's code changed since run 1 was submitted (FAB " in err


def test_restarts_need_a_fixed_run_name_and_overrides(fake, tmp_path):
    code, _, err, runs = fake.run([DONE], "--restarts", "1", config="num-rounds=9")
    assert code == 2 and not runs and "--restarts needs a fixed run-name" in err
    preset = tmp_path / "p.toml"
    preset.write_text("run-name = 'r'\n")
    code, _, err, runs = fake.run([DONE], "--restarts", "1", config=str(preset))
    assert code == 2 and not runs and "--restarts needs the run config as k=v overrides" in err
    code, _, err, runs = fake.run([DONE], "--restarts", "-1")
    assert code == 2 and "--restarts must be an integer >= 0" in err
    code, _, _, runs = fake.run([DIED], config="num-rounds=9")  # no --restarts: as before, one run
    assert code == 1 and len(runs) == 1


# --- the wrapper -------------------------------------------------------------------------------------
def test_the_wrapper_resumes_with_the_same_policy(monkeypatch, fake):
    calls, said = [], []
    endings = [cli.RunFailed(11, "finished:failed", details="No heartbeat received from the task"),
               cli.RunFailed(12, "finished:failed", cause="celgc run failed (X): TooFewReplies: round 5"),
               {"status": "finished:completed"}]

    def run_app(app, config, federation, timeout, *, superlink):
        calls.append(config)
        ending = endings[len(calls) - 1]
        if isinstance(ending, Exception):
            raise ending
        return ending

    monkeypatch.setattr(cli, "run_app", run_app)
    monkeypatch.setattr(cli, "_recorded_fab_hash", lambda run_id, sl: fab_hash(fake.path)[:8])
    run = cli.run_app_with_restarts(fake.path, "run-name='r'", None, 60, superlink=None, restarts=3, restart_delay=0,
                                    say=said.append)
    assert run["status"] == "finished:completed"
    assert calls == ["run-name='r'", ["run-name='r'", "resume=true"], ["run-name='r'", "resume=true"]]
    assert said[0].startswith("restart 1/3 of run 11 (finished:failed): finished:failed: No heartbeat received")
    with pytest.raises(ValueError, match="--restarts needs a fixed run-name"):
        cli.run_app_with_restarts(fake.path, None, None, 60, superlink=None, restarts=1)
    calls.clear()
    endings[:] = [cli.RunFailed(13, "finished:stopped")]
    with pytest.raises(cli.RunFailed):
        cli.run_app_with_restarts(fake.path, "run-name='r'", None, 60, superlink=None, restarts=3, restart_delay=0,
                                  say=said.append)
    assert len(calls) == 1 and said[-1].startswith("not restarted: it was stopped")
