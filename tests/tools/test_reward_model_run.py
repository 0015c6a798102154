"""A reward model in a real run: `tidal run gsm8k_qwen` on the local checkpoint and GSM8K-format
files (session fixtures), scored by a small sequence-classification model built here whose
score depends on the response's last token alone, so the policy learns it in a few steps."""

from __future__ import annotations

import json

import pytest

from tests.tools.test_gsm8k_run import SMALL
from tidal.tools.bench.fixture import build_tiny_reward_model


@pytest.fixture(scope="module")
def last_token_rm(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_reward_model(tmp_path_factory.mktemp("rm"), chat_template=False, last_token_only=True)


def test_a_run_scored_by_a_reward_model_alone_raises_its_score(tidal_cli, tmp_path, tiny_hf_dir, gsm8k_files, last_token_rm, runs):
    run_dir = tmp_path / "run"
    keys = [k for k in SMALL if not k.startswith("task.reward=")]
    data = [f"model.path={tiny_hf_dir}", f"data.train_files=[{gsm8k_files['train_jsonl']}]", f"data.eval_files=[{gsm8k_files['eval_parquet']}]"]
    out = tidal_cli("run", "gsm8k_qwen", f"run_dir={run_dir}", *data, *keys, "task.reward=none", f"reward_model.path={last_token_rm}", "reward_model.batch_size=5", "eval_every=4", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = runs.steps(run_dir)
    first, last = sum(m["reward"] for m in steps[:4]) / 4, sum(m["reward"] for m in steps[-4:]) / 4
    assert last > first + 3, f"the reward model's score did not go up: {first:.2f} -> {last:.2f}"
    assert any(r not in (0.0, 1.0) for m in steps for group in m["rewards"] for r in group)  # the model's scores, not a verifier's
    assert all(m["reward_function"] == 0.0 for m in steps)  # the reward's parts: none from a function, the model's scores
    assert sum(m["reward_model_score"] for m in steps[-4:]) / 4 > sum(m["reward_model_score"] for m in steps[:4]) / 4 + 3
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["accuracy_before"] is None and summary["accuracy_after"] is None  # no function to measure accuracy with
    assert not any("held_out_accuracy" in m for m in steps) and "held-out accuracy" not in out.stderr, out.stderr[-2000:]
    assert "the 10 held-out prompts are not scored: task.reward=none has no function to score answers with" in " ".join(out.stderr.split())  # as the console wraps it
    config = (run_dir / "config.yaml").read_text()
    assert f"path: {last_token_rm}" in config and "reward: none" in config


def test_a_reward_model_run_is_refused_before_it_starts_when_its_keys_do_not_fit(tidal_cli, tmp_path, tiny_hf_dir, gsm8k_files):
    data = [f"model.path={tiny_hf_dir}", f"data.train_files=[{gsm8k_files['train_jsonl']}]"]
    out = tidal_cli("run", "gsm8k_qwen", f"run_dir={tmp_path / 'a'}", *data, "task.reward=none", cwd=tmp_path)
    assert out.returncode != 0 and "task.reward=none leaves nothing to score the answers: set reward_model.path" in out.stderr
    out = tidal_cli("run", "gsm8k_qwen", f"run_dir={tmp_path / 'b'}", *data, f"reward_model.path={tmp_path / 'missing'}", cwd=tmp_path)
    assert out.returncode != 0 and f"reward_model.path={str(tmp_path / 'missing')!r} does not exist or is not a folder" in out.stderr
    out = tidal_cli("run", "gsm8k_qwen", f"run_dir={tmp_path / 'c'}", *data, f"reward_model.path={tiny_hf_dir}", cwd=tmp_path)
    assert out.returncode != 0 and not (tmp_path / "c").exists() and "architectures are ['Qwen2ForCausalLM']: not a sequence-classification model" in out.stderr


def test_a_reward_model_on_time_shared_devices_is_parked_and_the_run_is_the_one_alone(tidal_cli, tmp_path, runs, last_token_rm):
    """The quickstart's verifier plus a reward model, rollout colocated with the trainer on one
    (fake) device: the reward model takes turns there, parked between its scorings, and the
    run is the one with the device to itself, bit for bit."""
    keys = [f"reward_model.path={last_token_rm}", "reward_model.weight=0.1", "algorithm.max_staleness=0", "sft.steps=60", "task.num_eval_prompts=4", "algorithm.prompts_per_step=4", "algorithm.group_size=4"]
    runs.assert_colocated_as_alone(tidal_cli, tmp_path, [*keys, "algorithm.num_steps=3", "device=fake:cuda:1", "checkpoint_every=100", "tensorboard=false", "--no-progress"], env={})
    share = json.loads((tmp_path / "shared" / "summary.json").read_text())["timeshare"]
    assert share["seats"]["reward_model"]["parks"] >= 2 and share["seats"]["reward_model"]["parked_bytes"] > 0
    steps = runs.steps(tmp_path / "alone")
    assert any(r not in (0.0, 1.0) for m in steps for group in m["rewards"] for r in group)  # the model's weighted scores are in the rewards


def test_the_shipped_rlhf_recipe_runs_on_a_local_policy_reward_model_and_prompts(tidal_cli, tmp_path, tiny_hf_dir, gsm8k_files, last_token_rm, runs):
    """`rlhf_qwen.yaml` leaves the policy, the reward model and the prompts to the user: it is
    refused naming the missing key, then runs PPO with its critic on prompts without answers."""
    prompts = tmp_path / "prompts.jsonl"
    rows = [json.loads(line) for line in gsm8k_files["train_jsonl"].read_text().splitlines()]
    prompts.write_text("".join(json.dumps({"prompt": row["question"]}) + "\n" for row in rows))
    out = tidal_cli("run", "rlhf_qwen", f"run_dir={tmp_path / 'refused'}", f"model.path={tiny_hf_dir}", f"data.train_files=[{prompts}]", cwd=tmp_path)
    assert out.returncode != 0 and "set reward_model.path" in out.stderr and not (tmp_path / "refused").exists()
    run_dir = tmp_path / "run"
    small = ["device=cpu", "threads=1", "tensorboard=false", "rollout.max_new_tokens=4", "algorithm.num_steps=3", "algorithm.prompts_per_step=8", "train.precision=fp32", "model.gradient_checkpointing=false", "--no-progress"]
    keys = [f"model.path={tiny_hf_dir}", f"reward_model.path={last_token_rm}", f"data.train_files=[{prompts}]", *small]
    out = tidal_cli("run", "rlhf_qwen", f"run_dir={run_dir}", *keys, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = runs.steps(run_dir)
    assert [m["step"] for m in steps] == [1, 2, 3] and all(m["samples"] == 8 and m["value_loss"] > 0 and "kl" in m for m in steps)
