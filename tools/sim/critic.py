"""The critic of PPO (`algorithm.advantage=gae`) in `tidal simulate`: a value model the policy's
size on the trainer's devices, whose passes are modelled time there, as the real critics run
(`engines.critic`, `engines.fsdp_critic`, `engines.deepspeed_critic`): each step a forward
pass over the step's rows (the values, a third of a training step's FLOPs) before the policy
trains, and a training step over all of them after it (the critic trains every row, whatever
its advantage). Time-shared devices park its training state with the trainer's.
"""

from __future__ import annotations

from typing import Any

import torch

from tidal.flow.trajectory import TokenBatch
from tidal.tools.sim import costs
from tidal.tools.sim.engines import SimTrainEngine


class SimCritic:
    """A `flow.protocols.Critic` of modelled time on `trainer`'s devices (module docstring)."""

    def __init__(self, trainer: SimTrainEngine) -> None:
        self.trainer = trainer

    def values(self, batch: TokenBatch) -> torch.Tensor:
        """Zeros after a forward pass's time, as the trainer's `logprobs`."""
        return self.trainer.logprobs(batch)

    def train_step(self, batch: TokenBatch, returns: torch.Tensor, old_values: torch.Tensor) -> dict[str, float]:
        t = self.trainer
        seconds = costs.train_step_s(t.shape, t.device, num_devices=t.num_devices, num_nodes=t.num_nodes, tokens=t.step_tokens(batch), eff=t.eff, recompute=t.train_shape.recompute)
        return {"critic_s": t.busy(seconds)}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
