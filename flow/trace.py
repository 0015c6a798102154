"""A pipeline timeline in Chrome trace format (opens in Perfetto or chrome://tracing).

Each stage is a track; `with tracer.span("rollout", "generate"):` records one span.
Thread-safe; spans are kept in memory and written once with `save`. Another process's
spans (a Ray rollout actor's) join as a process of their own: it sends `export()`, this
side calls `merge(...)`, aligned by wall clock (exact on one host, as close as the
nodes' clocks elsewhere).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any


class Tracer:
    def __init__(self, process: str = "tidal") -> None:
        self._lock = threading.Lock()
        self._start = time.perf_counter()
        self._epoch = time.time()  # wall clock at `_start`: where another process's spans line up
        self._tracks: dict[str, int] = {}
        self._events: list[dict[str, Any]] = []
        self._processes: dict[int, tuple[str, dict[str, int]]] = {1: (process, self._tracks)}

    def _track(self, name: str) -> int:
        with self._lock:
            return self._tracks.setdefault(name, len(self._tracks) + 1)

    @contextlib.contextmanager
    def span(self, track: str, name: str, **args: Any) -> Iterator[None]:
        tid = self._track(track)
        begin = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            event = {"name": name, "ph": "X", "pid": 1, "tid": tid, "ts": (begin - self._start) * 1e6, "dur": (end - begin) * 1e6}
            if args:
                event["args"] = args
            with self._lock:
                self._events.append(event)

    def instant(self, track: str, name: str, **args: Any) -> None:
        tid = self._track(track)
        event = {"name": name, "ph": "i", "s": "t", "pid": 1, "tid": tid, "ts": (time.perf_counter() - self._start) * 1e6, "args": args}
        with self._lock:
            self._events.append(event)

    def spans(self, track: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            tid = self._tracks.get(track) if track is not None else None
            return [e for e in self._events if e["ph"] == "X" and e["pid"] == 1 and (track is None or e["tid"] == tid)]

    def export(self) -> dict[str, Any]:
        """This tracer's spans, to `merge` into another process's tracer (plain data: picklable, JSON-able)."""
        with self._lock:
            return {"epoch": self._epoch, "tracks": dict(self._tracks), "events": [e for e in self._events if e["pid"] == 1]}

    def merge(self, exported: Mapping[str, Any], *, process: str) -> None:
        """Add another tracer's `export()` as the process `process`, its times moved onto this
        tracer's clock by the two tracers' wall-clock starts."""
        shift = (exported["epoch"] - self._epoch) * 1e6
        with self._lock:
            pid = max(self._processes) + 1
            self._processes[pid] = (process, dict(exported["tracks"]))
            self._events.extend({**e, "pid": pid, "ts": e["ts"] + shift} for e in exported["events"])

    def save(self, path: str | Path) -> None:
        with self._lock:
            meta = []
            for pid, (process, tracks) in self._processes.items():
                meta.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": process}})
                meta.extend({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": track}} for track, tid in tracks.items())
            Path(path).write_text(json.dumps({"traceEvents": meta + self._events, "displayTimeUnit": "ms"}))


class Waits:
    """Seconds each stage waited: added by the stages' threads, taken (and reset) by the
    thread that reports a step, without losing an addition made while it takes them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = {}

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self._seconds[stage] = self._seconds.get(stage, 0.0) + seconds

    def take(self) -> dict[str, float]:
        """The seconds added since the last `take`, by stage."""
        with self._lock:
            seconds, self._seconds = self._seconds, {}
            return seconds
