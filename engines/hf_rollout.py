"""The `hf` rollout engine: transformers `generate` with sampling, on any hal platform.

Token in, token out: it continues `Trajectory` objects and records, for every sampled
token, its behavior logprob (log-softmax of the raw logits at the sampling temperature)
and the version of the weights that sampled it. Generation runs in chunks of
`chunk_tokens` decoding steps; between chunks (safe points) it asks `should_pause()`, so
new weights can be applied and the generation resumed from the tokens it already has
(partial rollout). Sampling uses the global torch RNG: results are reproducible under
`torch.manual_seed`.

Run for real: CPU with transformers 5.x (tests and the CPU quickstart). The same code
runs on a GPU or NPU platform (the model is moved to `platform.device(0)`); vLLM and
vllm-ascend are separate adapters.
"""

from __future__ import annotations

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
        eos_id: int,
        pad_id: int,
        temperature: float = 1.0,
        chunk_tokens: int = 8,
        platform: Platform | None = None,
        version: int = 0,
    ) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.platform = platform or current_platform()
        self.device = self.platform.device(0)
        self.model = model.to(self.device).eval()
        self.eos_id, self.pad_id = eos_id, pad_id
        self.temperature, self.chunk_tokens = temperature, chunk_tokens
        self.version = version

    @torch.no_grad()
    def generate(self, trajectories: Sequence[Trajectory], *, max_new_tokens: int, should_pause: Callable[[], bool] | None = None) -> list[Trajectory]:
        """See `RolloutEngine.generate`."""
        rows = list(trajectories)
        while True:
            active = [t for t in rows if not t.done and t.num_generated < max_new_tokens]
            for t in rows:
                if not t.done and t.num_generated >= max_new_tokens:
                    t.finish_reason = "length"
            if not active:
                return rows
            self._chunk(active, max_new_tokens)
            if should_pause is not None and any(not t.done for t in rows) and should_pause():
                return rows

    def _chunk(self, active: list[Trajectory], max_new_tokens: int) -> None:
        ids = [t.ids for t in active]
        width = max(map(len, ids))
        input_ids = torch.full((len(ids), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for row, x in enumerate(ids):  # left padding: every row's last token is at the end
            input_ids[row, width - len(x) :] = torch.tensor(x, dtype=torch.long)
            mask[row, width - len(x) :] = 1
        steps = min(self.chunk_tokens, max(max_new_tokens - t.num_generated for t in active))
        out = self.model.generate(
            input_ids.to(self.device),
            attention_mask=mask.to(self.device),
            max_new_tokens=steps,
            do_sample=True,
            temperature=self.temperature,
            top_k=0,
            top_p=1.0,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_id,
        )
        new = out.sequences[:, width:].cpu()
        logits = torch.stack(out.logits, dim=1).float().cpu()  # [rows, steps, vocab]
        logprobs = torch.log_softmax(logits / self.temperature, dim=-1).gather(-1, new[:, : logits.shape[1], None]).squeeze(-1)
        for row, t in enumerate(active):
            budget = max_new_tokens - t.num_generated
            tokens, lps = new[row].tolist()[:budget], logprobs[row].tolist()[:budget]
            if self.eos_id in tokens:
                end = tokens.index(self.eos_id) + 1
                tokens, lps = tokens[:end], lps[:end]
                t.finish_reason = "stop"
            t.extend(tokens, lps, self.version)
            if not t.done and t.num_generated >= max_new_tokens:
                t.finish_reason = "length"

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The model's tensors under the names `load_weights` expects (what a weight receiver checks against)."""
        for name, tensor in self.model.state_dict().items():
            yield name, tensor.detach()

    def load_weights(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy every named tensor into the model; all or nothing, then become `version`."""
        given = dict(named_tensors)
        own = self.model.state_dict()
        missing = sorted(set(own) - set(given))
        unknown = sorted(set(given) - set(own))
        wrong = sorted(n for n in set(own) & set(given) if tuple(own[n].shape) != tuple(given[n].shape))
        if missing or unknown or wrong:
            raise ValueError(f"weights for version {version} do not match the model: missing {missing[:5]}, unknown {unknown[:5]}, wrong shape {wrong[:5]}")
        with torch.no_grad():
            for name, tensor in own.items():
                tensor.copy_(given[name].to(device=tensor.device, dtype=tensor.dtype))
        self.version = version
