"""The client connections a `StoreServer` serves, and the requests it holds for them.

A ROUTER socket gives each connection a routing identity; the router's monitor names a
connection that ended by its file descriptor. `Peers` maps both to one `Peer`, whose
`holder` tags the leases taken through it, so a client that dies has its rows released.
A connection ZeroMQ knows no descriptor for (a peer speaking ZMTP 1.0 or 2.0, the
framings of ZeroMQ 2 and 3) is refused: its end could never be seen.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import zmq

from tidal.flow.store.wire import WireError

_holders = itertools.count(1)


class Peer:
    """One client connection; `holder` tags the leases taken through it (see `Store.get`)."""

    def __init__(self, identity: bytes, fd: int) -> None:
        self.identity = identity
        self.fd = fd
        self.alive = True
        self.holder = next(_holders)
        self.shm = False
        """Whether it shares this server's `/dev/shm`: replies may name segments."""
        self.sent: Any = None
        """The last get result sent to it, which it may not have mapped yet: held until its
        next request other than a withdraw (a client's thread reads each reply before it
        sends again) or its disconnect, so a put that replaces those rows' cells, or a lease
        that ran out, cannot unlink a segment before the client has mapped it."""


@dataclasses.dataclass
class Parked:
    """A get or put that waits for rows or room, until `deadline` (monotonic seconds)."""

    peer: Peer
    request_id: int
    op: str
    args: dict[str, Any]
    since: float
    deadline: float


class Peers:
    """The server thread's connections, by routing identity and by file descriptor."""

    def __init__(self) -> None:
        self._by_identity: dict[bytes, Peer] = {}
        self._by_fd: dict[int, Peer] = {}
        self._gone: set[bytes] = set()
        """Identities of clients that disconnected (ROUTER gives each connection its own)."""

    def __len__(self) -> int:
        return len(self._by_identity)

    def of(self, frames: Sequence[zmq.Frame]) -> Peer | None:
        """The connection a request came from (`frames` as the router gives them: its
        identity first). None when it disconnected before the request was read (no one
        would take the reply or release its leases). `WireError` when ZeroMQ knows no
        file descriptor for it."""
        identity = frames[0].bytes
        if identity in self._gone:
            return None
        try:
            fd = frames[-1].get(zmq.SRCFD)
        except zmq.ZMQError as e:  # EINVAL: no descriptor came with the frame
            raise WireError(
                "this connection cannot be served: ZeroMQ knows no file descriptor for it (ZMTP 1.0 or 2.0 framing, "
                "from ZeroMQ 2 or 3?), so its end, which releases its leases, could not be seen; connect with ZeroMQ >= 4"
            ) from e
        peer = self._by_identity.get(identity)
        if peer is None or peer.fd != fd:
            peer = self._by_identity[identity] = self._by_fd[fd] = Peer(identity, fd)
        return peer

    def disconnected(self, fd: int) -> Peer | None:
        """Forget the connection on `fd`, which ended; the peer it was, if any."""
        peer = self._by_fd.pop(fd, None)
        if peer is None:
            return None
        if self._by_identity.get(peer.identity) is peer:
            del self._by_identity[peer.identity]
        self._gone.add(peer.identity)
        peer.alive, peer.sent = False, None
        return peer


def request_of(args: dict[str, Any]) -> int:
    """The request id a withdraw or a liveness check is about."""
    request_id = args.get("request")
    if type(request_id) is not int:
        raise ValueError(f"'request' must be the int id of a get or put sent on this connection, got {request_id!r}")
    return request_id


def taken_by(op: str, args: dict[str, Any]) -> tuple[str, str] | None:
    """Whom a request's result leases rows to: a get's (consumer, partition)."""
    return (args["consumer"], args["partition"]) if op == "get" else None
