"""Top-k and top-p (nucleus) truncation: the distribution rollout samples from, and the one
the trainer's logprobs are taken under.

`rollout.top_k` / `rollout.top_p` cut the sampling distribution as vLLM's sampler and
transformers' `TopKLogitsWarper` / `TopPLogitsWarper` do, in their order: after the
temperature, keep the `top_k` largest scores (ties with the k-th kept), then, of what is
left renormalised, the smallest set of the most probable tokens whose probability reaches
`top_p` (the most probable token always). Rollout's behavior logprobs are the log-softmax of
the truncated scores (vLLM's `processed_logprobs`).

The trainer takes each token's logprob under the same truncation of its own scores, so the
policy it trains is the one rollout samples from: with the same weights the importance
ratio is 1, as without truncation. Taken under the full softmax instead (as trainers that
pass top_p to vLLM and nothing to the loss do), every sampled token's trained probability
would be its sampled one times the mass of the kept set, a ratio below 1 on every token
that the loss reads as off-policy drift. Off-policy, a sampled token may fall outside the
trainer's own kept set (its weights moved, or rounding at the set's edge): it is kept in
(`keep`), so its logprob stays finite and its gradient defined.
"""

from __future__ import annotations

import torch


def check_truncation(*, top_k: int, top_p: float) -> None:
    """Raises ValueError naming `top_k` (an int >= 0; 0 = off) or `top_p` (in (0, 1]; 1 = off)."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if not 0.0 < top_p <= 1.0:  # `not`: nan is refused too
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p!r}")


def truncates(*, top_k: int, top_p: float) -> bool:
    """Whether `top_k` / `top_p` cut anything."""
    return top_k > 0 or top_p < 1.0


def truncate(scores: torch.Tensor, *, top_k: int = 0, top_p: float = 1.0, keep: torch.Tensor | None = None) -> torch.Tensor:
    """`scores` (`[..., vocab]`, after the temperature) with -inf outside the top-k, then the
    top-p set; `keep` (`[...]` token ids) stay as they were in any case. Returns `scores`
    itself when nothing is cut."""
    if not truncates(top_k=top_k, top_p=top_p):
        return scores
    cut = scores
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(cut, top_k, dim=-1).values[..., -1:]
        cut = cut.masked_fill(cut < kth, -torch.inf)
    if top_p < 1.0:
        ascending, order = torch.sort(cut, dim=-1)
        below = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1.0 - top_p  # the mass up to each, least probable first
        below[..., -1] = False  # the most probable token stays
        cut = cut.masked_fill(below.scatter(-1, order, below), -torch.inf)
    if keep is not None:
        kept = torch.zeros_like(cut, dtype=torch.bool).scatter_(-1, keep[..., None], True)
        cut = torch.where(kept, scores, cut)
    return cut
