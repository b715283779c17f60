"""Ctrl-C and SIGTERM, sent for real to the command lines (simulations/interrupt.py): the engine CLI,
the runner (a pool of 2 workers) and the Flower wrapper stop with one line saying where and the
command that goes on, exit 130 / 143, no traceback; the printed command then finishes the run."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.runs.results import read_results

ROOT = Path(__file__).resolve().parents[1]
RUN = {"task": "digits", "num-clients": 4, "local-steps": 4, "num-rounds": 200, "checkpoint-every": 1,
       "eval-every": 50, "device": "cpu"}
pytestmark = pytest.mark.realproc


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


def _overrides(values: dict) -> str:
    return " ".join(f"{k}={json.dumps(v)}" if isinstance(v, str) else f"{k}={v}" for k, v in values.items())


def _rounds(results: Path) -> int:
    try:
        return max([r["round"] for r in map(json.loads, results.read_text().splitlines()[1:])], default=-1)
    except (OSError, ValueError):  # not there yet, or a line being written
        return -1


def _stop_after(proc: subprocess.Popen, results: Path, rounds: int, sig: int, limit: float = 120.0):
    """Send ``sig`` once ``results`` holds round ``rounds``; (exit status, stderr)."""
    deadline = time.monotonic() + limit
    while _rounds(results) < rounds:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no round {rounds} in {limit} s"
        time.sleep(0.2)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err


def _as_at_a_terminal() -> None:
    """In the child before exec: SIGINT as a terminal's foreground job has it. A command started in
    the background by a shell without job control (``cmd &`` in a script, a CI runner) inherits
    SIGINT *ignored*, and Python then keeps it ignored: the Ctrl-C tests would test nothing there."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _resume_command(err: str, marker: str = "with: ") -> list[str]:
    line = [x for x in err.splitlines() if marker in x][-1]
    cmd = shlex.split(line.split(marker, 1)[1])
    assert cmd[:2] == ["python", "-m"]
    return [sys.executable, *cmd[1:]]


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_the_engine_cli_stops_with_one_line_and_the_resume_command(tmp_path, sig, code):
    cmd = [sys.executable, "-m", "simulations.engine", "--quiet", "--run-config",
           _overrides({**RUN, "results-dir": str(tmp_path), "run-name": "r"})]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_as_at_a_terminal)
    rc, err = _stop_after(proc, tmp_path / "r" / "results.jsonl", 2, sig)
    assert rc == code, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"python -m simulations.engine: {signal.Signals(sig).name}: stopped after round "), last
    assert f"{tmp_path / 'r'} keeps its rows and the round-" in last and "resume=true" in last
    if sig == signal.SIGINT:  # the printed command finishes the run from its checkpoint
        resume = [a.replace("num-rounds=200", "num-rounds=12") for a in _resume_command(err)]  # short: 12 rounds
        done = subprocess.run(resume, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        _, rows = read_results(tmp_path / "r" / "results.jsonl")
        assert [r["round"] for r in rows] == list(range(13)) and any("resumed-from-round" in r for r in rows)


def test_the_runner_stops_its_pool_with_one_line_and_the_same_command_goes_on(tmp_path):
    sweep = tmp_path / "sw.toml"
    keys = {**RUN, "num-rounds": 20, "valid-fraction": 0.1, "run-name": "sw"}
    sweep.write_text("\n".join(f"{k} = {json.dumps(v)}" for k, v in keys.items())
                     + "\n\n[sweep]\nlr = [0.05, 0.1]\nseeds = 1\n")
    cmd = [sys.executable, "-m", "simulations.runner", str(sweep), "--backend", "engine", "--results-dir",
           str(tmp_path / "res"), "--jobs", "2"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_as_at_a_terminal)
    try:
        rc, err = _stop_after(proc, tmp_path / "res" / "sw-lr=0.05-seed=0" / "results.jsonl", 1, signal.SIGINT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("python -m simulations.runner: SIGINT: sweep(s) sw: finished points are kept"), last
    deadline = time.monotonic() + 30
    while subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True).returncode == 0:  # no worker left
        assert time.monotonic() < deadline, "pool workers outlived the runner"
        time.sleep(0.2)
    again = _resume_command(err, "runs again: ")
    assert again[1:] == cmd[1:]
    done = subprocess.run(again, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "sweep sw: 2 run, 0 skipped" in done.stdout
    _, rows = read_results(tmp_path / "res" / "sw-lr=0.05-seed=0" / "results.jsonl")
    assert rows[-1]["round"] == 20 and any("resumed-from-round" in r for r in rows)


def test_the_flower_wrapper_stops_the_run_with_its_superlink_and_says_how_to_resume(tmp_path):
    keys = {**RUN, "num-clients": 2, "results-dir": str(tmp_path), "run-name": "f"}
    cmd = [sys.executable, "-m", "simulations.flower", str(ROOT), "--run-config", _overrides(keys),
           "--federation-config", "num-supernodes=2"]
    env = {**_env(), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=_as_at_a_terminal)
    try:
        rc, err = _stop_after(proc, tmp_path / "f" / "results.jsonl", 1, signal.SIGTERM, limit=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert rc == 143, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("python -m simulations.flower: SIGTERM: stopped the run with its local SuperLink"), last
    assert _resume_command(err, "run-name: ")[-2:] == ["--run-config", "resume=true"]
    deadline = time.monotonic() + 30
    while subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True).returncode == 0:  # SuperLink gone
        assert time.monotonic() < deadline, "processes of the run outlived the wrapper"
        time.sleep(0.5)
    assert (tmp_path / "f" / "checkpoint.pt").is_file()
