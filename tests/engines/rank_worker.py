"""The steps every multi-rank engine test of this folder takes, in its rank processes and, as
the reference, on a `TorchTrainEngine` (`conftest.run_torch`). `conftest.spawn_ranks` copies
this file beside each worker script (a rank's process cannot import `tests.*`), which imports
it as `rank_worker`."""

from __future__ import annotations

from typing import Any

import torch

from tidal.flow.algorithms import PolicyLossConfig
from tidal.flow.trajectory import TokenBatch


def run_plan(engine: Any, batch: TokenBatch, advantages: torch.Tensor, plan: list) -> list[dict[str, float]]:
    """Each step of `plan` on `engine`: "sft" a supervised step, a dict an RL step with those
    `PolicyLossConfig` fields (and the advantages times its "scale"), its proximal logprobs the
    engine's before the step. Returns each step's metrics."""
    metrics = []
    for step in plan:
        if step == "sft":
            metrics.append(engine.sft_step(batch))
        else:
            proximal = engine.logprobs(batch)
            fields = dict(step)
            scaled = advantages * fields.pop("scale", 1.0)
            metrics.append(engine.train_step(batch, scaled, loss=PolicyLossConfig(**fields), proximal_logprobs=proximal))
    return metrics


def export(engine: Any) -> list[tuple[str, torch.Tensor]]:
    """A copy of every weight `engine.named_weights()` gives (a collective for a sharded engine)."""
    return [(name, tensor.clone()) for name, tensor in engine.named_weights()]
