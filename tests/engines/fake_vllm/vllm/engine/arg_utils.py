"""`EngineArgs` / `AsyncEngineArgs`: the fields the adapter passes, with vLLM 0.32.0's defaults, in its order."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineArgs:
    """Arguments for vLLM engine (the fields tidal passes; vLLM validates them when the engine is built)."""

    model: str = "Qwen/Qwen3-0.6B"
    dtype: str = "auto"
    seed: int = 0
    trust_remote_code: bool = False
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.92
    logprobs_mode: str = "raw_logprobs"
    enforce_eager: bool = False
    worker_extension_cls: str = ""
    enable_sleep_mode: bool = False


@dataclass
class AsyncEngineArgs(EngineArgs):
    """Arguments for asynchronous vLLM engine."""

    enable_log_requests: bool = False
