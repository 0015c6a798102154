"""The store server answers every request, whatever its bytes, and bounds what a peer can
make it buffer: headers nested too deeply, peers speaking ZeroMQ's old framings, errors
nobody foresaw, random and mutated frames, and frames over `max_message_bytes`."""

from __future__ import annotations

import random
import socket
import time
import urllib.parse

import msgpack
import psutil
import pytest
import torch
import zmq

from tidal.flow.store import RemoteStore, StorageUnit, Store, StoreServer
from tidal.flow.store.codec import MAX_DEPTH
from tidal.flow.store.wire import pack

REPLY_WAIT_S = 10.0


@pytest.fixture(scope="module")
def raw():
    """A store and unit server, and a raw DEALER to it: (server, socket)."""
    store = Store()
    store.create_partition("train", consumers=["c"])
    with StoreServer(store, unit=StorageUnit()) as server:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.address)
        yield server, sock
        sock.close(linger=0)
        ctx.term()


def _call(sock: zmq.Socket, frames: list[bytes]) -> dict:
    sock.send_multipart(frames)
    assert sock.poll(int(REPLY_WAIT_S * 1000)), f"no reply to {frames[0][:40]!r}... within {REPLY_WAIT_S}s"
    reply = msgpack.unpackb(sock.recv_multipart()[0], raw=False, strict_map_key=False)
    assert isinstance(reply, dict) and isinstance(reply.get("ok"), bool), reply
    return reply


def _serves(sock: zmq.Socket) -> None:
    ping = _call(sock, [msgpack.packb({"op": "ping", "id": 99, "args": {}})])
    assert ping["ok"] and ping["id"] == 99 and ping["result"]["store"] is True


def _deep(depth: int, *, maps: bool = False, request_id: int | None = 5) -> bytes:
    """A ping whose args hold a value nested `depth` levels (hand-made: msgpack packs 511 at most)."""
    value = (b"\x81\xa1k" if maps else b"\x91") * depth + b"\xc0"
    head = b"\x83" + msgpack.packb("op") + msgpack.packb("ping") + msgpack.packb("id") + msgpack.packb(request_id)
    return head + msgpack.packb("args") + b"\x81" + msgpack.packb("x") + value


@pytest.mark.parametrize("depth", [MAX_DEPTH, 500, 600, 1000, 5000])
@pytest.mark.parametrize("maps", [False, True], ids=["lists", "maps"])
def test_a_header_nested_too_deeply_gets_an_error_reply_with_its_id(raw, depth, maps):
    """RecursionError in the codec was caught by no handler: the request was only logged,
    and its client waited its whole rpc_timeout_s."""
    server, sock = raw
    reply = _call(sock, [_deep(depth, maps=maps)])
    assert not reply["ok"] and reply["error"] == "WireError"
    if depth < 1000:  # msgpack itself refuses past ~1000 levels: no id can be read then
        assert reply["id"] == 5 and f"MAX_DEPTH={MAX_DEPTH}" in reply["message"]
    _serves(sock)


def test_an_error_nobody_foresaw_while_reading_a_request_is_answered(raw, monkeypatch):
    import tidal.flow.store.server as server_module

    server, sock = raw
    monkeypatch.setattr(server_module, "check_request", lambda message, ops: (_ for _ in ()).throw(RuntimeError("a bug")))
    reply = _call(sock, [msgpack.packb({"op": "ping", "id": 12, "args": {}})])
    assert not reply["ok"] and reply["id"] == 12 and reply["error"] == "RuntimeError" and "a bug" in reply["message"]
    monkeypatch.undo()
    _serves(sock)


# Peers of ZeroMQ 2 and 3 (ZMTP 1.0, 2.0): ZeroMQ gives their frames no source descriptor --------
def _old_peer(address: str, version: int) -> socket.socket:
    parsed = urllib.parse.urlsplit(address)
    peer = socket.create_connection((parsed.hostname, parsed.port), timeout=REPLY_WAIT_S)
    # ZMTP 1.0: an empty identity; 2.0: the signature, revision 1, DEALER, an empty identity
    peer.sendall(b"\x01\x00" if version == 1 else b"\xff" + bytes(8) + b"\x7f\x01\x05\x00\x00")
    return peer


def _old_frames(version: int, frames: list[bytes]) -> bytes:
    out = b""
    for k, frame in enumerate(frames):
        more = int(k < len(frames) - 1)
        if version == 1:  # length (with the flags byte), flags, body
            n = len(frame) + 1
            out += (bytes([n]) if n < 255 else b"\xff" + n.to_bytes(8, "big")) + bytes([more]) + frame
        else:  # flags (2: a long length), length, body
            long = len(frame) > 255
            out += bytes([more | (2 if long else 0)]) + (len(frame).to_bytes(8, "big") if long else bytes([len(frame)])) + frame
    return out


class _OldReader:
    """The messages a server sends an old peer, parsed from its byte stream."""

    def __init__(self, peer: socket.socket, version: int) -> None:
        self.peer, self.version, self.data, self.closed = peer, version, b"", False
        self.skip = 10 if version == 1 else 14  # the server's greeting (and for 2.0 its empty identity)

    def next(self) -> list[bytes] | None:
        """The next whole message; None once the server closed the connection."""
        deadline = time.monotonic() + REPLY_WAIT_S
        while True:
            message = self._parse()
            if message is not None:
                return message
            if self.closed:
                return None
            self.peer.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                chunk = self.peer.recv(1 << 16)
            except ConnectionResetError:
                chunk = b""
            except TimeoutError:
                raise AssertionError(f"the server neither answered nor closed the connection within {REPLY_WAIT_S}s") from None
            self.closed = not chunk
            self.data += chunk

    def _parse(self) -> list[bytes] | None:
        i, frames = self.skip, []
        while True:
            if self.version == 1:
                if i + 2 > len(self.data):
                    return None
                n, i = self.data[i], i + 1
                if n == 0xFF:
                    if i + 8 > len(self.data):
                        return None
                    n, i = int.from_bytes(self.data[i:i + 8], "big"), i + 8
                flags, body, end = self.data[i], self.data[i + 1:i + n], i + n
            else:
                if i + 2 > len(self.data):
                    return None
                flags, i = self.data[i], i + 1
                width = 8 if flags & 2 else 1
                if i + width > len(self.data):
                    return None
                n, i = int.from_bytes(self.data[i:i + width], "big"), i + width
                body, end = self.data[i:i + n], i + n
            if end > len(self.data):
                return None
            frames.append(body)
            i = end
            if not flags & 1:
                self.skip = i
                return frames


@pytest.mark.parametrize("version", [1, 2])
def test_a_peer_with_zeromqs_old_framing_is_answered_not_left_waiting(raw, version):
    """`frames[-1].get(zmq.SRCFD)` raised ZMQError(EINVAL) outside the handler's `try`."""
    server, sock = raw
    peer = _old_peer(server.address, version)
    reader = _OldReader(peer, version)
    try:
        peer.sendall(_old_frames(version, [msgpack.packb({"op": "ping", "id": 3, "args": {}})]))
        reply = msgpack.unpackb(reader.next()[0], raw=False)
        assert not reply["ok"] and reply["id"] == 3 and "file descriptor" in reply["message"]
    finally:
        peer.close()
    _serves(sock)


# Fuzzing ---------------------------------------------------------------------------------
NUM_FUZZED = 3000
"""Requests the fuzz test sends on a DEALER (random, mutated, deeply nested), besides
`NUM_OLD_FUZZED` on each old framing: bounded, so that it runs in CI in a few seconds."""
NUM_OLD_FUZZED = 200


def _bases() -> list[list[bytes]]:
    """Valid requests to mutate: none can wait (no get; puts go to a partition without a bound)."""
    chunk = {"stacked": torch.arange(2000, dtype=torch.int32).reshape(2, 1000)}  # a buffer frame
    args = [
        ("ping", {}), ("metrics", {}), ("version", {}), ("set_version", {"version": 3}),
        ("create_partition", {"name": "p", "consumers": ["c"], "capacity_rows": None}),
        ("add_consumer", {"partition": "train", "consumer": "d"}),
        ("put", {"partition": "train", "columns": {"x": {"stacked": torch.ones(2, 3000)}}, "timeout": 0}),
        ("ack", {"consumer": "c", "partition": "train", "indexes": [0, 1]}),
        ("release", {"consumer": "c", "partition": "train", "indexes": None}),
        ("save", {"path": "store.bin"}),  # this server takes no client's save: refused
        ("parked", {"request": 1}), ("withdraw", {"request": 2}),
        ("unit_write", {"key": "k", "chunk": chunk}), ("unit_read", {"key": "k", "offsets": [0, 1]}), ("unit_drop", {"keys": ["k"]}),
    ]
    return [[bytes(f) for f in pack({"op": op, "id": k, "token": None, "args": a})] for k, (op, a) in enumerate(args, 1)]


def _mutate(rng: random.Random, frames: list[bytes]) -> list[bytes]:
    frames = [bytearray(f) for f in frames]
    for _ in range(rng.randint(1, 3)):
        f = frames[rng.randrange(len(frames))]
        how = rng.randrange(7)
        if how == 0 and f:  # flip bits
            for _ in range(rng.randint(1, 4)):
                f[rng.randrange(len(f))] ^= 1 << rng.randrange(8)
        elif how == 1 and f:  # replace bytes
            for _ in range(rng.randint(1, 4)):
                f[rng.randrange(len(f))] = rng.randrange(256)
        elif how == 2:  # cut short
            del f[rng.randint(0, len(f)):]
        elif how == 3:  # insert bytes
            at = rng.randint(0, len(f))
            f[at:at] = rng.randbytes(rng.randint(1, 8))
        elif how == 4 and f:  # repeat a slice
            a = rng.randrange(len(f))
            f[a:a] = f[a:a + rng.randint(1, 16)]
        elif how == 5:  # one buffer fewer or more
            if len(frames) > 1 and rng.random() < 0.5:
                frames.pop(rng.randrange(1, len(frames)))
            else:
                frames.append(bytearray(rng.randbytes(rng.choice([0, 8, 4000, 12_000]))))
        else:  # one frame of random bytes
            frames[rng.randrange(len(frames))] = bytearray(rng.randbytes(rng.randint(0, 64)))
    return [bytes(f) for f in frames]


def _fuzzed(rng: random.Random, bases: list[list[bytes]]) -> list[bytes]:
    roll = rng.random()
    if roll < 0.1:
        return [rng.randbytes(rng.randint(0, 40)) for _ in range(rng.randint(1, 3))]
    if roll < 0.2:
        depth = rng.choice([MAX_DEPTH - 1, MAX_DEPTH + 1, rng.randint(200, 1200), 5000])
        return [_deep(depth, maps=rng.random() < 0.5, request_id=rng.choice([None, 7]))]
    return _mutate(rng, rng.choice(bases))


def test_fuzzed_requests_are_all_answered_and_the_server_serves_on(raw):
    """Random bytes, mutations of valid requests (one frame or several) and deeply nested
    headers on a DEALER; mutated requests from peers of both old framings. Each gets a
    reply (or, from an old peer, a closed connection); valid requests are served after."""
    server, sock = raw
    rng = random.Random(46)
    bases = _bases()
    begin = time.monotonic()
    num_frames = 0
    for _ in range(NUM_FUZZED):
        frames = _fuzzed(rng, bases)
        num_frames += len(frames)
        _call(sock, frames)
    for version in (1, 2):
        peer = _old_peer(server.address, version)
        reader = _OldReader(peer, version)
        try:
            for _ in range(NUM_OLD_FUZZED):
                frames = _fuzzed(rng, bases)
                peer.sendall(_old_frames(version, frames))
                message = reader.next()
                if message is None:  # closed: allowed, and nothing more goes through it
                    break
                assert isinstance(msgpack.unpackb(message[0], raw=False, strict_map_key=False), dict)
        finally:
            peer.close()
    assert time.monotonic() - begin < 60  # a few seconds, on a loaded machine too
    assert num_frames >= NUM_FUZZED
    _serves(sock)
    client = RemoteStore(server.address, rpc_timeout_s=10)
    try:
        client.create_partition("after", consumers=["c"])
        client.put("after", {"x": torch.arange(4).reshape(2, 2)})
        assert client.get("c", "after", ["x"], 2, timeout=5).stack("x").tolist() == [[0, 1], [2, 3]]
    finally:
        client.close()
    assert server._thread.is_alive()


# Size limits ----------------------------------------------------------------------------
def _zmtp3_peer(address: str) -> socket.socket:
    """A raw ZMTP 3.0 DEALER that has done its handshake (NULL security)."""
    parsed = urllib.parse.urlsplit(address)
    peer = socket.create_connection((parsed.hostname, parsed.port), timeout=REPLY_WAIT_S)
    peer.sendall(b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + b"\x00" + bytes(31))
    ready = b"\x05READY" + b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
    peer.sendall(bytes([0x04, len(ready)]) + ready)
    return peer


def _closed_by_server(peer: socket.socket, wait_s: float = REPLY_WAIT_S) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        peer.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            if not peer.recv(1 << 16):
                return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False
    return False


def test_a_frame_over_max_message_bytes_ends_its_connection_before_it_is_buffered():
    """Without a limit a tokenless peer made a token-protected server buffer a 1 GiB frame
    before it answered Unauthorized, and half-sent frames claiming GiBs made it reserve them.
    (A token-protected server now refuses a peer without the token in the handshake, before
    any frame: `test_store_auth`. The limit bounds each frame of a peer with the token, and
    of any peer of a server without one.)"""
    limit = 1 << 20
    with pytest.raises(ValueError, match="max_message_bytes"):
        StoreServer(Store(), max_message_bytes=0)
    with StoreServer(Store(), max_message_bytes=limit) as server:
        assert server._router.getsockopt(zmq.MAXMSGSIZE) == limit
        me = psutil.Process()
        before = me.memory_info().vms
        claims = [_zmtp3_peer(server.address) for _ in range(4)]
        for k, peer in enumerate(claims):  # a frame header that claims 1 GiB, and a few of its bytes
            peer.sendall(b"\x02" + ((1 << 30) + k).to_bytes(8, "big") + b"x" * 4096)
        try:
            assert all(_closed_by_server(peer) for peer in claims)
        finally:
            for peer in claims:
                peer.close()
        assert me.memory_info().vms - before < (1 << 30)  # nothing of the 4 GiB claimed was reserved
    with StoreServer(Store(), max_message_bytes=limit, address="tcp://0.0.0.0:0", token="s3cret") as server:
        address = server.address.replace("0.0.0.0", "127.0.0.1")
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.plain_username, sock.plain_password = b"tidal", b"s3cret"  # it has the token
        events = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            sock.connect(address)
            sock.send_multipart([msgpack.packb({"op": "ping", "id": 1, "token": "s3cret", "args": {}}), bytes(limit + 1)])  # too big
            assert events.poll(int(REPLY_WAIT_S * 1000)), "the server did not disconnect the peer"
            assert not sock.poll(200)  # and it did not answer
            assert not server.num_malformed  # never read
            ok = _call(sock, [msgpack.packb({"op": "ping", "id": 2, "token": "s3cret", "args": {}}), bytes(limit)])  # the limit itself: served (reconnected)
            assert ok["ok"] and ok["id"] == 2
        finally:
            events.close(linger=0)
            sock.close(linger=0)
            ctx.term()
        client = RemoteStore(address, token="s3cret", rpc_timeout_s=10)
        try:
            client.create_partition("p", consumers=["c"])
            client.put("p", {"x": torch.zeros(2, 1000)})
            assert client.get("c", "p", ["x"], 2, timeout=5).indexes == [0, 1]
        finally:
            client.close()
