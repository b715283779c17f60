"""Shared by tests/test_deploy_*.py: the run config of deployed test runs and the
in-process reference (the real ServerApp and ClientApp on the loopback grid: the code
path of a simulation, without Ray) they must match bit for bit; ``FaultyGrid`` (planted
failures) lives in ``simulations.loopback``."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from client.app import app as client_app
from server.app import app as server_app
from simulations.loopback import FaultyGrid, run_server_app
from tasks.config import RunConfig
from tasks.runs.results import load_weights

# Small and fast: a round costs ~10-15 s of Flower process spawning on 2 cores anyway.
DEPLOY_CONFIG = {"num-clients": 2, "num-rounds": 2, "local-steps": 2, "batch-size": 16, "device": "cpu",
                 "node-wait": 60.0, "round-timeout": 90.0}

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")


def reference_run(folder: Path, failures: dict[int, set[int]] | None = None,
                  offline: dict[int, set[int]] | None = None, **overrides) -> Path:
    """The in-process run of DEPLOY_CONFIG (+ overrides); its results folder."""
    values = {**RunConfig().to_mapping(), **DEPLOY_CONFIG, "results-dir": str(folder), "run-name": "reference",
              **overrides}
    grid = FaultyGrid(client_app, values, values["num-clients"], failures=failures or {}, offline=offline)
    run_server_app(server_app, grid)
    return folder / "reference"


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_weights(a / "model.pt"), load_weights(b / "model.pt")
    assert list(wa) == list(wb)
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"weights differ in {different}"


def netns_list() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout


def tcp_peers(ns: str, port: int) -> set[str]:
    """Remote IPv4 addresses of established TCP connections to ``port`` inside namespace ``ns``."""
    text = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/tcp"], capture_output=True, text=True,
                          timeout=20, check=True).stdout
    peers = set()
    for line in text.splitlines()[1:]:
        local, remote, state = line.split()[1:4]
        if state == "01" and int(local.split(":")[1], 16) == port:
            ip = bytes.fromhex(remote.split(":")[0])[::-1]
            peers.add(".".join(str(b) for b in ip))
    return peers
