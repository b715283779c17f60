"""Test-wide settings and the fixtures the tests share.

One torch thread for the suite (CI has 2 cores shared by several processes; more threads make
the small models here slower, not faster), inherited by subprocesses too; ``CELGC_TEST_THREADS=n``
runs the suite with n instead (1, 2 and 4 are checked). Every test that compares a result made
in another process with one made here bit for bit (torchrun, `flwr run`, the runner's pool, a
CLI) runs its part here with the other processes' thread count, ``OMP_NUM_THREADS`` (default 1),
whatever n is: a CPU kernel may split a reduction by thread, so the thread count is part of what
a bit-identical result needs (marked ``realproc``: ``same_threads_as_subprocesses``).
``OMP_NUM_THREADS=m`` runs the torchrun tests with m threads in every process (the runner and
the deployed ClientApps pin their own count: their tests hold at m = 1 only); torch caps an
``OMP_NUM_THREADS`` above the machine's cores at the cores, so on a 2-core machine m = 4 runs 2. The shared pieces,
each defined once here: a small corpus to learn (``corpus``) and the tiny language model on it
(``tiny_lm``), a BatchNorm-free MLP for digits (``mlp``, ``mlp_digits``), the digits CNN with
average pooling (``smooth_digits``), and the Flower path and the engine run side by side on
one config (``runs``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

THREADS = os.environ.get("CELGC_TEST_THREADS", "1")
if not THREADS.isdigit() or int(THREADS) < 1:
    raise ValueError(f"CELGC_TEST_THREADS must be an integer >= 1, got {THREADS!r}")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # subprocesses: one thread (tests compare them with this process)
SUBPROCESS_THREADS = int(os.environ["OMP_NUM_THREADS"])
if SUBPROCESS_THREADS > 1:  # torch ignores an OMP_NUM_THREADS above what it counts as the cores (pytorch#60000): ask one
    import subprocess
    import sys

    SUBPROCESS_THREADS = int(subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                                            capture_output=True, text=True, check=True, timeout=120).stdout)
torch.set_num_threads(int(THREADS))


@pytest.fixture(autouse=True)
def same_threads_as_subprocesses(request):
    """A real-process test compares its subprocesses' results (``OMP_NUM_THREADS`` threads each) with
    this process's: this process runs its part with as many, whatever CELGC_TEST_THREADS is."""
    if request.node.get_closest_marker("realproc") is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(SUBPROCESS_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(before)

ROOT = Path(__file__).resolve().parents[1]
#: AWD-LSTM sizes of the tiny language model
TINY_LM = {"emb_size": 8, "hidden_size": 12, "num_layers": 2}


def write_corpus(folder: Path, words: int = 6000, seed: int = 0) -> None:
    """A small PTB-format corpus with structure to learn: sentences from a 30-word grammar-ish source."""
    rng = np.random.default_rng(seed)
    vocab = [f"w{i}" for i in range(30)]
    folder.mkdir(parents=True, exist_ok=True)
    for name, n in (("train", words), ("valid", words // 6), ("test", words // 6)):
        lines, count = [], 0
        while count < n:
            start = int(rng.integers(0, 30))
            length = int(rng.integers(3, 12))
            sentence = [vocab[(start + 3 * k) % 30] for k in range(length)]
            lines.append(" " + " ".join(sentence) + " ")
            count += length + 1
        (folder / f"ptb.{name}.txt").write_text("\n".join(lines) + "\n")


def _clear_task_caches() -> None:
    import tasks

    tasks.cached_task.cache_clear()
    tasks.partitions.cache_clear()


@pytest.fixture
def corpus():
    """``write_corpus(folder, words=6000, seed=0)``."""
    return write_corpus


@pytest.fixture
def tiny_lm(tmp_path, monkeypatch):
    """``tiny_lm(words=6000)``: a corpus of that many words in ``tmp_path / "data"`` and the ``ptb``
    task shrunk to the tiny AWD-LSTM (bptt 10, 64-token blocks); returns ``tmp_path``."""
    import tasks.language as language

    def make(words: int = 6000) -> Path:
        write_corpus(tmp_path / "data", words=words)
        monkeypatch.setitem(language.MODEL_SIZES, "ptb", TINY_LM)
        monkeypatch.setattr(language, "BPTT", 10)
        monkeypatch.setattr(language, "BLOCK_LEN", 64)
        language._corpus.cache_clear()
        _clear_task_caches()
        return tmp_path

    yield make
    _clear_task_caches()


def mlp_model(hidden: int = 24) -> nn.Module:
    """A BatchNorm-free MLP for the digits (8x8 images, 10 classes)."""
    return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, 10))


@pytest.fixture
def mlp():
    """``mlp(hidden=24)``: a BatchNorm-free digits MLP."""
    return mlp_model


@pytest.fixture
def mlp_digits(monkeypatch):
    """The digits task with the BatchNorm-free MLP in place of its CNN (every backend builds it)."""
    import tasks.digits

    monkeypatch.setattr(tasks.digits, "DigitsCNN", lambda num_classes=10: mlp_model())
    _clear_task_caches()
    yield
    _clear_task_caches()


@pytest.fixture
def smooth_digits(monkeypatch):
    """The digits CNN with 2x2 average pooling in place of max pooling (no argmax ties: vmap parity)."""
    import tasks.digits
    from tasks.digits import DigitsCNN

    class SmoothDigitsCNN(DigitsCNN):
        def __init__(self, num_classes: int = 10) -> None:
            super().__init__(num_classes)
            self.features[6] = nn.AvgPool2d(2)

    monkeypatch.setattr(tasks.digits, "DigitsCNN", SmoothDigitsCNN)
    _clear_task_caches()
    yield SmoothDigitsCNN
    _clear_task_caches()


#: keys the Flower path writes only when nodes fail or a run resumes
FLOWER_ONLY = {"failures", "resumed-from-round", "resumed-by"}


class Runs:
    """One config on the Flower path (the real ServerApp and ClientApp on the in-process grid)
    and on the engine, into ``tmp_path``; ``same`` compares two runs (state and rows)."""

    BASE = {"num-clients": 4, "num-rounds": 2, "batch-size": 16, "device": "cpu", "node-wait": 2.0}

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.grids: dict[str, object] = {}

    def values(self, name: str, **overrides) -> dict:
        from tasks.config import RunConfig

        return {**RunConfig().to_mapping(), **self.BASE, "results-dir": str(self.tmp_path), "run-name": name,
                **overrides}

    def read(self, name: str):
        from tasks.runs.results import load_weights, read_results

        return load_weights(self.tmp_path / name / "model.pt"), read_results(self.tmp_path / name / "results.jsonl")

    def flower(self, name: str, num_nodes: int | None = None, **overrides):
        """The ServerApp and ClientApp on ``num_nodes`` in-process nodes (default: one per client;
        fewer: each serves several)."""
        from client.app import app as client_app
        from server.app import app as server_app
        from simulations.loopback import LoopbackGrid, run_server_app

        values = self.values(name, **overrides)
        grid = LoopbackGrid(client_app, values, num_nodes or values["num-clients"])
        self.grids[name] = grid
        run_server_app(server_app, grid)
        return self.read(name)

    def engine(self, name: str, path: str = "auto", **overrides):
        from simulations.engine import EngineOptions, run_engine
        from tasks.config import RunConfig

        values = {k: v for k, v in self.values(name, **overrides).items()}
        result = run_engine(RunConfig.from_mapping(values), EngineOptions(path=path), show_progress=False)
        assert result.path == ("sequential" if path == "auto" else path)
        return self.read(name)

    @staticmethod
    def same(flower_run, engine_run, exact: bool) -> None:
        (f_state, (f_head, f_rows)), (e_state, (e_head, e_rows)) = flower_run, engine_run
        assert set(f_state) == set(e_state)
        for key, value in f_state.items():
            assert e_state[key].dtype == value.dtype, key
            if exact:
                assert torch.equal(e_state[key], value), key
            else:
                assert torch.allclose(e_state[key].double(), value.double(), atol=1e-5, rtol=0), key
        same = lambda c: {k: v for k, v in c.items() if k != "run-name"}  # noqa: E731
        assert same(e_head["config"]) == same(f_head["config"])
        assert e_head["backend"] == "engine"
        assert e_head["model-bytes"] == f_head["model-bytes"] and e_head["train-size"] == f_head["train-size"]
        assert len(e_rows) == len(f_rows)
        for f, e in zip(f_rows, e_rows, strict=True):
            assert list(e) == [k for k in f if k not in FLOWER_ONLY]  # same keys, same order
            for key, value in f.items():
                if key in ("wall-clock", *FLOWER_ONLY):
                    continue
                if isinstance(value, float) and math.isfinite(value):
                    if exact:
                        assert e[key] == value, key
                    else:
                        assert e[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
                else:
                    assert e[key] == value, key


@pytest.fixture
def runs(tmp_path):
    return Runs(tmp_path)


def run_command(cmd: list[str], timeout: float = 240):
    """Run ``cmd`` from the project root (``OMP_NUM_THREADS`` threads, the checkout first on the path); it must succeed."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def states_close(a, b, atol: float) -> None:
    """Every tensor of ``b`` in ``a``, same dtype, within ``atol``."""
    for key, value in b.items():
        assert a[key].dtype == value.dtype, key
        assert torch.allclose(a[key].double(), value.double(), atol=atol, rtol=0), key


@pytest.fixture
def command():
    """``command(cmd, timeout=240)``: run a command from the project root; it must succeed."""
    return run_command


def matches_one_process(folder: Path, run_name: str, keys: dict) -> list[dict]:
    """The engine run ``folder/run_name`` of 2 processes == the same ``keys`` in this one
    (model to 1e-6, the same row keys, every loss to 1e-6); its rows."""
    from simulations.engine import run_engine
    from tasks.config import RunConfig
    from tasks.runs.results import load_weights, read_results

    one = run_engine(RunConfig.from_mapping({**keys, "run-name": "one"}), show_progress=False)
    states_close(load_weights(folder / run_name / "model.pt"), one.state, 1e-6)
    header, rows = read_results(folder / run_name / "results.jsonl")
    assert header["world-size"] == 2 and header["backend"] == "engine"
    _, one_rows = read_results(folder / "one" / "results.jsonl")
    assert [list(r) for r in rows] == [list(r) for r in one_rows]
    assert [r["train-loss"] for r in rows[1:]] == pytest.approx([r["train-loss"] for r in one_rows[1:]], rel=1e-6)
    return rows


@pytest.fixture
def one_process():
    """``one_process(folder, run_name, keys)``: a 2-process engine run equals one process (``matches_one_process``)."""
    return matches_one_process


@pytest.fixture
def close():
    """``close(a, b, atol)``: two states agree within ``atol`` (same keys of ``b``, same dtypes)."""
    return states_close


class TinyLSTM(nn.Module):
    def __init__(self, vocab=12, dim=6):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, x):
        h, _ = self.lstm(self.emb(x))
        return self.out(h)


@dataclasses.dataclass
class TinyTextTask:
    """Next-token prediction on random streams: a task object as the engine sees one."""

    streams: list
    train_size: int = 400

    model = TinyLSTM

    @staticmethod
    def build_model():
        return TinyLSTM()

    def round_batches(self, partition, *, seed, partition_id, server_round, local_steps, batch_size, device):
        g = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, partition_id, server_round]).generate_state(1)[0]))
        for _ in range(local_steps):
            start = torch.randint(0, len(partition) - 9, (batch_size,), generator=g)
            rows = torch.stack([partition[s : s + 9] for s in start.tolist()], 1).to(device)  # [T+1, B]
            yield rows[:-1], rows[1:]

    @staticmethod
    def loss(model, batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x).reshape(-1, 12), y.reshape(-1))

    def evaluate(self, model, device):
        return {}



@pytest.fixture
def tiny_text():
    """``TinyTextTask(streams)``: next-token prediction with an ``nn.LSTM`` (``TinyTextTask.model``),
    a model vmap cannot take."""
    return TinyTextTask


VMAP_WORLD = """
import sys, torch
from torch import nn
from tasks.config import RunConfig
from simulations.engine import EngineOptions, run_engine
from tasks.partition import partition
from tasks.digits import DigitsCNN, digits_task
import dataclasses

def smooth():  # the default model with average pooling: no argmax to flip on 1-ulp differences
    model = DigitsCNN()
    model.features[6] = nn.AvgPool2d(2)
    return model

task = dataclasses.replace(digits_task(), build_model=smooth)
device = sys.argv[2] if len(sys.argv) > 2 else "cpu"
cfg = RunConfig.from_mapping({"num-clients": 5, "num-rounds": 2, "local-steps": 3, "batch-size": 16, "device": device})
parts = partition(task.labels, 5, "homogeneous", 0)
result = run_engine(cfg, EngineOptions(path="vmap"), task=task, parts=parts, write_results=False, show_progress=False)
if result.clients.start == 0:
    state = {k: v.cpu() for k, v in result.state.items()}
    torch.save({"state": state, "clients": list(result.clients), "rows": result.rows}, sys.argv[1])
"""


@pytest.fixture
def vmap_world():
    """A script: the engine's vmap path over 5 clients (``torchrun`` shares them), its result saved to argv[1]."""
    return VMAP_WORLD
