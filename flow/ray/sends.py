"""`QueuedSends`: weight versions sent by a thread of their own, the newest replacing one not
sent yet (`RayRollouts` with `transport.overlap` over a transport that cannot post)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class QueuedSends:
    """Weight versions sent by a thread of their own, in order, the newest replacing one not
    sent yet: `put` returns at once. A send's error is raised by the next `put` or `flush`,
    and no later version is sent after it."""

    def __init__(self, send: Callable[[int, Any], None]) -> None:
        self._send = send
        self._cond = threading.Condition()
        self._queued: tuple[int, Any] | None = None
        self._sending = self._closed = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.replaced = 0
        """Versions replaced by a newer one before they were sent."""

    def put(self, version: int, source: Any) -> None:
        with self._cond:
            self._raise()
            self.replaced += self._queued is not None
            self._queued = (version, source)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="tidal-weight-sends", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def flush(self) -> None:
        """Wait until nothing is queued or being sent."""
        self.drain()
        with self._cond:
            self._raise()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or being sent (or a send failed, or `close`); False at the timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: (self._queued is None and not self._sending) or self._error is not None or self._closed, timeout)

    def close(self) -> None:
        """End the thread once its send in progress ends; a version still queued is not sent."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def error(self) -> BaseException | None:
        """The error that ended sending, if one did."""
        return self._error

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"sending weights to rollout failed: {type(self._error).__name__}: {self._error}") from self._error

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queued is not None or self._closed)
                if self._closed:
                    return
                assert self._queued is not None
                (version, source), self._queued = self._queued, None
                self._sending = True
            error = None
            try:
                self._send(version, source)
            except BaseException as e:  # noqa: BLE001 - raised in the publisher's thread, at its next put
                error = e
            with self._cond:
                self._sending, self._error = False, error
                self._cond.notify_all()
                if error is not None:
                    return
