"""Each position's logprob of its next token without the batch's float32 copies of the logits.

`log_softmax(logits.float() / temperature)` over a micro-batch holds several
`[positions, vocab]` float32 tensors at once (the copy, the division, the result) and keeps
the result for the backward pass: with a 152k-token vocabulary (Qwen2.5) and 8k positions,
about 5 GB each. `token_logprobs` computes the same values a chunk of positions at a time
(about `CHUNK` values each) and keeps only the logits, in their own dtype, for the backward
pass, which recomputes each chunk's softmax: the gradient of `log p[target]` is
`(onehot(target) - softmax) / temperature`, as autograd's log_softmax backward gives it. The
entropy metric (detached) is taken in the same pass. What stays of the batch is the logits
themselves and their gradient, both in the logits' dtype. Under `top_k` / `top_p`
(`sampling.truncate`, each chunk cut as the whole would be) the softmax is the truncated
one's, in both passes. The values and gradients are
those of the whole-batch expression, bit for bit: each chunk runs its kernels, the backward
autograd's own (`_log_softmax_backward_data`). On CPU the recomputation costs about a sixth
more time than the whole-batch expression (2,048 positions x 152k vocabulary, bf16: peak
memory 3.6 -> 1.4 GB, 3.6 -> 4.2 s); `train_steps.next_token_stats` takes this path only for
logits of more than `CHUNK` values, where the memory matters.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch

from tidal.engines.sampling import truncate
from tidal.flow.algorithms import token_entropy

CHUNK = 1 << 24
"""Values (positions x vocabulary) per chunk: 64 MB of float32 temporaries, about 110
positions of a 150k-token vocabulary."""


def _chunks(wide: tuple[torch.Tensor, ...], narrow: tuple[torch.Tensor, ...]) -> Iterator[tuple[torch.Tensor, ...]]:
    """Views of the same positions of every tensor, about `CHUNK` values at a time: of each
    `wide` one ([..., vocab]) `[n, vocab]`, of each `narrow` one ([...]) `[n]`. They share the
    tensors' storage whatever their strides (`logits[:, :-1]` skips a position per row)."""
    lead = narrow[0].shape
    rows = max(1, CHUNK // max(wide[0].shape[-1], 1))
    for index in itertools.product(*(range(n) for n in lead[:-1])):
        for start in range(0, lead[-1] if lead else 1, rows):
            cut = slice(start, start + rows)
            yield tuple(w[index][cut] for w in wide) + tuple(n[index][cut] for n in narrow)


def _logprobs(part: torch.Tensor, target: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """A chunk's log-softmax at `temperature`, truncated (`target` kept in)."""
    return torch.log_softmax(truncate(part.float() / temperature, top_k=top_k, top_p=top_p, keep=target), dim=-1)


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float, top_k: int, top_p: float, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
        chosen = torch.empty(targets.shape, dtype=torch.float32, device=logits.device)
        entropy = torch.empty(targets.shape, dtype=torch.float32, device=logits.device)
        with torch.no_grad():
            for part, target, out, ent in _chunks((logits,), (targets, chosen, entropy)):
                logprobs = _logprobs(part, target, temperature, top_k, top_p)
                out.copy_(logprobs.gather(-1, target[:, None]).squeeze(-1))
                if with_entropy:
                    ent.copy_(token_entropy(logprobs, grad=False))
        ctx.save_for_backward(logits, targets)
        ctx.sampling = (temperature, top_k, top_p)
        ctx.mark_non_differentiable(entropy)
        return chosen, entropy

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _entropy: torch.Tensor | None) -> tuple[torch.Tensor, None, None, None, None, None]:
        logits, targets = ctx.saved_tensors
        temperature = ctx.sampling[0]
        grad_logits = torch.empty_like(logits)
        for part, into, target, g in _chunks((logits, grad_logits), (targets, grad.float())):
            logprobs = _logprobs(part, target, *ctx.sampling)
            upstream = torch.zeros_like(logprobs).scatter_(-1, target[:, None], g[:, None])
            # autograd's own kernel; a token cut off (-inf) gets 0: its softmax is 0 and only the target has upstream gradient
            into.copy_(torch.ops.aten._log_softmax_backward_data(upstream, logprobs, -1, torch.float32) / temperature)
        return grad_logits, None, None, None, None, None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, temperature: float, top_k: int = 0, top_p: float = 1.0, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each position's float32 logprob of its target under softmax(logits / temperature)
    truncated to `top_k` / `top_p` (`sampling.truncate`, the target kept in), for `logits`
    [..., vocab] in any float dtype and `targets` [...], with gradient to `logits`; with
    `entropy`, also each distribution's entropy, detached (the metric)."""
    chosen, entropies = _TokenLogprobs.apply(logits, targets, temperature, top_k, top_p, entropy)
    return chosen, entropies if entropy else None
