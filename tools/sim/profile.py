"""`tidal profile RECIPE`'s measurements: what one device of this machine does with the
recipe's policy model, the calibration input of the cluster simulator (`tools.sim.costs`).

`measure` builds the recipe's policy (`tools.train.build_policy`) on the platform's device
(`tidal.hal.init_platform(cfg.device)`) in the recipe's `model.dtype` and times, each as
the median of `repeats` runs after one untimed warm-up, with `time.perf_counter` read
after the platform's `synchronize` (accelerators queue work; the clock must wait for it):

- `decode`: one decode step, [batch, 1] ids against a KV cache of `context` tokens, under
  `torch.no_grad()` in eval mode. The cache is rebuilt by an untimed prefill before each
  run, so every run sees exactly `context` cached tokens (a step appends one).
- `prefill`: one forward of [batch, context] ids without a cache. Both call the model as
  the hf rollout engine does: logits of the last position only, where the model's forward
  takes `logits_to_keep` (as vLLM's prefill does; `costs.prefill_s`'s 2 x params x tokens
  counts the LM head for every token, a few percent more).
- `train`: the recipe's own train engine (`train.backend`, built as a run builds it, on a
  copy of the model) taking `train_step` with the recipe's loss over `rows` trajectories
  of `train_context` tokens, `train_prompt` of them prompt (default half) and the rest
  response (the warm-up makes the optimizer's
  moments, as a run's first step does). A plain forward, backward and AdamW step of the
  model costs a different amount: the engine's loss, micro-batching and clipping are what
  a run pays (on the quickstart's tiny model, less than half).
- `peak`: a dense n x n matmul in the model's dtype (flops = 2 n^3 / t) and a `copy_`
  between two byte tensors (bytes/s = 2 x bytes / t: one read, one write): the roofline
  peaks of this device as the simulator's `hardware.Device` states them.
- `generate` (optional; `generate_tokens=()` leaves it out): whole generate calls of the
  recipe's rollout engine (`rollout.backend`, built as a run builds it), each row with a
  prompt of its own of the shortest context and a stop token the model cannot sample, so
  every row runs to the call's budget: the smallest and the largest batch x each of
  `generate_tokens` new tokens. What a call costs beside the model's forward passes (the
  engine's own loop, sampling, building the batch) is what `calibrate.fit` takes from them.
- `weights`: cloning every distinct tensor of the state dict (tied names share one clone)
  and `load_state_dict` of the clones back: a weight sync's copy on one device.
- `host_device_bytes_per_s`: a 64 MB tensor device -> host -> device (host memory pinned
  where the platform pins); None where the device is the host.
- `contention` (optional; `contention=False` leaves it out): how much longer the largest
  training step takes while rollout's work (a prefill and a decode step of the largest
  batch) runs beside it in another thread of this process, and the other way round, each
  with its stage's torch threads: {"train": beside / alone, "rollout": beside / alone}.
  That is how the local runtime runs an async run's two stages on one host; on one CPU
  they share the cores, the caches, the memory bus and the interpreter's lock. Measured
  only where the device is the host: on an accelerator both would share one device here,
  which a disaggregated plan's roles never do.

Points whose context does not fit the model's `max_position_embeddings` are skipped
(decode needs room for its warm-up and repeats too). Not measured: collective bandwidth
(all-reduce, all-gather between devices), which needs two processes and a process group;
the simulator keeps its datasheet link figures for those. Decode and prefill run with
the torch threads the recipe gives its rollout stage, training with its train stage's
(`threads`, `rollout.threads`, `train.threads`; 0: torch's default), as a run runs them;
the peaks and the weight copies with this process's own.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

VERSION = 1
KEYS = ("version", "date", "recipe", "platform", "torch", "model", "peak", "decode", "prefill", "train", "weights", "host_device_bytes_per_s")
"""The top-level keys of a profile, all required."""
_SECTIONS = {
    "platform": ("kind", "device_count"),
    "model": ("name", "num_params", "num_layers", "hidden_size", "num_kv_heads", "head_dim", "bytes_per_param"),
    "peak": ("flops", "bytes_per_s"),
    "weights": ("bytes", "export_s", "load_s"),
}
_POINTS = {"decode": ("batch", "context", "seconds"), "prefill": ("batch", "context", "seconds"), "train": ("rows", "context", "tokens", "seconds")}
_GENERATE = ("batch", "prompt", "new_tokens", "seconds")
"""The keys of each point of a profile's optional `generate` section."""
_MB = 1 << 20
_DTYPE_NAMES = {"bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}
"""torch dtype names -> `Platform.dtype_support()`'s keys (float32 is always there)."""


def measure(
    cfg: Any,
    *,
    batches: Sequence[int] = (1, 4, 16),
    contexts: Sequence[int] = (32, 128),
    train_rows: Sequence[int] = (4, 16),
    train_context: int | None = None,
    train_prompt: int | None = None,
    generate_tokens: Sequence[int] = (4, 16),
    repeats: int = 3,
    contention: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Profile the recipe `cfg`'s policy on this machine's platform (see the module docstring).

    Args:
        cfg: a loaded recipe (`tools.config.load_config`).
        batches: sequences per decode step and per prefill.
        contexts: cached tokens per sequence of a decode step; prompt tokens of a prefill.
        train_rows: rows of a training step, one point each.
        train_context: tokens per training row; default the longest of `contexts` that fits.
        train_prompt: prompt tokens of those (the rest is response, at least one); default half.
        generate_tokens: new tokens of the whole generate calls timed (`generate`); empty: none.
        contention: also time each role's work beside the other's (`contention` below).
        repeats: timed runs per point (their median is reported), after one warm-up.
        progress: called with one line per group of measurements.

    Returns:
        The profile: a JSON-serialisable dict with the keys `KEYS`.

    Raises:
        ValueError: `repeats` below 1, a grid value below 1, `train_context` beyond the
            model's positions, or a model dtype this platform has no arithmetic for.
    """
    import torch  # noqa: PLC0415

    from tidal.engines.models import DTYPES  # noqa: PLC0415
    from tidal.hal import init_platform  # noqa: PLC0415
    from tidal.tools.config import stage_threads  # noqa: PLC0415
    from tidal.tools.rl import torch_threads  # noqa: PLC0415
    from tidal.tools.train import build_policy  # noqa: PLC0415

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for name, values in (("batches", batches), ("contexts", contexts), ("train_rows", train_rows)):
        if not values or min(values) < 1:
            raise ValueError(f"{name} must be a non-empty list of integers >= 1, got {list(values)}")
    say = progress or (lambda line: None)
    platform = init_platform(cfg.device).platform
    device = platform.device()

    def sync() -> None:
        platform.synchronize()

    model = build_policy(cfg)
    dtype = DTYPES[cfg.model.dtype]
    if isinstance(dtype, torch.dtype):  # "auto": the checkpoint's own
        model.to(device=device, dtype=dtype)
    else:
        model.to(device=device)
    dtype = next(model.parameters()).dtype
    wanted = _DTYPE_NAMES.get(str(dtype).removeprefix("torch."))
    if wanted and not platform.dtype_support().get(wanted, False):
        raise ValueError(f"model.dtype={cfg.model.dtype!r}: this {platform.kind} platform has no {wanted} arithmetic ({platform.dtype_support()})")
    config: Any = model.config  # a transformers config (nn.Module types every attribute as Tensor | Module)
    max_positions = config.max_position_embeddings
    vocab = config.vocab_size
    if train_context is not None and train_context > max_positions:
        raise ValueError(f"train_context={train_context} exceeds the model's {max_positions} positions")
    if train_prompt is not None and train_prompt < 1:
        raise ValueError(f"train_prompt must be >= 1, got {train_prompt}")

    # As the hf rollout engine calls the model: logits of the last position only where the
    # model can skip the others, and the KV cache under transformers' current keyword.
    forward = inspect.signature(type(model).forward).parameters
    last_logits = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}
    cache_name = "cache" if "cache" in forward else "past_key_values"

    def ids(rows: int, context: int) -> Any:
        return torch.randint(0, vocab, (rows, context), device=device)

    say(f"peak: {1024 if device.type == 'cpu' else 8192}^2 matmul in {dtype}, copy_ of {256 if device.type == 'cpu' else 1024} MB")
    peak = _peaks(torch, device=device, dtype=dtype, repeats=repeats, sync=sync)
    platform.empty_cache()

    model.eval()
    decode, prefill = [], []
    say(f"decode and prefill: batches {list(batches)} x contexts {list(contexts)} (max positions {max_positions})")
    with torch.no_grad(), torch_threads(stage_threads(cfg, "rollout")):  # as the run's rollout stage has them
        for batch in batches:
            for context in contexts:
                if context + repeats + 2 <= max_positions:
                    def cached(batch: int = batch, context: int = context) -> Any:
                        return getattr(model(input_ids=ids(batch, context), use_cache=True, **last_logits), cache_name)

                    step = ids(batch, 1)
                    seconds = _median_s(lambda cache, step=step: model(input_ids=step, use_cache=True, **{cache_name: cache}, **last_logits), repeats=repeats, sync=sync, setup=cached)
                    decode.append({"batch": batch, "context": context, "seconds": seconds})
                if context <= max_positions:
                    prompt = ids(batch, context)
                    seconds = _median_s(lambda prompt=prompt: model(input_ids=prompt, use_cache=False, **last_logits), repeats=repeats, sync=sync)
                    prefill.append({"batch": batch, "context": context, "seconds": seconds})

    generate: list[dict[str, Any]] = []
    shortest = min(contexts)
    calls = [(b, n) for b in sorted({min(batches), max(batches)}) for n in generate_tokens if shortest + n <= max_positions]
    if calls:
        say(f"generate: whole calls of the {cfg.rollout.backend} rollout engine, batches x new tokens {calls}, prompts of {shortest}")
        with torch.no_grad(), torch_threads(stage_threads(cfg, "rollout")):
            generate = _generate_points(cfg, model, platform, calls=calls, prompt=shortest, vocab=vocab, repeats=repeats, sync=sync)

    fitting = [c for c in contexts if c <= max_positions]
    context = train_context or max(fitting, default=0)
    train: list[dict[str, Any]] = []
    beside = None
    if context:
        say(f"train: rows {list(train_rows)} x {context} tokens, the recipe's train engine ({cfg.train.backend}) taking its RL step")
        rollout_work = None
        # On the host, an async run's two stages share its cores; two accelerators of a
        # disaggregated plan share nothing this could measure on one device.
        if contention and decode and device.type == "cpu":  # one decode step of the largest batch, its cache made first: rollout's work
            big = int(max(p["batch"] for p in decode))
            short = int(min(p["context"] for p in decode if p["batch"] == big))

            def rollout_work(big: int = big, short: int = short) -> None:
                with torch.no_grad():
                    cache = getattr(model(input_ids=ids(big, short), use_cache=True, **last_logits), cache_name)
                    model(input_ids=ids(big, 1), use_cache=True, **{cache_name: cache}, **last_logits)

        with torch_threads(stage_threads(cfg, "train")):  # as the run's train stage has them
            train, beside = _train_points(cfg, model, platform, rows=train_rows, context=context, prompt=train_prompt, vocab=vocab, repeats=repeats, sync=sync, rollout_work=rollout_work, say=say)
    else:
        say(f"train: skipped, no context of {list(contexts)} fits {max_positions} positions")

    say("weights: export (clone) and load_state_dict")
    weights = _weights(torch, model, repeats=repeats, sync=sync)
    host_device = None
    if device.type != "cpu":  # a CPU's "device" is the host: there is no copy to time
        say("host <-> device: 64 MB each way")
        host_device = _host_device_bytes_per_s(torch, device=device, pin=platform.pin_memory, repeats=repeats, sync=sync)

    fields = config.to_dict()  # what a config holds varies by architecture
    heads = fields["num_attention_heads"]
    fake = platform.descriptor.fake  # a fake platform computes on the host: its numbers are the host's
    return {
        "version": VERSION,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "recipe": cfg.name,
        "platform": {"kind": "cpu" if fake else platform.kind, "device_count": 1 if fake else platform.device_count()},
        "torch": torch.__version__,
        "model": {
            "name": f"{cfg.model.source}:{cfg.model.path}" if cfg.model.path else cfg.model.source,
            "num_params": sum(p.numel() for p in model.parameters()),  # parameters() yields a tied tensor once
            "num_layers": config.num_hidden_layers,
            "hidden_size": config.hidden_size,
            "num_kv_heads": fields.get("num_key_value_heads") or heads,  # configs without grouped-query attention have none
            "head_dim": fields.get("head_dim") or config.hidden_size // heads,
            "bytes_per_param": next(model.parameters()).element_size(),
        },
        "peak": peak,
        "decode": decode,
        "prefill": prefill,
        "train": train,
        "weights": weights,
        "host_device_bytes_per_s": host_device,
        **({"generate": generate} if generate else {}),
        **({"contention": beside} if beside is not None else {}),
    }


class _RunsToBudget:
    """The part of a tokenizer `build_rollout_engine` reads, with one stop id outside the
    model's vocabulary: no sampled token ends a row, so each runs to the call's budget."""

    def __init__(self, vocab: int) -> None:
        self.eos_ids, self.pad_id = [vocab], 0


def _generate_points(cfg: Any, model: Any, platform: Any, *, calls: Sequence[tuple[int, int]], prompt: int, vocab: int, repeats: int, sync: Callable[[], None]) -> list[dict[str, Any]]:
    """Median seconds of a whole generate call of the recipe's rollout engine, per (batch, new tokens)."""
    from tidal.flow.trajectory import Trajectory  # noqa: PLC0415
    from tidal.tools.rl import build_rollout_engine  # noqa: PLC0415

    engine = build_rollout_engine(cfg, model, _RunsToBudget(vocab), platform=platform, version=0)  # type: ignore[arg-type]  # reads eos_ids and pad_id only
    points = []
    for batch, new in calls:
        def call(batch: int = batch, new: int = new) -> None:
            base = max(2, vocab - 3)  # row r's prompt: r's digits in this base (ids from 3): distinct rows, one prefill each
            rows = [Trajectory(prompt_ids=[3 + (r // base**k) % base for k in range(prompt)]) for r in range(batch)]
            done = engine.generate(rows, max_new_tokens=new)
            if any(len(t.tokens) != new for t in done):
                raise RuntimeError(
                    f"rollout.backend={cfg.rollout.backend!r} ended rows of a {new}-token generate call at {sorted({len(t.tokens) for t in done})} tokens, "
                    "though it was given no stop token it could sample, so its calls cannot be timed at a fixed length: profile with the hf backend, or from Python with measure(generate_tokens=())"
                )

        points.append({"batch": batch, "prompt": prompt, "new_tokens": new, "seconds": _median_s(call, repeats=repeats, sync=sync)})
    return points


def _train_points(
    cfg: Any,
    model: Any,
    platform: Any,
    *,
    rows: Sequence[int],
    context: int,
    prompt: int | None,
    vocab: int,
    repeats: int,
    sync: Callable[[], None],
    rollout_work: Callable[[], None] | None = None,
    say: Callable[[str], None] = lambda _line: None,
) -> tuple[list[dict[str, Any]], dict[str, float] | None]:
    """The recipe's train engine (built as a run builds it, on a copy of `model`) timed at
    `train_step` over `rows` trajectories of `context` tokens each, `prompt` of them prompt
    (default half) and the rest response: the step a run takes (its loss, micro-batching
    and optimizer), not a plain forward and backward, which on a small model costs a
    different amount (and more for a response token than for a prompt token). With
    `rollout_work`, also the slowdown of each beside the other (`_beside`)."""
    import copy  # noqa: PLC0415

    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    from tidal.engines.models import recomputes_activations  # noqa: PLC0415
    from tidal.engines.registry import load  # noqa: PLC0415
    from tidal.flow.trajectory import Trajectory, to_token_batch  # noqa: PLC0415
    from tidal.tools.config import stage_threads  # noqa: PLC0415
    from tidal.tools.config_schema import loss_config  # noqa: PLC0415
    from tidal.tools.rl import build_train_engine  # noqa: PLC0415
    from tidal.tools.train import one_process_group  # noqa: PLC0415

    train_cls = load("train.backend", cfg.train.backend)
    group = one_process_group([train_cls], platform)
    try:
        engine = build_train_engine(cfg, train_cls, copy.deepcopy(model), platform=platform)
        loss = loss_config(cfg)
        prompt = max(1, min(context - 1, prompt if prompt is not None else context // 2))
        response = max(1, context - prompt)
        points = []
        steps = {}
        recompute = recomputes_activations(model)  # `model.gradient_checkpointing` (hf models)
        for n in rows:
            token = [3 + k % max(1, vocab - 3) for k in range(prompt + response)]  # ids every vocabulary has
            batch = to_token_batch([Trajectory(prompt_ids=token[:prompt], tokens=token[prompt:], logprobs=[-1.0] * response, versions=[0] * response, finish_reason="length") for _ in range(n)], pad_id=0)
            advantages = torch.linspace(-1.0, 1.0, n)
            steps[n] = lambda batch=batch, advantages=advantages: engine.train_step(batch, advantages, loss=loss)
            seconds = _median_s(steps[n], repeats=repeats, sync=sync)
            points.append({"rows": n, "context": prompt + response, "tokens": n * (prompt + response), "seconds": seconds, "recompute": recompute})
        if rollout_work is None:
            return points, None
        say("contention: a training step with rollout's work beside it in another thread, and the other way round")
        threads = {"train": stage_threads(cfg, "train"), "rollout": stage_threads(cfg, "rollout")}
        return points, _beside(steps[max(rows)], rollout_work, threads=threads, repeats=max(repeats, 5), sync=sync)
    finally:
        if group is not None:
            dist.destroy_process_group()
            group.unlink(missing_ok=True)


def _beside(train_step: Callable[[], Any], rollout_work: Callable[[], Any], *, threads: Mapping[str, int], repeats: int, sync: Callable[[], None]) -> dict[str, float]:
    """How much longer each role's work takes while the other's runs beside it, in another
    thread of this process, each with its stage's torch threads: as the local runtime runs
    an async run's two stages on one host. {"train": beside / alone, "rollout": ...}."""
    import threading  # noqa: PLC0415

    from tidal.tools.rl import torch_threads  # noqa: PLC0415

    def timed(work: Callable[[], Any], role: str, background: Callable[[], Any] | None, other: str) -> float:
        stop = threading.Event()

        def loop() -> None:
            with torch_threads(threads[other]):
                while not stop.is_set():
                    background()  # type: ignore[misc]

        thread = threading.Thread(target=loop, name="tidal-profile-beside", daemon=True) if background is not None else None
        if thread is not None:
            thread.start()
        try:
            with torch_threads(threads[role]):
                return _median_s(work, repeats=repeats, sync=sync)
        finally:
            stop.set()
            if thread is not None:
                thread.join()

    return {
        "train": timed(train_step, "train", rollout_work, "rollout") / timed(train_step, "train", None, "rollout"),
        "rollout": timed(rollout_work, "rollout", train_step, "train") / timed(rollout_work, "rollout", None, "train"),
    }


def _median_s(run: Callable[..., Any], *, repeats: int, sync: Callable[[], None], setup: Callable[[], Any] | None = None) -> float:
    """Median seconds of `run(setup())` (or `run()`) over `repeats` runs after one warm-up;
    `setup` is untimed, and the device is synchronized before each clock read."""
    times = []
    for i in range(repeats + 1):
        args = (setup(),) if setup is not None else ()
        sync()
        start = time.perf_counter()
        run(*args)
        sync()
        if i:  # the first run warms caches, kernels and allocators up
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _peaks(torch: Any, *, device: Any, dtype: Any, repeats: int, sync: Callable[[], None]) -> dict[str, float]:
    """Dense matmul FLOP/s in `dtype` and copy bandwidth; sizes large enough to hide launch
    costs. Each in a function of its own, so its tensors are freed before the next."""
    on_host = device.type == "cpu"
    flops = _matmul_flops(torch, n=1024 if on_host else 8192, device=device, dtype=dtype, repeats=repeats, sync=sync)
    bytes_per_s = _copy_bytes_per_s(torch, nbytes=(256 if on_host else 1024) * _MB, device=device, repeats=repeats, sync=sync)
    return {"flops": flops, "bytes_per_s": bytes_per_s}


def _matmul_flops(torch: Any, *, n: int, device: Any, dtype: Any, repeats: int, sync: Callable[[], None]) -> float:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _median_s(lambda: torch.mm(a, b, out=out), repeats=repeats, sync=sync)


def _copy_bytes_per_s(torch: Any, *, nbytes: int, device: Any, repeats: int, sync: Callable[[], None]) -> float:
    src, dst = torch.ones(nbytes, dtype=torch.uint8, device=device), torch.empty(nbytes, dtype=torch.uint8, device=device)
    return 2 * nbytes / _median_s(lambda: dst.copy_(src), repeats=repeats, sync=sync)  # each byte read once, written once


def _weights(torch: Any, model: Any, *, repeats: int, sync: Callable[[], None]) -> dict[str, float]:
    """Export: a clone of each distinct tensor (tied names share one, as in the model); load:
    `load_state_dict` of that export."""

    def export() -> dict[str, Any]:
        clones: dict[int, Any] = {}
        out = {}
        for name, tensor in model.state_dict(keep_vars=True).items():  # keep_vars: tied names give one object
            if id(tensor) not in clones:
                clones[id(tensor)] = tensor.detach().clone()
            out[name] = clones[id(tensor)]
        return out

    with torch.no_grad():
        export_s = _median_s(export, repeats=repeats, sync=sync)
        exported = export()
        load_s = _median_s(lambda: model.load_state_dict(exported), repeats=repeats, sync=sync)
    distinct = {id(t): t for t in exported.values()}.values()
    return {"bytes": sum(t.numel() * t.element_size() for t in distinct), "export_s": export_s, "load_s": load_s}


def _host_device_bytes_per_s(torch: Any, *, device: Any, pin: bool, repeats: int, sync: Callable[[], None]) -> float:
    """Bytes/s of a round trip device -> host -> device (2 x 64 MB moved per trip)."""
    nbytes = 64 * _MB
    on_device = torch.ones(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)

    def trip() -> None:
        host.copy_(on_device)
        on_device.copy_(host)

    return 2 * nbytes / _median_s(trip, repeats=repeats, sync=sync)


def save(profile: Mapping[str, Any], path: str | Path) -> None:
    """Write `profile` to `path` as JSON, whole or not at all (a temporary file beside it, renamed).

    Raises:
        ValueError: the profile lacks a key or has a bad one (as `load` would refuse it).
    """
    path = Path(path)
    _check(profile, where="the profile to save")
    text = json.dumps(profile, indent=2, allow_nan=False) + "\n"  # allow_nan=False: NaN is not JSON
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load(path: str | Path) -> dict[str, Any]:
    """The profile `save` wrote to `path`.

    Raises:
        ValueError: naming the file and the key that is missing or bad (or the JSON error).
    """
    path = Path(path)
    try:
        profile = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"profile {str(path)!r} is not JSON: {e}") from e
    _check(profile, where=f"profile {str(path)!r}")
    return profile


def _check(profile: Any, *, where: str) -> None:
    """Raise ValueError naming `where` and the first missing or bad key of `profile`."""
    if not isinstance(profile, Mapping):
        raise ValueError(f"{where} is not a JSON object")
    missing = [k for k in KEYS if k not in profile]
    if missing:
        raise ValueError(f"{where} has no key {missing[0]!r} (a profile has {', '.join(KEYS)})")
    if profile["version"] != VERSION:
        raise ValueError(f"{where}: key 'version' is {profile['version']!r}; this tidal reads version {VERSION}")
    for section, keys in _SECTIONS.items():
        value = profile[section]
        if not isinstance(value, Mapping):
            raise ValueError(f"{where}: key {section!r} must be an object with keys {', '.join(keys)}")
        for key in keys:
            if key not in value:
                raise ValueError(f"{where} has no key '{section}.{key}'")
    for section, keys in _POINTS.items():
        if not isinstance(profile[section], list):
            raise ValueError(f"{where}: key {section!r} must be a list of objects with keys {', '.join(keys)}")
        for i, point in enumerate(profile[section]):
            for key in keys:
                if not isinstance(point, Mapping) or key not in point:
                    raise ValueError(f"{where} has no key '{section}[{i}].{key}'")
            if not _positive(point["seconds"]):
                raise ValueError(f"{where}: key '{section}[{i}].seconds' must be a positive number, got {point['seconds']!r}")
    for i, point in enumerate(profile.get("generate", [])):  # optional: profiles before 2026-11-29 have none
        if not isinstance(point, Mapping) or any(key not in point for key in _GENERATE) or not _positive(point["seconds"]):
            raise ValueError(f"{where}: key 'generate[{i}]' must be an object with keys {', '.join(_GENERATE)} and positive seconds")
    for key in ("peak.flops", "peak.bytes_per_s", "weights.export_s", "weights.load_s"):
        section, name = key.split(".")
        if not _positive(profile[section][name]):
            raise ValueError(f"{where}: key {key!r} must be a positive number, got {profile[section][name]!r}")


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
