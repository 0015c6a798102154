"""A fake `AsyncLLM`: vLLM 0.32.0's v1 async engine as far as tidal's adapter uses it (see the
package docstring for what is faithful and what is not).

Every instance is appended to `INSTANCES` and records the calls made on it, in order, in
`calls` (tuples naming the method and its main arguments), for tests to read.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Iterable
from pathlib import Path
from typing import Any, get_args

import msgpack
import torch

from vllm.config.model import LogprobsMode, ModelDType
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams, VLLMValidationError
from vllm.usage.usage_lib import UsageContext
from vllm.v1.engine import EngineDeadError, PauseMode
from vllm.v1.worker.gpu_worker import Worker
from vllm.v1.worker.worker_base import with_extension

INSTANCES: list[AsyncLLM] = []
STEP_S = 0.002
"""The wait before each decoding step: stands in for device time, so the threads consuming
outputs get turns between steps as they do beside a real engine."""


class _Request:
    """One running request and its output collector (vLLM's `RequestOutputCollector`: a DELTA
    output not yet taken is merged with the next)."""

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams, stop_ids: set[int], generator: torch.Generator) -> None:
        self.request_id, self.prompt, self.params, self.stop_ids, self.generator = request_id, prompt, params, stop_ids, generator
        self.output: list[int] = []
        self.finished = False
        self.pending: RequestOutput | Exception | None = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput | Exception) -> None:
        if self.pending is None or isinstance(output, Exception):
            self.pending = output
            self.ready.set()
        elif isinstance(self.pending, RequestOutput) and isinstance(output, RequestOutput):
            self.pending.add(output, aggregate=True)

    async def get(self) -> RequestOutput:
        while (output := self.pending) is None:
            await self.ready.wait()
        self.pending = None
        self.ready.clear()
        if isinstance(output, Exception):
            raise output
        return output

    def emit(self, tokens: list[int], logprobs: list[dict[int, Logprob]], reason: str | None, stop_reason: int | None = None) -> None:
        completion = CompletionOutput(0, "", tokens, None, logprobs if self.params.logprobs is not None else None, finish_reason=reason, stop_reason=stop_reason)
        self.finished = self.finished or reason is not None
        self.put(RequestOutput(self.request_id, None, self.prompt, None, [completion], finished=reason is not None))


def _wire(obj: Any) -> Any:
    """`obj` after a trip through msgpack, as a utility call's arguments and results take one
    between the client and vLLM's engine process (tuples arrive as lists)."""

    def refuse(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            raise TypeError("a torch.Tensor in a collective_rpc call: vLLM 0.32 decodes it without its type, as a [dtype, shape, buffer index] list, not a tensor")
        raise TypeError(f"Object of type {type(value)} is not serializable (vLLM would need VLLM_ALLOW_INSECURE_SERIALIZATION=1 to pickle it)")

    return msgpack.unpackb(msgpack.packb(obj, default=refuse, use_bin_type=True), raw=False, strict_map_key=False)


class AsyncLLM:
    """A fake of vLLM's `AsyncLLM`. Build it with `from_engine_args` (its constructor is not vLLM's)."""

    def __init__(self, engine_args: AsyncEngineArgs) -> None:
        a = engine_args
        if a.logprobs_mode not in get_args(LogprobsMode):
            raise ValueError(f"logprobs_mode {a.logprobs_mode!r} is not one of {get_args(LogprobsMode)}")
        if a.dtype not in get_args(ModelDType):
            raise ValueError(f"dtype {a.dtype!r} is not one of {get_args(ModelDType)}")
        if not isinstance(a.tensor_parallel_size, int) or a.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {a.tensor_parallel_size}")
        if not 0 < a.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {a.gpu_memory_utilization}")
        model_dir = Path(a.model)
        if not (model_dir / "config.json").is_file():
            raise OSError(f"{a.model} is not a local folder with a config.json (and the fake cannot reach the Hugging Face Hub)")
        config = json.loads((model_dir / "config.json").read_text())
        generation = json.loads((model_dir / "generation_config.json").read_text()) if (model_dir / "generation_config.json").is_file() else {}
        self.eos_token_id: int | None = config.get("eos_token_id")
        ends = generation.get("eos_token_id")
        self.generation_eos: set[int] = set() if ends is None else {ends} if isinstance(ends, int) else set(ends)
        limit = config.get("max_position_embeddings", 2048)
        if a.max_model_len is not None and a.max_model_len > limit:
            raise ValueError(f"max_model_len {a.max_model_len} is greater than the derived max_model_len {limit}")
        self.max_model_len = a.max_model_len or limit
        self.engine_args = engine_args
        self.calls: list[tuple[Any, ...]] = [("from_engine_args",)]
        worker_class = with_extension(Worker, a.worker_extension_cls)
        self.workers = [worker_class(str(model_dir), rank, trust_remote_code=a.trust_remote_code) for rank in range(a.tensor_parallel_size)]
        self.requests: dict[str, _Request] = {}
        self.sleeping_tags: set[str] = set()
        self.paused = False
        self.dead = False
        self.generator = torch.Generator().manual_seed(a.seed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._work: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        try:
            self._check_loop()
        except RuntimeError:  # built outside a loop: bound to the first one that uses it
            pass
        INSTANCES.append(self)

    @classmethod
    def from_engine_args(cls, engine_args: AsyncEngineArgs, start_engine_loop: bool = True, usage_context: UsageContext = UsageContext.ENGINE_CONTEXT, stat_loggers: Any = None) -> AsyncLLM:
        if not isinstance(engine_args, AsyncEngineArgs):
            raise TypeError(f"engine_args must be an AsyncEngineArgs, got {type(engine_args).__name__}")
        return cls(engine_args)

    # --- requests ------------------------------------------------------------------------

    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        prompt_text: str | None = None,
        lora_request: Any = None,
        tokenization_kwargs: dict[str, Any] | None = None,
        trace_headers: Any = None,
        priority: int = 0,
        data_parallel_rank: int | None = None,
        session_id: str | None = None,
        kv_hints: Any = None,
        reasoning_ended: bool | None = None,
        reasoning_parser_kwargs: dict[str, Any] | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        self._check_loop()
        if self.dead:
            raise EngineDeadError("the engine was shut down")
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        if not isinstance(prompt, dict) or "prompt_token_ids" not in prompt:
            raise NotImplementedError("the fake takes token prompts only (TokensPrompt)")
        ids = list(prompt["prompt_token_ids"])
        vocab = self.workers[0].get_model().config.vocab_size
        if not ids or not all(isinstance(i, int) and 0 <= i < vocab for i in ids):
            raise VLLMValidationError(f"prompt_token_ids must be a non-empty list of token ids below {vocab}")
        p = sampling_params
        if p.n != 1 or p.output_kind is not RequestOutputKind.DELTA or p.detokenize:
            raise NotImplementedError("the fake supports n=1, output_kind=DELTA and detokenize=False only")
        if p.logprobs is not None and p.logprobs > 20:
            raise VLLMValidationError(f"Requested sample logprobs of {p.logprobs}, which is greater than max allowed: 20")
        if len(ids) >= self.max_model_len:
            raise VLLMValidationError(f"The prompt (length {len(ids)}) is longer than the maximum model length of {self.max_model_len}.")
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already running (the fake refuses what vLLM 0.32 would accept and abort together)")
        stop_ids = set(p.stop_token_ids or ())
        if not p.ignore_eos:  # SamplingParams.update_from_generation_config
            stop_ids |= self.generation_eos - {self.eos_token_id}
        request = _Request(request_id, ids, p, stop_ids, torch.Generator().manual_seed(p.seed) if p.seed is not None else self.generator)
        self.calls.append(("generate", request_id, sampling_params))
        self.requests[request_id] = request
        self._kick()
        try:
            while True:
                output = await request.get()
                yield output
                if output.finished:
                    return
        except (asyncio.CancelledError, GeneratorExit):
            await self.abort(request_id, internal=True)
            raise
        finally:
            if self.requests.get(request_id) is request:
                del self.requests[request_id]

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        self._check_loop()
        ids = (request_id,) if isinstance(request_id, str) else tuple(request_id)
        if not internal:
            self.calls.append(("abort", ids))
        for rid in ids:
            request = self.requests.get(rid)
            if request is not None and not request.finished:
                request.emit([], [], "abort")

    async def pause_generation(self, *, mode: PauseMode = "abort", clear_cache: bool = True) -> None:
        self._check_loop()
        self.calls.append(("pause_generation", mode))
        self._pause(mode)

    async def resume_generation(self) -> None:
        self._check_loop()
        self.calls.append(("resume_generation",))
        self.paused = False
        self._kick()

    # --- caches, sleep mode, workers -------------------------------------------------------------

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        self._check_loop()
        self.calls.append(("reset_prefix_cache",))
        return reset_running_requests or not any(not r.finished for r in self.requests.values())

    async def sleep(self, level: int = 1, mode: PauseMode = "abort") -> None:
        self._check_loop()
        self.calls.append(("sleep", level))
        if not self.engine_args.enable_sleep_mode:
            raise RuntimeError("sleep mode is not enabled (engine argument enable_sleep_mode)")
        self._pause(mode)
        if level < 1 or "weights" in self.sleeping_tags:
            return
        for worker in self.workers:
            worker.sleep(level)
        self.sleeping_tags |= {"weights", "kv_cache"}

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        self._check_loop()
        self.calls.append(("wake_up", None if tags is None else list(tags)))
        if tags is not None and "scheduling" in tags:
            tags = [t for t in tags if t != "scheduling"]
        if (tags is None or tags) and self.sleeping_tags and all(t in self.sleeping_tags for t in tags or ()):
            for worker in self.workers:
                worker.wake_up(tags)
            self.sleeping_tags -= set(tags) if tags else set(self.sleeping_tags)
        awake = not self.sleeping_tags
        if awake:
            self.paused = False
            self._kick()
        return awake

    async def is_sleeping(self) -> bool:
        self._check_loop()
        return self.paused or bool(self.sleeping_tags)

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        self._check_loop()
        self.calls.append(("collective_rpc", method))
        if self.dead:
            raise EngineDeadError("the engine was shut down")
        if not isinstance(method, str):
            raise NotImplementedError("a callable needs VLLM_ALLOW_INSECURE_SERIALIZATION=1 in vLLM; the fake takes method names")
        args, kwargs = _wire([list(args), kwargs or {}])
        results = []
        for worker in self.workers:
            try:
                results.append(getattr(worker, method)(*args, **kwargs))
            except Exception as e:
                raise RuntimeError(f"Worker {worker.rank} failed in collective_rpc {method!r}: {type(e).__name__}: {e}") from e
        return _wire(results)

    def shutdown(self, timeout: float | None = None) -> None:
        self.calls.append(("shutdown",))
        self.dead = True

        def stop() -> None:
            for request in self.requests.values():
                if not request.finished:
                    request.put(EngineDeadError("the engine was shut down"))
            if self._task is not None:
                self._task.cancel()

        if self._loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            stop()
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(stop)

    # --- the engine's loop ------------------------------------------------------------------

    def _check_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop, self._work = loop, asyncio.Event()
        elif loop is not self._loop:
            raise RuntimeError("AsyncLLM used from an event loop other than its own: its tasks and queues are bound to the first loop that ran it")

    def _pause(self, mode: str) -> None:
        if mode not in get_args(PauseMode):
            raise ValueError(f"Invalid pause mode: {mode}")
        if mode == "wait":
            raise NotImplementedError("the fake does not drain requests (mode='wait')")
        if mode == "abort":
            for request in self.requests.values():
                if not request.finished:
                    request.emit([], [], "abort")
        self.paused = True

    def _kick(self) -> None:
        assert self._work is not None
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._work.set()

    async def _run(self) -> None:
        assert self._work is not None
        while not self.dead:
            running = [r for r in self.requests.values() if not r.finished]
            if not running or self.paused:
                self._work.clear()
                await self._work.wait()
                continue
            await asyncio.sleep(STEP_S)
            for request in running:
                if not request.finished and not self.paused and not self.dead:
                    try:
                        self._step(request)
                    except Exception as e:  # a request's failure goes to its consumer
                        request.finished = True
                        request.put(e)

    def _step(self, r: _Request) -> None:
        """Sample one token for `r` and emit it (with its logprob, per `logprobs_mode`)."""
        logits = self.workers[0].get_model().next_token_logits(r.prompt + r.output)
        p = r.params
        greedy = p.temperature < 1e-5
        scaled = logits if greedy else _apply_top_k_top_p(logits / p.temperature, p.top_k, p.top_p)
        token = int(scaled.argmax()) if greedy else int(torch.multinomial(torch.softmax(scaled, -1), 1, generator=r.generator))
        values = {
            "raw_logprobs": torch.log_softmax(logits, -1), "processed_logprobs": torch.log_softmax(scaled, -1),
            "raw_logits": logits, "processed_logits": scaled,
        }[self.engine_args.logprobs_mode]  # fmt: skip
        logprob = Logprob(float(values[token]), rank=int((values > values[token]).sum()) + 1)
        r.output.append(token)
        reason, stop_reason = None, None
        if not p.ignore_eos and token == self.eos_token_id:  # vLLM's check_stop, in its order
            reason = "stop"
        elif token in r.stop_ids:
            reason, stop_reason = "stop", token
        elif len(r.prompt) + len(r.output) >= self.max_model_len or (p.max_tokens is not None and len(r.output) >= p.max_tokens):
            reason = "length"
        r.emit([token], [{token: logprob}], reason, stop_reason)


def _apply_top_k_top_p(logits: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """vLLM 0.32's `apply_top_k_top_p_pytorch` (vllm/v1/sample/ops/topk_topp_sampler.py) for
    one request's `[vocab]` logits, transcribed: one ascending sort, top-k on it (ties with the
    k-th kept), then top-p over what top-k left (at least the most probable token), scattered
    back. k in (0, -1) and p == 1 are off. Its Triton kernel (batches of 8 or more on GPUs)
    is not transcribed."""
    if k in (0, -1) and p >= 1.0:
        return logits
    logits_sort, logits_idx = logits[None].sort(dim=-1, descending=False)
    if k not in (0, -1):
        top_k_mask = logits_sort.gather(1, torch.tensor([[max(logits_sort.size(1) - k, 0)]]))
        logits_sort.masked_fill_(logits_sort < top_k_mask, -float("inf"))
    if p < 1.0:
        probs_sum = torch.cumsum(logits_sort.softmax(dim=-1), dim=-1)
        top_p_mask = probs_sum <= 1 - p
        top_p_mask[:, -1] = False
        logits_sort.masked_fill_(top_p_mask, -float("inf"))
    return logits[None].clone().scatter_(dim=-1, index=logits_idx, src=logits_sort)[0]
