"""The `torch` train engine: plain torch on any hal platform, one process.

AdamW, gradient clipping, micro-batches with gradient accumulation, logprobs recomputed
with the current weights, and optional mixed precision (`precision="bf16"`: forward
passes under `platform.autocast`, fp32 weights, gradients and optimizer state). The loss
is `tidal.flow.algorithms.policy_loss`; micro-batch losses are weighted by their share of
the batch's loss tokens (`token_mean`), sequences with a loss token (`seq_mean_*`) or rows
(`token_sum_norm`), so a step equals one full-batch step.

Less work per step, the same function of the weights (up to float rounding; tested):
micro-batches hold rows of similar length (the batch's rows sorted by length, stable),
each cut to its longest row. A micro-batch runs in one of three layouts:

- shared prompts (`_pack`): each distinct prompt once (a GRPO group's samples share
  theirs), followed by the responses of its rows, under a dense attention mask that keeps
  each response to its prompt and itself. With sdpa or eager attention and right-padded
  rows (every `to_token_batch`'s), where it saves a fifth of the tokens the next layout
  would run (long prompts, short responses; `_SharedPrompts.beats_padding_free`).
- padding-free (`engines.padding_free`; `padding_free=None`, the default: where the
  model can): only the rows' real tokens, packed, each row's positions from 0; a token
  budget then counts real tokens. Long responses, whose prompts are a small share, run so.
- padded: each row padded to the longest; a right-padded micro-batch runs without a
  padding mask, since under causal attention a real token only sees earlier, real,
  tokens. With `padding_free=False`, a model that cannot run padding-free, or rows too
  alike in length to share packed rows (`PaddingFree.pack`).

Rows whose advantage is zero on every loss token (a GRPO group whose samples all got the same
reward) add nothing to the loss or its gradient when there is no KL or entropy term, so they get no
forward or backward pass (`skipped_rows` in the step's metrics; the other metrics, such
as `clip_fraction`, are over the rows that ran).

A step whose gradient norm is NaN or infinite is skipped (`NonfiniteGuard`, which the
`fsdp` engine shares): the weights and AdamW's state stay, the version still counts, and
the metrics say `nonfinite_grad: 1.0`; more than `max_nonfinite_steps` in a row raise.

With `lora_rank` > 0 only LoRA adapters train (`engines.lora`, with peft): the base weights
stay as loaded, the KL reference is the base with the adapters off (no copy), and
`named_weights()` gives the merged weights under the base model's names.

Run for real: CPU (tests and the CPU quickstart). On GPU/NPU platforms the model lives
on `platform.device(0)`; multi-process training is the `fsdp` engine's job.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from tidal.engines import lora as lora_
from tidal.engines.lr_schedule import LRSchedule, load_position, lr_scheduler
from tidal.engines.micro_batches import pack, real_lengths, row_lengths
from tidal.engines.padding_free import keeps_logits, no_kv_cache, padding_free_for
from tidal.engines.train_steps import (
    NonfiniteGuard,
    add_metrics,
    average_metrics,
    batch_counts,
    check_settings,
    check_step_inputs,
    evaluating,
    grads_of,
    loss_weight,
    mask_sequences,
    masked_fraction,
    next_token_stats,
    own_settings,
    padded_positions,
    padded_token_stats,
    policy_micro_loss,
    rows_with_signal,
)
from tidal.flow.algorithms import PolicyLossConfig
from tidal.flow.trajectory import TokenBatch
from tidal.hal import Platform, current_platform
from tidal.hal.transfer import LazyWeights, TensorSpec


class TorchTrainEngine:
    """A `TrainEngine` for a transformers-style causal LM (forward returns `.logits`)."""

    train_keys = ("lora_rank", "lora_alpha", "lora_target_modules")
    """The recipe's LoRA keys (`TakesTrainKeys`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        grad_clip: float = 1.0,
        micro_batch_size: int = 8,
        max_tokens_per_micro_batch: int | None = None,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        precision: str = "fp32",
        kl_reference: bool = False,
        max_nonfinite_steps: int = 5,
        lr_schedule: LRSchedule | None = None,
        platform: Platform | None = None,
        version: int = 0,
        padding_free: bool | None = None,
        lora_rank: int = 0,
        lora_alpha: float = 16.0,
        lora_target_modules: Sequence[str] | str = lora_.TARGETS_ALL_LINEAR,
    ) -> None:
        check_settings(micro_batch_size=micro_batch_size, grad_clip=grad_clip, temperature=temperature, top_k=top_k, top_p=top_p, max_nonfinite_steps=max_nonfinite_steps, max_tokens_per_micro_batch=max_tokens_per_micro_batch)
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch  # None: micro-batches bounded by rows only
        self.padding_free = padding_free_for(model, padding_free)
        """How micro-batches run without padding (`engines.padding_free`); None: padded. Raises
        ValueError for `padding_free=True` where the model cannot."""
        self._no_kv_cache, self._keeps_logits = no_kv_cache(model), keeps_logits(model)  # every training forward's
        self.platform = platform or current_platform()
        self.platform.autocast(precision)  # raises here, not at the first step, where the platform lacks it
        self.precision = precision
        """Forward passes run under `platform.autocast(precision)`; weights, gradients and
        optimizer state stay fp32, and logprobs are computed from fp32 logits."""
        self.device = self.platform.device(0)
        self.lora = lora_.lora_settings(lora_rank, lora_alpha, lora_target_modules)
        """The LoRA adapters' settings; None: every weight trains."""
        if self.lora is not None:
            lora_.add_adapters(model, self.lora)
        self.model = model.to(self.device).train()
        self.reference = copy.deepcopy(self.model).eval().requires_grad_(False) if kl_reference and self.lora is None else None
        """A frozen copy of the weights the engine was built with, the reference policy of a
        loss with `kl_coef > 0` (`kl_reference=True`); kept in `state_dict()`. With LoRA the
        reference is the base with the adapters off (`engines.lora.adapters_off`), no copy."""
        self.kl_reference = kl_reference
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=weight_decay, betas=betas, **self.platform.optimizer_options())
        self.scheduler = lr_scheduler(self.optimizer, lr_schedule)  # stepped once per train_step (`engines.lr_schedule`)
        self.grad_clip, self.micro_batch_size, self.temperature = grad_clip, micro_batch_size, temperature
        self.top_k, self.top_p = top_k, top_p  # rollout's truncation: logprobs are taken under it (`engines.sampling`)
        self.version = version
        self.nonfinite = NonfiniteGuard(max_nonfinite_steps)
        # packed rows need a custom 4D attention mask, which these implementations take
        self._packs = getattr(getattr(self.model, "config", None), "_attn_implementation", None) in ("eager", "sdpa")
        self._before_change: Callable[[], None] = lambda: None

    def share_weights(self, place: Callable[[list[TensorSpec], dict[str, str], torch.device], Sequence[torch.Tensor]], *, before_change: Callable[[], None]) -> None:
        """Keep the weights, from now on, in the memory `place(specs, ties, device)` gives:
        one tensor per spec of `named_weights()` on this engine's device, a tied name
        (`ties[name] = other`) given `other`'s (a weight transport's shared memory:
        `IpcSender.place`). Then call `before_change()` every time before the weights
        change (each optimizer step taken, not a skipped one, and `load_state_dict`), so a
        reader of that memory in another process finishes first.

        Raises:
            ValueError: a weight is a buffer, not a parameter (before `place` is called;
                nothing moved).
            RuntimeError: `place` gave a tensor unlike its spec (nothing moved).
        """
        if self.lora is not None:
            raise ValueError("with LoRA adapters (train.lora_rank) the weights rollout takes are merged from the base and the adapters at each publish, not kept in place")
        params = self.model.state_dict(keep_vars=True)
        first: dict[int, str] = {}
        ties = {}
        for name, p in params.items():
            if not isinstance(p, torch.nn.Parameter):
                raise ValueError(f"weight {name!r} is a buffer, not a parameter: it cannot move")
            if id(p) in first:
                ties[name] = first[id(p)]
            first.setdefault(id(p), name)
        places = dict(zip(params, place([TensorSpec.of(n, p) for n, p in params.items()], ties, self.device)))
        for name, p in params.items():
            if (places[name].dtype, places[name].shape, places[name].device) != (p.dtype, p.shape, p.device):
                raise RuntimeError(f"the place for {name!r} is {places[name].dtype}{list(places[name].shape)} on {places[name].device}, the weight {p.dtype}{list(p.shape)} on {p.device}")
        with torch.no_grad():
            for name, p in params.items():
                if name not in ties:
                    places[name].copy_(p)
                    p.data = places[name]
        self._before_change = before_change

    def _token_logprobs(self, batch: TokenBatch, model: torch.nn.Module | None = None) -> torch.Tensor:
        """[rows, seq - 1] logprob of each next token under `model` (the trained one by
        default); with grad when grad is enabled."""
        return self._token_stats(batch, model)[0]

    def _token_stats(self, batch: TokenBatch, model: torch.nn.Module | None = None, *, entropy: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_token_logprobs` and, with `entropy` ("grad": for the bonus, "metric": detached),
        the entropy of the distribution at each of those positions (0 where the logprob is)."""
        model = self.model if model is None else model
        batch = batch.to(self.device)
        mask = batch.attention_mask
        right_padded = bool((mask[:, :1] != 0).all()) and bool((mask[:, 1:] <= mask[:, :-1]).all())
        if right_padded and self._packs:
            shared = _shared_prompts(batch)
            if shared is not None and (self.padding_free is None or shared.beats_padding_free()):
                return self._packed_logprobs(model, batch, shared, _pack(batch, shared), entropy=entropy)
        if self.padding_free is not None and (packed := self.padding_free.pack(batch)) is not None:
            return self.padding_free.token_stats(model, packed, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, entropy=entropy, autocast=self.platform.autocast(self.precision))
        inputs = {"attention_mask": None, **self._no_kv_cache} if right_padded else {"attention_mask": mask, "position_ids": padded_positions(mask), **self._no_kv_cache}
        return padded_token_stats(model, batch, inputs=inputs, keeps_logits=self._keeps_logits, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, entropy=entropy, autocast=self.platform.autocast(self.precision))

    def _packed_logprobs(self, model: torch.nn.Module, batch: TokenBatch, shared: _SharedPrompts, packed: _Packed, *, entropy: str | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_token_logprobs` computing each distinct prompt once (a GRPO group's rows share theirs).

        One forward over packed rows: each distinct prompt followed by the responses of
        its rows (`_pack`), under an attention mask that lets a response token see its
        prompt and the earlier tokens of its own response, nothing else, at the positions
        it has in its own row. The same function of the weights as the plain forward, on
        fewer tokens and without padding to the longest response; prompt positions (never
        in a loss) come out as 0.
        """
        device = self.device
        dtype = next(model.parameters()).dtype
        mask = torch.zeros(packed.allowed.shape, dtype=dtype).masked_fill_(~packed.allowed, torch.finfo(dtype).min)
        with self.platform.autocast(self.precision):
            logits = model(input_ids=packed.input_ids.to(device), attention_mask=mask[:, None].to(device), position_ids=packed.position_ids.to(device), **self._no_kv_cache).logits
        # [rows, width, vocab]: what predicts each row's response token j. Rows share predictors
        # (a prompt's last token), and `index_select`'s backward sums their gradients in a fixed
        # order, where advanced indexing's (`index_put_` accumulating) does not on CPU threads.
        predictors = packed.predictors.to(device)
        logits = logits.flatten(0, 1).index_select(0, predictors.flatten()).unflatten(0, predictors.shape)
        starts = torch.tensor(shared.prompt_lengths, device=device)  # each row's first response token
        num_response = torch.tensor(shared.lengths, device=device) - starts
        width = logits.shape[1]
        response = batch.input_ids.gather(1, (starts[:, None] + torch.arange(width, device=device)[None, :]).clamp(max=batch.input_ids.shape[1] - 1))
        logprobs, entropies = next_token_stats(logits, response, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, entropy=entropy)
        # position t of the batch layout predicts input_ids[:, t + 1]: response token j is at t = start - 1 + j
        j = torch.arange(batch.loss_mask.shape[1], device=device)[None, :] - (starts[:, None] - 1)
        placed = (j >= 0) & (j < num_response[:, None])
        at = j.clamp(0, width - 1)
        return torch.where(placed, logprobs.gather(1, at), 0.0), None if entropies is None else torch.where(placed, entropies.gather(1, at), 0.0)

    def _micro_batches(self, batch: TokenBatch, among: torch.Tensor | None = None) -> Iterator[tuple[torch.Tensor, TokenBatch]]:
        """(rows, micro-batch): rows of similar length, cut to the longest of them, within
        `micro_batch_size` rows and `max_tokens_per_micro_batch` tokens (padded, or real
        ones padding-free); only the rows `among` when given."""
        lengths = row_lengths(batch)
        order = torch.sort(lengths, stable=True).indices
        if among is not None:
            order = order[torch.isin(order, among)]
        sizes = lengths if self.padding_free is None else real_lengths(batch)
        for part in pack(sizes[order].tolist(), max_rows=self.micro_batch_size, max_tokens=self.max_tokens_per_micro_batch, padded=self.padding_free is None):
            rows = order[part]
            yield rows, batch.select(rows).crop(max(int(lengths[rows].max()), 2))

    def logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """[batch, seq - 1] logprob of each next token under the current weights.

        Defined where a row's response is predicted (its tokens from the first loss token
        on, environment tokens among them); positions that predict padding are 0, and so
        are prompt positions (everything before the first loss token: all of a row without
        one) when the rows went through the model packed (`_pack`). The model runs in eval
        mode (no dropout), as a rollout engine's does.
        """
        return self._batch_logprobs(batch, self._token_logprobs)

    def logprobs_under_reference(self, batch: TokenBatch) -> torch.Tensor:
        """`logprobs` under the frozen KL reference (`LogprobsUnderReference`; an engine built with `kl_reference=True`)."""
        if not self.kl_reference:
            raise ValueError("logprobs under the reference need one: build the engine with kl_reference=True")
        return self._batch_logprobs(batch, self._reference_logprobs)

    @torch.no_grad()
    def _batch_logprobs(self, batch: TokenBatch, token_logprobs: Any) -> torch.Tensor:
        out = torch.zeros(batch.loss_mask.shape, dtype=torch.float32)
        with evaluating(self.model):
            for rows, part in self._micro_batches(batch):
                out[rows, : part.loss_mask.shape[1]] = torch.where(part.attention_mask[:, 1:].cpu() != 0, token_logprobs(part).cpu(), 0.0)
        return out

    def _step(self, batch: TokenBatch, micro_loss: Any, weight_of: Any, among: torch.Tensor | None = None) -> dict[str, float]:
        """One optimizer step over the micro-batches of `batch` (of its rows `among`, when
        given: the others must contribute no gradient). "loss" (and "kl") are the batch's; the
        other metrics are means over the loss tokens of the rows that ran (`LOSS_METRICS`)."""
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {"loss": 0.0}  # nothing ran: the loss is 0
        covered = 0.0  # loss tokens that ran
        for rows, part in self._micro_batches(batch, among):
            weight = weight_of(part)
            if weight == 0:
                continue
            loss, metrics = micro_loss(part, rows)
            (loss * weight).backward()
            covered += add_metrics(totals, part, loss, metrics, weight=weight)
        average_metrics(totals, covered)
        for p in self.model.parameters():  # nothing ran: a zero gradient, so AdamW still steps (momentum, decay) as it would have
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)
        params = [p for p in self.model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm(grads_of(params))
        totals.update(self.nonfinite.step(self.optimizer, params, grad_norm, grad_clip=self.grad_clip, version=self.version, before_change=self._before_change))
        totals.update(lr=self.optimizer.param_groups[0]["lr"], num_tokens=float(batch.loss_mask.sum()))
        return totals

    def train_step(self, batch: TokenBatch, advantages: torch.Tensor, *, loss: PolicyLossConfig, proximal_logprobs: torch.Tensor | None = None) -> dict[str, float]:
        """One optimizer step over `batch`; version += 1. A loss with `kl_coef > 0` takes its
        reference logprobs from `self.reference` (an engine built with `kl_reference=True`).

        Raises:
            ValueError: `kl_coef > 0` without a reference, or advantages or proximal
                logprobs not shaped like the batch (`check_step_inputs`), before anything runs.
        """
        if loss.kl_coef > 0 and not self.kl_reference:
            raise ValueError(f"a loss with kl_coef={loss.kl_coef} needs a reference policy: build the engine with kl_reference=True")
        check_step_inputs(batch, advantages, proximal_logprobs)
        batch, loss, masked = mask_sequences(batch, loss, proximal_logprobs, self.logprobs)
        counts = batch_counts(batch)
        micro_loss = policy_micro_loss(self._token_stats, self._reference_logprobs, advantages=advantages, proximal_logprobs=proximal_logprobs, loss=loss, device=self.device)
        among = None
        if not loss.zero_advantage_counts:  # every other term of the loss is a multiple of the advantage
            among = rows_with_signal(advantages, batch.loss_mask)
        metrics = self._step(batch, micro_loss, loss_weight(loss, counts), among)
        metrics["skipped_rows"] = float(len(batch) - (len(batch) if among is None else len(among)))
        if masked is not None:
            metrics["seq_masked_fraction"] = masked_fraction(*masked)
        self.scheduler.step()
        self.version += 1
        return metrics

    @torch.no_grad()
    def _reference_logprobs(self, part: TokenBatch) -> torch.Tensor:
        if self.reference is None:  # LoRA: the base is the reference (train_step checked there is one)
            with lora_.adapters_off(self.model), evaluating(self.model):
                return self._token_logprobs(part)
        return self._token_logprobs(part, self.reference)

    def frozen_step(self) -> None:
        """A step the policy sits out (`algorithm.critic_warmup`: `TakesFrozenSteps`): version += 1,
        nothing else changes."""
        self.version += 1

    def sft_step(self, batch: TokenBatch) -> dict[str, float]:
        """One supervised step: next-token cross-entropy on `loss_mask` tokens (version unchanged)."""
        num_tokens = float(batch.loss_mask.sum())

        def micro_loss(part: TokenBatch, rows: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            mask = part.loss_mask.to(self.device)
            return -(self._token_logprobs(part) * mask).sum() / mask.sum().clamp(min=1), {}

        return self._step(batch, micro_loss, lambda part: float(part.loss_mask.sum()) / max(num_tokens, 1.0))

    def named_weights(self) -> LazyWeights:
        """Every weight by name: a `WeightSource` over the model's own tensors (no copies); with
        LoRA the base model's weights by its names, each adapted one merged as it is taken."""
        if self.lora is not None:
            specs = lambda: [TensorSpec.of(n, t) for n, t in lora_.base_weights(self.model).items()]  # noqa: E731 - merged ones keep the base's dtype and shape
            return LazyWeights(specs, lambda: lora_.merged_weights(self.model))

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in self.model.state_dict().items():
                yield name, tensor.detach()

        return LazyWeights(lambda: [TensorSpec.of(n, t) for n, t in self.model.state_dict().items()], tensors)

    def state_dict(self) -> dict[str, Any]:
        """"model": the weights as `named_weights()` gives them; with LoRA also "lora": the base
        ("base", by the base's names) and the adapters ("adapters") an exact resume loads."""
        if self.lora is not None:  # each merged layer to the host as it is made: at most one extra on the device
            base = lora_.base_weights(self.model)
            model = {n: t if t.data_ptr() == base[n].data_ptr() else t.cpu() for n, t in lora_.merged_weights(self.model)}
            lora = {"base": base, "adapters": lora_.adapter_weights(self.model), "settings": self.lora.keys()}
            return {"model": model, "lora": lora, "optimizer": self.optimizer.state_dict(), "lr_scheduler": self.scheduler.state_dict(), "version": self.version}
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "lr_scheduler": self.scheduler.state_dict(), "version": self.version}
        if self.reference is not None:
            state["reference"] = self.reference.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Set what `state_dict()` gave. With LoRA the base and adapters come from "lora"
        ("model", the merged weights, follows from them).

        Raises:
            ValueError: with LoRA, a state without "lora" (an engine's that trained every
                weight) or whose adapters do not fit these settings; nothing is set then.
        """
        weights = state["model"] if self.lora is None else lora_.saved_weights(self.model, state, self.lora)  # raises before anything is set
        self._before_change()
        self.model.load_state_dict(weights)
        with own_settings(self.optimizer):
            self.optimizer.load_state_dict(state["optimizer"])
        load_position(self.scheduler, state.get("lr_scheduler") or {"last_epoch": int(state["version"])})  # a state from before schedules: a step per version
        if self.reference is not None and "reference" in state:  # else the reference stays the weights the engine was built with
            self.reference.load_state_dict(state["reference"])
        self.version = int(state["version"])


@dataclasses.dataclass
class _SharedPrompts:
    prompts: list[tuple[int, ...]]
    """The distinct prompts."""
    inverse: list[int]
    """Each row's prompt, an index into `prompts`."""
    prompt_lengths: list[int]
    lengths: list[int]
    """Each row's prompt length and whole length (prompt and response)."""

    def beats_padding_free(self) -> bool:
        """Computing each distinct prompt once saves a fifth of the rows' real tokens, which a
        padding-free forward runs: long prompts, short responses (GRPO on short answers).
        Long responses make the prompts a small share, and the dense mask of `_pack` costs
        the square of its width, so they run padding-free."""
        num_response = sum(n - p for n, p in zip(self.lengths, self.prompt_lengths))
        return sum(map(len, self.prompts)) + num_response <= 0.8 * sum(self.lengths)


def _shared_prompts(batch: TokenBatch) -> _SharedPrompts | None:
    """The rows' prompts when computing each distinct one once saves a fifth of the padded
    tokens (else None; `beats_padding_free` compares with the real tokens). A row's prompt
    is everything before its first loss token; rows with no loss token have no response
    and are a prompt of their own.

    `batch` is right-padded.
    """
    lengths = batch.attention_mask.sum(1).tolist()
    has_loss = (batch.loss_mask != 0).cpu()
    first = has_loss.to(torch.uint8).argmax(1).tolist()
    ids = batch.input_ids.tolist()
    prompt_lengths = [f + 1 if any_loss else n for f, any_loss, n in zip(first, has_loss.any(1).tolist(), lengths)]
    distinct: dict[tuple[int, ...], int] = {}
    inverse = [distinct.setdefault(tuple(row[:p]), len(distinct)) for row, p in zip(ids, prompt_lengths)]
    num_response_tokens = sum(n - p for n, p in zip(lengths, prompt_lengths))
    if num_response_tokens == 0 or sum(map(len, distinct)) + num_response_tokens > 0.8 * len(ids) * max(lengths):
        return None
    return _SharedPrompts(list(distinct), inverse, prompt_lengths, lengths)


UNIT_ROWS_WIDE = 4
"""A packed unit (a prompt and its rows' responses) is at most this many longest rows wide."""


@dataclasses.dataclass
class _Packed:
    """Rows that share prompts, laid out for one forward (see `_pack`)."""

    input_ids: torch.Tensor
    """[packed, width] each distinct prompt followed by its rows' responses, right-padded."""
    position_ids: torch.Tensor
    """[packed, width] each token's position in its own batch row."""
    allowed: torch.Tensor
    """[packed, width, width] bool: query token i may attend to key token k."""
    predictors: torch.Tensor
    """[rows, response width] where, in the flattened [packed * width] layout, the token
    predicting each row's response token j is (0 past a row's response)."""


def _pack(batch: TokenBatch, shared: _SharedPrompts) -> _Packed:
    """Lay out `batch`'s rows by prompt: a unit is a distinct prompt followed by the
    responses of the rows that share it, each without its last token (it predicts
    nothing: a response of 2-3 tokens is a third shorter); units go, longest first, into
    the first packed row with room, rows as wide as the longest unit. A response token
    attends to its prompt and to the earlier tokens of its own response, and keeps its
    batch position. Rows without a response are left out (nothing of theirs is predicted).

    A unit holds at most `UNIT_ROWS_WIDE` times the longest row's tokens: the rest of its
    prompt's rows go into another unit with the prompt again. Without that bound a
    prompt's unit would grow with every response, and so would its dense attention mask
    and scores (the square of its width).
    """
    cap = UNIT_ROWS_WIDE * max(shared.lengths)
    units: list[tuple[int, list[int], int]] = []  # (prompt, rows, tokens)
    filling: dict[int, int] = {}  # prompt -> its unit that takes more rows
    for r, p in enumerate(shared.inverse):
        num_response = shared.lengths[r] - shared.prompt_lengths[r]
        if num_response == 0:
            continue
        u = filling.get(p)
        if u is None or units[u][2] + num_response - 1 > cap:
            u = filling[p] = len(units)
            units.append((p, [], len(shared.prompts[p])))
        _, rows, length = units[u]
        units[u] = (p, [*rows, r], length + num_response - 1)
    units.sort(key=lambda unit: -unit[2])
    width = units[0][2]
    used: list[int] = []  # each packed row's tokens so far
    placed = []  # (packed row, offset) of each unit
    for _, _, length in units:
        k = next((k for k, n in enumerate(used) if n + length <= width), len(used))
        if k == len(used):
            used.append(0)
        placed.append((k, used[k]))
        used[k] += length
    ids = batch.input_ids.tolist()
    tokens: list[list[int]] = [[] for _ in used]
    positions: list[list[int]] = [[] for _ in used]
    unit_ids: list[list[int]] = [[] for _ in used]  # -1 on padding
    parts: list[list[int]] = [[] for _ in used]  # 0 on a prompt, k on the unit's k-th response, -1 on padding
    num_response = max(shared.lengths[r] - shared.prompt_lengths[r] for r in range(len(ids)))
    predictors = [[0] * num_response for _ in ids]
    for u, ((p, rows, _), (k, offset)) in enumerate(zip(units, placed)):
        assert len(tokens[k]) == offset  # units go into their rows in placement order
        prompt = shared.prompts[p]
        last_prompt = k * width + len(tokens[k]) + len(prompt) - 1
        tokens[k] += prompt
        positions[k] += range(len(prompt))
        unit_ids[k] += [u] * len(prompt)
        parts[k] += [0] * len(prompt)
        for part, r in enumerate(rows, start=1):
            start, end = shared.prompt_lengths[r], shared.lengths[r]
            first = k * width + len(tokens[k])
            predictors[r][: end - start] = [last_prompt] + list(range(first, first + end - start - 1))
            tokens[k] += ids[r][start : end - 1]
            positions[k] += range(start, end - 1)
            unit_ids[k] += [u] * (end - start - 1)
            parts[k] += [part] * (end - start - 1)

    def padded(rows: list[list[int]], value: int) -> torch.Tensor:
        return torch.tensor([row + [value] * (width - len(row)) for row in rows], dtype=torch.long)

    unit, part_of = padded(unit_ids, -1), padded(parts, -1)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    same_unit = unit[:, :, None] == unit[:, None, :]
    sees = (part_of[:, None, :] == 0) | (part_of[:, :, None] == part_of[:, None, :])  # the prompt, or its own response (padding: other padding)
    return _Packed(padded(tokens, 0), padded(positions, 0), causal & same_unit & sees, torch.tensor(predictors, dtype=torch.long))
