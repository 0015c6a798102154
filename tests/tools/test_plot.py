"""progress.png: curves against RL steps, smoothed over the raw points, with held-out
accuracy marked (`tools.plot`)."""

from __future__ import annotations

import math
import statistics

import pytest

from tidal.tools.plot import default_span, ema, panels, plot


def _metrics(steps: range, *, response_len: bool = True) -> list[dict]:
    """Per-step metrics as metrics.jsonl holds them: a noisy rising reward."""
    out = []
    for i, step in enumerate(steps):
        m = {"step": step, "reward": min(1.0, 0.2 + 0.01 * i + (0.15 if i % 2 else -0.15)), "samples": 128, "step_s": 0.1 + 0.02 * (i % 3), "time": 1000.0 + i}
        if response_len:
            m["response_len"] = 3.0 + (i % 4)
        out.append(m)
    return out


def test_the_x_data_are_rl_steps_and_the_curves_are_smoothed():
    """The plot was drawn against wall time since the first step, raw points only."""
    metrics = _metrics(range(21, 81))  # a run resumed at step 20
    drawn = panels(metrics, accuracy={"before_rl": 0.25, "after_rl": 0.75})
    assert [p.title for p in drawn] == ["mean reward", "samples / s", "response length (tokens)"]
    for panel in drawn:
        assert panel.steps == list(range(21, 81)) and len(panel.raw) == len(panel.smooth) == 60
    reward = drawn[0]
    assert reward.raw == [m["reward"] for m in metrics]
    jumps = lambda xs: statistics.mean(abs(b - a) for a, b in zip(xs, xs[1:]))
    assert jumps(reward.smooth) < jumps(reward.raw) / 4  # the alternating noise averaged away
    assert reward.marks == [(0, 0.25, "held-out accuracy before RL"), (80, 0.75, "held-out accuracy after RL")]
    assert drawn[1].raw[0] == pytest.approx(128 / 0.1)


def test_no_response_length_panel_or_accuracy_mark_without_them():
    drawn = panels(_metrics(range(1, 4), response_len=False), accuracy={"before_rl": 0.5, "after_rl": None})
    assert [p.title for p in drawn] == ["mean reward", "samples / s"]
    assert drawn[0].marks == [(0, 0.5, "held-out accuracy before RL")]  # a run stopped early has no accuracy after RL


def test_ema_is_debiased_skips_gaps_and_is_raw_at_span_one():
    assert ema([1.0, 2.0, 3.0], span=1) == [1.0, 2.0, 3.0]
    smooth = ema([4.0, math.nan, 4.0, 8.0], span=3)
    assert smooth[:3] == [4.0, 4.0, 4.0] and 4.0 < smooth[3] < 8.0  # not pulled towards 0 at the start; NaN carried over
    assert math.isnan(ema([math.nan, 1.0], span=2)[0])
    assert (default_span(5), default_span(300), default_span(10_000)) == (1, 30, 50)
    with pytest.raises(ValueError, match="span must be >= 1"):
        ema([1.0], span=0)


def test_plot_writes_a_png(tmp_path):
    metrics = _metrics(range(1, 31))
    metrics[3]["step_s"] = 0.0  # a step timed at 0 s: no rate, drawn as a gap
    plot(metrics, tmp_path / "progress.png", accuracy={"before_rl": 0.1, "after_rl": 0.6})
    assert (tmp_path / "progress.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_plot_of_a_step_timed_at_zero_seconds_is_drawn(tmp_path):
    """A step whose clock read 0 s (a coarse clock) divided by zero in the rate: the run
    failed at its very end, after the final checkpoint and before summary.json."""
    steps = [{"step": 1, "time": 1.0, "step_s": 0.0, "samples": 8, "reward": 0.5}, {"step": 2, "time": 1.5, "step_s": 0.5, "samples": 8, "reward": 0.6}]
    plot(steps, tmp_path / "progress.png")
    assert (tmp_path / "progress.png").stat().st_size > 0


def test_a_plot_the_disk_refuses_names_the_file(tmp_path, monkeypatch):
    """A full disk fails inside the PNG writer's buffered write, whose error names no file:
    `tidal run` printed a traceback for progress.png, where every other file it writes gets
    one line naming it (`cli.STORAGE_ERRNOS`)."""
    import errno

    from matplotlib.figure import Figure

    def full_disk(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full_disk)
    with pytest.raises(OSError) as e:
        plot([{"step": 2, "time": 1.5, "step_s": 0.5, "samples": 8, "reward": 0.6}], tmp_path / "progress.png")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "progress.png")


def test_evaluations_during_rl_are_drawn_on_the_reward_panel(tmp_path):
    """The steps whose metrics hold `held_out_accuracy` (`eval_every`), beside the before/after marks."""
    metrics = _metrics(range(1, 11))
    for m, accuracy in zip(metrics[4::5], (0.4, 0.6)):
        m["held_out_accuracy"] = accuracy
    drawn = panels(metrics, accuracy={"before_rl": 0.25, "after_rl": 0.6})
    assert drawn[0].evaluations == [(5, 0.4), (10, 0.6)] and len(drawn[0].marks) == 2
    assert all(not p.evaluations for p in drawn[1:])
    plot(metrics, tmp_path / "progress.png", accuracy={"before_rl": 0.25, "after_rl": 0.6})
    assert (tmp_path / "progress.png").stat().st_size > 0
