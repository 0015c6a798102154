"""A step the policy sits out (`TakesFrozenSteps.frozen_step`, `algorithm.critic_warmup`)."""

from __future__ import annotations

import copy

import torch

from tests.engines.test_torch_train import _batch, tiny
from tidal.engines.registry import TRAIN, load
from tidal.engines.torch_train import TorchTrainEngine
from tidal.flow.algorithms import PolicyLossConfig
from tidal.flow.protocols import TakesFrozenSteps


def test_a_frozen_step_counts_a_version_and_changes_nothing_else():
    """`frozen_step` (`algorithm.critic_warmup`): every train backend has it; the torch engine's
    leaves weights, AdamW's state and the learning-rate schedule as they were, and the next
    real step is the one it would have taken without it, but for the version."""
    assert all(issubclass(load("train.backend", name), TakesFrozenSteps) for name in TRAIN)
    batch, advantages = _batch(), torch.tensor([1.0, -0.5, 0.25, -1.0])
    engines = [TorchTrainEngine(tiny(), lr=1e-2, micro_batch_size=2) for _ in range(2)]
    for engine in engines:
        engine.train_step(batch, advantages, loss=PolicyLossConfig())
    frozen, plain = engines
    before = copy.deepcopy(frozen.state_dict())
    frozen.frozen_step()
    after = frozen.state_dict()
    assert (frozen.version, plain.version) == (2, 1) and after["version"] == 2
    assert after["lr_scheduler"] == before["lr_scheduler"]
    assert all(torch.equal(after["model"][k], before["model"][k]) for k in before["model"])
    assert after["optimizer"]["state"][0]["step"] == before["optimizer"]["state"][0]["step"]
    metrics = [engine.train_step(batch, advantages, loss=PolicyLossConfig()) for engine in engines]
    assert metrics[0] == metrics[1]
    assert all(torch.equal(a, b) for a, b in zip(frozen.model.parameters(), plain.model.parameters(), strict=True))
