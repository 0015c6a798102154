"""Encoding store values as a msgpack header plus raw buffers. Nothing is ever pickled.

A value is a torch tensor (any dtype but the quantized ones), a NumPy array (numbers,
bools, fixed-width strings, datetimes), a `range`, a tuple, or a msgpack-native scalar /
string / bytes / list / dict. Tensors and arrays travel as their raw bytes in separate
buffers (frames on the wire, regions of a file on disk), or inside the header when they
are at most `INLINE_MAX_BYTES`; the header describes them by dtype and shape. Tuples come
back as tuples (a group id must stay hashable). Anything else is refused with
`CodecError`; `name_failure` says which part of a message it was in.
`decode` rejects anything it does not understand with `CodecError`, so a malformed or
truncated message can be answered with an error instead of crashing a server. Both ends
refuse a header nested deeper than `MAX_DEPTH` levels, before recursing past it: what
one end encodes, the other decodes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

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
        *(getattr(torch, name) for name in (  # newer dtypes, where this torch has them
            "uint16", "uint32", "uint64",
            "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
        ) if hasattr(torch, name)),
    )
}
_NAMES = {dt: name for name, dt in _TORCH_DTYPES.items()}
_IN_NUMPY = frozenset({torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128})
_ITEMSIZE = {name: torch.empty((), dtype=dt).element_size() for name, dt in _TORCH_DTYPES.items()}
_NUMPY_KINDS = "biufcUSMm"  # bool, signed, unsigned, float, complex, fixed-width str / bytes, datetime, timedelta (no objects)
_TENSOR, _ARRAY, _RANGE, _TUPLE = "t", "a", "r", "u"
INLINE_MAX_BYTES = 4096
"""Tensors and arrays up to this size travel inside the header (one frame fewer each)."""
MAX_RANGE = 1 << 24
"""The longest `range` a message may carry (row indexes: a few header bytes must not become gigabytes)."""
MAX_DEPTH = 100
"""How deeply a header's maps and lists may nest (a message or a saved store, with its
values; a tuple counts two levels): each level costs `encode` and `decode` Python stack,
and a few bytes nested deeper would end them in `RecursionError` instead of an answer."""
_SCALARS = frozenset({int, float, str, bool, type(None), bytes})
_NESTED = (dict, list)
_KEYS = (str, int, float, bytes, type(None))


def _too_deep() -> CodecError:
    return CodecError(f"nested deeper than MAX_DEPTH={MAX_DEPTH} levels of maps and lists (the store codec's limit)")


def _encode(value: Any, buffers: list[Any], depth: int = 0) -> Any:
    kind = type(value)
    if kind in _SCALARS:
        return value
    if depth >= MAX_DEPTH and not isinstance(value, (bool, int, float, str, bytes)):  # every other value is a map or list in the header
        raise _too_deep()
    if kind is dict:
        if "__" in value:
            raise CodecError("dict key '__' is reserved by the store codec")
        for key in value:
            if not isinstance(key, _KEYS):  # a tuple would be written as a list, which no decode can make a key
                raise CodecError(f"dict keys of type {type(key).__name__} cannot be saved or sent to another process (str, int, float, bytes, None can)")
        return {k: v if type(v) in _SCALARS else _encode(v, buffers, depth + 1) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        name = _NAMES.get(value.dtype)
        if name is None:
            raise CodecError(f"tensor dtype {value.dtype} is not supported by the store")
        if not value.is_cpu:
            raise CodecError(f"tensor on {value.device} must be moved to host memory before it is sent")
        if value.layout != torch.strided:
            raise CodecError(f"tensor layout {value.layout} is not supported by the store; put tensor.to_dense()")
        t = value.detach() if value.requires_grad else value
        t = t.resolve_conj().resolve_neg()  # a lazily conjugated or negated view: its values, not its raw bytes
        if not t.is_contiguous():
            t = t.contiguous()
        arr = t.numpy() if t.dtype in _IN_NUMPY else t.reshape(-1).view(torch.uint8).numpy()  # numpy has no bf16, float8, ...: its bytes (0-d too)
        return {"__": _TENSOR, "d": name, "s": list(value.shape), **_raw(arr, buffers)}
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in _NUMPY_KINDS:
            raise CodecError(f"numpy dtype {value.dtype} is not supported by the store")
        arr = value if value.flags.c_contiguous else np.ascontiguousarray(value)  # which makes a 0-d array 1-d
        return {"__": _ARRAY, "d": arr.dtype.str, "s": list(arr.shape), **_raw(arr, buffers)}
    if kind is range:
        return {"__": _RANGE, "r": [value.start, value.stop, value.step]}
    if isinstance(value, tuple):  # a named tuple comes back a plain one (equal, with the same hash)
        return {"__": _TUPLE, "v": _encode(list(value), buffers, depth + 1)}
    if isinstance(value, list):
        if all(type(v) in _SCALARS for v in value):  # e.g. row indexes: no recursion per element
            return value if kind is list else list(value)
        return [_encode(v, buffers, depth + 1) for v in value]
    if isinstance(value, dict):
        return _encode(dict(value), buffers, depth)
    if isinstance(value, np.generic):  # a NumPy scalar keeps its dtype: a 0-d array, read back as the scalar
        return {**_encode(np.asarray(value), buffers), "g": 1} if value.dtype.kind in _NUMPY_KINDS else value.item()
    if isinstance(value, (bool, int, float, str, bytes)):
        return value
    raise CodecError(f"values of type {type(value).__name__} cannot be saved or sent to another process (tensors, arrays, scalars, str, bytes, lists, tuples, dicts can)")


def _raw(arr: np.ndarray, buffers: list[Any]) -> dict[str, Any]:
    """Where a contiguous array's bytes go: inline in the header when small, else a buffer."""
    if arr.nbytes <= INLINE_MAX_BYTES:
        return {"x": arr.tobytes()}
    flat = arr.reshape(-1) if arr.ndim != 1 else arr  # its raw bytes go as they are
    buffers.append(flat.view(np.uint8) if arr.dtype.kind in "Mm" else flat)  # NumPy gives no buffer of datetimes
    return {"b": len(buffers) - 1}


def encode(value: Any) -> tuple[bytes, list[Any]]:
    """Return (msgpack header, raw buffers). Buffers share memory with the input; each is
    a contiguous 1-D array or memoryview (anything with the buffer protocol and `nbytes`)."""
    tree, buffers = encode_tree(value)
    return pack_header(tree), buffers


def encode_tree(value: Any) -> tuple[Any, list[Any]]:
    """`encode` before msgpack: the header as plain data (to add to), and the buffers."""
    buffers: list[Any] = []
    return _encode(value, buffers), buffers


def pack_header(tree: Any) -> bytes:
    try:
        return msgpack.packb(tree, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:  # an int past 64 bits, say
        raise CodecError(f"cannot be saved or sent to another process: {e}") from e


def _decode(obj: Any, buffers: Sequence[Any], copy: bool, depth: int = 0) -> Any:
    if depth >= MAX_DEPTH and isinstance(obj, _NESTED):
        raise _too_deep()
    if isinstance(obj, dict):
        kind = obj.get("__")
        if kind is None:
            return {k: _decode(v, buffers, copy, depth + 1) if isinstance(v, _NESTED) else v for k, v in obj.items()}
        if kind == _TUPLE:
            items = obj.get("v")
            if type(items) is not list:
                raise CodecError(f"malformed tuple {obj!r}")
            return tuple(_decode(items, buffers, copy, depth + 1))
        if kind == _RANGE:
            bounds = obj.get("r")
            if type(bounds) is not list or len(bounds) != 3 or not all(type(n) is int for n in bounds) or bounds[2] == 0:
                raise CodecError(f"malformed range {obj!r}")
            start, stop, step = bounds
            if (stop - start) // step > MAX_RANGE:
                raise CodecError(f"range {bounds} is longer than {MAX_RANGE}")
            return range(start, stop, step)
        try:
            dtype_name, shape = obj["d"], obj["s"]
            if type(shape) is not list or not all(type(n) is int for n in shape):
                shape = [int(n) for n in shape]
            index = obj.get("b")
            if index is None:
                buf = obj["x"]
                if not isinstance(buf, bytes):
                    raise TypeError("inline data must be bytes")
            else:
                if int(index) < 0:
                    raise IndexError(index)
                buf = buffers[int(index)]
        except (KeyError, TypeError, ValueError, IndexError) as e:
            raise CodecError(f"malformed array descriptor {obj!r}") from e
        if any(n < 0 for n in shape):
            raise CodecError(f"negative dimension in shape {shape}")
        if kind == _TENSOR:
            if not isinstance(dtype_name, str) or dtype_name not in _TORCH_DTYPES:
                raise CodecError(f"unknown tensor dtype {dtype_name!r}")
            itemsize = _ITEMSIZE[dtype_name]
        elif kind == _ARRAY:
            try:
                np_dtype = np.dtype(dtype_name)
            except (TypeError, ValueError) as e:
                raise CodecError(f"unknown numpy dtype {dtype_name!r}") from e
            if np_dtype.kind not in _NUMPY_KINDS:
                raise CodecError(f"numpy dtype {dtype_name!r} is not allowed")
            itemsize = np_dtype.itemsize
        else:
            raise CodecError(f"unknown value kind {kind!r}")
        numel = math.prod(shape)
        raw = memoryview(buf)
        if raw.ndim != 1 or raw.format != "B":
            raw = raw.cast("B")
        if raw.nbytes != numel * itemsize:
            raise CodecError(f"{'inline data' if index is None else f'buffer {index}'} holds {raw.nbytes} bytes, expected {numel * itemsize} for shape {shape}")
        try:
            if kind == _ARRAY:
                arr = np.frombuffer(raw, dtype=np_dtype).reshape(shape)
                if obj.get("g"):
                    return arr[()]
                return arr.copy() if copy or raw.readonly else arr
            if numel == 0:
                return torch.empty(shape, dtype=_TORCH_DTYPES[dtype_name])
            data: memoryview | bytearray = bytearray(raw) if copy or raw.readonly else raw  # torch tensors must own or share writable memory
            tensor = torch.frombuffer(data, dtype=_TORCH_DTYPES[dtype_name])  # keeps the buffer alive
            return tensor if len(shape) == 1 else tensor.reshape(shape)
        except (TypeError, ValueError, OverflowError, RuntimeError) as e:  # a shape or dtype NumPy or torch refuses (a zero itemsize, a dimension too big)
            raise CodecError(f"cannot make a {dtype_name} array of shape {shape}: {e}") from e
    if isinstance(obj, list):
        if not any(isinstance(v, _NESTED) for v in obj):
            return obj
        return [_decode(v, buffers, copy, depth + 1) for v in obj]
    return obj


def decode(header: bytes, buffers: Sequence[Any], *, copy: bool = False) -> Any:
    """Inverse of `encode`. With `copy=False` arrays share memory with writable buffers."""
    return decode_tree(unpack_header(header), buffers, copy=copy)


def unpack_header(header: bytes) -> Any:
    try:
        return msgpack.unpackb(header, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several types for bad input
        raise CodecError(f"header is not valid msgpack: {e}") from e


def decode_tree(tree: Any, buffers: Sequence[Any], *, copy: bool = False) -> Any:
    """Inverse of `encode_tree`."""
    return _decode(tree, buffers, copy)


def name_failure(error: CodecError, parts: Iterable[tuple[str, Any]]) -> CodecError:
    """`error`, raised encoding a message made of `parts` ((label, value) pairs), as an
    error that names the first part that does not encode. For an error path only: it
    encodes the parts again, one by one."""
    for label, value in parts:
        try:
            pack_header(encode_tree(value)[0])
        except CodecError as e:
            return CodecError(f"{label}: {e}")
    return error


def cells_of(label: str, value: Any, rows: Sequence[Any] | None = None) -> Iterator[tuple[str, Any]]:
    """`value` as `name_failure`'s parts: a list's cells one by one, labelled with their
    row (`rows[k]`, default k), anything else whole."""
    if isinstance(value, (list, tuple)):
        for k, cell in enumerate(value):
            yield f"{label} row {k if rows is None else rows[k]}", cell
    else:
        yield label, value
