"""The clock flow/ waits and reads time through: the real one (the standard library) and the
deterministic virtual one `tidal simulate` runs real threaded code on."""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time

import pytest

from tidal.flow.clock import REAL, Clock, RealClock
from tidal.flow.virtual_clock import SimulationDeadlock, SimulationOver, VirtualClock


# RealClock ------------------------------------------------------------------------------
def test_both_clocks_are_clocks():
    assert isinstance(REAL, RealClock)
    assert isinstance(REAL, Clock)
    assert isinstance(VirtualClock(), Clock)


def test_real_clock_reads_and_sleeps_real_time():
    start = REAL.now()
    assert abs(REAL.wall() - time.time()) < 1.0
    REAL.sleep(0.01)
    assert REAL.now() - start >= 0.01


def test_real_clock_event_and_condition_are_the_standard_library():
    event = REAL.event()
    assert isinstance(event, threading.Event)
    assert event.wait(0.01) is False
    event.set()
    assert event.wait() is True

    lock = threading.RLock()
    cond = REAL.condition(lock)
    assert isinstance(cond, threading.Condition)
    items: list[int] = []

    def produce() -> None:
        with cond:
            items.append(1)
            cond.notify()

    with lock, cond:  # held re-entrantly, as the store does
        thread = REAL.thread(produce, name="producer")
        assert isinstance(thread, threading.Thread) and thread.daemon and thread.name == "producer"
        thread.start()
        assert cond.wait_for(lambda: items, timeout=5) == [1]
    thread.join(5)
    assert not thread.is_alive()


def test_real_clock_futures_and_executor_are_the_standard_library():
    slow, fast = REAL.future(), REAL.future()
    assert isinstance(slow, concurrent.futures.Future)
    fast.set_result("fast")
    done, not_done = REAL.wait_futures([slow, fast], timeout=0.01)
    assert done == {fast} and not_done == {slow}
    with pytest.raises(concurrent.futures.TimeoutError):
        slow.result(timeout=0.01)

    pool = REAL.executor(1, name="tidal-test")
    assert isinstance(pool, concurrent.futures.ThreadPoolExecutor)
    futures = [pool.submit(lambda i: (i, threading.current_thread().name), i) for i in range(3)]
    assert [f.result(5)[0] for f in futures] == [0, 1, 2]
    assert futures[0].result()[1].startswith("tidal-test")
    pool.shutdown(wait=True)


# VirtualClock: time ---------------------------------------------------------------------
def test_sleep_advances_virtual_time_at_once():
    clock = VirtualClock(start_wall=1_000.0)

    def main() -> float:
        clock.sleep(3600)
        return clock.now()

    began = time.perf_counter()
    assert clock.run(main) == 3600.0
    assert time.perf_counter() - began < 0.5
    assert clock.wall() == 1_000.0 + 3600.0
    assert clock.stats.num_advances == 1


def test_sleepers_wake_in_deadline_order_at_their_deadlines():
    clock = VirtualClock()
    woke: list[tuple[str, float]] = []

    def sleeper(seconds: float) -> None:
        clock.sleep(seconds)
        woke.append((threading.current_thread().name, clock.now()))

    def main() -> None:
        threads = [clock.thread(sleeper, name=name, args=(s,)) for name, s in (("late", 7.5), ("early", 2.25))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    clock.run(main)
    assert woke == [("early", 2.25), ("late", 7.5)]
    assert clock.now() == 7.5


def test_equal_deadlines_wake_in_the_order_the_waits_began():
    clock = VirtualClock()
    woke: list[str] = []

    def waiter(name: str, delay: float, event) -> None:
        clock.sleep(delay)
        assert event.wait(5.0 - delay) is False  # every wait ends at t=5
        woke.append(name)

    def main() -> None:
        event = clock.event()
        # Started in one order, beginning their waits in another (by delay): "a" waits first.
        plan = (("c", 2.0), ("a", 0.5), ("d", 3.0), ("b", 1.0))
        threads = [clock.thread(waiter, name=n, args=(n, delay, event)) for n, delay in plan]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert clock.now() == 5.0

    clock.run(main)
    assert woke == ["a", "b", "c", "d"]

    clock = VirtualClock()
    order: list[str] = []

    def sleeper(name: str) -> None:
        clock.sleep(3.0)
        order.append(name)

    def main2() -> None:
        threads = [clock.thread(sleeper, name=n, args=(n,)) for n in ("z", "x", "y")]
        for t in threads:
            t.start()
        clock.sleep(0)  # they start sleeping before main does
        clock.sleep(3.0)
        order.append("main")
        for t in threads:
            t.join()

    clock.run(main2)
    assert order == ["z", "x", "y", "main"]


def test_event_wait_times_out_exactly_at_its_deadline():
    clock = VirtualClock()

    def main() -> tuple[bool, float, bool, float]:
        event = clock.event()
        clock.sleep(1.5)
        timed_out = event.wait(timeout=2.0)
        at = clock.now()
        setter = clock.thread(lambda: (clock.sleep(4.0), event.set()), name="setter")
        setter.start()
        was_set = event.wait(timeout=10.0)
        return timed_out, at, was_set, clock.now()

    assert clock.run(main) == (False, 3.5, True, 7.5)


def test_now_does_not_move_while_a_thread_runs():
    clock = VirtualClock()

    def busy() -> None:
        before = clock.now()
        sum(range(50_000))  # real work takes no virtual time
        assert clock.now() == before

    def main() -> float:
        t = clock.thread(busy, name="busy")
        t.start()
        clock.sleep(1.0)
        t.join()
        return clock.now()

    assert clock.run(main) == 1.0


# VirtualClock: primitives ---------------------------------------------------------------
def test_producer_consumer_on_a_condition_with_an_rlock_held_reentrantly():
    clock = VirtualClock()
    lock = threading.RLock()
    cond = clock.condition(lock)
    queue: list[int] = []
    got: list[tuple[float, int]] = []

    def producer() -> None:
        for i in range(4):
            clock.sleep(1.0)
            with cond:
                queue.append(i)
                cond.notify()

    def consumer() -> None:
        while len(got) < 4:
            with lock, cond:  # two levels: wait must release both and restore both
                while not queue:
                    assert cond.wait() is True
                got.append((clock.now(), queue.pop(0)))
                assert lock._is_owned()  # type: ignore[attr-defined]

    def main() -> None:
        threads = [clock.thread(consumer, name="consumer"), clock.thread(producer, name="producer")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with cond:
            assert cond.wait_for(lambda: False, timeout=2.5) is False
        assert clock.now() == 6.5

    clock.run(main)
    assert got == [(1.0, 0), (2.0, 1), (3.0, 2), (4.0, 3)]


def test_condition_with_a_plain_lock_and_notify_order():
    clock = VirtualClock()
    cond = clock.condition(threading.Lock())
    woke: list[str] = []

    def waiter(name: str) -> None:
        with cond:
            cond.wait()
            woke.append(name)

    def main() -> None:
        threads = [clock.thread(waiter, name=n, args=(n,)) for n in ("p", "q", "r")]
        for t in threads:
            t.start()
        clock.sleep(1.0)
        with cond:
            cond.notify()
        clock.sleep(1.0)
        assert woke == ["p"]
        with cond:
            cond.notify_all()
        for t in threads:
            t.join()
        with pytest.raises(RuntimeError, match="un-acquired"):
            cond.notify()

    clock.run(main)
    assert woke == ["p", "q", "r"]


def test_wait_futures_first_completed_returns_the_earlier_future():
    clock = VirtualClock()

    def main() -> None:
        early, late = clock.future(), clock.future()
        assert isinstance(early, concurrent.futures.Future)
        callbacks: list[float] = []
        early.add_done_callback(lambda f: callbacks.append(clock.now()))
        clock.thread(lambda: (clock.sleep(5.0), late.set_result("late")), name="late").start()
        clock.thread(lambda: (clock.sleep(2.0), early.set_result("early")), name="early").start()
        done, not_done = clock.wait_futures([late, early], return_when=concurrent.futures.FIRST_COMPLETED)
        assert (done, not_done) == ({early}, {late})
        assert clock.now() == 2.0 and callbacks == [2.0]
        done, not_done = clock.wait_futures([late], timeout=1.0)
        assert (done, not_done, clock.now()) == (set(), {late}, 3.0)
        with pytest.raises(concurrent.futures.TimeoutError):
            late.result(timeout=1.0)
        assert late.result() == "late" and clock.now() == 5.0
        done, _ = clock.wait_futures([early, late], return_when=concurrent.futures.ALL_COMPLETED)
        assert done == {early, late}

    clock.run(main)


def test_executor_runs_calls_in_submit_order_on_its_workers():
    clock = VirtualClock()
    ran: list[tuple[float, int, str]] = []

    def job(i: int, seconds: float) -> int:
        ran.append((clock.now(), i, threading.current_thread().name))
        clock.sleep(seconds)
        if i == 3:
            raise ValueError("job 3 fails")
        return i * 10

    def main() -> None:
        pool = clock.executor(1, name="prefetch")
        futures = [pool.submit(job, i, seconds=1.0) for i in range(4)]
        assert [f.result() for f in futures[:3]] == [0, 10, 20]
        assert isinstance(futures[3].exception(), ValueError)
        assert clock.now() == 4.0
        pool.shutdown(wait=True)
        with pytest.raises(RuntimeError, match="shut down"):
            pool.submit(job, 9, 0.0)

        two = clock.executor(2, name="pair")
        start = clock.now()
        pair = [two.submit(clock.sleep, 5.0) for _ in range(3)]
        clock.wait_futures(pair, return_when=concurrent.futures.ALL_COMPLETED)
        assert clock.now() - start == 10.0  # two at once, then the third
        two.shutdown()

    clock.run(main)
    assert ran == [(0.0, 0, "prefetch_0"), (1.0, 1, "prefetch_0"), (2.0, 2, "prefetch_0"), (3.0, 3, "prefetch_0")]


def test_executor_shutdown_cancels_queued_calls():
    clock = VirtualClock()

    def main() -> None:
        pool = clock.executor(1, name="w")
        futures = [pool.submit(clock.sleep, 1.0) for _ in range(3)]
        clock.sleep(0.5)
        pool.shutdown(wait=True, cancel_futures=True)
        assert [f.cancelled() for f in futures] == [False, True, True]
        assert futures[0].done() and clock.now() == 1.0

    clock.run(main)


def test_join_with_a_timeout_and_thread_errors():
    clock = VirtualClock()

    def main() -> None:
        t = clock.thread(clock.sleep, name="sleeper", args=(10.0,))
        with pytest.raises(RuntimeError, match="before it is started"):
            t.join()
        t.start()
        with pytest.raises(RuntimeError, match="only be started once"):
            t.start()
        t.join(timeout=4.0)
        assert t.is_alive() and clock.now() == 4.0
        t.join()
        assert not t.is_alive() and clock.now() == 10.0

    clock.run(main)


# VirtualClock: determinism --------------------------------------------------------------
def _interleaved_trace() -> list[tuple[float, str, str]]:
    clock = VirtualClock()
    trace: list[tuple[float, str, str]] = []
    lock = threading.Lock()  # a real lock, around work that never blocks on the clock
    cond = clock.condition(threading.RLock())
    started = clock.event()
    shared: list[int] = []

    def log(action: str) -> None:
        with lock:
            trace.append((clock.now(), threading.current_thread().name, action))

    def timed_wait(timeout: float) -> bool:
        with cond:
            return cond.wait(timeout)

    def worker(index: int) -> None:
        rng = random.Random(index)
        noise = random.Random()  # real work of a different length on every run: must not matter
        started.wait()
        for step in range(8):
            sum(range(noise.randrange(3000)))
            clock.sleep(rng.choice([0.0, 0.5, 1.0, 1.5]))
            with cond:
                shared.append(index)
                log(f"append {step} len={len(shared)}")
                cond.notify()
            if index % 2 and not timed_wait(0.75):
                log("timed out")

    def main() -> int:
        threads = [clock.thread(worker, name=f"w{i}", args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        clock.sleep(0.25)
        log("go")
        started.set()
        for t in threads:
            t.join()
        return len(shared)

    assert clock.run(main) == 48
    return trace


def test_the_same_scenario_gives_the_same_trace_every_time():
    traces = [_interleaved_trace() for _ in range(5)]
    assert len(traces[0]) > 48
    assert len({t[1] for t in traces[0]}) == 7  # every thread shows up
    for trace in traces[1:]:
        assert trace == traces[0]


def test_many_switches_between_two_threads():
    clock = VirtualClock()
    num_sleeps = 5_000  # 10,000 switches

    def ping() -> int:
        for _ in range(num_sleeps):
            clock.sleep(1.0)
        return num_sleeps

    def main() -> float:
        other = clock.thread(ping, name="other")
        other.start()
        ping()
        other.join()
        return clock.now()

    assert clock.run(main) == float(num_sleeps)
    assert clock.stats.num_advances == num_sleeps
    assert clock.stats.num_switches >= 2 * num_sleeps


# VirtualClock: failures and ending ------------------------------------------------------
def test_deadlock_names_every_blocked_thread():
    clock = VirtualClock()

    def main() -> None:
        for name in ("alpha", "beta"):
            clock.thread(clock.event().wait, name=name).start()
        t = clock.thread(clock.sleep, name="gamma", args=(3.0,))
        t.start()
        t.join()
        never = clock.future()
        never.result()

    with pytest.raises(SimulationDeadlock) as caught:
        clock.run(main)
    message = str(caught.value)
    assert "'alpha' waits on event#" in message and "'beta' waits on event#" in message
    assert "'main' waits on future#" in message and "t=3.0" in message
    assert "gamma" not in message  # it ended


def test_an_error_in_another_thread_is_reraised_by_run():
    clock = VirtualClock()

    def broken() -> None:
        clock.sleep(1.0)
        raise KeyError("lost row")

    def main() -> str:
        clock.thread(broken, name="broken").start()
        clock.sleep(5.0)
        return "main finished"

    with pytest.raises(KeyError, match="lost row"):
        clock.run(main)

    clock = VirtualClock()

    def main_waits_forever() -> None:
        clock.thread(broken, name="broken").start()
        clock.event().wait()  # the broken thread would have set it

    with pytest.raises(KeyError, match="lost row"):
        clock.run(main_waits_forever)


def test_an_error_in_main_is_reraised_by_run():
    clock = VirtualClock()

    def main() -> None:
        clock.sleep(1.0)
        raise ValueError("bad recipe")

    with pytest.raises(ValueError, match="bad recipe"):
        clock.run(main)
    with pytest.raises(RuntimeError, match="has run already"):
        clock.run(main)


def test_close_unwinds_threads_blocked_forever():
    clock = VirtualClock()
    cleaned: list[str] = []
    caught_by_except_exception: list[BaseException] = []

    def stuck(name: str) -> None:
        try:
            while True:
                try:
                    clock.event().wait()
                except Exception as e:  # real code's handlers must not swallow the unwinding
                    caught_by_except_exception.append(e)
        finally:
            cleaned.append(name)

    def runnable_at_the_end() -> None:
        try:
            clock.sleep(100.0)
        except SimulationOver:
            cleaned.append("sleeper")
            raise

    def main() -> str:
        for name in ("s1", "s2"):
            clock.thread(stuck, name=name, args=(name,)).start()
        clock.thread(runnable_at_the_end, name="sleeper").start()
        clock.sleep(1.0)
        clock.thread(lambda: cleaned.append("never ran"), name="late").start()  # runnable, never run, when main returns
        return "done"

    assert clock.run(main) == "done"
    assert cleaned == ["s1", "s2", "sleeper"]
    assert not caught_by_except_exception
    assert clock.blocked() == []
    clock.close()  # idempotent


def test_a_real_lock_around_non_blocking_work_does_not_deadlock():
    clock = VirtualClock()
    lock = threading.Lock()
    counts = {"n": 0}

    def bump(times: int) -> None:
        for _ in range(times):
            with lock:
                counts["n"] += 1
            clock.sleep(0.1)

    def main() -> int:
        threads = [clock.thread(bump, name=f"b{i}", args=(50,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return counts["n"]

    assert clock.run(main) == 150


def test_blocking_outside_a_simulated_thread_is_an_error():
    clock = VirtualClock()
    event = clock.event()
    with pytest.raises(RuntimeError, match="not a simulated thread"):
        event.wait()
    with pytest.raises(RuntimeError, match="not a simulated thread"):
        clock.sleep(1.0)
    with pytest.raises(RuntimeError, match="not a simulated thread"):
        clock.thread(print, name="x").start()
    # What does not block is fine anywhere.
    assert event.wait(0) is False
    event.set()
    assert event.wait() is True
    future = clock.future()
    future.set_result(3)
    assert future.result() == 3 and clock.wait_futures([future]) == ({future}, set())
    with pytest.raises(ValueError, match="futures of this clock"):
        clock.wait_futures([concurrent.futures.Future()])
    with pytest.raises(ValueError, match="non-negative"):
        clock.sleep(-1.0)


def test_a_condition_whose_lock_is_held_across_a_wait_fails_loudly():
    clock = VirtualClock()
    cond = clock.condition(threading.RLock())

    def waiter() -> None:
        with cond:
            cond.wait()

    def main() -> None:
        t = clock.thread(waiter, name="waiter")
        t.start()
        clock.sleep(1.0)
        with cond:
            cond.notify()
            clock.sleep(1.0)  # breaks the rule: blocks on the clock holding the condition's lock

    with pytest.raises(RuntimeError) as caught:
        clock.run(main)
    chain = [caught.value, caught.value.__context__]
    assert any("cannot reacquire its lock" in str(e) for e in chain), chain


def test_wait_futures_first_exception_and_idle_workers_at_the_end():
    clock = VirtualClock()

    def fail_after(seconds: float) -> None:
        clock.sleep(seconds)
        raise OSError("engine lost")

    def main() -> float:
        pool = clock.executor(3, name="engines")  # never shut down: close() unwinds its idle workers
        futures = [pool.submit(clock.sleep, 9.0), pool.submit(fail_after, 4.0), pool.submit(clock.sleep, 1.0)]
        done, not_done = clock.wait_futures(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
        assert done == {futures[1], futures[2]} and not_done == {futures[0]}
        assert [f._serial for f in done] == sorted(f._serial for f in done)  # type: ignore[attr-defined]
        return clock.now()

    assert clock.run(main) == 4.0
    assert clock.blocked() == [] and clock.unwind_errors == []
