"""Encoding store values as a msgpack header plus raw buffers. Nothing is ever pickled.

A value is a torch tensor, a NumPy array, or a msgpack-native scalar / string / bytes /
list / dict. Tensors and arrays travel as their raw bytes in separate buffers (frames on
the wire, regions of a file on disk); the header describes them by dtype and shape.
`decode` rejects anything it does not understand with `CodecError`, so a malformed or
truncated message can be answered with an error instead of crashing a server.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import math

import msgpack
import numpy as np
import torch


class CodecError(ValueError):
    """A message that does not decode: wrong type, unknown dtype, size mismatch, bad msgpack."""


_TORCH_DTYPES = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.float64, torch.float32, torch.float16, torch.bfloat16,
        torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
        torch.complex64, torch.complex128,
    )
}
_ITEMSIZE = {name: torch.empty((), dtype=dt).element_size() for name, dt in _TORCH_DTYPES.items()}
_NUMPY_KINDS = "biufc?"  # bool, signed, unsigned, float, complex (no objects, no strings)
_TENSOR, _ARRAY = "t", "a"
_PLAIN = (int, float, str, bool, type(None))


def _encode(value: Any, buffers: list[memoryview]) -> Any:
    if isinstance(value, torch.Tensor):
        name = str(value.dtype)[6:]  # "torch.float32" -> "float32"
        if name not in _TORCH_DTYPES:
            raise CodecError(f"tensor dtype {value.dtype} is not supported by the store")
        t = value.detach()
        if t.device.type != "cpu":
            raise CodecError(f"tensor on {t.device} must be moved to host memory before it is sent")
        if not t.is_contiguous():
            t = t.contiguous()
        arr = t.reshape(-1).view(torch.uint8).numpy() if t.dtype is torch.bfloat16 else t.numpy()
        buffers.append(memoryview(arr.reshape(-1).view(np.uint8)))
        return {"__": _TENSOR, "d": name, "s": list(value.shape), "b": len(buffers) - 1}
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in _NUMPY_KINDS:
            raise CodecError(f"numpy dtype {value.dtype} is not supported by the store")
        arr = np.ascontiguousarray(value)
        buffers.append(memoryview(arr.reshape(-1).view(np.uint8)))
        return {"__": _ARRAY, "d": arr.dtype.str, "s": list(arr.shape), "b": len(buffers) - 1}
    if isinstance(value, (list, tuple)):
        if all(type(v) in _PLAIN for v in value):  # e.g. row indexes: no recursion per element
            return list(value)
        return [_encode(v, buffers) for v in value]
    if isinstance(value, dict):
        if "__" in value:
            raise CodecError("dict key '__' is reserved by the store codec")
        return {k: _encode(v, buffers) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    raise CodecError(f"values of type {type(value).__name__} cannot be stored (tensors, arrays, scalars, str, bytes, lists, dicts)")


def encode(value: Any) -> tuple[bytes, list[memoryview]]:
    """Return (msgpack header, raw buffers). Buffers share memory with the input."""
    buffers: list[memoryview] = []
    header = msgpack.packb(_encode(value, buffers), use_bin_type=True)
    return header, buffers


def _decode(obj: Any, buffers: Sequence[Any], copy: bool) -> Any:
    if isinstance(obj, dict):
        kind = obj.get("__")
        if kind is None:
            return {k: _decode(v, buffers, copy) for k, v in obj.items()}
        try:
            dtype_name, shape, index = obj["d"], [int(n) for n in obj["s"]], int(obj["b"])
            buf = buffers[index]
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise CodecError(f"malformed array descriptor {obj!r}") from e
        if any(n < 0 for n in shape):
            raise CodecError(f"negative dimension in shape {shape}")
        if kind == _TENSOR:
            dtype = _TORCH_DTYPES.get(dtype_name)
            if dtype is None:
                raise CodecError(f"unknown tensor dtype {dtype_name!r}")
            itemsize = _ITEMSIZE[dtype_name]
        elif kind == _ARRAY:
            try:
                np_dtype = np.dtype(dtype_name)
            except TypeError as e:
                raise CodecError(f"unknown numpy dtype {dtype_name!r}") from e
            if np_dtype.kind not in _NUMPY_KINDS:
                raise CodecError(f"numpy dtype {dtype_name!r} is not allowed")
            itemsize = np_dtype.itemsize
        else:
            raise CodecError(f"unknown value kind {kind!r}")
        numel = math.prod(shape)
        raw = memoryview(buf).cast("B")
        if raw.nbytes != numel * itemsize:
            raise CodecError(f"buffer {index} holds {raw.nbytes} bytes, expected {numel * itemsize} for shape {shape}")
        if kind == _ARRAY:
            arr = np.frombuffer(raw, dtype=np_dtype).reshape(shape)
            return arr.copy() if copy else arr
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        flat = np.frombuffer(raw, dtype=np.uint8)
        if copy or raw.readonly:  # torch tensors must own or share writable memory
            flat = flat.copy()
        return torch.from_numpy(flat).view(dtype).reshape(shape)
    if isinstance(obj, list):
        if not any(isinstance(v, (dict, list)) for v in obj):
            return obj
        return [_decode(v, buffers, copy) for v in obj]
    return obj


def decode(header: bytes, buffers: Sequence[Any], *, copy: bool = False) -> Any:
    """Inverse of `encode`. With `copy=False` arrays share memory with writable buffers."""
    try:
        obj = msgpack.unpackb(header, raw=False, strict_map_key=False)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types for bad input
        raise CodecError(f"header is not valid msgpack: {e}") from e
    return _decode(obj, buffers, copy)
