"""The `torch` train engine: plain torch on any hal platform, one process.

AdamW, gradient clipping, micro-batches with gradient accumulation, logprobs recomputed
with the current weights. The loss is `tidal.flow.algorithms.policy_loss`; micro-batch
losses are weighted by their share of the batch's loss tokens (token aggregations) or
sequences (sequence aggregations), so a step equals one full-batch step.

Run for real: CPU (tests and the CPU quickstart). On GPU/NPU platforms the model lives
on `platform.device(0)`; multi-process training is the `fsdp` engine's job.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from tidal.flow.algorithms import PolicyLossConfig, policy_loss
from tidal.flow.trajectory import TokenBatch
from tidal.hal import Platform, current_platform


class TorchTrainEngine:
    """A `TrainEngine` for a transformers-style causal LM (forward returns `.logits`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        grad_clip: float = 1.0,
        micro_batch_size: int = 8,
        temperature: float = 1.0,
        platform: Platform | None = None,
        version: int = 0,
    ) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        self.platform = platform or current_platform()
        self.device = self.platform.device(0)
        self.model = model.to(self.device).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay, betas=betas)
        self.grad_clip, self.micro_batch_size, self.temperature = grad_clip, micro_batch_size, temperature
        self.version = version

    def _token_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        batch = batch.to(self.device)
        logits = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        logprobs = torch.log_softmax(logits.float() / self.temperature, dim=-1)
        return logprobs.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)

    def _micro_batches(self, n: int) -> Iterator[slice]:
        for start in range(0, n, self.micro_batch_size):
            yield slice(start, min(start + self.micro_batch_size, n))

    @torch.no_grad()
    def logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """[batch, seq - 1] logprob of each next token under the current weights."""
        return torch.cat([self._token_logprobs(batch.select(mb)).cpu() for mb in self._micro_batches(len(batch))])

    def _step(self, batch: TokenBatch, micro_loss: Any, weight_of: Any) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        for mb in self._micro_batches(len(batch)):
            part = batch.select(mb)
            weight = weight_of(part)
            if weight == 0:
                continue
            loss, metrics = micro_loss(part, mb)
            (loss * weight).backward()
            for key, value in {"loss": float(loss.detach()), **metrics}.items():
                totals[key] = totals.get(key, 0.0) + weight * float(value)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        totals.update(grad_norm=float(grad_norm), lr=self.optimizer.param_groups[0]["lr"], num_tokens=float(batch.loss_mask.sum()))
        return totals

    def train_step(self, batch: TokenBatch, advantages: torch.Tensor, *, loss: PolicyLossConfig, proximal_logprobs: torch.Tensor | None = None) -> dict[str, float]:
        """One optimizer step over `batch`; version += 1."""
        num_tokens = float(batch.loss_mask.sum())
        num_sequences = float((batch.loss_mask.sum(1) > 0).sum())
        by_sequence = loss.aggregation.startswith("seq_") or loss.aggregation == "token_sum_norm"

        def weight_of(part: TokenBatch) -> float:
            if by_sequence:
                return float((part.loss_mask.sum(1) > 0).sum()) / max(num_sequences, 1.0) if loss.aggregation != "token_sum_norm" else len(part) / len(batch)
            return float(part.loss_mask.sum()) / max(num_tokens, 1.0)

        def micro_loss(part: TokenBatch, mb: slice) -> tuple[torch.Tensor, dict[str, float]]:
            logprobs = self._token_logprobs(part)
            return policy_loss(
                logprobs,
                advantages[mb].to(self.device),
                behavior_logprobs=part.behavior_logprobs.to(self.device),
                mask=part.loss_mask.to(self.device),
                proximal_logprobs=None if proximal_logprobs is None else proximal_logprobs[mb].to(self.device),
                config=loss,
            )

        metrics = self._step(batch, micro_loss, weight_of)
        self.version += 1
        return metrics

    def sft_step(self, batch: TokenBatch) -> dict[str, float]:
        """One supervised step: next-token cross-entropy on `loss_mask` tokens (version unchanged)."""
        num_tokens = float(batch.loss_mask.sum())

        def micro_loss(part: TokenBatch, mb: slice) -> tuple[torch.Tensor, dict[str, float]]:
            mask = part.loss_mask.to(self.device)
            return -(self._token_logprobs(part) * mask).sum() / mask.sum().clamp(min=1), {}

        return self._step(batch, micro_loss, lambda part: float(part.loss_mask.sum()) / max(num_tokens, 1.0))

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach()

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "version": self.version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
