"""What every train engine shares: the step's checks, its metrics, the non-finite-gradient
guard, sequence masking, the rows with a learning signal, and a micro-batch's policy loss
and share of the step (`policy_micro_loss`, `loss_weight`); the multi-rank engines' policy
step itself is `engines.rank_steps`."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from tidal.engines import token_logprobs
from tidal.engines.sampling import check_truncation, truncate
from tidal.flow.algorithms import PolicyLossConfig, policy_loss, sequence_keep, token_entropy
from tidal.flow.trajectory import TokenBatch

MicroLoss = Callable[[TokenBatch, Any], tuple[torch.Tensor, dict[str, float]]]
"""(a micro-batch, its rows in the step's batch: a slice or an index tensor) -> (its loss, its metrics)."""
LOSS_METRICS = frozenset({"loss", "kl"})
"""A step's metrics that are terms of the batch's loss (each micro-batch's weighed by its share
of the loss's `aggregation`, summed); the others (`clip_fraction`, `entropy`, ...) are means
over the loss tokens of the rows that ran, as `policy_loss` gives them for one batch."""


class NonfiniteGuard:
    """Takes an optimizer step only when the gradient norm is finite. One batch with a NaN or
    infinite gradient (an overflow, an extreme reward, a diverging run) would otherwise
    write NaN into every weight and AdamW moment, and every later rollout and checkpoint
    would hold them; verl's actor skips such a step too. A run whose gradients stay
    non-finite stops instead: more than `max_in_row` skipped steps in a row raise."""

    def __init__(self, max_in_row: int) -> None:
        self.max_in_row = max_in_row
        self.in_row = 0
        """Non-finite steps in a row so far; a finite one starts the count again."""

    def step(
        self, optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor], grad_norm: torch.Tensor, *, grad_clip: float, version: int, before_change: Callable[[], None] = lambda: None
    ) -> dict[str, float]:
        """Clip the gradients of `params` (their total norm is `grad_norm`, the same on every
        rank) to `grad_clip`, call `before_change()` and step `optimizer`; where `grad_norm` is
        not finite, none of that: the weights and the optimizer's state (moments, step
        counts) stay as they were. Either way the gradients are freed. Reading the norm
        waits for the backward pass on an accelerator. Returns the step's `grad_norm` and
        `nonfinite_grad` (1.0: skipped) metrics.

        Raises:
            FloatingPointError: the norm was not finite at `max_in_row + 1` steps in a row
                (`version`: the weights' version; nothing stepped, gradients freed).
        """
        norm = float(grad_norm)
        finite = math.isfinite(norm)
        self.in_row = 0 if finite else self.in_row + 1
        try:
            if finite:
                torch.nn.utils.clip_grads_with_norm_(params, grad_clip, grad_norm)
                before_change()
                optimizer.step()
            elif self.in_row > self.max_in_row:
                raise FloatingPointError(
                    f"the gradient norm was {norm} at {self.in_row} optimizer steps in a row, the last at version {version}; "
                    f"train.max_nonfinite_steps={self.max_in_row} lets only {self.max_in_row} be skipped. The weights and optimizer state "
                    "are those from before the first of them. Lower train.lr, check the rewards (task.reward) for extreme values, "
                    "or raise train.max_nonfinite_steps to skip more such steps"
                )
        finally:
            optimizer.zero_grad(set_to_none=True)  # dead now: not held (or parked) until the next step
        return {"grad_norm": norm, "nonfinite_grad": float(not finite)}


def check_settings(*, micro_batch_size: int, grad_clip: float, temperature: float, max_nonfinite_steps: int, max_tokens_per_micro_batch: int | None = None, top_k: int = 0, top_p: float = 1.0) -> None:
    """Raises ValueError naming the first train engine setting out of bounds."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if max_tokens_per_micro_batch is not None and max_tokens_per_micro_batch < 2:
        raise ValueError(f"max_tokens_per_micro_batch must be >= 2 (a row has at least two positions), got {max_tokens_per_micro_batch}")
    if not grad_clip > 0:  # 0 would clip every gradient to nothing
        raise ValueError(f"grad_clip must be > 0 (the norm gradients are clipped to), got {grad_clip}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (the rollout's sampling temperature), got {temperature}")
    check_truncation(top_k=top_k, top_p=top_p)
    if max_nonfinite_steps < 0:
        raise ValueError(f"max_nonfinite_steps must be >= 0 (non-finite steps in a row that are skipped; 0 = raise at the first), got {max_nonfinite_steps}")


def grads_of(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients `params` hold (those without one left out)."""
    return [p.grad for p in params if p.grad is not None]


def add_metrics(totals: dict[str, float], part: TokenBatch, loss: torch.Tensor, metrics: dict[str, Any], *, weight: float) -> float:
    """Add a micro-batch's loss and metrics to a step's `totals`: `LOSS_METRICS` weighed by
    `weight` (its share of the loss), the others by its loss tokens; returns those tokens."""
    tokens = float(part.loss_mask.sum())
    for key, value in {"loss": float(loss.detach()), **metrics}.items():
        totals[key] = totals.get(key, 0.0) + (weight if key in LOSS_METRICS else tokens) * float(value)
    return tokens


def average_metrics(totals: dict[str, float], tokens: float) -> None:
    """Turn `add_metrics`' token-weighed sums into means over the `tokens` that ran (0 when none did)."""
    for key in totals.keys() - LOSS_METRICS:
        totals[key] /= tokens or 1.0


def check_step_inputs(batch: TokenBatch, advantages: torch.Tensor, proximal_logprobs: torch.Tensor | None) -> None:
    """Raises ValueError naming a train step's input whose shape does not fit `batch` (each
    micro-batch takes its rows and width of them: a wrong one went in cut, without a word)."""
    shape = list(batch.loss_mask.shape)
    if list(advantages.shape) not in (shape, shape[:1]):
        raise ValueError(f"advantages must be [batch] or [batch, seq - 1] = {shape}, got {list(advantages.shape)}")
    if proximal_logprobs is not None and list(proximal_logprobs.shape) != shape:
        raise ValueError(f"proximal_logprobs must be [batch, seq - 1] = {shape}, got {list(proximal_logprobs.shape)}")


def next_token_stats(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0, entropy: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each position's logprob of its target under softmax(logits / temperature), in float32
    (`logits` [..., vocab], `targets` [...]), and with `entropy` the entropy of that
    distribution (`token_entropy`: "grad" with gradient, for the entropy bonus; "metric"
    detached, a chunk of positions at a time). With `top_k` / `top_p` the distribution is
    truncated as rollout's is (`sampling.truncate`; each target kept in).

    Logits of more than `token_logprobs.CHUNK` values go a chunk of positions at a time,
    without float32 copies of the whole (`token_logprobs`; the same values and gradients,
    bit for bit), except for the entropy bonus, whose gradient needs every distribution."""
    if logits.numel() > token_logprobs.CHUNK and entropy != "grad":
        return token_logprobs.token_logprobs(logits, targets, temperature=temperature, top_k=top_k, top_p=top_p, entropy=entropy == "metric")
    logprobs = torch.log_softmax(truncate(logits.float() / temperature, top_k=top_k, top_p=top_p, keep=targets), dim=-1)
    chosen = logprobs.gather(-1, targets[..., None]).squeeze(-1)
    return chosen, None if entropy is None else token_entropy(logprobs, grad=entropy == "grad")


def padded_token_stats(
    model: Any, batch: TokenBatch, *, inputs: dict[str, Any], keeps_logits: bool, temperature: float, entropy: str | None, autocast: Any, top_k: int = 0, top_p: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`next_token_stats` of a padded micro-batch under `model`, [rows, seq - 1]; `inputs`: the
    forward's keywords besides `input_ids` (its mask, positions and `use_cache`).

    With `keeps_logits` (the model's forward takes transformers' `logits_to_keep`), logits are
    made only from the first position any row's loss reads (`loss_mask`): the positions
    before it, a prompt's, which no loss reads (a third of GSM8K's tokens), cost no lm_head
    and no log-softmax, and their logprobs and entropies are 0, as the torch engine's
    shared-prompt packing leaves them. A micro-batch without a loss token computes them all."""
    width = batch.input_ids.shape[1]
    read: Any = batch.loss_mask.any(0).nonzero() if keeps_logits else ()  # no device sync for a model without `logits_to_keep`
    start = int(read[0]) if len(read) else 0
    keep = {"logits_to_keep": width - start} if start else {}
    with autocast:
        logits = model(input_ids=batch.input_ids, **inputs, **keep).logits[:, :-1]
    logprobs, entropies = next_token_stats(logits, batch.input_ids[:, start + 1 :], temperature=temperature, top_k=top_k, top_p=top_p, entropy=entropy)
    if not start:
        return logprobs, entropies
    return torch.nn.functional.pad(logprobs, (start, 0)), None if entropies is None else torch.nn.functional.pad(entropies, (start, 0))


@torch.no_grad()
def broadcast_from_rank0(module: torch.nn.Module) -> None:
    """Rank 0's values of every tensor of `module`'s state on every rank, in place (a collective)."""
    import torch.distributed as dist  # noqa: PLC0415

    for tensor in module.state_dict().values():
        dist.broadcast(tensor, src=0)


def padded_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each token's position counted from its row's first real token (left padding at 0),
    as the rollout engine counts them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@contextlib.contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """The model in eval mode (no dropout) inside this block, in its own mode after it."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


@contextlib.contextmanager
def own_settings(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Load an optimizer's state from a checkpoint inside this block; after it, every param
    group has this engine's settings back (lr, weight decay, betas, and the platform's
    `optimizer_options()`, such as `fused`). A loaded state brings only its moments and step
    counts: a run resumed with another `train.lr` trains at that lr, and a state saved
    where AdamW was not fused steps the way this platform does. torch placed each `step`
    count by the saved groups' `fused` / `capturable`: on the host for a state saved
    unfused (an NPU run's), where a fused step on CUDA refuses it (pytorch#104767), so a
    fused or capturable group's counts go to their parameter's device as float32, as
    torch's own load puts them (on CPU a no-op; not run on a GPU)."""
    own = [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups]
    yield
    for group, settings in zip(optimizer.param_groups, own, strict=True):
        group.update(settings)
        if group.get("fused") or group.get("capturable"):
            for param in group["params"]:
                state = optimizer.state.get(param, {})
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].to(device=param.device, dtype=torch.float32)


def mask_sequences(batch: TokenBatch, loss: PolicyLossConfig, proximal_logprobs: torch.Tensor | None, logprobs: Callable[[TokenBatch], torch.Tensor]) -> tuple[TokenBatch, PolicyLossConfig, tuple[int, int] | None]:
    """Sequence masking decided over the whole batch before it is cut into micro-batches:
    the dropped rows lose their loss tokens, and the loss goes on without masking. So each
    micro-batch is weighed by the tokens (or sequences) it keeps, and the step equals one
    full-batch step; masking inside each micro-batch left the loss short by the dropped share
    when the drops were not spread evenly. Returns the batch, the loss and (sequences dropped,
    sequences with a loss token), None without sequence masking: counts, so that ranks
    holding parts of a batch can sum them (`masked_fraction`). With `proximal_is_policy` and
    no `proximal_logprobs`, the decision needs the current policy's logprobs: one pass more."""
    if loss.seq_mask_low is None and loss.seq_mask_high is None:
        return batch, loss, None
    behavior = batch.behavior_logprobs
    prox = proximal_logprobs if proximal_logprobs is not None else logprobs(batch) if loss.proximal_is_policy else behavior
    keep = sequence_keep(prox[:, : behavior.shape[1]].cpu(), behavior.cpu(), batch.loss_mask.cpu(), low=loss.seq_mask_low, high=loss.seq_mask_high)
    has_tokens = (batch.loss_mask.cpu() != 0).any(1)
    counts = (int((~keep & has_tokens).sum()), int(has_tokens.sum()))
    batch = dataclasses.replace(batch, loss_mask=batch.loss_mask * keep[:, None].to(batch.loss_mask.device, batch.loss_mask.dtype))
    return batch, dataclasses.replace(loss, seq_mask_low=None, seq_mask_high=None), counts


def masked_fraction(dropped: float, with_tokens: float) -> float:
    """The `seq_masked_fraction` metric: sequences dropped by sequence masking over those with a loss token."""
    return dropped / max(with_tokens, 1.0)


def rows_with_signal(advantages: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Indexes of the rows with a non-zero advantage on a loss token. Every term of the
    policy loss but the KL one is the advantage times something finite, so the other
    rows (a GRPO group whose samples all got the same reward) add exactly zero to the
    loss and its gradient, and need no forward or backward pass."""
    adv = advantages.detach().cpu()
    mask = loss_mask.cpu() != 0
    signal = (adv != 0) & mask.any(1) if adv.dim() == 1 else ((adv != 0) & mask).any(1)
    return torch.nonzero(signal).squeeze(1)



def batch_counts(batch: TokenBatch) -> dict[str, float]:
    """What weighs a step's micro-batches: loss tokens, sequences with a loss token, rows."""
    return {"tokens": float(batch.loss_mask.sum()), "sequences": float((batch.loss_mask.sum(1) > 0).sum()), "rows": float(len(batch))}


def loss_weight(loss: PolicyLossConfig, counts: dict[str, float]) -> Callable[[TokenBatch], float]:
    """A micro-batch's share of the step's loss under `loss.aggregation`: of its rows
    (`token_sum_norm`), of its sequences with a loss token (`seq_*`) or of its loss tokens,
    against the whole batch's `counts` ("rows", "sequences", "tokens")."""

    def weight_of(part: TokenBatch) -> float:
        if loss.aggregation == "token_sum_norm":
            return len(part) / counts["rows"]
        if loss.aggregation.startswith("seq_"):
            return float((part.loss_mask.sum(1) > 0).sum()) / max(counts["sequences"], 1.0)
        return float(part.loss_mask.sum()) / max(counts["tokens"], 1.0)

    return weight_of


def policy_micro_loss(
    token_stats: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    reference_logprobs: Callable[[TokenBatch], torch.Tensor],
    *,
    advantages: torch.Tensor,
    proximal_logprobs: torch.Tensor | None,
    loss: PolicyLossConfig,
    device: torch.device,
) -> MicroLoss:
    """A micro-batch's policy loss: its logprobs (and entropies) by `token_stats(part,
    entropy=...)`, its rows' advantages and proximal logprobs cut to its width, and with a KL
    term `reference_logprobs(part)`."""

    def micro_loss(part: TokenBatch, rows: Any) -> tuple[torch.Tensor, dict[str, float]]:
        logprobs, entropy = token_stats(part, entropy="grad" if loss.entropy_coef > 0 else "metric")
        width = logprobs.shape[1]  # the micro-batch is cut to its longest row: so are per-token inputs
        return policy_loss(
            logprobs,
            (advantages[rows] if advantages.dim() == 1 else advantages[rows, :width]).to(device),
            behavior_logprobs=part.behavior_logprobs.to(device),
            mask=part.loss_mask.to(device),
            proximal_logprobs=None if proximal_logprobs is None else proximal_logprobs[rows, :width].to(device),
            ref_logprobs=reference_logprobs(part) if loss.kl_coef > 0 else None,
            entropy=entropy,
            config=loss,
        )

    return micro_loss
