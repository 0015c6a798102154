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

Tensors cross the process boundary through a host file the workers map
(`tidal_load_shared`: the adapter writes a bucket into a `tidal.hal.transfer.shared_file`,
the message names the file and each tensor's place in it, and each worker loads views of
the mapping), where every worker can map it (`tidal_maps`: on the adapter's host); else
inside the collective_rpc message. vLLM 0.32 encodes a utility call's arguments with
msgpack and decodes them with no type information, so a `torch.Tensor` argument would
arrive as a `[dtype, shape, buffer index]` list, not a tensor: each tensor then travels as
`[name, dtype, shape, raw bytes]` (`pack_tensor`), which msgpack carries as it is, and is
rebuilt here (`unpack_tensor`). The file saves the copies the message costs: the bytes
out of the tensor, msgpack's into the message, the socket's to vLLM's engine process and
from it to each worker, and the worker's out of the message.

Imports nothing from vLLM: the methods use only what every vLLM worker has (`get_model()`,
whose `load_weights` takes Hugging Face names and fills vLLM's fused parameters).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)}


def dtype_name(name: str, dtype: torch.dtype) -> str:
    """How weight `name`'s `dtype` travels (ValueError for one a worker cannot rebuild)."""
    text = str(dtype).removeprefix("torch.")
    if text not in _DTYPES:
        raise ValueError(f"weight {name!r} has dtype {dtype}, which the vllm adapter does not carry")
    return text


def pack_tensor(name: str, tensor: torch.Tensor) -> list[Any]:
    """`[name, dtype, shape, bytes]`: one tensor as msgpack carries it (a copy on the host)."""
    dtype = dtype_name(name, tensor.dtype)
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
        self._tidal_load(version, (unpack_tensor(item) for item in items))
        return len(items)

    def tidal_maps(self, path: str) -> bool:
        """Whether this worker can map the shared file `path` (it runs on the adapter's host)."""
        from tidal.hal.transfer import TransferError  # noqa: PLC0415
        from tidal.hal.transfer.shared_file import map_shared  # noqa: PLC0415

        try:
            map_shared(path, 0)
        except TransferError:
            return False
        return True

    def tidal_load_shared(self, version: int, path: str, items: list[list[Any]]) -> int:
        """Load one bucket of `version`'s tensors from the shared file `path`, each item
        `[name, dtype, shape, byte offset]`, as `tidal_load_bucket` does; returns how many it
        took. The model's loader copies each view into its parameters before this returns
        (a copy from pageable host memory leaves the source free once the call is back), so
        the adapter may write the next bucket over these."""
        from tidal.hal.transfer.shared_file import map_shared  # noqa: PLC0415

        state = self._tidal_state()
        mapped = state["mapped"]
        if mapped is None or mapped[0] != path:
            mapped = state["mapped"] = (path, map_shared(path, 0, what="shared weight bucket"))
        buffer = mapped[1]

        def views() -> Any:
            for name, dtype, shape, offset in items:
                kind = _DTYPES[dtype]
                nbytes = math.prod(shape) * kind.itemsize
                if offset < 0 or offset + nbytes > buffer.numel():
                    raise ValueError(f"version {version}: {name!r} lies outside the shared bucket {path!r} ({buffer.numel()} bytes)")
                yield name, buffer[offset : offset + nbytes].view(kind).view(shape)

        self._tidal_load(version, views())
        return len(items)

    def _tidal_load(self, version: int, named_tensors: Any) -> None:
        state = self._tidal_state()
        if state["loading"] != version:
            state["loading"], state["loaded"], state["complete"] = version, set(), True
        loaded = self.get_model().load_weights(named_tensors)  # type: ignore[attr-defined]
        if loaded is None:  # a model whose loader does not say what it wrote: completeness is not checked
            state["complete"] = False
        else:
            state["loaded"] |= set(loaded)

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
            self.__dict__["_tidal_weights"] = {"version": None, "loading": None, "loaded": set(), "complete": True, "mapped": None}
        return self.__dict__["_tidal_weights"]
