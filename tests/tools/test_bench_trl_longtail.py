"""TRL on `tidal bench e2e --workload longtail`: `GRPOTrainer` on the gsm8k_qwen recipe, the
workload's checkpoint directory and prompt file, reading the prompt ids tidal's rollout reads."""

from __future__ import annotations

import pytest

from tidal.tools.bench import e2e as bench_e2e
from tidal.tools.bench import trl as bench_trl


@pytest.fixture(scope="module")
def longtail(tmp_path_factory):
    """The workload's files (a fresh build) and the overrides `workload_args` gives them."""
    from tidal.tools.bench.fixture import build_longtail_workload

    files = build_longtail_workload(tmp_path_factory.mktemp("longtail"))
    return [f"model.path={files['model']}", f"data.train_files=[{files['train']}]", *bench_e2e.LONGTAIL_OVERRIDES]


def test_grpo_config_maps_gsm8k_qwen_as_shipped_and_as_the_workload_sets_it(tmp_path, longtail):
    pytest.importorskip("trl")
    from tidal.tools.recipes import resolve_recipe
    from tidal.tools.run import prepare_run

    files = longtail[:2]
    cfg, _ = prepare_run(resolve_recipe("gsm8k_qwen"), [f"run_dir={tmp_path / 'shipped'}", *files])
    args = bench_trl.grpo_config(cfg, tmp_path / "trl")
    assert (args.num_generations, args.per_device_train_batch_size, args.gradient_accumulation_steps, args.generation_batch_size) == (8, 8, 16, 16 * 8)
    assert (args.max_completion_length, args.temperature, args.top_k, args.top_p) == (512, 1.0, 0, 1.0)
    assert (args.learning_rate, args.lr_scheduler_type.value, args.max_grad_norm, args.weight_decay) == (1e-6, "constant", 1.0, 0.0)
    assert (args.epsilon, args.epsilon_high, args.loss_type, args.scale_rewards, args.beta, args.num_iterations) == (0.2, 0.28, "dapo", "group", 0.0, 1)
    assert args.bf16 and args.activation_checkpointing  # train.precision: bf16, model.gradient_checkpointing: true
    assert args.use_cpu and not args.use_vllm and not args.shuffle_dataset

    cfg, _ = prepare_run(resolve_recipe("gsm8k_qwen"), [f"run_dir={tmp_path / 'longtail'}", *longtail])
    args = bench_trl.grpo_config(cfg, tmp_path / "trl")
    assert (args.num_generations, args.per_device_train_batch_size, args.gradient_accumulation_steps, args.generation_batch_size) == (4, 8, 4, 32)
    assert args.steps_per_generation == 4  # one generation of the step's 8 x 4 samples per optimizer step: on-policy
    assert args.max_completion_length == 256 and not args.bf16 and not args.activation_checkpointing


def test_check_prompt_ids_refuses_a_tokenizer_that_reads_the_text_as_other_ids():
    items = [{"prompt": "ab", "prompt_ids": [5, 6]}, {"prompt": "cd", "prompt_ids": [7, 8]}]
    bench_trl.check_prompt_ids(lambda text: {"input_ids": [[5, 6], [7, 8]]}, items)
    with pytest.raises(ValueError, match=r"training prompt 1 \('cd'\) .* from token 0, \[1, 7, 8\] where tidal has \[7, 8\]"):
        bench_trl.check_prompt_ids(lambda text: {"input_ids": [[5, 6], [1, 7, 8]]}, items)  # a BOS tidal's ids lack


@pytest.mark.slow
def test_trl_runs_longtail_from_the_prompt_ids_tidals_rollout_reads(monkeypatch, longtail):
    """Two TRL steps on the workload count their samples and tokens, and TRL's `generate`
    reads, row for row, the prompt ids tidal's rollout engine gets in a sync run of the
    same overrides: the chat-templated GSM8K prompts in the stream's order."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("trl")
    from tidal.engines.hf_rollout import HFRolloutEngine

    small = [*longtail, "rollout.max_new_tokens=24", "algorithm.prompts_per_step=3", "algorithm.group_size=2", "train.micro_batch_size=6"]
    trl_rows: list[list[int]] = []
    generate = transformers.GenerationMixin.generate

    def recording_generate(self, *args, **kwargs):
        if kwargs.get("do_sample") is not False:  # TRL's sampling (a held-out evaluation is greedy; longtail has none)
            for ids, mask in zip(kwargs["input_ids"].tolist(), kwargs["attention_mask"].tolist()):
                trl_rows.append([t for t, m in zip(ids, mask) if m])  # left padding dropped
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(transformers.GenerationMixin, "generate", recording_generate)
    summary = bench_trl.run_trl(seed=0, num_steps=2, overrides=small, recipe="gsm8k_qwen")
    monkeypatch.setattr(transformers.GenerationMixin, "generate", generate)

    assert summary["steps"] == 2 and summary["samples"] == 2 * 3 * 2
    assert summary["rl_seconds"] > 0 and summary["samples_per_s"] == pytest.approx(summary["samples"] / summary["rl_seconds"])
    assert summary["samples_per_s"] <= summary["tokens_per_s"] <= 24 * summary["samples_per_s"]  # 1 .. max_new_tokens tokens each
    assert 1 <= summary["response_len_start"] <= 24 and 1 <= summary["response_len_end"] <= 24
    assert summary["accuracy_before"] is None and summary["accuracy_after"] is None  # no held-out files, as tidal's rows
    assert summary["first_reward"] == 0.0  # the math reward scored them: a random model never earns it

    tidal_rows: list[list[int]] = []
    rollout = HFRolloutEngine.generate

    def recording_rollout(self, trajectories, **kwargs):
        tidal_rows.extend(list(t.prompt_ids) for t in trajectories if not t.tokens)  # fresh rows, not resumed ones
        return rollout(self, trajectories, **kwargs)

    monkeypatch.setattr(HFRolloutEngine, "generate", recording_rollout)
    tidal = bench_e2e.run_tidal(["algorithm.max_staleness=0"], seed=0, num_steps=2, overrides=small, recipe="gsm8k_qwen")
    assert tidal["steps"] == 2
    assert len(trl_rows) == 2 * 3 * 2 and len({tuple(row) for row in trl_rows}) == 2 * 3
    assert trl_rows == tidal_rows[: len(trl_rows)]
    im_start = transformers.AutoTokenizer.from_pretrained(longtail[0].partition("=")[2]).convert_tokens_to_ids("<|im_start|>")
    assert all(row[0] == im_start for row in trl_rows)  # the chat template's ids, system turn first, no BOS added


def test_e2e_longtail_runs_trl_on_the_workloads_recipe_and_overrides(monkeypatch, tmp_path):
    """TRL's systems get the workload's recipe and overrides with the precedence tidal's get
    (workload, system, user: a system's threads win over the workload's), and the "x TRL"
    column is taken against them."""
    from tidal.tools.bench import fixture as bench_fixture

    files = {"model": tmp_path / "model", "train": tmp_path / "train.jsonl"}
    monkeypatch.setattr(bench_fixture, "longtail_workload", lambda: files)  # no build: the files are not read here
    run = {"samples_per_s": 10.0, "tokens_per_s": 800.0, "rl_seconds": 1.0, "accuracy_before": None, "accuracy_after": None}
    calls = []
    monkeypatch.setattr(bench_e2e, "run_tidal", lambda system_overrides, *, overrides, recipe, **_: run)
    monkeypatch.setattr(bench_trl, "available", lambda: True)
    monkeypatch.setattr(bench_trl, "run_trl", lambda *, overrides, recipe, **_: calls.append((recipe, tuple(overrides))) or {**run, "samples_per_s": 5.0})
    results = bench_e2e.run(seeds=[0], num_steps=2, overrides=["rollout.max_new_tokens=64"], systems=["tidal-async", "trl-1t", "trl"], workload="longtail", progress=lambda m: None)
    workload = (f"model.path={files['model']}", f"data.train_files=[{files['train']}]", *bench_e2e.LONGTAIL_OVERRIDES)
    expected = [("gsm8k_qwen", (*workload, *bench_e2e.TRL_SYSTEMS[name], "rollout.max_new_tokens=64")) for name in bench_e2e.TRL_SYSTEMS if name in ("trl", "trl-1t")]
    assert sorted(calls) == sorted(expected)
    header, async_row, *trl_rows = bench_e2e.table(results)
    assert header[3].startswith("x TRL (trl") and async_row[3] == "2.00"
    assert all(row[0].startswith("trl") and row[3] == "1.00" for row in trl_rows)
