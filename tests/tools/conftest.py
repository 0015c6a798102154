"""Fixtures shared by the tests of tools/: comparing a resumed run with the uninterrupted one."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    """Each step's metrics, less what depends on timing."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in m.items() if k not in ("time", "step_s", "wait_s")} for m in lines]


def _assert_same_run(full: Path, resumed: Path, *, from_step: int, last_step: int = 4) -> None:
    """`resumed` (from `from_step`) ends with `full`'s per-step metrics and final weights. Its
    record holds each step once: from 1 when the run it resumed left a metrics.jsonl (copied up
    to the checkpoint), else (a bare checkpoint folder) from `from_step + 1`."""
    first = _steps(resumed)[0]["step"]
    assert first in (1, from_step + 1)
    assert [m["step"] for m in _steps(resumed)] == list(range(first, last_step + 1))
    assert [m["reward"] for m in _steps(resumed)] == [m["reward"] for m in _steps(full)[first - 1 :]]
    assert _steps(resumed) == _steps(full)[first - 1 :]
    a, b = (load_file(run / "checkpoints" / f"step-{last_step:06d}" / "model.safetensors") for run in (full, resumed))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="session")
def runs() -> types.SimpleNamespace:
    """`runs.steps(run_dir)`: a run's per-step metrics less timings; `runs.assert_same(full,
    resumed, from_step=)`: a resumed run repeats the uninterrupted one."""
    return types.SimpleNamespace(steps=_steps, assert_same=_assert_same_run)
