"""The `hf` rollout engine: a transformers causal LM sampled by tidal's own decoding loop, on any hal platform.

Token in, token out: it continues `Trajectory` objects and records, for every sampled
token, its behavior logprob (log-softmax of the raw logits at the sampling temperature,
truncated to `top_k` / `top_p` when they are set: `engines.sampling`) and the version of
the weights that sampled it.

The decoding loop is written here rather than calling transformers `generate`: one
prefill of the left-padded batch (prompt and any tokens a paused trajectory already
has), then one forward per token over the model's KV cache (`DynamicCache`), sampling
from `softmax(logits / temperature)`, cut to `top_k` then `top_p`, with `torch.multinomial`
as `generate(do_sample=True, top_k=..., top_p=...)` does. Rows that end (EOS, or their own
token budget) leave the batch and the cache at once, so later steps compute only
unfinished rows (`eos_id` may list several stop tokens, as instruct models' generation
configs do); `generate` keeps every row to the end and costs a call's set-up every chunk.
With no row ending early the tokens are those `generate` samples under the same seed (a
test checks it).

Every `chunk_tokens` decoding steps is a safe point: the loop asks `should_pause()` and,
when it says so, returns with unfinished trajectories (`finish_reason=None`); new
weights can then be applied and a later call resumes from the tokens they have, with a
fresh prefill under the new weights (partial rollout). Between safe points, and at a
safe point that does not pause, the cache is kept. Sampling uses the device's torch
RNG: results are reproducible under `torch.manual_seed`.

Run for real: CPU with transformers 5.x (tests and the CPU quickstart). The same code
runs on a GPU or NPU platform (the model is moved to `platform.device(0)`); vLLM and
vllm-ascend are separate adapters.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from tidal.engines.sampling import check_truncation, truncate
from tidal.engines.weight_checks import collect_weights
from tidal.flow.protocols import Refill
from tidal.flow.trajectory import Trajectory, unfinished
from tidal.hal import Platform, current_platform


class HFRolloutEngine:
    """A `RolloutEngine` around a transformers causal LM."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        eos_id: int | Sequence[int],
        pad_id: int,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        chunk_tokens: int = 8,
        platform: Platform | None = None,
        version: int = 0,
    ) -> None:
        if not temperature > 0:  # `not >`: nan is refused too
            raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
        check_truncation(top_k=top_k, top_p=top_p)
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.platform = platform or current_platform()
        self.device = self.platform.device(0)
        self.model = model.to(self.device).eval()
        stops = [eos_id] if isinstance(eos_id, int) else list(eos_id)
        if not stops or not all(isinstance(i, int) and not isinstance(i, bool) for i in stops):
            raise ValueError(f"eos_id must be a token id or a non-empty list of them, got {eos_id!r}")
        self.eos_ids, self.pad_id = frozenset(stops), pad_id
        self.temperature, self.chunk_tokens = temperature, chunk_tokens
        self.top_k, self.top_p = top_k, top_p
        self.version = version
        # Only the last position's logits are needed: models that can skip the others do.
        forward = inspect.signature(type(model).forward).parameters
        self._last_logits = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}
        # transformers 5.24 renamed `past_key_values` to `cache` (the old name warns, and goes in 5.40)
        self._cache_name = "cache" if "cache" in forward else "past_key_values"

    @torch.no_grad()
    def generate(
        self, trajectories: Sequence[Trajectory], *, max_new_tokens: int, should_pause: Callable[[], bool] | None = None, refill: Refill | None = None
    ) -> list[Trajectory]:
        """See `RolloutEngine.generate`; with `refill`, continuous batching (`Refill`).

        Raises:
            ValueError: an unfinished trajectory has no prompt token (its row would attend
                to nothing), or is given twice (`[t] * n`: its rows' samples would all go
                into it); nothing is generated. The same for rows `refill.more()` gives,
                raised when it gives them (rows decoded so far keep what they had).
        """
        rows = list(trajectories)
        active = unfinished(rows, max_new_tokens, set())
        if active:
            rows += _Decoding(self, max_new_tokens).run(active, should_pause, refill)
        return rows

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's tensors under the names `load_weights` expects (what a weight receiver checks against)."""
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach()

    def load_weights(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy every named tensor into the model; all or nothing, then become `version`.

        A floating-point tensor is cast to the model's floating dtype; any other dtype must
        match. Names tied in the model (e.g. `lm_head.weight` and the input embedding) share
        one tensor, so they must be given equal values.

        Raises:
            ValueError: a name is missing, unknown, given twice, or its shape, dtype or tie
                does not match (nothing is copied; the version is unchanged).
        """
        own = self.model.state_dict()  # fresh views: parking (flow.timeshare) gives parameters new storage
        given = collect_weights(version, named_tensors, {name: (t.shape, t.dtype) for name, t in own.items()})
        first: dict[int, str] = {}  # tied names are one Parameter: the copy of the last would overwrite the others
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            tied = first.setdefault(id(tensor), name)
            a, b = given[tied], given[name]
            if tied != name and a is not b and not torch.equal(a, b.to(a.device, a.dtype)):
                nonfinite = [n for n, t in ((tied, a), (name, b)) if t.is_floating_point() and not torch.isfinite(t).all()]
                raise ValueError(
                    f"weights for version {version}: {name!r} is tied to {tied!r} in the model, but they were given different values"
                    + (f" ({' and '.join(repr(n) for n in nonfinite)} not finite: NaN or inf)" if nonfinite else "")
                )
        with torch.no_grad():
            for name, tensor in own.items():
                tensor.copy_(given[name])  # casts and moves to the model's dtype and device
        self.version = version


@dataclasses.dataclass
class _Rows:
    """Rows decoded together: their KV cache and what the next forward needs."""

    slots: torch.Tensor
    """[rows] each row's slot in its `_Decoding` (the cache's batch order; on the host)."""
    cache: Any
    mask: torch.Tensor
    """[rows, width] 1 on each row's real tokens in the cache (left padding: 0)."""
    last: torch.Tensor
    """[rows] the position of each row's last token in the cache."""
    next_ids: torch.Tensor | None = None
    """[rows] the token sampled for each row: the next forward's input."""

    def select(self, keep: torch.Tensor) -> None:
        """Keep only rows `keep` (indices, on the device), in the cache too."""
        self.slots = self.slots[keep.cpu()]
        self.cache.batch_select_indices(keep)
        self.mask, self.last = self.mask[keep], self.last[keep]
        if self.next_ids is not None:
            self.next_ids = self.next_ids[keep]

    def trim(self) -> None:
        """Drop the leading cache columns that are padding in every row (rows that held them left)."""
        columns = self.mask.any(0)
        k = int(columns.long().argmax()) if bool(columns.any()) else 0
        if k:
            self.mask = self.mask[:, k:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[:, :, k:], layer.values[:, :, k:]


def mergeable(cache: Any) -> bool:
    """Whether rows of another cache of this kind can join it: a `DynamicCache` whose every
    layer keeps all positions (`DynamicLayer`: no sliding window, no recurrent state)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer  # noqa: PLC0415

    return type(cache) is DynamicCache and all(type(layer) is DynamicLayer for layer in cache.layers)


def _merge(a: _Rows, b: _Rows) -> _Rows:
    """`a`'s rows then `b`'s in one cache (both `mergeable`, both sampled): the narrower is
    left-padded with masked columns to the wider's width."""
    width = max(a.mask.shape[1], b.mask.shape[1])

    def pad(t: torch.Tensor, dim: int) -> torch.Tensor:
        missing = width - t.shape[dim]
        if not missing:
            return t
        shape = list(t.shape)
        shape[dim] = missing
        return torch.cat([t.new_zeros(shape), t], dim=dim)

    for la, lb in zip(a.cache.layers, b.cache.layers, strict=True):
        la.keys = torch.cat([pad(la.keys, 2), pad(lb.keys, 2)])
        la.values = torch.cat([pad(la.values, 2), pad(lb.values, 2)])
    assert a.next_ids is not None and b.next_ids is not None
    return _Rows(torch.cat([a.slots, b.slots]), a.cache, torch.cat([pad(a.mask, 1), pad(b.mask, 1)]), torch.cat([a.last, b.last]), torch.cat([a.next_ids, b.next_ids]))


class _Decoding:
    """One `generate` call's rows: each trajectory's slot, its tokens so far and its budget.

    Rows join (at the start, and from `refill.more()` after a step where rows ended) with
    one prefill of their distinct inputs, sample their first token, and, when the cache
    allows (`mergeable`), go into the decoding batch beside the rows already there; a row
    leaves when it ends, its trajectory written at once and handed to `refill.done()`."""

    def __init__(self, engine: HFRolloutEngine, max_new_tokens: int) -> None:
        self.engine, self.max_new_tokens = engine, max_new_tokens
        self.rows: list[Trajectory] = []
        """Each slot's trajectory."""
        # per slot, on the host: the tokens sampled in this call, their logprobs, how many, how many it may have
        self.tokens = torch.zeros((0, max_new_tokens), dtype=torch.long)
        self.logprobs = torch.zeros((0, max_new_tokens), dtype=torch.float64)  # a float64 model's logprobs kept whole
        self.counts = torch.zeros(0, dtype=torch.long)
        self.budget = torch.zeros(0, dtype=torch.long)
        self.stops = torch.tensor(sorted(engine.eos_ids), dtype=torch.long)
        self.seen: set[int] = set()

    def run(self, active: list[Trajectory], should_pause: Callable[[], bool] | None, refill: Refill | None) -> list[Trajectory]:
        """Decode until every row ends or a safe point pauses; returns the rows `refill` added."""
        self.seen.update(id(t) for t in active)
        batch, scores = self._prefill(active)
        finished = self._sample(batch, scores)
        added: list[Trajectory] = []
        step = 1
        while True:
            if refill is not None and finished:  # after any step where rows ended: their slots are free
                refill.done(finished)
                finished = []
                if not len(batch.slots) or mergeable(batch.cache):
                    new = unfinished(refill.more(), self.max_new_tokens, self.seen)
                    if new:
                        added += new
                        joining, scores = self._prefill(new)
                        finished += self._sample(joining, scores)
                        batch = joining if not len(batch.slots) else batch if not len(joining.slots) else _merge(batch, joining)
                        batch.trim()
            if not len(batch.slots):
                break
            if step % self.engine.chunk_tokens == 0 and should_pause is not None and should_pause():
                break
            finished += self._sample(batch, self._forward(batch))
            step += 1
        for slot in batch.slots.tolist():  # paused: what the rows have so far
            self._write(slot)
        if finished and refill is not None:
            refill.done(finished)
        return added

    def _prefill(self, rows: list[Trajectory]) -> tuple[_Rows, torch.Tensor]:
        """New slots for `rows`, one forward over their distinct inputs (a group's samples of a
        fresh prompt share one); returns them and each row's next-token scores."""
        engine, device = self.engine, self.engine.device
        slots = torch.arange(len(self.rows), len(self.rows) + len(rows))
        self.rows += rows
        self.tokens = torch.cat([self.tokens, self.tokens.new_zeros((len(rows), self.max_new_tokens))])
        self.logprobs = torch.cat([self.logprobs, self.logprobs.new_zeros((len(rows), self.max_new_tokens))])
        self.counts = torch.cat([self.counts, self.counts.new_zeros(len(rows))])
        self.budget = torch.cat([self.budget, torch.tensor([self.max_new_tokens - t.num_generated for t in rows], dtype=torch.long)])
        distinct: dict[tuple[int, ...], int] = {}
        inverse = [distinct.setdefault(tuple(t.ids), len(distinct)) for t in rows]
        lengths = [len(x) for x in distinct]
        width = max(lengths)
        # left padding: every row's last token is at the end
        input_ids = torch.tensor([[engine.pad_id] * (width - len(x)) + list(x) for x in distinct], dtype=torch.long, device=device)
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - k for k in lengths])[:, None]).long().to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate: pads at 0, real tokens from 0
        out = engine.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, **engine._last_logits)
        cache, scores = getattr(out, engine._cache_name), out.logits[:, -1]
        if len(distinct) < len(rows):  # every row gets its own copy of its prefill
            shared = torch.tensor(inverse, dtype=torch.long, device=device)
            scores, mask, positions = scores[shared], mask[shared], positions[shared]
            cache.batch_select_indices(shared)
        return _Rows(slots, cache, mask, positions[:, -1]), scores

    def _forward(self, batch: _Rows) -> torch.Tensor:
        """One decoding step: each row's sampled token in, its next-token scores out."""
        engine = self.engine
        assert batch.next_ids is not None
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones((len(batch.slots), 1))], dim=-1)
        batch.last = batch.last + 1
        out = engine.model(
            input_ids=batch.next_ids[:, None], attention_mask=batch.mask, position_ids=batch.last[:, None], use_cache=True, **{engine._cache_name: batch.cache}, **engine._last_logits
        )
        batch.cache = getattr(out, engine._cache_name)
        return out.logits[:, -1]

    def _sample(self, batch: _Rows, scores: torch.Tensor) -> list[Trajectory]:
        """Sample a token for every row of `batch` from `scores`; rows that end (a stop token,
        or their budget) leave it, their trajectories written. Returns those."""
        engine = self.engine
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) / engine.temperature  # half precision up to float32; float64 stays
        scores = truncate(scores, top_k=engine.top_k, top_p=engine.top_p)
        sampled = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1)
        chosen = torch.log_softmax(scores, dim=-1).gather(-1, sampled).squeeze(-1)
        sampled = sampled.squeeze(-1)
        tokens, slots = sampled.cpu(), batch.slots
        at = self.counts[slots]
        self.tokens[slots, at] = tokens
        self.logprobs[slots, at] = chosen.double().cpu()
        self.counts[slots] = at + 1
        stop = torch.isin(tokens, self.stops)
        ended = stop | (at + 1 >= self.budget[slots])
        batch.next_ids = sampled
        if not bool(ended.any()):
            return []
        finished = []
        for slot, stopped in zip(slots[ended].tolist(), stop[ended].tolist()):
            finished.append(self._write(slot))
            finished[-1].finish_reason = "stop" if stopped else "length"
        batch.select((~ended).nonzero().squeeze(-1).to(sampled.device))
        return finished

    def _write(self, slot: int) -> Trajectory:
        """Add what slot `slot` sampled in this call to its trajectory; returns the trajectory."""
        t, n = self.rows[slot], int(self.counts[slot])
        t.extend(self.tokens[slot, :n].tolist(), self.logprobs[slot, :n].tolist(), self.engine.version)
        return t
