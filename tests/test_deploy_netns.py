"""Separate hosts: the SuperLink and each SuperNode in its own network namespace, joined by
veth pairs on a private subnet (10.231.0.0/24) that this test creates and removes. TLS and
SuperNode authentication on; the deployed run ends with the simulation's model.

Skipped, with the reason, where network namespaces cannot be created (not root, no
CAP_SYS_ADMIN, no iproute2).
"""

from __future__ import annotations

import pytest
from deploy_support import DEPLOY_CONFIG, assert_same_weights, needs_openssl, netns_list, reference_run, tcp_peers

from simulations.flower.deploy import Deployment
from simulations.flower.netns import Namespaces

REASON = Namespaces.unavailable_reason()
pytestmark = [needs_openssl, pytest.mark.realproc,
              pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}")]


def test_superlink_and_supernodes_on_separate_hosts(tmp_path):
    config = {**DEPLOY_CONFIG, "num-rounds": 1}
    reference = reference_run(tmp_path / "sim", **{"num-rounds": 1})
    results = tmp_path / "results"
    hosts = Namespaces(num_clients=2)
    try:
        with hosts, Deployment(tmp_path / "dep", num_keys=2, netns=hosts) as d:
            assert d.address.startswith("10.231.0.1:")
            d.start_superlink()
            for i in range(2):
                d.register(i)
                d.start_supernode(i, partition=i, num_partitions=2)
            code, out, run = d.submit({**config, "results-dir": str(results), "run-name": "hosts"}, 240)
            assert code == 0, out
            assert run["status"] == "finished:completed"
            # the SuperNodes talk to the SuperLink across the veths, from their own addresses
            peers = tcp_peers(hosts.server, d.port)
            assert {hosts.client_ip(0), hosts.client_ip(1)} <= peers, peers
        assert d.leftover() == {}
    finally:
        hosts.delete()
    assert hosts.tag not in netns_list()
    assert_same_weights(results / "hosts", reference)
