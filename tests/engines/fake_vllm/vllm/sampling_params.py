"""`SamplingParams` (the fields tidal passes, validated as vLLM 0.32.0 validates them) and `RequestOutputKind`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

_SAMPLING_EPS = 1e-5
_MAX_TEMP = 1e-2


class RequestOutputKind(Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class VLLMValidationError(ValueError):
    """A request vLLM refuses."""


@dataclass
class SamplingParams:
    """Sampling parameters for text generation (the subset tidal passes)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    logprobs: int | None = None
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    _all_stop_token_ids: set[int] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        if 0 < self.temperature < _MAX_TEMP:
            self.temperature = _MAX_TEMP  # vLLM raises it (with a warning)
        if self.seed == -1:
            self.seed = None
        self.stop_token_ids = [] if self.stop_token_ids is None else list(dict.fromkeys(self.stop_token_ids))
        if self.logprobs is True:
            self.logprobs = 1
        if self.n < 1:
            raise VLLMValidationError(f"n must be at least 1, got {self.n}.")
        if not math.isfinite(self.temperature) or not 0.0 <= self.temperature <= 2.0:
            raise VLLMValidationError(f"temperature must be in [0, 2], got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise VLLMValidationError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise VLLMValidationError(f"top_k must be 0 (disable), or at least 1, got {self.top_k}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise VLLMValidationError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.logprobs is not None and self.logprobs < -1:
            raise VLLMValidationError(f"logprobs must be non-negative or -1, got {self.logprobs}.")
        if self.temperature < _SAMPLING_EPS:  # greedy
            self.top_p, self.top_k = 1.0, 0
        self._all_stop_token_ids.update(self.stop_token_ids)
