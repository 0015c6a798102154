"""`RequestOutput` / `CompletionOutput` as vLLM 0.32.0 defines them (constructor and `add`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class CompletionOutput:
    """One completion of a request: with DELTA outputs, the tokens since the last output, and
    (`logprobs`) one `{token_id: Logprob}` dict per token."""

    index: int
    text: str
    token_ids: Sequence[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Any]] | None
    routed_experts: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any = None
    sampling_mask: Any = None
    spec_decode_metrics: Any = None
    weight_versions: Any = None

    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutput:
    """The output data of a completion request."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        prompt_logprobs: Any,
        outputs: list[CompletionOutput],
        finished: bool,
        metrics: Any = None,
        lora_request: Any = None,
        encoder_prompt: str | None = None,
        encoder_prompt_token_ids: list[int] | None = None,
        num_cached_tokens: int | None = None,
        num_cache_creation_tokens: int | None = None,
        *,
        prompt_token_id_logprobs: Any = None,
        kv_transfer_params: dict[str, Any] | None = None,
        ec_transfer_params: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs = prompt_logprobs
        self.prompt_token_id_logprobs = prompt_token_id_logprobs
        self.outputs = outputs
        self.finished = finished
        self.metrics = metrics
        self.lora_request = lora_request
        self.encoder_prompt = encoder_prompt
        self.encoder_prompt_token_ids = encoder_prompt_token_ids
        self.num_cached_tokens = num_cached_tokens
        self.num_cache_creation_tokens = num_cache_creation_tokens
        self.kv_transfer_params = kv_transfer_params
        self.ec_transfer_params = ec_transfer_params

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merge a later output into this one (vLLM's output collector does when the consumer lags)."""
        self.finished |= next_output.finished
        for nxt in next_output.outputs:
            for i, completion in enumerate(self.outputs):
                if completion.index == nxt.index:
                    if aggregate:
                        completion.text += nxt.text
                        completion.token_ids = [*completion.token_ids, *nxt.token_ids]
                        if nxt.logprobs:
                            assert completion.logprobs is not None
                            completion.logprobs.extend(nxt.logprobs)
                        completion.cumulative_logprob = nxt.cumulative_logprob
                        completion.finish_reason = nxt.finish_reason
                        completion.stop_reason = nxt.stop_reason
                    else:
                        self.outputs[i] = nxt
                    break
            else:
                self.outputs.append(nxt)
