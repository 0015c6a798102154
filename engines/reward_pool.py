"""Reward functions run in worker processes, each sample under a timeout.

`RewardPool.score(fn, trajectories, texts)` is `tidal.engines.rewards.score` moved out
of the trainer's process: the same (rewards, failed indexes) answer, plus the number of
samples that timed out. A reward that raises, returns NaN / inf, hangs past `timeout_s`
or kills its worker process (a segfault in a native parser, `os._exit`) scores 0 and is
counted as failed; a hung worker is killed (by its pid) and a dead one replaced, so the
pool goes on working and the run never stops for a reward.

Why not `concurrent.futures.ProcessPoolExecutor`: it cannot stop one running call, it
does not say which worker runs which call, and when one worker dies the whole executor
is broken and every call in flight fails with it. Here each worker has its own pipe, the
pool knows which sample each worker holds and since when, and losing one worker costs
only that sample.

Workers are started with the `forkserver` method (or `spawn`; never `fork`: the trainer
has threads and a device context), so a reward function must be importable by name
(`module:function`, as `rewards.resolve_reward` gives). Each worker loads the function
before it is handed a sample, so importing its module (sympy, say) is not charged to the
first sample's timeout. Workers are daemon processes: a reward function cannot start
`multiprocessing` children of its own (subprocesses are fine).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import multiprocessing
import pickle
import signal
import time
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, ClassVar, NamedTuple

from tidal.engines.rewards import FLOAT32_MAX, RewardFn
from tidal.flow.trajectory import Trajectory

log = logging.getLogger(__name__)

START_METHODS = ("forkserver", "spawn")


def _until(deadline: float) -> float:
    """Seconds from now to `deadline` (monotonic), at least 0."""
    return max(0.0, deadline - time.monotonic())


class PoolScores(NamedTuple):
    """What `RewardPool.score` returns; unpacks as `rewards, failed, num_timeouts`."""

    rewards: list[float]
    failed: list[int]
    """Indexes of the samples whose reward failed (raised, not finite, timed out or crashed its worker); they score 0."""
    num_timeouts: int
    """How many of `failed` ran past the timeout."""


def _worker_main(conn: Connection, payload: bytes | None) -> None:
    """A worker's loop: load the reward function, then score the samples it is sent.

    Messages in: ("load", pickled fn), ("score", index, trajectory, text), None (exit).
    Messages out: ("ready", None) or ("ready", error text) after each load, and
    ("result", index, value, error text or None) for each sample.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it closes the pool
    fn = None

    def load(data: bytes | None) -> None:
        nonlocal fn
        try:
            fn = None if data is None else pickle.loads(data)
            conn.send(("ready", None))
        except Exception as e:  # noqa: BLE001 - reported to the pool, which raises it
            conn.send(("ready", f"{type(e).__name__}: {e}"))

    load(payload)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the pool is gone
            return
        if message is None:
            return
        if message[0] == "load":
            load(message[1])
            continue
        _, index, trajectory, text = message
        try:
            if fn is None:  # its load failed, which the pool has raised already
                raise RuntimeError("no reward function is loaded")
            value, error = float(fn(trajectory, text)), None
        except Exception as e:  # noqa: BLE001 - a bad reward fails its sample, never the worker
            value, error = 0.0, f"{type(e).__name__}: {e}"
        conn.send(("result", index, value, error))


@dataclasses.dataclass(eq=False)
class _Worker:
    process: Any
    conn: Connection
    ready: bool = False
    sample: int | None = None
    """The index of the sample it holds."""
    deadline: float = math.inf
    """When its sample (or, while starting or loading, its start) runs out of time (monotonic seconds)."""


class RewardPool:
    """Worker processes that score samples with a reward function, each under a timeout.

    Args:
        num_workers: processes scoring at once.
        timeout_s: longest a reward function may take on one sample; past it the sample
            scores 0, is counted, and its worker is killed and replaced.
        start_method: "forkserver" (default: a new worker forks from a server that has the
            modules of `preload` imported, so replacing one is cheap) or "spawn".
        start_timeout_s: longest a worker may take to start and load a function.
        preload: modules the fork server imports once, before it forks the first worker;
            ignored when this process's fork server is already running, or with "spawn".

    Raises:
        ValueError: a bad argument, naming it.

    Use as a context manager, or call `close()`: the workers live until then.
    """

    def __init__(
        self,
        *,
        num_workers: int = 2,
        timeout_s: float = 10.0,
        start_method: str = "forkserver",
        start_timeout_s: float = 120.0,
        preload: Sequence[str] = ("tidal.flow.trajectory",),
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {START_METHODS}, got {start_method!r} (fork copies the trainer's threads and device state)")
        self.num_workers, self.timeout_s, self.start_timeout_s = num_workers, timeout_s, start_timeout_s
        self._context: Any = multiprocessing.get_context(start_method)  # typeshed's BaseContext lacks Process
        if start_method == "forkserver" and preload:
            self._context.set_forkserver_preload(list(preload))
        self._payload: bytes | None = None
        self._fn_name = ""
        self._workers: list[_Worker] = []
        self.num_replaced = 0
        """Workers replaced so far (killed after a timeout, or dead)."""

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the workers now (for logs and for tests that watch replacements)."""
        return [w.process.pid for w in self._workers]

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start_worker(self) -> _Worker:
        parent, child = self._context.Pipe()
        process = self._context.Process(target=_worker_main, args=(child, self._payload), daemon=True, name="tidal-reward")
        process.start()
        child.close()
        return _Worker(process, parent, deadline=time.monotonic() + self.start_timeout_s)

    def _stop(self, worker: _Worker) -> None:
        """Kill `worker`'s process (by its pid: `Process.kill`) and reap it."""
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join()
        worker.conn.close()
        self._workers.remove(worker)

    def _replace(self, worker: _Worker) -> None:
        self._stop(worker)
        self._workers.append(self._start_worker())
        self.num_replaced += 1

    def _load(self, fn: RewardFn) -> None:
        """Make every worker hold `fn` (starting any that are missing) before samples are timed."""
        name = getattr(fn, "__qualname__", repr(fn))
        try:
            payload = pickle.dumps(fn)
        except (pickle.PicklingError, AttributeError, TypeError) as e:
            raise ValueError(f"reward function {name!r} cannot run in worker processes: it must be importable by name (module:function) ({e})") from None
        if payload != self._payload:
            self._payload, self._fn_name = payload, name
            for worker in list(self._workers):
                if not worker.ready:  # still starting with the old function: its answer would be ambiguous
                    self._stop(worker)
                    continue
                try:
                    worker.conn.send(("load", payload))
                except OSError:  # it died while idle
                    self._replace(worker)
                    continue
                worker.ready, worker.deadline = False, time.monotonic() + self.start_timeout_s
        while len(self._workers) < self.num_workers:
            self._workers.append(self._start_worker())
        while not all(w.ready for w in self._workers):
            self._wait_ready()

    def _wait_ready(self) -> None:
        """Take the next "ready" answers of starting or loading workers (`_answer_ready`)."""
        pending = [w for w in self._workers if not w.ready]
        ready = wait([w.conn for w in pending] + [w.process.sentinel for w in pending], timeout=_until(min(w.deadline for w in pending)))
        for worker in pending:
            if worker.conn in ready or worker.process.sentinel in ready or worker.deadline <= time.monotonic():
                self._answer_ready(worker)

    def _answer_ready(self, worker: _Worker) -> None:
        """Read the answer of a starting or loading worker that has one, died, or ran out of time.

        Raises:
            ValueError: it could not load the reward function.
            RuntimeError: it died, or did not answer within `start_timeout_s`.
        """
        if worker.conn.poll():
            try:
                _, error = worker.conn.recv()
            except (EOFError, OSError):
                pass
            else:
                if error is not None:
                    raise ValueError(f"reward function {self._fn_name!r} cannot be loaded in a worker process: {error}")
                worker.ready, worker.deadline = True, math.inf
                return
        code = self._exit_code(worker)
        self._stop(worker)
        if code is None:
            raise RuntimeError(f"a reward worker did not start and load {self._fn_name!r} within {self.start_timeout_s} s")
        raise RuntimeError(f"a reward worker exited (code {code}) while starting or loading {self._fn_name!r}")

    @staticmethod
    def _exit_code(worker: _Worker) -> int | None:
        """Its exit code, or None while it still runs (given a moment to finish exiting)."""
        worker.process.join(0.5)
        return worker.process.exitcode

    def score(self, fn: RewardFn, trajectories: Sequence[Trajectory], texts: Sequence[str]) -> PoolScores:
        """Rewards for every sample, the indexes of failed ones, and how many timed out.

        A sample fails when the function raises, returns NaN, an infinity or a value
        beyond float32's range, runs past `timeout_s` (its worker is killed), or its
        worker dies (os._exit, a crash); a failed sample scores 0.0. Each kind of failure
        of each function is logged once.

        Raises:
            ValueError: `fn` cannot be sent to or loaded in a worker, or the two sequences
                differ in length.
            RuntimeError: a new worker could not start (see `start_timeout_s`).
        """
        if len(trajectories) != len(texts):
            raise ValueError(f"{len(trajectories)} trajectories but {len(texts)} texts")
        self._load(fn)
        rewards = [0.0] * len(texts)
        failed: list[int] = []
        todo = deque(range(len(texts)))
        try:
            num_timeouts = self._run(todo, trajectories, texts, rewards, failed)
        except BaseException:
            for worker in [w for w in self._workers if w.sample is not None]:  # their answers would reach the next batch
                self._stop(worker)
            raise
        return PoolScores(rewards, sorted(failed), num_timeouts)

    def _run(self, todo: deque[int], trajectories: Sequence[Trajectory], texts: Sequence[str], rewards: list[float], failed: list[int]) -> int:
        """Score the samples of `todo` into `rewards` and `failed`; return how many timed out."""
        num_timeouts = 0
        while todo or any(w.sample is not None for w in self._workers):
            self._assign(todo, trajectories, texts)
            waiting = [w for w in self._workers if w.sample is not None or not w.ready]
            ready = wait([w.conn for w in waiting] + [w.process.sentinel for w in waiting], timeout=_until(min(w.deadline for w in waiting)))
            for worker in waiting:
                if not worker.ready:
                    if worker.conn in ready or worker.process.sentinel in ready or worker.deadline <= time.monotonic():
                        self._answer_ready(worker)
                    continue
                k = worker.sample
                assert k is not None  # a ready worker waits only while it holds a sample
                if worker.conn in ready:  # read before looking at the sentinel: it may have answered, then died
                    try:
                        _, index, value, error = worker.conn.recv()
                    except (EOFError, OSError):
                        pass
                    else:
                        assert index == k, f"worker answered sample {index} while holding {k}"
                        worker.sample, worker.deadline = None, math.inf
                        if error is None and (not math.isfinite(value) or abs(value) > FLOAT32_MAX):
                            error = f"ValueError: reward is {value}" + ("" if not math.isfinite(value) else ", beyond float32's range")
                        if error is None:
                            rewards[index] = value
                        else:
                            self._fail(error.partition(":")[0], f"reward function {self._fn_name!r} failed: {error}")
                            failed.append(index)
                        continue
                if worker.conn in ready or worker.process.sentinel in ready:  # died: its pipe closed without an answer
                    self._fail("crashed", f"a reward worker running {self._fn_name!r} exited (code {self._exit_code(worker)}); it was replaced")
                    failed.append(k)
                    self._replace(worker)
                elif worker.deadline <= time.monotonic():
                    self._fail("timeout", f"reward function {self._fn_name!r} took more than {self.timeout_s} s on one sample; its worker was killed and replaced")
                    failed.append(k)
                    num_timeouts += 1
                    self._replace(worker)
        return num_timeouts

    def _assign(self, todo: deque[int], trajectories: Sequence[Trajectory], texts: Sequence[str]) -> None:
        """Hand the next samples to idle workers; the clock of each starts now. An idle
        worker found dead (its pipe broken) is replaced and its sample goes back in line."""
        for worker in list(self._workers):
            if not todo or not worker.ready or worker.sample is not None:
                continue
            k = todo.popleft()
            try:
                worker.conn.send(("score", k, trajectories[k], texts[k]))
            except OSError:
                todo.appendleft(k)
                self._replace(worker)
                continue
            worker.sample, worker.deadline = k, time.monotonic() + self.timeout_s

    _warned: ClassVar[set[tuple[str, str]]] = set()
    """(function, kind of failure) pairs logged already, in this process."""

    def _fail(self, kind: str, message: str) -> None:
        """Log `message` the first time this function fails in this way (later ones are counted, not logged)."""
        key = (self._fn_name, kind)
        if key not in self._warned:
            self._warned.add(key)
            log.warning("%s (the sample scores 0 and is counted as failed; later failures of this kind are counted, not logged)", message)

    def close(self) -> None:
        """Stop every worker: asked to exit, then killed (by pid) if it has not within a second."""
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + 1.0
        for worker in list(self._workers):
            worker.process.join(max(0.0, deadline - time.monotonic()))
            self._stop(worker)
