"""The one configuration object: TOML run-config keys -> a frozen, validated ``RunConfig``.

The same hyphenated keys drive ``flwr run`` (``[tool.flwr.app.config]`` in pyproject.toml,
``--run-config`` overrides), a deployment, and the fast engine. The run config is parsed
once, at the edge (ServerApp, ClientApp, engine CLI); every error names the key, the value
and the allowed range.

A method's own keys are scoped by its name: ``<name>.<key>`` (``fedavgm.server-lr``; in TOML
``fedavgm.server-lr = 0.5`` or the table ``[fedavgm]``), so two methods may each have a key of
the same name. The running method reads its own; another method's key must keep its default
(a run config carries every registered method's keys, as ``flwr run`` passes the app's whole
config) and is an error naming its owner and the running method otherwise.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from strategies.core.dp_noise import BUFFER_CHOICES, DPSettings
from strategies.core.settings import DEFAULTS, Hyper
from strategies.methods import METHODS, NAME, method, own_keys
from strategies.methods.privacy import method_problems

from .overrides import flatten

TASKS = ("digits", "cifar10", "ptb", "wikitext2", "shakespeare")
#: ``package.module:factory`` -- a task of your own (``tasks.custom``, docs/tutorials/own-task.md)
TASK_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
#: the methods (``strategies.methods``: one module each) when this module was imported
ALGORITHMS = tuple(METHODS)
PARTITIONERS = ("homogeneous", "similarity", "dirichlet")
DEVICES = ("auto", "cpu", "cuda")
CLIENT_STATES = ("keep", "reset")
TEXT_SPLITS = ("blocks", "contiguous")
#: how floating-point parameters travel in the Flower paths' packed messages (strategies.flower_api.wire.TRANSPORTS)
TRANSPORTS = ("float32", "bfloat16", "float16")

#: N where num-clients = 0 (follow the federation) meets no federation: the engine, the in-process grid
DEFAULT_CLIENTS = 8


def _key(name: str, doc: str, **kw: Any) -> Any:
    """A config field with its TOML key and one-line meaning (docs/reference/run-config.md shows it)."""
    return field(metadata={"key": name, "doc": doc}, **kw)


_HYPER = {f.metadata["key"]: f for f in dataclasses.fields(Hyper)}


def _hyper(name: str) -> Any:
    """A training hyper-parameter: its meaning and default are ``strategies.core.settings.Hyper``'s."""
    return _key(name, _HYPER[name].metadata["doc"], default=getattr(DEFAULTS, _HYPER[name].name))


@dataclass(frozen=True)
class RunConfig:
    """Every setting of a run. Build with ``RunConfig.from_mapping`` (validates)."""

    task: str = _key("task", "data set + model: digits (offline default), cifar10, ptb, wikitext2, shakespeare, or your own \"package.module:factory\"", default="digits")
    algorithm: str = _key("algorithm", f"the method: {', '.join(METHODS)} (docs/ALGORITHMS.md: what each does, its own keys)", default="celgc")
    num_clients: int = _key("num-clients", "N, the clients; fewer SuperNodes than N serve several each (Flower's 2: 4 each); 0: one per SuperNode (8 on the engine)", default=8)
    clients_per_round: int = _key("clients-per-round", "K, clients sampled (uniformly, from seed and round) to train in each round; 0: all num-clients (the paper)", default=0)
    num_rounds: int = _key("num-rounds", "communication rounds", default=20)
    local_steps: int = _hyper("local-steps")
    batch_size: int = _hyper("batch-size")
    lr: float = _hyper("lr")
    clip: float = _hyper("clip")
    weight_decay: float = _hyper("weight-decay")
    momentum: float = _hyper("momentum")
    lr_decay: float = _hyper("lr-decay")
    lr_milestones: tuple[float, ...] = _hyper("lr-milestones")
    aggregation: str = _hyper("aggregation")
    trim_fraction: float = _hyper("trim-fraction")
    partitioner: str = _key("partitioner", "homogeneous, similarity or dirichlet", default="homogeneous")
    similarity: float = _key("similarity", "s in [0, 100]: % of each class dealt i.i.d. (similarity partitioner)", default=0.0)
    dirichlet_alpha: float = _key("dirichlet-alpha", "alpha > 0 of the Dirichlet label skew", default=0.5)
    dirichlet_min_size: int = _key("dirichlet-min-size", "redraw the Dirichlet split until every client holds this many examples (0: any non-empty split)", default=0)
    seed: int = _key("seed", "seed of model init, partitions and minibatches", default=0)
    data_dir: str = _key("data-dir", "where data sets live (cifar10, ptb, wikitext2, shakespeare; given to your own task's factory)", default="data")
    download: bool = _key("download", "allow downloading a data set that is missing", default=False)
    results_dir: str = _key("results-dir", "folder for results (relative: to the server's working directory)", default="results")
    run_name: str = _key("run-name", "results sub-folder; empty: <task>-<algorithm>-I<local-steps>-s<seed>-<time>", default="")
    device: str = _key("device", "auto (CUDA when present), cpu or cuda", default="auto")
    eval_every: int = _key("eval-every", "central evaluation every k rounds (and after the last)", default=1)
    node_wait: float = _key("node-wait", "seconds the server waits for the federation's nodes to connect", default=120.0)
    round_timeout: float = _key("round-timeout", "seconds the server waits for replies in a round", default=600.0)
    min_replies: int = _key("min-replies", "sound replies a round needs, else the run fails; 0: all num-clients", default=0)
    checkpoint_every: int = _key("checkpoint-every", "write <results-dir>/<run-name>/checkpoint.pt every k rounds (and after the last); 0: never", default=1)
    resume: bool = _key("resume", "continue run-name from its checkpoint (needs a fixed run-name); no checkpoint: start at round 0", default=False)
    tensorboard: bool = _key("tensorboard", "also write every results row's numbers as TensorBoard scalars into the run folder (needs the tensorboard extra); tensorboard --logdir <results-dir> shows the runs side by side", default=False)
    client_state: str = _key("client-state", "keep: a client carries its state (LM hidden state, place in its text) across rounds; reset: zero each round", default="keep")
    text_split: str = _key("text-split", "homogeneous text: blocks (2,048-token blocks round-robin) or contiguous (one region per client, rotated each pass)", default="blocks")
    average_iterates: bool = _key("average-iterates", "evaluate the running mean of the global models once valid-loss stops improving (nonmono evaluations)", default=False)
    nonmono: int = _key("nonmono", "evaluations without a new best valid-loss before average-iterates starts", default=5)
    eval_train: bool = _key("eval-train", "also evaluate the global model on the whole training set at each evaluation (train-eval-*)", default=False)
    node_aggregation: bool = _key("node-aggregation", f"a SuperNode serving several clients replies with their sum (one model's bytes, in float32 or the transport dtype) instead of each client's model: the reply checks see the node's average; needs uniform or examples aggregation, no DP, a method that only averages ({', '.join(n for n, m in METHODS.items() if m.node_sums)}); the model equals the engine's up to the order of the float64 sum", default=False)
    transport: str = _key("transport", "how the model's trainable parameters travel in this project's Flower messages: float32 (exact), or bfloat16 / float16 (half the bytes, lossy: the global model rounded, replies the rounded difference from it; the engine sends nothing and stays exact)", default="float32")
    valid_fraction: float = _key("valid-fraction", "share of each client's training data held out (seeded) as the validation set: valid-loss, valid-accuracy; 0: none", default=0.0)
    #: the running method's own settings (``Algorithm.Settings``): (its key, value), every one of its keys; in
    #: the run config they are ``<its name>.<key>``
    options: tuple[tuple[str, Any], ...] = field(default=(), metadata={"key": None, "doc": ""})
    eval_subsample: int = _key("eval-subsample", "evaluate on every k-th test example (1: all; cuts evaluation time on a CPU)", default=1)
    dp_noise_multiplier: float = _key("dp-noise-multiplier", "z, client-level DP: N(0, z^2 S^2) added once to the sum of a round's updates (S: the method's bound, or dp-clip); 0: no DP", default=0.0)
    dp_clip: float = _key("dp-clip", "C, update clipping of a DP run (DP-FedAvg): the sensitivity S, each contribution projected to norm <= C; needed without a per-client bound (local-sgd, naive, momentum > 0), a tighter S than CELGC's bound; 0: the method's own bound (CELGC: I gamma x the largest lr scale)", default=0.0)
    dp_delta: float = _key("dp-delta", "delta of the (epsilon, delta) reported; 0: 1/num-clients^1.1", default=0.0)
    dp_max_epsilon: float = _key("dp-max-epsilon", "the run stops (results and checkpoint kept) before a round would spend more epsilon; 0: no limit", default=0.0)
    dp_accountant: str = _key("dp-accountant", "epsilon of a DP run by rdp (Renyi DP) or pld (privacy loss distribution: tighter for the same run), both dp-accounting, K of M without replacement, replace-one", default="rdp")
    dp_buffers: str = _key("dp-buffers", "a DP run with a model holding buffers (BatchNorm statistics: data, no bound): refuse, or frozen (kept at their initial values)", default="refuse")
    dp_reproducible: bool = _key("dp-reproducible", "noise and client sample from the public seed (tests, backend parity): the run is marked NOT private", default=False)

    def __post_init__(self) -> None:
        _complete(self)
        _validate(self)

    # --- construction ---------------------------------------------------------------
    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, declared: Collection[str] = ()) -> RunConfig:
        """Parse run-config keys (hyphenated, as in TOML; a method's own keys ``<name>.<key>``, or
        nested tables of them); unknown keys are errors. ``declared``: keys the app's config lists
        (``[tool.flwr.app.config]``), where a table of a method this process does not know -- yours,
        not running -- is left unread instead of refused (``from_app``)."""
        values = flatten(values)
        fields = {f.metadata["key"]: f for f in dataclasses.fields(cls) if f.metadata["key"] is not None}
        kwargs: dict[str, Any] = {fields[k].name: _coerce(k, fields[k].type, v) for k, v in values.items() if k in fields}
        algorithm = kwargs.get("algorithm", fields["algorithm"].default)
        chosen = method(algorithm)  # first: its keys mean nothing without it (an error naming the methods, or the path's fault)
        rest = {k: v for k, v in values.items() if k not in fields}
        kwargs["options"] = tuple(_own_settings(rest, algorithm, chosen, list(fields), set(declared)).items())
        return cls(**kwargs)

    @classmethod
    def from_app(cls, values: Mapping[str, Any]) -> RunConfig:
        """The run config Flower hands an app (``Context.run_config``): every key is one the app's
        config lists (Flower refuses any other), so a table of a method of yours that is not the
        running one stays unread there."""
        return cls.from_mapping(values, declared=values)

    @classmethod
    def from_toml(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
        """Read ``[tool.flwr.app.config]`` of a pyproject.toml (or a file of run-config keys), ``overrides`` winning."""
        values, app = _toml_keys(path)
        return cls.from_mapping({**values, **flatten(overrides or {})}, declared=values if app else ())

    def to_mapping(self) -> dict[str, Any]:
        """The config as run-config keys and TOML-friendly values (logged with results)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.metadata["key"] is None:
                out.update({f"{method(self.algorithm).name}.{k}": v for k, v in self.options})
                continue
            value = getattr(self, f.name)
            if f.name == "lr_milestones":
                value = ",".join(f"{m:g}" for m in value)
            elif f.name == "clip" and math.isinf(value):
                value = "off"
            out[f.metadata["key"]] = value
        return out

    def replace(self, **changes: Any) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def with_clients(self, federation: int | None) -> RunConfig:
        """num-clients resolved: a set value stays; 0 follows ``federation`` (the number of
        partitions the nodes report), or ``DEFAULT_CLIENTS`` where there is none (None)."""
        if self.num_clients:
            return self
        return self.replace(num_clients=federation if federation is not None else DEFAULT_CLIENTS)

    def folder_name(self) -> str:
        """The results sub-folder: ``run-name``, or <task>-<algorithm>-I<local-steps>-s<seed>-<time>."""
        import time

        return self.run_name or f"{task_label(self.task)}-{task_label(self.algorithm)}-I{self.local_steps}-s{self.seed}-{time.strftime('%Y%m%d-%H%M%S')}"

    def evaluates(self, server_round: int) -> bool:
        """Central evaluation after this round: every ``eval-every`` rounds and after the last."""
        return server_round % self.eval_every == 0 or server_round == self.num_rounds

    def checkpoints(self, server_round: int) -> bool:
        """A checkpoint after this round: every ``checkpoint-every`` rounds and after the last (0: never)."""
        every = self.checkpoint_every
        return server_round > 0 and every > 0 and (server_round % every == 0 or server_round == self.num_rounds)

    @property
    def required_replies(self) -> int:
        return self.min_replies or self.per_round

    @property
    def per_round(self) -> int:
        """K, the clients that train in a round (all num-clients unless clients-per-round is set)."""
        return self.clients_per_round or self.num_clients

    @property
    def clipping(self) -> bool:
        return not math.isinf(self.clip)

    @property
    def method_options(self) -> dict[str, Any]:
        """The running method's own settings (its key, unscoped -> value)."""
        return dict(self.options)

    @property
    def dp(self) -> DPSettings:
        """The DP keys (``strategies.core.dp_noise``, the mechanism ``strategies.methods.privacy``)."""
        return DPSettings(noise_multiplier=self.dp_noise_multiplier, clip=self.dp_clip, delta=self.dp_delta,
                          max_epsilon=self.dp_max_epsilon, accountant=self.dp_accountant, buffers=self.dp_buffers,
                          reproducible=self.dp_reproducible)

    @property
    def hyper(self) -> Hyper:
        """The training hyper-parameters (``strategies.core.settings.Hyper``)."""
        return Hyper(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Hyper)})


def toml_values(path: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The run-config keys of ``[tool.flwr.app.config]`` of a pyproject.toml (or a file of run-config
    keys), flattened (``<name>.<key>``), ``overrides`` winning: what ``RunConfig.from_toml`` parses."""
    return {**_toml_keys(path)[0], **flatten(overrides or {})}


def _toml_keys(path: str | Path) -> tuple[dict[str, Any], bool]:
    """A TOML file's run-config keys, flattened, and whether they are an app's ``[tool.flwr.app.config]``."""
    data = tomllib.loads(Path(path).read_text())
    app = data.get("tool", {}).get("flwr", {}).get("app", {}).get("config")
    return flatten(app if app is not None else data), app is not None


def task_label(task: str) -> str:
    """``task`` as a file-name part: a built-in name as is, ``pkg.mod:factory`` -> ``pkg.mod.factory``."""
    return task.replace(":", ".")


def config_keys() -> list[tuple[str, Any, str]]:
    """(key, default, meaning) of every setting, in order: the shared keys, then every registered
    method's own (``<name>.<key>``) where ``options`` sits."""
    defaults = RunConfig().to_mapping()
    out = []
    for f in dataclasses.fields(RunConfig):
        if f.metadata["key"] is None:
            out += [(k, fld.default, f"algorithm {name!r}: {fld.metadata['doc']}") for k, (name, fld) in own_keys().items()]
        else:
            out.append((f.metadata["key"], defaults[f.metadata["key"]], f.metadata["doc"]))
    return out


def shared_keys() -> list[str]:
    """The run-config keys every method reads (not a method's own)."""
    return [f.metadata["key"] for f in dataclasses.fields(RunConfig) if f.metadata["key"] is not None]


def comparable(config: Mapping[str, Any]) -> dict[str, Any]:
    """A recorded run config (a results header's, a checkpoint's) in today's keys, to compare two
    runs: the running method's own keys scoped (records written before keys were scoped hold them
    bare: ``server-momentum``), other methods' keys left out (at their defaults, read by no run), and
    a shared key the record lacks at its default (a key added after the record was written: every
    new key's default is the behaviour before it, e.g. ``transport = "float32"``)."""
    values = flatten(config)
    algorithm = values.get("algorithm", RunConfig.algorithm)
    try:
        chosen = method(algorithm)
    except (ValueError, TypeError):
        chosen = None
    shared = set(shared_keys())
    methods = {**METHODS, **({chosen.name: chosen} if chosen is not None else {})}
    bare = {k for cls in methods.values() for k in cls.own_keys()} - shared
    out = {}
    for key, value in values.items():
        scope, dot, _ = key.partition(".")
        if not dot and key in bare:
            if chosen is not None and key in chosen.own_keys():
                out[f"{chosen.name}.{key}"] = value
        elif not (dot and scope in methods and (chosen is None or scope != chosen.name)):
            out[key] = value
    defaults = RunConfig().to_mapping()
    return {**{k: defaults[k] for k in shared if k in defaults and k not in out}, **out}


def _own_settings(values: dict[str, Any], algorithm: str, chosen: Any, shared: list[str],
                  declared: set[str]) -> dict[str, Any]:
    """The running method's own settings (its keys, unscoped) from the run config's keys beyond the
    shared ones. Each must be ``<method>.<key>`` of a method known here: a registered one or the
    running one (a method of yours that is not running: left unread where the app's config
    declares it, ``declared``). Another method's key must keep its default: it is never read, so a
    value set there would be lost."""
    methods = dict(METHODS)
    if chosen is not None:
        methods.setdefault(chosen.name, chosen)
    tables: dict[str, dict[str, Any]] = {}
    unknown = []
    for key, value in values.items():
        scope, dot, own = key.partition(".")
        if dot and scope in methods:
            tables.setdefault(scope, {})[own] = value
        elif not (dot and key in declared):
            unknown.append(key)
    if unknown:
        raise ValueError(_unknown_keys(sorted(unknown), shared, methods, algorithm, chosen))
    for name, given in tables.items():
        cls = methods[name]
        common = [k for k in given if k in shared and k not in cls.own_keys()]
        if common:
            raise ValueError(f"{', '.join(f'{name}.{k}' for k in common)}: {', '.join(common)} is a key every method "
                             f"reads, written without a method's name ({common[0]} = ...); the own keys of algorithm "
                             f"{name!r}: {', '.join(cls.run_config_keys()) or 'none'}")
        parsed = cls.parse_options(given, prefix=f"{name}.")  # its own checks: unknown keys, bad values
        if cls is chosen:
            continue
        for key, f in cls.own_keys().items():
            if key in given and getattr(parsed, f.name) != f.default:
                mine = f"; the running method's own is {chosen.name}.{key}" if chosen and key in chosen.own_keys() else ""
                raise ValueError(f"{name}.{key} = {given[key]!r} is a setting of algorithm {name!r}, not of the running "
                                 f"algorithm {algorithm!r} (set algorithm = \"{name}\", or leave {name}.{key} at its "
                                 f"default {f.default!r}{mine})")
    return tables.get(chosen.name, {}) if chosen is not None else {}


def _unknown_keys(unknown: list[str], shared: list[str], methods: dict[str, Any], algorithm: str, chosen: Any) -> str:
    """The error for keys that are neither shared nor a known method's own, with what was likely meant."""
    scoped = [k for cls in methods.values() for k in cls.run_config_keys()]
    hints = []
    for key in unknown:
        scope, dot, own = key.partition(".")
        owners = [f"{name}.{key}" for name, cls in methods.items() if key in cls.own_keys()]
        if not dot and owners:
            mine = (f"the running algorithm {algorithm!r} reads {chosen.name}.{key}" if chosen and key in chosen.own_keys()
                    else f"the running algorithm {algorithm!r} has no key {key!r}")
            hints.append(f"{key!r} is a method's own key, written under the method's name: {', '.join(owners)} ({mine})")
        elif dot and NAME.fullmatch(scope) and scope not in methods:
            close = difflib.get_close_matches(scope, list(methods), n=1, cutoff=0.6)
            hints.append(f"{key!r}: no method named {scope!r} here" + (f" (did you mean {close[0]!r}?)" if close else "")
                         + f"; a method's own keys are <name>.<key> of {', '.join(methods)}")
        else:
            close = difflib.get_close_matches(key, [*shared, *scoped], n=1, cutoff=0.7)
            if close:
                hints.append(f"did you mean {close[0]!r} for {key!r}?")
    return (f"unknown config key(s) {unknown}{''.join(f' ({h})' for h in hints)}; known keys: "
            f"{', '.join([*shared, *scoped])} (README, Configuration)")


def _complete(c: RunConfig) -> None:
    """The chosen method's defaults for shared keys left at the shared default (SCAFFOLD: clip
    off), and its own settings completed with their defaults and checked."""
    try:
        chosen = method(c.algorithm)
    except (ValueError, TypeError):
        return  # refused by _validate, naming the known methods or what is wrong with the path
    hyper = chosen.with_shared_defaults(c.hyper)
    for f in dataclasses.fields(Hyper):
        if getattr(c, f.name) != getattr(hyper, f.name):
            object.__setattr__(c, f.name, getattr(hyper, f.name))
    parsed = chosen.parse_options(dict(c.options), prefix=f"{chosen.name}.")
    object.__setattr__(c, "options", tuple((k, getattr(parsed, f.name)) for k, f in chosen.own_keys().items()))


def shared_default_notes(cfg: RunConfig, values: Mapping[str, Any], explicit: Collection[str] | None = None) -> list[str]:
    """One line for each shared key whose value the chosen method's own default replaced (``Algorithm.
    shared_defaults``: ``algorithm = "scaffold"`` with ``clip = 0.3`` runs unclipped). ``cfg``: the run
    config parsed from ``values``, its keys; ``explicit``: the keys the user set (the engine's overrides):
    only those are named, as set explicitly. None: not known (a ServerApp gets every key, defaults
    included): every replacement is named, said to be set or left at the shared default."""
    fields = {f.metadata["key"]: f for f in dataclasses.fields(RunConfig) if f.metadata["key"] is not None}
    notes = []
    for key in method(cfg.algorithm).shared_defaults:
        if key not in values or key not in fields or (explicit is not None and key not in explicit):
            continue
        given, used = _coerce(key, fields[key].type, values[key]), getattr(cfg, fields[key].name)
        if given == used:
            continue
        how = "set explicitly" if explicit is not None else "set in the run config, or left at the shared default"
        notes.append(f"algorithm {cfg.algorithm!r} runs with {key} = {_shown(key, used)}, its own default: the run's "
                     f"{key} = {_shown(key, given)} ({how}) equals the shared default, which a method's own default "
                     "replaces")
    return notes


def _shown(key: str, value: Any) -> str:
    return "off" if key == "clip" and isinstance(value, float) and math.isinf(value) else f"{value!r}"


def _coerce(key: str, typ: Any, value: Any) -> Any:
    typ = str(typ)
    if typ == "bool":
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ValueError(f"{key} must be true or false, got {value!r}")
    if typ == "int":
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"{key} must be an integer, got {value!r}")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"{key} must be an integer, got {value!r}") from None
        if not number.is_integer():
            raise ValueError(f"{key} must be an integer, got {value!r}")
        return int(number)
    if typ == "float":
        if key == "clip" and isinstance(value, str) and value.strip().lower() in ("off", "inf", "none"):
            return math.inf
        if isinstance(value, bool):
            raise ValueError(f"{key} must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ValueError(f"{key} must be a number, got {value!r}") from None
    if typ == "tuple[float, ...]":
        parts = value if isinstance(value, (list, tuple)) else str(value).replace(";", ",").split(",")
        try:
            return tuple(float(p) for p in parts if str(p).strip())
        except ValueError:
            raise ValueError(f"{key} must be comma-separated numbers like \"80,120\", got {value!r}") from None
    if not isinstance(value, str):
        raise ValueError(f"{key} must be a string, got {value!r}")
    return value


#: what a run-name may hold: one path component, nothing a shell or a path would read as more
_SAFE_NAME = re.compile(r"[A-Za-z0-9_.+=@, -]{1,200}")


def safe_component(name: str) -> bool:
    """Whether ``name`` is one safe folder name (not ``.``/``..``, no separator, no leading ``-``)."""
    return bool(_SAFE_NAME.fullmatch(name)) and name not in (".", "..") and not name.startswith(("-", " "))


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def node_aggregation_problem(c: RunConfig) -> str | None:
    """Why ``node-aggregation`` cannot run with ``c``, or None."""
    if c.aggregation not in ("uniform", "examples"):
        return f"needs aggregation = \"uniform\" or \"examples\" (a node cannot sum a robust statistic), got {c.aggregation!r}"
    if c.dp.enabled:
        return "needs dp-noise-multiplier = 0: a DP round needs every client's own update"
    if not method(c.algorithm).node_sums:
        return (f"needs a method whose server only averages the replies "
                f"({', '.join(n for n, m in METHODS.items() if m.node_sums)}), "
                f"got algorithm {c.algorithm!r}")
    return None


def _validate(c: RunConfig) -> None:
    def one_of(key: str, value: str, allowed: tuple[str, ...]) -> None:
        _check(value in allowed, f"{key} must be one of {', '.join(allowed)}, got {value!r}")

    def at_least(key: str, value: int, low: int) -> None:
        _check(isinstance(value, int) and value >= low, f"{key} must be an integer >= {low}, got {value!r}")

    _check(c.task in TASKS or TASK_PATH.fullmatch(c.task) is not None,
           f"task must be one of {', '.join(TASKS)} or an import path \"package.module:factory\", got {c.task!r}")
    name = method(c.algorithm).name  # a registered method or an import path that gives one; else an error naming them
    _check(name not in shared_keys() and name != "sweep" and not name.startswith("engine-"),
           f"algorithm {c.algorithm!r} is named {name!r}, which scopes its own keys ({name}.<key>) and so may not be a "
           "run-config key, 'sweep' (an experiment file's table) or start with 'engine-' (the engine's keys)")
    one_of("partitioner", c.partitioner, PARTITIONERS)
    one_of("device", c.device, DEVICES)
    one_of("client-state", c.client_state, CLIENT_STATES)
    one_of("text-split", c.text_split, TEXT_SPLITS)
    one_of("transport", c.transport, TRANSPORTS)
    if c.node_aggregation:
        why = node_aggregation_problem(c)
        if why:
            raise ValueError(f"node-aggregation = true {why}")
    at_least("nonmono", c.nonmono, 1)
    at_least("num-clients", c.num_clients, 0)
    at_least("num-rounds", c.num_rounds, 1)
    at_least("eval-every", c.eval_every, 1)
    at_least("seed", c.seed, 0)
    at_least("min-replies", c.min_replies, 0)
    at_least("checkpoint-every", c.checkpoint_every, 0)
    at_least("eval-subsample", c.eval_subsample, 1)
    at_least("dirichlet-min-size", c.dirichlet_min_size, 0)
    _check(isinstance(c.valid_fraction, float) and 0 <= c.valid_fraction < 0.5,
           f"valid-fraction must be in [0, 0.5) (the share of each client's training data held out), got {c.valid_fraction!r}")
    _check(not (c.resume and c.average_iterates), "resume=true with average-iterates=true is not supported: the running "
           "mean of the iterates is not checkpointed (resume with average-iterates=false, or run without resume)")
    _check(not c.resume or bool(c.run_name), "resume=true needs a fixed run-name (the folder holding the checkpoint)")
    _check(isinstance(c.run_name, str) and (not c.run_name or safe_component(c.run_name)),
           f"run-name must be one folder name inside results-dir (letters, digits, spaces and . _ - + = @ ,, not . or .., "
           f"no / or \\ and no leading - or space), got {c.run_name!r}")
    _check(not c.num_clients or c.min_replies <= c.num_clients,
           f"min-replies ({c.min_replies}) must be <= num-clients ({c.num_clients})")
    at_least("clients-per-round", c.clients_per_round, 0)
    _check(not c.num_clients or c.clients_per_round <= c.num_clients,
           f"clients-per-round ({c.clients_per_round}) must be <= num-clients ({c.num_clients}) (0: all of them)")
    _check(not c.clients_per_round or c.min_replies <= c.clients_per_round,
           f"min-replies ({c.min_replies}) must be <= clients-per-round ({c.clients_per_round}): only the sampled "
           "clients reply in a round")
    hyper = c.hyper  # the training hyper-parameters' own checks (strategies.core.settings.Hyper)
    for problem in method(c.algorithm).problems(hyper) + method(c.algorithm).config_problems(c):
        _check(False, problem)
    one_of("dp-buffers", c.dp_buffers, BUFFER_CHOICES)
    for problem in c.dp.problems() + method_problems(c.dp, method(c.algorithm), hyper, c.num_clients, c.per_round,
                                                   c.method_options):
        _check(False, problem)
    _check(0 <= c.similarity <= 100, f"similarity must be in [0, 100], got {c.similarity}")
    _check(math.isfinite(c.dirichlet_alpha) and c.dirichlet_alpha > 0, f"dirichlet-alpha must be > 0, got {c.dirichlet_alpha}")
    _check(c.node_wait > 0, f"node-wait must be > 0 seconds, got {c.node_wait}")
    _check(c.round_timeout > 0, f"round-timeout must be > 0 seconds, got {c.round_timeout}")
    if c.text_split == "contiguous":
        _check(c.task in ("ptb", "wikitext2"), f"text-split = \"contiguous\" splits a text corpus (ptb, wikitext2), not task {c.task!r}")
        _check(c.partitioner == "homogeneous", "text-split = \"contiguous\" is a homogeneous split: it needs partitioner "
               f"\"homogeneous\", got {c.partitioner!r} (similarity 0 already gives each client one region)")


