"""The trainer's side of `tidal simulate`: the policy's train engine and PPO's critic, flow's
protocols with modelled durations on the trainer's devices (`tools.sim.engines` has rollout's).

PPO's critic (`algorithm.advantage=gae`) is a value model the policy's size on the trainer's
devices, whose passes are modelled time there, as the real critics run (`engines.critic`,
`engines.fsdp_critic`, `engines.deepspeed_critic`): each step a forward pass over the step's
rows (the values, a third of a training step's FLOPs) before the policy trains, and a training
step over all of them after it (the critic trains every row, whatever its advantage).
Time-shared devices park its training state with the trainer's.
"""

from __future__ import annotations

from typing import Any

import torch

from tidal.engines.train_steps import rows_with_signal
from tidal.flow.algorithms import PolicyLossConfig
from tidal.flow.clock import Clock
from tidal.flow.trajectory import TokenBatch
from tidal.tools.sim import costs
from tidal.tools.sim.costs import DEFAULT_EFFICIENCY, Efficiency, ModelShape
from tidal.tools.sim.engines import Beside
from tidal.tools.sim.hardware import Device


class SimTrainEngine:
    """A `flow.protocols.TrainEngine` whose steps are modelled time; the weights are not materialised.

    Args:
        clock: the simulation's clock.
        model: the policy's shape.
        device: each training device.
        num_devices: data-parallel devices of the trainer, all nodes together.
        num_nodes: nodes they span (the gradient all-reduce crosses the network when > 1).
        eff: efficiency factors of the cost models.
        token_scale: real tokens per simulated token.
        prompt_tokens_real: the real length of every prompt, when the batch's prompts are
            placeholders; None: a prompt's simulated tokens x `token_scale`.
        beside: the roles at work on the host the trainer shares with rollout, if it shares
            one (its work slows by `eff.train_beside_rollout` beside rollout's).
        train_shape: how the recipe's train engine cuts a step into micro-batches (padded
            or not, `costs.TrainShape`); a step costs the tokens its busiest rank computes
            (`costs.step_tokens`) times the ranks. Default: padding-free.
    """

    def __init__(
        self,
        *,
        clock: Clock,
        model: ModelShape,
        device: Device,
        num_devices: int = 1,
        num_nodes: int = 1,
        eff: Efficiency = DEFAULT_EFFICIENCY,
        token_scale: int = 1,
        prompt_tokens_real: int | None = None,
        beside: Beside | None = None,
        train_shape: costs.TrainShape | None = None,
    ) -> None:
        if token_scale < 1:
            raise ValueError(f"token_scale must be >= 1, got {token_scale}")
        self.train_shape = train_shape or costs.TrainShape()
        self.clock, self.shape, self.device, self.eff = clock, model, device, eff
        self.num_devices, self.num_nodes, self.token_scale, self.prompt_tokens_real = num_devices, num_nodes, token_scale, prompt_tokens_real
        self.beside = beside or Beside(clock)
        self.version = 0
        self.stats: dict[str, float] = {"busy_s": 0.0}

    def row_tokens(self, batch: TokenBatch) -> list[int]:
        """Each row's real tokens: its prompt and response."""
        if self.prompt_tokens_real is None:
            return (batch.attention_mask.sum(dim=1) * self.token_scale).tolist()
        return (self.prompt_tokens_real + batch.loss_mask.sum(dim=1) * self.token_scale).tolist()

    def step_tokens(self, batch: TokenBatch) -> int:
        """Tokens a pass over `batch` computes, every rank as the busiest (`costs.step_tokens`)."""
        return costs.step_tokens(self.row_tokens(batch), ranks=self.num_devices, shape=self.train_shape)

    def train_step(self, batch: TokenBatch, advantages: torch.Tensor, *, loss: PolicyLossConfig, proximal_logprobs: torch.Tensor | None = None) -> dict[str, float]:
        """Sleep `costs.train_step_s` for the tokens the batch's step computes; version += 1.
        As the real engines, rows whose advantage is zero on every loss token (a GRPO group
        whose samples all got the same reward) get no pass unless `loss.zero_advantage_counts`:
        they cost nothing (`skipped_rows`)."""
        skipped = 0
        runs: TokenBatch | None = batch
        if not loss.zero_advantage_counts:
            among = rows_with_signal(advantages, batch.loss_mask)
            skipped = len(batch) - len(among)
            if skipped:
                runs = batch.select(among) if among.numel() else None
        if runs is None:  # nothing to train: the optimizer still steps
            self.version += 1
            return {"loss": 0.0, "train_s": 0.0, "skipped_rows": float(skipped)}
        tokens = self.step_tokens(runs)
        seconds = costs.train_step_s(self.shape, self.device, num_devices=self.num_devices, num_nodes=self.num_nodes, tokens=tokens, eff=self.eff, recompute=self.train_shape.recompute)
        self.stats["max_tokens"] = max(self.stats.get("max_tokens", 0), tokens)
        seconds = self.busy(seconds)
        self.version += 1
        return {"loss": 0.0, "train_s": seconds, "skipped_rows": float(skipped)}

    def frozen_step(self) -> None:
        """A step the policy sits out (`algorithm.critic_warmup`): no time; version += 1."""
        self.version += 1

    def logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """Zeros [batch, seq - 1] after a forward pass's time: a third of a step's FLOPs, no all-reduce."""
        flops = 2 * self.shape.num_params * self.step_tokens(batch)
        self.busy(flops / (self.num_devices * self.device.flops * self.eff.train_mfu))
        return torch.zeros(batch.loss_mask.shape, dtype=torch.float32)

    def logprobs_under_reference(self, batch: TokenBatch) -> torch.Tensor:
        """`logprobs`' time and zeros: the reference is the policy's size (`LogprobsUnderReference`)."""
        return self.logprobs(batch)

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """One tiny tensor: a simulated weight sync's time is the caller's (`SimRollouts`)."""
        return [("w", torch.zeros(1))]

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version = int(state["version"])

    def busy(self, seconds: float) -> float:
        """Sleep `seconds` of work on the trainer's devices (longer beside rollout's, `beside`); the seconds slept."""
        if seconds > 0:
            seconds = self.beside.run("train", seconds, self.eff)
        self.stats["busy_s"] += seconds
        return seconds


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
