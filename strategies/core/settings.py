"""The settings of a run's training and of one round, each with ONE owner (pure, no flwr).

``Hyper`` -- the training hyper-parameters of a run: I, b, eta, gamma, lambda, mu, the
schedule (decay, milestones) and the aggregation. Their defaults live here and nowhere else:
``tasks.config.RunConfig`` takes its defaults from ``Hyper`` and validates through it, and
the Flower strategies build one from their arguments. Every error names the TOML key and
the allowed range (``local-steps must be an integer >= 1, got 0``).

``Mode`` -- what a client does in one exchange of a round (the round config's ``mode``).

``RoundSettings`` -- what the server sends every client in one exchange, already scheduled:
it builds the round's ``ConfigRecord`` entries (``to_config``) and reads them back
(``from_config``, an error naming every missing or bad key). ``OWNED_KEYS`` -- the round-config
keys a strategy sets itself, so a caller's ``train_config`` may not -- is derived from its fields.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .averaging import AGGREGATIONS
from .clipped_sgd import StepConfig

__all__ = ["OWNED_KEYS", "ConfigError", "Hyper", "Mode", "RoundSettings"]


class ConfigError(ValueError):
    """The round's config lacks or mangles the settings of local clipped SGD."""


class Mode(str, enum.Enum):
    """What a client does in one exchange (the ``mode`` the round config carries)."""

    LOCAL = "local"                  # I local steps of clipped SGD; the reply: the model's state
    GRADIENT = "gradient"            # the gradient at the received point on the round's minibatch (naive)
    RESAMPLE = "episode-resample"    # EPISODE's G_r^i: a gradient on a minibatch of the resample stream
    EPISODE = "episode"              # I EPISODE steps with the correction c_i and the round's one clip decision
    SCAFFOLD = "scaffold"            # I SCAFFOLD steps corrected by c - c_i; the reply adds the control update

    def __str__(self) -> str:
        return self.value


def _key(key: str, doc: str, **kw: Any) -> Any:
    return field(metadata={"key": key, "doc": doc}, **kw)


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class Hyper:
    """The training hyper-parameters of a run, validated once (defaults: the project's run)."""

    local_steps: int = _key("local-steps", "I, local steps between averagings", default=8)
    batch_size: int = _key("batch-size", "minibatch size per client and step", default=32)
    lr: float = _key("lr", "eta, learning rate", default=0.3)
    clip: float = _key("clip", "gamma, clipping threshold; \"off\" or \"inf\" disables clipping", default=0.3)
    weight_decay: float = _key("weight-decay", "lambda, L2 weight decay", default=0.0)
    momentum: float = _key("momentum", "mu, heavy-ball momentum as torch.optim.SGD (0 in the paper)", default=0.0)
    lr_decay: float = _key("lr-decay", "factor applied to lr AND clip at each milestone", default=0.1)
    lr_milestones: tuple[float, ...] = _key("lr-milestones", "global epochs of the decays, comma separated (\"80,120\")",
                                            default=())
    aggregation: str = _key("aggregation", "uniform (the paper), examples (weighted by examples), median or trimmed-mean "
                            "(coordinate-wise, robust to lying clients: strategies.core.robust_statistics)", default="uniform")
    trim_fraction: float = _key("trim-fraction", "beta of aggregation = \"trimmed-mean\": floor(beta n) values dropped "
                                "at each end of every coordinate, in [0, 0.5)", default=0.2)

    def __post_init__(self) -> None:
        for message in self.problems():
            raise ValueError(message)

    def problems(self) -> list[str]:
        """Every invalid value, as a message naming its key and range."""
        out = []
        if not (_is_int(self.local_steps) and self.local_steps >= 1):
            out.append(f"local-steps must be an integer >= 1, got {self.local_steps!r}")
        if not (_is_int(self.batch_size) and self.batch_size >= 1):
            out.append(f"batch-size must be an integer >= 1, got {self.batch_size!r}")
        for name in ("lr", "clip", "weight_decay", "momentum"):
            if not _is_real(getattr(self, name)):
                out.append(f"{name.replace('_', '-')} must be a number, got {getattr(self, name)!r}")
        if not out:
            try:  # the step's own checks: lr, clip, weight decay, momentum (strategies.core.clipped_sgd)
                StepConfig(lr=self.lr, clip=self.clip, weight_decay=self.weight_decay, momentum=self.momentum)
            except ValueError as exc:
                out.append(str(exc))
        if not (_is_real(self.lr_decay) and 0 < self.lr_decay <= 1):
            out.append(f"lr-decay must be in (0, 1], got {self.lr_decay!r}")
        milestones = list(self.lr_milestones)
        if not all(_is_real(m) and math.isfinite(m) and m > 0 for m in milestones):
            out.append(f"lr-milestones must be global epochs > 0, got {tuple(milestones)}")
        elif milestones != sorted(milestones):
            out.append(f"lr-milestones must be increasing, got {tuple(milestones)}")
        if self.aggregation not in AGGREGATIONS:
            out.append(f"aggregation must be one of {', '.join(AGGREGATIONS)}, got {self.aggregation!r}")
        if not (_is_real(self.trim_fraction) and 0 <= self.trim_fraction < 0.5):
            out.append(f"trim-fraction must be in [0, 0.5), got {self.trim_fraction!r}")
        return out

    @classmethod
    def from_arguments(cls, **values: Any) -> Hyper:
        """A ``Hyper`` from Python arguments: an error names the argument (``local_steps``)."""
        try:
            return cls(**values)
        except ValueError as exc:
            key, _, rest = str(exc).partition(" ")
            raise ValueError(f"{cls.keys().get(key, key)} {rest}") from None

    @property
    def clipping(self) -> bool:
        return not math.isinf(self.clip)

    def step(self, lr: float | None = None, clip: float | None = None) -> StepConfig:
        """The step's settings (the run's, or a round's scheduled lr and clip)."""
        return StepConfig(lr=self.lr if lr is None else lr, clip=self.clip if clip is None else clip,
                          weight_decay=self.weight_decay, momentum=self.momentum)

    def replace(self, **changes: Any) -> Hyper:
        return dataclasses.replace(self, **changes)

    @classmethod
    def keys(cls) -> dict[str, str]:
        """TOML key -> field name."""
        return {f.metadata["key"]: f.name for f in dataclasses.fields(cls)}


#: the defaults of every hyper-parameter (what ``RunConfig`` and the strategies start from)
DEFAULTS = Hyper()


@dataclass(frozen=True)
class RoundSettings:
    """One exchange's settings, as the server sends them (already scheduled)."""

    server_round: int = _key("server-round", "the round (FedAvg's contract: every config carries it)")
    local_steps: int = _key("local-steps", "I, the local steps of this exchange (1 for a gradient)")
    batch_size: int = _key("batch-size", "minibatch size")
    lr: float = _key("lr", "eta of the round (scheduled)")
    clip: float = _key("clip", "gamma of the round (scheduled; inf: no clipping)")
    weight_decay: float = _key("weight-decay", "lambda")
    momentum: float = _key("momentum", "mu")
    mode: Mode = _key("mode", "what the client does in this exchange", default=Mode.LOCAL)
    global_grad_norm: float | None = _key("global-grad-norm", "EPISODE: the norm of G_r, the round's clip decision",
                                          default=None)
    algorithm: str | None = _key("algorithm", "the method whose client side answers (its registry name): a client "
                                 "runs exactly that method's code for the exchange of ``mode``", default=None)
    #: the round config's other entries: the method's own settings (``Algorithm.Settings``, written by the
    #: server, read by its client side) and any a caller adds; not a key of its own
    extra: dict[str, Any] = field(default_factory=dict, hash=False, metadata={"key": None, "doc": "other entries"})

    def __post_init__(self) -> None:
        if not isinstance(self.mode, Mode):
            object.__setattr__(self, "mode", Mode(self.mode))

    @property
    def step(self) -> StepConfig:
        """The step's hyper-parameters (checked: lr > 0, clip > 0, ...)."""
        return StepConfig(lr=self.lr, clip=self.clip, weight_decay=self.weight_decay, momentum=self.momentum)

    def replace(self, **changes: Any) -> RoundSettings:
        return dataclasses.replace(self, **changes)

    def to_config(self) -> dict[str, Any]:
        """The round-config entries (``mode`` only where it is not ``local``, the default a
        client reads; ``global-grad-norm`` and ``algorithm`` only where set)."""
        out: dict[str, Any] = {}
        for f in _FIELDS:
            value = getattr(self, f.name)
            if value is None or value is Mode.LOCAL:
                continue
            out[f.metadata["key"]] = value.value if isinstance(value, Mode) else value
        return {**out, **self.extra}

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> RoundSettings:
        """The settings of a round's ConfigRecord; an error names every missing or bad key."""
        missing = [k for k in REQUIRED_KEYS if k not in config]
        if missing:
            raise ConfigError(
                f"the round's config lacks {', '.join(repr(k) for k in missing)}: this ClientApp runs local clipped SGD "
                "and needs the CELGC (or NaiveParallelClip) strategy of `strategies` in the ServerApp, which sends "
                f"{', '.join(REQUIRED_KEYS)} every round"
            )
        ints = {k: config[k] for k in ("server-round", "local-steps", "batch-size")}
        bad = [f"{k}={v!r}" for k, v in ints.items() if not _is_int(v) or v < (0 if k == "server-round" else 1)]
        reals = {k: config[k] for k in ("lr", "clip", "weight-decay", "momentum")}
        bad += [f"{k}={v!r}" for k, v in reals.items() if not _is_real(v)]
        if bad:
            raise ConfigError(f"the round's config has bad values: {', '.join(bad)} (integers for server-round, "
                              "local-steps >= 1, batch-size >= 1; numbers for lr, clip, weight-decay, momentum)")
        mode = config.get("mode", Mode.LOCAL.value)
        try:
            mode = Mode(mode)
        except ValueError:
            raise ConfigError(f"the round's config has mode={mode!r}; known modes: "
                              f"{', '.join(m.value for m in Mode)}") from None
        algorithm = config.get("algorithm")
        if algorithm is not None and not (isinstance(algorithm, str) and algorithm):
            raise ConfigError(f"the round's config has algorithm={algorithm!r}: the name of a method")
        norm = config.get("global-grad-norm")
        if mode is Mode.EPISODE and not (_is_real(norm) and math.isfinite(norm) and norm >= 0):
            raise ConfigError(f"mode 'episode' needs global-grad-norm, a finite number >= 0, got {norm!r}")
        settings = cls(server_round=int(ints["server-round"]), local_steps=int(ints["local-steps"]),
                       batch_size=int(ints["batch-size"]), lr=float(reals["lr"]), clip=float(reals["clip"]),
                       weight_decay=float(reals["weight-decay"]), momentum=float(reals["momentum"]), mode=mode,
                       global_grad_norm=float(norm) if norm is not None and mode is Mode.EPISODE else None,
                       algorithm=algorithm, extra={k: v for k, v in config.items() if k not in _KEYS})
        settings.step  # noqa: B018 -- the step's own checks (lr > 0, clip > 0, ...)
        return settings


#: the fields of RoundSettings that are round-config keys, and those keys
_FIELDS = tuple(f for f in dataclasses.fields(RoundSettings) if f.metadata["key"] is not None)
_KEYS = frozenset(f.metadata["key"] for f in _FIELDS)

#: the round-config keys every clipped-SGD client needs
REQUIRED_KEYS: tuple[str, ...] = tuple(f.metadata["key"] for f in _FIELDS if f.default is dataclasses.MISSING)

#: round-config key -> the strategy argument that sets it (a caller's train_config may not set these);
#: ``server-round`` is FedAvg's own and always overwritten
OWNED_KEYS: dict[str, str] = {
    f.metadata["key"]: (f.name if f.name in {g.name for g in dataclasses.fields(Hyper)} else "(the strategy's class)")
    for f in _FIELDS if f.name != "server_round"
}

