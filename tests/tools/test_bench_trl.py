"""The TRL column of `tidal bench e2e`: the config mapping and a real run (its tokenizer:
tests/engines/test_tiny_tokenizer.py)."""

from __future__ import annotations

import pytest

from tidal.tools.bench import trl as bench_trl

SMALL = ["task.num_eval_prompts=40", "algorithm.prompts_per_step=4", "algorithm.group_size=4", "threads=1"]


def test_grpo_config_matches_the_recipe(tmp_path):
    pytest.importorskip("trl")
    from tidal.tools.recipes import resolve_recipe
    from tidal.tools.run import prepare_run

    cfg, _ = prepare_run(resolve_recipe("quickstart_cpu"), [f"run_dir={tmp_path / 'run'}", "algorithm.prompts_per_step=6"])
    args = bench_trl.grpo_config(cfg, tmp_path / "trl")
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == args.generation_batch_size == 6 * 8
    assert args.per_device_train_batch_size == 48 and args.num_generations == 8 and args.num_iterations == 1
    assert (args.learning_rate, args.lr_scheduler_type.value, args.max_grad_norm) == (cfg.train.lr, "constant", cfg.train.grad_clip)
    assert (args.max_completion_length, args.temperature, args.top_k, args.top_p) == (6, 1.0, 0, 1.0)
    assert (args.epsilon, args.epsilon_high, args.loss_type, args.scale_rewards, args.beta) == (0.2, 0.28, "dapo", "group", 0.0)
    assert args.use_cpu and not args.bf16 and not args.activation_checkpointing and not args.use_vllm and not args.shuffle_dataset
    cfg, _ = prepare_run(resolve_recipe("quickstart_cpu"), [f"run_dir={tmp_path / 'run-bf16'}", "train.precision=bf16"])
    assert bench_trl.grpo_config(cfg, tmp_path / "trl").bf16


def test_grpo_config_refuses_what_trl_cannot_match(tmp_path):
    pytest.importorskip("trl")
    from tidal.tools.recipes import resolve_recipe
    from tidal.tools.run import prepare_run

    cfg, _ = prepare_run(resolve_recipe("quickstart_cpu"), [f"run_dir={tmp_path / 'run'}", "algorithm.advantage=rloo"])
    with pytest.raises(ValueError, match="algorithm.advantage='rloo'"):
        bench_trl.grpo_config(cfg, tmp_path / "trl")


@pytest.mark.slow
def test_run_trl_trains_from_tidals_warm_start_on_the_same_number_of_samples():
    pytest.importorskip("trl")
    from tidal.tools.bench.e2e import run_tidal

    summary = bench_trl.run_trl(seed=3, num_steps=2, overrides=SMALL)
    assert summary["steps"] == 2 and summary["samples"] == 2 * 4 * 4
    assert 0.0 <= summary["accuracy_before"] <= 1.0 and 0.0 <= summary["accuracy_after"] <= 1.0
    assert summary["rl_seconds"] > 0 and summary["samples_per_s"] == pytest.approx(summary["samples"] / summary["rl_seconds"])
    # each completion has 1 .. max_new_tokens tokens
    assert summary["samples_per_s"] <= summary["tokens_per_s"] <= 6 * summary["samples_per_s"]
    assert 0.0 <= summary["first_reward"] <= 1.0
    tidal = run_tidal(["algorithm.max_staleness=0"], seed=3, num_steps=2, overrides=SMALL)
    assert summary["accuracy_before"] == tidal["accuracy_before"] > 0  # the same warm-started model, the same evaluation
