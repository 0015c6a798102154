"""TRL's run in `tidal bench e2e` gets what tidal's get: a clock over the same span of work,
the same per-stage torch threads, and the same fp32 held-out evaluation."""

from __future__ import annotations

import time

import pytest

from tidal.tools.bench import trl as bench_trl

SMALL = ["task.num_eval_prompts=20", "algorithm.prompts_per_step=2", "algorithm.group_size=2", "sft.steps=2", "threads=1"]


@pytest.mark.slow
def test_trl_wall_time_leaves_out_trls_setup_as_tidals_leaves_out_its_engines(monkeypatch):
    """tidal builds its train engine (model copy, optimizer) and rollout engine before its clock
    starts; TRL builds its optimizer, scheduler and dataloader and runs accelerate's `prepare`
    inside `trainer.train()`. The TRL clock starts when its first step can start
    (`on_train_begin`), so setup made slower by `setup_s` leaves `rl_seconds` under it."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("trl")
    setup_s = 3.0
    prepare = transformers.Trainer._prepare_for_training

    def slow_prepare(self, *args, **kwargs):
        time.sleep(setup_s)
        return prepare(self, *args, **kwargs)

    monkeypatch.setattr(transformers.Trainer, "_prepare_for_training", slow_prepare)
    summary = bench_trl.run_trl(seed=0, num_steps=2, overrides=SMALL)
    assert summary["steps"] == 2 and summary["samples"] == 2 * 2 * 2
    assert 0 < summary["rl_seconds"] < setup_s
    assert summary["samples_per_s"] == pytest.approx(summary["samples"] / summary["rl_seconds"])


@pytest.mark.slow
def test_trl_generates_with_rollout_threads_and_trains_with_train_threads(monkeypatch):
    """`rollout.threads` / `train.threads` reach TRL as they reach tidal's stages, so the
    `trl-split` baseline (generation on one thread, training on every core) is TRL tuned as
    the fastest sync (`tidal-sync-split`) is; TRL once ran both on the run's `threads`."""
    import torch

    transformers = pytest.importorskip("transformers")
    trl = pytest.importorskip("trl")
    seen: dict[str, set[int]] = {"generate": set(), "loss": set()}
    generate, compute_loss = transformers.GenerationMixin.generate, trl.GRPOTrainer.compute_loss

    def counting_generate(self, *args, **kwargs):
        if kwargs.get("do_sample") is not False:  # TRL's sampling, not the greedy evaluation
            seen["generate"].add(torch.get_num_threads())
        return generate(self, *args, **kwargs)

    def counting_loss(self, *args, **kwargs):
        seen["loss"].add(torch.get_num_threads())
        return compute_loss(self, *args, **kwargs)

    monkeypatch.setattr(transformers.GenerationMixin, "generate", counting_generate)
    monkeypatch.setattr(trl.GRPOTrainer, "compute_loss", counting_loss)
    overrides = [*SMALL, "threads=0", "rollout.threads=1", "train.threads=3"]
    summary = bench_trl.run_trl(seed=0, num_steps=2, overrides=overrides)
    assert summary["steps"] == 2
    assert seen == {"generate": {1}, "loss": {3}}


@pytest.mark.slow
def test_trl_held_out_evaluation_runs_in_float32_as_tidals_does(monkeypatch):
    """tidal evaluates a plain copy of its trainer's fp32 weights, whatever train.precision;
    with `bf16=True` accelerate wraps the TRL model's forward in bf16 autocast, and the
    held-out accuracy after RL was once measured through that wrapper."""
    import torch

    transformers = pytest.importorskip("transformers")
    pytest.importorskip("trl")
    autocast_in_evaluation = []
    generate = transformers.GenerationMixin.generate

    def recording_generate(self, *args, **kwargs):
        if kwargs.get("do_sample") is not False:  # TRL's sampling, not the greedy held-out evaluation
            return generate(self, *args, **kwargs)
        hook = self.get_output_embeddings().register_forward_hook(lambda *_: autocast_in_evaluation.append(torch.is_autocast_enabled("cpu")))
        try:
            return generate(self, *args, **kwargs)
        finally:
            hook.remove()

    monkeypatch.setattr(transformers.GenerationMixin, "generate", recording_generate)
    summary = bench_trl.run_trl(seed=0, num_steps=1, overrides=[*SMALL, "train.precision=bf16"])
    assert summary["steps"] == 1
    assert autocast_in_evaluation and not any(autocast_in_evaluation)  # before RL and after it
