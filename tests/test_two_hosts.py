"""Two hosts for real: the engine under torchrun and a Flower simulation on a Ray cluster, each
spread over two Linux network namespaces joined by veths (``Namespaces(num_clients=2)``: its
two client namespaces are the hosts, 10.231.0.10 and 10.231.0.11; the bridge namespace is only
the switch). Nothing is reachable between the hosts but through the veths.

1. ``torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 10.231.0.10:PORT``
   once on each host (gloo over the veths): the one-process model to 1e-6, the same rows.
   ``--local-addr`` names each host's own address (else torchrun advertises the hostname,
   which resolves to the same loopback address in every namespace), ``--rdzv-conf
   is_host=...`` says which host serves the rendezvous store (torchrun's guess compares the
   endpoint with the hostname's addresses and misses the veth) and GLOO_SOCKET_IFNAME the
   veth gloo must use (without it gloo binds the hostname's address, 127.0.0.1 here, and
   fails: ``Gloo connectFullMesh failed ... Connection refused, remote=[127.0.0.1]:...``).
   Ranks follow the sorted node addresses, so host 0 (..10) is rank 0 and writes the results.
2. Flower's multi-node simulation: ``ray start --head`` on host 0, ``ray start --address`` on
   host 1, one CPU each, then the app through ``flwr run`` (``python -m simulations.flower``:
   a private SuperLink, pass/fail from the run status) on host 0 with RAY_ADDRESS set. One CPU
   per client, so Flower's pool has one actor per host; a ClientAppActor is seen running in
   host 1's namespace, and the model is the engine's, bit for bit.

Every process runs in one of the namespaces made here and carries a tag in its environment;
on the way out (failures included) every process in the namespaces and every tagged one is
stopped by pid (SIGTERM, then SIGKILL), then the namespaces are deleted. ``ray stop`` is
never used: it kills every Ray process of the user on the machine, namespaces or not. Each
Ray node has its own ``--temp-dir``, so ``ray_current_cluster`` (what ``ray.init()`` without
an address joins) is written there, not in the machine-wide default temp dir.

Skipped, with the reason, where network namespaces cannot be created (not root, no
CAP_SYS_ADMIN, no iproute2).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from deploy_support import netns_list

from simulations.flower import format_overrides
from simulations.flower.netns import Namespaces
from simulations.flower.processes import TAG_VAR, bin_dir, exe, live_pids, process_tree, stop, tail
from tasks.runs.results import read_results

REASON = Namespaces.unavailable_reason()
pytestmark = [pytest.mark.realproc,
              pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}")]

ROOT = Path(__file__).resolve().parents[1]
RDZV_PORT = 29400  # a fresh namespace has every port free: fixed ports, no race
RAY_PORT = 6379
SAMPLE_S = 0.3


class TwoHosts:
    """Hosts 0 and 1 (two network namespaces) and every process started in them: logs in
    ``logs``, one tag in every environment; ``close`` stops them all and deletes the
    namespaces; ``leftover`` is what survived (must be {})."""

    def __init__(self, folder: Path) -> None:
        self.ns = Namespaces(num_clients=2)
        self.tag = f"two-hosts-{uuid.uuid4().hex}"
        self.logs = folder / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        self.dirs: list[str] = []
        self.leftover: dict[int, int] = {}

    def host(self, i: int) -> str:
        return self.ns.clients[i]

    def ip(self, i: int) -> str:
        return self.ns.client_ip(i)

    def env(self, i: int, **extra: str) -> dict[str, str]:
        env = {**os.environ, "PYTHONPATH": str(ROOT), TAG_VAR: self.tag,
               "PATH": os.pathsep.join([str(bin_dir()), os.environ.get("PATH", "")]),
               "GLOO_SOCKET_IFNAME": self.ns.client_ifname(i), "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("RAY_ADDRESS", None)
        env.update(extra)
        return env

    def temp_dir(self, prefix: str) -> str:
        """A short private folder (Ray puts unix sockets under its temp dir: 107 bytes at most)."""
        path = tempfile.mkdtemp(prefix=prefix)
        self.dirs.append(path)
        return path

    def start(self, i: int, name: str, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        """``cmd`` on host i, in a session of its own, output to ``logs/NAME.log``."""
        with open(self.logs / f"{name}.log", "wb") as out:
            proc = subprocess.Popen([*self.ns.prefix(self.host(i)), *cmd], cwd=ROOT, env=env or self.env(i),
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def run(self, i: int, cmd: list[str], timeout: float, env: dict[str, str] | None = None):
        return subprocess.run([*self.ns.prefix(self.host(i)), *cmd], cwd=ROOT, env=env or self.env(i),
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)

    def log(self, name: str, lines: int = 40) -> str:
        try:
            return f"--- {name} ---\n" + tail((self.logs / f"{name}.log").read_text(errors="replace"), lines)
        except OSError:
            return f"--- {name}: no log ---"

    def pids_in(self, ns: str) -> set[int]:
        res = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=20)
        return {int(p) for p in res.stdout.split()} if res.returncode == 0 else set()

    def inside(self) -> dict[int, int]:
        """pid -> start time of every live process in the three namespaces (all ours)."""
        pids = set().union(*(self.pids_in(ns) for ns in [self.ns.server, *self.ns.clients]))
        return {p: s for p, s in live_pids().items() if p in pids}

    def tx_bytes(self, i: int) -> int:
        """Bytes host i has sent through its veth."""
        res = self.run(i, ["cat", f"/sys/class/net/{self.ns.client_ifname(i)}/statistics/tx_bytes"], 20)
        return int(res.stdout)

    def close(self) -> None:
        try:
            for proc in reversed(self.procs):  # the last started (a client of the others) first
                stop(proc, tag=self.tag, timeout=15.0)
            stop(pids={**self.inside(), **process_tree((), self.tag)}, timeout=10.0)
            self.leftover = {**self.inside(), **process_tree((), self.tag)}
        finally:
            self.ns.delete()
            for path in self.dirs:
                shutil.rmtree(path, ignore_errors=True)

    def __enter__(self) -> TwoHosts:
        try:
            self.ns.create()
        except BaseException:
            self.ns.delete()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tcp_peers(ns: str, port: int) -> set[str]:
    """Remote addresses of established TCP connections to or from ``port`` in namespace ``ns``,
    IPv6 sockets included (c10d's store and gRPC listen dual-stack: a peer on 10.231.0.11 is
    ::ffff:10.231.0.11 in /proc/net/tcp6, which deploy_support.tcp_peers does not read)."""
    text = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/tcp", "/proc/net/tcp6"], capture_output=True,
                          text=True, timeout=20).stdout
    peers = set()
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 4 or fields[3] != "01" or ":" not in fields[1]:  # 01: ESTABLISHED (headers skipped)
            continue
        local, remote = fields[1], fields[2]
        if port not in (int(local.rsplit(":", 1)[1], 16), int(remote.rsplit(":", 1)[1], 16)):
            continue
        raw = bytes.fromhex(remote.rsplit(":", 1)[0])
        raw = b"".join(raw[k:k + 4][::-1] for k in range(0, len(raw), 4))  # host-order 32-bit words
        ip = ipaddress.ip_address(raw)
        peers.add(str(ip.ipv4_mapped or ip) if isinstance(ip, ipaddress.IPv6Address) else str(ip))
    return peers


def wait_all(procs: list[subprocess.Popen], timeout: float, sample=None) -> float:
    """Wait (bounded) until every process has exited, calling ``sample()`` meanwhile; the seconds taken."""
    start = time.monotonic()
    for _ in range(int(timeout / SAMPLE_S) + 1):
        if all(p.poll() is not None for p in procs) or time.monotonic() - start > timeout:
            break
        if sample is not None:
            sample()
        time.sleep(SAMPLE_S)
    return time.monotonic() - start


def test_torchrun_on_two_hosts_gives_the_one_process_result(tmp_path, one_process):
    """3 clients on 2 hosts (2 + 1) vs all 3 in one process, as
    test_two_gloo_processes_give_the_one_process_result on one host."""
    keys = {"num-clients": 3, "num-rounds": 2, "local-steps": 3, "batch-size": 16, "device": "cpu",
            "results-dir": str(tmp_path)}
    overrides = " ".join(f"{k}={v}" for k, v in keys.items())
    peers: set[str] = set()
    with TwoHosts(tmp_path) as hosts:
        endpoint = f"{hosts.ip(0)}:{RDZV_PORT}"
        procs = [hosts.start(r, f"torchrun{r}", [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "two-hosts",
            "--rdzv-conf", f"is_host={'true' if r == 0 else 'false'},join_timeout=120", "--local-addr", hosts.ip(r),
            "--max-restarts", "0", "-m", "simulations.engine", "--config", str(ROOT / "pyproject.toml"), "--quiet",
            "--run-config", f"{overrides} run-name=two"], hosts.env(r, LOGLEVEL="INFO")) for r in range(2)]
        took = wait_all(procs, 300, lambda: peers.update(tcp_peers(hosts.host(0), RDZV_PORT)))
        logs = "\n".join(hosts.log(f"torchrun{r}") for r in range(2))
        assert [p.poll() for p in procs] == [0, 0], f"after {took:.0f} s\n{logs}"
        sent = [hosts.tx_bytes(r) for r in range(2)]
        rank_lines = [(hosts.logs / f"torchrun{r}.log").read_text(errors="replace") for r in range(2)]
    assert hosts.leftover == {}
    assert hosts.ns.tag not in netns_list()

    rows = one_process(tmp_path, "two", keys)
    model_bytes = read_results(tmp_path / "two" / "results.jsonl")[0]["model-bytes"]
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert rows[-1]["replies"] == 3 and rows[-1]["num-steps"] == 9

    # Across the veths: host 1 joined the rendezvous store on host 0 from its own address, the
    # hosts took ranks 0 and 1 by address, host 0's veth address the MASTER_ADDR, and each sent
    # more than a model's worth of bytes a round (the all-reduce of a float64 vector of the
    # parameters: twice the float32 model, half of it sent by each rank, twice).
    assert hosts.ip(1) in peers, peers
    for r in range(2):  # torchrun's INFO lines (LOGLEVEL=INFO): "Rendezvous complete for workers. Result: ..."
        for line in (f"master_addr={hosts.ip(0)}", f"group_rank={r}", "group_world_size=2"):
            assert re.search(rf"\]\s+{line}$", rank_lines[r], re.M), f"{line}\n{rank_lines[r][-3000:]}"
    assert min(sent) > keys["num-rounds"] * model_bytes, sent
    print(f"two-host torchrun: {took:.0f} s; veth tx bytes {sent}, model {model_bytes} bytes")


def ray_nodes(hosts: TwoHosts, address: str) -> int:
    """Active nodes of the cluster per ``ray status`` on host 0 (0 until it answers)."""
    try:
        res = hosts.run(0, [exe("ray"), "status", "--address", address], 60)
    except subprocess.TimeoutExpired:
        return 0
    active = res.stdout.split("Active:", 1)[-1].split("Pending:", 1)[0] if "Active:" in res.stdout else ""
    return sum(" node_" in line for line in active.splitlines())


def wait_for_nodes(hosts: TwoHosts, address: str, count: int, procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for _ in range(int(timeout) + 1):
        if ray_nodes(hosts, address) >= count:
            return
        dead = [p.returncode for p in procs if p.poll() is not None]
        assert not dead and time.monotonic() < deadline, \
            f"Ray cluster: not {count} nodes ({'exit codes ' + str(dead) if dead else f'after {timeout:.0f} s'})\n" + \
            hosts.log("ray-head") + "\n" + hosts.log("ray-node")
        time.sleep(1.0)


def test_flower_simulation_on_a_two_host_ray_cluster(tmp_path, runs):
    """`flwr run` of the app on a Ray cluster of host 0 (head) and host 1: completed, an actor on
    each host, and the engine's model bit for bit."""
    config = {**runs.BASE, "num-clients": 3, "num-rounds": 2, "local-steps": 2, "node-wait": 60.0}
    address = f"{Namespaces.SUBNET}.10:{RAY_PORT}"
    ray_common = ["--num-cpus", "1", "--num-gpus", "0", "--object-store-memory", "80000000",
                  "--disable-usage-stats", "--block"]
    ray = [exe("ray"), "start"]
    actors: dict[int, set[str]] = {0: set(), 1: set()}
    peers: set[str] = set()
    timings = {}
    with TwoHosts(tmp_path) as hosts:
        assert address == f"{hosts.ip(0)}:{RAY_PORT}"
        t0 = time.monotonic()
        head = hosts.start(0, "ray-head", [*ray, "--head", "--node-ip-address", hosts.ip(0), "--port", str(RAY_PORT),
                                           "--include-dashboard", "false", "--temp-dir", hosts.temp_dir("rh"), *ray_common])
        wait_for_nodes(hosts, address, 1, [head], 120)
        node = hosts.start(1, "ray-node", [*ray, "--address", address, "--node-ip-address", hosts.ip(1),
                                           "--temp-dir", hosts.temp_dir("rn"), *ray_common])
        wait_for_nodes(hosts, address, 2, [head, node], 120)
        timings["cluster"] = time.monotonic() - t0

        def sample() -> None:
            peers.update(tcp_peers(hosts.host(0), RAY_PORT))
            for i in (0, 1):
                for pid in hosts.pids_in(hosts.host(i)):
                    try:
                        argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    except OSError:
                        continue
                    if "ClientAppActor" in argv:
                        actors[i].add(argv.strip())

        run_config = {**config, "results-dir": str(tmp_path), "run-name": "flower"}
        cmd = [sys.executable, "-m", "simulations.flower", str(ROOT), "--timeout", "300",
               "--federation-config", "num-supernodes=3 client-resources-num-cpus=1"]
        for item in format_overrides(run_config):
            cmd += ["--run-config", item]
        flower = hosts.start(0, "flower", cmd, hosts.env(0, RAY_ADDRESS=address))
        timings["flower"] = wait_all([flower], 360, sample)
        log = hosts.log("flower", 80)
        assert flower.poll() == 0, f"exit {flower.poll()} after {timings['flower']:.0f} s\n{log}\n" + \
            hosts.log("ray-head") + "\n" + hosts.log("ray-node")
        out = (hosts.logs / "flower.log").read_text(errors="replace")
        run = json.loads(out.strip().splitlines()[-1])  # the wrapper's last line: the run's status
        alive_nodes = [p.poll() for p in (head, node)]
    assert hosts.leftover == {}
    assert hosts.ns.tag not in netns_list()

    assert run["status"] == "finished:completed", log
    assert alive_nodes == [None, None]  # both Ray nodes lived through the run
    assert hosts.ip(1) in peers, peers  # host 1's node talks to the head (GCS) across the veth
    # one CPU per Ray node and per client: the pool's two actors, one on each host (a private
    # local Ray, RAY_ADDRESS ignored, would have both on host 0)
    assert actors[1], f"no ClientAppActor seen in host 1's namespace\n{log}"
    assert actors[0], f"no ClientAppActor seen in host 0's namespace\n{log}"
    runs.same(runs.read("flower"), runs.engine("engine", "auto", **config), exact=True)
    print(f"two-host Ray: cluster up in {timings['cluster']:.0f} s, flwr run {timings['flower']:.0f} s; "
          f"actors on host 1: {sorted(actors[1])}; Ray's log prefix for host 1: {f'ip={hosts.ip(1)}' in out}")
