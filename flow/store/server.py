"""Serve a store (controller) and/or a storage unit over ZeroMQ.

One thread receives requests and serves each at once, without waiting. A `get` with too
few ready rows, or a `put` into a full partition, is parked; parked requests are retried,
in arrival order, right after anything that can satisfy them (a put, an ack, a release, a
version change, a lease expiry) and answered the moment they succeed - no polling, no
sleeps. A change that arrives as a request is answered first and then followed by the
retries in the server thread, before the next request is read: a producer that waits
for each put's reply is not held up by the consumers its put wakes. A change
made by another thread of this process (the producer of an embedded store calling
`Store.put`) retries the parked requests right there and sends their replies itself: no
hand-off to the server thread, no wait for the GIL. The socket is shared under a lock; the
server thread waits on its file descriptor, never inside a ZeroMQ call. The loop's only
timer is the earliest parked deadline or lease expiry.

A client's connection dying (its process killed mid-`get`, say) is seen through the
socket's monitor: the rows leased through that connection are released for redelivery
and its parked requests are dropped, so a consumer that dies loses nothing. A client
whose get or put waits asks now and then whether it is still parked (`parked`), on the
same connection; that answer, and a withdraw's, never overtakes the request's own reply,
so "not parked" with no reply before it tells the client that none is coming (this
server restarted, or the connection broke).

Every request is answered: a malformed frame, an unknown op, a bad token, a header
nested too deeply or a failing call gets an error reply and the server keeps serving.
Servers bind 127.0.0.1 unless told otherwise, and refuse to bind anything reachable from
other machines without a shared token. A server with a token checks it in each
connection's handshake (`auth`): a peer without it is disconnected before it sends one
frame, so it can make the server hold nothing. Each request's header carries the token
too, checked again (were the handshake's check ever missing, ZeroMQ would take every
peer). A frame larger than `max_message_bytes` ends its connection as its length
arrives, before any of it is buffered. A client's `save` writes only inside the
`persist_dir` the server was started with, and none without one.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import zmq
import zmq.utils.monitor

from tidal.flow.store import auth, persist
from tidal.flow.store import shm as _shm
from tidal.flow.store.cells import as_indexes
from tidal.flow.store.codec import CodecError, cells_of, name_failure
from tidal.flow.store.peers import Parked, Peer, Peers, request_of, taken_by
from tidal.flow.store.table import Store, StoreTimeout
from tidal.flow.store.unit_links import SavedChunks, UnitLinks
from tidal.flow.store.units import RemoteChunk, StorageUnit
from tidal.flow.store.wire import MAX_MESSAGE_BYTES, WireError, check_bind, check_request, decode_column, encode_column, get_reply, pack, request_id_of, token_ok, unpack
from tidal.hal import owner

log = logging.getLogger(__name__)
_ids = itertools.count()
_BLOCKING = ("get", "put", "wait_partition")
_QUIET = {"get": {"describe_timeout": False}}
"""Added to a waiting request's arguments while the server tries it again: a get's
timeout is described only when its client's deadline has passed."""
_ABOUT_A_REQUEST = frozenset({"withdraw", "parked"})  # sent while a get or put waits: they leave the held reply alone
_MUTATING = frozenset({"get", "put", "ack", "release", "set_version", "create_partition", "add_consumer"})  # get: its acks and drops free room
_WAKE, _STOP = b"w", b"s"
_POLLIN = int(zmq.POLLIN)  # a plain int: `&` with the enum member builds an enum member each time (a few us per look)


class StoreServer:
    """Serve `store` (a `Store`, typically the controller) and/or `unit` at `address`.

    `address` is a ZeroMQ endpoint; port 0 picks a free port (read `server.address`).
    Binding anything but loopback requires `token`, which a peer must show in its
    connection's handshake and carry in every request (`auth`; "" is no token).
    With `shm` (the default), clients on this host send large buffers through shared
    memory and get rows that arrived that way as references to it (see `shm`).
    `persist_dir`: the directory a client's `save` (`RemoteStore.save`) may write in, at a
    path relative to it or inside it; None (the default) refuses every such save (the
    server's own `save` writes anywhere). `max_message_bytes`: the largest frame (one
    buffer of a request) this server takes, and takes from storage units; a peer that sends
    a larger one is disconnected before it is buffered. Buffers sent through shared memory
    do not count.
    """

    def __init__(
        self,
        store: Store | None = None,
        *,
        unit: StorageUnit | None = None,
        address: str = "tcp://127.0.0.1:0",
        token: str | None = None,
        shm: bool = True,
        persist_dir: str | os.PathLike[str] | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        if store is None and unit is None:
            raise ValueError("StoreServer needs a store, a storage unit, or both")
        if isinstance(max_message_bytes, bool) or not isinstance(max_message_bytes, int) or max_message_bytes < 1:
            raise ValueError(f"max_message_bytes must be a number of bytes >= 1, got {max_message_bytes!r}")
        check_bind(address, token)
        token = token or None
        self.store, self.unit, self.token = store, unit, token
        self.persist_dir = None if persist_dir is None else os.fspath(persist_dir)
        self.max_message_bytes = max_message_bytes
        self.num_malformed = 0
        self.num_errors = 0
        self.host = _shm.host_id() if shm else None
        self.segments = _shm.Segments(own=True) if self.host is not None else None
        """Shared-memory segments this server has mapped (and unlinks when it lets go)."""
        if self.segments is not None:
            owner.sweep(_shm.DIR)  # segments of killed senders and servers: nothing else frees them
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)  # checked on each frame's length, before it is read
        try:
            self._zap = auth.ZapHandler(self._ctx, token) if token is not None else None  # before the bind: no peer comes unchecked
            auth.require_token(self._router, token)
            self._router.bind(address[:-2] + ":*" if address.endswith(":0") else address)
        except BaseException:
            self._ctx.destroy(linger=0)  # the router and the context's threads: a taken port leaks nothing
            raise
        self.address: str = cast(bytes, self._router.getsockopt(zmq.LAST_ENDPOINT)).decode()  # pyzmq types every option as int | bytes; this one is bytes
        self._monitor = self._router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._wake_endpoint = f"inproc://tidal-store-wake-{next(_ids)}"
        self._wakes = self._ctx.socket(zmq.PULL)
        self._wakes.bind(self._wake_endpoint)
        self._waker = self._ctx.socket(zmq.PUSH)  # other threads' changes wake the loop
        self._waker.connect(self._wake_endpoint)
        self._waker_lock = threading.Lock()
        self._wake_pending = False
        self._closed = False
        self._lock = threading.RLock()  # the router socket and the parked requests; taken after the store's lock, never before
        self._local = threading.local()  # `retrying`: this thread is retrying parked requests already
        self._peers = Peers()
        self._parked: list[Parked] = []
        self._saving: set[tuple[Peer, int]] = set()
        """(peer, request id) of the remote saves in progress, each on a thread of its own."""
        self._poller = zmq.Poller()  # the server thread's; drop links to units watch their handshakes on it
        self._units = UnitLinks(self._ctx, token, max_message_bytes=max_message_bytes, poller=self._poller)
        self._listening = False  # for evictions, once cells on storage units are put
        self._ops: dict[str, Callable[..., Any]] = {"ping": self._ping}  # (peer, args) -> the result
        if store is not None:
            store.add_change_listener(self._on_change)
            self._ops.update(
                create_partition=lambda peer, a: store.create_partition(
                    a["name"], consumers=a["consumers"], capacity_rows=a.get("capacity_rows"), capacity_bytes=a.get("capacity_bytes"), lease_s=a.get("lease_s", 300.0), exist_ok=bool(a.get("exist_ok")),
                ),
                wait_partition=lambda peer, a: store.wait_partition(a["partition"], timeout=a.get("timeout")),
                add_consumer=lambda peer, a: store.add_consumer(a["partition"], a["consumer"]),
                set_version=lambda peer, a: store.set_version(a["version"]),
                version=lambda peer, a: store.version,
                put=self._put,
                get=lambda peer, a: get_reply(store, a, peer.holder),
                ack=lambda peer, a: store.ack(a["consumer"], a["partition"], as_indexes(a["indexes"])),
                release=lambda peer, a: store.release(a["consumer"], a.get("partition"), a.get("indexes")),
                metrics=lambda peer, a: store.metrics(),
                save=self._start_save,  # called with the request id too (`_handle`): the thread that saves replies
                withdraw=self._withdraw,
                parked=self._holds,
            )
        if unit is not None:
            self._ops.update(
                unit_write=lambda peer, a: unit.write(a["key"], decode_column("chunk", a["chunk"])),
                unit_read=self._unit_read,
                unit_drop=lambda peer, a: unit.drop(a["keys"]),
            )
        self._thread = threading.Thread(target=self._serve, name="tidal-store-server", daemon=True)
        self._thread.start()

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def serve_forever(self) -> None:
        """Block until the server is closed (`close()` from another thread, or a signal
        handler), or until Ctrl-C, which closes it. Requests are served on the server's own
        thread from construction on: this only keeps a script that does nothing else alive."""
        try:
            self._thread.join()
        finally:
            self.close()

    def close(self) -> None:
        """Stop serving; parked requests get no reply. Idempotent."""
        if not self._thread.is_alive():
            return
        with self._waker_lock:
            self._closed = True
            self._waker.send(_STOP)
        self._thread.join(timeout=10)
        if self.store is not None:  # a store that outlives its server no longer calls it
            self.store.remove_listener(self._on_change)
            self.store.remove_listener(self._units.on_free)
        if self.segments is not None:
            self.segments.unlink_all()  # no client can ask for them now; mappings stay valid
        self._waker.close(linger=0)
        self._ctx.destroy(linger=0)

    def save(self, path: str | os.PathLike[str], *, timeout_s: float = 60.0) -> None:
        """Save the store to `path` (`persist.save`), with the rows it keeps on storage
        units read from them (each unit must answer within `timeout_s`). The store's lock
        is held only while its state is copied: the units are read after (their chunks
        pinned, `SavedChunks`), so other threads' puts and gets go on meanwhile."""
        assert self.store is not None, "a server of a storage unit alone has no store to save"
        sockets: dict[str, zmq.Socket] = {}
        saved = SavedChunks(self._units)
        try:
            state = self.store.state_dict(read_chunk=saved.refer)
            saved.resolve(state, lambda chunk: self._read_chunk(chunk, sockets, timeout_s))
        finally:
            for sock in sockets.values():
                sock.close(linger=0)
            if saved.close():
                self._wake()  # the drops that waited for this save go out from the server thread
        persist.write(state, path)

    def _read_chunk(self, chunk: RemoteChunk, sockets: dict[str, zmq.Socket], timeout_s: float) -> Any:
        """Every row of `chunk`, from the unit that holds it (this server's own: in process)."""
        if self.unit is not None and chunk.unit == self.address:
            return self.unit.read(chunk.key, np.arange(len(chunk), dtype=np.int64))
        return self._units.read_chunk(chunk, sockets, timeout_s)

    def _on_change(self, partition: str | None) -> None:
        """Store listener (store lock held): a change made outside the server thread retries
        the parked requests here and now (those on the changed partition; every one after
        a change to the whole store); the server thread is woken only if something is left
        for it (requests still parked, whose timer may have moved; requests that arrived
        meanwhile; chunks to drop on storage units)."""
        if threading.current_thread() is self._thread or getattr(self._local, "retrying", False):
            return
        wake = False
        concerned = partition is None or any(p.args.get("partition") == partition for p in self._parked)
        if self._parked and concerned:  # stable: requests are parked only with the store lock held
            self._local.retrying = True
            try:
                with self._lock:
                    if self._closed:
                        return
                    self._retry_parked()
                    wake = bool(self._parked) or self._readable(self._router)  # our sends may have taken its signal
            except Exception:  # a failed reply must not fail the caller's put
                log.exception("store server: unexpected error while retrying parked requests")
                wake = True
            finally:
                self._local.retrying = False
        if wake or self._units.drops:
            self._wake()

    def _wake(self) -> None:
        if self._wake_pending:
            return
        with self._waker_lock:
            if self._closed:
                return
            self._wake_pending = True
            self._waker.send(_WAKE)

    # The loop ---------------------------------------------------------------------------
    def _serve(self) -> None:
        poller = self._poller
        router_fd = self._router.get(zmq.FD)  # other threads send on the router: wait on its fd, not in ZeroMQ
        poller.register(router_fd, zmq.POLLIN)
        for sock in (self._wakes, self._monitor, *([self._zap.socket] if self._zap else [])):
            poller.register(sock, zmq.POLLIN)
        more = False
        while True:
            events = dict(poller.poll(0 if more else self._timeout_ms()))
            if self._zap is not None and self._zap.socket in events:
                self._zap.answer()
            if self._monitor in events:
                self._drain_monitor()
            retry = not events and not more  # a deadline or lease expiry passed
            if self._wakes in events:
                while self._readable(self._wakes):
                    if self._wakes.recv() == _STOP:
                        with self._lock:
                            self._close_sockets()
                        return
                    self._wake_pending = False
                    retry = True
            more = True  # the fd only says "look": read until the socket says empty
            for _ in range(64):
                with self._lock:
                    if not self._readable(self._router):
                        more = False
                        break
                    frames = self._router.recv_multipart(copy=False)
                if self._readable(self._monitor):
                    self._drain_monitor()  # a disconnect that came first is handled first
                try:
                    retry |= self._handle(frames)
                except Exception:  # a bug answering one request must not stop the server
                    log.exception("store server: unexpected error while serving a request")
                    retry = True
                if retry and self._parked:  # after the change's own reply, before the next request
                    self._retry_parked()
                    retry = False
            if retry and self._parked:
                self._retry_parked()
            self._units.flush_drops()
            if not more:  # the replies just sent may have taken the fd's edge for a request that came meanwhile
                with self._lock:
                    more = self._readable(self._router)

    @staticmethod
    def _readable(sock: zmq.Socket) -> bool:
        return bool(cast(int, sock.get(zmq.EVENTS)) & _POLLIN)  # pyzmq types every option as int | bytes; EVENTS is an int

    def _timeout_ms(self) -> int:
        with self._lock:
            deadlines = [p.deadline for p in self._parked]
        if not deadlines:
            return -1
        expiry = self.store.next_lease_expiry() if self.store is not None else None
        if expiry is not None:
            deadlines.append(expiry)
        soonest = min(deadlines)
        return -1 if math.isinf(soonest) else max(0, math.ceil((soonest - time.monotonic()) * 1000))

    def _close_sockets(self) -> None:
        for sock in (self._router, self._wakes, self._monitor):
            sock.close(linger=0)
        if self._zap is not None:  # after the router: it took no peer unchecked
            self._zap.close()
        self._units.close()

    def _drain_monitor(self) -> None:
        while self._readable(self._monitor):
            event = zmq.utils.monitor.recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._disconnected(event["value"])

    def _disconnected(self, fd: int) -> None:
        peer = self._peers.disconnected(fd)
        if peer is None:
            return
        if self.segments is not None:
            self.segments.disconnected(peer.identity)  # segments it sent no longer go back to it
        with self._lock:
            self._parked = [p for p in self._parked if p.peer is not peer]
        released = 0
        if self.store is not None:
            released = self.store.release_holder(peer.holder)
            if released:
                self._retry_parked()
        log.info("store client %s disconnected; released %d leased rows", peer.identity.hex(), released)

    def _handle(self, frames: list[zmq.Frame]) -> bool:
        """Serve one request; True when it changed the store (or may have: it failed
        unforeseen). Whatever its bytes, it is answered, with its id when that could be
        read, unless its client is gone."""
        request_id = None
        try:
            peer = self._peers.of(frames)
            if peer is None:  # queued before its client disconnected: no one would take the reply or release its leases
                return False
            message = unpack(frames[1:], segments=self.segments, token=self.token, origin=peer.identity)
            peer.shm = self.host is not None and message.get("host") == self.host
            request_id = message.get("id") if isinstance(message.get("id"), int) else None
            op, request_id, args = check_request(message, self._ops)
            args.pop("waiting_since", None)  # set only by the server itself
            if op not in _ABOUT_A_REQUEST:  # sent while a get waits, whose answer it may not have read yet
                peer.sent = None
        except Exception as e:  # WireError, or a message nothing foresaw: either way it gets an answer
            if not isinstance(e, WireError):
                log.exception("store server: unexpected error while reading a request")
            self.num_malformed += 1
            if request_id is None:
                request_id = e.request_id if isinstance(e, WireError) and e.request_id is not None else request_id_of(frames[1:])
            self._reply_error(frames[0].bytes, request_id, type(e).__name__, f"malformed request: {e}")
            return False
        try:
            return self._serve_request(peer, request_id, op, args, message.get("token"))
        except Exception as e:  # as above: answered, and the server serves on
            log.exception("store server: unexpected error while serving request %s", request_id)
            self._fail(peer, request_id, e)
            return True

    def _serve_request(self, peer: Peer, request_id: int, op: str, args: dict[str, Any], token: Any) -> bool:
        """Serve a request that decoded; True when it changed the store."""
        if not token_ok(self.token, token):
            self._reply_error(peer, request_id, "Unauthorized", "missing or wrong store token")
            return False
        timeout = args.get("timeout")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0):  # NaN too
            self._reply_error(peer, request_id, "ValueError", f"timeout must be a number of seconds >= 0 or null, got {timeout!r}")
            return False
        if op in _BLOCKING and timeout != 0:
            assert self.store is not None  # only a store serves blocking ops
            with self.store.lock:  # trying and parking are one step for a thread retrying parked requests
                try:
                    self._answer(peer, request_id, op, self._ops[op](peer, {**args, "timeout": 0, **_QUIET.get(op, {})}), args)
                    return op in _MUTATING
                except StoreTimeout:
                    now = time.monotonic()
                    wait = math.inf if timeout is None else float(timeout)
                    # a get's ack is done by the first attempt (and may have freed room); a put's
                    # ack happens only with the put, so it stays for the retries
                    acked = op == "get" and args.pop("ack", None) is not None
                    with self._lock:
                        self._parked.append(Parked(peer, request_id, op, args, now, now + wait))
                    return acked
                except Exception as e:  # noqa: BLE001 - every request gets a reply; the server keeps serving
                    self._fail(peer, request_id, e)
                return op in _MUTATING
        if op == "save":
            self._start_save(peer, request_id, args)
            return False
        try:
            self._answer(peer, request_id, op, self._ops[op](peer, args), args)
        except Exception as e:  # noqa: BLE001 - as above
            self._fail(peer, request_id, e)
        return op in _MUTATING

    def _start_save(self, peer: Peer, request_id: int, a: dict[str, Any]) -> None:
        """A client's `save`, on a thread of its own that replies when the file is written:
        reading the storage units and writing a large store take long, and this thread
        keeps serving meanwhile (other clients' puts and gets, and the saving client's
        liveness checks, which `_holds` answers yes until the reply has gone)."""
        path = a.get("path")
        if not isinstance(path, str):
            self._reply_error(peer, request_id, "ValueError", f"save needs a path (a string), got {path!r}")
            return
        if self.persist_dir is None:
            self._reply_error(peer, request_id, "ValueError", (
                "this store server takes no save from its clients: start it with StoreServer(..., persist_dir=DIR) "
                "to let them save inside DIR, or save in its own process (StoreServer.save, persist.save)"
            ))
            return
        try:
            target = persist.path_inside(self.persist_dir, path)
        except (ValueError, OSError) as e:  # outside it, or no path at all (a NUL byte)
            self._reply_error(peer, request_id, "ValueError", str(e))
            return
        with self._lock:
            self._saving.add((peer, request_id))

        def save() -> None:
            try:
                self.save(target)
            except Exception as e:  # noqa: BLE001 - the client gets the error; the server keeps serving
                self._fail(peer, request_id, e)
            else:
                self._reply(peer, request_id, None)
            finally:
                with self._lock:  # after the reply: a liveness check answered "no" from here on is read after it
                    self._saving.discard((peer, request_id))

        threading.Thread(target=save, name="tidal-store-save", daemon=True).start()

    def _withdraw(self, peer: Peer, a: dict[str, Any]) -> bool:
        """Drop `peer`'s parked get or put `a["request"]` (its client stopped waiting: the
        wait was cancelled). True when it was still parked: it gets no reply and nothing was
        taken or put for it; False when it was not: its reply went out before this one
        (`_answer`), or this connection never sent it (a restarted server, a new connection)."""
        request_id = request_of(a)
        with self._lock:
            kept = [p for p in self._parked if not (p.peer is peer and p.request_id == request_id)]
            withdrawn, self._parked = len(kept) < len(self._parked), kept
        return withdrawn

    def _holds(self, peer: Peer, a: dict[str, Any]) -> bool:
        """Whether `peer`'s get or put `a["request"]` is parked here, or its save still runs
        (`_start_save`): a waiting client's liveness check. False means its reply went out
        before this one (`_answer`), or this server never got it through this connection (it
        restarted, or the connection broke, which drops a connection's parked requests): no
        reply is coming."""
        request_id = request_of(a)
        with self._lock:
            return (peer, request_id) in self._saving or any(p.peer is peer and p.request_id == request_id for p in self._parked)

    def _retry_parked(self) -> None:
        """Retry parked requests in arrival order; answer those that succeed or expire."""
        assert self.store is not None  # only a store parks requests
        with self.store.lock, self._lock:
            self._retry_parked_locked()

    def _retry_parked_locked(self) -> None:
        changed = True
        while changed and self._parked:  # a parked put that succeeds may satisfy a parked get
            changed, still = False, []
            failed: list[tuple[Parked, Exception]] = []
            now = time.monotonic()
            for parked in self._parked:
                try:
                    args = {**parked.args, "timeout": 0, "waiting_since": parked.since, **(_QUIET.get(parked.op, {}) if now < parked.deadline else {})}
                    result = self._ops[parked.op](parked.peer, args)
                except StoreTimeout as e:
                    if now >= parked.deadline:
                        failed.append((parked, StoreTimeout(str(e).replace("after 0s", f"after {parked.args.get('timeout')}s"))))
                    else:
                        still.append(parked)
                    continue
                except Exception as e:  # noqa: BLE001 - every request gets a reply
                    failed.append((parked, e.with_traceback(None)))
                    continue
                self._reply(parked.peer, parked.request_id, result, taken_by(parked.op, parked.args))
                changed |= parked.op in _MUTATING
            self._parked, args = still, {}  # drop the last request's arguments
            for parked, error in failed:  # once nothing here holds their rows: a put's shared memory is freed before its client hears
                parked.args = {}
                self._fail(parked.peer, parked.request_id, error)

    def _answer(self, peer: Peer, request_id: int, op: str, result: Any, args: dict[str, Any]) -> None:
        """Reply to a request served at once. A change is answered before the parked requests
        it may satisfy are retried (`_serve`): its producer waits for this reply."""
        self._reply(peer, request_id, result, taken_by(op, args))

    def _reply(self, peer: Peer, request_id: int, result: Any, taken: tuple[str, str] | None = None) -> None:
        """Send `result`. `taken`: the (consumer, partition) a get's rows were leased to,
        given back if the reply cannot be encoded (no one would ever ack them)."""
        try:
            frames = [peer.identity, *pack({"id": request_id, "ok": True, "result": result}, owned=self.segments if peer.shm else None)]
        except Exception as e:  # a result that cannot be sent is that request's error, never the server's end
            log.exception("store server: the reply to request %s could not be encoded", request_id)
            if taken is not None:
                assert self.store is not None  # only a store serves gets
                self.store.release(*taken, indexes=result["indexes"])
                if isinstance(e, CodecError):  # say which column and row: a value an in-process put kept
                    rows = list(result["indexes"])
                    e = name_failure(e, (cell for name, column in result["columns"].items() for cell in cells_of(f"column {name!r}", next(iter(column.values())), rows)))
            self._fail(peer, request_id, e)
            return
        with self._lock:
            if not self._closed:
                self._router.send_multipart(frames, copy=False)
        if peer.shm and taken is not None:
            peer.sent = result

    def _fail(self, peer: Peer, request_id: int | None, error: Exception) -> None:
        self.num_errors += 1
        self._reply_error(peer, request_id, type(error).__name__, str(error))

    def _reply_error(self, to: Peer | bytes, request_id: int | None, kind: str, message: str) -> None:
        """Send an error reply `to` a peer (or a routing identity: a connection not served)."""
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")  # a lone surrogate (an OS path's) is no msgpack string
        frames = [to if isinstance(to, bytes) else to.identity, *pack({"id": request_id, "ok": False, "error": kind, "message": message})]
        with self._lock:
            if not self._closed:
                self._router.send_multipart(frames)

    # Store ops --------------------------------------------------------------------------
    def _ping(self, peer: Peer, args: dict[str, Any]) -> dict[str, Any]:
        return {"store": self.store is not None, "unit": self.unit is not None, "host": self.host}

    def _put(self, peer: Peer, a: dict[str, Any]) -> range | list[int]:
        assert self.store is not None
        columns = dict(a.get("columns") or {})
        for name, descriptor in (a.get("remote") or {}).items():
            columns[name] = RemoteChunk.from_wire(descriptor)
            if not self._listening:
                self.store.add_free_listener(self._units.on_free)
                self._listening = True
        ack = a.get("ack")
        if ack is not None and not (isinstance(ack, dict) and isinstance(ack.get("consumer"), str) and isinstance(ack.get("partition"), str)):
            raise ValueError("put's ack must be a map with consumer, partition and indexes")
        then_ack = None if ack is None else (ack["consumer"], ack["partition"], as_indexes(ack.get("indexes", [])))
        return self.store.put(
            a["partition"],
            columns,
            a.get("indexes"),
            groups=a.get("groups"),
            versions=a.get("versions"),
            tags=a.get("tags"),
            timeout=a.get("timeout"),
            ack=then_ack,
            as_range=True,
            num_rows=a.get("num_rows"),
        )

    # Storage-unit ops ---------------------------------------------------------------------
    def _unit_read(self, peer: Peer, a: dict[str, Any]) -> dict[str, Any]:
        assert self.unit is not None
        rows = self.unit.read(a["key"], a["offsets"])
        return {"stacked": rows} if not isinstance(rows, list) else encode_column(rows)
