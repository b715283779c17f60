"""A closed control plane on separate hosts (network namespaces): the SuperLink listens on the
server host's loopback only and nginx (server/deploy/start_proxy.sh) exposes its Fleet API and
nothing else. An outsider host holding ``ca.crt`` can neither register a SuperNode nor submit a
run -- not through the proxy (404 for every non-Fleet path, 401 from the SuperLink for Fleet
calls it cannot sign, refused for an unregistered key) and not at the SuperLink's port
(connection refused) -- while the operator on the server host registers three SuperNodes,
which train through the proxy, and a full run completes with the simulation's model.

Skipped, with the reason, where network namespaces cannot be created or nginx is missing.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from deploy_support import DEPLOY_CONFIG, assert_same_weights, needs_openssl, netns_list, reference_run, tcp_peers

from simulations.flower.cli import FlowerCliError, flwr_json
from simulations.flower.deploy import REPO, Deployment
from simulations.flower.netns import Namespaces
from simulations.flower.superlink import ExistingSuperLink
from tasks.runs.results import read_results

REASON = Namespaces.unavailable_reason()
NGINX = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")
pytestmark = [needs_openssl, pytest.mark.realproc,
              pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}"),
              pytest.mark.skipif(NGINX is None, reason="nginx is not installed (apt-get install nginx)")]

# One HTTPS request per (method, raw path), verified against ca.crt; prints [status or error].
PROBE = """
import http.client, json, ssl, sys
host, port, ca, requests = sys.argv[1], int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
ctx = ssl.create_default_context(cafile=ca)
out = []
for method, path in requests:
    conn = http.client.HTTPSConnection(host, port, context=ctx, timeout=20)
    try:
        conn.request(method, path, body=b"", headers={"Content-Type": "application/protobuf"})
        out.append(conn.getresponse().status)
    except OSError as exc:
        out.append(type(exc).__name__)
    finally:
        conn.close()
print(json.dumps(out))
"""

# What an outsider sends straight to the proxy: every non-Fleet API, and tricks to reach one.
RAW = [("POST", "/v1/control/register-node"), ("POST", "/v1/control/start-run"),
       ("POST", "/v1/control/list-runs"), ("POST", "/v1/runtime/get-nodes"), ("GET", "/docs"),
       ("GET", "/openapi.json"), ("GET", "/health"), ("POST", "/v1/fleet/../control/start-run"),
       ("POST", "/v1/fleet/%2e%2e/control/start-run"), ("POST", "/v1/fleet//get-run"),
       ("POST", "/v1/fleet/get-run?x=/v1/control"), ("GET", "/v1/fleet/get-run"),
       ("POST", "/v1/fleet/register-node"), ("POST", "/v1/fleet/get-run")]
EXPECTED = [404] * 11 + [403, 401, 401]  # 403: only POST; 401: the SuperLink's SuperNode authentication


def probe(ns: str, host: str, port: int, ca: str, requests: list[tuple[str, str]]) -> list:
    res = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", PROBE, host, str(port), ca,
                          json.dumps(requests)], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(res.stdout)


def refused(args: list[str], who: ExistingSuperLink) -> str:
    """The error line of a ``flwr`` command that must fail (pytest fails if it succeeds)."""
    with pytest.raises(FlowerCliError) as info:
        flwr_json(args, who, timeout=120)
    text = str(info.value)
    return next((line for line in text.splitlines() if "Client error" in line or "unavailable" in line), text)


def test_an_outsider_can_neither_register_nor_submit_while_the_operator_runs(tmp_path):
    config = {**DEPLOY_CONFIG, "num-clients": 3, "num-rounds": 1}
    reference = reference_run(tmp_path / "sim", **{"num-clients": 3, "num-rounds": 1})
    results = tmp_path / "results"
    hosts = Namespaces(num_clients=4)  # hosts 0-2: the operator's SuperNodes; host 3: the outsider
    outsider_ns = hosts.clients[3]
    tried: list[tuple[str, str, str]] = []
    try:
        with hosts, Deployment(tmp_path / "dep", num_keys=4, netns=hosts, proxy=True) as d:
            d.start_superlink()
            d.start_proxy()
            ca, stranger_key = str(d.certs / "ca.crt"), str(d.certs / "supernode-3.pub")
            via_proxy = ExistingSuperLink(d.address, insecure=False, root_certificates=ca, connection="proxy",
                                          flwr_home=tmp_path / "outsider-proxy", command_prefix=hosts.prefix(outsider_ns))
            direct = ExistingSuperLink(f"{hosts.server_ip}:{d.link_port}", insecure=False, root_certificates=ca,
                                       connection="direct", flwr_home=tmp_path / "outsider-direct",
                                       command_prefix=hosts.prefix(outsider_ns))

            # the outsider, with ca.crt and its own key pair, through the proxy and at the SuperLink's port
            for who, where in ((via_proxy, "proxy"), (direct, "SuperLink port")):
                err = refused(["supernode", "register", stranger_key, who.connection], who)
                tried.append(("outsider", f"flwr supernode register ({where})", err))
                err_run = refused(["run", str(REPO), who.connection], who)
                tried.append(("outsider", f"flwr run ({where})", err_run))
                if who is via_proxy:
                    assert "404 Not Found" in err and "/v1/control/register-node" in err, err
                    assert "404 Not Found" in err_run and "/v1/control/start-run" in err_run, err_run
                else:  # nothing listens there outside the server's loopback
                    assert "Connection to the SuperLink is unavailable" in err, err
                    assert "Connection to the SuperLink is unavailable" in err_run, err_run
            codes = probe(outsider_ns, hosts.server_ip, d.port, ca, RAW)
            tried += [("outsider", f"{m} {p} (proxy)", str(c)) for (m, p), c in zip(RAW, codes, strict=True)]
            assert codes == EXPECTED, list(zip(RAW, codes, strict=True))
            direct_codes = probe(outsider_ns, hosts.server_ip, d.link_port, ca, RAW[:2])
            tried += [("outsider", f"{m} {p} (SuperLink port)", str(c)) for (m, p), c in zip(RAW, direct_codes)]
            assert direct_codes == ["ConnectionRefusedError"] * 2, direct_codes
            # a SuperNode with the outsider's unregistered key, claiming partition 0, through the proxy
            stranger = d.start_supernode(3, partition=0, num_partitions=3, name="stranger")
            assert stranger.wait_exit(120) != 0
            assert "Failed to activate SuperNode" in stranger.output(), stranger.tail()
            tried.append(("outsider", "SuperNode, unregistered key, partition 0 (proxy)", "Failed to activate SuperNode"))

            # the operator, on the server host: registers three SuperNodes, which train through the proxy
            registered = {d.register(i) for i in range(3)}
            for i in range(3):
                d.start_supernode(i, partition=i, num_partitions=3)
            code, out, run = d.submit({**config, "results-dir": str(results), "run-name": "closed"}, 300)
            assert code == 0, out
            assert run["status"] == "finished:completed"
            tried.append(("operator", "register 3 SuperNodes, submit.sh (server host)", run["status"]))
            assert set(d.node_status()) == registered  # the outsider never became a node
            # SuperNodes reach the proxy from their own addresses; only the proxy (loopback) reaches the SuperLink
            assert {hosts.client_ip(i) for i in range(3)} <= tcp_peers(hosts.server, d.port)
            assert tcp_peers(hosts.server, d.link_port) <= {"127.0.0.1"}
        assert d.leftover() == {}
    finally:
        hosts.delete()
        print("\n".join(f"{actor:9} | {what:58} | {outcome.splitlines()[-1][:160]}" for actor, what, outcome in tried))
    assert hosts.tag not in netns_list()
    assert_same_weights(results / "closed", reference)
    _, rows = read_results(results / "closed" / "results.jsonl")
    assert [r["round"] for r in rows] == [0, 1] and rows[1]["failed-nodes"] == []
