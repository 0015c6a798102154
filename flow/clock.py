"""The clock every wait and every reading of time in flow/ goes through.

flow/'s scheduling code (the workflow, its stages, the store, rollout workers) is threaded:
it waits on events, conditions, futures and threads, sleeps, and reads the time. A `Clock`
is the one object that provides all of those, so the same code can run on real time
(`REAL`, the standard library, unchanged behaviour) or on a virtual clock
(`tidal.flow.virtual_clock.VirtualClock`) where `tidal simulate` replays a cluster whose
engines only pretend to work: a 3.2 s generate is a 3.2 s sleep that returns at once.

Code takes `clock: Clock = REAL` and asks it, never `threading`/`time`/`concurrent.futures`
directly, for anything that blocks or tells the time:

    done = clock.event()                  # threading.Event()
    cond = clock.condition(lock)          # threading.Condition(lock)
    clock.thread(fn, name="tidal-x").start()
    start = clock.now()                   # time.monotonic()

Locks stay plain `threading.Lock`/`RLock`: a critical section that never blocks on a clock
primitive while it holds the lock needs nothing from the clock (the virtual clock's module
docstring says why that is safe there).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, Protocol, TypeVar, runtime_checkable

T = TypeVar("T")
FIRST_COMPLETED = concurrent.futures.FIRST_COMPLETED
FIRST_EXCEPTION = concurrent.futures.FIRST_EXCEPTION
ALL_COMPLETED = concurrent.futures.ALL_COMPLETED


class ClockEvent(Protocol):
    """What `Clock.event()` returns: `threading.Event`'s interface."""

    def is_set(self) -> bool: ...
    def set(self) -> None: ...
    def clear(self) -> None: ...

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the flag is set or `timeout` seconds pass; the flag (False on timeout)."""
        ...


class ClockCondition(Protocol):
    """What `Clock.condition(lock)` returns: `threading.Condition`'s interface."""

    def __enter__(self) -> bool: ...
    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None: ...
    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool: ...
    def release(self) -> None: ...

    def wait(self, timeout: float | None = None) -> bool:
        """Release the lock, block until notified or `timeout` passes, reacquire; False on timeout."""
        ...

    def wait_for(self, predicate: Callable[[], T], timeout: float | None = None) -> T:
        """Wait until `predicate()` is true or `timeout` passes; the last value of `predicate()`."""
        ...

    def notify(self, n: int = 1) -> None: ...
    def notify_all(self) -> None: ...


class ClockThread(Protocol):
    """What `Clock.thread(...)` returns: the part of `threading.Thread` flow/ uses."""

    @property
    def name(self) -> str: ...
    def start(self) -> None: ...
    def join(self, timeout: float | None = None) -> None: ...
    def is_alive(self) -> bool: ...


class ClockExecutor(Protocol):
    """What `Clock.executor(...)` returns: `ThreadPoolExecutor`'s interface."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]: ...
    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None: ...


@runtime_checkable
class Clock(Protocol):
    """Time, waits and threads for flow/'s scheduling code.

    Every method mirrors a standard-library call so that `REAL` changes nothing; a virtual
    clock implements the same calls on simulated time. Objects one clock makes (events,
    futures, ...) are only for use with that clock.
    """

    def now(self) -> float:
        """Monotonic seconds (`time.monotonic()`): for durations and deadlines."""
        ...

    def wall(self) -> float:
        """Seconds since the epoch (`time.time()`): for timestamps people or other hosts read."""
        ...

    def sleep(self, seconds: float) -> None:
        """Block the calling thread for `seconds` (`time.sleep`)."""
        ...

    def event(self) -> ClockEvent:
        """A new `threading.Event` equivalent."""
        ...

    def condition(self, lock: threading.Lock | threading.RLock | None = None) -> ClockCondition:
        """A new `threading.Condition(lock)` equivalent; `lock` is a plain Lock or RLock (an
        RLock by default), which may be held re-entrantly while waiting."""
        ...

    def thread(self, target: Callable[..., object], *, name: str, args: tuple[Any, ...] = (), daemon: bool = True) -> ClockThread:
        """A new, not yet started, thread running `target(*args)` (`threading.Thread`)."""
        ...

    def future(self) -> concurrent.futures.Future[Any]:
        """A new pending `concurrent.futures.Future`, completed by whoever holds it."""
        ...

    def wait_futures(
        self, fs: Iterable[concurrent.futures.Future[Any]], *, timeout: float | None = None, return_when: str = FIRST_COMPLETED
    ) -> tuple[set[concurrent.futures.Future[Any]], set[concurrent.futures.Future[Any]]]:
        """(done, not done) once `return_when` holds or `timeout` passes (`concurrent.futures.wait`)."""
        ...

    def executor(self, max_workers: int, *, name: str) -> ClockExecutor:
        """A pool of `max_workers` threads named `{name}_{i}` (`ThreadPoolExecutor`)."""
        ...


class RealClock(Clock):
    """The standard library, call for call: real threads, real time.

    Args:
        now: where `now()` reads the time (`time.monotonic` by default); a test that expires
            a store's leases at will passes a function of its own, and every wait stays real.
    """

    def __init__(self, *, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now

    def now(self) -> float:
        return self._now()

    def wall(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def event(self) -> threading.Event:
        return threading.Event()

    def condition(self, lock: threading.Lock | threading.RLock | None = None) -> threading.Condition:
        return threading.Condition(lock)

    def thread(self, target: Callable[..., object], *, name: str, args: tuple[Any, ...] = (), daemon: bool = True) -> threading.Thread:
        return threading.Thread(target=target, name=name, args=args, daemon=daemon)

    def future(self) -> concurrent.futures.Future[Any]:
        return concurrent.futures.Future()

    def wait_futures(
        self, fs: Iterable[concurrent.futures.Future[Any]], *, timeout: float | None = None, return_when: str = FIRST_COMPLETED
    ) -> tuple[set[concurrent.futures.Future[Any]], set[concurrent.futures.Future[Any]]]:
        return concurrent.futures.wait(fs, timeout=timeout, return_when=return_when)

    def executor(self, max_workers: int, *, name: str) -> concurrent.futures.ThreadPoolExecutor:
        return concurrent.futures.ThreadPoolExecutor(max_workers, thread_name_prefix=name)


REAL = RealClock()
"""The clock of a real run: what every `clock` argument defaults to."""
