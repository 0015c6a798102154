"""The real-user recipe through the real CLI: `tidal run gsm8k_qwen` on a local Hugging Face
checkpoint and GSM8K-format files (the session fixtures `tiny_hf_dir` and `gsm8k_files`,
built locally), with small overrides.

The reward is swapped, through `task.reward=module:function`, for one the fixture's random
model learns within a few steps (its first token's id even), so "reward goes up" is a
reliable assertion; `max_staleness=0` makes the run repeat itself bit for bit, so a run
cut after a periodic checkpoint and resumed must end as the uninterrupted one did.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tidal.tools.config import load_config
from tidal.tools.recipes import resolve_recipe

SMALL = [
    "device=cpu", "threads=1", "tensorboard=false", "rollout.max_new_tokens=4", "algorithm.num_steps=16", "algorithm.prompts_per_step=8",
    "algorithm.group_size=4", "algorithm.max_staleness=0", "train.micro_batch_size=32", "train.lr=0.03", "train.precision=fp32",
    "model.gradient_checkpointing=false", "task.reward=tidal_test_rewards:first_token_even", "checkpoint_every=8", "--no-progress",
]  # fmt: skip


def test_the_shipped_recipe_runs_once_its_model_and_data_are_named(tiny_hf_dir, gsm8k_files):
    """`gsm8k_qwen.yaml` leaves model.path and data.train_files to the user: it loads as it
    ships, `tidal run` refuses it naming the key until they are set, then accepts it."""
    from tidal.tools.config import ConfigError
    from tidal.tools.run import check_runnable

    recipe = resolve_recipe("gsm8k_qwen")
    cfg = load_config(recipe)
    assert cfg.model.source == "hf" and cfg.task.reward == "math" and cfg.sft.steps == 0
    model, train_files = f"model.path={tiny_hf_dir}", f"data.train_files=[{gsm8k_files['train_parquet']}]"
    for overrides, named in (([], "model.path"), ([model], "set data.train_files"), ([model, train_files, "task.reward=''"], "data.train_files needs task.reward")):
        try:
            check_runnable(load_config(recipe, overrides))
        except ConfigError as e:
            assert named in str(e)
        else:
            raise AssertionError(f"{overrides} was accepted")
    check_runnable(load_config(recipe, [model, train_files]))


def test_gsm8k_recipe_trains_a_local_checkpoint_on_a_data_file_and_resumes_exactly(tidal_cli, tmp_path, tiny_hf_dir, gsm8k_files, runs):
    env = {"PYTHONPATH": str(Path(__file__).parent)}
    data = [f"model.path={tiny_hf_dir}", f"data.train_files=[{gsm8k_files['train_jsonl']}]", f"data.eval_files=[{gsm8k_files['eval_parquet']}]"]
    full = tmp_path / "full"
    out = tidal_cli("run", "gsm8k_qwen", f"run_dir={full}", *data, *SMALL, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "held-out accuracy before RL: 0.0% (10 prompts; no warm start)" in out.stderr  # a random model: no GSM8K answer right
    steps = runs.steps(full)
    assert [m["step"] for m in steps] == list(range(1, 17))
    first, last = sum(m["reward"] for m in steps[:4]) / 4, sum(m["reward"] for m in steps[-4:]) / 4
    assert last > first + 0.2, f"reward did not go up: {first:.2f} -> {last:.2f}"
    summary = json.loads((full / "summary.json").read_text())
    assert summary["steps"] == 16 and summary["accuracy_before"] == 0.0 and summary["accuracy_after"] is not None
    checkpoint = full / "checkpoints" / "step-000008"
    state = json.loads((checkpoint / "state.json").read_text())
    assert state["data"] == {"num_prompts": 40, "seed": 0, "shuffle": True} and state["prompt_position"] >= 8 * 8  # the data position, with what makes it mean the same prompts
    from tidal.engines.tokenizers import HFTokenizer

    assert HFTokenizer.from_pretrained(checkpoint).eos_ids == HFTokenizer.from_pretrained(tiny_hf_dir).eos_ids  # the checkpoint's own tokenizer, both end ids
    assert not (full / "cache" / "initial").exists()  # the checkpoint directory is the initial model's record

    cut = tmp_path / "cut"  # the run as a crash after its step-8 checkpoint left it
    shutil.copytree(checkpoint, cut / "checkpoints" / "step-000008")
    (cut / "checkpoints" / "latest").write_text("step-000008\n")
    resumed = tmp_path / "resumed"
    out = tidal_cli("run", "gsm8k_qwen", f"run_dir={resumed}", f"resume={cut}", *data, *SMALL, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    runs.assert_same(full, resumed, from_step=8, last_step=16)  # the same prompts from the data position on, the same samples, the same weights

    exported = tmp_path / "exported"  # the trained hf model leaves as a directory transformers loads unchanged
    out = tidal_cli("export", str(full), str(exported), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    last = json.loads((full / "summary.json").read_text())["steps"]
    trained = load_file(full / "checkpoints" / f"step-{last:06d}" / "model.safetensors")
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in trained.items())
    tokenizer = AutoTokenizer.from_pretrained(exported)
    assert tokenizer.encode("What is 2+3?") == HFTokenizer.from_pretrained(checkpoint).encode("What is 2+3?", add_bos=False)
