"""The `hf` rollout engine: a transformers causal LM sampled by tidal's own decoding loop, on any hal platform.

Token in, token out: it continues `Trajectory` objects and records, for every sampled
token, its behavior logprob (log-softmax of the raw logits at the sampling temperature)
and the version of the weights that sampled it.

The decoding loop is written here rather than calling transformers `generate`: one
prefill of the left-padded batch (prompt and any tokens a paused trajectory already
has), then one forward per token over the model's KV cache (`DynamicCache`), sampling
from `softmax(logits / temperature)` with `torch.multinomial` as `generate(do_sample=True,
top_k=0, top_p=1)` does. Rows that end (EOS, or their own token budget) leave the batch
and the cache at once, so later steps compute only unfinished rows (`eos_id` may list
several stop tokens, as instruct models' generation configs do); `generate` keeps
every row to the end and costs a call's set-up every chunk. With no row ending early the
tokens are those `generate` samples under the same seed (a test checks it).

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

import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch

from tidal.flow.trajectory import Trajectory
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
        chunk_tokens: int = 8,
        platform: Platform | None = None,
        version: int = 0,
    ) -> None:
        if not temperature > 0:  # `not >`: nan is refused too
            raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.platform = platform or current_platform()
        self.device = self.platform.device(0)
        self.model = model.to(self.device).eval()
        stops = [eos_id] if isinstance(eos_id, int) else list(eos_id)
        if not stops or not all(isinstance(i, int) and not isinstance(i, bool) for i in stops):
            raise ValueError(f"eos_id must be a token id or a non-empty list of them, got {eos_id!r}")
        self.eos_ids, self.pad_id = frozenset(stops), pad_id
        self._stops = torch.tensor(sorted(self.eos_ids), dtype=torch.long)
        self.temperature, self.chunk_tokens = temperature, chunk_tokens
        self.version = version
        # Only the last position's logits are needed: models that can skip the others do.
        forward = inspect.signature(type(model).forward).parameters
        self._last_logits = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}
        # transformers 5.24 renamed `past_key_values` to `cache` (the old name warns, and goes in 5.40)
        self._cache_name = "cache" if "cache" in forward else "past_key_values"

    @torch.no_grad()
    def generate(self, trajectories: Sequence[Trajectory], *, max_new_tokens: int, should_pause: Callable[[], bool] | None = None) -> list[Trajectory]:
        """See `RolloutEngine.generate`.

        Raises:
            ValueError: an unfinished trajectory has no prompt token (its row would attend
                to nothing), or is given twice (`[t] * n`: its rows' samples would all go
                into it); nothing is generated.
        """
        rows = list(trajectories)
        if any(not t.prompt_ids and not t.done for t in rows):
            raise ValueError("a trajectory needs at least one prompt token")
        seen: dict[int, int] = {}
        for k, t in enumerate(rows):
            if not t.done and seen.setdefault(id(t), k) != k:
                raise ValueError(f"trajectories {seen[id(t)]} and {k} are the same object: give each sample its own Trajectory (not [t] * n)")
        for t in rows:
            if not t.done and t.num_generated >= max_new_tokens:
                t.finish_reason = "length"
        active = [t for t in rows if not t.done]
        if active:
            self._decode(active, max_new_tokens, should_pause)
        return rows

    def _decode(self, active: list[Trajectory], max_new_tokens: int, should_pause: Callable[[], bool] | None) -> None:
        """Sample until every row ends or a safe point pauses; then write the tokens into the trajectories."""
        device, n = self.device, len(active)
        # Rows with the same input (a group's samples of a fresh prompt) are prefilled once.
        distinct: dict[tuple[int, ...], int] = {}
        inverse = [distinct.setdefault(tuple(t.ids), len(distinct)) for t in active]
        lengths = [len(x) for x in distinct]
        width = max(lengths)
        # left padding: every row's last token is at the end
        input_ids = torch.tensor([[self.pad_id] * (width - len(x)) + list(x) for x in distinct], dtype=torch.long, device=device)
        mask = (torch.arange(width)[None, :] >= torch.tensor([width - k for k in lengths])[:, None]).long().to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate: pads at 0, real tokens from 0
        shared = torch.tensor(inverse, dtype=torch.long, device=device) if len(distinct) < n else None
        budget = torch.tensor([max_new_tokens - t.num_generated for t in active])
        num_steps = int(budget.max())
        tokens = torch.full((n, num_steps), self.pad_id, dtype=torch.long)
        logprobs = torch.zeros((n, num_steps), dtype=torch.float64)  # a float64 model's logprobs kept whole
        counts = torch.zeros(n, dtype=torch.long)
        live = torch.arange(n)  # original row of each row still in the batch
        cache = None
        for step in range(num_steps):
            out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True, **{self._cache_name: cache}, **self._last_logits)
            cache = getattr(out, self._cache_name)
            scores = out.logits[:, -1]
            scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) / self.temperature  # half precision up to float32; float64 stays
            if shared is not None and step == 0:  # every row gets its own copy of its prefill
                scores, mask, positions = scores[shared], mask[shared], positions[shared]
                cache.batch_select_indices(shared)
            sampled = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1)
            chosen = torch.log_softmax(scores, dim=-1).gather(-1, sampled).squeeze(-1).cpu()
            sampled = sampled.squeeze(-1)
            host = sampled.cpu()
            tokens[live, step] = host
            logprobs[live, step] = chosen.double()
            counts[live] = step + 1
            going = ~torch.isin(host, self._stops) & (budget[live] > step + 1)
            if not bool(going.any()):
                break
            if (step + 1) % self.chunk_tokens == 0 and should_pause is not None and should_pause():
                break
            if not bool(going.all()):  # ended rows leave the batch and the cache
                keep = going.nonzero().squeeze(-1)
                live, sampled, mask, positions = live[keep], sampled[keep.to(device)], mask[keep.to(device)], positions[keep.to(device)]
                cache.batch_select_indices(keep.to(device))
            input_ids = sampled[:, None]
            mask = torch.cat([mask, mask.new_ones((len(live), 1))], dim=-1)
            positions = positions[:, -1:] + 1
        for t, k, new, lps, left in zip(active, counts.tolist(), tokens.tolist(), logprobs.tolist(), budget.tolist()):
            t.extend(new[:k], lps[:k], self.version)
            if k and new[k - 1] in self.eos_ids:
                t.finish_reason = "stop"
            elif k == left:
                t.finish_reason = "length"

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
        given: dict[str, torch.Tensor] = {}
        repeated = []
        for name, tensor in named_tensors:
            if name in given:
                repeated.append(name)
            given[name] = tensor
        own = self.model.state_dict()  # fresh views: parking (flow.timeshare) gives parameters new storage
        missing = sorted(set(own) - set(given))
        unknown = sorted(set(given) - set(own))
        both = sorted(set(own) & set(given))
        wrong = [n for n in both if own[n].shape != given[n].shape]
        dtype = [n for n in both if own[n].dtype != given[n].dtype and not (own[n].dtype.is_floating_point and given[n].dtype.is_floating_point)]
        if missing or unknown or wrong or dtype or repeated:
            raise ValueError(f"weights for version {version} do not match the model: missing {missing[:5]}, unknown {unknown[:5]}, wrong shape {wrong[:5]}, wrong dtype {dtype[:5]}, given twice {repeated[:5]}")
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
