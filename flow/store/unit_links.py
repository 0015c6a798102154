"""A store server's links to the storage units that hold its rows (a split deployment).

The controller keeps only where each chunk of rows lives (`RemoteChunk`). When it lets go
of one (every consumer acked its rows, or a put replaced them) the unit is told to drop
it, and a save reads every chunk back from its unit. Both go over connections of the
server's own ZeroMQ context, which the server closes with it.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import numpy as np
import zmq

from tidal.flow.store.table import StoreError
from tidal.flow.store.units import RemoteChunk
from tidal.flow.store.wire import decode_column, pack, unpack

log = logging.getLogger(__name__)


class UnitLinks:
    """Drops chunks on, and reads chunks from, the storage units a controller refers to.

    `on_free` is the store's free listener (store lock held: it only notes the chunk);
    the server thread sends the notes with `flush_drops`, which needs no reply. Not
    thread-safe: `flush_drops` and `close` run in the server thread; `read_chunk` uses
    sockets of its caller's own (one save's).
    """

    def __init__(self, ctx: zmq.Context, token: str | None) -> None:
        self._ctx, self._token = ctx, token
        self.drops: collections.deque[tuple[str, str]] = collections.deque()
        """(unit address, chunk key) of chunks to drop there."""
        self._sockets: dict[str, zmq.Socket] = {}
        self._deaf: set[str] = set()
        """Units that took no message at the last try (warned about once until they take one)."""

    def on_free(self, partition: str, chunk: Any) -> None:
        if isinstance(chunk, RemoteChunk):
            self.drops.append((chunk.unit, chunk.key))

    def flush_drops(self) -> None:
        """Tell each unit, in one message, which of its chunks to drop. Never blocks: a
        unit that takes no more messages (it died, or is stuck) loses the notes, with a
        warning, rather than stall the server thread (its chunks went with it, if it died)."""
        if not self.drops:
            return
        batches: dict[str, list[str]] = {}
        while self.drops:
            unit, key = self.drops.popleft()
            batches.setdefault(unit, []).append(key)
        for unit, keys in batches.items():
            sock = self._sockets.get(unit)
            if sock is None:
                sock = self._sockets[unit] = self._connect(unit)
            while sock.poll(0):  # replies to earlier drops carry nothing we need
                sock.recv_multipart()
            try:
                sock.send_multipart(pack({"op": "unit_drop", "id": 0, "token": self._token, "args": {"keys": keys}}), flags=zmq.NOBLOCK)
                self._deaf.discard(unit)
            except zmq.Again:
                if unit not in self._deaf:
                    log.warning("storage unit %s takes no messages (is it running?): chunks it holds are not dropped there", unit)
                self._deaf.add(unit)

    def read_chunk(self, chunk: RemoteChunk, sockets: dict[str, zmq.Socket], timeout_s: float) -> Any:
        """Every row of `chunk`, from the unit that holds it (within `timeout_s`), through
        `sockets` (by unit address; the caller closes them)."""
        sock = sockets.get(chunk.unit)
        if sock is None:
            sock = sockets[chunk.unit] = self._connect(chunk.unit)
        offsets = np.arange(len(chunk), dtype=np.int64)
        sock.send_multipart(pack({"op": "unit_read", "id": 1, "token": self._token, "args": {"key": chunk.key, "offsets": offsets}}))
        if not sock.poll(int(timeout_s * 1000)):
            raise StoreError(f"storage unit {chunk.unit} did not answer within {timeout_s:g}s: the rows it holds cannot be saved")
        reply = unpack(sock.recv_multipart())
        if not reply.get("ok"):
            raise StoreError(f"storage unit {chunk.unit} cannot give chunk {chunk.key!r} to save: {reply.get('message')}")
        return decode_column(chunk.key, reply["result"])

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()

    def _connect(self, unit: str) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(unit)
        return sock
