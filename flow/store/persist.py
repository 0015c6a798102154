"""Saving a store to one file and loading it back, so a run resumes with its in-flight data.

File layout: the magic `TIDALST2`, a little-endian u64 header length, the msgpack header,
a u32 buffer count, each raw buffer as u64 length + bytes, then a u32 CRC-32 of every byte
before it. Written to a temporary file and renamed, so a crash mid-save leaves the
previous file intact; a file changed since (a flipped bit, a truncation, a copy cut
short) fails `load` naming the mismatch instead of resuming with wrong rows. Files of the
older layout (`TIDALST1`: the same without the checksum) still load. Nothing is pickled.

A value the codec cannot carry (an arbitrary object an in-process put kept) fails the save
with `CodecError` naming its partition, column and row. A controller whose rows live on
storage units is saved with `read_chunk` (its server's `StoreServer.save` reads them
from the units); the loaded store holds those rows itself.

A save a client asks for over the wire writes only where `path_inside` allows: inside the
directory its server was given (`StoreServer(persist_dir=)`).
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from tidal.flow.clock import REAL, Clock
from tidal.flow.store.codec import CodecError, decode, encode, name_failure
from tidal.flow.store.table import Store, StoreError
from tidal.flow.store.units import RemoteChunk

MAGIC = b"TIDALST2"
"""The magic of files this version writes (with a checksum)."""
MAGIC_UNCHECKED = b"TIDALST1"
"""The magic of files written before the checksum (2026-11-26), still loaded."""


def save(store: Store, path: str | Path, *, read_chunk: Callable[[RemoteChunk], Any] | None = None) -> None:
    """Save `store` to `path`. `read_chunk(chunk)`: the rows of a chunk held on a storage
    unit (a tensor or a list), for a controller of a split deployment."""
    write(store.state_dict(read_chunk=read_chunk), path)


def write(state: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Write a store's state (`Store.state_dict`) to `path`, as `save` does."""
    try:
        header, buffers = encode(state)
    except CodecError as e:
        raise name_failure(e, _parts(state)) from e
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        # not through a link left in its place: the file it names is not this save's to overwrite
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o666), "wb") as f:
            crc = 0

            def write(data: Any) -> None:
                nonlocal crc
                crc = zlib.crc32(data, crc)
                f.write(data)

            write(MAGIC + struct.pack("<Q", len(header)) + header + struct.pack("<I", len(buffers)))
            for buf in buffers:
                write(struct.pack("<Q", buf.nbytes))
                write(buf)
            f.write(struct.pack("<I", crc))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk, say: no half-written file stays behind
        raise


def path_inside(root: str | Path, path: str | Path) -> Path:
    """Where a save at `path` (relative paths: from `root`) writes, once `..` and symbolic
    links are resolved; `ValueError` naming `path` when that is not a file in `root` or
    under it (a path given by a client must not overwrite whatever the server may write)."""
    base = Path(os.path.realpath(root))
    target = Path(os.path.realpath(base / path))  # an absolute `path` replaces `base`
    if base not in target.parents:
        raise ValueError(f"save path {str(path)!r} names no file inside the store server's persist_dir {str(root)!r} (it resolves to {str(target)!r})")
    return target


def load(path: str | Path, *, clock: Clock = REAL) -> Store:
    """The store saved at `path` (timing leases with `clock`); `StoreError` naming the
    file when it is not a whole, unchanged store file (bad magic, truncated, checksum
    mismatch, bad contents).

    The checksum is checked in a first pass over the file, a chunk at a time, and each
    buffer is then read straight into memory of its own: the file is never held whole
    beside its buffers, so a load peaks at about the file's size, not twice it."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            body = _checked_body(f, size)
            f.seek(8)
            header_len = _unpack(f, "<Q", body)
            if 16 + header_len + 4 > body:
                raise CodecError(f"header of {header_len} bytes does not fit a {body}-byte file (truncated?)")
            header = f.read(header_len)
            buffers = [_read_buffer(f, _unpack(f, "<Q", body), body) for _ in range(_unpack(f, "<I", body))]
            if f.tell() != body and body != size:  # an older file (unchecked) may end with anything
                raise CodecError(f"{body - f.tell()} bytes after the last buffer")
        return Store.from_state_dict(decode(header, buffers), clock=clock)
    except (CodecError, struct.error, KeyError, TypeError, ValueError, OverflowError, AttributeError, IndexError) as e:  # what a malformed file's contents raise
        raise StoreError(f"cannot load store from {str(path)!r}: {e}") from e


READ_CHUNK_BYTES = 1 << 24
"""How much of the file the checksum pass reads at a time."""


def _checked_body(f: Any, size: int) -> int:
    """The length of the file's contents without its checksum, once the checksum matches
    (an older file: its whole size)."""
    magic = f.read(8)
    if magic == MAGIC_UNCHECKED:
        return size
    if magic != MAGIC:
        raise CodecError(f"not a tidal store file (bad magic {magic!r}; expected {MAGIC!r})")
    if size < 8 + 8 + 4 + 4:
        raise CodecError(f"file is truncated ({size} bytes)")
    body = size - 4
    actual, left = zlib.crc32(magic), body - 8
    while left:
        chunk = f.read(min(left, READ_CHUNK_BYTES))
        if not chunk:
            raise CodecError("file is truncated")  # it shrank while being read
        actual, left = zlib.crc32(chunk, actual), left - len(chunk)
    (expected,) = struct.unpack("<I", f.read(4))
    if actual != expected:
        raise CodecError(f"checksum mismatch (file says {expected:#010x}, contents give {actual:#010x}): the file was changed or cut short after it was saved")
    return body


def _unpack(f: Any, fmt: str, body: int) -> int:
    """One number of `fmt` read from `f`, which must end before `body`."""
    n = struct.calcsize(fmt)
    if f.tell() + n > body:
        raise CodecError("file is truncated")
    return struct.unpack(fmt, f.read(n))[0]


def _read_buffer(f: Any, n: int, body: int) -> bytearray:
    """The next `n` bytes of `f` (which must end before `body`), read into a buffer of their own."""
    if f.tell() + n > body:
        raise CodecError("file is truncated")
    buf = bytearray(n)
    if f.readinto(buf) != n:
        raise CodecError("file is truncated")
    return buf


def _parts(state: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """A state's values labelled for `name_failure`: each row's metadata and cells."""
    for name, p in state["partitions"].items():
        for index, group, _, tags in p["rows"]:
            yield f"partition {name!r} row {index} group", group
            yield f"partition {name!r} row {index} tags", tags
        for column, cells in p["columns"].items():
            for index, value in cells:
                yield f"partition {name!r} column {column!r} row {index}", value
