"""`ClientSockets`: the per-thread ZeroMQ sockets of one `RemoteStore`, and closing them.

A ZeroMQ socket is used by one thread at a time, and closing a socket that another thread
is blocked on is undefined (it hangs `Context.term()`, or that thread gets a raw
`ZMQError`). So each thread of a client gets its own sockets, and every call of the client
runs inside `in_call`, which knows which threads are inside a call. `close()` closes the
sockets of the threads that are not, then terminates the context: a thread blocked in a
receive or poll then gets ETERM, which `in_call` turns into `StoreError`, and it closes
its own sockets as it leaves its call. Termination returns once every socket is closed.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import zmq

from tidal.flow.store.table import StoreError


class ThreadSockets(dict):
    """One thread's connections by address (a `threading.local` value, dropped when the
    thread ends), every socket it opened (`owned`), and how many of its calls are running."""

    def __init__(self) -> None:
        super().__init__()
        self.owned: list[zmq.Socket] = []
        self.depth = 0

    __eq__ = object.__eq__  # one thread's, not equal contents: kept in a `WeakSet`
    __hash__ = object.__hash__  # type: ignore[assignment]  # typeshed types dict.__hash__ as None; a subclass may restore identity hashing


def _close_all(owned: list[zmq.Socket], lock: threading.RLock) -> None:
    """Close sockets no thread is using any more (a finished thread's, an idle one's)."""
    with lock:
        for sock in owned:
            sock.close(linger=0)
        owned.clear()


class ClientSockets:
    """The sockets of one client of the store server at `address`, thread by thread."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.ctx = ctx
        self.address = address
        self.closed = False
        self._lock = threading.RLock()  # re-entrant: a dead thread's finalizer may run inside it
        self._tls = threading.local()
        self._threads: weakref.WeakSet[ThreadSockets] = weakref.WeakSet()

    def of_thread(self) -> ThreadSockets:
        """This thread's sockets; `StoreError` once the client is closed."""
        with self._lock:
            if self.closed:
                raise StoreError(f"the client of store server {self.address} is closed")
            sockets = getattr(self._tls, "sockets", None)
            if sockets is None:
                sockets = self._tls.sockets = ThreadSockets()
                self._threads.add(sockets)
                # when the thread ends, its sockets close: the server releases the rows it leased
                weakref.finalize(sockets, _close_all, sockets.owned, self._lock)
            return sockets

    def open(self, kind: int) -> zmq.Socket:
        """A new socket (linger 0) of this thread, closed with the thread or the client."""
        sockets = self.of_thread()
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        with self._lock:
            sockets.owned[:] = [s for s in sockets.owned if not s.closed]  # a connection refused in its handshake was closed at once
            sockets.owned.append(sock)
        return sock

    @contextlib.contextmanager
    def in_call(self) -> Iterator[None]:
        """Run one call of this thread (calls nest). A ZeroMQ error raised because the
        client was closed meanwhile becomes `StoreError`; the last call of a thread to end
        after `close()` closes that thread's sockets."""
        with self._lock:
            sockets = self.of_thread()
            sockets.depth += 1
        try:
            yield
        except zmq.ZMQError as e:
            if not self.closed:
                raise
            raise StoreError(f"the client of store server {self.address} was closed") from e
        finally:
            with self._lock:
                sockets.depth -= 1
                if self.closed and sockets.depth == 0:
                    _close_all(sockets.owned, self._lock)

    def close_idle(self) -> bool:
        """Mark the client closed and close the sockets of every thread not inside a call
        (and this thread's: it is not blocked on them). False when it was closed already.
        The caller then terminates the context, which ends the other threads' waits."""
        with self._lock:
            if self.closed:
                return False
            self.closed = True
            mine = getattr(self._tls, "sockets", None)
            for sockets in list(self._threads):
                if sockets.depth == 0 or sockets is mine:
                    _close_all(sockets.owned, self._lock)
            return True


_Method = TypeVar("_Method", bound=Callable[..., Any])


def one_call(method: _Method) -> _Method:
    """Run a method of a client (whose `_sockets` are its `ClientSockets`) as one call of its
    thread (`ClientSockets.in_call`): a `close()` meanwhile leaves this thread's sockets to
    it and ends its wait with `StoreError`."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with self._sockets.in_call():
            return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]
