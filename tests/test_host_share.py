"""A deployed ClientApp's torch threads (client/host_share.py): N, or auto = the host's cores over
its SuperNodes, fixed for a run in the node's Context.state; unset: torch is left alone."""

from __future__ import annotations

import pytest
import torch
from flwr.app import Context, RecordDict

from client import host_share


def context() -> Context:
    return Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})


def test_the_setting_is_read_and_checked(monkeypatch):
    monkeypatch.setattr(host_share, "supernodes_on_host", lambda: 3)
    assert host_share.threads_wanted("4") == 4
    assert host_share.threads_wanted("auto", cores=8) == 2
    assert host_share.threads_wanted("auto", cores=2) == 1  # never 0
    assert host_share.threads_wanted("") is None
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(ValueError, match="CELGC_TORCH_THREADS must be an integer >= 1 or 'auto'"):
            host_share.threads_wanted(bad)


def test_a_run_keeps_its_thread_count_when_the_host_changes(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv(host_share.ENV, "auto")
        monkeypatch.setattr(host_share.os, "cpu_count", lambda: 4)
        nodes = {"n": 2}
        monkeypatch.setattr(host_share, "supernodes_on_host", lambda: nodes["n"])
        ctx = context()
        host_share.use_host_share(ctx)
        assert torch.get_num_threads() == 2 and dict(ctx.state[host_share.STATE_KEY]) == {"threads": 2}
        nodes["n"] = 1  # the other SuperNode of the host died: this run keeps 2 threads
        torch.set_num_threads(1)
        host_share.use_host_share(ctx)
        assert torch.get_num_threads() == 2
        host_share.use_host_share(fresh := context())  # a new run counts again
        assert torch.get_num_threads() == 4 and dict(fresh.state[host_share.STATE_KEY]) == {"threads": 4}
    finally:
        torch.set_num_threads(before)


def test_unset_leaves_torch_alone(monkeypatch):
    monkeypatch.delenv(host_share.ENV, raising=False)
    ctx = context()
    before = torch.get_num_threads()
    host_share.use_host_share(ctx)
    assert torch.get_num_threads() == before and host_share.STATE_KEY not in ctx.state


def test_auto_threads_follow_the_live_supernodes_and_the_thread_count_changes_the_bits(tmp_path, monkeypatch):
    """Why a deployed SCAFFOLD run once differed from the in-process one by 1e-7 (issue 38): its host's other
    SuperNode had died in the test before, so ``--threads auto`` on the 2-core host gave the run 2 torch
    threads (2 cores over 1 live SuperNode) instead of 1, and a CPU kernel splits its reductions by
    thread. The same run in process at 1 and 2 threads: different last bits, equal to float rounding."""
    from deploy_support import DEPLOY_CONFIG, reference_run

    from tasks.runs.results import load_weights

    live = {"n": 2}
    monkeypatch.setattr(host_share, "supernodes_on_host", lambda: live["n"])
    assert host_share.threads_wanted("auto", cores=2) == 1
    live["n"] = 1  # host 1's SuperNode was killed: host 0's next run counts only itself
    assert host_share.threads_wanted("auto", cores=2) == 2
    case = {**DEPLOY_CONFIG, "num-rounds": 3, "min-replies": 1, "algorithm": "scaffold", "clip": "off"}
    before, models = torch.get_num_threads(), {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            folder = reference_run(tmp_path / f"t{threads}", failures={1: {1, 2, 3}}, **case)  # host 1 offline
            models[threads] = load_weights(folder / "model.pt")
    finally:
        torch.set_num_threads(before)
    one, two = models[1], models[2]
    assert any(not torch.equal(one[k], two[k]) for k in one)  # the thread count is an input of the result
    for k in one:
        torch.testing.assert_close(one[k], two[k], rtol=1e-5, atol=1e-6)
