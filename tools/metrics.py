"""A run's per-step metrics: `metrics.jsonl` always, TensorBoard event files in
`<run_dir>/tensorboard` when the `tensorboard` package is installed (`pip install
tensorboard`, or the `[tensorboard]` extra) and the recipe's `tensorboard` key is true,
and a Weights & Biases run when `wandb.project` is set (the `[wandb]` extra).

TensorBoard and W&B get every number of a step's metrics as a scalar at that step (a
mapping of numbers, such as `wait_s`, as `wait_s/<stage>`); lists such as `groups` stay in
the JSONL. W&B is a copy: a W&B run that cannot start, or stops taking metrics, is named
in a warning and the run goes on (`wandb sync --sync-tensorboard` uploads the
TensorBoard files later).
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import secrets
import statistics
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from tidal.flow.files import naming, write_whole

log = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"
WANDB_FILE = "wandb.json"
"""The run directory's record of its W&B run (id, project, entity), which a resumed run
continues (`wandb.init(id=..., resume="allow")`)."""
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


class _WandbWriter:
    """One W&B run (`wandb.init`) for a run directory: the one its WANDB_FILE names (a run
    resumed in place, a restarted trainer: the same W&B run goes on), else a new one,
    recorded there. A run resumed into another directory is a branch: a W&B run of its own."""

    def __init__(self, settings: Any, run_dir: Path, *, config: Mapping[str, Any]) -> None:
        import wandb  # noqa: PLC0415 - optional

        saved = _wandb_id(run_dir)
        self.new = saved is None
        run_id = saved or secrets.token_hex(4)
        mode = settings.mode.value if settings.mode is not None else None
        self.run = wandb.init(
            project=settings.project, entity=settings.entity, name=settings.name or run_dir.name, id=run_id, resume="allow",
            config=dict(config), dir=str(run_dir), tags=list(settings.tags) or None, mode=mode,
        )  # fmt: skip
        write_whole(run_dir / WANDB_FILE, json.dumps({"id": run_id, "project": settings.project, "entity": settings.entity}) + "\n")

    def write(self, values: Iterable[tuple[str, float]], step: int) -> None:
        self.run.log(dict(values), step=step)

    def summarize(self, values: Iterable[tuple[str, float]]) -> None:
        self.run.summary.update(dict(values))

    def close(self) -> None:
        self.run.finish()


def _wandb_id(run_dir: Path) -> str | None:
    try:
        found = json.loads((run_dir / WANDB_FILE).read_text()).get("id")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) and found else None


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

    `wandb` (the recipe's `wandb` section): with a `project`, every step also goes to a
    W&B run (`_WandbWriter`) with `config` (the resolved recipe) as its config; a new W&B
    run gets `earlier` first too. W&B keeps a step it already has: after a restart from a
    checkpoint, the steps done again are the earlier attempt's there, as metrics.jsonl
    keeps only the new ones.
    """

    def __init__(
        self, run_dir: Path, *, tensorboard: bool = True, first_step: int = 1, earlier: Sequence[Mapping[str, Any]] = (),
        wandb: Any = None, config: Mapping[str, Any] | None = None,
    ) -> None:  # fmt: skip
        self.path = run_dir / "metrics.jsonl"
        self.tensorboard_dir = run_dir / TENSORBOARD_DIR if tensorboard and tensorboard_installed() else None
        self._writer = None
        if self.tensorboard_dir is not None:
            new = not (self.tensorboard_dir.is_dir() and any(self.tensorboard_dir.iterdir()))
            self._writer = _EventWriter(self.tensorboard_dir, first_step=first_step)
            for metrics in earlier if new else ():
                if metrics["step"] < first_step:
                    self._writer.write(scalars(metrics), metrics["step"], metrics.get("time"))
        self._wandb: _WandbWriter | None = None
        if wandb is not None and wandb.project:
            try:
                self._wandb = _WandbWriter(wandb, run_dir, config=config or {})
            except Exception as e:  # noqa: BLE001 - not logged in, offline, a bad entity: the run goes on without the copy
                self._wandb_failed("could not start", e)
            else:
                for metrics in earlier if self._wandb.new else ():  # a W&B run new to a resumed tidal run: its curves from step 1
                    if metrics["step"] < first_step:
                        self._to_wandb(metrics["step"], scalars(metrics))
        self._file: TextIO | None = None

    def _wandb_failed(self, what: str, error: BaseException) -> None:
        self._wandb = None
        log.warning(
            "W&B logging %s (%s: %s); the run goes on, its metrics in metrics.jsonl%s", what, type(error).__name__, error,
            f" and {self.tensorboard_dir} (`wandb sync --sync-tensorboard {self.tensorboard_dir}` uploads them)" if self.tensorboard_dir is not None else "",
        )  # fmt: skip

    def _to_wandb(self, step: int, values: Iterable[tuple[str, float]], *, summary: bool = False) -> None:
        if self._wandb is None:
            return
        try:
            values = list(values)
            self._wandb.write(values, step)
            if summary:
                self._wandb.summarize(values)
        except Exception as e:  # noqa: BLE001 - a copy: its failure never stops the run
            self._wandb_failed(f"stopped at step {step}", e)

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
        self._to_wandb(metrics["step"], scalars(metrics))

    def write_final(self, values: Mapping[str, Any], step: int) -> None:
        """End-of-run numbers (held-out accuracy before and after) at the last step:
        TensorBoard, and W&B (also its run's summary)."""
        if self._writer is not None:
            self._writer.write(scalars(values), step)
        self._to_wandb(step, scalars(values), summary=True)

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
            if self._wandb is not None:
                wandb, self._wandb = self._wandb, None
                try:
                    wandb.close()
                except Exception as e:  # noqa: BLE001
                    log.warning("W&B run did not finish cleanly (%s: %s); metrics.jsonl has every step", type(e).__name__, e)


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
