"""Serve a store (controller) and/or a storage unit over ZeroMQ.

One thread owns the socket and the store calls: each request is served at once, without
waiting. A `get` with too few ready rows, or a `put` into a full partition, is
parked; parked requests are retried, in arrival order, right after anything that can
satisfy them (a put, an ack, a release, a version change, a lease expiry, a change made
by another thread of this process) and answered the moment they succeed, in the same
thread - no polling, no sleeps, no hand-off between threads. The loop's only timer is
the earliest parked deadline or lease expiry.

A client's connection dying (its process killed mid-`get`, say) is seen through the
socket's monitor: the rows leased through that connection are released for redelivery
and its parked requests are dropped, so a consumer that dies loses nothing.

Every request is answered: a malformed frame, an unknown op, a bad token or a failing
call gets an error reply and the server keeps serving. Servers bind 127.0.0.1 unless
told otherwise, and refuse to bind anything reachable from other machines without a
shared token.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq
import zmq.utils.monitor

from tidal.flow.store import persist
from tidal.flow.store.samplers import NO_VERSION, from_spec
from tidal.flow.store.cells import Batch
from tidal.flow.store.table import Store, StoreTimeout
from tidal.flow.store.units import RemoteChunk, StorageUnit
from tidal.flow.store.wire import WireError, check_bind, check_request, decode_column, encode_batch_column, encode_column, pack, token_ok, unpack

log = logging.getLogger(__name__)
_ids = itertools.count()
_BLOCKING = ("get", "put")
_MUTATING = frozenset({"get", "put", "ack", "release", "set_version", "create_partition", "add_consumer"})  # get: its acks and drops free room
_WAKE, _STOP = b"w", b"s"


class _Peer:
    """One client connection: what it holds leased."""

    def __init__(self, identity: bytes, fd: int) -> None:
        self.identity = identity
        self.fd = fd
        self.alive = True
        self.leases: dict[tuple[str, str], set[int]] = {}


@dataclasses.dataclass
class _Parked:
    peer: _Peer
    request_id: int
    op: str
    args: dict[str, Any]
    since: float
    deadline: float


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
        self._wake_endpoint = f"inproc://tidal-store-wake-{next(_ids)}"
        self._wakes = self._ctx.socket(zmq.PULL)
        self._wakes.bind(self._wake_endpoint)
        self._waker = self._ctx.socket(zmq.PUSH)  # other threads' changes wake the loop
        self._waker.connect(self._wake_endpoint)
        self._waker_lock = threading.Lock()
        self._wake_pending = False
        self._closed = False
        self._peers: dict[bytes, _Peer] = {}
        self._by_fd: dict[int, _Peer] = {}
        self._parked: list[_Parked] = []
        self._drops: collections.deque[tuple[str, str]] = collections.deque()  # (unit, chunk key)
        self._unit_sockets: dict[str, zmq.Socket] = {}
        self._listening = False  # for evictions, once cells on storage units are put
        self._ops: dict[str, Callable[[_Peer, dict[str, Any]], Any]] = {"ping": self._ping}
        if store is not None:
            store.add_change_listener(self._on_change)
            self._ops.update(
                create_partition=self._create_partition,
                add_consumer=self._add_consumer,
                set_version=lambda peer, a: store.set_version(a["version"]),
                version=lambda peer, a: store.version,
                put=self._put,
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
        """Stop serving; parked requests get no reply. Idempotent."""
        if not self._thread.is_alive():
            return
        with self._waker_lock:
            self._closed = True
            self._waker.send(_STOP)
        self._thread.join(timeout=10)
        self._waker.close(linger=0)
        self._ctx.destroy(linger=0)

    def _on_change(self) -> None:
        """Store listener: a change made outside the loop thread wakes the loop."""
        if threading.current_thread() is self._thread or self._wake_pending:
            return
        with self._waker_lock:
            if self._closed:
                return
            self._wake_pending = True
            self._waker.send(_WAKE)

    # The loop ---------------------------------------------------------------------------
    def _serve(self) -> None:
        poller = zmq.Poller()
        for sock in (self._router, self._wakes, self._monitor):
            poller.register(sock, zmq.POLLIN)
        while True:
            events = dict(poller.poll(self._timeout_ms()))
            if self._monitor in events:
                self._drain_monitor()
            retry = not events  # a deadline or lease expiry passed
            if self._wakes in events:
                while self._readable(self._wakes):
                    if self._wakes.recv() == _STOP:
                        self._close_sockets()
                        return
                    self._wake_pending = False
                    retry = True
            if self._router in events:
                for _ in range(64):
                    if not self._readable(self._router):
                        break
                    frames = self._router.recv_multipart(copy=False)
                    if self._readable(self._monitor):
                        self._drain_monitor()  # a disconnect that came first is handled first
                    try:
                        retry |= self._handle(frames)
                    except Exception:  # noqa: BLE001 - a bug answering one request must not stop the server
                        log.exception("store server: unexpected error while serving a request")
                        retry = True
            if retry and self._parked:
                self._retry_parked()
            self._flush_drops()

    @staticmethod
    def _readable(sock: zmq.Socket) -> bool:
        return bool(sock.get(zmq.EVENTS) & zmq.POLLIN)

    def _timeout_ms(self) -> int:
        if not self._parked:
            return -1
        deadlines = [p.deadline for p in self._parked]
        expiry = self.store.next_lease_expiry() if self.store is not None else None
        if expiry is not None:
            deadlines.append(expiry)
        soonest = min(deadlines)
        return -1 if math.isinf(soonest) else max(0, math.ceil((soonest - time.monotonic()) * 1000))

    def _close_sockets(self) -> None:
        for sock in (self._router, self._wakes, self._monitor, *self._unit_sockets.values()):
            sock.close(linger=0)

    def _drain_monitor(self) -> None:
        while self._readable(self._monitor):
            event = zmq.utils.monitor.recv_monitor_message(self._monitor)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._disconnected(event["value"])

    def _disconnected(self, fd: int) -> None:
        peer = self._by_fd.pop(fd, None)
        if peer is None:
            return
        if self._peers.get(peer.identity) is peer:
            del self._peers[peer.identity]
        peer.alive = False
        self._parked = [p for p in self._parked if p.peer is not peer]
        leases, peer.leases = peer.leases, {}
        if self.store is not None:
            for (consumer, partition), indexes in leases.items():
                self.store.release(consumer, partition, indexes)
            if leases:
                self._retry_parked()
        log.info("store client %s disconnected; released %d leased rows", peer.identity.hex(), sum(map(len, leases.values())))

    def _handle(self, frames: list[zmq.Frame]) -> bool:
        """Serve one request; True when it changed the store."""
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
            args.pop("waiting_since", None)  # set only by the server itself
        except WireError as e:
            self.num_malformed += 1
            self._reply_error(peer, request_id, "WireError", f"malformed request: {e}")
            return False
        if not token_ok(self.token, message.get("token")):
            self._reply_error(peer, request_id, "Unauthorized", "missing or wrong store token")
            return False
        timeout = args.get("timeout")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0):
            self._reply_error(peer, request_id, "ValueError", f"timeout must be a number of seconds >= 0 or null, got {timeout!r}")
            return False
        if op in _BLOCKING and timeout != 0:
            try:
                self._reply(peer, request_id, self._ops[op](peer, {**args, "timeout": 0}))
                return op in _MUTATING
            except StoreTimeout:
                now = time.monotonic()
                wait = math.inf if timeout is None else float(timeout)
                # a get's ack is done by the first attempt (and may have freed room); a put's
                # ack happens only with the put, so it stays for the retries
                acked = op == "get" and args.pop("ack", None) is not None
                self._parked.append(_Parked(peer, request_id, op, args, now, now + wait))
                return acked
            except Exception as e:  # noqa: BLE001 - every request gets a reply; the server keeps serving
                self._fail(peer, request_id, e)
            return op in _MUTATING
        try:
            self._reply(peer, request_id, self._ops[op](peer, args))
        except Exception as e:  # noqa: BLE001 - as above
            self._fail(peer, request_id, e)
        return op in _MUTATING

    def _retry_parked(self) -> None:
        """Retry parked requests in arrival order; answer those that succeed or expire."""
        changed = True
        while changed and self._parked:  # a parked put that succeeds may satisfy a parked get
            changed, still = False, []
            now = time.monotonic()
            for parked in self._parked:
                try:
                    args = {**parked.args, "timeout": 0, "waiting_since": parked.since}
                    result = self._ops[parked.op](parked.peer, args)
                except StoreTimeout as e:
                    if now >= parked.deadline:
                        self._fail(parked.peer, parked.request_id, StoreTimeout(str(e).replace("after 0s", f"after {parked.args.get('timeout')}s")))
                    else:
                        still.append(parked)
                    continue
                except Exception as e:  # noqa: BLE001 - every request gets a reply
                    self._fail(parked.peer, parked.request_id, e)
                    continue
                self._reply(parked.peer, parked.request_id, result)
                changed |= parked.op in _MUTATING
            self._parked = still

    def _reply(self, peer: _Peer, request_id: int, result: Any) -> None:
        self._router.send_multipart([peer.identity, *pack({"id": request_id, "ok": True, "result": result})], copy=False)

    def _fail(self, peer: _Peer, request_id: int | None, error: Exception) -> None:
        self.num_errors += 1
        self._reply_error(peer, request_id, type(error).__name__, str(error))

    def _reply_error(self, peer: _Peer, request_id: int | None, kind: str, message: str) -> None:
        self._router.send_multipart([peer.identity, *pack({"id": request_id, "ok": False, "error": kind, "message": message})])

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
        columns = dict(a.get("columns") or {})
        for name, descriptor in (a.get("remote") or {}).items():
            columns[name] = RemoteChunk.from_wire(descriptor)
            if not self._listening:
                self.store.add_free_listener(self._on_free)
                self._listening = True
        ack = a.get("ack")
        if ack is not None and not (isinstance(ack, dict) and isinstance(ack.get("consumer"), str) and isinstance(ack.get("partition"), str)):
            raise ValueError("put's ack must be a map with consumer, partition and indexes")
        then_ack = None if ack is None else (ack["consumer"], ack["partition"], np.asarray(ack.get("indexes", []), dtype=np.int64))
        indexes = self.store.put(
            a["partition"],
            columns,
            a.get("indexes"),
            groups=a.get("groups"),
            versions=a.get("versions"),
            tags=a.get("tags"),
            timeout=a.get("timeout"),
            ack=then_ack,
        )
        if then_ack is not None:
            held = peer.leases.get((then_ack[0], then_ack[1]))
            if held:
                held.difference_update(then_ack[2].tolist())
        return indexes

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
            waiting_since=a.get("waiting_since"),
            ack=None if a.get("ack") is None else np.asarray(a["ack"], dtype=np.int64),
        )
        if a.get("ack") is not None:
            held = peer.leases.get((a["consumer"], a["partition"]))
            if held:
                held.difference_update(np.asarray(a["ack"]).tolist())
        peer.leases.setdefault((a["consumer"], a["partition"]), set()).update(batch.indexes)
        return {
            "indexes": np.asarray(batch.indexes, dtype=np.int64),
            "groups": None if all(g is None for g in batch.groups) else batch.groups,
            "versions": np.asarray([NO_VERSION if v is None else v for v in batch.versions], dtype=np.int64),
            "columns": {name: encode_batch_column(batch, name) for name in batch.columns},
        }

    def _ack(self, peer: _Peer, a: dict[str, Any]) -> int:
        assert self.store is not None
        indexes = np.asarray(a["indexes"], dtype=np.int64)
        newly = self.store.ack(a["consumer"], a["partition"], indexes)
        held = peer.leases.get((a["consumer"], a["partition"]))
        if held:
            held.difference_update(indexes.tolist())
        return newly

    # Storage-unit ops ---------------------------------------------------------------------
    def _unit_write(self, peer: _Peer, a: dict[str, Any]) -> None:
        assert self.unit is not None
        self.unit.write(a["key"], decode_column("chunk", a["chunk"]))

    def _unit_read(self, peer: _Peer, a: dict[str, Any]) -> dict[str, Any]:
        assert self.unit is not None
        rows = self.unit.read(a["key"], a["offsets"])
        return {"stacked": rows} if not isinstance(rows, list) else encode_column(rows)

    def _unit_drop(self, peer: _Peer, a: dict[str, Any]) -> int:
        assert self.unit is not None
        return self.unit.drop(a["keys"])

    # Chunks the controller let go of, on storage units ------------------------------------
    def _on_free(self, partition: str, chunk: Any) -> None:
        if isinstance(chunk, RemoteChunk):
            self._drops.append((chunk.unit, chunk.key))

    def _flush_drops(self) -> None:
        if not self._drops:
            return
        batches: dict[str, list[str]] = {}
        while self._drops:
            unit, key = self._drops.popleft()
            batches.setdefault(unit, []).append(key)
        for unit, keys in batches.items():
            sock = self._unit_sockets.get(unit)
            if sock is None:
                sock = self._unit_sockets[unit] = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(unit)
            while sock.poll(0):  # replies to earlier drops carry nothing we need
                sock.recv_multipart()
            sock.send_multipart(pack({"op": "unit_drop", "id": 0, "token": self.token, "args": {"keys": keys}}))
