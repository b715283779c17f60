"""Your own task: the import path a ``task`` key names, and helpers that build a task from your data.

``task = "package.module:factory"`` makes every backend call ``factory(cfg)`` (``import_task``);
the rules -- what the factory receives and returns, where the module must be importable --
are in ``tasks/protocol.py``. ``tensor_task`` and ``dataset_task`` turn in-memory data with
integer class labels plus a model factory into the ``ClassificationTask`` the built-in digits
task is: minibatches from ``tasks.sampling``, cross-entropy, test loss and accuracy.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from .classification import ClassificationTask

if TYPE_CHECKING:
    from torch.utils.data import Dataset

    from .config import RunConfig

HELP = "see tasks/protocol.py"


def import_task(cfg: RunConfig) -> object:
    """``factory(cfg)`` for ``cfg.task = "module:factory"``; errors name the path and the problem."""
    module_name, _, attribute = cfg.task.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # not found, or the module itself fails: name the path either way
        raise ImportError(
            f"task {cfg.task!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc}); it must be "
            f"importable where the apps run: installed, on PYTHONPATH, or a folder of the project ({HELP})"
        ) from exc
    factory: Any = module
    for part in attribute.split("."):
        if not hasattr(factory, part):
            raise ImportError(f"task {cfg.task!r}: module {module_name!r} has no attribute {attribute!r} ({HELP})")
        factory = getattr(factory, part)
    if not callable(factory):
        raise TypeError(f"task {cfg.task!r}: {attribute} is a {type(factory).__name__}, not a callable "
                        f"factory(cfg) returning a task ({HELP})")
    return factory(cfg)


def tensor_task(train_x: Any, train_y: Any, test_x: Any, test_y: Any, build_model: Callable[[], nn.Module], *,
                name: str = "custom", eval_batch_size: int = 1024) -> ClassificationTask:
    """A classification task from training and test inputs ``[n, ...]`` and integer class labels ``[n]``.

    Tensors or NumPy arrays; floating-point inputs become the default dtype (float32, as the
    model's parameters), labels int64. ``build_model()`` returns a fresh model whose output
    is ``[batch, classes]`` logits. Clients train on minibatches of their partition's
    examples (``tasks.sampling``) with cross-entropy; evaluation reports ``test-loss`` and
    ``test-accuracy`` on the test set.
    """
    if not callable(build_model):
        raise TypeError(f"build_model must be a callable returning an nn.Module, got {type(build_model).__name__}")
    if not isinstance(eval_batch_size, int) or eval_batch_size < 1:
        raise ValueError(f"eval_batch_size must be an integer >= 1, got {eval_batch_size!r}")
    tx, ty = _inputs("train_x", train_x), _labels("train_y", train_y)
    vx, vy = _inputs("test_x", test_x), _labels("test_y", test_y)
    for (xn, x), (yn, y) in ((("train_x", tx), ("train_y", ty)), (("test_x", vx), ("test_y", vy))):
        if len(x) != len(y):
            raise ValueError(f"{xn} has {len(x)} examples but {yn} has {len(y)} labels")
        if len(y) == 0:
            raise ValueError(f"{yn} is empty: a task needs training and test examples")
    if tx.shape[1:] != vx.shape[1:] or tx.dtype != vx.dtype:
        raise ValueError(f"train_x examples are {tuple(tx.shape[1:])} {tx.dtype} but test_x examples are "
                         f"{tuple(vx.shape[1:])} {vx.dtype}: they must match")
    num_classes = int(max(ty.max(), vy.max())) + 1
    return ClassificationTask(name=name, train_x=tx, train_y=ty, test_x=vx, test_y=vy, num_classes=num_classes,
                              build_model=build_model, eval_batch_size=eval_batch_size)


def dataset_task(train: Dataset, test: Dataset, build_model: Callable[[], nn.Module], *,
                 name: str = "custom", eval_batch_size: int = 1024) -> ClassificationTask:
    """``tensor_task`` of two map-style datasets whose items are (input, integer label) pairs.

    Each dataset is read once, item by item, into two tensors (inputs stacked, labels): the
    data must fit in memory, and the task then trains exactly like ``tensor_task`` on
    those tensors.
    """
    train_x, train_y = _read("train", train)
    test_x, test_y = _read("test", test)
    return tensor_task(train_x, train_y, test_x, test_y, build_model, name=name, eval_batch_size=eval_batch_size)


def _read(which: str, dataset: Any) -> tuple[Tensor, Tensor]:
    try:
        n = len(dataset)
    except TypeError:
        raise TypeError(f"{which} must be a map-style Dataset (with __len__ and __getitem__), "
                        f"got {type(dataset).__name__}") from None
    xs, ys = [], []
    for i in range(n):
        item = dataset[i]
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise ValueError(f"{which}[{i}] must be an (input, label) pair, got {type(item).__name__}")
        xs.append(torch.as_tensor(item[0]))
        ys.append(torch.as_tensor(item[1]))
    if not xs:
        raise ValueError(f"{which} is empty: a task needs training and test examples")
    shapes = {tuple(x.shape) for x in xs}
    if len(shapes) > 1:
        raise ValueError(f"{which} inputs must all have one shape, got {sorted(shapes)[:3]}")
    bad = next((i for i, y in enumerate(ys) if y.dim() != 0), None)
    if bad is not None:
        raise ValueError(f"{which}[{bad}] label must be a single integer, got shape {tuple(ys[bad].shape)}")
    return torch.stack(xs), torch.stack(ys)


def _inputs(name: str, values: Any) -> Tensor:
    x = torch.as_tensor(values)
    if x.dim() < 1:
        raise ValueError(f"{name} must hold one input per example ([n, ...]), got a scalar")
    if x.is_floating_point() and x.dtype != torch.get_default_dtype():
        x = x.to(torch.get_default_dtype())
    return x.contiguous()


def _labels(name: str, values: Any) -> Tensor:
    y = torch.as_tensor(values)
    if y.dim() != 1:
        raise ValueError(f"{name} must be one integer class label per example ([n]), got shape {tuple(y.shape)}")
    if y.is_floating_point() or y.is_complex() or y.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer class labels, got dtype {y.dtype}")
    if len(y) and int(y.min()) < 0:
        raise ValueError(f"{name} must hold class labels >= 0, got {int(y.min())}")
    return y.to(torch.int64).contiguous()
