"""A run whose gradients turn non-finite: `tidal run` skips those steps, then stops with an
error, and the checkpoint it leaves holds the last finite weights."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from tidal.engines.torch_train import TorchTrainEngine

SMALL = ["task.num_eval_prompts=8", "sft.steps=2", "algorithm.prompts_per_step=2", "algorithm.group_size=2", "threads=1", "tensorboard=false"]
"""A quickstart of a few seconds (as tests/tools/test_train.py runs it)."""


def test_a_run_whose_gradients_stay_nan_stops_non_zero_and_keeps_finite_weights(tmp_path, monkeypatch, capsys):
    """From RL step 3 on every advantage is NaN (what a reward that overflows float32 in
    the group mean gives; before, every row gets 0.5 more, so steps 1-2 surely train).
    Steps 3-7 are skipped (train.max_nonfinite_steps=5, the default), step 8 stops the run
    with exit code 1 and the error, after a checkpoint at version 7 (the skipped steps still
    count); it and the periodic ones taken meanwhile (steps 4 and 6) hold step 2's weights and
    AdamW state, and the metrics lines stay strict JSON."""
    from tidal.tools.cli import main

    real = TorchTrainEngine.train_step

    def poisoned(self, batch, advantages, **kwargs):
        return real(self, batch, advantages * math.nan if self.version >= 2 else advantages + 0.5, **kwargs)

    monkeypatch.setattr(TorchTrainEngine, "train_step", poisoned)
    run_dir = tmp_path / "run"
    code = main(["run", "quickstart_cpu", "--no-progress", *SMALL, "algorithm.num_steps=10", "checkpoint_every=2", f"run_dir={run_dir}"])
    err = capsys.readouterr().err
    assert code == 1
    assert "tidal run: error: the gradient norm was nan at 6 optimizer steps in a row, the last at version 7; train.max_nonfinite_steps=5" in err
    assert "Traceback" not in err
    assert "Lower train.lr" in err and f"resume={run_dir}" in err  # and how to continue from the last checkpoint
    lines = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl")) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["nonfinite_grad"]) for m in lines] == [(s, float(s > 2)) for s in range(1, 8)]
    assert all(m["grad_norm"] is None for m in lines[2:]) and all(m["grad_norm"] > 0 for m in lines[:2])
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step-000007"
    warm, trained, periodic, latest = (load_file(path / "model.safetensors") for path in (run_dir / "cache" / "warm_start", checkpoints / "step-000002", checkpoints / "step-000006", checkpoints / "step-000007"))
    assert all(torch.isfinite(t).all() and torch.equal(t, trained[name]) and torch.equal(t, periodic[name]) for name, t in latest.items())
    assert not all(torch.equal(t, warm[name]) for name, t in trained.items())  # steps 1-2 trained
    optimizer = torch.load(checkpoints / "step-000007" / "trainer.pt", weights_only=True)["optimizer"]
    assert all(torch.isfinite(v).all() for s in optimizer["state"].values() for v in s.values())
    assert {float(s["step"]) for s in optimizer["state"].values()} == {2.0}  # AdamW stepped twice: the skipped steps left no count
    timeline = json.loads((run_dir / "timeline.json").read_text())  # what the failed run did is kept
    assert sum(e["name"] == "train" and e["ph"] == "X" for e in timeline["traceEvents"]) >= 7



def test_train_max_nonfinite_steps_reaches_the_engine_and_the_run_resumes_from_where_it_stopped(tmp_path, monkeypatch, capsys):
    """`train.max_nonfinite_steps=1`: step 3 is skipped, step 4 stops the run, which saves a
    checkpoint at version 3 first; resumed once the cause is gone, it trains steps 4-6."""
    from tidal.tools.cli import main

    real = TorchTrainEngine.train_step
    monkeypatch.setattr(TorchTrainEngine, "train_step", lambda self, batch, advantages, **kw: real(self, batch, advantages * math.nan if self.version >= 2 else advantages, **kw))
    run_dir = tmp_path / "run"
    args = ["run", "quickstart_cpu", "--no-progress", *SMALL, "algorithm.num_steps=6", "checkpoint_every=100", "train.max_nonfinite_steps=1"]
    assert main([*args, f"run_dir={run_dir}"]) == 1
    assert "the gradient norm was nan at 2 optimizer steps in a row, the last at version 3; train.max_nonfinite_steps=1" in capsys.readouterr().err
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step-000003"
    monkeypatch.setattr(TorchTrainEngine, "train_step", real)
    assert main([*args, f"resume={run_dir}", f"run_dir={tmp_path / 'resumed'}"]) == 0
    record = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    first = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in record] == [1, 2, 3, 4, 5, 6] and record[:3] == [m for m in first if m["step"] <= 3]  # the run's whole record, once
    lines = record[3:]
    assert [(m["step"], m["nonfinite_grad"]) for m in lines] == [(4, 0.0), (5, 0.0), (6, 0.0)]
    assert all(math.isfinite(m["grad_norm"]) for m in lines)
