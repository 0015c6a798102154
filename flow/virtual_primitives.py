"""The blocking primitives of `tidal.flow.virtual_clock.VirtualClock`: what a simulated thread waits in.

`VirtualClock.event()`, `condition()`, `thread()`, `future()` and `executor()` return the
classes here: `threading.Event`, `threading.Condition` and `threading.Thread` look-alikes, a
`concurrent.futures.Future` and a `ThreadPoolExecutor` whose waits are on virtual time. Each
keeps its own FIFO of parked waits and blocks, wakes and starts threads only through the
clock that made it (passed to it, typed as `_Scheduler`), under that clock's lock; the rules
they follow (the baton, wake order, the real-lock rule) are in `tidal.flow.virtual_clock`'s
docstring. Here too is what the scheduler and the primitives share: `_Task`, one simulated
thread's scheduling state, and `SimulationOver`, which a primitive raises to unwind its
thread when the simulation ends.

This module imports nothing from `tidal.flow.virtual_clock` (which imports it).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import deque
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any, Protocol, TypeVar

from tidal.flow.clock import FIRST_COMPLETED, FIRST_EXCEPTION

T = TypeVar("T")
_Entry = tuple["_Task", int]
"""A parked wait in some wait queue: (the thread, the token of that wait)."""


class SimulationOver(BaseException):
    """Raised inside a simulated thread still blocked when the simulation ends, to unwind it.

    A BaseException so that the `except Exception` handlers of real code let it through."""


class _Task:
    """One simulated thread's scheduling state (all fields guarded by the clock's lock)."""

    __slots__ = ("baton", "deadline", "done", "ident", "joiners", "name", "timed_out", "timer", "token", "waiting")

    def __init__(self, name: str) -> None:
        self.name = name
        # A lock used as a binary semaphore: the thread parks by acquiring it, whoever
        # passes it the baton releases it.
        self.baton = threading.Lock()
        self.baton.acquire()
        self.ident: int | None = None
        self.token = 0  # the current wait's id: entries of older waits (in queues, in the heap) are stale
        self.waiting: str | None = None  # what it blocks on; None while runnable or running
        self.deadline: float | None = None
        self.timer = False  # a live entry of its current wait is in the timer heap
        self.timed_out = False
        self.done = False
        self.joiners: deque[_Entry] = deque()


class _Scheduler(Protocol):
    """What the primitives use of the clock that made them (a `VirtualClock`): `_begin_wait`,
    `_wait_in`, `_wake` and `_wake_all` are called with its `_lock` held; `_start` takes it."""

    @property
    def _lock(self) -> threading.Lock: ...
    @property
    def _serials(self) -> Iterator[int]: ...
    @property
    def _current(self) -> _Task | None: ...
    def now(self) -> float: ...
    def _begin_wait(self, what: str) -> _Task: ...
    def _wait_in(self, queues: tuple[deque[_Entry], ...], what: str, timeout: float | None) -> bool: ...
    def _wake(self, task: _Task, token: int, *, timed_out: bool = False) -> bool: ...
    def _wake_all(self, queue: deque[_Entry]) -> None: ...
    def _start(self, thread: _Thread) -> _Task: ...


def _wait_is_over(done: set[concurrent.futures.Future[Any]], fs: set[concurrent.futures.Future[Any]], return_when: str) -> bool:
    if len(done) == len(fs):
        return True
    if return_when == FIRST_COMPLETED:
        return bool(done)
    if return_when == FIRST_EXCEPTION:
        # The base class's exception(): ours would take the clock's lock, held here.
        return any(not f.cancelled() and concurrent.futures.Future.exception(f, 0) is not None for f in done)
    return False


class _Event:
    """`threading.Event` on a virtual clock."""

    def __init__(self, clock: _Scheduler) -> None:
        self._clock = clock
        self._flag = False
        self._parked: deque[_Entry] = deque()
        self._what = f"event#{next(clock._serials)}.wait()"

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        with self._clock._lock:
            self._flag = True
            self._clock._wake_all(self._parked)

    def clear(self) -> None:
        with self._clock._lock:
            self._flag = False

    def wait(self, timeout: float | None = None) -> bool:
        clock = self._clock
        with clock._lock:
            if self._flag:
                return True
            if timeout is not None and timeout <= 0:
                return False
            return clock._wait_in((self._parked,), self._what, timeout)


class _Condition:
    """`threading.Condition(lock)` on a virtual clock; the lock is a real Lock or RLock."""

    def __init__(self, clock: _Scheduler, lock: threading.Lock | threading.RLock | None) -> None:
        self._clock = clock
        self._lock = threading.RLock() if lock is None else lock
        # threading.Condition knows how to release an RLock held re-entrantly and restore it
        # (and how to tell whether a plain Lock is held); borrow that rather than redo it.
        inner: Any = threading.Condition(self._lock)
        self._release_save: Callable[[], Any] = inner._release_save
        self._acquire_restore: Callable[[Any], None] = inner._acquire_restore
        self._is_owned: Callable[[], bool] = inner._is_owned
        self._parked: deque[_Entry] = deque()
        self._what = f"condition#{next(clock._serials)}.wait()"

    def __enter__(self) -> bool:
        return self._lock.acquire()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._lock.release()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        if not self._is_owned():
            raise RuntimeError("cannot wait on un-acquired lock")
        if timeout is not None and timeout <= 0:
            return False
        clock = self._clock
        clock._lock.acquire()
        try:
            clock._begin_wait(self._what)  # not a simulated thread: fail before letting the lock go
            saved = self._release_save()
        except BaseException:
            clock._lock.release()
            raise
        try:
            return clock._wait_in((self._parked,), self._what, timeout)
        finally:
            clock._lock.release()
            self._reacquire(saved)

    def _reacquire(self, saved: Any) -> None:
        # Uncontended unless a thread broke the real-lock rule: fail loudly instead of hanging.
        if not self._lock.acquire(blocking=False):
            raise RuntimeError(
                f"{self._what} cannot reacquire its lock: another simulated thread holds it while blocked on the clock "
                "(real locks must not be held across a clock wait)"
            )
        self._lock.release()
        self._acquire_restore(saved)

    def wait_for(self, predicate: Callable[[], T], timeout: float | None = None) -> T:
        deadline = None if timeout is None else self._clock.now() + timeout
        result = predicate()
        while not result:
            left = None
            if deadline is not None:
                left = deadline - self._clock.now()
                if left <= 0:
                    break
            self.wait(left)
            result = predicate()
        return result

    def notify(self, n: int = 1) -> None:
        if not self._is_owned():
            raise RuntimeError("cannot notify on un-acquired lock")
        clock = self._clock
        with clock._lock:
            while n > 0 and self._parked:
                if clock._wake(*self._parked.popleft()):
                    n -= 1

    def notify_all(self) -> None:
        self.notify(len(self._parked))


class _Thread:
    """`threading.Thread` on a virtual clock (always a daemon OS thread underneath)."""

    def __init__(self, clock: _Scheduler, target: Callable[..., object], *, name: str, args: tuple[Any, ...], daemon: bool) -> None:
        self._clock = clock
        self._target = target
        self._args = args
        self.name = name
        self.daemon = daemon
        self._task: _Task | None = None

    def start(self) -> None:
        if self._task is not None:
            raise RuntimeError(f"thread {self.name!r} can only be started once")
        self._task = self._clock._start(self)

    def join(self, timeout: float | None = None) -> None:
        task = self._task
        if task is None:
            raise RuntimeError(f"cannot join thread {self.name!r} before it is started")
        clock = self._clock
        what = f"join({self.name!r})"
        with clock._lock:
            if task.done or (timeout is not None and timeout <= 0):
                return
            if task is clock._current and task.ident == threading.get_ident():
                raise RuntimeError(f"thread {self.name!r} cannot join itself")
            clock._wait_in((task.joiners,), what, timeout)

    def is_alive(self) -> bool:
        return self._task is not None and not self._task.done

    def __repr__(self) -> str:
        state = "initial" if self._task is None else "started" if not self._task.done else "stopped"
        return f"<simulated thread {self.name!r} {state}>"


class _Future(concurrent.futures.Future[Any]):
    """A `concurrent.futures.Future` whose waits are on a virtual clock."""

    def __init__(self, clock: _Scheduler) -> None:
        super().__init__()
        self._clock = clock
        self._parked: deque[_Entry] = deque()
        self._serial = next(clock._serials)
        self._label = f"future#{self._serial}"

    def set_result(self, result: Any) -> None:
        super().set_result(result)
        self._wake()

    def set_exception(self, exception: BaseException | None) -> None:
        super().set_exception(exception)
        self._wake()

    def cancel(self) -> bool:
        cancelled = super().cancel()
        if cancelled:
            self._wake()
        return cancelled

    def result(self, timeout: float | None = None) -> Any:
        self._wait(timeout, ".result()")
        if not self.done():
            raise concurrent.futures.TimeoutError()
        return super().result(timeout=0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait(timeout, ".exception()")
        if not self.done():
            raise concurrent.futures.TimeoutError()
        return super().exception(timeout=0)

    def _wake(self) -> None:
        with self._clock._lock:
            self._clock._wake_all(self._parked)

    def _wait(self, timeout: float | None, call: str) -> None:
        clock = self._clock
        with clock._lock:
            if self.done() or (timeout is not None and timeout <= 0):
                return
            clock._wait_in((self._parked,), self._label + call, timeout)

    def __hash__(self) -> int:
        # By creation order, not address: a set of futures (what wait_futures returns)
        # then iterates in the same order on every run.
        return self._serial

    def __repr__(self) -> str:
        return f"<{self._label} {'done' if self.done() else 'pending'}>"


class _Executor:
    """`ThreadPoolExecutor` on a virtual clock: `max_workers` simulated threads, started as
    work arrives, taking calls first in, first out."""

    def __init__(self, clock: _Scheduler, max_workers: int, *, name: str) -> None:
        if max_workers <= 0:
            raise ValueError(f"max_workers={max_workers} must be > 0")
        self._clock = clock
        self._max_workers = max_workers
        self._name = name
        self._queue: deque[tuple[_Future, Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = deque()
        self._idle: deque[_Entry] = deque()  # workers parked waiting for work
        self._workers: list[_Thread] = []
        self._shutdown = False
        self._what = f"executor {name!r} waiting for work"

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future[T]:
        clock = self._clock
        with clock._lock:
            if self._shutdown:
                raise RuntimeError(f"executor {self._name!r} is shut down: cannot schedule new futures")
            future = _Future(clock)
            self._queue.append((future, fn, args, kwargs))
            woke = False
            while self._idle and not woke:
                woke = clock._wake(*self._idle.popleft())
            spawn = not woke and len(self._workers) < self._max_workers
        if spawn:
            worker = _Thread(clock, self._work, name=f"{self._name}_{len(self._workers)}", args=(), daemon=True)
            worker.start()
            self._workers.append(worker)
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        clock = self._clock
        with clock._lock:
            self._shutdown = True
            dropped = [item[0] for item in self._queue] if cancel_futures else []
            if cancel_futures:
                self._queue.clear()
            clock._wake_all(self._idle)
        for future in dropped:
            future.cancel()
        if wait:
            for worker in self._workers:
                worker.join()

    def __enter__(self) -> _Executor:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.shutdown(wait=True)

    def _work(self) -> None:
        clock = self._clock
        while True:
            with clock._lock:
                while not self._queue:
                    if self._shutdown:
                        return
                    clock._wait_in((self._idle,), self._what, None)
                future, fn, args, kwargs = self._queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except SimulationOver:
                raise
            except BaseException as e:  # noqa: BLE001  # as ThreadPoolExecutor: the error goes to the caller through the future
                future.set_exception(e)
            else:
                future.set_result(result)
