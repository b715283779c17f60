"""A secure Flower deployment on this machine, driven by the scripts next to this file.

``Deployment`` creates credentials (``make_certs.sh``), starts a SuperLink with TLS and
SuperNode authentication (``start_superlink.sh``), registers SuperNode keys
(``flwr supernode register``), starts SuperNodes (``start_supernode.sh``) and submits runs
(``submit.sh``) -- the commands of docs/DEPLOY.md, on one machine. With ``Namespaces`` the
SuperLink and every SuperNode run in their own network namespace on a private subnet, as
on separate hosts. With ``proxy=True`` the SuperLink listens on the server's loopback only
and SuperNodes reach its Fleet API through nginx (``start_proxy.sh``): the operator uses the
Control API from the server host, as docs/DEPLOY.md recommends. Every process started here
is stopped on exit (its process group, its descendants and everything carrying this
deployment's tag: SIGTERM, then SIGKILL),
including the ``flower-superexec``, ``flwr-serverapp`` and ``flwr-clientapp`` processes
Flower spawns and the warm ClientApp runner with its workers (``processes.stop``). Used by tests/test_deploy_*.py;
``python -m simulations.flower.deploy`` runs a demo federation.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from server.deploy.cli_json import parse_cli_json

from .cli import flwr_json, format_overrides
from .netns import Namespaces
from .processes import TAG_VAR, free_port, process_tree, signal_pids, stop, tail
from .superlink import ExistingSuperLink, base_env

__all__ = ["DEPLOY", "REPO", "DeployError", "Deployment", "Namespaces", "Proc", "free_port", "last_record"]

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "server" / "deploy"


class DeployError(RuntimeError):
    """A script or process of the deployment failed or did not become ready in time."""


class Proc:
    """One started script: its own process group, output in ``log``, bounded waits."""

    def __init__(self, name: str, cmd: Sequence[str], *, cwd: Path, env: Mapping[str, str], log: Path) -> None:
        self.name, self.cmd, self.log = name, list(cmd), log
        self._fh = open(log, "ab")
        self.popen = subprocess.Popen(self.cmd, cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL,
                                      stdout=self._fh, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, lines: int = 30) -> str:
        return tail(self.output(), lines)

    def wait_for(self, text: str, timeout: float) -> None:
        """Until ``text`` is in the output; DeployError if the process exits or time runs out."""
        deadline = time.monotonic() + timeout
        while text not in self.output():
            if not self.alive():
                raise DeployError(f"{self.name} exited with {self.popen.returncode} before {text!r}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise DeployError(f"{self.name}: no {text!r} within {timeout:g} s:\n{self.tail()}")
            time.sleep(0.2)

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise DeployError(f"{self.name} still running after {timeout:g} s:\n{self.tail()}") from None

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the whole process tree (its group and descendants): fault injection."""
        targets = process_tree([self.pid]) if self.alive() else {}
        if self.alive():
            try:
                os.killpg(self.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        signal_pids(targets, sig)

    def stop(self, timeout: float = 10.0) -> None:
        stop(self.popen, timeout=timeout)
        self._fh.close()


class Deployment:
    """Credentials, a SuperLink and SuperNodes under ``root``, started from the scripts.

    ``with Deployment(root, num_keys=2) as d: d.start_superlink(); d.register(0); ...``
    """

    def __init__(self, root: str | Path, *, num_keys: int = 2, netns: Namespaces | None = None,
                 port: int | None = None, insecure: bool = False, proxy: bool = False, state_file: bool = True) -> None:
        if proxy and insecure:
            raise ValueError("Deployment: proxy=True needs TLS (the proxy presents server.crt); drop insecure=True")
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.netns = netns
        self.insecure = insecure
        self.host = netns.server_ip if netns else "127.0.0.1"
        self.proxy = proxy
        self.state_file = state_file  # False: the SuperLink keeps its state in memory (start_superlink.sh's default)
        self.port = port or free_port()  # where SuperNodes connect: the SuperLink, or the proxy
        self.address = f"{self.host}:{self.port}"
        # the SuperLink's own port; behind the proxy it listens on the server's loopback only
        self.link_port = free_port() if proxy else self.port
        control = f"127.0.0.1:{self.link_port}" if proxy else self.address
        self.certs = self.root / "certs"
        self.tag = uuid.uuid4().hex
        self.procs: list[Proc] = []
        self.superlink: Proc | None = None
        self.nodes: dict[int, Proc] = {}
        if not insecure:
            self._script("make_certs.sh", "-o", str(self.certs), "-s", self.host, "-n", str(num_keys))
        self.operator = ExistingSuperLink(  # the operator's `flwr` CLI on the server host
            control, insecure=insecure, root_certificates=None if insecure else self.certs / "ca.crt",
            connection="celgc", flwr_home=self.root / "operator",
            command_prefix=netns.prefix(netns.server) if netns else (),
        )

    # --- processes -------------------------------------------------------------------
    def _env(self, home: Path) -> dict[str, str]:
        env = base_env(home)
        env[TAG_VAR] = self.tag
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        return env

    def _script(self, name: str, *args: str, timeout: float = 60) -> str:
        res = subprocess.run(["bash", str(DEPLOY / name), *args], capture_output=True, text=True, timeout=timeout,
                             env=self._env(self.root / "operator"))
        if res.returncode != 0:
            raise DeployError(f"{name} {' '.join(args)} exited {res.returncode}:\n{res.stdout}{res.stderr}")
        return res.stdout

    def _start(self, name: str, script: str, args: Sequence[str], ns: str | None, home: Path | None = None,
               env: Mapping[str, str] | None = None) -> Proc:
        home = home or self.root / name
        home.mkdir(parents=True, exist_ok=True)
        prefix = self.netns.prefix(ns) if self.netns and ns else []
        proc = Proc(name, [*prefix, "bash", str(DEPLOY / script), *args], cwd=home, env={**self._env(home), **(env or {})},
                    log=self.root / f"{name}.log")
        self.procs.append(proc)
        return proc

    def start_superlink(self, timeout: float = 60) -> Proc:
        """start_superlink.sh on ``port`` with a persistent database; waits until it serves.

        Called again after the SuperLink died, it restarts it on the same port, database and
        working directory (a restarted server host): registrations survive (``state_file``),
        SuperNodes reconnect.
        """
        # loopback behind the proxy; on namespaces without it, every interface (an open
        # Control API: start_superlink.sh warns)
        host = "127.0.0.1" if self.proxy else "0.0.0.0" if self.netns else self.host
        args = ["--host", host, "--port", str(self.link_port)]
        if self.state_file:
            args += ["--database", str(self.root / "superlink-state.db")]
        args += ["--insecure"] if self.insecure else ["--certs", str(self.certs)]
        name = "superlink" if self.superlink is None else f"superlink-{len(self.procs)}"
        self.superlink = self._start(name, "start_superlink.sh", args, self.netns.server if self.netns else None,
                                     home=self.root / "superlink")
        self.superlink.wait_for("Uvicorn running on", timeout)
        return self.superlink

    def start_proxy(self, timeout: float = 30) -> Proc:
        """start_proxy.sh on the server host: the Fleet API at ``address``, nothing else."""
        if not self.proxy:
            raise DeployError("start_proxy() needs Deployment(..., proxy=True)")
        args = ["--certs", str(self.certs), "--listen", self.address,
                "--upstream", f"127.0.0.1:{self.link_port}", "--run-dir", str(self.root / "proxy-run")]
        proc = self._start("proxy", "start_proxy.sh", args, self.netns.server if self.netns else None)
        proc.wait_for("start worker processes", timeout)
        return proc

    def register(self, i: int, timeout: float = 60) -> int:
        """``flwr supernode register supernode-i.pub``; the node id."""
        data = flwr_json(["supernode", "register", str(self.certs / f"supernode-{i}.pub"), self.operator.connection],
                         self.operator, timeout)
        return int(data["node-id"])

    def node_status(self, timeout: float = 60) -> dict[int, str]:
        data = flwr_json(["supernode", "ls", self.operator.connection], self.operator, timeout)
        return {int(n["node-id"]): n["status"] for n in data.get("nodes", [])}

    def start_supernode(self, i: int, *, key: int | None = None, partition: int | None = None,
                        num_partitions: int | None = None, local_data: str | Path | None = None,
                        options: Sequence[str] = (), extra: Sequence[str] = (), name: str | None = None,
                        env: Mapping[str, str] | None = None) -> Proc:
        """start_supernode.sh for host ``i`` (its own namespace, if any) with key ``key`` (default i);
        ``options`` go to the script (e.g. --rejoin-retries), ``extra`` to flower-supernode, ``env``
        into its environment (and its ClientApps')."""
        args = ["--superlink", self.address, "--port", str(free_port()), *options]
        if self.insecure:
            args.append("--insecure")
        else:
            args += ["--ca", str(self.certs / "ca.crt"), "--key", str(self.certs / f"supernode-{i if key is None else key}")]
        if local_data is not None:
            args += ["--local-data", str(local_data)]
        if partition is not None:
            args += ["--partition", str(partition)]
        if num_partitions is not None:
            args += ["--num-partitions", str(num_partitions)]
        if extra:
            args += ["--", *extra]
        proc = self._start(name or f"supernode-{i}", "start_supernode.sh", args,
                           self.netns.clients[i] if self.netns else None, env=env)
        self.nodes[i] = proc
        return proc

    def _submit_cmd(self, run_config: Mapping[str, Any] | Sequence[str], timeout: float, app: Path,
                    restarts: int = 0, restart_delay: float = 10.0) -> list[str]:
        more = ["--restarts", str(int(restarts)), "--restart-delay", f"{restart_delay:g}"] if restarts else []
        return [*self.operator.command_prefix, "bash", str(DEPLOY / "submit.sh"), "--app", str(app),
                "--connection", self.operator.connection, "--timeout", str(int(timeout)), "--poll", "1", *more,
                "--run-config", " ".join(format_overrides(run_config))]

    def submit(self, run_config: Mapping[str, Any] | Sequence[str], timeout: float = 300,
               app: Path = REPO, restarts: int = 0, restart_delay: float = 10.0) -> tuple[int, str, dict]:
        """submit.sh: (exit status, output, the last run's final record or {}); ``restarts``: submit.sh
        --restarts (a run that failed or whose ServerApp died is resumed, up to that many times)."""
        env = self._env(self.operator.home)
        try:
            res = subprocess.run(self._submit_cmd(run_config, timeout, app, restarts, restart_delay),
                                 capture_output=True, text=True, timeout=timeout + 90, env=env, cwd=self.operator.home,
                                 start_new_session=True)
        except subprocess.TimeoutExpired as exc:
            raise DeployError(f"submit.sh did not return within {timeout + 90:g} s") from exc
        return res.returncode, res.stdout + res.stderr, last_record(res.stdout)

    def submit_in_background(self, run_config: Mapping[str, Any] | Sequence[str], timeout: float = 300,
                             app: Path = REPO, restarts: int = 0, restart_delay: float = 10.0) -> Proc:
        """submit.sh as a process (stopped with the deployment); ``last_record(proc.output())``."""
        name = f"submit-{len(self.procs)}"
        proc = Proc(name, self._submit_cmd(run_config, timeout, app, restarts, restart_delay), cwd=self.operator.home,
                    env=self._env(self.operator.home), log=self.root / f"{name}.log")
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        """Stop every process started here (newest first), then whatever still carries the tag."""
        for proc in reversed(self.procs):
            proc.stop()
        stop(tag=self.tag, timeout=2.0)

    def leftover(self) -> dict[int, int]:
        """Live processes still carrying this deployment's tag (should be none after stop)."""
        return process_tree((), self.tag)

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def last_record(output: str) -> dict:
    """The run record submit.sh prints last (a JSON object line), {} if none."""
    try:
        record = parse_cli_json(output, last=True)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m simulations.flower.deploy",
        description="A secure deployment on this machine: certificates, a SuperLink with TLS and SuperNode "
                    "authentication, N registered SuperNodes, one run checked for success.")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--run-config", default="num-rounds=3 local-steps=4", help="overrides, TOML k=v")
    parser.add_argument("--proxy", action="store_true",
                        help="SuperLink on loopback, SuperNodes through nginx (start_proxy.sh): Fleet API only")
    parser.add_argument("--keep", help="keep the deployment's files in this folder")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--restarts", type=int, default=0,
                        help="submit.sh --restarts: resume a run that failed or whose ServerApp died, up to N times")
    ns = parser.parse_args(argv)
    if ns.restarts < 0:
        parser.error(f"--restarts must be an integer >= 0, got {ns.restarts}")
    root = Path(ns.keep) if ns.keep else Path(tempfile.mkdtemp(prefix="celgc-deploy-"))
    overrides = [f"num-clients={ns.nodes}", f"results-dir='{root / 'results'}'", "run-name='demo'", ns.run_config]
    try:
        with Deployment(root, num_keys=ns.nodes, proxy=ns.proxy) as d:
            d.start_superlink()
            if ns.proxy:
                d.start_proxy()
            for i in range(ns.nodes):
                d.register(i)
                d.start_supernode(i, partition=i, num_partitions=ns.nodes)
            code, out, _ = d.submit(overrides, ns.timeout, restarts=ns.restarts)
            print(out)
            return code
    finally:
        if not ns.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
