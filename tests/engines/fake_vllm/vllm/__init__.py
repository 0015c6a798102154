"""A fake vLLM 0.32.0 for tidal's tests: the module paths, classes and signatures the `vllm`
rollout adapter uses (checked against tests/engines/vllm_api_0.32.0.json), behaving as the
real ones do where the adapter relies on it, on CPU, with no vLLM installed.

Faithful: `AsyncLLM.from_engine_args` validates the engine arguments vLLM validates
(`logprobs_mode`, `dtype`, `tensor_parallel_size`, `gpu_memory_utilization`) and mixes the
`worker_extension_cls` into its workers after vLLM's name-conflict check; `generate` is an
async generator of `RequestOutput`s with DELTA outputs (merged when the consumer lags, as
vLLM's output collector does), stopping as vLLM's scheduler does (`stop_token_ids`, the
checkpoint's end tokens unless `ignore_eos`, `max_tokens`, `max_model_len`); logprobs follow
`logprobs_mode`; `abort` ends requests with a final "abort" output; `sleep` needs
`enable_sleep_mode`, aborts running requests and pauses scheduling until a full `wake_up`;
a level-2 sleep discards the weights; `collective_rpc` carries its arguments and results
through msgpack as vLLM's engine process does (a tensor argument is refused: the real one
would arrive as an untyped list); every coroutine must run on the loop the engine first ran
on. The workers' model holds vLLM's fused parameter layout (`qkv_proj`, `gate_up_proj`, a
tied `lm_head`) and its `load_weights` maps Hugging Face names onto it as vLLM's
`AutoWeightsLoader` with Qwen2's `hf_to_vllm_mapper` does.

Not faithful: one process (workers are objects, every tensor-parallel rank holds the whole
model), float32 on CPU, one forward per request per step without a KV cache, a short
`STEP_S` wait per step standing in for device time, `n=1` / DELTA / `detokenize=False` only,
and a live duplicate request id is refused (real vLLM 0.32 randomises request ids and accepts
duplicates, but `abort(id)` then aborts all of them: the adapter must not rely on that).
"""

from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from vllm.inputs import TokensPrompt
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import SamplingParams

__version__ = "0.32.0"
FAKE = True

__all__ = ["AsyncEngineArgs", "CompletionOutput", "EngineArgs", "RequestOutput", "SamplingParams", "TokensPrompt", "__version__"]
