"""A store server's links to the storage units that hold its rows (a split deployment).

The controller keeps only where each chunk of rows lives (`RemoteChunk`). When it lets go
of one (every consumer acked its rows, or a put replaced them) the unit is told to drop
it, and a save reads every chunk back from its unit. Both go over connections of the
server's own ZeroMQ context, which the server closes with it.

A save notes the chunks it will read (`SavedChunks`) while it holds the store's lock, and
reads them after letting go of it, so puts and gets go on while the units answer; the
noted chunks are pinned meanwhile (a drop of one waits until the save is done with it).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import zmq

from tidal.flow.store import auth
from tidal.flow.store.table import StoreError
from tidal.flow.store.units import RemoteChunk
from tidal.flow.store.wire import decode_column, pack, unpack

log = logging.getLogger(__name__)


class UnitLinks:
    """Drops chunks on, and reads chunks from, the storage units a controller refers to.

    `on_free` is the store's free listener (store lock held: it only notes the chunk);
    the server thread sends the notes with `flush_drops`, which needs no reply. Not
    thread-safe: `flush_drops` and `close` run in the server thread; `read_chunk` uses
    sockets of its caller's own (one save's). A unit whose reply has a frame larger than
    `max_message_bytes` is disconnected before it is buffered (`StoreServer`'s limit).
    Connections show the controller's `token` in their handshake (`auth`); to a unit
    without a token they connect again without it (drops sent meanwhile are sent again).
    The handshake of a drops connection is followed on `poller` (the server thread's, which
    calls `flush_drops` when it hears of it), never waited for.
    """

    def __init__(self, ctx: zmq.Context, token: str | None, *, max_message_bytes: int = -1, poller: zmq.Poller | None = None) -> None:
        self._ctx, self._token, self._max_message_bytes = ctx, token, max_message_bytes
        self._poller = poller
        self.drops: collections.deque[tuple[str, str]] = collections.deque()
        """(unit address, chunk key) of chunks to drop there."""
        self._sockets: dict[str, zmq.Socket] = {}
        self._deaf: set[str] = set()
        """Units that took no message at the last try (warned about once until they take one)."""
        self._pins: collections.Counter[tuple[str, str]] = collections.Counter()
        """(unit address, chunk key) of chunks a save will read: not dropped until it has."""
        self._held: list[tuple[str, str]] = []
        """Drops of pinned chunks, sent once they are unpinned."""
        self._pin_lock = threading.Lock()  # pins are set by a saving thread, drops sent by the server thread
        self._following: dict[str, tuple[auth.Handshake, list[list[str]]]] = {}
        """Units whose drop connection's handshake goes on: how it goes, and the keys sent meanwhile."""

    def pin(self, chunk: RemoteChunk) -> None:
        """Keep `chunk` on its unit (a drop waits) until `unpin`."""
        with self._pin_lock:
            self._pins[(chunk.unit, chunk.key)] += 1

    def unpin(self, chunks: list[RemoteChunk]) -> bool:
        """Let go of pins; True when drops that waited for them are due (`flush_drops`)."""
        with self._pin_lock:
            for chunk in chunks:
                where = (chunk.unit, chunk.key)
                self._pins[where] -= 1
                if self._pins[where] <= 0:
                    del self._pins[where]
            due = [where for where in self._held if where not in self._pins]
            self._held = [where for where in self._held if where in self._pins]
        self.drops.extend(due)
        return bool(due)

    def on_free(self, partition: str, chunk: Any) -> None:
        if isinstance(chunk, RemoteChunk):
            self.drops.append((chunk.unit, chunk.key))

    def flush_drops(self) -> None:
        """Tell each unit, in one message, which of its chunks to drop. Never blocks: a
        unit that takes no more messages (it died, or is stuck) loses the notes, with a
        warning, rather than stall the server thread (its chunks went with it, if it died)."""
        if self._following:
            self._follow_handshakes()
        if not self.drops:
            return
        batches: dict[str, list[str]] = {}
        with self._pin_lock:
            while self.drops:
                unit, key = self.drops.popleft()
                if (unit, key) in self._pins:  # a save reads it first
                    self._held.append((unit, key))
                else:
                    batches.setdefault(unit, []).append(key)
        for unit, keys in batches.items():
            sock = self._sockets.get(unit)
            if sock is None:
                try:
                    sock = self._sockets[unit] = self._drop_link(unit, self._token)
                except zmq.ZMQError as e:  # a put named an address ZeroMQ refuses: no unit to tell
                    log.warning("storage unit %r cannot be reached (%s): chunks it holds are not dropped there", unit, e)
                    continue
            self._send_drops(unit, sock, keys)

    def _send_drops(self, unit: str, sock: zmq.Socket, keys: list[str]) -> None:
        while sock.poll(0):  # replies to earlier drops carry nothing we need
            sock.recv_multipart()
        try:
            sock.send_multipart(pack({"op": "unit_drop", "id": 0, "token": self._token, "args": {"keys": keys}}), flags=zmq.NOBLOCK)
            self._deaf.discard(unit)
        except zmq.Again:
            if unit not in self._deaf:
                log.warning("storage unit %s takes no messages (is it running?): chunks it holds are not dropped there", unit)
            self._deaf.add(unit)
            return
        if unit in self._following:
            self._following[unit][1].append(keys)

    def _drop_link(self, unit: str, token: str | None) -> zmq.Socket:
        """A connection to `unit` for drops, whose handshake `flush_drops` follows without waiting."""
        sock = self._socket()
        try:
            handshake = auth.Handshake(sock, unit, token)
        except BaseException:
            sock.close(linger=0)
            raise
        self._following[unit] = (handshake, [])
        if self._poller is not None:
            self._poller.register(handshake.monitor, zmq.POLLIN)
        return sock

    def _unfollow(self, unit: str) -> None:
        handshake, _ = self._following.pop(unit)
        if self._poller is not None:
            self._poller.unregister(handshake.monitor)
        handshake.close()

    def _follow_handshakes(self) -> None:
        for unit, (handshake, sent) in list(self._following.items()):
            try:
                took = handshake.outcome()
            except StoreError as e:  # ZeroMQ does not connect again: the drops queue up, then are refused (`_send_drops`)
                log.warning("storage unit %s refused this controller's connection: chunks it holds are not dropped there (%s)", unit, e)
                took = True
            if took is None:
                continue
            self._unfollow(unit)
            if took is False:  # the unit has no token: again without it, with the drops sent meanwhile
                self._sockets.pop(unit).close(linger=0)
                sock = self._sockets[unit] = self._drop_link(unit, None)
                for keys in sent:
                    self._send_drops(unit, sock, keys)

    def read_chunk(self, chunk: RemoteChunk, sockets: dict[str, zmq.Socket], timeout_s: float) -> Any:
        """Every row of `chunk`, from the unit that holds it (within `timeout_s`), through
        `sockets` (by unit address; the caller closes them)."""
        deadline = time.monotonic() + timeout_s
        sock = sockets.get(chunk.unit)
        if sock is None:
            sock = sockets[chunk.unit] = auth.connect(self._socket, chunk.unit, self._token, lambda handshake: handshake.wait(timeout_s))
        offsets = np.arange(len(chunk), dtype=np.int64)
        sock.send_multipart(pack({"op": "unit_read", "id": 1, "token": self._token, "args": {"key": chunk.key, "offsets": offsets}}))
        if not sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            raise StoreError(f"storage unit {chunk.unit} did not answer within {timeout_s:g}s: the rows it holds cannot be saved")
        reply = unpack(sock.recv_multipart())
        if not reply.get("ok"):
            raise StoreError(f"storage unit {chunk.unit} cannot give chunk {chunk.key!r} to save: {reply.get('message')}")
        return decode_column(chunk.key, reply["result"])

    def close(self) -> None:
        for unit in list(self._following):
            self._unfollow(unit)
        for sock in self._sockets.values():
            sock.close(linger=0)
        self._sockets.clear()

    def _socket(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        return sock


class SavedChunks:
    """The chunks on storage units a save's state refers to, read after the store's lock.

    `refer` is `persist.state_of`'s `read_chunk` (store lock held): it pins the chunk and
    stands in for its rows; `resolve` (lock released) reads each chunk once and puts its
    rows into the state where the stand-ins are; `close` unpins them.
    """

    def __init__(self, links: UnitLinks) -> None:
        self._links = links
        self._chunks: dict[tuple[str, str], _ChunkRows] = {}

    def refer(self, chunk: RemoteChunk) -> _ChunkRows:
        where = (chunk.unit, chunk.key)
        rows = self._chunks.get(where)
        if rows is None:
            self._links.pin(chunk)
            rows = self._chunks[where] = _ChunkRows(chunk)
        return rows

    def resolve(self, state: dict[str, Any], read: Callable[[RemoteChunk], Any]) -> None:
        """Read every referred chunk with `read` and replace its cells' stand-ins in `state`."""
        for rows in self._chunks.values():
            rows.rows = read(rows.chunk)
        for cells in _column_cells(state):
            for cell in cells:
                if isinstance(cell[1], _Cell):
                    cell[1] = cell[1].value()

    def close(self) -> bool:
        """Unpin the chunks; True when drops that waited for them are due."""
        chunks, self._chunks = [rows.chunk for rows in self._chunks.values()], {}
        return self._links.unpin(chunks) if chunks else False


class _ChunkRows:
    """A chunk's rows, read later; indexing gives a stand-in for one cell."""

    def __init__(self, chunk: RemoteChunk) -> None:
        self.chunk = chunk
        self.rows: Any = None

    def __getitem__(self, offset: int) -> _Cell:
        return _Cell(self, offset)


class _Cell:
    __slots__ = ("chunk", "offset")

    def __init__(self, chunk: _ChunkRows, offset: int) -> None:
        self.chunk, self.offset = chunk, offset

    def value(self) -> Any:
        return self.chunk.rows[self.offset]


def _column_cells(state: dict[str, Any]) -> Iterator[list[list[Any]]]:
    """Each column's [index, cell] list in a `persist.state_of` state."""
    for part in state["partitions"].values():
        yield from part["columns"].values()
