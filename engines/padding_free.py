"""Padding-free micro-batches (`train.padding_free`), the way verl's `use_remove_padding`
works, for both train engines: a micro-batch's rows go through the model as their real
tokens only, back to back, each row's positions counting from 0 again, with no attention
mask. transformers reads that packed format from the positions (a position that does not
follow its predecessor starts a sequence: `masking_utils.find_packed_sequence_indices`)
and keeps each token to the earlier tokens of its own sequence: flash attention through
its variable-length kernels, the other implementations with a block-diagonal causal mask.
Each row's logits are those of its padded forward (up to float rounding; tested), on the
rows' real tokens rather than `rows x longest row`.

The layout follows the attention implementation. Flash attention takes one sequence of
all the tokens, `[1, tokens]` (its kernels skip the masked blocks, and it reads packing
only from a batch of one). The others get rows as wide as the longest sequence, filled
first-fit longest first: sdpa and eager build a dense `[rows, 1, width, width]` mask
(flex, whose block mask is sparse, is laid out alike, to be safe), and that mask and the
attention scores then stay within the padded forward's (one `[1, tokens]` row would cost
the square of the micro-batch's tokens); only the ends of those rows are padding (at most
one of them is half empty or more). Where those rows would be nearly as many as the
sequences (rows of similar length, as the torch engine's sorted micro-batches often
are), the micro-batch runs padded instead (`PaddingFree.pack`): that saves the mask, and
a causal kernel skips half the scores a masked one computes.

A row's last real token predicts nothing and is left out. The per-token logprobs (and
entropies) come back in the engines' `[rows, seq - 1]` layout: position t holds the
logprob of `input_ids[:, t + 1]` where both tokens are real, 0 elsewhere (so also where
a left-padded row's first token is predicted from padding).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Iterator
from typing import Any, Protocol, cast, runtime_checkable

import torch

from tidal.engines.train_steps import next_token_stats
from tidal.flow.trajectory import TokenBatch

PACKING_ATTENTION = ("sdpa", "eager", "flex_attention")
"""transformers attention implementations, besides flash attention's, whose masks follow packed positions."""


def cannot_pack(model: torch.nn.Module) -> str | None:
    """Why `model` cannot run padding-free, or None when it can: a transformers model built on
    its attention interface (`_supports_attention_backend`: its masks come from
    `masking_utils`, which reads packed positions), whose forward takes `position_ids`,
    with a flash, sdpa, eager or flex attention implementation."""
    name = type(model).__name__
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return f"{name}'s forward takes no position_ids"
    if not getattr(model, "_supports_attention_backend", False):
        return f"{name} does not build its attention masks with transformers' masking utilities (no _supports_attention_backend)"
    attention = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if attention is None or not (attention in PACKING_ATTENTION or "flash" in attention):
        return f"{name}'s attention implementation {attention!r} is none of flash, {', '.join(PACKING_ATTENTION)}"
    return None


def no_kv_cache(model: torch.nn.Module) -> dict[str, bool]:
    """The keyword a training forward of `model` passes so that it builds no KV cache:
    `use_cache=False` where its forward takes `use_cache` (a transformers model otherwise
    takes it from its config, True for Qwen2: a cache each pass, holding keys and values
    beside activation recomputation's, and a warning under it); nothing for a forward
    without it."""
    return {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}


def keeps_logits(model: torch.nn.Module) -> bool:
    """Whether `model`'s forward takes `logits_to_keep` (transformers' causal LMs), with which
    a padded micro-batch makes logits only where a loss reads them (`padded_token_stats`)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


@dataclasses.dataclass(frozen=True)
class PaddingFree:
    """How an engine runs a micro-batch padding-free (`padding_free_for` picks it)."""

    one_row: bool
    """All the tokens in one row (flash attention); else rows as wide as the longest sequence."""
    loss_logits_only: bool = False
    """Logits only where a loss reads them (`pack_rows`' `loss_mask`): one row through the
    model's `logits_to_keep` (`keeps_logits`); rows as wide as the longest sequence, where a
    sequence's prompt sits in other columns in each row (and `logits_to_keep` picks columns
    every row shares), by handing the model's output embedding only the kept positions'
    hidden states (`head_reads`: the model's own code still scales or caps the logits)."""

    def pack(self, batch: TokenBatch) -> PackedRows | None:
        """`batch` laid out padding-free (`pack_rows`), or None where rows as wide as the
        longest sequence hold more than four fifths of its sequences: their rows then save
        little over the padded forward, which needs no mask (a causal kernel skips the
        masked half of the scores, where a dense mask computes all of them)."""
        packed = pack_rows(batch.input_ids, batch.attention_mask, one_row=self.one_row, loss_mask=batch.loss_mask if self.loss_logits_only else None)
        return None if not self.one_row and packed.input_ids.shape[0] > 0.8 * packed.num_sequences else packed

    def token_stats(self, model: torch.nn.Module, packed: PackedRows, *, temperature: float, top_k: int = 0, top_p: float = 1.0, entropy: str | None = None, autocast: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[rows, seq - 1] logprob of each next token of the rows `packed` holds (on their
        device) under `model`, and with `entropy` its distribution's entropy
        (`next_token_stats`); 0 where the token or its predecessor is padding. `autocast`: the
        context the forward runs in."""
        keep = {"logits_to_keep": packed.keep} if packed.keep is not None and self.one_row else {}
        heads = head_reads(model, packed.keep, packed.input_ids.shape) if packed.keep is not None and not self.one_row else contextlib.nullcontext()
        with autocast if autocast is not None else contextlib.nullcontext(), heads:
            logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=None, use_cache=False, **keep).logits
        logits = logits.flatten(0, 1)
        if packed.source is not None:
            logits = logits.index_select(0, packed.source)  # each target's predicting token (unique: its backward adds nothing up)
        logprobs, entropies = next_token_stats(logits, packed.targets, temperature=temperature, top_k=top_k, top_p=top_p, entropy=entropy)
        return packed.scatter(logprobs), None if entropies is None else packed.scatter(entropies)


def padding_free_for(model: torch.nn.Module, setting: bool | None) -> PaddingFree | None:
    """The padding-free layout for `model` under `setting` (`train.padding_free`: None = auto,
    wherever the model can), or None: micro-batches padded to their longest row.

    Raises:
        ValueError: `setting` is True and the model cannot run padding-free (`cannot_pack`).
    """
    if setting is False:
        return None
    reason = cannot_pack(model)
    if reason is not None:
        if setting:
            raise ValueError(f"train.padding_free=true, but {reason}: set train.padding_free=false (pad each micro-batch) or null (padding-free where the model can)")
        return None
    config: Any = model.config  # a transformers config (a module's attribute types as Tensor | Module)
    one_row = "flash" in config._attn_implementation
    return PaddingFree(one_row=one_row, loss_logits_only=keeps_logits(model) if one_row else has_head(model))


@runtime_checkable
class NamesItsHead(Protocol):
    """A model that names the module turning hidden states into logits (transformers' causal LMs)."""

    def get_output_embeddings(self) -> Any: ...


def has_head(model: torch.nn.Module) -> bool:
    """Whether `model` names its output embedding (`NamesItsHead`, and it is a module), which
    `head_reads` narrows."""
    return isinstance(model, NamesItsHead) and isinstance(model.get_output_embeddings(), torch.nn.Module)


@contextlib.contextmanager
def head_reads(model: torch.nn.Module, keep: torch.Tensor, shape: torch.Size) -> Iterator[None]:
    """Within it, `model`'s output embedding (`get_output_embeddings()`) reads only the
    hidden states at `keep`, positions in the flattened `shape` ([rows, width]) layout of the
    packed rows, as one row: the forward's logits are `[1, len(keep), vocab]`, in `keep`'s
    order, and the lm_head and the log-softmax cost nothing elsewhere.

    Raises:
        RuntimeError: the output embedding was called on something other than the packed
            rows' hidden states (a model whose head works otherwise): set
            train.padding_free=false.
    """

    def gather(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden, *rest = args
        if hidden.dim() != 3 or tuple(hidden.shape[:2]) != tuple(shape):
            raise RuntimeError(
                f"{type(model).__name__}'s output embedding read hidden states of shape {list(hidden.shape)}, not the packed rows' {list(shape)}: "
                "it cannot make logits only where a loss reads them; set train.padding_free=false"
            )
        return (hidden.flatten(0, 1).index_select(0, keep).unsqueeze(0), *rest)

    head: torch.nn.Module = cast(NamesItsHead, model).get_output_embeddings()  # a module: `loss_logits_only` came from `has_head`
    handle = head.register_forward_pre_hook(gather)
    try:
        yield
    finally:
        handle.remove()


@dataclasses.dataclass
class PackedRows:
    """Rows laid out for one padding-free forward (`pack_rows`)."""

    input_ids: torch.Tensor
    """[packed, width] the rows' tokens, back to back, padding after the last of a packed row."""
    position_ids: torch.Tensor
    """[packed, width] each token's position in its own row, from 0 (padding goes on counting)."""
    source: torch.Tensor | None
    """[targets] where each target's predicting token is in the flattened [packed * width]
    layout; None when it is each token in order."""
    targets: torch.Tensor
    """[targets] the token each predicts."""
    slots: torch.Tensor
    """[targets] where each one's logprob goes in the flattened [rows, seq - 1] layout."""
    shape: tuple[int, int]
    """[rows, seq - 1]."""
    num_sequences: int
    """Rows with a token to predict from (two real tokens or more)."""
    keep: torch.Tensor | None = None
    """The positions, in the flattened [packed * width] layout, whose logits are made (the
    `targets`' predicting tokens, in order: one row's `logits_to_keep`, else `head_reads`);
    None: every position's."""

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """One value per target into the [rows, seq - 1] layout, 0 elsewhere."""
        out = values.new_zeros(self.shape[0] * self.shape[1])
        return out.index_copy(0, self.slots, values).view(self.shape)


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, *, one_row: bool, loss_mask: torch.Tensor | None = None) -> PackedRows:
    """Lay out a micro-batch padding-free: each row's real tokens but its last (a sequence),
    all in one packed row (`one_row`) or first-fit, longest first, into rows as wide as the
    longest sequence. On `input_ids`' device.

    `loss_mask` ([rows, seq - 1]): the targets are only those from each row's first loss
    position on (`keep`, their predicting tokens in the flattened packed layout): a
    prompt's, which no loss reads (a third of GSM8K's tokens), get no logits and no
    log-softmax, and logprob 0, as a padded micro-batch's (`train_steps.padded_token_stats`).
    A micro-batch without a loss position keeps all."""
    device = input_ids.device
    num_rows, seq = input_ids.shape
    real = attention_mask.cpu() != 0
    fed = real.clone()
    last = seq - 1 - real.flip(1).to(torch.uint8).argmax(1)  # each row's last real token
    fed[torch.arange(num_rows), last] = False  # (a row without one has nothing to clear)
    lengths = fed.sum(1).tolist()
    rows, cols = fed.nonzero(as_tuple=True)  # row by row, in order
    within = (fed.cumsum(1) - 1)[rows, cols]  # each fed token's position in its sequence
    order = [r for r in (range(num_rows) if one_row else sorted(range(num_rows), key=lambda r: -lengths[r])) if lengths[r]]
    width = sum(lengths) if one_row else max((lengths[r] for r in order), default=0)
    starts = [0] * num_rows  # each sequence's first slot in the flattened packed rows
    used: list[int] = []  # tokens in each packed row
    ends: list[int] = []  # each packed row's last sequence's length
    for r in order:
        k = next((k for k, n in enumerate(used) if n + lengths[r] <= width), len(used))
        if k == len(used):
            used.append(0)
            ends.append(0)
        starts[r], used[k], ends[k] = k * width + used[k], used[k] + lengths[r], lengths[r]
    if not used:  # no row has two real tokens: one token, so the forward still runs (and its collectives)
        used, ends, width = [0], [0], 1
    slot = torch.tensor(starts)[rows] + within
    flat_ids = torch.zeros(len(used) * width, dtype=torch.long)
    flat_ids[slot] = input_ids.cpu()[rows, cols]
    positions = torch.cat([torch.arange(end, end + width - n) for n, end in zip(used, ends)])  # padding goes on from the last sequence
    tails = torch.cat([torch.arange(k * width + n, (k + 1) * width) for k, n in enumerate(used)])
    flat_positions = torch.zeros(len(used) * width, dtype=torch.long)
    flat_positions[tails] = positions
    flat_positions[slot] = within
    predicts = real[rows, (cols + 1).clamp(max=seq - 1)] & (cols + 1 < seq)  # the next token is real
    keep = None
    if loss_mask is not None:
        read = loss_mask.cpu() != 0
        first = torch.where(read.any(1), read.to(torch.uint8).argmax(1), seq)  # each row's first loss position
        kept = cols >= first[rows]
        if bool((predicts & kept).any()) and not bool(kept[predicts].all()):
            predicts &= kept
            keep = slot[predicts]
    source = slot[predicts]
    dense = keep is not None or (len(source) == len(used) * width and bool((source == torch.arange(len(source))).all()))  # kept logits come in the targets' order
    return PackedRows(
        input_ids=flat_ids.view(len(used), width).to(device),
        position_ids=flat_positions.view(len(used), width).to(device),
        source=None if dense else source.to(device),
        targets=input_ids[rows[predicts].to(device), (cols[predicts] + 1).to(device)],
        slots=(rows[predicts] * (seq - 1) + cols[predicts]).to(device),
        shape=(num_rows, seq - 1),
        num_sequences=len(order),
        keep=None if keep is None else keep.to(device),
    )
