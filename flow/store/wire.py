"""The store's wire format between processes (ZeroMQ multipart messages).

A request is `[header, *buffers]`: the header is msgpack of
`{"op": str, "id": int, "token": str | None, "args": {...}}` where every tensor or array
in `args` is a descriptor pointing at one of the raw buffers (see `codec`). A reply is the
same shape with `{"id": int, "ok": True, "result": ...}` or
`{"id": int | None, "ok": False, "error": "<kind>", "message": str}`. Nothing is pickled;
a header that does not decode, names an unknown op or carries wrong argument types gets
an error reply.

Batches travel column by column: a column of small same-shape tensors is stacked into
one buffer (`{"stacked": tensor}`), large or ragged cells go as one buffer each
(`{"cells": [...]}`), and rows held on storage units go as where to read them
(`{"remote": [[unit address, chunk key, row offsets], ...]}`; a block of rows the
controller holds itself, beside them, is an encoded column in that list).
"""

from __future__ import annotations

import hmac
import ipaddress
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from tidal.flow.store import shm
from tidal.flow.store.cells import Batch, as_indexes, rows_of
from tidal.flow.store.codec import CodecError, decode_tree, encode_tree, pack_header, unpack_header
from tidal.flow.store.samplers import Sequential, from_spec
from tidal.flow.store.table import Store
from tidal.flow.store.units import RemoteChunk

_SEQUENTIAL, _SEQUENTIAL_SPEC = Sequential(), {"kind": "sequential"}
STACK_MAX_CELL_BYTES = 64 * 1024
"""Cells up to this size are stacked into one buffer per column; larger ones go zero-copy."""
MAX_MESSAGE_BYTES = 4 << 30
"""The largest frame (a header, or one buffer) a store server takes by default
(`StoreServer(max_message_bytes=)`): a stacked column of a put, or a large cell, travels
as one frame, unless it goes through shared memory."""


class WireError(ValueError):
    """A message that is not a valid request or reply. `request_id`: the id its header
    carried, when the header decoded (so the error reply, or the error, goes to that
    request and is never taken for another's)."""

    def __init__(self, message: str, *, request_id: int | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


def pack(message: Mapping[str, Any], *, writer: shm.Writer | None = None, owned: shm.Segments | None = None, written: list[str] | None = None) -> list[Any]:
    """`[header, *buffers]`. With `writer` and/or `owned`, large buffers go by shared
    memory (see `shm`): the header's `shm` entry says where, their frames are empty.
    `written` gets the names of the segments `writer` wrote for the message."""
    tree, buffers = encode_tree(message)
    if (writer is not None or owned is not None) and buffers:
        placed = shm.place(buffers, writer=writer, owned=owned)
        if placed:
            tree["shm"] = placed
            for i, *_ in placed:
                buffers[i] = b""
            try:
                frames = [pack_header(tree), *buffers]
            except Exception:
                if writer is not None:
                    writer.discard(placed)  # written for a message that will never be sent
                raise
            if writer is not None and written is not None:
                written += writer.written(placed)
            return frames
    return [pack_header(tree), *buffers]


def unpack(frames: Sequence[Any], *, segments: shm.Segments | None = None, token: str | None = None, origin: Any = None) -> dict[str, Any]:
    """Decode `[header, *buffers]`; raises `WireError` for anything malformed. Buffers in
    shared memory are read through `segments` (`origin`: the connection the message came
    by, which the segments may go back to), and only for a message carrying `token`;
    without `segments` such a message is refused."""
    if not frames:
        raise WireError("empty message")
    try:
        message = unpack_header(bytes(frames[0]))
    except CodecError as e:
        raise WireError(str(e)) from e
    if not isinstance(message, dict):
        raise WireError(f"message must be a map, got {type(message).__name__}")
    try:
        buffers: list[Any] = [memoryview(f) for f in frames[1:]]
        placed = message.pop("shm", None)
        if placed is not None:
            _map_placed(placed, buffers, segments, token, message, origin)
        decoded = decode_tree(message, buffers)
        if not isinstance(decoded, dict):  # the map was a codec descriptor (a range, a tuple, ...)
            raise WireError(f"message must be a map, got {type(decoded).__name__}")
        return decoded
    except (CodecError, shm.ShmError, WireError) as e:
        request_id = message.get("id")
        raise WireError(str(e), request_id=request_id if type(request_id) is int else None) from e


def request_id_of(frames: Sequence[Any]) -> int | None:
    """The id in the header of `[header, *buffers]`, when it has one: for the error reply
    to a request refused before (or while) it was decoded. None when it has none."""
    try:
        header = unpack_header(bytes(frames[0]))
    except (CodecError, IndexError):
        return None
    request_id = header.get("id") if isinstance(header, dict) else None
    return request_id if type(request_id) is int else None


def _map_placed(placed: Any, buffers: list[Any], segments: shm.Segments | None, token: str | None, message: Mapping[str, Any], origin: Any) -> None:
    if segments is None:
        raise WireError("this end takes no shared-memory buffers (another host, or shared memory is off)")
    if not token_ok(token, message.get("token")):
        raise WireError("shared-memory buffers need the store token: missing or wrong")
    if not isinstance(placed, list):
        raise WireError("shm must be a list of [buffer, segment, offset, nbytes]")
    mapped: dict[str, Any] = {}
    try:
        for entry in placed:
            if not (isinstance(entry, list) and len(entry) == 4 and type(entry[0]) is int and 0 <= entry[0] < len(buffers)):
                raise WireError(f"bad shared-memory entry {entry!r}")
            i, name, offset, nbytes = entry
            buffers[i] = segments.map(name, offset, nbytes, mapped, origin)
    finally:
        segments.done(mapped)


def check_request(message: Mapping[str, Any], ops: Mapping[str, Any]) -> tuple[str, int, dict[str, Any]]:
    op, request_id, args = message.get("op"), message.get("id"), message.get("args", {})
    if not isinstance(request_id, int) or isinstance(request_id, bool):
        raise WireError(f"request id must be an int, got {request_id!r}")
    if not isinstance(op, str) or op not in ops:
        raise WireError(f"unknown op {op!r}; ops: {sorted(ops)}")
    if not isinstance(args, dict) or not all(isinstance(k, str) for k in args):
        raise WireError(f"args of {op!r} must be a map with string keys")
    return op, request_id, args


def token_ok(expected: str | None, given: Any) -> bool:
    if expected is None:
        return True
    return isinstance(given, str) and hmac.compare_digest(expected.encode(), given.encode())


def is_loopback(address: str) -> bool:
    """True for tcp://127.x, tcp://[::1], tcp://localhost and ipc:// / inproc:// addresses."""
    parsed = urllib.parse.urlsplit(address)
    if parsed.scheme in ("ipc", "inproc"):
        return True
    host = parsed.hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name or a hostname: reachable from elsewhere


def check_bind(address: str, token: str | None) -> None:
    if not is_loopback(address) and not token:
        raise ValueError(
            f"store server address {address!r} is reachable from other machines; "
            "pass a shared token (store.token / TIDAL_STORE_TOKEN) or bind tcp://127.0.0.1"
        )


def encode_column(cells: list[Any] | tuple[Any, ...]) -> dict[str, Any]:
    """One batch column for the wire: stacked when small and uniform, else cell by cell."""
    first = cells[0] if cells else None
    if (
        isinstance(first, torch.Tensor)
        and first.numel() * first.element_size() <= STACK_MAX_CELL_BYTES
        and all(isinstance(c, torch.Tensor) and c.shape == first.shape and c.dtype == first.dtype for c in cells)
    ):
        return {"stacked": torch.stack(cells)}
    return {"cells": list(cells)}


def encode_batch_column(batch: Batch, name: str) -> dict[str, Any]:
    """A batch column for the wire: one stacked buffer when it is made of tensor chunks,
    the chunk keys and row offsets when its chunks live on storage units."""
    blocks = batch.blocks(name)
    if len(blocks) == 1 and isinstance(blocks[0][0], torch.Tensor):  # the usual case: rows of one put
        chunk, offsets = blocks[0]
        return {"stacked": rows_of(chunk, offsets)}
    if len(blocks) == 1 and isinstance(blocks[0][0], np.ndarray):  # stacked as it was put (cell by cell, a 1-d one's cells are NumPy scalars)
        chunk, offsets = blocks[0]
        return {"stacked": chunk[np.asarray(offsets)]}
    if any(isinstance(chunk, RemoteChunk) for chunk, _ in blocks):  # rows this store holds itself (a restored one's) go along
        return {"remote": [[chunk.unit, chunk.key, as_indexes(offsets)] if isinstance(chunk, RemoteChunk) else _block(chunk, offsets) for chunk, offsets in blocks]}
    stacked = batch.chunked(name)
    return {"stacked": stacked} if stacked is not None else encode_column(batch.columns[name])


def _block(chunk: Any, offsets: Any) -> dict[str, Any]:
    """The rows `offsets` of a chunk held here, encoded as a column."""
    if isinstance(chunk, torch.Tensor):
        return {"stacked": rows_of(chunk, offsets)}
    if isinstance(chunk, np.ndarray):
        return {"stacked": chunk[np.asarray(offsets)]}
    return encode_column([chunk[int(k)] for k in offsets])


def decode_column(name: str, value: Any) -> Any:
    """The column as a chunk: a tensor with rows along dim 0, or a list of cells."""
    if not isinstance(value, dict) or len(value) != 1:
        raise WireError(f"column {name!r} is not an encoded column")
    (kind, payload), = value.items()
    if kind == "stacked" and isinstance(payload, (torch.Tensor, np.ndarray)) and payload.ndim >= 1:
        return payload
    if kind == "cells" and isinstance(payload, list):
        return payload
    if kind == "remote" and isinstance(payload, list):
        return payload  # [[unit, key, offsets] or an encoded column, ...]: the client reads the first from the units
    raise WireError(f"column {name!r} has unknown encoding {kind!r}")


def get_reply(store: Store, a: Mapping[str, Any], holder: int) -> dict[str, Any]:
    """Serve a get request's args `a` from `store` for the connection `holder`:
    the result a reply carries, each column encoded for the wire. Rows whose columns cannot
    be encoded are given back (no one would ack them) before the error is raised."""
    ack = a.get("ack")
    batch: Batch = store.get(
        a["consumer"],
        a["partition"],
        a["columns"],
        a["batch_size"],
        sampler=_SEQUENTIAL if a.get("sampler") in (None, _SEQUENTIAL_SPEC) else from_spec(a["sampler"]),
        timeout=a.get("timeout"),
        partial=bool(a.get("partial", False)),
        waiting_since=a.get("waiting_since"),
        ack=None if ack is None else as_indexes(ack),
        holder=holder,
        describe_timeout=bool(a.get("describe_timeout", True)),
    )
    indexes, version = batch.index_range, batch.version_fill
    try:
        columns = {name: encode_batch_column(batch, name) for name in batch.columns}
    except Exception:
        store.release(a["consumer"], a["partition"], batch.index_array)
        raise
    return {
        "indexes": batch.index_array if indexes is None else indexes,
        "groups": batch.groups if batch.has_groups else None,
        "versions": batch.version_array if version is None else version,
        "columns": columns,
    }
