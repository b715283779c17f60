"""SuperLink handles for the ``flwr`` CLI: a private ``LocalSuperLink`` or an ``ExistingSuperLink``.

Facts relied on (flwr 1.42): ``flower-superlink`` serves the Control, Fleet and Runtime
APIs over ONE HTTP port (``--host``/``--port``, health at ``GET /health``). The CLI reads
connections from ``$FLWR_HOME/config.toml`` (``[superlink] default = NAME`` and
``[superlink.NAME] address/insecure/root-certificates``). CLI commands run with
``cwd`` = FLWR_HOME: ``flwr ls/log/stop`` treat a ``pyproject.toml`` in the cwd as legacy
usage and may rewrite it.

flwr's own local SuperLink (``flwr.cli.local_superlink``) does not fit a test or an
experiment: it always binds the one fixed port 39091 (shared by every user of the
machine), writes its output to /dev/null and gives up after 15 s; so this module starts
its own on a free port with an isolated FLWR_HOME, and polls the same ``/health`` route.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from .processes import TAG_VAR, bin_dir, exe, free_port, stop, tail

__all__ = ["ExistingSuperLink", "LocalSuperLink", "SuperLinkLike", "SuperLinkStartError", "base_env",
           "write_flower_config"]

_CONN_RE = re.compile(r"^[A-Za-z0-9_-]+$")


class SuperLinkStartError(RuntimeError):
    """``flower-superlink`` exited early or did not become healthy in time."""


def write_flower_config(home: Path, name: str, address: str, insecure: bool = True,
                        root_certificates: str | None = None) -> Path:
    """``$FLWR_HOME/config.toml`` with one connection ``name`` (the default)."""
    if not _CONN_RE.match(name):
        raise ValueError(f"invalid connection name {name!r} (letters, digits, - and _)")
    lines = ["[superlink]", f'default = "{name}"', "", f"[superlink.{name}]", f"address = {json.dumps(address)}"]
    if root_certificates:
        lines.append(f"root-certificates = {json.dumps(str(root_certificates))}")
    lines.append(f"insecure = {'true' if insecure else 'false'}")
    path = home / "config.toml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def base_env(home: Path) -> dict[str, str]:
    """The environment of every Flower process started here: this FLWR_HOME, this venv's
    console scripts first on PATH, no dependency install, no update check, no colours."""
    env = dict(os.environ)
    env["FLWR_HOME"] = str(home)
    env["PATH"] = os.pathsep.join([str(bin_dir()), env.get("PATH", "")])
    env["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"  # no `uv sync`
    env.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")  # no network
    env.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("COLUMNS", "400")  # rich: do not wrap CLI output
    env.pop("FORCE_COLOR", None)
    env.pop(TAG_VAR, None)
    return env


def _new_home(flwr_home: str | os.PathLike[str] | None) -> Path:
    home = Path(flwr_home) if flwr_home else Path(tempfile.mkdtemp(prefix="flwr-home-"))
    home.mkdir(parents=True, exist_ok=True)
    return home


class ExistingSuperLink:
    """A connection to a SuperLink this module does not manage (deployment, or reuse).

    Writes ``$FLWR_HOME/config.toml`` (a temp FLWR_HOME unless ``flwr_home`` is given).
    ``command_prefix`` is prepended to every ``flwr`` command (e.g. ``ip netns exec NS``).
    """

    def __init__(self, address: str, *, insecure: bool = True,
                 root_certificates: str | os.PathLike[str] | None = None, connection: str = "target",
                 flwr_home: str | os.PathLike[str] | None = None, command_prefix: Sequence[str] = ()):
        self.command_prefix = list(command_prefix)
        self._own_home = flwr_home is None
        self.home = _new_home(flwr_home)
        self.address = address
        self.connection = connection
        write_flower_config(self.home, connection, address, insecure,
                            str(root_certificates) if root_certificates else None)
        self.env = base_env(self.home)

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


def _probe_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


class LocalSuperLink:
    """``flower-superlink`` on a free loopback port with an isolated FLWR_HOME.

    ``with LocalSuperLink() as sl: submit_run(app, sl, ...)``. Attributes: ``home``
    (FLWR_HOME), ``port``, ``address`` (``host:port``), ``connection`` (its name in
    ``$FLWR_HOME/config.toml``), ``env`` (for ``flwr`` subprocesses), ``log_file``,
    ``output_file`` (stdout/stderr of the SuperLink and all it spawns), ``tag``.
    ``cwd`` (attribute ``server_cwd``; default: the caller's cwd) is the working directory
    of the SuperLink and so of the ServerApp and simulated ClientApps; the ``cwd`` property
    is where ``flwr`` commands run (FLWR_HOME). On exit every process of this instance is
    stopped (``processes.stop``: SIGTERM, SIGKILL after ``shutdown_timeout``).
    """

    def __init__(self, *, simulation: bool = True, host: str = "127.0.0.1", port: int | None = None,
                 flwr_home: str | os.PathLike[str] | None = None, connection: str = "local-sim",
                 database: str | None = None, cwd: str | os.PathLike[str] | None = None,
                 isolation: str = "subprocess", startup_timeout: float = 60.0, shutdown_timeout: float = 10.0,
                 keep_home: bool = False, extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None):
        self.simulation = simulation
        self.host = host
        self._port_fixed = port is not None
        self.port = port if port is not None else free_port(_probe_host(host))
        self._own_home = flwr_home is None
        self.home = _new_home(flwr_home)
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
        self.env = base_env(self.home)
        if env:
            self.env.update(env)
        self.process: subprocess.Popen[bytes] | None = None
        self._out_fh: IO[bytes] | None = None
        write_flower_config(self.home, connection, self.address)

    @property
    def address(self) -> str:
        return f"{_probe_host(self.host)}:{self.port}"

    @property
    def cwd(self) -> Path:
        """Working directory for ``flwr`` CLI commands (never an app directory)."""
        return self.home

    def command(self) -> list[str]:
        cmd = [exe("flower-superlink"), "--insecure"]
        if self.simulation:
            cmd.append("--simulation")
        return [*cmd, "--isolation", self.isolation, "--host", self.host, "--port", str(self.port),
                "--database", self.database, "--log-file", str(self.log_file),
                "--disable-runtime-dependency-installation", *self.extra_args]

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
                self.port = free_port(_probe_host(self.host))  # lost the port race: retry
                write_flower_config(self.home, self.connection, self.address)
        return self

    def _start_once(self) -> None:
        self._out_fh = open(self.output_file, "ab")
        self.process = subprocess.Popen(self.command(), cwd=self.server_cwd, env={**self.env, TAG_VAR: self.tag},
                                        stdin=subprocess.DEVNULL, stdout=self._out_fh, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        url = f"http://{self.address}/health"
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SuperLinkStartError(
                    f"flower-superlink exited with code {self.process.returncode}:\n" + self.output_tail())
            try:
                with urllib.request.urlopen(url, timeout=1.0) as resp:
                    if 200 <= resp.status < 300:
                        return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.2)
        raise SuperLinkStartError(
            f"flower-superlink not healthy at {url} after {self.startup_timeout:.0f}s:\n" + self.output_tail())

    def is_running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def output_tail(self, lines: int = 40) -> str:
        try:
            return tail(self.output_file.read_text(errors="replace"), lines)
        except OSError:
            return ""

    def _terminate(self) -> None:
        stop(self.process, tag=self.tag, timeout=self.shutdown_timeout)
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
