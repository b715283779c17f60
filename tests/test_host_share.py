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
