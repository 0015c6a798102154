"""Saving a store to one file and loading it back, so a run resumes with its in-flight data.

File layout: the magic `TIDALST1`, a little-endian u64 header length, the msgpack header,
a u32 buffer count, then each raw buffer as u64 length + bytes. Written to a temporary
file and renamed, so a crash mid-save leaves the previous file intact. Nothing is pickled.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

from tidal.flow.store.codec import CodecError, decode, encode
from tidal.flow.store.table import Store, StoreError

MAGIC = b"TIDALST1"


def save(store: Store, path: str | Path) -> None:
    header, buffers = encode(store.state_dict())
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<Q", len(header)) + header + struct.pack("<I", len(buffers)))
        for buf in buffers:
            f.write(struct.pack("<Q", buf.nbytes))
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: str | Path) -> Store:
    data = Path(path).read_bytes()
    view = memoryview(data)
    try:
        if view[:8] != MAGIC:
            raise CodecError("not a tidal store file (bad magic)")
        (header_len,) = struct.unpack_from("<Q", view, 8)
        pos = 16 + header_len
        if pos + 4 > len(view):
            raise CodecError(f"header of {header_len} bytes does not fit a {len(view)}-byte file (truncated?)")
        header = bytes(view[16:pos])
        (num_buffers,) = struct.unpack_from("<I", view, pos)
        pos += 4
        buffers = []
        for _ in range(num_buffers):
            (n,) = struct.unpack_from("<Q", view, pos)
            pos += 8
            if pos + n > len(view):
                raise CodecError("file is truncated")
            buffers.append(bytearray(view[pos : pos + n]))
            pos += n
        return Store.from_state_dict(decode(header, buffers))
    except (CodecError, struct.error, KeyError, TypeError, ValueError, OverflowError) as e:
        raise StoreError(f"cannot load store from {str(path)!r}: {e}") from e
