"""The worker side of the `vllm` rollout adapter: a vLLM worker extension that takes tidal's weights.

vLLM mixes the class named by the engine argument `worker_extension_cls` into every worker
it starts (one per tensor-parallel rank, in processes of its own), and
`AsyncLLM.collective_rpc(name, args=...)` calls the method `name` on each of them and
returns their answers in rank order. `tidal.engines.vllm_rollout.VLLMRolloutEngine`
loads a version of the weights with two such calls: `tidal_load_bucket` once per bucket of
tensors, then `tidal_commit_weights`, which checks that every parameter of the worker's
model was written and records the version, which the adapter compares across workers.

vLLM refuses an extension with a name its worker class also has (`WorkerWrapperBase`'s
check): every name here has `tidal_` in it, and a test checks them against the names of
vLLM 0.32.0's `Worker` (tests/engines/vllm_api_0.32.0.json).

Tensors cross the process boundary inside the collective_rpc message. vLLM 0.32 encodes a
utility call's arguments with msgpack and decodes them with no type information, so a
`torch.Tensor` argument would arrive as a `[dtype, shape, buffer index]` list, not a
tensor: each tensor travels as `[name, dtype, shape, raw bytes]` (`pack_tensor`), which
msgpack carries as it is, and is rebuilt here (`unpack_tensor`).

Imports nothing from vLLM: the methods use only what every vLLM worker has (`get_model()`,
whose `load_weights` takes Hugging Face names and fills vLLM's fused parameters).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)}


def pack_tensor(name: str, tensor: torch.Tensor) -> list[Any]:
    """`[name, dtype, shape, bytes]`: one tensor as msgpack carries it (a copy on the host)."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ValueError(f"weight {name!r} has dtype {tensor.dtype}, which the vllm adapter does not carry")
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return [name, dtype, list(tensor.shape), flat.view(torch.uint8).numpy().tobytes()]


def unpack_tensor(item: Sequence[Any]) -> tuple[str, torch.Tensor]:
    """The (name, tensor) `pack_tensor` packed (a tensor of its own, on the host)."""
    name, dtype, shape, data = item
    if not data:
        return name, torch.empty(shape, dtype=_DTYPES[dtype])
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # bytearray: a writable copy torch may own
    return name, raw.view(_DTYPES[dtype]).reshape(shape)


class TidalWorkerExtension:
    """Mixed into each vLLM worker (`worker_extension_cls`): receives tidal's weights by Hugging
    Face name and records the version they are."""

    def tidal_load_bucket(self, version: int, items: list[list[Any]]) -> int:
        """Load one bucket of `version`'s tensors (`pack_tensor` items) into the model; returns
        how many tensors it took. The model's `load_weights` maps Hugging Face names onto its
        own parameters (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`, this rank's shard
        of each) and returns the parameters it wrote."""
        state = self._tidal_state()
        if state["loading"] != version:
            state["loading"], state["loaded"], state["complete"] = version, set(), True
        loaded = self.get_model().load_weights(unpack_tensor(item) for item in items)  # type: ignore[attr-defined]
        if loaded is None:  # a model whose loader does not say what it wrote: completeness is not checked
            state["complete"] = False
        else:
            state["loaded"] |= set(loaded)
        return len(items)

    def tidal_commit_weights(self, version: int) -> int:
        """Finish `version`: every parameter of the model must have been written by its buckets
        (as vLLM's own loader requires of a checkpoint); returns the version now recorded.

        Raises:
            ValueError: no bucket of `version` arrived, or parameters were not written (named).
        """
        state = self._tidal_state()
        if state["loading"] != version:
            raise ValueError(f"version {version}: no weights of it arrived at this worker (it last loaded {state['loading']})")
        if state["complete"]:
            missing = sorted({name for name, _ in self.get_model().named_parameters()} - state["loaded"])  # type: ignore[attr-defined]
            if missing:
                raise ValueError(f"version {version}: parameters not written by the weights sent: {missing[:5]}")
        state["version"], state["loading"] = version, None
        return version

    def tidal_weight_version(self) -> int | None:
        """The version last committed here (None before the first)."""
        return self._tidal_state()["version"]

    def _tidal_state(self) -> dict[str, Any]:
        # set on first use: a worker extension has no constructor of its own
        if "_tidal_weights" not in self.__dict__:
            self.__dict__["_tidal_weights"] = {"version": None, "loading": None, "loaded": set(), "complete": True}
        return self.__dict__["_tidal_weights"]
