"""progress.png: a run's curves against RL steps, smoothed over the raw points.

`panels` computes what is drawn (a pure function, tested without matplotlib); `plot`
draws it. Each panel shows one metric per step as faint raw points and its exponential
moving average as a line; the reward panel marks the held-out accuracy before RL (at
step 0) and after it (at the last step), the numbers summary.json reports, and draws the
evaluations during RL (`eval_every`: the steps whose metrics hold `held_out_accuracy`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidal.flow.files import naming


@dataclass(kw_only=True)
class Panel:
    """One metric of a run, ready to draw."""

    title: str
    """The y-axis label."""
    steps: list[int]
    """The RL step of each point (the x data)."""
    raw: list[float]
    """The metric at each step; NaN where a step has none (a step timed at 0 s has no rate)."""
    smooth: list[float]
    """`ema(raw)`: what the eye should follow."""
    marks: list[tuple[int, float, str]] = field(default_factory=list)
    """Points drawn apart: (step, value, label), such as held-out accuracy."""
    evaluations: list[tuple[int, float]] = field(default_factory=list)
    """(step, held-out accuracy) of the evaluations during RL (`eval_every`), drawn as one line."""


def ema(values: Sequence[float], *, span: int) -> list[float]:
    """The exponential moving average of `values` with weight 2 / (span + 1) on the newest,
    debiased as TensorBoard's smoothing is (the first points are not pulled to 0). NaN
    values are skipped (the average carries over them); before the first finite one, NaN.

    Raises:
        ValueError: `span` < 1.
    """
    if span < 1:
        raise ValueError(f"span must be >= 1, got {span}")
    alpha = 2 / (span + 1)
    out, total, weight = [], 0.0, 0.0
    for value in values:
        if math.isfinite(value):
            total = (1 - alpha) * total + alpha * value
            weight = (1 - alpha) * weight + alpha
        out.append(total / weight if weight else math.nan)
    return out


def default_span(num_points: int) -> int:
    """The smoothing span for a run of `num_points` steps: a tenth of them, 1 to 50 (a
    short run is left almost raw, a long one is smoothed over up to 50 steps)."""
    return max(1, min(50, num_points // 10))


def panels(metrics: Sequence[Mapping[str, Any]], *, accuracy: Mapping[str, float | None] | None = None, span: int | None = None) -> list[Panel]:
    """What `plot` draws for `metrics` (one dict per RL step, as metrics.jsonl holds them).

    Args:
        metrics: per-step metrics with `step`, `reward`, `samples` and `step_s`; those with
            `response_len` add a response-length panel, those with `held_out_accuracy`
            points of the reward panel's `evaluations`.
        accuracy: held-out accuracy, `before_rl` (marked at step 0) and `after_rl`
            (marked at the last step); a missing or None value is not marked.
        span: the moving average's span (default: `default_span`).

    Returns:
        The reward panel, the samples/s panel, then response length when the metrics have it.
    """
    steps = [int(m["step"]) for m in metrics]
    span = span or default_span(len(metrics))

    def panel(title: str, raw: list[float]) -> Panel:
        return Panel(title=title, steps=steps, raw=raw, smooth=ema(raw, span=span))

    reward = panel("mean reward", [_number(m["reward"]) for m in metrics])
    accuracy = accuracy or {}
    if (before := accuracy.get("before_rl")) is not None:
        reward.marks.append((0, float(before), "held-out accuracy before RL"))
    if (after := accuracy.get("after_rl")) is not None and steps:
        reward.marks.append((steps[-1], float(after), "held-out accuracy after RL"))
    reward.evaluations = [(int(m["step"]), float(m["held_out_accuracy"])) for m in metrics if m.get("held_out_accuracy") is not None]
    out = [reward, panel("samples / s", [m["samples"] / m["step_s"] if m["step_s"] else math.nan for m in metrics])]
    if any("response_len" in m for m in metrics):
        out.append(panel("response length (tokens)", [_number(m.get("response_len")) for m in metrics]))
    return out


def _number(value: float | None) -> float:
    """A metric as a float; NaN for None (metrics.jsonl writes a NaN or infinity as null)."""
    return math.nan if value is None else float(value)


def plot(metrics: Sequence[Mapping[str, Any]], path: Path, *, accuracy: Mapping[str, float | None] | None = None) -> None:
    """Draw `panels(metrics, accuracy=accuracy)` to the PNG `path`, against RL steps.

    Raises:
        OSError: naming `path` when the disk refuses the write.
    """
    import matplotlib  # noqa: PLC0415 - only when a plot is written

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.ticker import MaxNLocator  # noqa: PLC0415

    span = default_span(len(metrics))
    drawn = panels(metrics, accuracy=accuracy, span=span)
    fig, axes = plt.subplots(len(drawn), 1, figsize=(8, 2.4 * len(drawn) + 0.6), sharex=True, squeeze=False)
    colors = ("tab:blue", "tab:orange", "tab:green")
    for ax, panel, color in zip(axes[:, 0], drawn, colors):
        ax.plot(panel.steps, panel.raw, ".", color=color, alpha=0.25, markersize=3, label="per step")
        ax.plot(panel.steps, panel.smooth, "-", color=color, linewidth=1.8, label=f"moving average ({span} step{'s' if span > 1 else ''})")
        for (step, value, label), marker in zip(panel.marks, ("o", "*")):
            ax.plot([step], [value], marker, color="black", markersize=9, linestyle="none", label=f"{label}: {value:.1%}")
        if panel.evaluations:
            ax.plot(*zip(*panel.evaluations), "s--", color="black", markersize=4, linewidth=0.8, label="held-out accuracy (eval_every)")
        ax.set_ylabel(panel.title)
        ax.grid(True, alpha=0.3)
        if panel.marks or panel.evaluations:
            ax.legend(loc="best", fontsize=8)
    axes[-1, 0].set_xlabel("RL step")
    axes[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0, 0].set_title("tidal: each RL step (points) and their moving average (line)", fontsize=10)
    fig.tight_layout()
    try:
        with naming(path):  # a full disk fails in the PNG writer's buffered write, which names no file
            fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
