"""The warm ClientApp runner (client/warm_runner.py) in a real secure deployment on loopback:
SuperNodes with Flower's ``--isolation process`` and the runner, as start_supernode.sh starts
them by default.

* two runs back to back on the same SuperNodes (CELGC, then SCAFFOLD with its per-client
  control variates) each equal the engine bit for bit, each served by a fresh worker per node
  (no state of the first run reaches the second), and every round of a run by the same one;
* a ClientApp that raises fails that message only (the round records it, the worker serves
  the next round); a worker that dies fails its message (the runner answers it with an Error
  reply naming the exit code) and the next round gets a new worker;
* SIGTERM to a SuperNode's script stops the SuperNode, the runner and its workers;
* the SuperNode and its runner share a fresh SuperExec secret (mode 600, removed at the end): an
  ``AcquireTask`` without it, or with another, is refused, so no other process of the host takes
  the node's tasks.

The deployed ClientApps run one torch thread each (``--threads 1``), as the engine here
(conftest): results depend on the thread count, so the comparison pins it.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import time
from pathlib import Path

import pytest
from deploy_support import DEPLOY_CONFIG, assert_same_weights, needs_openssl

from simulations.engine import EngineOptions, run_engine
from simulations.flower.deploy import REPO, Deployment
from simulations.flower.processes import process_tree
from tasks.config import RunConfig
from tasks.runs.results import read_results

pytestmark = [needs_openssl, pytest.mark.realproc]

CONFIG = {**DEPLOY_CONFIG, "num-rounds": 3}
WORKER = re.compile(r"Warm ClientApp runner: worker (\d+) for run (\d+)")

# Loaded at interpreter start on one SuperNode (its PYTHONPATH): its ClientApp raises in round 2
# and its process dies in round 3, as a task with a bug or a crashing library would.
FAULTY_SITE = """\
import os

import client.local_round as local_round

honest = local_round.client_round


def client_round(cfg, pids, exchange, *args, **kwargs):
    if exchange.settings.server_round == 2:
        raise ValueError("planted failure in round 2")
    if exchange.settings.server_round == 3:
        os._exit(3)
    return honest(cfg, pids, exchange, *args, **kwargs)


local_round.client_round = client_round
"""


def workers(proc) -> list[tuple[int, int]]:
    """(worker pid, run id) of every worker the SuperNode's runner forked, in order."""
    return [(int(a), int(b)) for a, b in WORKER.findall(proc.output())]


def engine_run(folder, name: str, **values) -> None:
    cfg = RunConfig.from_mapping({**RunConfig().to_mapping(), **CONFIG, **values, "results-dir": str(folder),
                                  "run-name": name})
    run_engine(cfg, EngineOptions(path="sequential"), show_progress=False)


def test_runs_back_to_back_equal_the_engine_and_share_no_state(tmp_path):
    results = tmp_path / "results"
    runs = {"celgc": {}, "scaffold": {"algorithm": "scaffold", "clip": "off", "lr": 0.1}}
    with Deployment(tmp_path / "dep", num_keys=2, state_file=False) as d:
        d.start_superlink()
        for i in range(2):
            d.register(i)
            d.start_supernode(i, partition=i, num_partitions=2, options=["--threads", "1"])
        for name, values in runs.items():
            code, out, run = d.submit({**CONFIG, **values, "results-dir": str(results), "run-name": name}, 300)
            assert code == 0 and run["status"] == "finished:completed", out
        nodes = list(d.nodes.values())
        forked = [workers(p) for p in nodes]
        commands = [cmdline(pid) for pid in process_tree([p.pid for p in nodes])]
        assert any("warm_runner.py" in c for c in commands) and not any("flower-superexec" in c for c in commands)
    for per_node in forked:  # one worker per run on each node, every round of the run by that worker
        assert len(per_node) == 2 and len({run for _, run in per_node}) == 2 and len({w for w, _ in per_node}) == 2
    for name, values in runs.items():
        engine_run(tmp_path / "engine", name, **values)
        assert_same_weights(results / name, tmp_path / "engine" / name)
        _, rows = read_results(results / name / "results.jsonl")
        assert [r["replies"] for r in rows[1:]] == [2, 2, 2]
    assert d.leftover() == {}


def test_a_failed_message_fails_alone_and_a_dead_worker_is_replaced(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(FAULTY_SITE)
    results = tmp_path / "results"
    config = {**CONFIG, "num-rounds": 4, "min-replies": 1, "round-timeout": 120.0, "results-dir": str(results),
              "run-name": "faulty"}
    with Deployment(tmp_path / "dep", num_keys=2, state_file=False) as d:
        d.start_superlink()
        for i in range(2):
            d.register(i)
            env = {"PYTHONPATH": os.pathsep.join([str(site), str(REPO)])} if i == 1 else None
            d.start_supernode(i, partition=i, num_partitions=2, options=["--threads", "1"], env=env)
        code, out, run = d.submit(config, 300)
        assert code == 0 and run["status"] == "finished:completed", out
        faulty, honest = workers(d.nodes[1]), workers(d.nodes[0])
        log = d.nodes[1].output()
    _, rows = read_results(results / "faulty" / "results.jsonl")
    assert [r["replies"] for r in rows[1:]] == [2, 1, 1, 2]
    assert rows[2]["failed-nodes"] == [1] and any("planted failure in round 2" in f for f in rows[2]["failures"])
    assert rows[3]["failed-nodes"] == [1] and any("the ClientApp's process died (exit code 3)" in f
                                                  for f in rows[3]["failures"]), rows[3]["failures"]
    assert "the ClientApp's process died (exit code 3)" in log
    # the exception left the worker serving (rounds 1-3 one worker); its death brought a new one for round 4
    assert len(faulty) == 2 and faulty[0][1] == faulty[1][1] and faulty[0][0] != faulty[1][0]
    assert len(honest) == 1


def test_sigterm_stops_the_supernode_its_runner_and_workers(tmp_path):
    results = tmp_path / "results"
    with Deployment(tmp_path / "dep", num_keys=1, state_file=False) as d:
        d.start_superlink()
        d.register(0)
        node = d.start_supernode(0, partition=0, num_partitions=1, options=["--threads", "1"])
        code, out, run = d.submit({**CONFIG, "num-clients": 1, "num-rounds": 1, "results-dir": str(results),
                                   "run-name": "one"}, 300)
        assert code == 0, out
        assert len(workers(node)) == 1
        tree = {pid: cmdline(pid) for pid in process_tree([node.pid])}
        assert any("warm_runner.py" in c for c in tree.values()) and any("flower-supernode" in c for c in tree.values())
        secret, address = connected_by_a_secret(tree)
        os.kill(node.pid, signal.SIGTERM)  # the script only: it must stop what it started
        assert node.wait_exit(30) == 143
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(pid) for pid in tree):
            time.sleep(0.2)
        assert not [cmd for pid, cmd in tree.items() if _alive(pid)]
        assert not secret.exists() and not secret.parent.exists()  # the script's fresh secret went with it


def connected_by_a_secret(tree: dict[int, str]) -> tuple[Path, str]:
    """The runner and the SuperNode name the same secret file (600, 32 random bytes); AcquireTask on the
    node's Runtime API is refused without it and with another one, and answered with it. (The secret
    file, the Runtime API address.)"""
    import httpx
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.constant import TaskType
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor, SuperExecAuthHttpInterceptor
    from flwr.supercore.retry.retry_invoker import RetryInvoker
    from flwr.supercore.runtime import RuntimeHttpClient

    from client.warm_runner import load_worker

    named = {re.search(r"--superexec-auth-secret-file (\S+)", c).group(1) for c in tree.values()
             if ("warm_runner.py" in c or "flower-supernode" in c) and "--superexec-auth-secret-file" in c}
    assert len(named) == 1, tree
    secret = Path(named.pop())
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and len(secret.read_bytes()) == 32
    address = next(re.search(r"--runtime-api-address (\S+)", c).group(1) for c in tree.values() if "warm_runner.py" in c)
    worker = load_worker()
    request = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])
    for key in (None, b"not the secret, 32 bytes long..."):  # a stranger on the host
        interceptors = [RuntimeVersionHttpInterceptor(component_name="SuperExec")]
        if key is not None:
            interceptors.append(SuperExecAuthHttpInterceptor(master_secret=key, protected_methods=frozenset(
                {"/flwr.proto.Runtime/AcquireTask"})))
        # no retries: Flower's own invoker answers a 401 by sending SIGINT to its process
        once = RetryInvoker(lambda: iter(()), (), max_tries=1, max_time=None)
        client = RuntimeHttpClient.from_server_address(server_address=address, insecure=True, root_certificates=None,
                                                       interceptors=interceptors, retry_invoker=once)
        try:
            with pytest.raises(httpx.HTTPStatusError, match="401 Unauthorized"):
                client.AcquireTask(request)
        finally:
            client.close()
    client = worker.Endpoint(address, True, None, secret.read_bytes()).client(max_tries=1)
    try:
        assert not client.AcquireTask(request).token  # answered: no task waits (the run is over)
    finally:
        client.close()
    return secret, address


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
