"""simulations/replay.py: which clients missed which rounds, read from a run's rows; the in-process
replay of a run with exactly those failures ends with its model, bit for bit (also across a resume);
rows lost or held twice are counted. The deployed version is the soak (benchmarks/soak.py)."""

from __future__ import annotations

import pytest
from deploy_support import DEPLOY_CONFIG, reference_run

from simulations.replay import missed_rounds, model_differences, offline_rounds, replay, row_accounting
from tasks.runs.results import read_results

CASE = {**DEPLOY_CONFIG, "num-clients": 3, "num-rounds": 4, "min-replies": 1, "checkpoint-every": 1}


def test_failures_are_read_from_the_rows():
    rows = [{"round": 0}, {"round": 1, "failed-nodes": [2]}, {"round": 2, "failed-nodes": []},
            {"round": 3, "failed-nodes": [0, 2]}]
    assert missed_rounds(rows) == {2: {1, 3}, 0: {3}}
    with pytest.raises(ValueError, match=r"round 1: failed client 'node 1002' has no partition id"):
        missed_rounds([{"round": 1, "failed-nodes": ["node 1002"]}])


def test_rows_lost_and_duplicated_are_counted():
    assert row_accounting([{"round": k} for k in range(4)], 3) == {
        "rows-lost": 0, "rows-duplicated": 0, "lost-rounds": [], "duplicated-rounds": []}
    counted = row_accounting([{"round": k} for k in (0, 1, 1, 3, 3, 3, 5)], 4)
    assert counted == {"rows-lost": 2, "rows-duplicated": 4, "lost-rounds": [2, 4], "duplicated-rounds": [1, 3, 5]}


def test_a_faulty_resumed_run_replays_to_its_model_bit_for_bit(tmp_path):
    """Rounds 1-2 with client 1 failing in round 2, stopped; resumed for rounds 3-4 with clients 0 and 2
    failing in round 4 (the rows of both parts tell): the replay from the rows alone equals it."""
    folder = reference_run(tmp_path / "run", failures={1: {2}}, **{**CASE, "num-rounds": 2})
    reference_run(tmp_path / "run", failures={0: {4}, 2: {4}}, **{**CASE, "resume": True})
    _, rows = read_results(folder / "results.jsonl")
    assert missed_rounds(rows) == {1: {2}, 0: {4}, 2: {4}} and rows[3]["resumed-from-round"] == 2
    assert row_accounting(rows, 4)["rows-lost"] == row_accounting(rows, 4)["rows-duplicated"] == 0
    again = replay(folder, tmp_path / "replay")
    assert model_differences(folder, again) == {}
    assert [r["failed-nodes"] for r in read_results(again / "results.jsonl")[1][1:]] == [[], [1], [], [0, 2]]
    # the check can fail: the same run without its failures is another model
    clean = reference_run(tmp_path / "clean", **CASE)
    assert model_differences(folder, clean)


def test_a_client_offline_when_a_round_starts_is_replayed_as_not_asked(tmp_path):
    """Found by the soak: a client whose node is offline when a round starts is never asked, so the
    server's uniform weights are 1/2, renormalised over 2 replies; a client asked that fails leaves
    weights of 1/3 renormalised over the same 2: the same replies average to other bits. The rows
    tell the two apart, and the replay asks exactly whom the run asked."""
    offline = reference_run(tmp_path / "offline", offline={1: {2}}, **{**CASE, "checkpoint-every": 0})
    failed = reference_run(tmp_path / "failed", failures={1: {2}}, **{**CASE, "checkpoint-every": 0})
    _, rows = read_results(offline / "results.jsonl")
    assert rows[2]["failures"] == ["partition 1: offline (not online when the round started)"]
    assert offline_rounds(rows) == {1: {2}} and missed_rounds(rows) == {1: {2}}
    assert model_differences(offline, failed)  # the mechanism: the same replies, other weights, other bits
    assert model_differences(offline, replay(offline, tmp_path / "replay")) == {}
