"""How the `vllm` rollout engine checks a version's weights and hands them to vLLM's workers.

`WeightPusher` holds the checkpoint's manifest (`checkpoint_manifest`: the names, shapes and
dtypes of the Hugging Face model a checkpoint directory configures, tied names included),
checks every version against it before anything is sent (`check`), and sends it to every
worker through the worker extension's calls (`push`, over `AsyncLLM.collective_rpc`;
`tidal.engines.vllm_worker`), in buckets, in the manifest's order, each floating tensor
cast to the manifest's dtype, a tied name's twin left out (vLLM's loader skips it too: one
parameter holds both):

- through a host file the workers map (`tidal.hal.transfer.shared_file`), when every
  worker can map it (asked once, at the first version: they run on this host, as vLLM's
  own multiprocessing workers do): a bucket of up to `SHARED_BUCKET_BYTES` (at least the
  largest tensor) is written into the file and the call carries only names and offsets;
  where /dev/shm has no room for the bucket, the next way, with a warning;
- else inside the calls' messages, `WEIGHT_BUCKET_BYTES` a call, each tensor as raw bytes
  (vLLM's utility calls decode tensor arguments untyped, so they cannot travel as tensors).

What was run: both paths against the fake vLLM of tests/engines/fake_vllm (whose workers
are objects of this process, the file mapped for real); never against real vLLM, whose
engine process relays the messages (the copies the file saves were counted from vLLM
0.32's source, not measured).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from tidal.engines.vllm_worker import dtype_name, pack_tensor
from tidal.engines.weight_checks import collect_weights
from tidal.hal.transfer import TransferError
from tidal.hal.transfer.shared_file import SharedFile

log = logging.getLogger(__name__)

FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
"""Hugging Face module name -> the vLLM parameter it is a part of (Llama, Qwen2/3, Mistral...)."""
WEIGHT_BUCKET_BYTES = 64 << 20
"""Bytes of tensors per `collective_rpc` call inside the message: each call is one message
through vLLM's engine process to every worker, held whole in memory on its way."""
SHARED_BUCKET_BYTES = 512 << 20
"""Bytes of the host file a bucket is written into (at least the largest tensor; at most the
whole version): one call per bucket, naming places in it."""
ALIGN = 64
"""Byte alignment of each tensor in the file (a cache line; any dtype's itemsize divides it)."""
_TORCH_DTYPES = {"half": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16, "float": torch.float32, "float32": torch.float32}

Rpc = Callable[..., list[Any]]
"""`rpc(method, *args)`: the method of every worker's extension, their answers in rank order."""


class WeightPusher:
    """The checks and sends of `VLLMRolloutEngine.load_weights` (module docstring)."""

    def __init__(self, model_path: Path, dtype: str, *, trust_remote_code: bool = False) -> None:
        self.specs, self.ties = checkpoint_manifest(model_path, dtype, trust_remote_code=trust_remote_code)
        self._file: SharedFile | None = None  # the shared bucket, made at the first push
        self.shared: bool | None = None
        """Whether versions go through the host file (None until the first push asks the workers)."""

    def check(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The tensors by name, after every check `load_weights` makes (ValueError naming what is wrong)."""
        given = collect_weights(version, named_tensors, self.specs, about_missing=_fused_into)
        for name, tied in self.ties.items():
            a, b = given[tied], given[name]
            if a is not b and not torch.equal(a, b.to(a.device, a.dtype)):
                raise ValueError(f"weights for version {version}: {name!r} is tied to {tied!r} in the model, but they were given different values")
        for name, (_, kind) in self.specs.items():
            dtype_name(name, kind if given[name].is_floating_point() else given[name].dtype)  # as sent: one the workers rebuild
        return given

    def push(self, version: int, given: dict[str, torch.Tensor], rpc: Rpc) -> None:
        """Send `check`'s tensors to every worker: through the host file where they all map it, else inside the messages."""
        if self.shared is None:
            self.shared = self._workers_map(rpc)
        if self.shared:
            try:
                self._push_shared(version, given, rpc)
                return
            except TransferError as e:  # no room for the bucket in /dev/shm: nothing was sent
                log.warning("vllm rollout: %s; weights go inside vLLM's messages from now on", e)
                self.shared = False
        for bucket in self._buckets(given):
            rpc("tidal_load_bucket", version, bucket)

    def close(self) -> None:
        """Delete the host file (the workers' mappings keep its pages until they drop them)."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def _sends(self, given: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors to send, in the manifest's order, each cast to its floating dtype, a tied twin left out."""
        for name, (_, dtype) in self.specs.items():
            if name in self.ties:
                continue
            tensor = given[name]
            yield name, tensor.to(dtype) if tensor.is_floating_point() and tensor.dtype != dtype else tensor

    def _workers_map(self, rpc: Rpc) -> bool:
        """Whether every worker maps a host file of this process (asked with a small one)."""
        try:
            probe = SharedFile(1, prefix="tidal-vllm-probe")
        except TransferError as e:
            log.warning("vllm rollout: %s; weights go inside vLLM's messages", e)
            return False
        try:
            answers = rpc("tidal_maps", str(probe.path))
        finally:
            probe.close()
        if all(answers):
            return True
        log.warning("vllm rollout: workers %s cannot map this host's files (on another host?): weights go inside vLLM's messages", [k for k, a in enumerate(answers) if not a])
        return False

    def _push_shared(self, version: int, given: dict[str, torch.Tensor], rpc: Rpc) -> None:
        sends = list(self._sends(given))
        sizes = [_aligned(t.nbytes) for _, t in sends]
        need = max(min(SHARED_BUCKET_BYTES, sum(sizes)), max(sizes, default=1))
        if self._file is None or self._file.nbytes < need:
            self.close()
            self._file = SharedFile(need, prefix="tidal-vllm-weights", remedy="give it more room (e.g. docker run --shm-size or --ipc=host)")
        buffer, path = self._file.buffer, str(self._file.path)
        items: list[list[Any]] = []
        offset = 0
        for (name, tensor), size in zip(sends, sizes):
            if items and offset + tensor.nbytes > buffer.numel():
                rpc("tidal_load_shared", version, path, items)
                items, offset = [], 0
            buffer[offset : offset + tensor.nbytes].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
            items.append([name, dtype_name(name, tensor.dtype), list(tensor.shape), offset])
            offset += size
        if items:
            rpc("tidal_load_shared", version, path, items)

    def _buckets(self, given: dict[str, torch.Tensor]) -> Iterator[list[list[Any]]]:
        """The tensors to send inside the messages, packed, in buckets of about `WEIGHT_BUCKET_BYTES`."""
        bucket: list[list[Any]] = []
        size = 0
        for name, tensor in self._sends(given):
            bucket.append(pack_tensor(name, tensor))
            size += tensor.nbytes
            if size >= WEIGHT_BUCKET_BYTES:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket


def _fused_into(missing: list[str]) -> str:
    """What `collect_weights` adds about missing names that vLLM fuses into one parameter."""
    fused = sorted({f for n in missing if (f := fused_name(n))})
    return f" (vLLM fuses the missing parts into {fused[:5]})" if fused else ""


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def checkpoint_manifest(path: Path, dtype: str, *, trust_remote_code: bool = False) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], dict[str, str]]:
    """The tensors of the Hugging Face model a checkpoint directory configures, by name: (shape,
    dtype), floating ones in `dtype` ("auto": the checkpoint's `dtype`); and its ties (name ->
    the first name sharing its tensor). The model is built on the meta device: no memory;
    `trust_remote_code`: a checkpoint whose model is its own code (`model.trust_remote_code`).

    Raises:
        ValueError: naming `path`, when transformers cannot build a causal LM from its config.
    """
    import transformers  # noqa: PLC0415 - heavy: only a vllm run reads a manifest here

    try:
        config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"model_path={str(path)!r}: cannot build a causal LM from its config: {type(e).__name__}: {e}") from e
    floating = _TORCH_DTYPES.get(dtype) or _checkpoint_dtype(config)
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    ties: dict[str, str] = {}
    first: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        specs[name] = (tuple(tensor.shape), floating if tensor.is_floating_point() else tensor.dtype)
        tied = first.setdefault(id(tensor), name)
        if tied != name:
            ties[name] = tied
    return specs, ties


def _checkpoint_dtype(config: Any) -> torch.dtype:
    """The dtype a checkpoint's config names (transformers gives a torch dtype or its name; float32 when none)."""
    value = config.dtype
    if isinstance(value, str):
        value = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}.get(value)
    return value if isinstance(value, torch.dtype) and value.is_floating_point else torch.float32


def fused_name(name: str) -> str | None:
    """The vLLM parameter a Hugging Face weight is part of (`...q_proj.weight` -> `...qkv_proj.weight`), or None."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in FUSED:
            return ".".join([*parts[:i], FUSED[part], *parts[i + 1 :]])
    return None
