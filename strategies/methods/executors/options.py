"""How a backend runs its clients (``engine-*`` keys): the execution path and its switches.

The run itself is the shared ``RunConfig`` (same TOML keys as ``flwr run``); these keys only
choose HOW the clients of an engine process or of a multi-client SuperNode execute it and
never change the method. The engine takes them as ``--run-config "engine-cuda-graphs=true
..."`` next to the run's keys (``split_engine_keys`` splits them off before the ``RunConfig``
is built); a ClientApp runs with the defaults (``auto``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

PATHS = ("auto", "vmap", "sequential")
RANDOMNESS = ("error", "different", "same")
PREFIX = "engine-"


def _key(name: str, doc: str, **kw: Any) -> Any:
    return field(metadata={"key": name, "doc": doc}, **kw)


@dataclass(frozen=True)
class EngineOptions:
    """How the clients placed on one device run (an engine process, a multi-client SuperNode)."""

    path: str = _key("engine-path", "auto, vmap or sequential; auto: on CUDA vmap when the model allows it, else "
                     "(and on the CPU) one client after another", default="auto")
    bf16: bool = _key("engine-bf16", "forward under bf16 autocast (vmap path); fp32 parameters and update",
                      default=False)
    channels_last: bool = _key("engine-channels-last", "channels-last weights and images (vmap path)", default=False)
    cuda_graphs: bool = _key("engine-cuda-graphs", "capture the vmapped local step in a CUDA graph (CUDA only)",
                             default=False)
    randomness: str = _key("engine-randomness", "vmap randomness: error (random models go sequential), "
                           "different or same", default="error")
    streams: bool = _key("engine-streams", "sequential path on CUDA: one stream per client", default=True)

    def __post_init__(self) -> None:
        if self.path not in PATHS:
            raise ValueError(f"engine-path must be one of {', '.join(PATHS)}, got {self.path!r}")
        if self.randomness not in RANDOMNESS:
            raise ValueError(f"engine-randomness must be one of {', '.join(RANDOMNESS)}, got {self.randomness!r}")
        for f in dataclasses.fields(self):
            if f.type in ("bool", bool) and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"{f.metadata['key']} must be true or false, got {getattr(self, f.name)!r}")
        if self.path == "sequential" and (self.bf16 or self.channels_last or self.cuda_graphs):
            raise ValueError("engine-bf16, engine-channels-last and engine-cuda-graphs apply to the vmap path; "
                             "they cannot be combined with engine-path=sequential")

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> EngineOptions:
        fields = {f.metadata["key"]: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise ValueError(f"unknown engine key(s) {unknown}; known: {', '.join(fields)}")
        kwargs = {}
        for key, value in values.items():
            if fields[key].type in ("bool", bool) and isinstance(value, str) and value.lower() in ("true", "false"):
                value = value.lower() == "true"
            kwargs[fields[key].name] = value
        return cls(**kwargs)

    def to_mapping(self) -> dict[str, Any]:
        return {f.metadata["key"]: getattr(self, f.name) for f in dataclasses.fields(self)}


def split_engine_keys(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(run-config keys, engine-* keys)."""
    run = {k: v for k, v in values.items() if not k.startswith(PREFIX)}
    engine = {k: v for k, v in values.items() if k.startswith(PREFIX)}
    return run, engine
