"""A pipeline timeline in Chrome trace format (opens in Perfetto or chrome://tracing).

Each stage is a track; `with tracer.span("rollout", "generate"):` records one span.
Thread-safe; spans are kept in memory and written once with `save`.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class Tracer:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._start = time.perf_counter()
        self._tracks: dict[str, int] = {}
        self._events: list[dict[str, Any]] = []

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
            return [e for e in self._events if e["ph"] == "X" and (track is None or e["tid"] == tid)]

    def save(self, path: str | Path) -> None:
        with self._lock:
            names = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": track}} for track, tid in self._tracks.items()]
            process = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "tidal"}}]
            Path(path).write_text(json.dumps({"traceEvents": process + names + self._events, "displayTimeUnit": "ms"}))
