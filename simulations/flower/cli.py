"""Wrappers of the ``flwr`` CLI (flwr 1.42): submit a run, its status, wait, logs, stop.

Facts relied on: ``flwr run/ls/stop --format json`` exit 0 even on errors and print
``{"success": false, "error-message": ...}``; ``flwr run`` exits 0 when the run later
fails, so success is decided by the status from ``flwr ls`` (``finished:completed`` /
``finished:failed`` / ``finished:stopped``; before that ``pending``, ``starting``,
``running``). ``flwr log ID CONN --stream`` on a finished run prints the whole log and
exits; on a live run it streams until the run finishes. The JSON output is read by the
one parser, ``server.deploy.cli_json`` (also used by ``submit.sh``).
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tomllib

from server.deploy.cli_json import parse_cli_json
from server.deploy.restarts import FAILED_MARK, fab_hash, failure_cause, stop_reason
from tasks.overrides import parse_overrides

from .processes import exe, stop, strip_ansi, tail
from .superlink import LocalSuperLink, SuperLinkLike

__all__ = ["FAILED_MARK", "STATUS_COMPLETED", "STATUS_FAILED", "STATUS_STOPPED", "FlowerCliError", "RunFailed", "RunTimeout",
           "failure_cause", "fetch_logs", "flwr_json", "format_overrides", "is_finished", "parse_cli_json", "prepare_run_config",
           "run_app", "run_app_with_restarts", "run_status", "stop_run", "submit_run", "wait_for_run"]

STATUS_COMPLETED = "finished:completed"
STATUS_FAILED = "finished:failed"
STATUS_STOPPED = "finished:stopped"
_KEY_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


class FlowerCliError(RuntimeError):
    """A ``flwr`` command failed, timed out, or answered ``"success": false``."""

    def __init__(self, cmd: Sequence[str], message: str, stdout: str = "", stderr: str = ""):
        self.cmd, self.stdout, self.stderr = list(cmd), stdout, stderr
        super().__init__(f"{' '.join(self.cmd)}: {message}")


class RunFailed(RuntimeError):
    """A run finished with a status other than ``finished:completed``."""

    def __init__(self, run_id: int, status: str, logs_tail: str = "", details: str = "", cause: str = ""):
        self.run_id, self.status, self.logs_tail, self.details = run_id, status, logs_tail, details
        self.cause = cause or failure_cause(logs_tail)
        msg = f"{self.cause}\n" if self.cause else ""
        msg += f"Flower run {run_id} ended with status {status!r}"
        if details and details != "N/A":
            msg += f": {details}"
        if logs_tail:
            msg += f"\n--- last log lines ---\n{logs_tail}"
        super().__init__(msg)


class RunTimeout(RunFailed):
    """The run did not finish within the time bound (it is stopped best-effort)."""


def _toml_value(key: str, value: Any) -> str:
    """One value in the TOML form that ``flwr.common.config.parse_config_args`` reads back."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str):
        # flwr splits pairs with (\S+?)=('[^']*'|"[^"]*"|\S+): a quoted value may not
        # contain its own quote character at all.
        if "\n" in value or "\r" in value:
            raise ValueError(f"override {key!r}: newlines are not supported")
        if "'" not in value:
            return f"'{value}'"  # TOML literal string: verbatim
        if '"' not in value:
            return json.dumps(value)  # TOML basic string (JSON escapes are valid TOML)
        raise ValueError(f"override {key!r}: a string with both ' and \" is not supported")
    raise TypeError(f"override {key!r}: unsupported type {type(value).__name__} (use bool, int, float or str)")


def format_overrides(config: Mapping[str, Any] | Sequence[str] | None) -> list[str]:
    """``{"lr": 0.1, "task": "digits"}`` -> ``["lr=0.1", "task='digits'"]`` (flwr has a
    parser, ``parse_config_args``, but no writer). Strings pass through unchanged."""
    if config is None:
        return []
    if isinstance(config, str):
        return [config]
    if not isinstance(config, Mapping):
        return [str(item) for item in config]
    out = []
    for key, value in config.items():
        if not _KEY_RE.match(str(key)):
            raise ValueError(f"invalid override key {key!r} (letters, digits, '_', '.', '-')")
        out.append(f"{key}={_toml_value(str(key), value)}")
    return out


def app_config_keys(app: Path) -> list[str]:
    """The keys of the app's ``[tool.flwr.app.config]`` (tables flattened with dots, as flwr does)."""
    return list(app_config(app))


def app_config(app: Path) -> dict[str, Any]:
    """The app's ``[tool.flwr.app.config]``: its keys and defaults (tables flattened with dots)."""
    data = tomllib.loads((app / "pyproject.toml").read_text())
    return _flat(data.get("tool", {}).get("flwr", {}).get("app", {}).get("config", {}))


def _flat(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, Mapping):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def prepare_run_config(app: Path, run_config: Mapping[str, Any] | Sequence[str] | None) -> list[str]:
    """``--run-config`` items for ``flwr run``, checked against the app's keys before anything is
    submitted (``run_config_values``)."""
    return format_overrides(run_config_values(app, run_config))


def run_config_values(app: Path, run_config: Mapping[str, Any] | Sequence[str] | None) -> dict[str, Any]:
    """The overrides of ``--run-config`` items, merged. Sequences may mix TOML files and ``k=v``
    strings (flwr refuses the mix: they are merged here, later items winning); a key the app does
    not have is named with the close matches and the known keys (flwr says only "Invalid run
    configuration")."""
    if run_config is None:
        return {}
    if isinstance(run_config, str):
        run_config = [run_config]
    if isinstance(run_config, Mapping):
        values = dict(run_config)
    else:
        items = [str(item) for item in run_config]
        missing = [i for i in items if "=" not in i and i.endswith(".toml") and not Path(i).is_file()]
        if missing:
            raise ValueError(f"--run-config file {missing[0]!r} does not exist")
        values = {}
        for item in items:
            parsed = parse_overrides([item])
            values.update(_flat(parsed) if "=" not in item else parsed)
    known = app_config_keys(app)
    unknown = [k for k in values if k not in known]
    if unknown:
        hints = "; ".join(f"{k!r}{_unknown_hint(k, known)}" for k in unknown)
        raise ValueError(f"unknown run-config key {hints}: the app's [tool.flwr.app.config] has {', '.join(known)}")
    return values


def _unknown_hint(key: str, known: Sequence[str]) -> str:
    """What a key the app's config lacks was likely meant to be: a close key; a method's own key
    written without its method's name; the key of a method whose table the app's config lacks."""
    scope, dot, _ = key.partition(".")
    scopes = {k.partition(".")[0] for k in known if "." in k}
    if dot and scope not in scopes:
        close = difflib.get_close_matches(scope, sorted(scopes), n=1, cutoff=0.7)
        return (f" (the app's config lists no keys of a method named {scope!r}"
                + (f"; did you mean {close[0]!r}?" if close else "") + "; flwr run takes only keys listed there: a "
                "method of your own lists its keys in [tool.flwr.app.config] at their defaults -- `python -m "
                "simulations.docs_tables --method package.module:Class` prints the lines; docs/ALGORITHMS.md)")
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.7)
    if close:
        return f" (did you mean {close[0]!r}?)"
    owners = [k for k in known if k.partition(".")[2] == key]
    if not dot and owners:
        return f" (a method's own key, written under the method's name: {', '.join(owners)})"
    return ""


def run_cli(args: Sequence[str], superlink: SuperLinkLike, timeout: float) -> tuple[int, str, str]:
    """``flwr ARGS`` bounded by ``timeout``; (returncode, stdout, stderr)."""
    cmd = [*getattr(superlink, "command_prefix", ()), exe("flwr"), *args]
    proc = subprocess.Popen(cmd, cwd=superlink.cwd, env=superlink.env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop(proc, timeout=0.0)
        out, err = proc.communicate(timeout=10)
        raise FlowerCliError(cmd, f"timed out after {timeout:.0f}s", out.decode(errors="replace"),
                             err.decode(errors="replace")) from None
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def flwr_json(args: Sequence[str], superlink: SuperLinkLike, timeout: float = 60.0) -> dict[str, Any]:
    """Run ``flwr ARGS --format json``; the parsed object, or FlowerCliError."""
    argv = [*args, "--format", "json"]
    code, out, err = run_cli(argv, superlink, timeout)
    cmd = ["flwr", *argv]
    try:
        data = parse_cli_json(out)
    except ValueError:
        raise FlowerCliError(cmd, f"exit {code}, no JSON output:\n{tail(out + err, 30)}", out, err) from None
    if not isinstance(data, dict) or not data.get("success", False):
        msg = data.get("error-message", data) if isinstance(data, dict) else data
        raise FlowerCliError(cmd, strip_ansi(str(msg)), out, err)
    return data


def submit_run(app_dir: str | os.PathLike[str], superlink: SuperLinkLike,
               run_config: Mapping[str, Any] | Sequence[str] | None = None,
               federation_config: Mapping[str, Any] | Sequence[str] | None = None, timeout: float = 120.0) -> int:
    """``flwr run APP CONN --format json`` with overrides; the run id.

    ``run_config`` keys must exist in the app's ``[tool.flwr.app.config]`` (checked here first,
    ``prepare_run_config``; TOML files and ``k=v`` strings may be mixed).
    ``federation_config`` (simulation): ``num-supernodes``, ``backend``,
    ``client-resources-num-cpus`` (int), ``client-resources-num-gpus`` (float), ``init-args-*``.
    """
    app = Path(app_dir).expanduser().resolve()
    if not (app / "pyproject.toml").is_file():
        raise FileNotFoundError(f"no pyproject.toml in {app}")
    args = ["run", str(app), superlink.connection]
    for item in prepare_run_config(app, run_config):
        args += ["--run-config", item]
    fed = format_overrides(federation_config)
    if fed:
        args += ["--federation-config", " ".join(fed)]
    data = flwr_json(args, superlink, timeout)
    run_id = data.get("run-id")
    if run_id in (None, ""):
        raise FlowerCliError(["flwr", *args], f"no run-id in {data}")
    return int(run_id)


def run_status(run_id: int, superlink: SuperLinkLike, timeout: float = 60.0) -> dict[str, Any]:
    """The run's dict from ``flwr ls --run-id ID --format json`` (``run-id``, ``status``,
    ``status-details``, ``elapsed``, ``pending-at`` ... ``finished-at``, ...)."""
    data = flwr_json(["ls", superlink.connection, "--run-id", str(int(run_id))], superlink, timeout)
    for run in data.get("runs") or []:
        if str(run.get("run-id")) == str(int(run_id)):
            return run
    raise FlowerCliError(["flwr", "ls", "--run-id", str(run_id)], f"run not in {data}")


def is_finished(status: str) -> bool:
    return status.split(":", 1)[0] == "finished"


def wait_for_run(run_id: int, superlink: SuperLinkLike, timeout: float, poll_interval: float = 2.0) -> dict[str, Any]:
    """Wait until the status is ``finished:*``; its dict, with the run's log as ``"logs"``
    when it was followed. RunTimeout past ``timeout``; a LocalSuperLink that died is reported
    at once (RunFailed, status ``superlink-died``).

    One ``flwr log --stream`` follows the run to its end, then one ``flwr ls`` reads the
    status. Each ``flwr`` process costs about 1.5 s of CPU to start (Python and flwr's
    imports): polling ``flwr ls`` every few seconds kept a core busy and, on 2 cores, stalled
    the simulation's ClientApps (rounds of 2-3 s instead of 0.6 s, measured). Polling is the
    fallback when the stream ends before the run does."""
    deadline = time.monotonic() + timeout
    logs = _follow(run_id, superlink, deadline, poll_interval)
    last: dict[str, Any] = {"status": "unknown"}
    while True:
        if isinstance(superlink, LocalSuperLink) and not superlink.is_running():
            raise RunFailed(run_id, "superlink-died", superlink.output_tail())
        left = deadline - time.monotonic()
        if left <= 0:
            raise RunTimeout(run_id, str(last.get("status")), details=f"not finished after {timeout:.0f}s")
        try:
            last = run_status(run_id, superlink, timeout=max(5.0, min(60.0, left)))
        except FlowerCliError:
            if deadline - time.monotonic() <= 0:
                raise
            time.sleep(poll_interval)
            continue
        if is_finished(str(last.get("status", ""))):
            return {**last, "logs": logs} if logs is not None else last
        logs = None  # the stream ended early: what it gave is not the whole log
        time.sleep(min(poll_interval, max(0.0, deadline - time.monotonic())))


def _follow(run_id: int, superlink: SuperLinkLike, deadline: float, poll_interval: float) -> str | None:
    """Stream the run's log until the stream ends (the run finished) or ``deadline``; the log,
    or None when it did not end in time."""
    cmd = [*getattr(superlink, "command_prefix", ()), exe("flwr"), "log", str(int(run_id)), superlink.connection,
           "--stream"]
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, cwd=superlink.cwd, env=superlink.env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            while proc.poll() is None:
                if time.monotonic() >= deadline or (isinstance(superlink, LocalSuperLink)
                                                    and not superlink.is_running()):
                    return None
                time.sleep(min(poll_interval, 0.5))
        finally:
            stop(proc, timeout=5.0)
        out.seek(0)
        return _without_banners(out.read().decode(errors="replace"))


def _without_banners(out: str) -> str:
    lines = out.splitlines(keepends=True)
    banners = ("Using SuperLink:", "Starting logstream for run_id")
    while lines and any(b in lines[0] for b in banners):  # the CLI's own first lines
        lines.pop(0)
    return "".join(lines)


def fetch_logs(run_id: int, superlink: SuperLinkLike, timeout: float = 60.0) -> str:
    """The run's log (ServerApp output and, in simulation, ClientApp output via Ray);
    bounded by ``timeout`` (partial on timeout: a live run streams until it ends)."""
    try:
        _, out, _ = run_cli(["log", str(int(run_id)), superlink.connection, "--stream"], superlink, timeout)
    except FlowerCliError as exc:
        return exc.stdout
    return _without_banners(out)


def stop_run(run_id: int, superlink: SuperLinkLike, timeout: float = 60.0) -> bool:
    """``flwr stop ID CONN``; True if the SuperLink reports success."""
    try:
        flwr_json(["stop", str(int(run_id)), superlink.connection], superlink, timeout)
    except FlowerCliError:
        return False
    return True


def run_app(app_dir: str | os.PathLike[str], run_config: Mapping[str, Any] | Sequence[str] | None = None,
            federation_config: Mapping[str, Any] | Sequence[str] | None = None, timeout: float = 600.0, *,
            superlink: SuperLinkLike | None = None, superlink_kwargs: Mapping[str, Any] | None = None,
            poll_interval: float = 2.0, log_tail_lines: int = 60, fetch_log: bool = True) -> dict[str, Any]:
    """Start a LocalSuperLink (unless one is given), submit, wait, fetch logs.

    Returns the run's dict plus ``"logs"`` (``""`` without ``fetch_log``). Raises RunFailed
    unless the status is ``finished:completed``; RunTimeout (run stopped) past ``timeout``.
    """
    if superlink is None:
        with LocalSuperLink(**dict(superlink_kwargs or {})) as own:
            return run_app(app_dir, run_config, federation_config, timeout, superlink=own,
                           poll_interval=poll_interval, log_tail_lines=log_tail_lines, fetch_log=fetch_log)
    deadline = time.monotonic() + timeout
    run_id = submit_run(app_dir, superlink, run_config, federation_config, timeout=min(120.0, timeout))
    try:
        run = wait_for_run(run_id, superlink, max(1.0, deadline - time.monotonic()), poll_interval=poll_interval)
    except RunTimeout as exc:
        stop_run(run_id, superlink, timeout=30.0)
        logs = fetch_logs(run_id, superlink, timeout=15.0)
        raise RunTimeout(run_id, exc.status, tail(logs, log_tail_lines), exc.details, failure_cause(logs)) from None
    followed = run.pop("logs", None)
    run["logs"] = ("" if not fetch_log else followed if followed is not None
                   else fetch_logs(run_id, superlink, timeout=60.0))
    status = str(run.get("status"))
    if status != STATUS_COMPLETED:
        raise RunFailed(run_id, status, tail(run["logs"], log_tail_lines), str(run.get("status-details", "")),
                        failure_cause(run["logs"]))
    return run


def run_app_with_restarts(app_dir: str | os.PathLike[str], run_config: Mapping[str, Any] | Sequence[str] | None,
                          federation_config: Mapping[str, Any] | Sequence[str] | None, timeout: float, *,
                          superlink: SuperLinkLike, restarts: int, restart_delay: float = 10.0,
                          say: Any = print) -> dict[str, Any]:
    """``run_app`` on ``superlink``; a run that failed is submitted again with ``resume=true``, up to
    ``restarts`` times, by the policy of ``submit.sh --restarts`` (``server.deploy.restarts``: not a
    stopped run, a refused config, a run that cannot resume, the same failure twice, a changed app).
    ``say(line)`` is told each restart with its cause. The last RunFailed is raised with the reason."""
    app = Path(app_dir).expanduser().resolve()
    if restarts < 0:
        raise ValueError(f"restarts must be an integer >= 0, got {restarts}")
    if restarts and not str(run_config_values(app, run_config).get("run-name") or ""):
        raise ValueError("--restarts needs a fixed run-name (--run-config \"run-name='NAME'\"): a restart resumes "
                         "that folder")
    deadline = time.monotonic() + timeout
    config, previous, first = run_config, None, None
    for attempt in range(restarts + 1):
        try:
            return run_app(app, config, federation_config, max(1.0, deadline - time.monotonic()), superlink=superlink)
        except RunTimeout:
            raise
        except RunFailed as exc:
            cause = exc.cause or (f"{exc.status}: {exc.details}" if exc.details and exc.details != "N/A" else exc.status)
            why = stop_reason(exc.status, cause, previous)
            if why is None and attempt < restarts:
                first = first or _recorded_fab_hash(exc.run_id, superlink)
                now = fab_hash(app)
                if first and not now.startswith(first):
                    why = (f"the app's code changed since its first run was submitted (FAB {first[:8]}, now "
                           f"{now[:8]}): resume by hand with resume=true if that is intended")
            if why is not None or attempt == restarts:
                say(f"not restarted: {why or f'all {restarts} restart(s) used ({cause})'}")
                raise
            say(f"restart {attempt + 1}/{restarts} of run {exc.run_id} ({exc.status}): {cause}; submitting it again "
                f"with resume=true in {restart_delay:g} s")
            previous = cause
            config = [*format_overrides(run_config), "resume=true"]
            time.sleep(restart_delay)
    raise AssertionError("unreachable")


def _recorded_fab_hash(run_id: int, superlink: SuperLinkLike) -> str:
    """The FAB hash Flower recorded for the run ("" when it cannot say)."""
    try:
        return str(run_status(run_id, superlink).get("fab-hash") or "")
    except FlowerCliError:
        return ""
