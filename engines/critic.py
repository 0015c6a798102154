"""The critic of PPO with a learned value function (`algorithm.advantage=gae`): a copy of the
policy's transformer body with a linear value head, trained on each step's returns.

It starts from the policy's weights as the run's RL phase begins (verl and OpenRLHF start
their critic from the actor's checkpoint too), with a value head of zeros, so the first
values are 0 and the first advantages are the discounted rewards; or from another model
that reads the policy's tokens, a reward model say, whose score head becomes the value head
(OpenRLHF's default: the critic starts from the reward model). `Critic` runs in the
trainer's process, on its first device (the `torch` train backend; `engines.fsdp_critic` and
`engines.deepspeed_critic` are this critic over the ranks of the `fsdp` and `deepspeed`
backends, from this module's pieces); the workflow asks it for each step's values before the
policy trains, then trains it on that step's returns.

Its values sit where the policy's logprobs do (`TokenBatch`: column t is the choice of token
t + 1 after reading 0..t): the value at t is the head applied to the body's hidden state of
token t. The loss is `flow.algorithms.gae.value_loss` averaged over the step's loss tokens,
in micro-batches of `micro_batch_size` rows each cut to its longest row (as the train
engines cut theirs), then one AdamW step with the gradient's norm
clipped to `grad_clip`.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from typing import Any

import torch

from tidal.engines.micro_batches import pack, row_lengths
from tidal.engines.train_steps import evaluating, own_settings, padded_positions
from tidal.flow.algorithms.gae import explained_variance, value_loss
from tidal.flow.trajectory import TokenBatch
from tidal.hal import Platform, current_platform


class ValueModel(torch.nn.Module):
    """A transformer body (a transformers `PreTrainedModel`'s `base_model`) and a linear head
    giving one value per token."""

    def __init__(self, body: torch.nn.Module, hidden_size: int, *, head: torch.nn.Linear | None = None) -> None:
        super().__init__()
        self.body = body
        self._no_split_modules = list(getattr(body, "_no_split_modules", None) or ())  # its decoder layers: what FSDP shards one by one (`fsdp_setup.shard`)
        with torch.random.fork_rng(devices=[]):  # its draws would move the run's generator, which a resumed run has just restored
            self.head = torch.nn.Linear(hidden_size, 1)
        with torch.no_grad():  # zeros, or a one-label classifier's head (a reward model's score)
            self.head.weight.copy_(head.weight.float() if head is not None else torch.zeros_like(self.head.weight))
            self.head.bias.copy_(head.bias.float() if head is not None and head.bias is not None else torch.zeros_like(self.head.bias))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask, position_ids=padded_positions(attention_mask), use_cache=False).last_hidden_state
        return self.head(hidden.float()).squeeze(-1)


class Critic:
    """A value model trained on returns (module docstring).

    Args:
        policy: the model the critic starts from, a transformers `PreTrainedModel`: the
            policy (a causal LM), or another model that reads the policy's tokens (a reward
            model); its body is copied, not shared.
        head: a one-label linear head to start the value head from (a reward model's
            `score`); None: zeros.
        lr: AdamW's learning rate.
        value_clip: how far a value may move from the one the advantages were computed with
            before its loss stops pulling it (PPO's value clipping); None: no clipping.
        micro_batch_size: rows per forward and backward pass.
        grad_clip: largest gradient norm.
        weight_decay: AdamW's.
        precision: forward passes under `platform.autocast(precision)`; weights stay fp32.
        platform: where it runs (its first device).
    """

    def __init__(
        self, policy: Any, *, lr: float = 1e-5, value_clip: float | None = 0.5, micro_batch_size: int = 8, grad_clip: float = 1.0,
        weight_decay: float = 0.01, precision: str = "fp32", platform: Platform | None = None, head: torch.nn.Linear | None = None,
    ) -> None:  # fmt: skip
        self.platform = platform or current_platform()
        self.device, self.precision = self.platform.device(0), precision
        self.model = ValueModel(copy.deepcopy(policy.base_model), policy.config.hidden_size, head=head).to(self.device).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay, **self.platform.optimizer_options())
        self.value_clip, self.micro_batch_size, self.grad_clip = value_clip, micro_batch_size, grad_clip

    @torch.no_grad()
    def values(self, batch: TokenBatch) -> torch.Tensor:
        """`[batch, seq - 1]` float32 values on the host, 0 outside the loss tokens."""
        out = torch.zeros(batch.loss_mask.shape)
        with evaluating(self.model):
            for rows, columns in chunks(batch, self.micro_batch_size):
                out[rows, columns] = self._values(batch, rows, columns).cpu()
        return out * batch.loss_mask.bool()

    def _values(self, batch: TokenBatch, rows: slice, columns: slice) -> torch.Tensor:
        return value_pass(self.model, batch, rows, columns, device=self.device, autocast=self.platform.autocast(self.precision))

    def train_step(self, batch: TokenBatch, returns: torch.Tensor, old_values: torch.Tensor) -> dict[str, float]:
        """One optimizer step on the value loss of `batch` toward `returns` (`[batch, seq - 1]`,
        as `old_values`, the values the advantages were computed with)."""
        mask = batch.loss_mask.bool()
        num_tokens = int(mask.sum())
        self.optimizer.zero_grad(set_to_none=True)
        total, clipped = 0.0, 0
        for rows, columns in chunks(batch, self.micro_batch_size):
            if not mask[rows].any():
                continue
            loss, num_clipped = micro_value_loss(self._values(batch, rows, columns), (rows, columns), returns=returns, old_values=old_values, mask=mask, clip=self.value_clip)
            (loss / max(num_tokens, 1)).backward()
            total += float(loss.detach())
            clipped += int(num_clipped)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return step_metrics(total=total, clipped=clipped, grad_norm=grad_norm, returns=returns, old_values=old_values, mask=mask)

    def state_dict(self) -> dict[str, Any]:
        """The value model's weights and AdamW's state (host tensors: what a checkpoint saves)."""
        return {"model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()}, "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's state (`state_dict`); the optimizer keeps this critic's settings
        (`critic.lr` given now, the platform's fused AdamW: `own_settings`)."""
        self.model.load_state_dict(state["model"])
        with own_settings(self.optimizer):
            self.optimizer.load_state_dict(state["optimizer"])


def chunks(batch: TokenBatch, max_rows: int) -> Iterator[tuple[slice, slice]]:
    """A critic's micro-batches, cut as the train engines cut theirs (`micro_batches.pack`):
    (rows, the `[.., seq - 1]` columns up to their longest row's last real token)."""
    lengths = row_lengths(batch)
    for rows in pack(lengths.tolist(), max_rows=max_rows):
        yield rows, slice(0, max(int(lengths[rows].max()) - 1, 0))


def value_pass(model: torch.nn.Module, batch: TokenBatch, rows: slice, columns: slice, *, device: torch.device, autocast: Any) -> torch.Tensor:
    """The values of `batch[rows]` at `columns` (`chunks`), float32 on `device`: one forward pass under `autocast`."""
    width = columns.stop + 1
    ids, attention = batch.input_ids[rows, :width].to(device), batch.attention_mask[rows, :width].to(device)
    with autocast:
        return model(ids, attention)[:, :-1].float()


def micro_value_loss(predicted: torch.Tensor, cut: tuple[slice, slice], *, returns: torch.Tensor, old_values: torch.Tensor, mask: torch.Tensor, clip: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`value_loss` summed over the loss tokens of one micro-batch (`cut`: its rows and columns
    of the step's `returns`, `old_values` and loss `mask`), and how many it clipped."""
    device = predicted.device
    return value_loss(predicted, old_values[cut].to(device), returns[cut].to(device), mask[cut].to(device), clip=clip)


def step_metrics(*, total: float, clipped: int, grad_norm: float, returns: torch.Tensor, old_values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """A critic step's metrics: `total` value loss and `clipped` tokens (summed over the step's
    loss tokens), the gradient's norm, and the step's values, returns and how much of the
    returns' variance the values explained."""
    num_tokens = int(mask.sum())
    return {
        "value_loss": total / max(num_tokens, 1),
        "value_clipfrac": clipped / max(num_tokens, 1),
        "value_grad_norm": grad_norm,
        "values_mean": float(old_values[mask].mean()) if num_tokens else 0.0,
        "returns_mean": float(returns[mask].mean()) if num_tokens else 0.0,
        "explained_variance": explained_variance(old_values, returns, mask),
    }
