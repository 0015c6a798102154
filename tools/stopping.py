"""Stopping a run early without losing its work.

The first Ctrl-C (SIGINT) or SIGTERM during the RL stage asks the run to stop: the
trainer finishes the step it is on, the stages stop, a checkpoint is written, and
`tidal run` exits with 130 (SIGINT) or 143 (SIGTERM) and prints the command that
continues the run. A second Ctrl-C (or SIGTERM) stops at once, as without tidal.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class RunStopped(KeyboardInterrupt):
    """A run that stopped early on request, after saving a checkpoint; `exit_code` is the
    shell's for the signal (128 + its number)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
        number = getattr(signal.Signals, reason, signal.SIGINT)
        self.exit_code = 128 + int(number)


class StopRequest:
    """Asks a running `train()` to end after its current RL step, with a checkpoint.

    `request` may come from any thread, before or during the RL stage; `train()` puts
    the callback that stops its workflow in with `on_request`.
    """

    def __init__(self) -> None:
        self.reason: str | None = None
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[str], None]] = []

    def request(self, reason: str) -> None:
        with self._lock:
            if self.reason is not None:
                return
            self.reason = reason
            callbacks = list(self._callbacks)
        for callback in callbacks:
            callback(reason)

    def on_request(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` on the request, now if it was already made."""
        with self._lock:
            self._callbacks.append(callback)
            reason = self.reason
        if reason is not None:
            callback(reason)


@contextlib.contextmanager
def stop_on_signals(stop: StopRequest) -> Iterator[None]:
    """Inside (in the main thread; elsewhere nothing changes): the first SIGINT or SIGTERM
    calls `stop.request` with the signal's name, and the signals get their default
    handling back, so a second one stops at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def first(signum: int, frame: object) -> None:
        restore()
        # From a thread: the handler runs between two bytecodes of the main thread, which
        # may hold a lock that stopping the workflow takes.
        threading.Thread(target=stop.request, args=(signal.Signals(signum).name,), name="tidal-stop", daemon=True).start()

    previous = {s: signal.signal(s, first) for s in SIGNALS}

    def restore() -> None:
        for s, handler in previous.items():
            signal.signal(s, handler)

    try:
        yield
    finally:
        restore()
