"""`train.backend=megatron` through the real `tidal run`: one process locally whose checkpoint
resumes exactly (megatron-core on CPU, gloo); what it needs (`engines.registry.NEEDS`); and the
settings it cannot run refused before a run directory; a colocated trainer that parks for its
rollout guest and trains as one alone does. (Two ranks led by rank 0 run in
tests/engines/test_megatron_train.py; under Ray, led ranks are the `fsdp` and `deepspeed`
runs' code, `fsdp_lead.follow_engines`: tests/tools/test_deepspeed_run.py.)

With `max_staleness: 0` a run repeats itself bit for bit, so a run resumed from its periodic
checkpoint (weights in Hugging Face names and AdamW's state converted from megatron-core's,
through `state_dict()` / `load_state_dict()`) must end exactly as the uninterrupted run did.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from tidal.engines import registry

ENV = {"PYTHONPATH": str(Path(__file__).parent), "RAY_AUTH_MODE": "disabled"}
TINY = [
    "task.reward=tidal_test_rewards:first_token_even", "task.num_eval_prompts=4", "sft.steps=2", "sft.batch_size=8", "algorithm.prompts_per_step=2",
    "algorithm.group_size=4", "algorithm.max_staleness=0", "threads=1", "tensorboard=false", "rollout.max_new_tokens=3", "model.hidden_size=32",
    "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1", "model.intermediate_size=64",
]  # fmt: skip
HAS_MEGATRON = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None


@pytest.mark.skipif(not HAS_MEGATRON, reason="megatron-core is not installed")
def test_a_megatron_run_resumed_from_its_periodic_checkpoint_repeats_the_uninterrupted_run(tidal_cli, tmp_path, runs):
    """The tiny quickstart's Qwen2 as megatron-core's GPTModel, with a KL term to the warm
    start's weights (the engine's frozen reference `GPTModel`): the warm start, 4 RL steps, a
    checkpoint at step 2; a run resumed from it (the reference read back from the checkpoint)
    ends with the uninterrupted run's metrics and weights, bit for bit; and the torch engine,
    the same run, gives its losses and KL up to float32 noise."""
    full, cut, resumed, torch_run = tmp_path / "full", tmp_path / "cut", tmp_path / "resumed", tmp_path / "torch"
    common = ["train.backend=megatron", *TINY, "algorithm.kl_coef=0.1", "algorithm.num_steps=4", "--no-progress"]
    out = tidal_cli("run", "quickstart_cpu", f"run_dir={full}", "checkpoint_every=2", *common, env=ENV, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "warm start: 2 supervised steps" in out.stderr and "UserWarning" not in out.stderr  # megatron's missing-kernel warnings held back
    shutil.copytree(full / "checkpoints" / "step-000002", cut / "checkpoints" / "step-000002")
    (cut / "checkpoints" / "latest").write_text("step-000002\n")
    out = tidal_cli("run", "quickstart_cpu", f"run_dir={resumed}", f"resume={cut}", *common, env=ENV, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "at version 2" in out.stderr
    runs.assert_same(full, resumed, from_step=2)
    steps = runs.steps(full)
    assert len({m["loss"] for m in steps}) > 1 and all(m["nonfinite_grad"] == 0.0 for m in steps)  # it trained
    assert steps[-1]["kl"] > 0  # the policy moved away from its reference
    out = tidal_cli("run", "quickstart_cpu", f"run_dir={torch_run}", *common, "train.backend=torch", env=ENV, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    runs.assert_takes_steps_of(full, torch_run)


@pytest.mark.skipif(not HAS_MEGATRON, reason="megatron-core is not installed")
def test_a_colocated_megatron_trainer_parks_for_its_guest_and_trains_as_alone(tidal_cli, tmp_path, runs):
    """Rollout time-shares the trainer's (fake) device: the engine parks its GPTModel and
    AdamW state in host memory at each hand-off (`MegatronTrainEngine.park`: on a fake
    device the platform's offload really copies them out and back into new tensors), and
    with `max_staleness: 0` the run is the disaggregated run's, bit for bit."""
    runs.assert_colocated_as_alone(tidal_cli, tmp_path, ["train.backend=megatron", *TINY, "algorithm.num_steps=3", "device=fake:cuda:1", "checkpoint_every=100", "--no-progress"], env=ENV)


@pytest.mark.skipif(not HAS_MEGATRON, reason="megatron-core is not installed")
def test_a_megatron_run_with_a_critic_takes_the_torch_engines_steps_and_resumes(tidal_cli, tmp_path, runs):
    """PPO with a critic and a KL penalty in the reward on the megatron backend: the policy as
    megatron-core's GPTModel (the KL reference's logprobs from its frozen copy), the critic the
    `fsdp` backend's (`engines.fsdp_critic`, over the local run's one-process group): the torch
    backend's steps, and an exact resume with the critic's state and the adapted KL coefficient."""
    tiny = [k for k in TINY if not k.startswith(("algorithm.group_size", "algorithm.prompts_per_step"))]
    runs.assert_critic_run_is_torchs(tidal_cli, tmp_path, backend=["train.backend=megatron"], common=[*tiny, *runs.ppo_keys, "algorithm.num_steps=4", "--no-progress"], env=ENV)


@pytest.mark.skipif(not HAS_MEGATRON, reason="megatron-core is not installed")
def test_a_colocated_megatron_trainer_parks_its_critic_with_it_and_trains_as_alone(tidal_cli, tmp_path, runs):
    """PPO with rollout time-sharing the trainer's (fake) device: the GPTModel parks itself and
    the fsdp critic parks with it at each hand-off (one seat), and the run is the
    disaggregated run's, bit for bit, its critic's metrics too."""
    tiny = [k for k in TINY if not k.startswith(("algorithm.group_size", "algorithm.prompts_per_step"))]
    common = ["train.backend=megatron", *tiny, *runs.ppo_keys, "algorithm.num_steps=3", "device=fake:cuda:1", "checkpoint_every=100", "--no-progress"]
    runs.assert_colocated_as_alone(tidal_cli, tmp_path, common, env=ENV)
    seats = json.loads((tmp_path / "shared" / "summary.json").read_text())["timeshare"]["seats"]
    assert seats["critic"]["parks"] == seats["train"]["parks"] >= 2 and seats["critic"]["parked_bytes"] > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["placement.train.count=2"], "placement.train.count=2 needs runtime=ray"),
    ],
)
def test_megatron_settings_that_cannot_run_are_config_errors(tidal_cli, tmp_path, args, message):
    out = tidal_cli("run", "quickstart_cpu", "train.backend=megatron", *args, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert message in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "runs").exists(), "nothing is written for an invalid config"


def test_megatron_needs_megatron_core_everywhere_and_mindspeed_on_npus(monkeypatch):
    monkeypatch.setattr(registry, "version", lambda name: None)
    assert registry.missing("train.backend", "megatron", kind="cuda") == "train.backend=megatron needs megatron-core, not installed here (pip install 'tidal-rl[megatron]')"
    monkeypatch.setattr(registry, "version", lambda name: "1.0" if name == "megatron-core" else None)
    assert registry.missing("train.backend", "megatron", kind="cpu") is None
    assert registry.missing("train.backend", "megatron", kind="npu") == "train.backend=megatron needs mindspeed, not installed here"
    assert "megatron" in registry.MULTI_RANK and "megatron" in registry.TIME_SHARES
