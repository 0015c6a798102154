"""Stopping a run early without losing its work.

The first Ctrl-C (SIGINT) or SIGTERM during the RL stage asks the run to stop: the
trainer finishes the step it is on, the stages stop, a checkpoint is written, and
`tidal run` exits with 130 (SIGINT) or 143 (SIGTERM) and prints the command that
continues the run. A second Ctrl-C (or SIGTERM) stops at once, as without tidal. A first
signal that comes while the final checkpoint is written (after the last step) lets it
finish, and stops the run the same way.

`QuietRollout` makes a checkpoint of a synchronous run (`max_staleness: 0`) resume to
the run it would have been without the stop.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # not at run time: the CLI and `ray_stop` import this module without torch and zmq
    from tidal.flow.store import Store

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
    calls `stop.request` with the signal's name, and the signals get their handlers from
    before back, so a second one stops at once. A signal the process ignores (SIGINT in
    a script's background job) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def first(signum: int, frame: object) -> None:
        restore()
        # From a thread: the handler runs between two bytecodes of the main thread, which
        # may hold a lock that stopping the workflow takes.
        threading.Thread(target=stop.request, args=(signal.Signals(signum).name,), name="tidal-stop", daemon=True).start()

    previous = {s: signal.signal(s, first) for s in SIGNALS if signal.getsignal(s) is not signal.SIG_IGN}

    def restore() -> None:
        for s, handler in previous.items():
            signal.signal(s, handler)

    try:
        yield
    finally:
        restore()


class QuietRollout:
    """With `max_staleness: 0`, a checkpoint's RNG state agrees with the store it saves, so a
    resumed run repeats the uninterrupted one bit for bit.

    The rollout engine starts no generation from the start of a train step (or a frozen one,
    `TakesFrozenSteps`) that writes a periodic checkpoint (`checkpoints(step)`, the step
    numbered from 1) to the end of the step's `on_step`, which writes it (the caller sets
    `open` then); other steps are not held up. `rng()` is the state before the last
    generation while the store has not got its samples (a run stopped while it generated: a
    resumed run generates them again). `store` is the run's, `rng_state()` returns the state
    a checkpoint saves.
    """

    def __init__(self, store: Store, trainer: Any, rollout: Any, *, rng_state: Callable[[], dict[str, Any]], checkpoints: Callable[[int], bool]) -> None:
        from tidal.flow.protocols import TakesFrozenSteps  # noqa: PLC0415 - imports torch, which this module's other users do without

        self.store, self.rng_state = store, rng_state
        self.open = threading.Event()
        self.open.set()
        self.before: tuple[dict[str, Any], int] | None = None
        generate = rollout.generate

        def closing(step: Callable[..., Any]) -> Callable[..., Any]:
            def closed(*args: Any, **kwargs: Any) -> Any:
                if checkpoints(trainer.version + 1):
                    self.open.clear()  # the step's samples are generated: the next ones wait for `open`
                return step(*args, **kwargs)

            return closed

        def quiet_generate(*args: Any, should_pause: Callable[[], bool] | None = None, **kwargs: Any) -> Any:
            while not self.open.wait(1.0) and not (should_pause and should_pause()):
                pass  # a run that fails before its `on_step` stops rollout: this wait ends too
            self.before = (self.rng_state(), self._acked())
            return generate(*args, should_pause=should_pause, **kwargs)

        trainer.train_step, rollout.generate = closing(trainer.train_step), quiet_generate
        if isinstance(trainer, TakesFrozenSteps):  # a step the policy sits out (`algorithm.critic_warmup`) checkpoints too
            trainer.frozen_step = closing(trainer.frozen_step)  # type: ignore[method-assign]  # wrapped on this instance, as train_step is

    def _acked(self) -> int:
        return self.store.consumer_counts("prompts", "rollout")["acked"]

    def rng(self) -> dict[str, Any]:
        """The RNG state that goes with the store now."""
        if self.before is not None and self._acked() == self.before[1]:
            return self.before[0]
        return self.rng_state()
