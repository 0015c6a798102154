"""Serve a store (controller) and/or a storage unit over ZeroMQ.

One thread owns the ROUTER socket. Each request is first served inline without waiting;
a `get` with too few ready rows, or a `put`/`reserve` into a full partition, moves to a
worker thread that waits on the store's condition variable (no polling) and sends its
reply back through an in-process socket. Workers are reused and only created when every
existing one is busy waiting.

A client's connection dying (its process killed mid-`get`, say) is seen through the
socket's monitor: the rows leased through that connection are released for redelivery
and its waiting requests are cancelled, so a consumer that dies loses nothing.

Every request is answered: a malformed frame, an unknown op, a bad token or a failing
call gets an error reply and the server keeps serving. Servers bind 127.0.0.1 unless
told otherwise, and refuse to bind anything reachable from other machines without a
shared token.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import zmq
import zmq.utils.monitor

from tidal.flow.store import persist
from tidal.flow.store.samplers import from_spec
from tidal.flow.store.table import Batch, Store, StoreTimeout
from tidal.flow.store.units import Ref, StorageUnit
from tidal.flow.store.wire import WireError, check_bind, check_request, decode_column, encode_column, pack, token_ok, unpack

log = logging.getLogger(__name__)
_ids = itertools.count()
_BLOCKING = ("get", "put", "reserve")


class _Peer:
    """One client connection: what it holds leased and which of its requests are waiting."""

    def __init__(self, identity: bytes, fd: int) -> None:
        self.identity = identity
        self.fd = fd
        self.alive = True
        self.leases: dict[tuple[str, str], set[int]] = {}
        self.waiting: set[threading.Event] = set()


class _Workers:
    """Threads for requests that must wait; grows only when every worker is busy."""

    def __init__(self, ctx: zmq.Context, endpoint: str) -> None:
        self._ctx, self._endpoint = ctx, endpoint
        self._tasks: queue.SimpleQueue[Callable[[zmq.Socket], None] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._threads: list[threading.Thread] = []

    def submit(self, task: Callable[[zmq.Socket], None]) -> None:
        with self._lock:
            if self._idle:
                self._idle -= 1
            else:
                thread = threading.Thread(target=self._run, name=f"tidal-store-worker-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
        self._tasks.put(task)

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.PUSH)
        sock.connect(self._endpoint)
        try:
            while (task := self._tasks.get()) is not None:
                task(sock)
                with self._lock:
                    self._idle += 1
        finally:
            sock.close(linger=0)

    def stop(self) -> None:
        for _ in self._threads:
            self._tasks.put(None)
        for thread in self._threads:
            thread.join(timeout=5)


class StoreServer:
    """Serve `store` (a `Store`, typically the controller) and/or `unit` at `address`.

    `address` is a ZeroMQ endpoint; port 0 picks a free port (read `server.address`).
    Binding anything but loopback requires `token`, which every request must carry.
    """

    def __init__(
        self,
        store: Store | None = None,
        *,
        unit: StorageUnit | None = None,
        address: str = "tcp://127.0.0.1:0",
        token: str | None = None,
    ) -> None:
        if store is None and unit is None:
            raise ValueError("StoreServer needs a store, a storage unit, or both")
        check_bind(address, token)
        self.store, self.unit, self.token = store, unit, token
        self.num_malformed = 0
        self.num_errors = 0
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.bind(address[:-2] + ":*" if address.endswith(":0") else address)
        self.address: str = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._monitor = self._router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._replies_endpoint = f"inproc://tidal-store-replies-{next(_ids)}"
        self._replies = self._ctx.socket(zmq.PULL)
        self._replies.bind(self._replies_endpoint)
        self._workers = _Workers(self._ctx, self._replies_endpoint)
        self._lock = threading.Lock()  # guards _Peer.leases / waiting / alive
        self._peers: dict[bytes, _Peer] = {}
        self._by_fd: dict[int, _Peer] = {}
        self._drops: collections.deque[tuple[str, str, int]] = collections.deque()
        self._unit_sockets: dict[str, zmq.Socket] = {}
        self._ops: dict[str, Callable[[_Peer, dict[str, Any]], Any]] = {"ping": self._ping}
        if store is not None:
            store.add_evict_listener(self._on_evict)
            self._ops.update(
                create_partition=self._create_partition,
                add_consumer=self._add_consumer,
                set_version=lambda peer, a: store.set_version(a["version"]),
                version=lambda peer, a: store.version,
                put=self._put,
                reserve=self._reserve,
                get=self._get,
                ack=self._ack,
                release=lambda peer, a: store.release(a["consumer"], a.get("partition"), a.get("indexes")),
                metrics=lambda peer, a: store.metrics(),
                save=lambda peer, a: persist.save(store, a["path"]),
            )
        if unit is not None:
            self._ops.update(unit_write=self._unit_write, unit_read=self._unit_read, unit_drop=self._unit_drop)
        self._thread = threading.Thread(target=self._serve, name="tidal-store-server", daemon=True)
        self._thread.start()

    def __enter__(self) -> StoreServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop serving; waiting requests are cancelled. Idempotent."""
        if not self._thread.is_alive():
            return
        with self._lock:
            for peer in self._peers.values():
                for event in peer.waiting:
                    event.set()
        if self.store is not None:
            self.store.wake()
        stop = self._ctx.socket(zmq.PUSH)
        stop.connect(self._replies_endpoint)
        stop.send(b"")
        stop.close(linger=1000)
        self._thread.join(timeout=10)
        self._workers.stop()
        self._ctx.destroy(linger=0)

    # The loop ---------------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        for sock in (self._router, self._replies, self._monitor):
            poller.register(sock, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            self._drain_monitor()
            if self._replies in events:
                while True:
                    try:
                        frames = self._replies.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    if len(frames) == 1 and not frames[0].bytes:
                        self._close_sockets()
                        return
                    self._router.send_multipart(frames, copy=False)
            if self._router in events:
                for _ in range(64):
                    try:
                        frames = self._router.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._drain_monitor()  # a disconnect that came first is handled first
                    self._handle(frames)
            self._flush_drops()

    def _close_sockets(self) -> None:
        for sock in (self._router, self._replies, self._monitor, *self._unit_sockets.values()):
            sock.close(linger=0)

    def _drain_monitor(self) -> None:
        while True:
            try:
                event = zmq.utils.monitor.recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._disconnected(event["value"])

    def _disconnected(self, fd: int) -> None:
        peer = self._by_fd.pop(fd, None)
        if peer is None:
            return
        if self._peers.get(peer.identity) is peer:
            del self._peers[peer.identity]
        with self._lock:
            peer.alive = False
            leases, peer.leases = peer.leases, {}
            for event in peer.waiting:
                event.set()
        if self.store is not None:
            for (consumer, partition), indexes in leases.items():
                self.store.release(consumer, partition, indexes)
            self.store.wake()
        log.info("store client %s disconnected; released %d leased rows", peer.identity.hex(), sum(map(len, leases.values())))

    def _handle(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
        fd = frames[-1].get(zmq.SRCFD)
        peer = self._peers.get(identity)
        if peer is None or peer.fd != fd:
            peer = self._peers[identity] = self._by_fd[fd] = _Peer(identity, fd)
        request_id = None
        try:
            message = unpack(frames[1:])
            request_id = message.get("id") if isinstance(message.get("id"), int) else None
            op, request_id, args = check_request(message, self._ops)
            args.pop("cancel", None)  # set only by the server itself
        except WireError as e:
            self.num_malformed += 1
            self._reply_error(identity, request_id, "WireError", f"malformed request: {e}")
            return
        if not token_ok(self.token, message.get("token")):
            self._reply_error(identity, request_id, "Unauthorized", "missing or wrong store token")
            return
        try:
            if op in _BLOCKING and args.get("timeout") != 0:
                try:
                    result = self._ops[op](peer, {**args, "timeout": 0})
                except StoreTimeout:
                    self._wait_in_worker(peer, request_id, op, args)
                    return
            else:
                result = self._ops[op](peer, args)
        except Exception as e:  # noqa: BLE001 - every request gets a reply; the server keeps serving
            self.num_errors += 1
            self._reply_error(identity, request_id, type(e).__name__, str(e))
            return
        self._router.send_multipart([identity, *pack({"id": request_id, "ok": True, "result": result})], copy=False)

    def _reply_error(self, identity: bytes, request_id: int | None, kind: str, message: str) -> None:
        self._router.send_multipart([identity, *pack({"id": request_id, "ok": False, "error": kind, "message": message})])

    def _wait_in_worker(self, peer: _Peer, request_id: int, op: str, args: dict[str, Any]) -> None:
        cancel = threading.Event()
        with self._lock:
            peer.waiting.add(cancel)

        def task(sock: zmq.Socket) -> None:
            try:
                result = self._ops[op](peer, {**args, "cancel": cancel})
                frames = pack({"id": request_id, "ok": True, "result": result})
            except Exception as e:  # noqa: BLE001 - reported to the client
                frames = pack({"id": request_id, "ok": False, "error": type(e).__name__, "message": str(e)})
            with self._lock:
                peer.waiting.discard(cancel)
                alive = peer.alive
            if alive:
                sock.send_multipart([peer.identity, *frames], copy=False)

        self._workers.submit(task)

    # Store ops --------------------------------------------------------------------------
    def _ping(self, peer: _Peer, args: dict[str, Any]) -> dict[str, Any]:
        return {"store": self.store is not None, "unit": self.unit is not None}

    def _create_partition(self, peer: _Peer, a: dict[str, Any]) -> None:
        assert self.store is not None
        self.store.create_partition(
            a["name"],
            consumers=a["consumers"],
            capacity_rows=a.get("capacity_rows"),
            capacity_bytes=a.get("capacity_bytes"),
            lease_s=a.get("lease_s", 300.0),
        )

    def _add_consumer(self, peer: _Peer, a: dict[str, Any]) -> None:
        assert self.store is not None
        self.store.add_consumer(a["partition"], a["consumer"])

    def _put(self, peer: _Peer, a: dict[str, Any]) -> list[int]:
        assert self.store is not None
        if "refs" in a:
            columns: dict[str, Any] = {name: [Ref.from_wire(r) for r in refs] for name, refs in a["refs"].items()}
        else:
            columns = a["columns"]
        return self.store.put(
            a["partition"],
            columns,
            a.get("indexes"),
            groups=a.get("groups"),
            versions=a.get("versions"),
            tags=a.get("tags"),
            timeout=a.get("timeout"),
        )

    def _reserve(self, peer: _Peer, a: dict[str, Any]) -> list[int]:
        assert self.store is not None
        return self.store.reserve(
            a["partition"],
            a["num_rows"],
            nbytes=a.get("nbytes", 0),
            groups=a.get("groups"),
            versions=a.get("versions"),
            tags=a.get("tags"),
            timeout=a.get("timeout"),
        )

    def _get(self, peer: _Peer, a: dict[str, Any]) -> dict[str, Any]:
        assert self.store is not None
        batch: Batch = self.store.get(
            a["consumer"],
            a["partition"],
            a["columns"],
            a["batch_size"],
            sampler=from_spec(a.get("sampler", {"kind": "sequential"})),
            timeout=a.get("timeout"),
            partial=bool(a.get("partial", False)),
            cancel=a.get("cancel"),
        )
        key = (a["consumer"], a["partition"])
        with self._lock:
            if peer.alive:
                peer.leases.setdefault(key, set()).update(batch.indexes)
        if not peer.alive:  # it died while this get was being served
            self.store.release(a["consumer"], a["partition"], batch.indexes)
        return {
            "indexes": batch.indexes,
            "groups": batch.groups,
            "versions": batch.versions,
            "columns": {name: encode_column(cells) for name, cells in batch.columns.items()},
        }

    def _ack(self, peer: _Peer, a: dict[str, Any]) -> int:
        assert self.store is not None
        newly = self.store.ack(a["consumer"], a["partition"], a["indexes"])
        with self._lock:
            held = peer.leases.get((a["consumer"], a["partition"]))
            if held:
                held.difference_update(a["indexes"])
        return newly

    # Storage-unit ops ---------------------------------------------------------------------
    def _unit_write(self, peer: _Peer, a: dict[str, Any]) -> None:
        assert self.unit is not None
        columns = {name: decode_column(name, value) for name, value in a["columns"].items()}
        self.unit.write(a["partition"], a["indexes"], columns)

    def _unit_read(self, peer: _Peer, a: dict[str, Any]) -> dict[str, Any]:
        assert self.unit is not None
        cells = self.unit.read(a["partition"], a["wanted"])
        return {name: encode_column(values) for name, values in cells.items()}

    def _unit_drop(self, peer: _Peer, a: dict[str, Any]) -> int:
        assert self.unit is not None
        return self.unit.drop(a["partition"], a["indexes"])

    # Evictions on a controller whose cells live on storage units --------------------------
    def _on_evict(self, partition: str, index: int, cells: dict[str, Any]) -> None:
        for unit in {c.unit for c in cells.values() if isinstance(c, Ref)}:
            self._drops.append((unit, partition, index))

    def _flush_drops(self) -> None:
        if not self._drops:
            return
        batches: dict[tuple[str, str], list[int]] = {}
        while self._drops:
            unit, partition, index = self._drops.popleft()
            batches.setdefault((unit, partition), []).append(index)
        for (unit, partition), indexes in batches.items():
            sock = self._unit_sockets.get(unit)
            if sock is None:
                sock = self._unit_sockets[unit] = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(unit)
            while sock.poll(0):  # replies to earlier drops carry nothing we need
                sock.recv_multipart()
            args = {"partition": partition, "indexes": indexes}
            sock.send_multipart(pack({"op": "unit_drop", "id": 0, "token": self.token, "args": args}))
