"""Store connections authenticated in ZeroMQ's handshake, before any message.

A server with a token takes a connection only once its peer has shown the token in the
ZMTP handshake: ZeroMQ's PLAIN mechanism (user `tidal`, password the token), which a ZAP
handler in the server's context checks (`ZapHandler`). A peer without the token is
disconnected before it can send one frame of a message, so it cannot make the server
buffer anything, whatever the number or the size of the frames it tries (ZeroMQ bounds the
size of a frame, `StoreServer(max_message_bytes=)`, but not the number of frames of a
message, and hands a message over only once it is whole: a token in its header is read
too late). PLAIN carries the token in the clear, as request headers always did: it keeps
out peers that do not know the token, not eavesdroppers on the network. A server without
a token speaks ZeroMQ's NULL mechanism and takes anyone, as before.

ZeroMQ alone would leave a refused client's requests unanswered (it does not reconnect
after a refused handshake, and says so only on the socket's monitor), so a client waits
for its connection's handshake to end (`Handshake`) before it sends on it, and raises
`StoreError` at once when it is refused. A client with a token whose server has none (the
mechanisms differ) connects again without it: such a server takes anyone.
"""

from __future__ import annotations

import hmac
import itertools
import time
from collections.abc import Callable
from typing import cast

import zmq
import zmq.utils.monitor

from tidal.flow.store.table import StoreError

USERNAME = b"tidal"
"""The PLAIN user name a client shows with its token (the password)."""
ZAP_DOMAIN = b"tidal-store"
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where ZeroMQ asks a context's ZAP handler (RFC 27)
UNAUTHORIZED = "Unauthorized: missing or wrong store token"
"""What a client refused for its token hears (the server's error reply to a request with a
wrong token in its header says the same)."""
_HANDSHAKE_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
_MECHANISM_MISMATCH = zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
_RECONNECT_MS, _RECONNECT_MAX_MS = 10, 100
# A server that refuses a handshake's mechanism often resets the connection before the client
# has read why (`HANDSHAKE_FAILED_NO_DETAIL`), and ZeroMQ then connects again: tries 10 ms
# apart let the client learn why within a fraction of a second. A server that is not up is
# tried again after 10, 20, 40, 80 and then every 100 ms (ZeroMQ's default interval).
_monitors = itertools.count()


class ZapHandler:
    """Checks the PLAIN handshakes of the sockets of one ZeroMQ context (a `StoreServer`'s):
    user `tidal` with `token` as its password passes; anything else is refused. Bound before
    the server's socket is: without a handler ZeroMQ takes every PLAIN peer. `answer` is
    called by the server thread when `socket` is readable; it never blocks."""

    def __init__(self, ctx: zmq.Context, token: str) -> None:
        self._token = token.encode()
        self.socket = ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(_ZAP_ENDPOINT)
        self.num_refused = 0
        """Handshakes refused (a wrong token, or none); a peer whose mechanism is not PLAIN
        is refused by ZeroMQ before any is asked for and is not counted."""

    def answer(self) -> None:
        """Answer every request that has come (ZeroMQ waits for each before it goes on)."""
        while self.socket.get(zmq.EVENTS) & zmq.POLLIN:
            frames = self.socket.recv_multipart()
            if len(frames) < 8:  # not a ZAP request: only ZeroMQ itself connects here
                continue
            route, request_id, domain, mechanism, credentials = frames[:2], frames[3], frames[4], frames[7], frames[8:]
            ok = domain == ZAP_DOMAIN and mechanism == b"PLAIN" and len(credentials) == 2 and credentials[0] == USERNAME and hmac.compare_digest(credentials[1], self._token)
            if not ok:
                self.num_refused += 1
            self.socket.send_multipart([*route, b"1.0", request_id, b"200" if ok else b"400", b"OK" if ok else b"missing or wrong store token", USERNAME if ok else b"", b""])

    def close(self) -> None:
        self.socket.close(linger=0)


def require_token(sock: zmq.Socket, token: str | None) -> None:
    """Make a server's socket (before it binds) take only peers that show `token` in the
    handshake (its context needs a `ZapHandler`); with no token, it takes anyone."""
    if token:
        sock.setsockopt(zmq.PLAIN_SERVER, 1)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)


def show_token(sock: zmq.Socket, token: str | None) -> None:
    """Make a client's socket (before it connects) show `token` in its handshakes."""
    if token:
        sock.setsockopt(zmq.PLAIN_USERNAME, USERNAME)
        sock.setsockopt(zmq.PLAIN_PASSWORD, token.encode())


class Handshake:
    """The handshake of a client socket's connection to `address`, followed on the socket's
    monitor until it ends. Connects `sock`, showing `token` (`show_token`); `close` stops the
    monitor (the socket stays the caller's)."""

    def __init__(self, sock: zmq.Socket, address: str, token: str | None) -> None:
        self.address, self.token = address, token or None
        self.num_resets = 0
        """Connections the server ended during the handshake without saying why."""
        show_token(sock, self.token)
        sock.setsockopt(zmq.RECONNECT_IVL, _RECONNECT_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, _RECONNECT_MAX_MS)
        self._sock = sock
        self.monitor = sock.get_monitor_socket(_HANDSHAKE_EVENTS, addr=f"inproc://tidal-store-handshake-{next(_monitors)}")
        try:
            sock.connect(address)
        except BaseException:
            self.close()
            raise

    def outcome(self) -> bool | None:
        """True once the server took the connection; False when the server has no token and
        this socket showed one (connect again without it); None while the handshake goes on.
        `StoreError` when the server refused it. Never blocks."""
        while cast(int, self.monitor.get(zmq.EVENTS)) & zmq.POLLIN:  # pyzmq types every option as int | bytes; EVENTS is an int
            event = zmq.utils.monitor.recv_monitor_message(self.monitor)
            kind, value = event["event"], event["value"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return True
            if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # ZeroMQ connects again
                self.num_resets += 1
                continue
            if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == _MECHANISM_MISMATCH:
                if self.token is not None:
                    return False
                raise StoreError(f"{UNAUTHORIZED}: store server {self.address} takes only clients that show its token, and this one has none (pass token=, or set TIDAL_STORE_TOKEN)")
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                raise StoreError(f"{UNAUTHORIZED}: store server {self.address} refused this client's token")
            raise StoreError(f"store server {self.address} refused the connection: ZeroMQ handshake error {int(value):#x} (is it a tidal store server?)")
        return None

    def wait(self, timeout_s: float, *, wake: zmq.Socket | None = None, cancelled: Callable[[], bool] | None = None, check_s: float = 1.0) -> bool | None:
        """`outcome()` once known; None when it is not within `timeout_s`, or once
        `cancelled()` (looked at every `check_s`, and whenever `wake` is readable: drained)."""
        deadline = time.monotonic() + timeout_s
        poller = zmq.Poller()
        for sock in (self.monitor, wake):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)
        while (took := self.outcome()) is None:
            left = deadline - time.monotonic()
            if left <= 0 or (cancelled is not None and cancelled()):
                return None
            poller.poll(int(1000 * min(left, check_s)) + 1)
            while wake is not None and wake.poll(0):
                wake.recv()
        return took

    def why_not(self) -> str:
        """What the handshake went through, for an error saying it did not end in time."""
        if not self.num_resets:
            return ""
        return f" (it ended the connection during the handshake {self.num_resets} times: a missing or wrong store token?)"

    def close(self) -> None:
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:  # the context is being terminated: the monitor ends with it
            pass
        self.monitor.close(linger=0)


def connect(open_socket: Callable[[], zmq.Socket], address: str, token: str | None, wait: Callable[[Handshake], bool | None]) -> zmq.Socket:
    """A socket of `open_socket()` connected to `address`, showing `token`, once
    `wait(handshake)` returns True, or None (followed no further: the caller's wait for a
    reply tells what comes of it). False (the server has no token) connects a new socket
    without it. A socket whose handshake failed is closed."""
    while True:
        sock = open_socket()
        try:
            handshake = Handshake(sock, address, token)
            try:
                took = wait(handshake)
            finally:
                handshake.close()
        except BaseException:
            sock.close(linger=0)
            raise
        if took is not False:
            return sock
        sock.close(linger=0)
        token = None  # such a server takes anyone
