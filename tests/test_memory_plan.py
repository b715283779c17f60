"""server.memory: what a round needs on every host, by hand; a round that cannot fit is refused before
round 1 with the model's size, the needs and the budget; what fits better is named."""

from __future__ import annotations

import json

import pytest

from server.memory import CLIENT_MODEL, LINK_DOWN, LINK_UP, NODE_COPIES, REPLY, SERVER_MODEL, MemoryPlanError, check, needs
from simulations.loopback import run_in_process
from tasks.host import available_memory, host_id, parse_bytes

MB = 10**6


def test_needs_by_hand():
    plan = {n.process: n.bytes for n in needs(100 * MB, {1: 4, 2: 4}, node_sums=False, transport="float32",
                                               server_host=7, node_host={1: 7, 2: 7})}
    assert plan["ServerApp"] == SERVER_MODEL * 100 * MB + REPLY * 800 * MB  # 8 client models held
    assert plan["SuperLink"] == LINK_DOWN * 2 * 100 * MB + LINK_UP * 800 * MB  # the model down to 2 nodes, 8 up
    assert plan["SuperNode 1"] == NODE_COPIES * (100 + 400) * MB + 100 * MB
    assert plan["ClientApp 2"] == CLIENT_MODEL * 4 * 100 * MB + 2 * (100 + 400) * MB


def test_node_sums_and_a_lossy_transport_shrink_the_replies():
    summed = {n.process: n.bytes for n in needs(100 * MB, {1: 4, 2: 4}, node_sums=True, transport="bfloat16",
                                                 server_host=None, node_host={})}
    assert summed["ServerApp"] == SERVER_MODEL * 100 * MB + REPLY * 200 * MB  # one sum a node
    assert summed["SuperLink"] == LINK_DOWN * 2 * 50 * MB + LINK_UP * (50 + 50) * MB  # half the bytes on the wire
    assert summed["SuperNode 1"] == NODE_COPIES * (50 + 50) * MB + 50 * MB


def test_a_host_too_small_is_refused_with_the_size_the_needs_and_what_fits():
    args = dict(node_sums=False, transport="float32", server_host=7, node_host={1: 7, 2: 7}, clients=8)
    check(100 * MB, {1: 4, 2: 4}, server_memory=10**12, node_memory={1: 10**12, 2: 10**12}, **args)  # fits
    with pytest.raises(MemoryPlanError) as err:
        check(100 * MB, {1: 4, 2: 4}, server_memory=10**12, node_memory={1: 3 * 10**9, 2: 10**12}, **args)
    text = str(err.value)
    assert "refused before round 1" in text and "100.0 MB model" in text and "3.00 GB available" in text
    assert "ServerApp" in text and "SuperNode 1" in text and "node-aggregation = true" in text
    assert 'transport = "bfloat16"' in text and "clients-per-round below 8" in text


def test_hosts_are_budgeted_apart_and_an_unknown_one_is_not_checked():
    plan = dict(node_sums=False, transport="float32", server_host=1, clients=8)
    # the server's host is big, each node's own host holds its SuperNode and ClientApp only
    check(100 * MB, {1: 4, 2: 4}, server_memory=10**12, node_host={1: 2, 2: 3},
          node_memory={1: 5 * 10**9, 2: 5 * 10**9}, **plan)
    with pytest.raises(MemoryPlanError):  # the same two nodes on the server's small host
        check(100 * MB, {1: 4, 2: 4}, server_memory=5 * 10**9, node_host={1: 1, 2: 1},
              node_memory={1: 5 * 10**9, 2: 5 * 10**9}, **plan)
    check(100 * MB, {1: 4, 2: 4}, server_memory=None, node_host={1: None, 2: None},
          node_memory={1: None, 2: None}, **plan)


def test_the_host_readings(monkeypatch):
    assert parse_bytes("24G") == 24 << 30 and parse_bytes("512") == 512 and parse_bytes("1.5MiB") == 3 << 19
    with pytest.raises(ValueError, match="CELGC_MEMORY_LIMIT must be a number of bytes"):
        parse_bytes("lots")
    monkeypatch.setenv("CELGC_MEMORY_LIMIT", "3G")
    assert available_memory() == 3 << 30
    assert host_id() is None or 0 <= host_id() < 2**48


def test_a_run_that_cannot_fit_stops_before_round_1(tmp_path, monkeypatch):
    monkeypatch.setenv("CELGC_MEMORY_LIMIT", "1M")
    with pytest.raises(MemoryPlanError, match=r"refused before round 1: a round of 4 clients of a 0\.1 MB model"):
        run_in_process({"num-clients": 4, "num-rounds": 2, "results-dir": str(tmp_path), "run-name": "small",
                        "device": "cpu"}, 2)
    rows = [json.loads(line) for line in (tmp_path / "small" / "results.jsonl").read_text().splitlines()] \
        if (tmp_path / "small" / "results.jsonl").exists() else []
    assert not [r for r in rows if r.get("kind") == "round" and r.get("round", 0) >= 1]


@pytest.mark.realproc
def test_flwr_run_that_cannot_fit_fails_before_round_1_with_the_reason(tmp_path, monkeypatch):
    """Through a real local SuperLink and Ray: the ServerApp's refusal is the run's failure cause."""
    from pathlib import Path

    from simulations.flower import LocalSuperLink, RunFailed, run_app

    monkeypatch.setenv("CELGC_MEMORY_LIMIT", "1M")  # inherited by the SuperLink, the simulation and its ServerApp
    root = Path(__file__).resolve().parents[1]
    (tmp_path / "superlink").mkdir()
    with LocalSuperLink(cwd=tmp_path / "superlink") as superlink:
        with pytest.raises(RunFailed) as info:
            run_app(root, {"num-clients": 4, "num-rounds": 2, "results-dir": str(tmp_path), "run-name": "small"},
                    {"num-supernodes": 2}, timeout=240, superlink=superlink)
    assert info.value.status == "finished:failed"
    assert "MemoryPlanError: refused before round 1: a round of 4 clients of a 0.1 MB model" in str(info.value)
