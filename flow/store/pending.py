"""`PendingPut`: a remote put sent without waiting for its reply (`RemoteStore.submit_put`).

A producer keeps a few puts in flight on its thread's connection; each one's reply may be
read by another request's wait on that connection first, so the client keeps it (its
thread's `submitted` ids and `stash` of their replies) until `result()` takes it.

A put of a split deployment wrote its columns to a storage unit first. When it fails, the
chunks there are freed only if the server said it did nothing of the put (an error reply,
a withdrawn wait); after a failure that leaves that open (no reply in time, a broken
connection) they stay, since the controller may hold rows that refer to them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from tidal.flow.store.codec import CodecError
from tidal.flow.store.table import StoreError, StoreTimeout

NOT_DONE = "tidal_store_not_done"
_ERRORS: dict[str, type[Exception]] = {
    "StoreTimeout": StoreTimeout,
    "StoreError": StoreError,
    "ValueError": ValueError,
    "TypeError": TypeError,
    "CodecError": CodecError,
}


def result_of(reply: dict[str, Any]) -> Any:
    """A reply's result, or its error raised as the server raised it."""
    if reply.get("ok"):
        return reply.get("result")
    kind, message = reply.get("error"), reply.get("message")
    error_type = StoreError if kind is None else _ERRORS.get(kind, StoreError)
    raise error_type(message if kind in _ERRORS else f"{kind}: {message}")


def own_result(reply: dict[str, Any]) -> Any:
    """`result_of` a get's or put's own reply: its error is the server's word that it did
    nothing of the request (`not_done`)."""
    try:
        return result_of(reply)
    except Exception as e:
        not_done(e)
        raise


def not_done(error: BaseException) -> BaseException:
    """Mark `error` as the store server's word that it did nothing of a request (its error
    reply; a withdrawn wait); returns it."""
    setattr(error, NOT_DONE, True)
    return error


def was_not_done(error: BaseException) -> bool:
    """Whether `error` says the server did nothing of the request (`not_done`). Any other
    failure (no reply in time, a broken connection, a malformed reply) leaves it open: the
    server may have done it."""
    return getattr(error, NOT_DONE, False)


class PendingPut:
    """A put sent by `RemoteStore.submit_put`; `result()` waits for its reply.

    What it needs of its client comes as arguments: `thread_state` (the submitting thread's
    dict, where the ids of its puts in flight and the replies read for them are kept),
    `wait_reply()` (wait for this put's reply on the thread's connection; its indexes) and
    `drop_chunks()` (free the put's chunks on a storage unit)."""

    def __init__(self, request_id: int, *, thread_state: dict[str, Any], wait_reply: Callable[[], list[int]], drop_chunks: Callable[[], None]) -> None:
        self._id, self._wait_reply, self._drop_chunks = request_id, wait_reply, drop_chunks
        self._thread = threading.current_thread()
        self._outcome: list[int] | BaseException | None = None  # the indexes, or the error result() raises
        self._submitted, self._stash = thread_state.setdefault("submitted", set()), thread_state.setdefault("stash", {})
        self._submitted.add(request_id)  # its reply is kept if another request's wait reads it

    def result(self) -> list[int]:
        """The new rows' indexes; raises what `put` would have raised. Call it in the
        thread that submitted the put (its connection is that thread's)."""
        if self._outcome is None:
            if threading.current_thread() is not self._thread:
                raise RuntimeError(f"read a pending put's result in the thread that submitted it ({self._thread.name})")
            try:
                self._outcome = self._wait_reply()
            except BaseException as e:  # noqa: BLE001 - kept: result() raises it, now and on every later call
                self._outcome = e
                if was_not_done(e):  # the server refused it or withdrew it: free its chunks on the unit
                    self._drop_chunks()
                # else (no reply in time, a broken connection) the controller may hold the rows:
                # their chunks stay, for as long as the unit runs, rather than rows without data
            finally:
                self._forget()
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return self._outcome

    def _forget(self) -> None:
        self._submitted.discard(self._id)
        self._stash.pop(self._id, None)

    def __del__(self) -> None:
        if self._outcome is None:  # never read: its reply, when it comes, is dropped
            self._forget()
