"""A deterministic virtual clock: flow/'s real threaded code on simulated time.

`tidal simulate` runs the project's own scheduling code (workflow, stages, store, rollout
workers) against engines whose work is a modelled duration. That code is threaded and
waits on events, conditions, futures and sleeps; `VirtualClock` implements
`tidal.flow.clock.Clock` so the same code runs unchanged, hours of cluster time in seconds,
and gives the same answer every time.

The design, and why:

* **A baton.** Simulated threads are real OS threads (so real code, thread-locals and
  `threading.current_thread()` keep working), but only the one holding the baton runs. A
  thread gives the baton up only inside a clock primitive that blocks (sleep, Event.wait,
  Condition.wait, Thread.join, Future.result/exception, wait_futures, and the executor's
  workers waiting for work). Between two such calls a thread runs alone, so what happens
  never depends on how the OS schedules threads.
* **Determinism.** The next thread to run is the head of a FIFO of runnable threads,
  appended in the order they were woken: notify wakes waiters in the order they began to
  wait, Event.set wakes all its waiters in that order, a started thread is appended at
  `start()`. A trace of a simulation is therefore a function of the code and its inputs
  alone: a schedule that misbehaves once misbehaves on every rerun, under a debugger too.
* **Time moves only when nothing can run.** `now()` never changes while a thread runs. When
  no thread is runnable the clock jumps to the earliest pending deadline (a heap keyed by
  (deadline, sequence number), so waits with one deadline time out in the order they
  began), wakes every wait due then (a timed-out wait returns False, as in threading) and
  goes on. No thread runnable and no deadline pending is a deadlock: `run()` raises
  `SimulationDeadlock` naming each blocked thread and what it waits on.
* **Ending.** `run(fn)` returns when `fn` returns; then `close()` unwinds every simulated
  thread still blocked, one at a time, by raising `SimulationOver` (a BaseException, so an
  `except Exception` in real code does not swallow it) from the primitive it is parked in,
  so finally blocks run. An exception escaping another simulated thread is re-raised by
  `run()`.

**The real-lock rule.** Code run under the clock may use plain `threading.Lock`/`RLock`
for critical sections that never block on a clock primitive while the lock is held (a
Condition's own lock is released by its `wait`, as always). Only one simulated thread runs
at a time, so such a lock is never contended and needs nothing from the clock. A thread
that blocks on the clock while holding a real lock would stop the one that next wants it
for real, with no virtual time passing: do not. A Condition whose lock is found held on
reacquiring raises RuntimeError rather than hang.

Two things determinism does not cover: a set of clock futures iterates by creation order
(they hash by it), but sets of other objects iterate by address; and a loop that polls
with `sleep(0)` while every other thread waits on a timeout never lets time move.

Threads that are not simulated threads of the clock may make its objects, read `now()` and
`wall()`, and make calls that never block (Event.set, notify, Future.set_result, done(),
a wait on something already finished); a call that would block raises RuntimeError.

The primitives a simulated thread blocks in (Event, Condition, Thread, futures, the
executor) are in `tidal.flow.virtual_primitives`; this module is the scheduler they park
through.
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from tidal.flow.clock import ALL_COMPLETED, FIRST_COMPLETED, FIRST_EXCEPTION, Clock
from tidal.flow.virtual_primitives import SimulationOver, _Condition, _Entry, _Event, _Executor, _Future, _Task, _Thread, _wait_is_over

__all__ = ["ClockStats", "SimulationDeadlock", "SimulationOver", "VirtualClock"]

T = TypeVar("T")


class SimulationDeadlock(RuntimeError):
    """No simulated thread can run and none waits with a timeout: nothing will ever wake them."""


@dataclass(slots=True)
class ClockStats:
    """Counters of one virtual clock's scheduling."""

    num_switches: int = 0
    """Times the baton passed from one simulated thread to another."""
    num_advances: int = 0
    """Times virtual time jumped forward."""
    num_threads: int = 0
    """Simulated threads started, the main one included."""


def _discard(queue: deque[_Entry], entry: _Entry) -> None:
    try:
        queue.remove(entry)
    except ValueError:
        pass  # its waker took it


class VirtualClock(Clock):
    """Deterministic simulated time for code written against `Clock` (module docstring).

    Args:
        start_wall: What `wall()` reads at virtual time 0 (seconds since the epoch).
    """

    def __init__(self, *, start_wall: float = 0.0) -> None:
        self._lock = threading.Lock()  # guards all scheduling state; never held while parked
        self._stopped = threading.Condition(self._lock)  # run() and close() wait here for the simulated threads
        self._start_wall = start_wall
        self._now = 0.0
        self._runnable: deque[_Task] = deque()
        self._timers: list[tuple[float, int, _Task, int]] = []
        self._num_stale_timers = 0
        self._sequence = itertools.count()
        self._tokens = itertools.count(1)
        self._serials = itertools.count(1)
        self._tasks: dict[_Task, None] = {}  # the live ones, oldest first
        self._current: _Task | None = None
        self._main: _Task | None = None
        self._state = "new"  # new -> running -> stopped -> closing -> closed
        self._outcome: tuple[Any, BaseException | None] | None = None
        self._deadlock: str | None = None
        self._errors: list[tuple[str, BaseException]] = []
        self.unwind_errors: list[tuple[str, BaseException]] = []
        """Exceptions other than SimulationOver that escaped threads while `close()` unwound them."""
        self.stats = ClockStats()

    # The Clock interface ----------------------------------------------------------------
    def now(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._start_wall + self._now

    def sleep(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"sleep length must be non-negative, got {seconds}")
        with self._lock:
            task = self._begin_wait("sleep()")
            if seconds == 0:
                self._yield(task)
            else:
                self._block(task, "sleep()", seconds)

    def event(self) -> _Event:
        return _Event(self)

    def condition(self, lock: threading.Lock | threading.RLock | None = None) -> _Condition:
        return _Condition(self, lock)

    def thread(self, target: Callable[..., object], *, name: str, args: tuple[Any, ...] = (), daemon: bool = True) -> _Thread:
        return _Thread(self, target, name=name, args=args, daemon=daemon)

    def future(self) -> _Future:
        return _Future(self)

    def wait_futures(
        self, fs: Iterable[concurrent.futures.Future[Any]], *, timeout: float | None = None, return_when: str = FIRST_COMPLETED
    ) -> tuple[set[concurrent.futures.Future[Any]], set[concurrent.futures.Future[Any]]]:
        if return_when not in (FIRST_COMPLETED, FIRST_EXCEPTION, ALL_COMPLETED):
            raise ValueError(f"return_when={return_when!r} must be FIRST_COMPLETED, FIRST_EXCEPTION or ALL_COMPLETED")
        futures: set[concurrent.futures.Future[Any]] = set(fs)
        ours: list[_Future] = []
        for f in futures:
            if not isinstance(f, _Future) or f._clock is not self:
                raise ValueError(f"wait_futures waits only on futures of this clock (its future() or executors), got {f!r}")
            ours.append(f)
        ours.sort(key=lambda f: f._serial)
        what = ""
        with self._lock:
            deadline = None if timeout is None else self._now + timeout
            while True:
                done: set[concurrent.futures.Future[Any]] = {f for f in ours if f.done()}
                if _wait_is_over(done, futures, return_when):
                    break
                left = None if deadline is None else deadline - self._now
                if left is not None and left <= 0:
                    break
                what = what or "wait_futures(" + ", ".join(f._label for f in ours) + ")"
                self._wait_in(tuple(f._parked for f in ours if f not in done), what, left)
        return done, futures - done

    def executor(self, max_workers: int, *, name: str) -> _Executor:
        return _Executor(self, max_workers, name=name)

    # Running a simulation ---------------------------------------------------------------
    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` as the first simulated thread ("main") until it returns, then `close()`.

        Returns:
            What `fn` returned.

        Raises:
            The exception `fn` raised; else the first exception that escaped another
            simulated thread; else `SimulationDeadlock` if the threads deadlocked first.
            RuntimeError if this clock has run already.
        """
        with self._lock:
            if self._state != "new":
                raise RuntimeError(f"this VirtualClock has run already (state {self._state}); make a new one for each simulation")
            self._state = "running"
            main = self._main = self._current = self._new_task("main")
        self._spawn(main, fn, args)
        main.baton.release()
        with self._lock:
            while self._state == "running":
                self._stopped.wait()
        self.close()
        assert self._outcome is not None or self._deadlock is not None
        value: Any = None
        error: BaseException | None = None
        if self._outcome is not None:
            value, error = self._outcome
        if error is not None:
            raise error
        if self._errors:
            raise self._errors[0][1]
        if self._deadlock is not None:
            raise SimulationDeadlock(self._deadlock)
        return value

    def close(self) -> None:
        """Unwind every simulated thread still alive, one at a time, with `SimulationOver`.

        Called by `run()`; idempotent. Raises RuntimeError while the simulation runs.
        """
        with self._lock:
            if self._state == "running":
                raise RuntimeError("close() while the simulation runs: the main function ends it by returning")
            if self._state != "stopped":
                self._state = "closed"
                return
            self._state = "closing"
            tasks = list(self._tasks)
        for task in tasks:
            with self._lock:
                if task.done:
                    continue
                self._current = task
                task.baton.release()
                while not task.done:
                    self._stopped.wait()
        with self._lock:
            self._current = None
            self._state = "closed"

    def blocked(self) -> list[tuple[str, str]]:
        """(thread name, what it waits on) for each blocked simulated thread, oldest thread first."""
        with self._lock:
            return [(t.name, self._describe(t)) for t in self._tasks if not t.done and t.waiting is not None]

    # Scheduling (all called with self._lock held) ---------------------------------------
    def _new_task(self, name: str) -> _Task:
        task = _Task(name)
        self._tasks[task] = None
        self.stats.num_threads += 1
        return task

    def _spawn(self, task: _Task, target: Callable[..., object], args: tuple[Any, ...]) -> None:
        # Daemon: a simulated thread left parked by an interrupted run must not keep the process alive.
        threading.Thread(target=self._thread_main, args=(task, target, args), name=task.name, daemon=True).start()

    def _begin_wait(self, what: str) -> _Task:
        """The calling simulated thread, about to block in `what`, with a fresh wait token."""
        task = self._current
        if task is None or task.ident != threading.get_ident():
            raise RuntimeError(
                f"{what} would block thread {threading.current_thread().name!r}, which is not a simulated thread of this VirtualClock: "
                "run the code under VirtualClock.run() and start threads with clock.thread()"
            )
        if self._state == "closing":
            raise SimulationOver
        task.token = next(self._tokens)
        return task

    def _wait_in(self, queues: tuple[deque[_Entry], ...], what: str, timeout: float | None) -> bool:
        """Park the calling simulated thread in each of `queues` until one wakes it (True) or
        `timeout` passes (False)."""
        task = self._begin_wait(what)
        entry = (task, task.token)
        for queue in queues:
            queue.append(entry)
        woken = False
        try:
            woken = self._block(task, what, timeout)
        finally:
            if not woken or len(queues) > 1:
                for queue in queues:
                    _discard(queue, entry)
        return woken

    def _block(self, task: _Task, what: str, timeout: float | None) -> bool:
        """Park `task` (the running thread) until woken or `timeout` passes: False if it timed out."""
        task.waiting = what
        task.timed_out = False
        task.deadline = None
        if timeout is not None:
            task.deadline = self._now + timeout
            task.timer = True
            heapq.heappush(self._timers, (task.deadline, next(self._sequence), task, task.token))
        nxt = self._pick()
        if nxt is None:
            self._stop(deadlock=self._deadlock_message())
            self._park(task, None)
        elif nxt is not task:
            self._park(task, nxt)
        if self._state == "closing":
            raise SimulationOver
        return not task.timed_out

    def _yield(self, task: _Task) -> None:
        self._runnable.append(task)
        nxt = self._pick()
        if nxt is not task:
            self._park(task, nxt)
        if self._state == "closing":
            raise SimulationOver

    def _park(self, task: _Task, nxt: _Task | None) -> None:
        """Hand the baton to `nxt` (None: nobody) and sleep until it comes back."""
        if nxt is not None:
            self.stats.num_switches += 1
        self._lock.release()
        try:
            if nxt is not None:
                nxt.baton.release()
            task.baton.acquire()
        finally:
            self._lock.acquire()

    def _pick(self) -> _Task | None:
        """The next thread to run, which becomes current; None if none can ever run."""
        if not self._runnable:
            self._advance()
            if not self._runnable:
                return None
        self._current = self._runnable.popleft()
        return self._current

    def _advance(self) -> None:
        """Jump to the earliest pending deadline and wake every wait due then, in the order they began."""
        while self._timers:
            deadline, _, task, token = self._timers[0]
            if task.token != token or task.waiting is None:
                heapq.heappop(self._timers)
                self._num_stale_timers -= 1
                continue
            if self._runnable and deadline > self._now:
                return  # later deadlines wait for these threads
            heapq.heappop(self._timers)
            if deadline > self._now:
                self._now = deadline
                self.stats.num_advances += 1
            task.timer = False
            self._wake(task, token, timed_out=True)

    def _wake(self, task: _Task, token: int, *, timed_out: bool = False) -> bool:
        """Make the wait `token` of `task` runnable, if it is still parked in it."""
        if task.token != token or task.waiting is None:
            return False
        task.waiting = None
        task.timed_out = timed_out
        self._runnable.append(task)
        if task.timer:
            task.timer = False
            self._num_stale_timers += 1
            if self._num_stale_timers > 1024 and 2 * self._num_stale_timers > len(self._timers):
                # Waits notified before their timeout leave entries behind; drop them in bulk.
                self._timers = [e for e in self._timers if e[2].token == e[3] and e[2].waiting is not None]
                heapq.heapify(self._timers)
                self._num_stale_timers = 0
        return True

    def _wake_all(self, queue: deque[_Entry]) -> None:
        while queue:
            self._wake(*queue.popleft())

    def _stop(self, *, deadlock: str | None = None) -> None:
        self._current = None
        self._state = "stopped"
        self._deadlock = deadlock
        self._stopped.notify_all()

    def _describe(self, task: _Task) -> str:
        return f"{task.waiting}" if task.deadline is None else f"{task.waiting} until t={task.deadline}"

    def _deadlock_message(self) -> str:
        blocked = [f"thread {t.name!r} waits on {self._describe(t)}" for t in self._tasks if not t.done and t.waiting is not None]
        return f"at t={self._now} no simulated thread can run and none waits with a timeout: " + "; ".join(blocked)

    # A simulated thread's life ----------------------------------------------------------
    def _thread_main(self, task: _Task, target: Callable[..., object], args: tuple[Any, ...]) -> None:
        task.ident = threading.get_ident()
        task.baton.acquire()
        value: Any = None
        error: BaseException | None = None
        try:
            if self._state != "closing":
                value = target(*args)
        except SimulationOver:
            pass
        except BaseException as e:  # noqa: BLE001  # recorded and re-raised by run()
            error = e
        self._finish(task, value, error)

    def _finish(self, task: _Task, value: Any, error: BaseException | None) -> None:
        with self._lock:
            task.done = True
            del self._tasks[task]
            self._wake_all(task.joiners)
            closing = self._state == "closing"
            if task is self._main and not closing:
                self._outcome = (value, error)
            elif error is not None:
                (self.unwind_errors if closing else self._errors).append((task.name, error))
            if closing:
                self._stopped.notify_all()
                return
            if task is self._main:
                self._stop()
                return
            nxt = self._pick()
            if nxt is None:
                self._stop(deadlock=self._deadlock_message())
                return
            self.stats.num_switches += 1
        nxt.baton.release()

    def _start(self, thread: _Thread) -> _Task:
        with self._lock:
            if self._state == "closing":
                raise SimulationOver
            creator = self._current
            if creator is None or creator.ident != threading.get_ident():
                raise RuntimeError(f"thread {thread.name!r} started from a thread that is not a simulated thread of this VirtualClock")
            task = self._new_task(thread.name)
            self._runnable.append(task)
        self._spawn(task, thread._target, thread._args)
        return task
