"""Which engine adapter each `backend` key names: an explicit registry, imported lazily.

Names are checked when a recipe loads (before any run directory is made); the adapter
module is imported only when a run builds the engine.
"""

from __future__ import annotations

import importlib
from typing import Any

ROLLOUT = {"hf": "tidal.engines.hf_rollout:HFRolloutEngine"}
"""rollout.backend -> adapter (vllm arrives with its adapter)."""
TRAIN = {"torch": "tidal.engines.torch_train:TorchTrainEngine", "fsdp": "tidal.engines.fsdp_train:FSDPTrainEngine"}
"""train.backend -> adapter."""
MULTI_RANK = frozenset({"fsdp"})
"""train.backend values that train over several processes, one per `placement.train` instance."""
REGISTRIES = {"rollout.backend": ROLLOUT, "train.backend": TRAIN}


def unknown(key: str, value: str) -> str | None:
    """An error message when `value` is not a registered backend for `key`, else None."""
    registry = REGISTRIES[key]
    if value in registry:
        return None
    return f"{key}={value!r} is not available in this version; choices: {', '.join(sorted(registry))}"


def load(key: str, value: str) -> Any:
    """The adapter class registered for `value` under `key`."""
    message = unknown(key, value)
    if message:
        raise ValueError(message)
    module, _, name = REGISTRIES[key][value].partition(":")
    return getattr(importlib.import_module(module), name)
