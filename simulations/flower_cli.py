"""Drive the real Flower CLI (flwr 1.42): a throw-away SuperLink, ``flwr run``, status, logs.

Used by tests, the experiment runner and deployment scripts. Stdlib only at import time
(no torch, no flwr): everything Flower is reached through its console scripts.

Facts this module relies on (read from the installed flwr 1.42 and checked end to end):

* ``flower-superlink`` serves the Control, Fleet and Runtime (ServerAppIo/SimulationIo)
  APIs over ONE HTTP port (``--host``/``--port``, health at ``GET /health``); the old
  ``--control-api-address``/``--fleet-api-address`` flags are deprecated no-ops.
* In ``--isolation subprocess`` (default) the SuperLink spawns ``flower-superexec`` in a
  NEW session, which spawns ``flwr-simulation``/``flwr-serverapp`` (and Ray) -- killing
  the SuperLink's process group is not enough, so teardown also kills every process that
  carries this instance's environment tag or descends from it.
* The CLI reads connections from ``$FLWR_HOME/config.toml``::

      [superlink]
      default = "name"
      [superlink.name]
      address = "127.0.0.1:PORT"
      insecure = true

* ``flwr run/ls/stop --format json`` exit 0 even on errors; they print
  ``{"success": false, "error-message": ...}``. ``flwr run`` exits 0 when the run later
  fails, so success is decided by the run status from ``flwr ls``:
  ``finished:completed`` / ``finished:failed`` / ``finished:stopped`` (others:
  ``pending``, ``starting``, ``running``).
* ``flwr log ID CONN`` on a finished run prints the whole log and exits; on a live run it
  streams until the run finishes.
* CLI commands run with ``cwd`` = the isolated FLWR_HOME: ``flwr ls/log/stop`` otherwise
  treat ``./<connection>/pyproject.toml`` or a ``[tool.flwr.federations]`` table in the
  cwd's pyproject.toml as legacy usage and may rewrite it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "STATUS_COMPLETED",
    "STATUS_FAILED",
    "STATUS_STOPPED",
    "ExistingSuperLink",
    "FlowerCliError",
    "LocalSuperLink",
    "RunFailed",
    "RunTimeout",
    "SuperLinkStartError",
    "fetch_logs",
    "flwr_json",
    "format_overrides",
    "is_finished",
    "run_app",
    "run_status",
    "stop_run",
    "submit_run",
    "wait_for_run",
]

STATUS_COMPLETED = "finished:completed"
STATUS_FAILED = "finished:failed"
STATUS_STOPPED = "finished:stopped"
_FINISHED = "finished"

_TAG_VAR = "FLWR_CLI_HELPER_TAG"
_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
_KEY_RE = re.compile(r"^[A-Za-z0-9_.-]+$")
_CONN_RE = re.compile(r"^[A-Za-z0-9_-]+$")


# ----------------------------------------------------------------------------- errors
class FlowerCliError(RuntimeError):
    """A ``flwr`` command failed, timed out, or answered ``"success": false``."""

    def __init__(self, cmd: Sequence[str], message: str, stdout: str = "", stderr: str = ""):
        self.cmd = list(cmd)
        self.stdout = stdout
        self.stderr = stderr
        super().__init__(f"{' '.join(self.cmd)}: {message}")


class SuperLinkStartError(RuntimeError):
    """``flower-superlink`` exited early or did not become healthy in time."""


class RunFailed(RuntimeError):
    """A run finished with a status other than ``finished:completed``."""

    def __init__(self, run_id: int, status: str, logs_tail: str = "", details: str = ""):
        self.run_id = run_id
        self.status = status
        self.logs_tail = logs_tail
        self.details = details
        msg = f"Flower run {run_id} ended with status {status!r}"
        if details and details != "N/A":
            msg += f": {details}"
        if logs_tail:
            msg += f"\n--- last log lines ---\n{logs_tail}"
        super().__init__(msg)


class RunTimeout(RunFailed):
    """The run did not finish within the time bound (it is stopped best-effort)."""


# ------------------------------------------------------------------------ small helpers
def _bin_dir() -> Path:
    """The directory of the current interpreter's console scripts (the venv's bin)."""
    return Path(sys.executable).parent


def _exe(name: str) -> str:
    """Resolve a console script of the *current* environment, falling back to PATH."""
    cand = _bin_dir() / name
    if cand.exists():
        return str(cand)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"`{name}` not found next to {sys.executable} nor on PATH")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host`` (small race until it is bound)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def strip_ansi(text: str) -> str:
    return _ANSI_RE.sub("", text)


def _tail(text: str, lines: int) -> str:
    return "\n".join(strip_ansi(text).rstrip().splitlines()[-lines:])


def _toml_value(key: str, value: Any) -> str:
    """One override value in the TOML form ``flwr`` parses (see flwr.common.config)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, str):
        # flwr splits "k=v" pairs with the regex (\S+?)=('[^']*'|"[^"]*"|\S+), so a
        # quoted value may not contain its own quote character at all.
        if "\n" in value or "\r" in value:
            raise ValueError(f"override {key!r}: newlines are not supported")
        if "'" not in value:
            return f"'{value}'"  # TOML literal string: verbatim, no escapes
        if '"' not in value:
            return json.dumps(value)  # TOML basic string (JSON escapes are valid TOML)
        raise ValueError(f"override {key!r}: a string with both ' and \" is not supported")
    raise TypeError(f"override {key!r}: unsupported type {type(value).__name__} (use bool, int, float or str)")


def format_overrides(config: Mapping[str, Any] | Sequence[str] | None) -> list[str]:
    """``{"lr": 0.1, "task": "digits"}`` -> ``["lr=0.1", "task='digits'"]``.

    A sequence of strings is passed through unchanged (already ``k=v`` TOML text).
    """
    if config is None:
        return []
    if isinstance(config, str):
        return [config]
    if not isinstance(config, Mapping):
        return [str(item) for item in config]
    out = []
    for key, value in config.items():
        if not _KEY_RE.match(str(key)):
            raise ValueError(f"invalid override key {key!r}")
        out.append(f"{key}={_toml_value(str(key), value)}")
    return out


def _parse_json_output(stdout: str) -> Any:
    text = stdout.strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    decoder = json.JSONDecoder()
    for match in re.finditer(r"(?m)^\{", text):  # first top-level object that parses
        try:
            obj, _ = decoder.raw_decode(text[match.start() :])
            return obj
        except json.JSONDecodeError:
            continue
    raise ValueError("no JSON object in output")


# --------------------------------------------------------------- process-tree handling
def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, starttime) of a live pid from /proc, None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = raw[raw.rfind(")") + 2 :].split()
    try:
        return rest[0], int(rest[1]), int(rest[19])
    except (IndexError, ValueError):
        return None


def _all_pids() -> list[int]:
    try:
        return [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []


def _tagged_or_descendant_pids(root: int | None, tag: str) -> dict[int, int]:
    """pid -> starttime of every live (non-zombie) process carrying ``tag`` in its
    environment or descending from ``root``. Linux only (empty elsewhere)."""
    if not os.path.isdir("/proc"):
        return {}
    needle = f"{_TAG_VAR}={tag}".encode()
    me = os.getpid()
    stats: dict[int, tuple[str, int, int]] = {}
    found: dict[int, int] = {}
    for pid in _all_pids():
        st = _proc_stat(pid)
        if st is None:
            continue
        stats[pid] = st
        if pid == me or st[0] in ("Z", "X"):
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            found[pid] = st[2]
    if root is not None:
        children: dict[int, list[int]] = {}
        for pid, (_, ppid, _) in stats.items():
            children.setdefault(ppid, []).append(pid)
        stack = [root]
        while stack:
            pid = stack.pop()
            for child in children.get(pid, []):
                if child != me and stats[child][0] not in ("Z", "X"):
                    found[child] = stats[child][2]
                stack.append(child)
        if root in stats and stats[root][0] not in ("Z", "X"):
            found[root] = stats[root][2]
    return found


def _signal_pids(pids: Mapping[int, int], sig: int) -> None:
    for pid, start in pids.items():
        st = _proc_stat(pid)
        if st is None or st[2] != start:  # gone or pid reused
            continue
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _alive(pids: Mapping[int, int]) -> dict[int, int]:
    out = {}
    for pid, start in pids.items():
        st = _proc_stat(pid)
        if st is not None and st[2] == start and st[0] not in ("Z", "X"):
            out[pid] = start
    return out


# ---------------------------------------------------------------------- SuperLink handles
def _write_flower_config(home: Path, name: str, address: str, insecure: bool, root_certificates: str | None) -> Path:
    if not _CONN_RE.match(name):
        raise ValueError(f"invalid connection name {name!r} (letters, digits, - and _)")
    lines = ["[superlink]", f'default = "{name}"', "", f"[superlink.{name}]", f"address = {json.dumps(address)}"]
    if root_certificates:
        lines.append(f"root-certificates = {json.dumps(str(root_certificates))}")
    lines.append(f"insecure = {'true' if insecure else 'false'}")
    path = home / "config.toml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _base_env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["FLWR_HOME"] = str(home)
    # Console scripts spawned by Flower (flower-superexec, flwr-simulation, ...) are
    # looked up on PATH: make sure it is *this* environment's.
    env["PATH"] = os.pathsep.join([str(_bin_dir()), env.get("PATH", "")])
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"  # no `uv sync`
    env.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")  # no network
    env.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("COLUMNS", "400")  # rich: do not wrap CLI output
    env.pop("FORCE_COLOR", None)
    env.pop(_TAG_VAR, None)
    return env


class ExistingSuperLink:
    """A connection to a SuperLink this module does not manage (deployment, or reuse).

    Writes ``$FLWR_HOME/config.toml`` with one connection (a temp FLWR_HOME unless
    ``flwr_home`` is given) so the ``flwr`` commands here can address it by name.
    """

    def __init__(
        self,
        address: str,
        *,
        insecure: bool = True,
        root_certificates: str | os.PathLike[str] | None = None,
        connection: str = "target",
        flwr_home: str | os.PathLike[str] | None = None,
        command_prefix: Sequence[str] = (),
    ):
        self.command_prefix = list(command_prefix)  # prepended to every `flwr` command
        self._own_home = flwr_home is None
        self.home = Path(flwr_home) if flwr_home else Path(tempfile.mkdtemp(prefix="flwr-home-"))
        self.home.mkdir(parents=True, exist_ok=True)
        self.address = address
        self.connection = connection
        _write_flower_config(
            self.home, connection, address, insecure, str(root_certificates) if root_certificates else None
        )
        self.env = _base_env(self.home)

    @property
    def cwd(self) -> Path:
        return self.home

    def close(self) -> None:
        if self._own_home:
            shutil.rmtree(self.home, ignore_errors=True)

    def __enter__(self) -> ExistingSuperLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LocalSuperLink:
    """``flower-superlink`` on a free loopback port with an isolated FLWR_HOME.

    ``with LocalSuperLink() as sl: submit_run(app, sl, ...)``. Attributes: ``home``
    (FLWR_HOME), ``port``, ``address`` (``host:port`` for CLI connections and, in
    deployment mode, for ``flower-supernode --superlink``), ``connection`` (name in
    ``$FLWR_HOME/config.toml``), ``env`` (full environment for ``flwr`` subprocesses),
    ``log_file`` (SuperLink log), ``output_file`` (stdout/stderr of the SuperLink and
    everything it spawns: SuperExec, flwr-simulation, Ray).

    The ``cwd`` argument (attribute ``server_cwd``; default: the caller's cwd) is the
    working directory of the SuperLink and therefore of the ServerApp and the simulated
    ClientApps -- a relative ``results/`` path in a ServerApp lands there. (The ``cwd``
    property is where ``flwr`` CLI commands run: FLWR_HOME.) On exit every process of this instance is terminated
    (SIGTERM, then SIGKILL after ``shutdown_timeout``), including detached children.
    """

    def __init__(
        self,
        *,
        simulation: bool = True,
        host: str = "127.0.0.1",
        port: int | None = None,
        flwr_home: str | os.PathLike[str] | None = None,
        connection: str = "local-sim",
        database: str | None = None,
        cwd: str | os.PathLike[str] | None = None,
        isolation: str = "subprocess",
        startup_timeout: float = 60.0,
        shutdown_timeout: float = 10.0,
        keep_home: bool = False,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ):
        self.simulation = simulation
        self.host = host
        self._port_fixed = port is not None
        self.port = port if port is not None else free_port(self._probe_host(host))
        self._own_home = flwr_home is None
        self.home = Path(flwr_home) if flwr_home else Path(tempfile.mkdtemp(prefix="flwr-home-"))
        self.home.mkdir(parents=True, exist_ok=True)
        self.connection = connection
        self.database = database if database is not None else str(self.home / "state.db")
        self.server_cwd = Path(cwd) if cwd is not None else Path.cwd()
        self.isolation = isolation
        self.startup_timeout = startup_timeout
        self.shutdown_timeout = shutdown_timeout
        self.keep_home = keep_home
        self.extra_args = list(extra_args)
        self.log_file = self.home / "superlink.log"
        self.output_file = self.home / "superlink.out"
        self.tag = uuid.uuid4().hex
        self.env = _base_env(self.home)
        if env:
            self.env.update(env)
        self.process: subprocess.Popen[bytes] | None = None
        self._out_fh: Any = None
        _write_flower_config(self.home, connection, self.address, True, None)

    # -- addressing
    @staticmethod
    def _probe_host(host: str) -> str:
        return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host

    @property
    def address(self) -> str:
        return f"{self._probe_host(self.host)}:{self.port}"

    @property
    def cwd(self) -> Path:
        """Working directory for ``flwr`` CLI commands (never an app directory)."""
        return self.home

    # -- lifecycle
    def command(self) -> list[str]:
        cmd = [_exe("flower-superlink"), "--insecure"]
        if self.simulation:
            cmd.append("--simulation")
        cmd += [
            "--isolation",
            self.isolation,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--database",
            self.database,
            "--log-file",
            str(self.log_file),
            "--disable-runtime-dependency-installation",
            *self.extra_args,
        ]
        return cmd

    def start(self) -> LocalSuperLink:
        if self.process is not None:
            raise RuntimeError("SuperLink already started")
        attempts = 1 if self._port_fixed else 3
        for attempt in range(attempts):
            try:
                self._start_once()
                return self
            except SuperLinkStartError:
                self._terminate()
                if attempt + 1 >= attempts:
                    self._cleanup_home()
                    raise
                self.port = free_port(self._probe_host(self.host))  # port race: retry
                _write_flower_config(self.home, self.connection, self.address, True, None)
        return self

    def _start_once(self) -> None:
        server_env = dict(self.env)
        server_env[_TAG_VAR] = self.tag
        self._out_fh = open(self.output_file, "ab")
        self.process = subprocess.Popen(
            self.command(),
            cwd=self.server_cwd,
            env=server_env,
            stdin=subprocess.DEVNULL,
            stdout=self._out_fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        url = f"http://{self.address}/health"
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SuperLinkStartError(
                    f"flower-superlink exited with code {self.process.returncode}:\n" + self.output_tail()
                )
            try:
                with urllib.request.urlopen(url, timeout=1.0) as resp:
                    if 200 <= resp.status < 300:
                        return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.2)
        raise SuperLinkStartError(
            f"flower-superlink not healthy at {url} after {self.startup_timeout:.0f}s:\n" + self.output_tail()
        )

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def output_tail(self, lines: int = 40) -> str:
        try:
            return _tail(self.output_file.read_text(errors="replace"), lines)
        except OSError:
            return ""

    def _terminate(self) -> None:
        """SIGTERM the SuperLink's group and every tagged/descendant process, wait,
        then SIGKILL what is left. Bounded by ``shutdown_timeout`` (+5 s)."""
        proc = self.process
        root = proc.pid if proc is not None else None
        targets = _tagged_or_descendant_pids(root, self.tag)
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except (ProcessLookupError, PermissionError):
                pass
        _signal_pids(targets, signal.SIGTERM)
        deadline = time.monotonic() + self.shutdown_timeout
        while time.monotonic() < deadline:
            targets.update(_tagged_or_descendant_pids(None, self.tag))  # late spawns
            if (proc is None or proc.poll() is not None) and not _alive(targets):
                break
            time.sleep(0.1)
        else:
            if proc is not None and proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            targets.update(_tagged_or_descendant_pids(None, self.tag))
            _signal_pids(_alive(targets), signal.SIGKILL)
            deadline = time.monotonic() + 5.0
            while time.monotonic() < deadline and _alive(targets):
                time.sleep(0.1)
        if proc is not None:
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass
        self.process = None
        if self._out_fh is not None:
            self._out_fh.close()
            self._out_fh = None

    def _cleanup_home(self) -> None:
        if self._own_home and not self.keep_home:
            shutil.rmtree(self.home, ignore_errors=True)

    def stop(self) -> None:
        self._terminate()
        self._cleanup_home()

    def __enter__(self) -> LocalSuperLink:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __del__(self) -> None:  # last resort; `with`/stop() is the contract
        try:
            if self.process is not None and self.process.poll() is None:
                self._terminate()
        except Exception:
            pass


SuperLinkLike = LocalSuperLink | ExistingSuperLink


# ----------------------------------------------------------------------- CLI wrappers
def _run_cli(args: Sequence[str], superlink: SuperLinkLike, timeout: float) -> tuple[int, str, str]:
    """Run ``flwr ARGS`` bounded by ``timeout``; (returncode, stdout, stderr)."""
    # e.g. ["ip", "netns", "exec", NS]: run the CLI where the SuperLink is reachable
    cmd = [*getattr(superlink, "command_prefix", ()), _exe("flwr"), *args]
    proc = subprocess.Popen(
        cmd,
        cwd=superlink.cwd,
        env=superlink.env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        out, err = proc.communicate(timeout=10)
        raise FlowerCliError(
            cmd, f"timed out after {timeout:.0f}s", out.decode(errors="replace"), err.decode(errors="replace")
        ) from None
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


def flwr_json(args: Sequence[str], superlink: SuperLinkLike, timeout: float = 60.0) -> dict[str, Any]:
    """Run ``flwr ARGS --format json``; the parsed object, or FlowerCliError."""
    argv = [*args, "--format", "json"]
    code, out, err = _run_cli(argv, superlink, timeout)
    cmd = ["flwr", *argv]
    try:
        data = _parse_json_output(out)
    except ValueError:
        raise FlowerCliError(cmd, f"exit {code}, no JSON output:\n{_tail(out + err, 30)}", out, err) from None
    if not isinstance(data, dict) or not data.get("success", False):
        msg = data.get("error-message", data) if isinstance(data, dict) else data
        raise FlowerCliError(cmd, strip_ansi(str(msg)), out, err)
    return data


def submit_run(
    app_dir: str | os.PathLike[str],
    superlink: SuperLinkLike,
    run_config: Mapping[str, Any] | Sequence[str] | None = None,
    federation_config: Mapping[str, Any] | Sequence[str] | None = None,
    timeout: float = 120.0,
) -> int:
    """``flwr run APP CONN --format json`` with overrides; returns the run id.

    ``run_config`` keys must exist in the app's ``[tool.flwr.app.config]`` (the SuperLink
    rejects unknown keys). ``federation_config`` keys (simulation): ``num-supernodes``,
    ``backend``, ``verbose``, ``client-resources-num-cpus`` (int),
    ``client-resources-num-gpus`` (float), ``init-args-num-cpus``, ``init-args-num-gpus``,
    ``init-args-logging-level``, ``init-args-log-to-driver``.
    """
    app = Path(app_dir).expanduser().resolve()
    if not (app / "pyproject.toml").is_file():
        raise FileNotFoundError(f"no pyproject.toml in {app}")
    args = ["run", str(app), superlink.connection]
    for item in format_overrides(run_config):
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
    """The run's dict from ``flwr ls --run-id ID --format json`` (keys: ``run-id``,
    ``status``, ``status-details``, ``elapsed``, ``pending-at`` ... ``finished-at``,
    ``network-traffic``, ``compute-time``, ``fab-id``, ``fab-hash``, ...)."""
    data = flwr_json(["ls", superlink.connection, "--run-id", str(int(run_id))], superlink, timeout)
    runs = data.get("runs") or []
    for run in runs:
        if str(run.get("run-id")) == str(int(run_id)):
            return run
    raise FlowerCliError(["flwr", "ls", "--run-id", str(run_id)], f"run not in {data}")


def is_finished(status: str) -> bool:
    return status.split(":", 1)[0] == _FINISHED


def wait_for_run(run_id: int, superlink: SuperLinkLike, timeout: float, poll_interval: float = 2.0) -> dict[str, Any]:
    """Poll until the run's status is ``finished:*``; its dict. RunTimeout past timeout.

    A LocalSuperLink that died is reported at once (RunFailed, status ``superlink-died``).
    """
    deadline = time.monotonic() + timeout
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
            return last
        time.sleep(min(poll_interval, max(0.0, deadline - time.monotonic())))


def fetch_logs(run_id: int, superlink: SuperLinkLike, timeout: float = 60.0) -> str:
    """The run's log (ServerApp stdout/stderr/logging + ClientApp output via Ray).

    For a finished run ``flwr log`` returns everything and exits; for a live run it
    streams until the run ends, so this is bounded by ``timeout`` (partial on timeout).
    """
    cmd = ["log", str(int(run_id)), superlink.connection, "--stream"]
    try:
        _, out, err = _run_cli(cmd, superlink, timeout)
    except FlowerCliError as exc:
        return exc.stdout
    del err
    lines = out.splitlines(keepends=True)
    banners = ("Using SuperLink:", "Starting logstream for run_id")
    while lines and any(b in lines[0] for b in banners):  # the CLI's own first lines
        lines.pop(0)
    return "".join(lines)


def stop_run(run_id: int, superlink: SuperLinkLike, timeout: float = 60.0) -> bool:
    """``flwr stop ID CONN``; True if the SuperLink reports success."""
    try:
        flwr_json(["stop", str(int(run_id)), superlink.connection], superlink, timeout)
    except FlowerCliError:
        return False
    return True


def run_app(
    app_dir: str | os.PathLike[str],
    run_config: Mapping[str, Any] | Sequence[str] | None = None,
    federation_config: Mapping[str, Any] | Sequence[str] | None = None,
    timeout: float = 600.0,
    *,
    superlink: SuperLinkLike | None = None,
    superlink_kwargs: Mapping[str, Any] | None = None,
    poll_interval: float = 2.0,
    log_tail_lines: int = 60,
    fetch_log: bool = True,
) -> dict[str, Any]:
    """Start a LocalSuperLink (unless one is given), submit, wait, fetch logs.

    Returns the run's dict plus ``"logs"`` (str, ANSI kept as Flower wrote it; ``""``
    when ``fetch_log`` is false). Raises RunFailed unless the status is
    ``finished:completed``, RunTimeout (run stopped best-effort) past ``timeout``.
    """
    if superlink is None:
        with LocalSuperLink(**dict(superlink_kwargs or {})) as own:
            return run_app(
                app_dir,
                run_config,
                federation_config,
                timeout,
                superlink=own,
                poll_interval=poll_interval,
                log_tail_lines=log_tail_lines,
                fetch_log=fetch_log,
            )
    deadline = time.monotonic() + timeout
    run_id = submit_run(app_dir, superlink, run_config, federation_config, timeout=min(120.0, timeout))
    try:
        run = wait_for_run(run_id, superlink, max(1.0, deadline - time.monotonic()), poll_interval=poll_interval)
    except RunTimeout as exc:
        stop_run(run_id, superlink, timeout=30.0)
        logs = fetch_logs(run_id, superlink, timeout=15.0)
        raise RunTimeout(run_id, exc.status, _tail(logs, log_tail_lines), exc.details) from None
    logs = fetch_logs(run_id, superlink, timeout=60.0) if fetch_log else ""
    run["logs"] = logs
    status = str(run.get("status"))
    if status != STATUS_COMPLETED:
        raise RunFailed(run_id, status, _tail(logs, log_tail_lines), str(run.get("status-details", "")))
    return run


# ------------------------------------------------------------------------------ __main__
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m simulations.flower_cli",
        description="Run a Flower App on a throw-away local SuperLink and report its status.",
    )
    parser.add_argument("app_dir")
    parser.add_argument(
        "--run-config",
        "-c",
        action="append",
        default=[],
        help="TOML 'k=v' overrides (repeatable), e.g. \"lr=0.1 task='digits'\"",
    )
    parser.add_argument(
        "--federation-config", action="append", default=[], help="e.g. 'num-supernodes=8 client-resources-num-cpus=1'"
    )
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--address", help="use this running SuperLink (host:port) instead")
    parser.add_argument("--deployment", action="store_true", help="start the local SuperLink without --simulation")
    parser.add_argument("--keep-home", action="store_true", help="keep FLWR_HOME (logs)")
    parser.add_argument("--quiet", action="store_true", help="do not print the run log")
    ns = parser.parse_args(argv)

    def go(sl: SuperLinkLike) -> dict[str, Any]:
        return run_app(ns.app_dir, ns.run_config or None, ns.federation_config or None, ns.timeout, superlink=sl)

    try:
        if ns.address:
            with ExistingSuperLink(ns.address) as sl:
                run = go(sl)
        else:
            with LocalSuperLink(simulation=not ns.deployment, keep_home=ns.keep_home) as sl:
                if ns.keep_home:
                    print(f"FLWR_HOME={sl.home}", file=sys.stderr)
                run = go(sl)
    except RunFailed as exc:
        print(exc, file=sys.stderr)
        print(json.dumps({"run-id": str(exc.run_id), "status": exc.status}))
        return 1
    except (FlowerCliError, SuperLinkStartError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not ns.quiet:
        print(strip_ansi(run.get("logs", "")), file=sys.stderr)
    print(json.dumps({k: v for k, v in run.items() if k != "logs"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
