"""PPO with a critic (`algorithm.advantage=gae`) through the real `tidal run`: the quickstart
learns with it, and the combinations it cannot run are refused before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tidal.tools.config import ConfigError, load_config
from tidal.tools.recipes import resolve_recipe
from tidal.tools.run import check_runnable

PPO = ["algorithm.advantage=gae", "algorithm.group_size=1", "algorithm.prompts_per_step=32", "critic.lr=0.003", "algorithm.num_steps=40"]


def test_the_quickstart_learns_with_a_critic(tidal_cli, tmp_path):
    run_dir = tmp_path / "run"
    out = tidal_cli("run", "quickstart_cpu", f"run_dir={run_dir}", *PPO, "tensorboard=false", "--no-progress", cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["accuracy_after"] >= summary["accuracy_before"] + 0.05, summary
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(m["samples"] == 32 and "value_loss" in m for m in steps)
    assert sum(m["value_loss"] for m in steps[-10:]) < sum(m["value_loss"] for m in steps[:10])  # the critic learns the values


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.backend=deepspeed", "train.zero_stage=3"], "train.zero_stage=3: the deepspeed critic .* trains under ZeRO-1 or -2 only; set critic.backend=fsdp .*, or train.zero_stage=2"),
        (["train.backend=fsdp", "critic.backend=deepspeed", "train.zero_stage=3"], "train.zero_stage=3: the deepspeed critic"),
        (["critic.backend=megatronn"], "critic.backend='megatronn' is not one of deepspeed, fsdp, megatron, torch"),
        (["algorithm.advantage=grpo", "algorithm.group_size=2", "critic.backend=fsdp"], r"critic.backend='fsdp' is read only with a critic \(algorithm.advantage=gae\); algorithm.advantage=grpo: unset critic.backend"),
    ],
)
def test_a_critic_with_another_train_backend_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_runnable(load_config(resolve_recipe("quickstart_cpu"), ["algorithm.advantage=gae", "algorithm.group_size=1", *overrides]))


def test_a_train_backend_without_a_critic_is_refused_naming_those_with_one(monkeypatch):
    """Every registered backend holds a critic today (megatron's is fsdp's); one registered
    without (a user's, say) is refused by name before any work."""
    from tidal.engines import registry

    assert set(registry.CRITIC) == set(registry.TRAIN)
    monkeypatch.delitem(registry.CRITIC, "megatron")
    message = r"algorithm.advantage=gae trains a critic beside the policy, which train.backend='megatron' cannot hold yet: set train.backend to one that can \(deepspeed, fsdp, torch\), critic.backend, or another advantage"
    with pytest.raises(ConfigError, match=message):
        check_runnable(load_config(resolve_recipe("quickstart_cpu"), ["algorithm.advantage=gae", "algorithm.group_size=1", "train.backend=megatron"]))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.advantage=grpo", "algorithm.group_size=2", "algorithm.kl_in_reward=0.05"], r"algorithm.kl_in_reward=0.05 .* algorithm.advantage=grpo reads one reward per sequence: set algorithm.kl_coef"),
        (["algorithm.kl_target=0.01"], r"algorithm.kl_target=0.01 adapts .* algorithm.kl_in_reward is 0"),
        (["algorithm.kl_in_reward=0.05", "algorithm.kl_target=0"], r"algorithm.kl_target=0.0 must be > 0"),
    ],
)
def test_a_kl_in_the_reward_it_cannot_run_is_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_runnable(load_config(resolve_recipe("quickstart_cpu"), ["algorithm.advantage=gae", "algorithm.group_size=1", *overrides]))


def test_a_critic_on_time_shared_devices_is_parked_and_the_run_is_the_one_alone(tidal_cli, tmp_path, runs):
    """Rollout colocated with the trainer on one (fake) device: the critic takes turns there
    as the trainer does, its model and AdamW state parked while the others compute, and the
    run is the one with the device to itself, bit for bit."""
    keys = ["algorithm.advantage=gae", "algorithm.group_size=1", "algorithm.prompts_per_step=6", "critic.lr=0.01", "algorithm.max_staleness=0", "sft.steps=60", "task.num_eval_prompts=4"]
    keys.append("algorithm.aggregation=seq_mean_token_mean")  # a loss that differs by step (token_mean of whitened advantages is 0 at ratio 1)
    runs.assert_colocated_as_alone(tidal_cli, tmp_path, [*keys, "algorithm.num_steps=3", "device=fake:cuda:1", "checkpoint_every=100", "tensorboard=false", "--no-progress"], env={})
    share = json.loads((tmp_path / "shared" / "summary.json").read_text())["timeshare"]
    assert share["seats"]["critic"]["parks"] >= 2 and share["seats"]["critic"]["parked_bytes"] > 0


def test_critic_path_starts_the_critic_from_a_reward_model_that_reads_the_policys_tokens(tidal_cli, tmp_path, tiny_hf_dir, gsm8k_files, runs):
    """OpenRLHF's way: the critic starts from the reward model. One whose tokenizer is the
    policy's starts the critic (its first values are its scores, not zeros); one with another
    vocabulary, a missing folder, or a run without a critic are refused before any work."""
    from tidal.tools.bench.fixture import build_tiny_reward_model
    from tidal.tools.run import check_critic_path

    same = build_tiny_reward_model(tmp_path / "same", vocab_size=320, seed=0)  # the fixture policy's tokenizer: same corpus, size and seed
    other = build_tiny_reward_model(tmp_path / "other")
    base = ["algorithm.advantage=gae", "algorithm.group_size=1", f"model.path={tiny_hf_dir}", f"data.train_files=[{gsm8k_files['train_jsonl']}]"]
    for overrides, message in (
        ([f"critic.path={other}"], r"its tokenizer's vocabulary \(\d+ tokens\) is not the policy's"),
        ([f"critic.path={tmp_path / 'nowhere'}"], "does not exist or is not a folder"),
        ([f"critic.path={same}", "algorithm.advantage=grpo", "algorithm.group_size=2"], "is read only with a critic"),
    ):
        with pytest.raises(ConfigError, match=message):
            check_critic_path(load_config(resolve_recipe("gsm8k_qwen"), [*base, *overrides]))
    small = ["device=cpu", "threads=1", "tensorboard=false", "rollout.max_new_tokens=4", "algorithm.num_steps=2", "algorithm.prompts_per_step=8", "train.precision=fp32", "model.gradient_checkpointing=false", "--no-progress"]
    firsts = []
    for name, extra in (("policy", []), ("from_rm", [f"critic.path={same}"])):
        out = tidal_cli("run", "gsm8k_qwen", f"run_dir={tmp_path / name}", *base, *small, *extra, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        firsts.append(runs.steps(tmp_path / name)[0]["values_mean"])
    assert firsts[0] == 0.0 and firsts[1] != 0.0  # a zero head, then the reward model's scores


TINY = [
    "task.reward=tidal_test_rewards:first_token_even", "task.num_eval_prompts=4", "sft.steps=2", "sft.batch_size=8", "algorithm.max_staleness=0", "threads=1",
    "tensorboard=false", "rollout.max_new_tokens=3", "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1", "model.intermediate_size=64",
]  # fmt: skip


def test_a_critic_warmup_trains_the_critic_alone_first_and_a_run_resumed_inside_it_is_the_same(tidal_cli, tmp_path, runs):
    """`algorithm.critic_warmup=2`: the policy sits out steps 1 and 2 (its weights as the warm
    start left them, its metrics absent) while the critic trains on each; it trains from step 3.
    A run resumed from the step-1 checkpoint, inside the warm-up, repeats the uninterrupted run."""
    import shutil

    from safetensors.torch import load_file

    env = {"PYTHONPATH": str(Path(__file__).parent)}
    full, cut, resumed = tmp_path / "full", tmp_path / "cut", tmp_path / "resumed"
    common = [*TINY, *runs.ppo_keys, "algorithm.critic_warmup=2", "algorithm.num_steps=4", "checkpoint_every=1", "--no-progress"]
    out = tidal_cli("run", "quickstart_cpu", f"run_dir={full}", *common, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = runs.steps(full)
    assert ["loss" in m for m in steps] == [False, False, True, True]  # the policy's own metrics from its first step
    assert len({m["value_loss"] for m in steps}) == 4  # the critic trained at every step
    weights = [load_file(full / "checkpoints" / f"step-{k:06d}" / "model.safetensors") for k in (1, 2, 3)]
    assert all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0])  # steps 1 and 2 left the policy as it was
    assert any(not torch.equal(weights[1][n], weights[2][n]) for n in weights[0])  # step 3 trained it
    shutil.copytree(full / "checkpoints" / "step-000001", cut / "checkpoints" / "step-000001")
    (cut / "checkpoints" / "latest").write_text("step-000001\n")
    out = tidal_cli("run", "quickstart_cpu", f"run_dir={resumed}", f"resume={cut}", *common, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    runs.assert_same(full, resumed, from_step=1)



def test_a_one_process_policy_with_the_fsdp_critic_takes_the_torch_critics_steps_and_resumes(tidal_cli, tmp_path, runs):
    """`critic.backend=fsdp` beside `train.backend=torch`: `tidal run` makes the one-process
    group the critic needs, and the run is the all-torch run's up to float32 noise, resumed exactly."""
    env = {"PYTHONPATH": str(Path(__file__).parent)}
    runs.assert_critic_run_is_torchs(tidal_cli, tmp_path, backend=["train.backend=torch", "critic.backend=fsdp"], common=[*TINY, *runs.ppo_keys, "algorithm.num_steps=4", "--no-progress"], env=env)
