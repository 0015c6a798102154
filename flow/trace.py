"""A pipeline timeline in Chrome trace format (opens in Perfetto or chrome://tracing).

Each stage is a track; `with tracer.span("rollout", "generate"):` records one span.
Thread-safe; spans are kept in memory and written with `save`. Another process's
spans (a Ray rollout actor's) join as a process of their own: it sends `export()`, this
side calls `merge(...)`, aligned by wall clock (exact on one host, as close as the
nodes' clocks elsewhere).

A tracer keeps its most recent `max_events` events (`MAX_EVENTS` by default) and counts
the ones it dropped (the saved file's `otherData.dropped_events`, by process), so a long
run's timeline stays a bounded size. A span still open when the tracer is saved or
exported (a stage that hung, or had not finished when the run stopped) is written up to
that moment with `"unfinished": true` in its args.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from tidal.flow.clock import REAL, Clock
from tidal.flow.files import write_whole

MAX_EVENTS = 200_000
"""Events a tracer keeps by default: about 110 MB of memory and a 30 MB file, the last
~30k steps of the quickstart (about 6 events a step)."""


class Tracer:
    def __init__(self, process: str = "tidal", *, max_events: int = MAX_EVENTS, clock: Clock = REAL) -> None:
        if max_events < 1:
            raise ValueError(f"max_events={max_events} must be >= 1")
        self._lock = threading.Lock()
        self._clock = clock  # a simulation's virtual clock: its timeline is the simulated run's
        self._start = clock.now()
        self._epoch = clock.wall()  # wall clock at `_start`: where another process's spans line up
        self._tracks: dict[str, int] = {}
        self._events: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_events)  # this process's, oldest dropped first
        self._merged: list[dict[str, Any]] = []  # other processes' (each bounded by its own tracer)
        self._open: dict[int, dict[str, Any]] = {}  # spans entered and not yet left, by entry
        self._entries = itertools.count()
        self._processes: dict[int, tuple[str, dict[str, int]]] = {1: (process, self._tracks)}
        self._dropped: dict[int, int] = {1: 0}

    def _track(self, name: str) -> int:
        with self._lock:
            return self._tracks.setdefault(name, len(self._tracks) + 1)

    def _now_us(self) -> float:
        return (self._clock.now() - self._start) * 1e6

    def _append(self, event: dict[str, Any]) -> None:
        """Keep `event` (the lock held), counting the oldest one it pushes out."""
        if len(self._events) == self._events.maxlen:
            self._dropped[1] += 1
        self._events.append(event)

    @contextlib.contextmanager
    def span(self, track: str, name: str, **args: Any) -> Iterator[None]:
        tid = self._track(track)
        entry = next(self._entries)
        start = self._now_us()
        event: dict[str, Any] = {"name": name, "ph": "X", "pid": 1, "tid": tid, "ts": start}
        if args:
            event["args"] = args
        with self._lock:
            self._open[entry] = event
        try:
            yield
        finally:
            end = self._now_us()
            with self._lock:
                event["dur"] = end - start
                del self._open[entry]
                self._append(event)

    def instant(self, track: str, name: str, **args: Any) -> None:
        tid = self._track(track)
        event = {"name": name, "ph": "i", "s": "t", "pid": 1, "tid": tid, "ts": self._now_us(), "args": args}
        with self._lock:
            self._append(event)

    def spans(self, track: str | None = None) -> list[dict[str, Any]]:
        """This process's finished spans (of `track`, or every track), oldest first."""
        with self._lock:
            tid = self._tracks.get(track) if track is not None else None
            return [e for e in self._events if e["ph"] == "X" and (track is None or e["tid"] == tid)]

    def _own_events(self) -> list[dict[str, Any]]:
        """This process's events (the lock held), spans still open among them as they stand now."""
        now = self._now_us()
        unfinished = [{**e, "dur": now - e["ts"], "args": {**e.get("args", {}), "unfinished": True}} for e in self._open.values()]
        return [*self._events, *unfinished]

    def export(self) -> dict[str, Any]:
        """This tracer's events, to `merge` into another process's tracer (plain data: picklable, JSON-able)."""
        with self._lock:
            return {"epoch": self._epoch, "tracks": dict(self._tracks), "events": self._own_events(), "dropped": self._dropped[1]}

    def merge(self, exported: Mapping[str, Any], *, process: str) -> None:
        """Add another tracer's `export()` as the process `process`, its times moved onto this
        tracer's clock by the two tracers' wall-clock starts."""
        shift = (exported["epoch"] - self._epoch) * 1e6
        with self._lock:
            pid = max(self._processes) + 1
            self._processes[pid] = (process, dict(exported["tracks"]))
            self._dropped[pid] = exported.get("dropped", 0)  # an export from before it was counted: none
            self._merged.extend({**e, "pid": pid, "ts": e["ts"] + shift} for e in exported["events"])

    def save(self, path: str | Path) -> None:
        """Write the timeline to `path` whole or not at all: through a temporary file beside
        it, renamed over it, so a full disk or a kill part way leaves the previous file."""
        with self._lock:
            meta = []
            for pid, (process, tracks) in self._processes.items():
                meta.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": process}})
                meta.extend({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": track}} for track, tid in tracks.items())
            trace: dict[str, Any] = {"traceEvents": meta + self._own_events() + self._merged, "displayTimeUnit": "ms"}
            dropped = {self._processes[pid][0]: n for pid, n in self._dropped.items() if n}
            if dropped:
                trace["otherData"] = {"dropped_events": dropped}
        write_whole(Path(path), json.dumps(trace))


class Waits:
    """Seconds each stage waited: added by the stages' threads, taken (and reset) by the
    thread that reports a step, without losing an addition made while it takes them."""

    def __init__(self, *, clock: Clock = REAL) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._seconds: dict[str, float] = {}
        self._ongoing: dict[int, tuple[str, float]] = {}  # a `waiting` block's id -> (stage, when it began or was last taken)
        self._ids = itertools.count()

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self._seconds[stage] = self._seconds.get(stage, 0.0) + seconds

    @contextlib.contextmanager
    def waiting(self, stage: str) -> Iterator[None]:
        """Count the time inside as `stage`'s wait. A `take` meanwhile gets the part so far,
        so a wait that spans a step's report counts on each step's line as it passes (added
        only at its end, a long one landed whole on a later step's)."""
        key = next(self._ids)
        with self._lock:
            self._ongoing[key] = (stage, self._clock.now())
        try:
            yield
        finally:
            with self._lock:
                stage, since = self._ongoing.pop(key)  # a `take` from here on leaves the rest to this `add`
            self.add(stage, self._clock.now() - since)

    def take(self) -> dict[str, float]:
        """The seconds waited since the last `take`, by stage (waits still going on: their part so far)."""
        with self._lock:
            now = self._clock.now()
            for key, (stage, since) in self._ongoing.items():
                self._seconds[stage] = self._seconds.get(stage, 0.0) + now - since
                self._ongoing[key] = (stage, now)
            seconds, self._seconds = self._seconds, {}
            return seconds
