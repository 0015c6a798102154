"""Liveness under `runtime: ray`: noticing an actor that is alive but answers nothing.

A process that dies is noticed at once (its calls fail, and the restart path runs); one that
stops answering (stopped by SIGSTOP, paused in a debugger, its machine swapping) is not: the
run just stops, until a lease or a receive timeout, an hour later, says so. `Liveness` sends
each watched actor a cheap `ping` call and judges it by the time since its last answer:
silent for `silent_s`, it is reported (a warning naming it and how long it has been silent,
and `num_silences`); silent `grace_s` longer, it is handed back to be killed, which makes it
a death that the usual restart path handles (`fault.rollout_restarts`,
`fault.trainer_restarts`).

It has no thread of its own: the loop that already waits on the actors (the driver's on the
trainer ranks, the trainer's on the rollout actors) calls `check`, which never waits, about
every `every_s`.

Receiving weights is two waits: for the trainer to start the next version, which may be a
long step, an evaluation or a checkpoint away and is bounded by liveness alone, and for a
version that started to arrive, bounded by `transfer_timeout_s` of its size.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

TRANSFER_BASE_S = 30.0
"""What any weight transfer that started may take, whatever its size."""
TRANSFER_MIN_BYTES_PER_S = 50e6
"""The slowest a started transfer may go before it counts as stopped: a 1 Gb/s link shared
by a few receivers, or a sender that gathers each bucket from sharded ranks."""


def transfer_timeout_s(nbytes: int) -> float:
    """How long a weight version of `nbytes` may take to arrive once it started."""
    return TRANSFER_BASE_S + nbytes / TRANSFER_MIN_BYTES_PER_S


class Liveness:
    """Pings `actors` (each with a `ping` method that answers at once) and notices the silent.

    Args:
        actors: Ray actor handles.
        name: names actor `i` in messages (its role, index and pid).
        silent_s: silence after which an actor is reported; 0 turns the checks off.
        grace_s: further silence after which it is handed back by `check` to be killed.
        clock: seconds, monotonic (injected by tests).
    """

    def __init__(self, actors: Sequence[Any], name: Callable[[int], str], *, silent_s: float, grace_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.actors, self.name, self.silent_s, self.grace_s, self.clock = list(actors), name, silent_s, grace_s, clock
        now = clock()
        self._heard = [now] * len(self.actors)  # last answer (or first ping, or return from a restart)
        self._sent = [-float("inf")] * len(self.actors)  # last ping
        self._asked: dict[Any, int] = {}  # ping in flight -> actor
        self._warned: set[int] = set()
        self.killed: set[int] = set()
        """Actors handed back to be killed and not back since (`reset`)."""
        self.num_silences = 0
        """Times an actor went silent for `silent_s` (each silence counted once)."""

    @property
    def on(self) -> bool:
        return self.silent_s > 0

    @property
    def every_s(self) -> float:
        """How often `check` should be called (and an actor pinged): a quarter of `silent_s`,
        so a silence is noticed within about 1.25 `silent_s`."""
        return self.silent_s / 4

    def check(self) -> list[int]:
        """Collect the answers in, ping each actor with none in flight (at most every
        `every_s`), report the newly silent; return the actors silent for
        `silent_s + grace_s` (each once) to kill."""
        if not self.on:
            return []
        import ray  # noqa: PLC0415

        now = self.clock()
        if self._asked:
            ready, _ = ray.wait(list(self._asked), num_returns=len(self._asked), timeout=0)
            for ref in ready:
                i = self._asked.pop(ref)
                try:
                    ray.get(ref)
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                    pass  # dead or restarting: not silent (the restart path hears of it)
                self._heard_from(i, now)
        waiting = set(self._asked.values())
        for i, actor in enumerate(self.actors):
            if i not in waiting and i not in self.killed and now - self._sent[i] >= self.every_s:
                if self._sent[i] == -float("inf"):
                    self._heard[i] = now  # judged from its first ping, not from when this was made
                self._asked[actor.ping.remote()] = i
                self._sent[i] = now
        kill = []
        for i in range(len(self.actors)):
            silent = now - self._heard[i]
            if i in self.killed or silent < self.silent_s:
                continue
            if i not in self._warned:
                self._warned.add(i)
                self.num_silences += 1
                log.warning("%s has not answered for %.0fs (stopped, or its machine overloaded?); it is killed as dead if silent %.0fs more (fault.liveness_s, fault.liveness_grace_s)", self.name(i), silent, max(self.silent_s + self.grace_s - silent, 0.0))
            if silent >= self.silent_s + self.grace_s:
                log.warning("%s was silent for %.0fs: killing it, which counts as its death", self.name(i), silent)
                self.killed.add(i)
                kill.append(i)
        return kill

    def reset(self, i: int) -> None:
        """Actor `i` is back from a restart: judged from now. A ping its old process had in
        flight fails or is answered by the new one soon (and is collected, not dropped: Ray
        logs an error nobody fetched)."""
        self.killed.discard(i)
        self._warned.discard(i)
        self._heard[i] = self.clock()

    def _heard_from(self, i: int, now: float) -> None:
        if i in self._warned:
            log.warning("%s answered again after %.0fs of silence", self.name(i), now - self._heard[i])
            self._warned.discard(i)
        self._heard[i] = now


STALL_FIRST_S = 1800.0
"""Before the first step (models loading, the untrained evaluation, a warm start): how long
with no step before `StepStall` speaks."""
STALL_FLOOR_S = 600.0
"""After it: the least silence `StepStall` speaks after, whatever the steps took."""
STALL_STEPS = 10.0
"""After it: `StepStall` speaks once no step finished for this many times the median step."""


class StepStall:
    """Notices a run whose steps stopped while every actor still answers its pings: a rank
    waiting in a collective the other ranks never join (ranks that disagree on what to run)
    answers, so `Liveness` sees nothing, and the run hangs without a word until the group's
    timeout, or for ever where the collective has none.

    `check(step)` is called about once a second with the last finished step (None before the
    first) and returns a message once no step has finished for `STALL_FIRST_S` (before the
    first), or for `STALL_STEPS` times the median step and at least `STALL_FLOOR_S` (after),
    once per stall; a warning only: a long evaluation or checkpoint may be all it is.

    Args:
        pids: names the processes to look into (`py-spy dump --pid PID`), for the message.
        clock: seconds, monotonic (injected by tests).
    """

    def __init__(self, pids: str, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.pids, self.clock = pids, clock
        self._step: int | None = None
        self._since = clock()
        self._step_s: list[float] = []
        self._spoke = False

    def limit_s(self) -> float:
        """The silence after which `check` speaks now."""
        return max(STALL_FLOOR_S, STALL_STEPS * statistics.median_high(self._step_s)) if self._step_s else STALL_FIRST_S

    def check(self, step: int | None) -> str | None:
        now = self.clock()
        step = self._step if step is None else step  # a line being written reads as none
        if step != self._step:
            if self._step is not None and step is not None and step > self._step:
                self._step_s.append((now - self._since) / (step - self._step))
            self._step, self._since, self._spoke = step, now, False
            return None
        silent = now - self._since
        if self._spoke or silent <= self.limit_s():
            return None
        self._spoke = True
        after = "since the run started" if step is None else f"since step {step}"
        pace = f"; steps took {statistics.median_high(self._step_s):.1f}s (median)" if self._step_s else ""
        return (
            f"no RL step has finished for {silent:.0f}s ({after}{pace}), though every trainer rank answers: if none is computing, "
            f"one may wait in a collective the others never join; `py-spy dump --pid PID` shows where each is ({self.pids})"
        )
