"""A store server with a token checks it in each connection's handshake (`auth`): a peer
without it cannot make the server hold anything, and a client without it, or with
another, is told so at once. A server without a token takes anyone, as before."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time
import urllib.parse

import msgpack
import pytest
import torch
import zmq

from tidal.flow.store import RemoteStore, StorageUnit, Store, StoreError, StoreServer

TOKEN = "s3cret"
NUM_FRAMES, FRAME_BYTES = 400, 512 << 10
"""What a flooding peer sends: one message of 200 MiB that it never finishes, each frame
under the server's `max_message_bytes` (1 MiB here)."""
MAX_GROWTH_BYTES = 16 << 20
REFUSED = r"Unauthorized: missing or wrong store token: store server \S+ (refused this client's token|takes only clients that show its token)"

_SERVER = textwrap.dedent("""
    import sys
    import psutil
    from tidal.flow.store import Store, StoreServer
    server = StoreServer(Store(), token=sys.argv[1], max_message_bytes=1 << 20)
    print(server.address, flush=True)
    for _ in sys.stdin:  # each line: how much memory it holds now
        print(psutil.Process().memory_info().rss, flush=True)
""")


def _zmtp3_peer(address: str, mechanism: bytes, command: bytes) -> socket.socket:
    """A raw ZMTP 3.0 peer that sent its greeting and first handshake command, and then
    follows no protocol: it sends what it likes, whatever the server answers."""
    parsed = urllib.parse.urlsplit(address)
    peer = socket.create_connection((parsed.hostname, parsed.port), timeout=10)
    peer.sendall(b"\xff" + bytes(8) + b"\x7f\x03\x00" + mechanism.ljust(20, b"\0") + b"\x00" + bytes(31))
    peer.sendall(bytes([0x04, len(command)]) + command)
    return peer


_NULL_READY = b"\x05READY" + b"\x0bSocket-Type" + (6).to_bytes(4, "big") + b"DEALER"
_PLAIN_HELLO = b"\x05HELLO" + b"\x05tidal" + b"\x04nope"  # a wrong password


def _flood(peer: socket.socket) -> int:
    """Send `NUM_FRAMES` frames of `FRAME_BYTES`, every one marked "more" (the message never
    ends); the bytes sent before the server closed the connection."""
    frame = b"\x03" + FRAME_BYTES.to_bytes(8, "big") + bytes(FRAME_BYTES)  # more, long
    sent = 0
    try:
        for _ in range(NUM_FRAMES):
            peer.sendall(frame)
            sent += len(frame)
    except (BrokenPipeError, ConnectionResetError):
        pass
    return sent


def _closed(peer: socket.socket) -> bool:
    """Whether the server closes the connection (within a few seconds)."""
    peer.settimeout(3)
    try:
        while peer.recv(1 << 16):  # the server's greeting, an ERROR command
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


@pytest.mark.parametrize(("mechanism", "command"), [(b"NULL", _NULL_READY), (b"PLAIN", _PLAIN_HELLO)], ids=["no-token", "wrong-token"])
def test_a_peer_without_the_token_cannot_make_the_server_hold_a_message_of_many_frames(mechanism, command):
    """ZeroMQ bounds the size of a frame (`max_message_bytes`), not the number of frames of a
    message, and the token in a request's header was read only once the message was whole:
    a tokenless peer made a token-protected server hold a 200 MiB message of 512 KiB frames
    (and as much more as it liked). It is now disconnected in the handshake."""
    proc = subprocess.Popen([sys.executable, "-c", _SERVER, TOKEN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None

    def rss() -> int:
        proc.stdin.write("\n")
        proc.stdin.flush()
        return int(proc.stdout.readline())

    try:
        address = proc.stdout.readline().strip()
        client = RemoteStore(address, token=TOKEN, rpc_timeout_s=30, shm=False)
        try:
            assert client.ping()["store"]  # the server has served a connection: what that takes is held already
            before = rss()
            peer = _zmtp3_peer(address, mechanism, command)
            try:
                sent = _flood(peer)
                time.sleep(0.5)  # what reached the server is read by now
                grown = rss() - before
                print(f"a {mechanism.decode()} peer sending {NUM_FRAMES} x {FRAME_BYTES >> 10} KiB frames ({sent >> 20} MiB sent before it was cut off): the server grew by {grown / (1 << 20):.1f} MiB")
                assert grown < MAX_GROWTH_BYTES
                assert _closed(peer)
            finally:
                peer.close()
            assert client.ping()["store"]  # and it serves on
        finally:
            client.close()
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_a_client_with_the_token_is_served_after_showing_it_in_the_handshake(monkeypatch):
    with StoreServer(Store(), token=TOKEN) as server:
        assert server._router.getsockopt(zmq.MECHANISM) == zmq.PLAIN
        monkeypatch.setenv("TIDAL_STORE_TOKEN", TOKEN)
        clients = [RemoteStore(server.address, token=TOKEN, rpc_timeout_s=10), RemoteStore(server.address, rpc_timeout_s=10, shm=False)]  # the second: the token from the environment
        try:
            clients[0].create_partition("p", consumers=["c"])
            for k, client in enumerate(clients):
                client.put("p", {"x": torch.full((2, 1000), float(k))})
                batch = client.get("c", "p", ["x"], 2, timeout=5)
                assert batch.indexes == [2 * k, 2 * k + 1] and batch.stack("x").eq(k).all()
        finally:
            for client in clients:
                client.close()
        assert server._zap.num_refused == 0 and server.num_malformed == 0


@pytest.mark.parametrize("token", ["nope", None, ""], ids=["wrong", "missing", "empty"])
def test_a_client_without_the_right_token_is_told_at_once(monkeypatch, token):
    """Refused in the handshake, a client would wait its whole `rpc_timeout_s` for replies
    that never come (ZeroMQ does not connect again, and says why only on a monitor)."""
    monkeypatch.delenv("TIDAL_STORE_TOKEN", raising=False)
    with StoreServer(Store(), token=TOKEN) as server:
        for shm in (True, False):
            client = RemoteStore(server.address, token=token, rpc_timeout_s=30, shm=shm)
            try:
                for call in (client.metrics, lambda: client.put("p", {"x": torch.zeros(4, 1 << 18)}), lambda: client.get("c", "p", ["x"], 1, timeout=None)):
                    begin = time.monotonic()
                    with pytest.raises(StoreError, match=REFUSED):
                        call()
                    assert time.monotonic() - begin < 5  # well under rpc_timeout_s
            finally:
                client.close()
        assert server._zap.num_refused == (6 if token == "nope" else 0)  # one handshake per call; one without a token is refused before any
        assert server.num_malformed == 0


def test_a_raw_socket_without_the_token_gets_no_request_through():
    with StoreServer(Store(), token=TOKEN) as server:
        ctx = zmq.Context()
        socks = [ctx.socket(zmq.DEALER) for _ in range(3)]
        socks[1].plain_username, socks[1].plain_password = b"tidal", b"nope"
        socks[2].plain_username, socks[2].plain_password = b"tidal", TOKEN.encode()
        try:
            for sock in socks:
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDTIMEO, 2000)  # a refused peer's pipe may be gone before the send: a DEALER without one blocks
                sock.connect(server.address)
                try:
                    sock.send_multipart([msgpack.packb({"op": "ping", "id": 1, "token": TOKEN, "args": {}})])
                except zmq.Again:
                    assert sock is not socks[2], "the client with the token could not send"
            assert socks[2].poll(10_000) and msgpack.unpackb(socks[2].recv())["ok"]
            assert not socks[0].poll(300) and not socks[1].poll(0)
        finally:
            for sock in socks:
                sock.close(linger=0)
            ctx.term()


def test_a_server_without_a_token_takes_anyone_as_before(monkeypatch):
    monkeypatch.delenv("TIDAL_STORE_TOKEN", raising=False)
    with StoreServer(Store()) as server:
        assert server._router.getsockopt(zmq.MECHANISM) == zmq.NULL
        ctx = zmq.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(server.address)
        try:
            raw.send_multipart([msgpack.packb({"op": "ping", "id": 1, "args": {}})])
            assert raw.poll(10_000) and msgpack.unpackb(raw.recv())["ok"]
        finally:
            raw.close(linger=0)
            ctx.term()
        clients = [RemoteStore(server.address, rpc_timeout_s=10), RemoteStore(server.address, token=TOKEN, rpc_timeout_s=10)]  # the second connects again without it
        try:
            clients[0].create_partition("p", consumers=["c"])
            for k, client in enumerate(clients):
                begin = time.monotonic()
                client.put("p", {"x": torch.full((1, 3), float(k))})
                assert client.get("c", "p", ["x"], 1, timeout=5).indexes == [k]
                assert time.monotonic() - begin < 5
        finally:
            for client in clients:
                client.close()


def test_a_controller_with_a_token_reaches_units_with_it_and_without_one(tmp_path, wait_for):
    """Drops and a save's reads go to units that have the controller's token, and to units
    that have none (connected again without it, drops sent meanwhile sent again)."""
    controller = Store()
    with (
        StoreServer(controller, token=TOKEN, persist_dir=tmp_path) as ctrl,
        StoreServer(unit=StorageUnit(), token=TOKEN) as with_token,
        StoreServer(unit=StorageUnit()) as without,
    ):
        producers = [RemoteStore(ctrl.address, token=TOKEN, unit=unit.address) for unit in (with_token, without)]
        try:
            producers[0].create_partition("train", consumers=["train"])
            for k, producer in enumerate(producers):
                producer.put("train", {"x": torch.full((2, 2), float(k))})
            producers[0].save("store.bin")  # reads both units
            batch = producers[1].get("train", "train", ["x"], 4, timeout=5)
            assert batch.stack("x")[:, 0].tolist() == [0.0, 0.0, 1.0, 1.0]
            producers[1].ack("train", "train", batch.indexes)
            wait_for(lambda: (len(with_token.unit), len(without.unit)) == (0, 0))  # dropped on both
        finally:
            for producer in producers:
                producer.close()
