"""The `vllm` rollout engine: vLLM's v1 `AsyncLLM` behind tidal's `RolloutEngine` protocol.

Token in, token out, as the `hf` engine: every unfinished `Trajectory` becomes one vLLM
request whose prompt is its token ids so far (`TokensPrompt`: the prompt and whatever a
paused trajectory already generated), sampled with `SamplingParams(n=1, temperature,
top_k, top_p (0 and 1: off), max_tokens=its remaining budget, logprobs=0, detokenize=False,
output_kind=DELTA)`; each streamed delta's token ids and the logprob of each sampled token
are appended to the trajectory with the engine's `version`. The engine is created with
`logprobs_mode="processed_logprobs"`: vLLM's default, `raw_logprobs`, reports the model's
log-softmax before the temperature is applied, which is not the distribution the token was
sampled from, so every importance ratio the trainer forms from those behavior logprobs
would be biased; the processed ones are also cut to top-k / top-p, as the trainer's are
(`engines.sampling`, which follows vLLM's `apply_top_k_top_p`). Rows stop at tidal's `eos_id`s only (`ignore_eos=True` with
`stop_token_ids`), as the `hf` engine's do, not also at the checkpoint's generation-config
ends. `finish_reason` is "stop" (an end token, kept in the tokens) or "length" (the
budget, or vLLM's `max_model_len`).

The `AsyncLLM` lives on an asyncio event loop in a thread of its own, started by the
constructor and stopped by `close()`; the synchronous protocol methods submit coroutines
to it (`asyncio.run_coroutine_threadsafe`), and `generate` consumes the requests' outputs in
the caller's thread, where it also calls `should_pause` and `refill` (they may block on the
store without stalling vLLM's output handling).

Partial rollout: after outputs that gave some request `chunk_tokens` more tokens, the
engine asks `should_pause()`; when it says so, it aborts its running requests
(`AsyncLLM.abort(request_ids)`, as AReaL's and verl's partial rollouts end theirs), keeps
every token that was streamed before the abort (each with its logprob), and returns with
those rows unfinished (`finish_reason=None`). A later `generate` resubmits them from their
tokens, under whatever weights are loaded then (per-token versions tell which).
`pause_generation` / `resume_generation` exist in 0.32 but are not used: in "abort" mode
they end every request of the engine and leave its scheduler paused until resumed, in
"keep" mode requests stay inside vLLM, while tidal's contract hands paused trajectories
back to the caller (which may give them to another worker). With `refill` (continuous
batching, native to vLLM), rows that end are handed to `refill.done()` as their outputs
arrive and the rows `refill.more()` gives become new requests at once; they are returned
after the rows given.

Weights: `load_weights(version, named_tensors)` takes the weights by Hugging Face name.
They are checked, before anything is sent, against the checkpoint's manifest: the names,
shapes and dtypes of the Hugging Face model `model_path` configures, built on the meta
device (no memory), tied names included (`named_weights()` gives the same specs, for a
weight receiver's `expected_specs`). vLLM fuses q/k/v into `qkv_proj` and gate/up into
`gate_up_proj`, so a missing part is named with the fused parameter it belongs to. The
tensors then go to every worker through the worker extension
(`tidal.engines.vllm_worker.TidalWorkerExtension`, named by the engine argument
`worker_extension_cls`) with `collective_rpc`, in buckets (`tidal.engines.vllm_weights`):
written into a host file every worker maps, the calls naming where each tensor lies, or,
where a worker cannot map it (on another host), as raw bytes inside the messages (vLLM's
utility calls decode tensor arguments untyped, so they cannot travel as tensors); each
worker's model `load_weights` maps the names onto its fused, sharded parameters, and the
commit call checks every parameter was written and returns the version each worker now
has, which must all equal `version`. Then the prefix cache is reset (its KV was computed
by the old weights). Weights reach vLLM's workers through host memory: tidal's `ipc`,
`collective` and `host` transports feed the adapter's process (the Ray rollout actor
receives a version into host memory with tidal's receivers and calls `load_weights`), and
the `host` transport is the path between a trainer and a rollout of different torch builds
(a vLLM environment pins its own torch).

`sleep(level)` / `wake_up(tags)` map to `AsyncLLM.sleep` / `wake_up` (sleep mode is always
enabled) for colocated and multiplexed layouts; `generate` refuses to run while anything
sleeps, `load_weights` while the weights do, and after a level-2 sleep (weights discarded)
`generate` waits for a `load_weights`.

What was run: never against real vLLM on this project's machines (no GPU, and vLLM is not
installed in tidal's environment). The adapter is tested against `tests/engines/fake_vllm`,
whose modules mirror the vLLM 0.32.0 module paths and whose signatures are checked against
`tests/engines/vllm_api_0.32.0.json`, a snapshot of the real signatures read from the
vllm-0.32.0 wheel's source; a test compares an installed vLLM to the snapshot and is
skipped where none is installed. vllm-ascend: the same adapter runs on Ascend NPUs through
vLLM's platform plugin (vllm-ascend 0.23 needs an environment of its own, with torch 2.10
and CANN); hal supplies `ASCEND_RT_VISIBLE_DEVICES` and the collective backend's settings.
Nothing here names a device: vLLM finds its platform inside the devices hal made visible.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import Callable, Coroutine, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from tidal.engines.sampling import check_truncation
from tidal.engines.vllm_weights import WeightPusher
from tidal.flow.protocols import Refill
from tidal.flow.trajectory import Trajectory, unfinished
from tidal.hal import Platform, current_platform

WORKER_EXTENSION = "tidal.engines.vllm_worker.TidalWorkerExtension"
"""The `worker_extension_cls` engine argument: mixed into every vLLM worker."""
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
"""The `dtype` values vLLM 0.32 takes (its `ModelDType`)."""
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-2, 2.0
"""vLLM's `SamplingParams` refuses a temperature above 2 and silently raises one below 0.01 to
0.01: the adapter refuses both, so behavior logprobs are always at the recipe's temperature."""
_END = object()
"""A request's stream ended (after its last output, or its error)."""


class VLLMRolloutEngine:
    """A `RolloutEngine` (and `Pads`) around vLLM's `AsyncLLM`, built from a checkpoint directory."""

    rollout_keys = ("gpu_memory_utilization", "max_model_len", "enforce_eager")
    """Recipe `rollout.*` keys the run passes to the constructor by name (`tensor_parallel_size`
    comes from the placement: `placement.rollout.devices_each`)."""
    builds_from_checkpoint = True
    """The run passes the checkpoint directory (`model_path`), not a torch module."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        eos_id: int | Sequence[int],
        pad_id: int,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        chunk_tokens: int = 8,
        platform: Platform | None = None,
        version: int = 0,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.6,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        seed: int = 0,
        dtype: str = "auto",
        trust_remote_code: bool = False,
    ) -> None:
        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise ValueError(f"model_path={str(model_path)!r} is not a Hugging Face checkpoint directory (no config.json)")
        stops = [eos_id] if isinstance(eos_id, int) else list(eos_id)
        if not stops or not all(isinstance(i, int) and not isinstance(i, bool) for i in stops):
            raise ValueError(f"eos_id must be a token id or a non-empty list of them, got {eos_id!r}")
        if not MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE:  # `not <=`: nan is refused too
            raise ValueError(f"temperature must be in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}] for vLLM sampling, got {temperature}")
        check_truncation(top_k=top_k, top_p=top_p)
        _check_int("chunk_tokens", chunk_tokens, 1)
        _check_int("version", version, -1)  # -1: no weights of the trainer yet (a Ray rollout actor, until its first version arrives)
        _check_int("tensor_parallel_size", tensor_parallel_size, 1)
        _check_int("seed", seed, 0)
        if max_model_len is not None:
            _check_int("max_model_len", max_model_len, 1)
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if not isinstance(enforce_eager, bool):
            raise ValueError(f"enforce_eager must be true or false, got {enforce_eager!r}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if not isinstance(trust_remote_code, bool):
            raise ValueError(f"trust_remote_code must be true or false, got {trust_remote_code!r}")
        self.eos_ids, self.pad_id = frozenset(stops), pad_id
        self.temperature, self.chunk_tokens = temperature, chunk_tokens
        self.top_k, self.top_p = top_k, top_p
        self.version = version
        self.platform = platform or current_platform()
        """Kept for the run's bookkeeping: vLLM finds its device through its own platform
        detection (vllm-ascend's plugin on Ascend), inside the devices hal made visible."""
        self.model_path = path
        self._weights = WeightPusher(path, dtype, trust_remote_code=trust_remote_code)
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs  # noqa: PLC0415 - vLLM is optional: only this backend needs it
            from vllm.inputs import TokensPrompt  # noqa: PLC0415
            from vllm.sampling_params import RequestOutputKind, SamplingParams  # noqa: PLC0415
            from vllm.v1.engine.async_llm import AsyncLLM  # noqa: PLC0415
        except ImportError as e:
            raise ImportError(f"rollout.backend=vllm needs vLLM (0.32.0) installed in the rollout's environment: {e}") from e
        self._tokens_prompt, self._sampling_params, self._delta = TokensPrompt, SamplingParams, RequestOutputKind.DELTA
        self.engine_args = AsyncEngineArgs(
            model=str(path),
            dtype=dtype,
            seed=seed,
            trust_remote_code=trust_remote_code,
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            logprobs_mode="processed_logprobs",  # the sampled distribution's logprobs (module docstring)
            enforce_eager=enforce_eager,
            worker_extension_cls=WORKER_EXTENSION,
            enable_sleep_mode=True,
        )
        self._request_ids = itertools.count()
        self._lock = threading.Lock()  # one of generate / load_weights / sleep / wake_up at a time
        self._asleep: set[str] = set()
        self._weights_lost = False
        self._closed = False
        self._close_lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="tidal-vllm-loop", daemon=True)
        self._thread.start()
        self._llm: Any = None

        async def build() -> Any:  # in the loop: AsyncLLM binds its tasks to the running loop
            return AsyncLLM.from_engine_args(self.engine_args)

        try:
            self._llm = self._call(build())
        except BaseException:
            self.close()
            raise

    # --- RolloutEngine ---------------------------------------------------------------------

    def generate(
        self, trajectories: Sequence[Trajectory], *, max_new_tokens: int, should_pause: Callable[[], bool] | None = None, refill: Refill | None = None
    ) -> list[Trajectory]:
        """See `RolloutEngine.generate`; with `refill`, continuous batching (`Refill`).

        Raises:
            ValueError: an unfinished trajectory has no prompt token, or is given twice
                (`[t] * n`); nothing is generated. The same for rows `refill.more()` gives,
                raised when it gives them (the running requests are aborted; rows keep what
                they had).
            RuntimeError: the engine is closed or asleep, or vLLM failed a request (the other
                requests are aborted first).
        """
        rows = list(trajectories)
        seen: set[int] = set()
        active = unfinished(rows, max_new_tokens, seen)
        if not active:
            return rows
        with self._lock:
            if self._closed:
                raise RuntimeError("the vllm rollout engine is closed")
            if self._asleep:
                raise RuntimeError(f"the vllm rollout engine is asleep ({sorted(self._asleep)}): wake_up() first")
            if self._weights_lost:
                raise RuntimeError("a level-2 sleep discarded the weights: load_weights() before generating")
            rows += _Generation(self, max_new_tokens, seen).run(active, should_pause, refill)
        return rows

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight `load_weights` takes, as a meta tensor of its shape and dtype (no memory):
        what a weight receiver checks versions against (`expected_specs`). Floating tensors have
        the dtype the constructor's `dtype` names ("auto": the checkpoint's own)."""
        for name, (shape, dtype) in self._weights.specs.items():
            yield name, torch.empty(shape, dtype=dtype, device="meta")

    def load_weights(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send every named tensor to every worker; all checks first, then become `version`.

        A floating-point tensor may have any floating dtype (vLLM's loaders cast it); any other
        dtype must match. Names tied in the model must be given equal values (one of them is sent).

        Raises:
            ValueError: a name is missing, unknown, given twice, or its shape, dtype or tie does
                not match (nothing is sent; the version is unchanged).
            RuntimeError: the engine is closed or its weights asleep (nothing sent), or a worker
                failed or does not report `version` after the load (the workers' weights may
                then be part old, part new: the version is unchanged and the engine should be
                rebuilt).
        """
        given = self._weights.check(version, named_tensors)
        with self._lock:
            if self._closed:
                raise RuntimeError("the vllm rollout engine is closed")
            if "weights" in self._asleep:
                raise RuntimeError("the weights are asleep: wake_up(tags=['weights']) before load_weights")
            self._weights.push(version, given, self._rpc)
            reported = self._rpc("tidal_commit_weights", version)
            if not reported or any(v != version for v in reported):
                raise RuntimeError(f"weights of version {version} were sent, but the workers report versions {reported} (one per rank)")
            if not self._call(self._llm.reset_prefix_cache()):  # cached KV was computed by the old weights
                raise RuntimeError(f"weights of version {version} were loaded, but vLLM could not reset its prefix cache (requests still running?)")
            self._weights_lost = False
            self.version = version

    # --- sleep mode and shutdown --------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Free the devices' memory for a colocated trainer: level 1 moves the weights to host
        memory and drops the KV cache, level 2 drops both (`load_weights` must follow the wake-up)."""
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        with self._lock:
            self._call(self._llm.sleep(level))
            self._asleep = {"weights", "kv_cache"}
            self._weights_lost = self._weights_lost or level == 2

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Take the memory back: all of it, or only `tags` ("weights", "kv_cache"; waking the
        weights first lets a level-2 sleeper load new ones before its KV cache returns)."""
        if tags is not None and (not tags or not set(tags) <= {"weights", "kv_cache"}):
            raise ValueError(f"tags must be None or a non-empty list of 'weights' and 'kv_cache', got {tags!r}")
        with self._lock:
            self._call(self._llm.wake_up(None if tags is None else list(tags)))
            self._asleep -= set(tags) if tags is not None else self._asleep

    def park(self) -> None:
        """`ParksItself`: a level-1 sleep while a colocated trainer has the devices (the weights
        wait in host memory, so the next turn generates with them at once)."""
        self.sleep(1)

    def unpark(self) -> None:
        """`ParksItself`: wake everything up."""
        self.wake_up()

    def close(self) -> None:
        """Shut vLLM down and stop the loop thread; idempotent. A `generate` running in another
        thread then ends (its requests are cancelled, which aborts them)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            if self._llm is not None:
                llm, self._llm = self._llm, None

                async def shutdown() -> None:
                    llm.shutdown()

                asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result()
        finally:
            self._weights.close()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()

    # --- helpers ---------------------------------------------------------------------------

    def _run_loop(self) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        try:
            loop.run_forever()
            tasks = asyncio.all_tasks(loop)  # requests still streaming: cancelled (vLLM aborts them)
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run `coro` on the engine's loop and return its result (in the calling thread)."""
        if self._closed:
            coro.close()
            raise RuntimeError("the vllm rollout engine is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _rpc(self, method: str, *args: Any) -> list[Any]:
        """`method` of every worker's extension (`collective_rpc`), their answers in rank order."""
        return self._call(self._llm.collective_rpc(method, args=args))

    def _submit(self, coro: Coroutine[Any, Any, Any]) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _request(self, prompt_ids: list[int], max_tokens: int) -> tuple[Any, Any, str]:
        """A request's prompt, sampling parameters and id."""
        params = self._sampling_params(
            n=1,
            temperature=self.temperature,
            top_k=self.top_k,  # 0 is "off" in vLLM 0.32 (-1 is still accepted)
            top_p=self.top_p,
            max_tokens=max_tokens,
            logprobs=0,  # the sampled token's own logprob only
            stop_token_ids=sorted(self.eos_ids),
            ignore_eos=True,  # stop at tidal's end ids only: not also at the generation config's
            detokenize=False,
            output_kind=self._delta,
        )
        return self._tokens_prompt(prompt_token_ids=prompt_ids), params, f"tidal-{next(self._request_ids)}"

class _Generation:
    """One `generate` call: its requests, each a slot, and the outputs they stream back.

    The streams run on the engine's loop and put `(slot, output)` pairs, then `(slot, _END)`,
    into `events`; the caller's thread takes them, writes the tokens into the slots'
    trajectories, and makes the safe-point and refill calls."""

    def __init__(self, engine: VLLMRolloutEngine, max_new_tokens: int, seen: set[int]) -> None:
        self.engine, self.max_new_tokens, self.seen = engine, max_new_tokens, seen
        self.events: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        self.stop = threading.Event()
        """Set at a pause or an error: streams abort their request at their next output."""
        self.rows: list[Trajectory] = []
        self.request_ids: list[str] = []
        self.live: set[int] = set()
        """Slots whose stream has not ended."""
        self.fresh: dict[int, int] = {}
        """Tokens each live slot got since the last safe point."""
        self.error: BaseException | None = None

    def run(self, active: list[Trajectory], should_pause: Callable[[], bool] | None, refill: Refill | None) -> list[Trajectory]:
        """Stream every row until all end or a safe point pauses; returns the rows `refill` added."""
        added: list[Trajectory] = []
        self._start(active)
        try:
            while self.live:
                ended = self._take(self.events.get())
                while True:  # what else arrived is handled with it, as one decoding step's outputs
                    try:
                        ended += self._take(self.events.get_nowait())
                    except queue.Empty:
                        break
                if self.error is not None:
                    raise self.error
                if refill is not None and ended:
                    refill.done(ended)
                    if not self.stop.is_set():
                        new = unfinished(refill.more(), self.max_new_tokens, self.seen)
                        added += new
                        self._start(new)
                if should_pause is not None and not self.stop.is_set() and max(self.fresh.values(), default=0) >= self.engine.chunk_tokens:
                    self.fresh = dict.fromkeys(self.fresh, 0)
                    if should_pause():
                        self._abort()
        except BaseException:
            self._abort()
            self._drain()
            raise
        return added

    def _start(self, rows: list[Trajectory]) -> None:
        for t in rows:
            slot = len(self.rows)
            prompt, params, request_id = self.engine._request(t.ids, self.max_new_tokens - t.num_generated)
            self.rows.append(t)
            self.request_ids.append(request_id)
            self.live.add(slot)
            self.fresh[slot] = 0
            self.engine._submit(self._stream(slot, prompt, params, request_id))

    async def _stream(self, slot: int, prompt: Any, params: Any, request_id: str) -> None:
        """On the engine's loop: one request's outputs into `events`."""
        llm = self.engine._llm
        aborted = False
        try:
            async for output in llm.generate(prompt, params, request_id):
                self.events.put((slot, output))
                if self.stop.is_set() and not output.finished and not aborted:  # it started after the abort call
                    aborted = True
                    await llm.abort(request_id)
        except Exception as e:  # noqa: BLE001 - raised in the caller's thread
            self.events.put((slot, e))
        finally:
            self.events.put((slot, _END))

    def _take(self, event: tuple[int, Any]) -> list[Trajectory]:
        """Apply one event; returns the trajectory it finished, if any."""
        slot, output = event
        if output is _END:
            self.live.discard(slot)
            self.fresh.pop(slot, None)
            return []
        if isinstance(output, BaseException):
            self.error = self.error or output
            return []
        t = self.rows[slot]
        completion = output.outputs[0]
        ids = list(completion.token_ids)
        if ids:
            logprobs = completion.logprobs
            if logprobs is None or len(logprobs) != len(ids):
                raise RuntimeError(f"vLLM request {self.request_ids[slot]} returned {len(ids)} tokens but {0 if logprobs is None else len(logprobs)} logprobs")
            t.extend(ids, [position[token].logprob for position, token in zip(logprobs, ids)], self.engine.version)
            self.fresh[slot] = self.fresh.get(slot, 0) + len(ids)
        if not output.finished:
            return []
        reason = completion.finish_reason
        if reason in ("stop", "length"):
            t.finish_reason = reason
            return [t]
        if reason != "abort":  # aborted: paused, resumed by a later call
            self.error = self.error or RuntimeError(f"vLLM ended request {self.request_ids[slot]} with finish_reason={reason!r}")
        return []

    def _abort(self) -> None:
        """Stop every running request (those that start later abort at their first output)."""
        if self.stop.is_set():
            return
        self.stop.set()
        ids = [self.request_ids[slot] for slot in sorted(self.live)]
        if ids and not self.engine._closed:
            self.engine._call(self.engine._llm.abort(ids))

    def _drain(self) -> None:
        """After an error: take the remaining outputs (rows keep their tokens) until every stream ended."""
        while self.live:
            try:
                self._take(self.events.get())
            except Exception:  # noqa: BLE001 - the first error is the one raised
                pass


def _check_int(key: str, value: Any, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{key} must be an integer >= {least}, got {value!r}")

