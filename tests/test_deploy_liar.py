"""A registered SuperNode that lies, on its own host (network namespace), TLS and SuperNode
authentication on: its owner changed its code (a ``sitecustomize`` that rewrites every train
reply, ``simulations.attacks``). A lie the checks can see (``num_batches_tracked`` = 2**63 - 1)
is rejected, the run completes and equals the in-process run in which that client failed; a lie
within every bound (the update sign-flipped at 0.999 I gamma) passes the checks, and with
``aggregation = "median"`` the deployed run equals the in-process run with the same liar.

Skipped, with the reason, where network namespaces cannot be created.
"""

from __future__ import annotations

import os

import pytest
from deploy_support import DEPLOY_CONFIG, FaultyGrid, assert_same_weights, needs_openssl

from client.app import app as client_app
from server.app import app as server_app
from simulations.attacks import LyingGrid
from simulations.flower.deploy import REPO, Deployment
from simulations.flower.netns import Namespaces
from simulations.loopback import run_server_app
from tasks.config import RunConfig
from tasks.runs.results import read_results

REASON = Namespaces.unavailable_reason()
pytestmark = [needs_openssl, pytest.mark.realproc,
              pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}")]

CONFIG = {**DEPLOY_CONFIG, "num-clients": 3, "num-rounds": 1, "min-replies": 2}
LIAR = 2

SITECUSTOMIZE = """\
from pathlib import Path

from simulations.attacks import install

install(lambda: Path({path!r}).read_text().strip())
"""


def in_process(folder, name, grid_cls, **kw):
    values = {**RunConfig().to_mapping(), **CONFIG, **kw.pop("config", {}), "results-dir": str(folder),
              "run-name": name}
    run_server_app(server_app, grid_cls(client_app, values, 3, **kw))
    return folder / name


def test_a_lying_supernode_is_rejected_or_outvoted(tmp_path):
    failed = in_process(tmp_path / "ref", "failed", FaultyGrid, failures={LIAR: {1}})
    outvoted = in_process(tmp_path / "ref", "outvoted", LyingGrid, attack="sign-flip", liars=[LIAR],
                          config={"aggregation": "median"})
    honest = in_process(tmp_path / "ref", "honest", FaultyGrid, failures={}, config={"aggregation": "median"})
    with pytest.raises(AssertionError, match="weights differ"):  # the lie moves the median (a little)
        assert_same_weights(honest, outvoted)
    liar_code = tmp_path / "liar-site"
    liar_code.mkdir()
    attack = liar_code / "attack"
    (liar_code / "sitecustomize.py").write_text(SITECUSTOMIZE.format(path=str(attack)))
    results = tmp_path / "results"
    hosts = Namespaces(num_clients=3)
    try:
        with hosts, Deployment(tmp_path / "dep", num_keys=3, netns=hosts) as d:
            d.start_superlink()
            for i in range(3):
                d.register(i)
                env = {"PYTHONPATH": os.pathsep.join([str(liar_code), str(REPO)])} if i == LIAR else None
                d.start_supernode(i, partition=i, num_partitions=3, env=env)
            attack.write_text("bn-count-max")
            code, out, run = d.submit({**CONFIG, "results-dir": str(results), "run-name": "rejected"}, 300)
            assert code == 0 and run["status"] == "finished:completed", out
            attack.write_text("sign-flip")
            code, out, run = d.submit({**CONFIG, "results-dir": str(results), "run-name": "outvoted",
                                       "aggregation": "median"}, 300)
            assert code == 0 and run["status"] == "finished:completed", out
        assert d.leftover() == {}
    finally:
        hosts.delete()
    _, rows = read_results(results / "rejected" / "results.jsonl")
    assert rows[1]["replies"] == 2 and rows[1]["rejected-replies"] == 1, rows[1]
    assert any(f.startswith(f"partition {LIAR}: rejected, features.1.num_batches_tracked is 9223372036854775807")
               for f in rows[1]["failures"]), rows[1]["failures"]
    assert_same_weights(results / "rejected", failed)
    _, rows = read_results(results / "outvoted" / "results.jsonl")
    assert rows[1]["replies"] == 3 and rows[1]["rejected-replies"] == 0  # the lie passes every check ...
    assert_same_weights(results / "outvoted", outvoted)  # ... and the median is the in-process run's
