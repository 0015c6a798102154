"""A run's per-step metrics: `metrics.jsonl` always, and TensorBoard event files in
`<run_dir>/tensorboard` when the `tensorboard` package is installed (`pip install
tensorboard`, or the `[tensorboard]` extra) and the recipe's `tensorboard` key is true.

TensorBoard gets every number of a step's metrics as a scalar at that step (a mapping of
numbers, such as `wait_s`, as `wait_s/<stage>`); lists such as `groups` stay in the JSONL.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

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


def tensorboard_writer_class() -> Any:
    """torch's `SummaryWriter`, or None when the tensorboard package is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - optional, and slow to import
    except ImportError:
        return None
    return SummaryWriter


class MetricsLog:
    """Appends each step's metrics to `run_dir/metrics.jsonl` (written per step, so a
    crash keeps every finished step) and, when `tensorboard` and the package is
    installed, to TensorBoard (written every few seconds, and at `close`).

    `first_step` is the step the run starts at: TensorBoard drops what an earlier
    attempt in the same run directory wrote from there on.
    """

    def __init__(self, run_dir: Path, *, tensorboard: bool = True, first_step: int = 1) -> None:
        self.path = run_dir / "metrics.jsonl"
        writer_class = tensorboard_writer_class() if tensorboard else None
        self.tensorboard_dir = run_dir / TENSORBOARD_DIR if writer_class is not None else None
        self._writer = None if writer_class is None else writer_class(log_dir=str(self.tensorboard_dir), purge_step=first_step, flush_secs=5)

    def write(self, metrics: Mapping[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self._writer is not None:
            for tag, value in scalars(metrics):
                self._writer.add_scalar(tag, value, global_step=metrics["step"], walltime=metrics.get("time"))

    def write_final(self, values: Mapping[str, float], step: int) -> None:
        """End-of-run numbers (held-out accuracy before and after) at the last step; TensorBoard only."""
        if self._writer is not None:
            for tag, value in scalars(values):
                self._writer.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
