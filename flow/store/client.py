"""`RemoteStore`: the `Store` API, served by a `StoreServer` in another process.

The same calls, arguments, return values and errors as the in-process `Store`, so a
stage does not know which one it holds - but for values the codec cannot carry (any
object but tensors, arrays, scalars, strings, bytes, lists, tuples and dicts: see `codec`),
which an in-process store keeps and a remote put refuses with `CodecError` naming their
column and row. Each thread gets its own socket (a blocking `get` in one thread never
holds up another's `ack`), and its own connection: leases are tied to the connection that
took them, so a thread or process that dies has its rows redelivered.

Split deployment: give `unit=` a `StoreServer` that serves a local `StorageUnit` (or the
address of one). Then `put` writes each column into that unit as one chunk - in process,
zero copy - and sends the controller only where it lives and its rows' sizes; `get` asks
the controller which rows to take and reads them straight from the units that hold them.

Shared memory: with a server on the same host (same `/dev/shm`, checked with one ping
per server), large buffers go through shared-memory segments instead of the socket, both
ways (see `shm`): a put writes its rows once, a get maps them.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import zmq

from tidal.flow.clock import ClockEvent
from tidal.flow.store import auth
from tidal.flow.store import shm as _shm
from tidal.flow.store.cells import Batch, as_indexes, cell_sizes, check_column, num_rows_of_put
from tidal.flow.store.codec import CodecError, cells_of, name_failure
from tidal.flow.store.pending import PendingPut, not_done, own_result, result_of
from tidal.flow.store.samplers import NO_VERSION, Sampler, Sequential, to_spec
from tidal.flow.store.server import StoreServer
from tidal.flow.store.table import StoreError
from tidal.flow.store.thread_sockets import ClientSockets, one_call
from tidal.flow.store.units import RemoteChunk
from tidal.flow.store.wire import WireError, decode_column, encode_column, pack, unpack

TOKEN_ENV = "TIDAL_STORE_TOKEN"
_SEQUENTIAL_SPEC = to_spec(Sequential())


class RemoteStore:
    """A client of the store server at `address` (e.g. ``tcp://127.0.0.1:5555``).

    `token` defaults to the `TIDAL_STORE_TOKEN` environment variable. It is shown in each
    connection's handshake (`auth`): a server with a token refuses a client without it, or
    with another, and the call raises `StoreError` ("Unauthorized: missing or wrong store
    token") at once; a server without one takes this client all the same. Calls that do not
    wait for data fail with `StoreError` when the server has not replied within
    `rpc_timeout_s`; `get`/`put` wait as long as their own `timeout` plus that, and fail
    sooner when the server no longer holds them (it restarted, or the connection broke) or
    stops answering `_await_parked`'s checks for `rpc_timeout_s`.
    `shm=False` keeps every byte on the socket even when the server shares this host.
    """

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        unit: StoreServer | str | None = None,
        rpc_timeout_s: float = 60.0,
        shm: bool = True,
    ) -> None:
        self.address = address
        self.token = token if token is not None else os.environ.get(TOKEN_ENV)
        self.rpc_timeout_s = rpc_timeout_s
        self._local_unit = unit if isinstance(unit, StoreServer) else None
        if self._local_unit is not None and self._local_unit.unit is None:
            raise ValueError("unit= must be a StoreServer that serves a StorageUnit")
        self.unit_address = unit.address if isinstance(unit, StoreServer) else unit
        self._ctx = zmq.Context()
        self._tls = threading.local()
        self._sockets = ClientSockets(self._ctx, address)
        self._ids = itertools.count(1)
        self._keys = itertools.count()
        self._uid = uuid.uuid4().hex[:12]
        self._host = _shm.host_id() if shm else None
        self._writer = _shm.Writer()
        self._unclaimed: dict[int, list[str]] = {}
        """Request id -> the segments written for it, until its reply says the server took them."""
        self._segments = _shm.Segments(own=False)
        # `wake()` publishes here; a thread in a cancellable wait listens (`_wake_listener`)
        self._waker = self._ctx.socket(zmq.PUB)
        self._waker.setsockopt(zmq.LINGER, 0)
        self._wake_address = f"inproc://tidal-store-wake-{uuid.uuid4().hex}"
        self._waker.bind(self._wake_address)
        self._wake_lock = threading.Lock()
        self._shared: dict[str, bool] = {}  # server address -> shares our /dev/shm

    # Plumbing ---------------------------------------------------------------------------
    def _socket(self, address: str, what: str) -> zmq.Socket:
        """This thread's connection to `address`. A new one is used once the server took
        its handshake (`auth`), within `rpc_timeout_s`; `what`: the call it is for."""
        sockets = self._sockets.of_thread()
        sock = sockets.get(address)
        if sock is None:
            sock = sockets[address] = self._connect(address, what)
        return sock

    def _connect(self, address: str, what: str) -> zmq.Socket:
        return auth.connect(lambda: self._sockets.open(zmq.DEALER), address, self.token, lambda handshake: self._await_handshake(handshake, what))

    def _await_handshake(self, handshake: auth.Handshake, what: str) -> bool:
        """`handshake.outcome()` once known; `StoreError` when the server refused the
        connection, did not finish the handshake within `rpc_timeout_s`, or this thread's
        cancellable call was cancelled meanwhile (nothing was sent)."""
        cancel = getattr(self._tls, "cancel", None)
        wake = None if cancel is None else self._wake_listener()
        took = handshake.wait(self.rpc_timeout_s, wake=wake, cancelled=None if cancel is None else cancel.is_set, check_s=CANCEL_CHECK_S)
        if took is None and cancel is not None and cancel.is_set():
            raise not_done(StoreError(f"{what} was cancelled"))
        if took is None:
            raise StoreError(f"store server {handshake.address} did not answer {what!r} within {self.rpc_timeout_s:g}s; is it running?{handshake.why_not()}")
        return took

    def _send(self, address: str, op: str, args: dict[str, Any]) -> tuple[zmq.Socket, int]:
        shared = self._shares_host(address, op)  # first: a new connection is named by that ping
        sock = self._socket(address, op)
        request_id = next(self._ids)
        message = {"op": op, "id": request_id, "token": self.token, "args": args}
        if shared:
            message["host"] = self._host
            written: list[str] = []
            frames = pack(message, writer=self._writer, written=written)
            if written:
                self._unclaimed[request_id] = written
        else:
            frames = pack(message)
        try:
            sock.send_multipart(frames, copy=False)
        except BaseException:
            self._settle(request_id, ok=False)
            raise
        return sock, request_id

    def _settle(self, request_id: int, *, ok: bool) -> None:
        """A request was answered or withdrawn: the server took its segments, or, when it
        failed, may not have (unlinking one it took is a no-op: it has another name)."""
        names = self._unclaimed.pop(request_id, None)
        if names and not ok:
            self._writer.unlink(names)

    @one_call
    def shares_host(self, address: str | None = None) -> bool:
        """Whether large buffers to and from the server at `address` (default: the store's)
        go through shared memory."""
        return self._shares_host(address or self.address, "ping")

    def _shares_host(self, address: str, op: str) -> bool:
        shared = self._shared.get(address)
        if shared is None:
            shared = False
            if self._host is not None:  # one ping per server: does it see our /dev/shm?
                what = "ping" if op == "ping" else f"ping (before {op})"
                sock = self._socket(address, what)
                request_id = next(self._ids)
                sock.send_multipart(pack({"op": "ping", "id": request_id, "token": self.token, "args": {}}))
                shared = self._receive(sock, request_id, address, what, self.rpc_timeout_s).get("host") == self._host
            self._shared[address] = shared
        return shared

    def _cancellable(self, cancel: ClockEvent, what: str, call: Any) -> Any:
        """`call()` (a get or put, sent once) whose wait for its reply ends when `cancel` is
        set: the request is then withdrawn at the server (`_receive_or_withdraw`). The
        event is looked at every `CANCEL_CHECK_S`, and at once on `wake()`."""
        # Subscribe to `wake()` before the first look at `cancel`: a stop that sets it and
        # wakes in between is then seen either way (set at the look, or its wake heard).
        self._wake_listener()
        if cancel.is_set():
            raise StoreError(f"{what} was cancelled")
        self._tls.cancel = cancel
        try:
            return call()
        finally:
            self._tls.cancel = None

    def _wake_listener(self) -> zmq.Socket:
        """This thread's subscription to `wake()`."""
        self._sockets.of_thread()  # first: a closed client says so
        listener = getattr(self._tls, "wake_listener", None)
        if listener is None:
            listener = self._tls.wake_listener = self._sockets.open(zmq.SUB)
            listener.setsockopt(zmq.SUBSCRIBE, b"")
            listener.connect(self._wake_address)
        return listener

    def _receive(self, sock: zmq.Socket, request_id: int, address: str, op: str, wait_s: float | None) -> Any:
        if op in ("get", "put", "save", "wait_partition"):  # the requests a server may hold (parked, or saving) while it answers liveness checks
            return self._await_parked(sock, request_id, address, op, wait_s, getattr(self._tls, "cancel", None))
        return self._receive_reply(sock, request_id, address, op, wait_s)

    def _await_parked(self, sock: zmq.Socket, request_id: int, address: str, op: str, wait_s: float | None, cancel: ClockEvent | None) -> Any:
        """The reply to a get or put, which the server may park for up to `wait_s` (None:
        without bound). After each `CANCEL_CHECK_S` without it, asks the server on `sock`
        whether it still holds the request (`parked`); "no" means no reply is coming (the
        server answers that after the request's own reply, and a restarted server or a
        remade connection holds nothing of it), and so does no answer in `rpc_timeout_s`:
        either ends the wait with `StoreError`. Asked on a second connection, a restarted
        server's answer said nothing about the request. A cancellable wait (`cancel`) also
        looks at the event every `CANCEL_CHECK_S` and on `wake()`, and once it is set
        withdraws the request (`_withdraw`) instead of waiting on."""
        poller = None if cancel is None else self._poller(sock)
        deadline = None if wait_s is None else time.monotonic() + wait_s
        heard, question, asked = time.monotonic(), None, 0.0  # when the server last answered; the check out: its id, when
        try:
            while cancel is None or not cancel.is_set():
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise StoreError(f"store server {address} did not answer {op!r} within {wait_s:g}s; is it running?")
                if question is None and now - heard >= CANCEL_CHECK_S:
                    question, asked = self._ask_parked(address, request_id), now
                elif question is not None and now - asked >= self.rpc_timeout_s:
                    self._settle(request_id, ok=False)
                    raise StoreError(f"store server {address} did not answer a ping within {self.rpc_timeout_s:g}s while {op!r} waited; is it running?")
                due = asked + self.rpc_timeout_s if question is not None else heard + CANCEL_CHECK_S
                due = min(due, math.inf if deadline is None else deadline, math.inf if poller is None else now + CANCEL_CHECK_S)
                reply = self._wait_reply(sock, request_id, address, op, due - now, poller=poller, until=question)
                if reply is not None:
                    return own_result(reply)
                answer = None if question is None else self._tls.stash.pop(question, None)
                if answer is not None:
                    self._tls.submitted.discard(question)
                    if result_of(answer) is not True:
                        self._settle(request_id, ok=False)
                        raise StoreError(f"store server {address} no longer holds this {op!r}, and no reply to it came (the server restarted, or the connection to it broke): the request is lost")
                    heard, question = time.monotonic(), None
            return self._withdraw(sock, request_id, address, op)
        finally:
            if question is not None:  # its answer, if it comes, is a late reply: skipped
                self._tls.submitted.discard(question)
                self._tls.stash.pop(question, None)

    def _poller(self, sock: zmq.Socket) -> zmq.Poller:
        """A poller of `sock` and this thread's subscription to `wake()`."""
        poller = zmq.Poller()
        for each in (sock, self._wake_listener()):
            poller.register(each, zmq.POLLIN)
        return poller

    def _ask_parked(self, address: str, request_id: int) -> int:
        """Ask the server whether it still holds `request_id` (same connection); the answer's id."""
        _, question = self._send(address, "parked", {"request": request_id})
        tls = self._tls.__dict__
        tls.setdefault("stash", {})
        tls.setdefault("submitted", set()).add(question)  # its answer is kept when read
        return question

    def _wait_reply(self, sock: zmq.Socket, request_id: int, address: str, op: str, wait_s: float, *, poller: zmq.Poller | None, until: int | None) -> dict[str, Any] | None:
        """The reply to `request_id` if it comes within `wait_s`; None when it does not, when
        the answer to `until` comes first, or when `poller` hears a `wake()` first."""
        wait_s = max(wait_s, 0.0)
        if poller is not None:
            ready = dict(poller.poll(int(1000 * wait_s) + 1))
            listener = self._tls.wake_listener
            while listener.poll(0):
                listener.recv()
            if sock not in ready:
                return None
            wait_s = 0.0  # ready: another request's reply, maybe
        return self._next_reply(sock, request_id, address, op, wait_s, until=until)

    def _withdraw(self, sock: zmq.Socket, request_id: int, address: str, op: str) -> Any:
        """Ask the server to drop a request whose wait was cancelled. Still parked: nothing
        was done for it, and this raises `StoreError`. Answered already: that answer (the
        server sends it before the withdraw's), as if the wait had not been cancelled (rows
        it took or put are the caller's). Neither (a restarted server): `StoreError` too."""
        submitted = self._tls.__dict__.setdefault("submitted", set())
        kept = request_id in submitted
        submitted.add(request_id)  # its answer, read while waiting for the withdraw's, is kept
        cancel, self._tls.cancel = self._tls.cancel, None
        try:
            _, withdraw_id = self._send(address, "withdraw", {"request": request_id})
            withdrawn = self._receive_reply(sock, withdraw_id, address, "withdraw", self.rpc_timeout_s)
            reply = None if withdrawn else self._next_reply(sock, request_id, address, op, 0.0)  # kept, if it came
            if reply is None:
                self._settle(request_id, ok=False)
                if withdrawn:
                    raise not_done(StoreError(f"{op} was cancelled"))
                raise StoreError(f"{op} was cancelled (store server {address} no longer held it: it restarted, or the connection broke)")
            return own_result(reply)
        finally:
            self._tls.cancel = cancel
            if not kept:
                submitted.discard(request_id)

    def _receive_reply(self, sock: zmq.Socket, request_id: int, address: str, op: str, wait_s: float | None) -> Any:
        reply = self._next_reply(sock, request_id, address, op, wait_s)
        if reply is None:
            raise StoreError(f"store server {address} did not answer {op!r} within {wait_s:g}s; is it running?")
        return result_of(reply)

    def _next_reply(self, sock: zmq.Socket, request_id: int, address: str, op: str, wait_s: float | None, *, until: int | None = None) -> dict[str, Any] | None:
        """The reply to `request_id`, or None when none came within `wait_s` (or the answer
        to `until` came first). Replies to this thread's other submitted requests read on
        the way are kept for them; late replies to abandoned requests are skipped."""
        timeout_ms = -1 if wait_s is None else int(wait_s * 1000) + 1
        timeouts = self._tls.__dict__.setdefault("timeouts", {})
        if timeouts.get(sock) != timeout_ms:  # one blocking receive with a timeout, not a poll and then a receive
            sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
            timeouts[sock] = timeout_ms
        stash = self._tls.__dict__.setdefault("stash", {})
        reply = stash.pop(request_id, None)
        while reply is None:
            try:
                reply = unpack(sock.recv_multipart(copy=False), segments=self._segments)
            except zmq.Again:
                return None
            except WireError as e:
                raise StoreError(f"malformed reply from store server {address}: {e}") from e
            reply_id = reply.get("id")
            if reply_id != request_id and reply_id is not None:
                if reply_id in self._tls.__dict__.get("submitted", ()):
                    stash[reply_id] = reply
                    if reply_id == until:
                        return None
                else:
                    self._settle(reply_id, ok=bool(reply.get("ok")))
                reply = None
        self._settle(request_id, ok=bool(reply.get("ok")))
        return reply

    @one_call
    def _call(self, op: str, args: dict[str, Any], *, wait: float | None = 0.0, address: str | None = None) -> Any:
        """`wait`: how long the server may legitimately wait (None: without bound)."""
        address = address or self.address
        sock, request_id = self._send(address, op, args)
        return self._receive(sock, request_id, address, op, None if wait is None else wait + self.rpc_timeout_s)

    # Store API --------------------------------------------------------------------------
    def ping(self) -> dict[str, Any]:
        return self._call("ping", {})

    def create_partition(
        self,
        name: str,
        *,
        consumers: Sequence[str],
        capacity_rows: int | None = None,
        capacity_bytes: int | None = None,
        lease_s: float = 300.0,
        exist_ok: bool = False,
    ) -> None:
        args = {"name": name, "consumers": list(consumers), "capacity_rows": capacity_rows, "capacity_bytes": capacity_bytes, "lease_s": lease_s, "exist_ok": exist_ok}
        self._call("create_partition", args)

    def wait_partition(self, name: str, *, timeout: float | None = None, cancel: ClockEvent | None = None) -> None:
        """As `Store.wait_partition`: the server holds the request until the partition exists."""
        if cancel is not None:
            return self._cancellable(cancel, f"wait_partition({name!r})", lambda: self.wait_partition(name, timeout=timeout))
        self._call("wait_partition", {"partition": name, "timeout": timeout}, wait=timeout)

    def add_consumer(self, partition: str, consumer: str) -> None:
        self._call("add_consumer", {"partition": partition, "consumer": consumer})

    @property
    def version(self) -> int:
        return self._call("version", {})

    def set_version(self, version: int) -> None:
        self._call("set_version", {"version": version})

    @one_call
    def put(
        self,
        partition: str,
        columns: Mapping[str, Any],
        indexes: Sequence[int] | None = None,
        *,
        groups: Sequence[Any] | None = None,
        versions: Sequence[int | None] | None = None,
        tags: Sequence[Mapping[str, Any]] | None = None,
        timeout: float | None = None,
        cancel: ClockEvent | None = None,
        ack: tuple[str, str, Sequence[int]] | None = None,
        num_rows: int | None = None,
    ) -> list[int]:
        """As `Store.put` (`ack=` included: the server does both in one step). With a storage
        unit the data goes there and the controller gets references."""

        def submit() -> PendingPut:
            return self.submit_put(partition, columns, indexes, groups=groups, versions=versions, tags=tags, timeout=timeout, ack=ack, num_rows=num_rows)

        if cancel is not None:
            return self._cancellable(cancel, f"put into {partition!r}", lambda: submit().result())
        return submit().result()

    @one_call
    def submit_put(
        self,
        partition: str,
        columns: Mapping[str, Any],
        indexes: Sequence[int] | None = None,
        *,
        groups: Sequence[Any] | None = None,
        versions: Sequence[int | None] | None = None,
        tags: Sequence[Mapping[str, Any]] | None = None,
        timeout: float | None = None,
        ack: tuple[str, str, Sequence[int]] | None = None,
        num_rows: int | None = None,
    ) -> PendingPut:
        """Send a put and return before its reply: a producer keeps several in flight
        (pipelined on this thread's connection, applied by the server in the order sent)
        and reads each one's indexes, or error, with `PendingPut.result()` in this thread.
        The columns must not change until then. `Store.submit_put` is the same call."""
        if not columns:
            raise ValueError("put needs at least one column")
        then_ack = None if ack is None else {"consumer": ack[0], "partition": ack[1], "indexes": as_indexes(ack[2])}
        meta = {"groups": _plain(groups), "versions": _plain(versions), "tags": _plain(tags), "timeout": timeout, "ack": then_ack, "num_rows": num_rows}
        keys: list[str] = []
        try:
            num_rows = num_rows_of_put(columns, indexes, num_rows)
            if self.unit_address is None or num_rows == 0:  # 0 rows: a chunk on the unit would never be freed (the controller keeps none)
                args = {"partition": partition, "columns": dict(columns), "indexes": _plain(indexes), **meta}
            else:
                remote = {}
                for name, value in columns.items():
                    chunk = check_column(name, value, num_rows)
                    key = f"{self._uid}-{next(self._keys)}"
                    if self._local_unit is not None:
                        assert self._local_unit.unit is not None  # checked in __init__
                        self._local_unit.unit.write(key, chunk)  # in process: zero copy
                    else:
                        self._call("unit_write", {"key": key, "chunk": encode_column(chunk) if isinstance(chunk, list) else {"stacked": chunk}}, address=self.unit_address)
                    keys.append(key)
                    remote[name] = RemoteChunk(self.unit_address, key, cell_sizes(chunk)).wire
                args = {"partition": partition, "remote": remote, "indexes": _plain(indexes), **meta}
            sock, request_id = self._send(self.address, "put", args)
        except BaseException as e:
            self._drop_chunks(keys)  # the controller never took them: free them on the unit
            if isinstance(e, CodecError):  # say which column (or metadata) and row
                parts = itertools.chain(
                    *(cells_of(f"column {name!r}", value) for name, value in columns.items()),
                    cells_of("groups", [] if groups is None else groups),
                    cells_of("tags", [] if tags is None else tags),
                )
                raise name_failure(e, parts) from e
            raise
        wait_s = None if timeout is None else timeout + self.rpc_timeout_s

        def wait_reply() -> list[int]:
            with self._sockets.in_call():  # a close() meanwhile is a StoreError
                return list(self._receive(sock, request_id, self.address, "put", wait_s))

        return PendingPut(request_id, thread_state=self._tls.__dict__, wait_reply=wait_reply, drop_chunks=lambda: self._drop_chunks(keys))

    def _drop_chunks(self, keys: list[str]) -> None:
        if not keys:
            return
        if self._local_unit is not None:
            assert self._local_unit.unit is not None  # checked in __init__
            self._local_unit.unit.drop(keys)
        else:
            try:
                self._call("unit_drop", {"keys": keys}, address=self.unit_address)
            except StoreError:
                pass  # the unit is gone too; nothing is left to free

    @one_call
    def get(
        self,
        consumer: str,
        partition: str,
        columns: Sequence[str],
        batch_size: int,
        *,
        sampler: Sampler | None = None,
        timeout: float | None = None,
        partial: bool = False,
        ack: Iterable[int] | None = None,
        cancel: ClockEvent | None = None,
    ) -> Batch:
        """As `Store.get`; rows on storage units are read from them before returning.

        Setting `cancel` ends the wait with `StoreError`: at once after `wake()`, else within
        `CANCEL_CHECK_S`; the request, sent once, is withdrawn at the server. A request the
        server answered first is returned as usual. `put` takes `cancel` the same way.
        """
        if cancel is not None:
            return self._cancellable(cancel, f"get({consumer!r}, {partition!r})", lambda: self.get(consumer, partition, columns, batch_size, sampler=sampler, timeout=timeout, partial=partial, ack=ack))
        args = {
            "ack": None if ack is None else as_indexes(ack),
            "consumer": consumer,
            "partition": partition,
            "columns": columns if isinstance(columns, str) else list(columns),  # a string: the server names it (`Store.get`)
            "batch_size": batch_size,
            "sampler": _SEQUENTIAL_SPEC if sampler is None else to_spec(sampler),
            "timeout": timeout,
            "partial": partial,
        }
        reply = self._call("get", args, wait=timeout)
        chunks = {name: decode_column(name, value) for name, value in reply["columns"].items()}
        remote = {name: chunks[name] for name, value in reply["columns"].items() if "remote" in value}
        if remote:
            chunks.update(self._read_units(remote))
        indexes, versions = reply["indexes"], reply["versions"]
        if isinstance(versions, list):
            versions = [None if v == NO_VERSION else v for v in versions]
        return Batch.from_chunks(partition, indexes if isinstance(indexes, range) else as_indexes(indexes), {c: chunks[c] for c in columns}, reply["groups"], versions)

    def _read_units(self, remote: dict[str, list[Any]]) -> dict[str, Any]:
        """Read every (unit, chunk key, offsets) piece; requests to all units go out first."""
        pending = []
        pieces: dict[tuple[str, int], Any] = {}
        for name, blocks in remote.items():
            for k, block in enumerate(blocks):
                if isinstance(block, dict):  # rows the controller holds itself
                    pieces[(name, k)] = decode_column(name, block)
                    continue
                unit, key, offsets = block
                if self._local_unit is not None and unit == self._local_unit.address:
                    assert self._local_unit.unit is not None  # checked in __init__
                    pieces[(name, k)] = self._local_unit.unit.read(key, offsets)
                else:
                    pending.append((name, k, unit, *self._send(unit, "unit_read", {"key": key, "offsets": offsets})))
        for name, k, unit, sock, request_id in pending:
            pieces[(name, k)] = decode_column(name, self._receive(sock, request_id, unit, "unit_read", self.rpc_timeout_s))
        out = {}
        for name, blocks in remote.items():
            parts = [pieces[(name, k)] for k in range(len(blocks))]
            if all(isinstance(p, torch.Tensor) for p in parts) and len({(p.dtype, p.shape[1:]) for p in parts}) == 1:  # cat would promote or fail
                out[name] = parts[0] if len(parts) == 1 else torch.cat(parts)
            else:
                out[name] = [cell for p in parts for cell in p]
        return out

    def ack(self, consumer: str, partition: str, indexes: Iterable[int]) -> int:
        return self._call("ack", {"consumer": consumer, "partition": partition, "indexes": as_indexes(indexes)})

    def release(self, consumer: str, partition: str | None = None, indexes: Iterable[int] | None = None) -> int:
        args = {"consumer": consumer, "partition": partition, "indexes": None if indexes is None else [int(i) for i in indexes]}
        return self._call("release", args)

    def metrics(self) -> dict[str, Any]:
        return self._call("metrics", {})

    def save(self, path: str) -> None:
        """Save the server's store to `path` on the server's machine (`StoreServer.save`:
        rows on storage units are read from them and saved too): a path relative to the
        server's `persist_dir`, or inside it; a server started without one refuses. The
        server saves on a thread of its own and keeps serving; this waits for as long as the
        save takes, while the server answers that it is still saving (`rpc_timeout_s` bounds
        each check, not the save)."""
        self._call("save", {"path": str(path)}, wait=None)

    def wake(self) -> None:
        """End the cancellable waits of this client's threads (`get`/`put` with `cancel`)
        whose event is set now, rather than at their next re-check (`CANCEL_CHECK_S`)."""
        with self._wake_lock:
            if not self._sockets.closed:
                self._waker.send(b"")

    def close(self) -> None:
        """Close every socket of this client (their connections end: unacked leases return).
        Another thread's get, put or call that waits then ends with `StoreError` ("was
        closed"), and that thread closes its own sockets (ZeroMQ forbids closing them under
        it); this returns once it has. A submitted put whose reply was not read may or may
        not have gone in; the segment of one the server has not read yet is unlinked.
        Idempotent."""
        with self._wake_lock:
            if not self._sockets.close_idle():
                return
            self._waker.close(linger=0)
        for request_id in list(self._unclaimed):
            self._settle(request_id, ok=False)
        self._writer.close()
        self._ctx.term()

    def __enter__(self) -> RemoteStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


CANCEL_CHECK_S = 1.0
"""How often a cancellable remote get/put looks at its cancel event while it waits, when
nobody calls `RemoteStore.wake()` (a local check: the request is sent once), and how long
any waiting get/put lets the server be silent before it asks whether the server still
holds the request (`RemoteStore._await_parked`)."""


def _plain(values: Sequence[Any] | None) -> list[Any] | np.ndarray | None:
    return values if values is None or isinstance(values, (list, np.ndarray)) else list(values)
