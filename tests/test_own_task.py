"""Your own task by import path: config, clear errors, the tensor / Dataset helpers (== the built-in
digits task bit for bit), and the own-task tutorial's code (docs/tutorials/own-task.md == examples/own_task)."""

import re
from pathlib import Path

import pytest
import torch
from docs_support import blocks
from torch.utils.data import TensorDataset

import tasks
from simulations.engine import run_engine
from simulations.summary import Run
from tasks import load_task
from tasks.classification import ClassificationTask
from tasks.config import RunConfig, task_label
from tasks.custom import dataset_task, tensor_task
from tasks.digits import DigitsCNN, digits_task
from tasks.runs.results import read_results

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "examples.own_task.tabular:make_task"
SMALL = {"num-clients": 3, "num-rounds": 2, "local-steps": 3, "batch-size": 16, "device": "cpu"}


@pytest.fixture(autouse=True)
def fresh_task_cache():
    tasks.cached_task.cache_clear()
    tasks.partitions.cache_clear()
    yield
    tasks.cached_task.cache_clear()
    tasks.partitions.cache_clear()


# --- factories the tests name by import path (this module is importable as test_own_task) ---
SEEN = []


def digits_by_tensors(cfg):
    SEEN.append(cfg)
    d = digits_task()
    return tensor_task(d.train_x, d.train_y, d.test_x, d.test_y, build_model=DigitsCNN)


def digits_by_plain_tensors(cfg):
    """The digits tensors with the strides torch.empty / torch.stack give: (64, 64, 8, 1), where the
    built-in task's have (64, 1, 8, 1) -- same values, but a convolution's rounding depends on it."""
    d = digits_task()
    plain = lambda t: t.clone(memory_format=torch.contiguous_format)  # noqa: E731
    return tensor_task(plain(d.train_x), d.train_y, plain(d.test_x), d.test_y, build_model=DigitsCNN)


def digits_by_dataset(cfg):
    d = digits_task()
    return dataset_task(TensorDataset(d.train_x, d.train_y), TensorDataset(d.test_x, d.test_y), DigitsCNN)


class Factories:
    @staticmethod
    def nested(cfg):
        return digits_task()


NOT_CALLABLE = 42


def lacks_loss(cfg):
    class NoLoss:
        train_size = 10
        labels = [0] * 10

        def build_model(self): ...
        def round_batches(self, *a, **k): ...
        def evaluate(self, *a): ...
        def evaluate_indices(self, *a): ...

    return NoLoss()


def lacks_split(cfg):
    task = digits_task()
    return type("NoSplit", (), {k: getattr(task, k) for k in
                                ("train_size", "build_model", "round_batches", "loss", "evaluate", "evaluate_indices")})()


def evaluate_not_callable(cfg):
    task = digits_task()
    task.evaluate = "accuracy"
    return task


def cfg_of(task, **values):
    return RunConfig.from_mapping({"task": task, **values})


# --- the config key -----------------------------------------------------------------------
@pytest.mark.parametrize("path", [EXAMPLE, "mod:f", "a.b.c:Factory.create", "_p.m2:make_1"])
def test_import_paths_are_accepted_next_to_the_builtin_names(path):
    assert cfg_of(path).task == path
    assert RunConfig.from_mapping(cfg_of(path).to_mapping()).task == path


@pytest.mark.parametrize("value", ["imagenet", "examples.own_task.tabular", "mod:", ":f", "a:b:c", "1mod:f",
                                   "a-b:f", "path/to/file.py:f", "mod:f()", "mod :f"])
def test_other_task_values_name_both_forms(value):
    with pytest.raises(ValueError, match=re.escape(f'task must be one of digits, cifar10, ptb, wikitext2, shakespeare or '
                                                   f'an import path "package.module:factory", got {value!r}')):
        cfg_of(value)


def test_folder_names_of_imported_tasks_have_no_colon():
    assert task_label(EXAMPLE) == "examples.own_task.tabular.make_task" and task_label("digits") == "digits"
    assert cfg_of(EXAMPLE).folder_name().startswith("examples.own_task.tabular.make_task-celgc-I8-s0-")
    run = Run(folder=Path("r"), header={"config": {"task": EXAMPLE, "partitioner": "dirichlet", "dirichlet-alpha": 1}},
              rows=[])
    assert run.group == "examples.own_task.tabular.make_task-dirichlet1"  # the plots' file names


# --- loading -----------------------------------------------------------------------------
def test_the_factory_receives_the_run_config():
    SEEN.clear()
    cfg = cfg_of("test_own_task:digits_by_tensors", **{"data-dir": "my-data", "seed": 7})
    task = load_task(cfg)
    assert SEEN == [cfg] and isinstance(task, ClassificationTask)
    assert isinstance(load_task(cfg_of("test_own_task:Factories.nested")), ClassificationTask)


@pytest.mark.parametrize("path,error,match", [
    ("no_such_package.tasks:make", ImportError,
     r"task 'no_such_package.tasks:make': cannot import module 'no_such_package.tasks' \(ModuleNotFoundError: "
     r"No module named 'no_such_package'\); it must be importable where the apps run"),
    ("test_own_task:make_tsk", ImportError, r"task 'test_own_task:make_tsk': module 'test_own_task' has no attribute "
                                            r"'make_tsk'"),
    ("test_own_task:Factories.missing", ImportError, r"has no attribute 'Factories.missing'"),
    ("test_own_task:NOT_CALLABLE", TypeError, r"task 'test_own_task:NOT_CALLABLE': NOT_CALLABLE is a int, not a "
                                              r"callable factory\(cfg\) returning a task"),
    ("test_own_task:lacks_loss", TypeError, r"task 'test_own_task:lacks_loss' \(NoLoss\) is not a task: it lacks loss "
                                            r"\(see tasks/protocol.py\)"),
    ("test_own_task:lacks_split", TypeError, r"\(NoSplit\) is not a task: it lacks labels or client_partitions"),
    ("test_own_task:evaluate_not_callable", TypeError, r"\(ClassificationTask\) is not a task: evaluate must be "
                                                       r"callable"),
])
def test_bad_factory_paths_say_what_is_wrong(path, error, match):
    with pytest.raises(error, match=match):
        load_task(cfg_of(path))


def test_a_module_that_fails_on_import_is_named(tmp_path, monkeypatch):
    (tmp_path / "broken_task.py").write_text("import torch\nraise RuntimeError('no GPU here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match=r"task 'broken_task:make': cannot import module 'broken_task' "
                                          r"\(RuntimeError: no GPU here\)") as info:
        load_task(cfg_of("broken_task:make"))
    assert isinstance(info.value.__cause__, RuntimeError)


# --- the helpers -------------------------------------------------------------------------
def test_tensor_task_takes_numpy_and_makes_the_classification_task():
    x, y = torch.randn(10, 3, dtype=torch.float64), torch.arange(10) % 3
    task = tensor_task(x.numpy(), y.numpy().astype("int32"), x[:4].numpy(), y[:4].numpy(), build_model=DigitsCNN)
    assert task.train_x.dtype == torch.float32 and task.train_y.dtype == torch.int64
    assert torch.equal(task.train_x, x.float()) and task.num_classes == 3 and task.train_size == 10
    assert task.labels.tolist() == y.tolist()


@pytest.mark.parametrize("change,match", [
    ({"train_y": torch.zeros(9, dtype=torch.int64)}, r"train_x has 10 examples but train_y has 9 labels"),
    ({"test_x": torch.zeros(0, 3), "test_y": torch.zeros(0, dtype=torch.int64)}, r"test_y is empty"),
    ({"train_y": torch.zeros(10)}, r"train_y must hold integer class labels, got dtype torch.float32"),
    ({"train_y": torch.zeros(10, 1, dtype=torch.int64)}, r"train_y must be one integer class label per example"),
    ({"test_y": torch.tensor([0, -1, 0, 0])}, r"test_y must hold class labels >= 0, got -1"),
    ({"test_x": torch.zeros(4, 5)}, r"train_x examples are \(3,\) torch.float32 but test_x examples are \(5,\)"),
    ({"train_x": torch.tensor(1.0)}, r"train_x must hold one input per example"),
    ({"build_model": "mlp"}, r"build_model must be a callable returning an nn.Module, got str"),
    ({"eval_batch_size": 0}, r"eval_batch_size must be an integer >= 1, got 0"),
])
def test_tensor_task_rejects_bad_data_naming_it(change, match):
    args = {"train_x": torch.zeros(10, 3), "train_y": torch.zeros(10, dtype=torch.int64), "test_x": torch.zeros(4, 3),
            "test_y": torch.zeros(4, dtype=torch.int64), "build_model": DigitsCNN, **change}
    with pytest.raises((ValueError, TypeError), match=match):
        tensor_task(**args)


def test_dataset_task_rejects_items_that_are_not_pairs():
    good = TensorDataset(torch.zeros(4, 3), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"train\[0\] must be an \(input, label\) pair, got Tensor"):
        dataset_task(torch.zeros(4, 3), good, DigitsCNN)
    with pytest.raises(ValueError, match=r"train\[0\] label must be a single integer, got shape \(2,\)"):
        dataset_task(TensorDataset(torch.zeros(4, 3), torch.zeros(4, 2, dtype=torch.int64)), good, DigitsCNN)
    with pytest.raises(TypeError, match=r"test must be a map-style Dataset \(with __len__ and __getitem__\), got "
                                        r"generator"):
        dataset_task(good, (p for p in []), DigitsCNN)
    with pytest.raises(ValueError, match=r"train inputs must all have one shape"):
        dataset_task([(torch.zeros(3), 0), (torch.zeros(2), 1)], good, DigitsCNN)


def engine_run(tmp_path, name, **values):
    run_engine(RunConfig.from_mapping({**SMALL, "results-dir": str(tmp_path), "run-name": name, **values}),
               show_progress=False)
    header, rows = read_results(tmp_path / name / "results.jsonl")
    return torch.load(tmp_path / name / "model.pt"), header, rows


def without_clock(rows):
    return [{k: v for k, v in r.items() if k != "wall-clock"} for r in rows]


def test_dataset_task_reads_the_same_tensors():
    d, mine = digits_task(), digits_by_dataset(None)
    for name in ("train_x", "train_y", "test_x", "test_y"):
        assert torch.equal(getattr(mine, name), getattr(d, name)) and getattr(mine, name).dtype == getattr(d, name).dtype
    assert mine.num_classes == 10 and mine.train_size == d.train_size


@pytest.mark.parametrize("factory,reference", [("digits_by_tensors", "digits"),
                                               ("digits_by_dataset", "test_own_task:digits_by_plain_tensors")])
def test_the_digits_data_through_the_helpers_trains_like_the_builtin_task(tmp_path, factory, reference):
    """The same tensors (same strides) and model by import path == the reference task: same model,
    same rows, bit for bit."""
    state, header, rows = engine_run(tmp_path, "mine", task=f"test_own_task:{factory}", partitioner="dirichlet")
    ref_state, ref_header, ref_rows = engine_run(tmp_path, "digits", task=reference, partitioner="dirichlet")
    assert header["config"]["task"] == f"test_own_task:{factory}"
    assert header["train-size"] == ref_header["train-size"] and header["model-bytes"] == ref_header["model-bytes"]
    assert without_clock(rows) == without_clock(ref_rows)
    assert state.keys() == ref_state.keys() and all(torch.equal(state[k], ref_state[k]) for k in state)


# --- the tutorial ----------------------------------------------------------------------------
def readme_snippet():
    """The Python block of docs/tutorials/own-task.md, as the site shows it."""
    return next(b.code for b in blocks(ROOT / "docs" / "tutorials" / "own-task.md") if b.lang == "python")


def test_the_readme_code_is_the_example_and_runs(tmp_path, monkeypatch):
    code = readme_snippet()
    assert code == (ROOT / "examples" / "own_task" / "tabular.py").read_text()
    (tmp_path / "readme_task.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    state, header, rows = engine_run(tmp_path, "readme", task="readme_task:make_task")
    assert header["train-size"] == 455 and rows[-1]["replies"] == 3
    assert rows[-1]["test-accuracy"] > 0.8 > rows[0]["test-accuracy"]
    assert state["0.weight"].shape == (32, 30)
