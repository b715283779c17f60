"""simulations.flower without a SuperLink: the one JSON reader, overrides read back by flwr's
own parser, the one stop helper, and ``stop-local`` stopping only this FLWR_HOME's SuperLink.

Stand-ins replace real SuperLinks: a script named ``flower-superlink`` that sleeps, started
with the command line flwr uses (``--port 39091 --log-file FLWR_HOME/local-superlink/...``)
and a child of its own (like flower-superexec). Every wait polls with a bounded deadline.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from server.deploy.cli_json import field, parse_cli_json
from simulations.flower import format_overrides
from simulations.flower.__main__ import main
from simulations.flower.cli import prepare_run_config
from simulations.flower.deploy import last_record
from simulations.flower.local import find_local_superlinks, local_log_file
from simulations.flower.processes import alive, process_tree, stop

STAND_IN = """\
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(child.pid, flush=True)
time.sleep(600)
"""


def test_parse_cli_json_finds_the_object_after_banners() -> None:
    text = 'Loading project configuration...\n{"success": true,\n "runs": [{"run-id": 7, "status": "finished:failed"}]}\n'
    obj = parse_cli_json(text)
    assert field(obj, "runs.status") == "finished:failed"
    assert field(obj, "runs") == {"run-id": 7, "status": "finished:failed"}
    assert field(obj, "missing") == ""
    assert parse_cli_json('{"a": 1}\nlog line\n{"a": 2}\n', last=True) == {"a": 2}
    assert last_record("run-id 3\n{not json\n") == {}
    with pytest.raises(ValueError, match="no JSON object"):
        parse_cli_json("Error: connection refused")


def test_cli_json_script_as_submit_sh_calls_it() -> None:
    script = Path(__file__).resolve().parents[1] / "server" / "deploy" / "cli_json.py"
    out = subprocess.run([sys.executable, str(script), "runs.status"], input='x\n{"runs": [{"status": "s"}]}',
                         capture_output=True, text=True, timeout=30)
    assert (out.returncode, out.stdout) == (0, "s\n")


def test_overrides_read_back_by_flwr() -> None:
    config = pytest.importorskip("flwr.common.config")
    values = {"a": 1, "b": 0.5, "c": True, "d": "x y", "e": "it's", "f": -2.5e-7, "g": float("inf")}
    assert config.parse_config_args(format_overrides(values)) == values


ROOT = Path(__file__).resolve().parents[1]


def test_the_wrapper_starts_without_torch() -> None:
    """The flwr wrappers read their overrides with the standard library (torch: 2.7 s a start)."""
    code = "import sys, simulations.flower.__main__; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd=Path(__file__).resolve().parents[1])


def test_run_config_is_checked_against_the_apps_keys_before_submitting(tmp_path: Path, capsys) -> None:
    # a misspelled key is named, with the close match and the known keys (flwr: "Invalid run configuration.")
    with pytest.raises(ValueError, match=r"unknown run-config key 'local-step' \(did you mean 'local-steps'\?\): "
                                         r"the app's \[tool.flwr.app.config\] has task, algorithm, .*local-steps"):
        prepare_run_config(ROOT, ["num-rounds=2 local-step=4"])
    with pytest.raises(ValueError, match="unknown run-config key 'zzz': "):
        prepare_run_config(ROOT, {"zzz": 1})
    with pytest.raises(ValueError, match="file 'nowhere.toml' does not exist"):
        prepare_run_config(ROOT, ["nowhere.toml"])
    # the wrapper says so and exits 2, before any SuperLink starts
    assert main([str(ROOT), "--run-config", "local-step=4"]) == 2
    assert "unknown run-config key 'local-step' (did you mean 'local-steps'?)" in capsys.readouterr().err


def test_the_failure_cause_is_read_from_the_serverapps_log() -> None:
    import server.app
    from simulations.flower.cli import FAILED_MARK, RunFailed, failure_cause

    assert FAILED_MARK == server.app.FAILED_MARK
    line = server.app.one_line(ValueError("batch-size (1000) exceeds\n the smallest client's 179 examples"))
    assert line == "ValueError: batch-size (1000) exceeds the smallest client's 179 examples"
    cause = f"{FAILED_MARK} (EPISODE I=8 on digits): {line}"
    log = f"INFO :      Starting\n\x1b[91mERROR \x1b[0m:     {cause}\nTraceback (most recent call last):\n  x"
    assert failure_cause(log) == cause
    failed = RunFailed(7, "finished:failed", "Traceback ...", "ServerApp raised an exception", failure_cause(log))
    assert str(failed).splitlines()[0] == cause
    assert failure_cause("Traceback (most recent call last):") == ""


def test_a_toml_file_and_overrides_are_merged_in_order(tmp_path: Path) -> None:
    # flwr run refuses a file together with key=value pairs; the wrapper merges them, later items winning
    preset = tmp_path / "preset.toml"
    preset.write_text('num-rounds = 30\nlr = 0.1\ntask = "digits"\n')
    items = prepare_run_config(ROOT, [str(preset), "num-rounds=2", "lr-milestones='5,8'"])
    config = pytest.importorskip("flwr.common.config")
    assert config.parse_config_args(items) == {"num-rounds": 2, "lr": 0.1, "task": "digits", "lr-milestones": "5,8"}


def _start(argv: list[str], cwd: Path) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(proc.stdout.readline())  # the stand-in has spawned its child
    return proc, child


def _local_superlink(home: Path, tmp: Path) -> tuple[subprocess.Popen, int]:
    script = tmp / "bin" / "flower-superlink"
    script.parent.mkdir(exist_ok=True)
    script.write_text(STAND_IN)
    return _start([sys.executable, str(script), "--insecure", "--simulation", "--isolation", "subprocess",
                   "--host", "127.0.0.1", "--port", "39091", "--log-file", str(local_log_file(home)),
                   "--database", str(home / "local-superlink" / "state.db")], tmp)


def _wait_gone(pids: dict[int, int], seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pids)


def test_stop_local_stops_only_this_flwr_home(tmp_path: Path, monkeypatch, capsys) -> None:
    mine, other = tmp_path / "mine", tmp_path / "other"
    a, a_child = _local_superlink(mine, tmp_path)
    b, b_child = _local_superlink(other, tmp_path)
    try:
        assert set(find_local_superlinks(mine)) == {a.pid}
        tree_a = process_tree([a.pid])
        assert a_child in tree_a
        monkeypatch.setenv("FLWR_HOME", str(mine))  # the default, as flwr decides it
        assert main(["stop-local", "--timeout", "10"]) == 0
        assert f"pid {a.pid}" in capsys.readouterr().out
        assert _wait_gone(tree_a)
        assert a.wait(timeout=10) is not None
        assert set(alive(process_tree([b.pid]))) == {b.pid, b_child}  # the other FLWR_HOME's survives
        assert main(["stop-local"]) == 0  # nothing left: says so, exit 0
        assert "no local SuperLink" in capsys.readouterr().out
    finally:
        for proc in (a, b):
            stop(proc, timeout=5.0)
            proc.stdout.close()


def test_stop_reaches_a_child_in_another_session_and_a_sigterm_ignorer(tmp_path: Path) -> None:
    ignorer = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(0, flush=True); time.sleep(600)"
    proc, child = _start([sys.executable, "-c", STAND_IN], tmp_path)
    stubborn = subprocess.Popen([sys.executable, "-c", ignorer], stdout=subprocess.PIPE, text=True)
    stubborn.stdout.readline()  # the SIGTERM handler is installed
    try:
        tree = process_tree([proc.pid])
        assert child in tree
        assert stop(proc, timeout=10.0) == {}
        assert not alive(tree) and proc.returncode is not None
        assert stop(pids={stubborn.pid: process_tree([stubborn.pid])[stubborn.pid]}, timeout=0.2) == {}
        assert stubborn.wait(timeout=10) == -9
    finally:
        stubborn.kill()
        stubborn.stdout.close()
        proc.stdout.close()


def test_local_log_file_matches_flwr(monkeypatch, tmp_path: Path) -> None:
    """flwr's own (private) path helper agrees: a flwr upgrade that moves the log fails here."""
    local = pytest.importorskip("flwr.cli.local_superlink")
    monkeypatch.setenv("FLWR_HOME", str(tmp_path))
    assert local._get_local_superlink_paths()[1] == local_log_file()
    assert os.environ["FLWR_HOME"] == str(tmp_path)


def test_a_bad_value_exits_2_before_the_run_is_submitted(monkeypatch, capsys, tmp_path: Path) -> None:
    """This project's app: a value its RunConfig refuses ends the wrapper with 2 and the error, before
    `flwr run` (checked while the SuperLink starts); a bad key before a SuperLink is even made."""
    import simulations.flower.__main__ as wrapper

    made = []

    class NoSuperLink:
        def __init__(self, **kw) -> None:
            made.append(kw)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            return None

    monkeypatch.setattr(wrapper, "LocalSuperLink", NoSuperLink)
    monkeypatch.setattr(wrapper, "run_app", lambda *a, **k: pytest.fail("the run was submitted"))
    assert main([str(ROOT), "--run-config", "num-rounds=2 lr=-1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: run-config: ") and "lr" in err and len(made) == 1
    made.clear()
    assert main([str(ROOT), "--run-config", "local-step=4"]) == 2 and made == []
    # another app's values are its own ServerApp's to check
    other = wrapper.ValueCheck(tmp_path, {"lr": -1})
    other.start()
    other.result()
    assert other.error is None
