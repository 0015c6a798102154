"""`train.backend=deepspeed` through the real `tidal run`: two rank actors under Ray (ZeRO-2 and
ZeRO-3), and one process locally, whose checkpoint resumes exactly.

Under Ray (a fake cluster of GPUs: CPU tensors, gloo, DeepSpeed's CPU accelerator)
`placement.train.count=2` starts two trainer ranks: rank 0 runs the workflow and leads,
rank 1 follows (`deepspeed_lead.follow`) and trains on its share of every batch; the
quickstart learns, as with the `fsdp` backend (tests/tools/test_fsdp_run.py). Locally the
engine runs over the one-process group `tidal run` makes; with `max_staleness: 0` a run
repeats itself bit for bit, so a run resumed from its periodic checkpoint must end exactly
as the uninterrupted run did.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

pytest.importorskip("deepspeed")

SMALL = ["task.max_value=9", "task.num_eval_prompts=40", "sft.steps=20", "task.reward=tidal_test_rewards:starts_with_seven", "threads=1"]
ENV = {"PYTHONPATH": str(Path(__file__).parent), "RAY_AUTH_MODE": "disabled"}
FAKE_GPUS = ["cluster.fake=true", "cluster.nodes=[{name: gpu, kind: cuda, devices: 3}]", "placement.train.requires=[gpu]", "placement.rollout.requires=[gpu]"]
TINY = [
    "task.reward=tidal_test_rewards:first_token_even", "task.num_eval_prompts=4", "sft.steps=2", "sft.batch_size=8", "algorithm.prompts_per_step=2",
    "algorithm.group_size=4", "algorithm.max_staleness=0", "threads=1", "tensorboard=false", "rollout.max_new_tokens=3", "model.hidden_size=32",
    "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1", "model.intermediate_size=64",
]  # fmt: skip


def _steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_two_deepspeed_ranks_on_ray_learn_the_quickstart(tidal_cli, tmp_path, stage):
    run_dir = tmp_path / "run"
    num_steps = 16
    out = tidal_cli(
        "run", "quickstart_cpu", "runtime=ray", "train.backend=deepspeed", f"train.zero_stage={stage}", f"run_dir={run_dir}", *SMALL, *FAKE_GPUS,
        "placement.train.count=2", "placement.rollout.count=1", f"algorithm.num_steps={num_steps}", "checkpoint_every=100", "--no-progress",
        env=ENV, cwd=tmp_path, timeout=480,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    steps = _steps(run_dir)
    assert [m["step"] for m in steps] == list(range(1, num_steps + 1))
    first, last = sum(m["reward"] for m in steps[:4]) / 4, sum(m["reward"] for m in steps[-4:]) / 4
    assert last > first + 0.1, f"reward did not go up: {first:.2f} -> {last:.2f}"
    assert all(m["nonfinite_grad"] == 0.0 and m["grad_norm"] > 0 for m in steps)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["train"]["zero_stage"] == stage
    leader, follower = summary["trainer_ranks"]
    assert (leader["rank"], follower["rank"]) == (0, 1) and leader["pid"] != follower["pid"]
    # rank 1 built the warm start's engine and RL's, and took every step on its share of the rows
    assert follower["engines"] == 2 and follower["steps"] == 20 + num_steps and follower["rows"] > 0
    # ZeRO-3 gathers each weight with every rank for each version rank 0 publishes; ZeRO-2's ranks hold them whole
    assert follower["exports"] >= num_steps + 1 if stage == 3 else follower["exports"] == 0
    (rollout,) = json.loads((run_dir / "runtime.json").read_text())["rollout_summaries"]
    assert rollout["last_version_received"] == num_steps


@pytest.mark.parametrize("adapters", [[], ["train.lora_rank=4", "train.lr=0.01"]], ids=["every-weight", "lora"])
def test_a_deepspeed_run_resumed_from_its_periodic_checkpoint_repeats_the_uninterrupted_run(tidal_cli, tmp_path, runs, adapters):
    """ZeRO-3 over a one-process group, with a KL term to the warm start's weights (the
    engine's frozen reference, copied whole before ZeRO-3 partitions the model; with LoRA
    adapters, the base with the adapters off): a run cut after its step-2 checkpoint
    (weights, or the base and adapters, AdamW's moments and step, the reference, through
    `state_dict()`) and resumed ends with the uninterrupted run's metrics and weights, bit
    for bit; and the torch engine, the same run, gives its losses and KL up to float32 noise."""
    if adapters:
        pytest.importorskip("peft")
    full, cut, resumed, torch_run = tmp_path / "full", tmp_path / "cut", tmp_path / "resumed", tmp_path / "torch"
    common = ["train.backend=deepspeed", "train.zero_stage=3", *TINY, "algorithm.kl_coef=0.1", "algorithm.num_steps=4", *adapters, "--no-progress"]
    out = tidal_cli("run", "quickstart_cpu", f"run_dir={full}", "checkpoint_every=2", *common, env=ENV, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    shutil.copytree(full / "checkpoints" / "step-000002", cut / "checkpoints" / "step-000002")
    (cut / "checkpoints" / "latest").write_text("step-000002\n")
    out = tidal_cli("run", "quickstart_cpu", f"run_dir={resumed}", f"resume={cut}", *common, env=ENV, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "at version 2" in out.stderr
    runs.assert_same(full, resumed, from_step=2)
    steps = runs.steps(full)
    assert len({m["loss"] for m in steps}) > 1 and steps[-1]["kl"] > 0  # it trained, away from its reference
    out = tidal_cli("run", "quickstart_cpu", f"run_dir={torch_run}", *common, "train.backend=torch", env=ENV, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    runs.assert_takes_steps_of(full, torch_run)
    if adapters:  # the checkpoint's base and adapters, in the torch engine's format
        import torch

        lora = torch.load(full / "checkpoints" / "step-000004" / "trainer.pt", weights_only=True)["lora"]
        assert lora["settings"]["train.lora_rank"] == 4 and lora["adapters"] and all(".lora_" in name for name in lora["adapters"])


def test_a_deepspeed_run_with_a_critic_takes_the_torch_engines_steps_and_resumes(tidal_cli, tmp_path, runs):
    """PPO with a critic and a KL penalty in the reward on the deepspeed backend (ZeRO-2,
    `engines.deepspeed_critic`, over the local run's one-process group), as OpenRLHF runs it:
    the torch backend's steps, and an exact resume with the critic's state and the adapted KL coefficient."""
    tiny = [k for k in TINY if not k.startswith(("algorithm.group_size", "algorithm.prompts_per_step"))]
    runs.assert_critic_run_is_torchs(tidal_cli, tmp_path, backend=["train.backend=deepspeed", "train.zero_stage=2"], common=[*tiny, *runs.ppo_keys, "algorithm.num_steps=4", "--no-progress"], env=ENV)


def test_a_zero3_run_with_the_fsdp_critic_takes_the_torch_engines_steps_and_resumes(tidal_cli, tmp_path, runs):
    """PPO beside a ZeRO-3 policy: `critic.backend=fsdp` (the deepspeed critic trains under
    ZeRO-1/2 only), the KL reference partitioned as the policy: the torch backend's steps, and
    an exact resume with the critic's state and the adapted KL coefficient."""
    tiny = [k for k in TINY if not k.startswith(("algorithm.group_size", "algorithm.prompts_per_step"))]
    backend = ["train.backend=deepspeed", "train.zero_stage=3", "critic.backend=fsdp"]
    runs.assert_critic_run_is_torchs(tidal_cli, tmp_path, backend=backend, common=[*tiny, *runs.ppo_keys, "algorithm.num_steps=4", "--no-progress"], env=ENV)


def test_a_colocated_deepspeed_trainer_parks_for_its_guest_and_trains_as_alone(tidal_cli, tmp_path, runs):
    """Rollout time-shares the trainer's (fake) device: the ZeRO-3 engine parks itself at each
    hand-off (`DeepSpeedTrainEngine.park`: DeepSpeed's `offload_states`, and the master slices,
    AdamW's state and the KL reference's slices moved by tidal) and takes its state back, and
    with `max_staleness: 0` the run is the disaggregated run's, bit for bit."""
    runs.assert_colocated_as_alone(tidal_cli, tmp_path, ["train.backend=deepspeed", "train.zero_stage=3", *TINY, "algorithm.kl_coef=0.1", "algorithm.num_steps=3", "device=fake:cuda:1", "checkpoint_every=100", "--no-progress"], env=ENV)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["train.backend=deepspeed", "train.zero_stage=4"], "train.zero_stage=4 is not one of 1, 2, 3"),
        (["train.backend=deepspeed", "placement.train.count=2"], "placement.train.count=2 needs runtime=ray"),
    ],
)
def test_deepspeed_settings_that_cannot_run_are_config_errors(tidal_cli, tmp_path, args, message):
    out = tidal_cli("run", "quickstart_cpu", *args, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert message in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "runs").exists(), "nothing is written for an invalid config"


def test_a_kl_term_with_a_backend_that_holds_no_reference_is_refused(monkeypatch):
    """Every shipped train backend holds one (`registry.KL_REFERENCE`); one registered without
    it is refused before anything starts, naming the key."""
    from tidal.engines import registry
    from tidal.tools.config import ConfigError, load_config
    from tidal.tools.recipes import resolve_recipe
    from tidal.tools.run import check_runnable

    assert set(registry.KL_REFERENCE) == set(registry.TRAIN)
    monkeypatch.setattr(registry, "KL_REFERENCE", ("torch", "megatron"))
    with pytest.raises(ConfigError, match=r"algorithm.kl_coef=0.1 needs a reference policy, which only train.backend=torch or megatron holds; train.backend='deepspeed'"):
        check_runnable(load_config(resolve_recipe("quickstart_cpu"), ["train.backend=deepspeed", "algorithm.kl_coef=0.1"]))
