"""A real secure deployment on loopback: a SuperLink and two SuperNodes from the scripts in
server/deploy/, with TLS and SuperNode authentication, run the default task to completion
and end with the simulation's model; an unregistered SuperNode is refused; a failed run
is reported as failed; insecure mode needs an explicit flag and warns.

Every process is stopped by the Deployment context (also on failure); every wait is bounded.
"""

from __future__ import annotations

import subprocess

import pytest
from deploy_support import DEPLOY_CONFIG, assert_same_weights, needs_openssl, reference_run

from simulations.flower.deploy import DEPLOY, Deployment, free_port
from tasks.runs.results import read_results

pytestmark = [needs_openssl, pytest.mark.realproc]


def test_secure_run_matches_the_simulation_and_refuses_strangers(tmp_path):
    reference = reference_run(tmp_path / "sim")
    results = tmp_path / "results"
    with Deployment(tmp_path / "dep", num_keys=3) as d:
        d.start_superlink()
        registered = {d.register(0), d.register(1)}
        # key 2 was created but never registered: the SuperLink refuses that SuperNode
        stranger = d.start_supernode(2, partition=1, num_partitions=2, name="stranger",
                                     options=["--rejoin-retries", "1", "--rejoin-delay", "1"])
        for i in range(2):
            d.start_supernode(i, partition=i, num_partitions=2)
        code, out, run = d.submit({**DEPLOY_CONFIG, "results-dir": str(results), "run-name": "deployed"}, 240)
        assert code == 0, out
        assert run["status"] == "finished:completed"
        assert stranger.wait_exit(60) != 0
        assert stranger.output().count("Failed to activate SuperNode") == 2  # refused, retried once, refused
        assert "retry 1/1" in stranger.output()
        assert set(d.node_status()) == registered  # the stranger never became a node

        # a run whose ServerApp fails is reported as failed (flwr run itself exits 0)
        code, out, run = d.submit({**DEPLOY_CONFIG, "lr": -1.0, "results-dir": str(results), "run-name": "bad"}, 120)
        assert code == 1, out
        assert run["status"] == "finished:failed" and "ended with status finished:failed" in out
        assert "lr must be a finite number > 0" in out  # the run's log reached the operator
    assert d.leftover() == {}  # SuperLink, SuperNodes, SuperExecs, ServerApps, ClientApps: all gone
    assert_same_weights(results / "deployed", reference)
    _, rows = read_results(results / "deployed" / "results.jsonl")
    assert [r["round"] for r in rows] == [0, 1, 2] and all(r["failed-nodes"] == [] for r in rows[1:])


def test_a_host_serves_several_partitions_like_one_node_each(tmp_path):
    """A silo: 2 SuperNodes (--num-partitions 2) serve the run's 4 clients, 2 each (node i:
    clients i and i + 2, one executor call); the model is the one of 4 single-client nodes."""
    reference = reference_run(tmp_path / "sim", **{"num-clients": 4})
    results = tmp_path / "results"
    with Deployment(tmp_path / "dep", num_keys=2) as d:
        d.start_superlink()
        for i in range(2):
            d.register(i)
            d.start_supernode(i, partition=i, num_partitions=2)
        code, out, run = d.submit({**DEPLOY_CONFIG, "num-clients": 4, "results-dir": str(results),
                                   "run-name": "silos"}, 240)
        assert code == 0, out
        assert run["status"] == "finished:completed"
    assert d.leftover() == {}
    assert_same_weights(results / "silos", reference)
    _, rows = read_results(results / "silos" / "results.jsonl")
    assert rows[-1]["replies"] == 4 and rows[-1]["failed-nodes"] == []


def test_scripts_refuse_to_run_insecure_by_accident(tmp_path):
    def script(name, *args):
        return subprocess.run(["bash", str(DEPLOY / name), *args], capture_output=True, text=True, timeout=30,
                              cwd=tmp_path, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})

    res = script("start_superlink.sh")
    assert res.returncode == 2 and "--certs DIR is required (or --insecure" in res.stderr
    res = script("start_superlink.sh", "--certs", str(tmp_path))
    assert res.returncode == 2 and "ca.crt is missing: run make_certs.sh" in res.stderr
    res = script("start_supernode.sh", "--superlink", "127.0.0.1:9093", "--partition", "0", "--num-partitions", "2")
    assert res.returncode == 2 and "--ca FILE" in res.stderr
    res = script("start_supernode.sh", "--superlink", "x:1", "--partition", "2", "--num-partitions", "2")
    assert res.returncode == 2 and "--partition must be < --num-partitions" in res.stderr


def test_insecure_mode_warns(tmp_path):
    with Deployment(tmp_path, insecure=True, port=free_port()) as d:
        d.start_superlink()
        assert "TLS and SuperNode authentication are OFF" in d.superlink.output()
    assert d.leftover() == {}


def test_make_certs_is_idempotent_and_keys_are_private(tmp_path):
    run = lambda *a: subprocess.run(["bash", str(DEPLOY / "make_certs.sh"), "-o", str(tmp_path), *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=60, check=True)
    run("-s", "10.0.0.5", "-s", "server.example", "-n", "1")
    ca = (tmp_path / "ca.crt").read_bytes()
    run("-n", "2")  # adds supernode-1, keeps the CA and the server certificate
    assert (tmp_path / "ca.crt").read_bytes() == ca and (tmp_path / "supernode-1.pub").exists()
    for key in ("ca.key", "server.key", "supernode-0", "supernode-1"):
        assert (tmp_path / key).stat().st_mode & 0o777 == 0o600, key
    text = subprocess.run(["openssl", "x509", "-in", str(tmp_path / "server.crt"), "-noout", "-text"],
                          capture_output=True, text=True, timeout=30, check=True).stdout
    assert "IP Address:10.0.0.5" in text and "DNS:server.example" in text and "IP Address:127.0.0.1" in text
    verify = subprocess.run(["openssl", "verify", "-CAfile", str(tmp_path / "ca.crt"), str(tmp_path / "server.crt")],
                            capture_output=True, text=True, timeout=30)
    assert verify.returncode == 0
    assert (tmp_path / "supernode-0.pub").read_text().startswith("ecdsa-sha2-nistp384 ")
