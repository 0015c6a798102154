"""A run's per-step metrics: `metrics.jsonl` always, and TensorBoard event files in
`<run_dir>/tensorboard` when the `tensorboard` package is installed (`pip install
tensorboard`, or the `[tensorboard]` extra) and the recipe's `tensorboard` key is true.

TensorBoard gets every number of a step's metrics as a scalar at that step (a mapping of
numbers, such as `wait_s`, as `wait_s/<stage>`); lists such as `groups` stay in the JSONL.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import statistics
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from tidal.flow.files import naming

TENSORBOARD_DIR = "tensorboard"
_NOT_SCALARS = ("step", "time")


def scalars(metrics: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """(tag, value) for each number in `metrics`, nested mappings as `outer/inner`."""
    for key, value in metrics.items():
        if key in _NOT_SCALARS and not prefix:
            continue
        if isinstance(value, Mapping):
            yield from scalars(value, f"{prefix}{key}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield f"{prefix}{key}", float(value)


class _EventWriter:
    """TensorBoard's event file writer (the `tensorboard` package's own, not torch's
    `SummaryWriter`): one event per step with every scalar in it, where `add_scalar` per
    number cost the trainer's thread about ten times as much."""

    def __init__(self, folder: Path, *, first_step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog  # noqa: PLC0415 - optional
        from tensorboard.compat.proto.summary_pb2 import Summary  # noqa: PLC0415
        from tensorboard.summary.writer.event_file_writer import EventFileWriter  # noqa: PLC0415

        self._event, self._summary = Event, Summary
        self._file = EventFileWriter(str(folder), flush_secs=5)
        # TensorBoard drops the events at steps >= first_step that an earlier attempt wrote
        self._file.add_event(Event(wall_time=time.time(), step=first_step, session_log=SessionLog(status=SessionLog.START)))

    def write(self, values: Iterable[tuple[str, float]], step: int, wall_time: float | None = None) -> None:
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=value) for tag, value in values])
        self._file.add_event(self._event(wall_time=wall_time or time.time(), step=step, summary=summary))

    def close(self) -> None:
        self._file.close()


def tensorboard_installed() -> bool:
    try:
        for name in ("tensorboard", "tensorboard.summary.writer.event_file_writer"):
            importlib.import_module(name)
    except ImportError:
        return False
    return True


def finite(value: Any) -> Any:
    """`value` with every NaN and infinite float as None: standard JSON (`null`), which jq
    and other strict parsers read (Python's `json` writes NaN, which they refuse)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


class MetricsLog:
    """Appends each step's metrics to `run_dir/metrics.jsonl` (written per step, so a
    crash keeps every finished step) and, when `tensorboard` and the package is
    installed, to TensorBoard (written every few seconds, and at `close`).

    The JSONL file stays open, line-buffered, until `close`: opening and closing it for
    every step cost the trainer's step time, most where its other threads took the GIL
    at the open or the close.

    `first_step` is the step the run starts at: TensorBoard drops what an earlier
    attempt in the same run directory wrote from there on. `earlier`: a resumed run's
    steps before `first_step` (as its metrics.jsonl holds them); a TensorBoard folder
    that is new here (a run resumed into a new directory) gets them first, so its curves
    cover the whole run as metrics.jsonl does. A folder an earlier attempt wrote has them.
    """

    def __init__(self, run_dir: Path, *, tensorboard: bool = True, first_step: int = 1, earlier: Sequence[Mapping[str, Any]] = ()) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.tensorboard_dir = run_dir / TENSORBOARD_DIR if tensorboard and tensorboard_installed() else None
        self._writer = None
        if self.tensorboard_dir is not None:
            new = not (self.tensorboard_dir.is_dir() and any(self.tensorboard_dir.iterdir()))
            self._writer = _EventWriter(self.tensorboard_dir, first_step=first_step)
            for metrics in earlier if new else ():
                if metrics["step"] < first_step:
                    self._writer.write(scalars(metrics), metrics["step"], metrics.get("time"))
        self._file: TextIO | None = None

    def write(self, metrics: Mapping[str, Any]) -> None:
        """Append one step's line (and its TensorBoard scalars).

        Raises:
            OSError: naming `metrics.jsonl`, when the disk refuses the line (full, over
                quota). The line stays buffered: a later `write` or `close` on a disk with
                room writes it first, whole.
        """
        if self._file is None:
            self._file = self.path.open("a", buffering=1, encoding="utf-8")  # line-buffered: each step's line is written at once
        with naming(self.path):
            self._file.write(json.dumps(finite(metrics), allow_nan=False) + "\n")
        if self._writer is not None:
            self._writer.write(scalars(metrics), metrics["step"], metrics.get("time"))

    def write_final(self, values: Mapping[str, Any], step: int) -> None:
        """End-of-run numbers (held-out accuracy before and after) at the last step; TensorBoard only."""
        if self._writer is not None:
            self._writer.write(scalars(values), step)

    def close(self) -> None:
        """Close both files.

        Raises:
            OSError: naming `metrics.jsonl`, when the disk still refuses the line a `write`
                could not write (TensorBoard's file is closed all the same).
        """
        file, self._file = self._file, None
        try:
            if file is not None:
                with naming(self.path):
                    file.close()
        finally:
            if self._writer is not None:
                self._writer.close()
                self._writer = None


def last_metrics(path: Path) -> dict[str, Any] | None:
    """The last whole line of a `metrics.jsonl`, read from the file's tail (a long run's
    file is tens of MB, and the Ray driver reads it every second for its progress bar);
    None when there is none yet, or the line is being written."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            lines = f.read().splitlines()
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):  # not there yet, or a line cut short (`{"wait_s": {"a": 1}` ends with "}" too)
        return None


def length_drift(lengths: Sequence[float]) -> dict[str, float]:
    """`response_len_start` / `response_len_end`: the mean of `lengths` (one per step, in
    order) over the first and the last tenth of the steps (at least one step each)."""
    if not lengths:
        return {}
    tenth = max(len(lengths) // 10, 1)
    return {"response_len_start": statistics.mean(lengths[:tenth]), "response_len_end": statistics.mean(lengths[-tenth:])}
