"""Time to accuracy under a network model (simulations/network.py) and its table in the comparison
(simulations/compare.py): hand-computed rounds and runs, the links' validation, and the compare tool on
small sweeps this file writes (no training)."""

import json

import pytest

from simulations import compare as compare_tool
from simulations import runner
from simulations.compare import compare, exchanges
from simulations.network import LINKS, Link, parse_links, read_links, round_seconds, run_seconds
from simulations.stats import summary

MOBILE = LINKS["mobile"]  # 10 Mbit/s down, 2 Mbit/s up, 50 ms


# --- the pure model, by hand ---------------------------------------------------------------------
def test_a_round_is_compute_plus_latency_per_exchange_plus_bytes_over_each_direction():
    # 1 MB down at 10 Mbit/s = 0.8 s; 0.5 MB up at 2 Mbit/s = 2 s; 2 exchanges x 2 x 50 ms = 0.2 s
    assert round_seconds(MOBILE, compute_s=0.25, exchanges=2, down_bytes=1e6, up_bytes=0.5e6) == pytest.approx(3.25)
    # the directions are not interchangeable: the same bytes the other way round
    assert round_seconds(MOBILE, compute_s=0.25, exchanges=2, down_bytes=0.5e6, up_bytes=1e6) == pytest.approx(4.85)
    dc = LINKS["datacenter"]  # 10 Gbit/s both ways, 0.1 ms: 8e6 bit / 1e10 bit/s = 0.8 ms each way
    assert round_seconds(dc, compute_s=0.0, exchanges=1, down_bytes=1e6, up_bytes=1e6) == pytest.approx(0.0018)
    assert round_seconds(dc, compute_s=1.5, exchanges=0, down_bytes=0, up_bytes=0) == 1.5
    with pytest.raises(ValueError, match="values >= 0"):
        round_seconds(dc, compute_s=-1.0, exchanges=1, down_bytes=0, up_bytes=0)


def test_a_run_sums_its_rounds_up_to_the_target_round_per_client():
    rows = [{"round": 0},  # the initial model: no round, no cost
            {"round": 1, "bytes-sent": 4e6, "bytes-received": 2e6},
            {"round": 2, "bytes-sent": 4e6, "bytes-received": 2e6},
            {"round": 3, "bytes-sent": 4e6, "bytes-received": 2e6}]
    # 4 clients: 1 MB down (0.8 s) and 0.5 MB up (2 s) each a round; 1 exchange (0.1 s); 8 steps of 5 ms (0.04 s)
    per_round = 0.04 + 0.1 + 0.8 + 2.0
    got = run_seconds(rows, MOBILE, until_round=2, step_seconds=0.005, local_steps=8, clients=4, exchanges=1)
    assert got == pytest.approx(2 * per_round)
    # no communication (one client): the compute alone, whatever bytes the rows count
    assert run_seconds(rows, MOBILE, until_round=3, step_seconds=0.005, local_steps=8, clients=1,
                       exchanges=0) == pytest.approx(3 * 0.04)
    with pytest.raises(ValueError, match="clients >= 1"):
        run_seconds(rows, MOBILE, until_round=3, step_seconds=0.005, local_steps=8, clients=0, exchanges=1)


def test_a_round_exchanges_the_methods_modes_and_one_client_none():
    assert exchanges({"algorithm": "celgc", "num-clients": 8}) == 1
    assert exchanges({"algorithm": "naive", "num-clients": 8}) == 1
    assert exchanges({"algorithm": "episode", "num-clients": 8}) == 2  # resampled gradients, then the round
    assert exchanges({"algorithm": "single", "num-clients": 1}) == 0
    with pytest.raises(ValueError, match="'nope'"):
        exchanges({"algorithm": "nope", "num-clients": 8})


# --- choosing links ------------------------------------------------------------------------------
def test_links_are_chosen_by_name_or_from_a_toml_file(tmp_path):
    assert [link.name for link in parse_links(None)] == ["datacenter", "cross-site", "mobile"]
    assert parse_links("none") == []
    assert [link.name for link in parse_links("mobile, datacenter")] == ["mobile", "datacenter"]
    f = tmp_path / "links.toml"
    f.write_text("[links.campus]\ndown-mbps = 100\nup-mbps = 40\nlatency-ms = 5\n")
    (campus,) = read_links(f)
    assert (campus.down_bps, campus.up_bps, campus.latency_s) == (100e6, 40e6, pytest.approx(0.005))
    assert [link.name for link in parse_links(f"datacenter,{f}")] == ["datacenter", "campus"]
    assert campus.describe() == "100 Mbit/s down, 40 Mbit/s up, 5 ms"


@pytest.mark.parametrize("body, message", [
    ("[links.x]\ndown-mbps = 1\nup-mbps = 1\n", "missing \\['latency-ms'\\]"),
    ("[links.x]\ndown-mbps = 1\nup-mbps = 1\nlatency-ms = 1\nloss = 0.1\n", "unknown \\['loss'\\]"),
    ("[links.x]\ndown-mbps = 0\nup-mbps = 1\nlatency-ms = 1\n", "down bandwidth must be a finite number > 0"),
    ("[links.x]\ndown-mbps = 1\nup-mbps = 1\nlatency-ms = -1\n", "latency must be a finite number >= 0"),
    ("[links.x]\ndown-mbps = \"fast\"\nup-mbps = 1\nlatency-ms = 1\n", "links.x.down-mbps must be a number"),
    ("[links.x]\ndown-mbps = nan\nup-mbps = 1\nlatency-ms = 1\n", "down bandwidth"),
    ("[other]\na = 1\n", "expected only \\[links.<name>\\] tables"),
    ("[links]\n", "expected only"),
    ("[links.x\n", "not valid TOML"),
    ("[links.\"9 bad\"]\ndown-mbps = 1\nup-mbps = 1\nlatency-ms = 1\n", "link name"),
])
def test_a_bad_links_file_is_refused_naming_what_is_wrong(tmp_path, body, message):
    f = tmp_path / "links.toml"
    f.write_text(body)
    with pytest.raises(ValueError, match=message):
        parse_links(str(f))


def test_bad_network_names_are_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown network 'satellite': known datacenter, cross-site, mobile"):
        parse_links("datacenter,satellite")
    with pytest.raises(ValueError, match="names no link"):
        parse_links(" , ")
    with pytest.raises(ValueError, match="does not exist"):
        parse_links(str(tmp_path / "missing.toml"))
    f = tmp_path / "mine.toml"
    f.write_text("[links.mobile]\ndown-mbps = 1\nup-mbps = 1\nlatency-ms = 1\n")
    with pytest.raises(ValueError, match="'mobile' is defined twice"):
        parse_links(f"mobile,{f}")
    with pytest.raises(ValueError, match="finite number > 0"):
        Link("x", float("inf"), 1.0, 0.0)


# --- through the compare tool, on sweeps written here ------------------------------------------------
CONFIG = {"task": "digits", "num-clients": 4, "clients-per-round": 0, "local-steps": 2, "num-rounds": 3,
          "partitioner": "homogeneous", "valid-fraction": 0.1}
MB = 1_000_000


def _sweep(results, name: str, algorithm: str, accuracy: dict[int, list[float]], wall: dict[int, float],
           up_per_client: float, **config) -> None:
    """A finished sweep of one grid point over the given seeds: 1 MB down and ``up_per_client`` up per
    client a round, ``accuracy[seed]`` at rounds 1..3, training wall-clock ``wall[seed]`` at the end."""
    runs = {}
    for seed, accs in accuracy.items():
        folder = results / f"{name}-lr=0.1-seed={seed}"
        folder.mkdir(parents=True)
        cfg = {**CONFIG, "algorithm": algorithm, "seed": seed, "lr": 0.1, **config}
        clients = cfg["clients-per-round"] or cfg["num-clients"]
        lines = [{"kind": "header", "config": cfg},
                 {"kind": "round", "round": 0, "test-accuracy": 0.1, "valid-accuracy": 0.1, "wall-clock": 0.0}]
        for r, acc in enumerate(accs, 1):
            lines.append({"kind": "round", "round": r, "communication-rounds": r, "bytes-sent": clients * MB,
                          "bytes-received": int(clients * up_per_client), "test-accuracy": acc, "valid-accuracy": acc,
                          "wall-clock": wall[seed] * r / 3})
        (folder / "results.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        runs[folder.name] = {"values": {"lr": 0.1}, "seed": seed, "stage": 1, "tuning-pass": False,
                             "elapsed": 1.0, "status": "ok"}
    manifest = {"kind": "sweep", "file": f"{name}.toml", "run-name": name, "grid": {"lr": [0.1]},
                "seeds": sorted(accuracy), "tune-seeds": len(accuracy), "tune": {}, "select": "valid-accuracy",
                "selected": {"lr": 0.1}, "runs": runs}
    (results / f"{name}.sweep.json").write_text(json.dumps(manifest))


def test_compare_reports_time_to_target_per_link_beside_rounds_and_bytes(tmp_path):
    res = tmp_path / "res"
    # CELGC: 4 clients, I = 2, 0.5 MB up a client a round; 24 client-steps in 0.024 s and 0.048 s: 1 and 2 ms a step
    _sweep(res, "celgc", "celgc", {0: [0.3, 0.6, 0.7], 1: [0.4, 0.45, 0.8]}, {0: 0.024, 1: 0.048}, 0.5 * MB)
    # EPISODE: two exchanges a round; seed 1 never reaches 0.5
    _sweep(res, "episode", "episode", {0: [0.6, 0.7, 0.8], 1: [0.2, 0.3, 0.4]}, {0: 0.024, 1: 0.024}, 1 * MB)
    links = parse_links("mobile,datacenter")
    text, data = compare([res], tmp_path / "cmp", target=0.5, plots=False, links=links)

    def per_round(link, step_s, ex, up):  # one client: I = 2 steps, 1 MB down, `up` bytes up
        return round_seconds(link, compute_s=2 * step_s, exchanges=ex, down_bytes=MB, up_bytes=up)

    celgc, episode = data  # sorted: CELGC, then EPISODE
    # mobile: 0.002 + 0.1 + 0.8 + 2 = 2.902 s a round (seed 0, 2 rounds); 0.004 + 2.9 (seed 1, 3 rounds)
    seeds = [2 * 2.902, 3 * 2.904]
    assert [2 * per_round(MOBILE, 0.001, 1, 0.5 * MB), 3 * per_round(MOBILE, 0.002, 1, 0.5 * MB)] == pytest.approx(seeds)
    got = celgc["time-to-target"]["mobile"]
    want = summary(seeds)
    assert (got["mean"], got["low"], got["high"]) == pytest.approx((want.mean, want.low, want.high))
    assert got["reached"] == 2 and got["seeds"] == 2
    dc = LINKS["datacenter"]
    assert celgc["time-to-target"]["datacenter"]["mean"] == pytest.approx(
        (2 * per_round(dc, 0.001, 1, 0.5 * MB) + 3 * per_round(dc, 0.002, 1, 0.5 * MB)) / 2)
    assert celgc["mb-down-to-target"]["mean"] == pytest.approx((8 + 12) / 2)  # 4 MB down a round
    assert celgc["mb-up-to-target"]["mean"] == pytest.approx((4 + 6) / 2)
    # EPISODE seed 0: round 1 reaches it, two exchanges: 0.002 + 0.2 + 0.8 + 4 = 5.002 s; 1 of 2 seeds
    assert episode["time-to-target"]["mobile"]["mean"] == pytest.approx(5.002)
    assert episode["time-to-target"]["mobile"]["reached"] == 1
    assert "| mobile: s to target | datacenter: s to target |" in text
    assert "mobile = 10 Mbit/s down, 2 Mbit/s up, 50 ms" in text
    assert "| digits-homogeneous | EPISODE I=2 | 50 | 1 (1/2 reached) | 4.0 / 4.0 | 5 (1/2 reached) |" in text
    md = (tmp_path / "cmp" / "comparison.md").read_text()
    assert md == text and "rounds to target" in md.split("\n\n")[0]  # the first table stays as it was
    saved = json.loads((tmp_path / "cmp" / "comparison.json").read_text())
    assert saved[0]["network"]["mobile"] == {"down-bps": 10e6, "up-bps": 2e6, "latency-s": 0.05}
    # no links: no second table
    text, data = compare([res], tmp_path / "cmp2", target=0.5, plots=False, links=[])
    assert ": s to target" not in text and "time-to-target" not in data[0]


def test_the_command_lines_refuse_a_bad_network_before_anything_runs(tmp_path, capsys):
    res = tmp_path / "res"
    _sweep(res, "celgc", "celgc", {0: [0.3, 0.6, 0.7], 1: [0.4, 0.45, 0.8]}, {0: 0.024, 1: 0.048}, 0.5 * MB)
    assert compare_tool.main([str(res), "--out", str(tmp_path / "cmp"), "--network", "wifi", "--no-plots"]) == 2
    assert "error: unknown network 'wifi'" in capsys.readouterr().err
    assert not (tmp_path / "cmp").exists()
    assert compare_tool.main([str(res), "--out", str(tmp_path / "cmp"), "--network", "cross-site", "--no-plots",
                              "--target", "0.5"]) == 0
    assert "cross-site: s to target" in (tmp_path / "cmp" / "comparison.md").read_text()
    # the runner checks --network before it runs any file
    exp = tmp_path / "e.toml"
    exp.write_text('task = "digits"\nnum-rounds = 1\n')
    assert runner.main([str(exp), "--backend", "engine", "--results-dir", str(tmp_path / "r"),
                        "--compare", str(tmp_path / "c"), "--network", "wifi"]) == 2
    assert "unknown network 'wifi'" in capsys.readouterr().err and not (tmp_path / "r").exists()
    with pytest.raises(SystemExit):
        runner.main([str(exp), "--network", "mobile"])
    assert "--network is an option of --compare" in capsys.readouterr().err
