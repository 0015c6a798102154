"""`train.backend=fsdp` through the real `tidal run`: one process locally, two rank actors under Ray.

Locally the engine runs over a one-process group that `tidal run` makes through hal; its
checkpoint is the torch engine's format, so a torch run resumes from it. Under Ray (a
fake cluster of GPUs, CPU tensors and gloo) `placement.train.count=2` starts two trainer
ranks: rank 0 runs the workflow and leads, rank 1 follows and trains on its share of
every batch; the weights go live on the rollout actor as usual. With a KL term the
engine takes the torch engine's steps and resumes against the reference it saved.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SMALL = ["task.max_value=9", "task.num_eval_prompts=40", "sft.steps=20", "task.reward=tidal_test_rewards:starts_with_seven", "threads=1"]
ENV = {"PYTHONPATH": str(Path(__file__).parent), "RAY_AUTH_MODE": "disabled"}
FAKE_GPUS = ["cluster.fake=true", "cluster.nodes=[{name: gpu, kind: cuda, devices: 3}]", "placement.train.requires=[gpu]", "placement.rollout.requires=[gpu]"]


def _steps(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _reward_went_up(steps: list[dict]) -> None:
    first, last = sum(m["reward"] for m in steps[:4]) / 4, sum(m["reward"] for m in steps[-4:]) / 4
    assert last > first + 0.1, f"reward did not go up: {first:.2f} -> {last:.2f}"


def test_fsdp_runs_locally_and_its_checkpoint_resumes_with_the_torch_engine(tidal_cli, tmp_path):
    run_dir = tmp_path / "run"
    out = tidal_cli("run", "quickstart_cpu", "train.backend=fsdp", f"run_dir={run_dir}", *SMALL, "algorithm.num_steps=20", "checkpoint_every=10", "--no-progress", env=ENV, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = _steps(run_dir)
    assert [m["step"] for m in steps] == list(range(1, 21))
    _reward_went_up(steps)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 20 and 0.0 <= summary["accuracy_after"] <= 1.0

    resumed = tmp_path / "resumed"
    out = tidal_cli("run", "quickstart_cpu", "train.backend=torch", f"run_dir={resumed}", f"resume={run_dir}", *SMALL, "algorithm.num_steps=24", "--no-progress", env=ENV, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "at version 20" in out.stderr
    more = _steps(resumed)[20:]  # after the resumed run's steps, copied
    assert [m["step"] for m in more] == [21, 22, 23, 24]
    assert sum(m["reward"] for m in more) / 4 > sum(m["reward"] for m in steps[:4]) / 4  # it went on from the trained weights


KL_TINY = [
    "task.reward=tidal_test_rewards:first_token_even", "task.num_eval_prompts=4", "sft.steps=2", "sft.batch_size=8", "algorithm.prompts_per_step=2",
    "algorithm.group_size=4", "algorithm.max_staleness=0", "threads=1", "tensorboard=false", "rollout.max_new_tokens=3", "model.hidden_size=32",
    "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1", "model.intermediate_size=64", "algorithm.kl_coef=0.1", "algorithm.num_steps=4", "--no-progress",
]  # fmt: skip


def test_an_fsdp_kl_run_takes_the_torch_engines_steps_and_resumes_against_its_saved_reference(tidal_cli, tmp_path, runs):
    """With a KL term the engine keeps a whole, frozen copy of the warm start's weights on each
    rank: the losses and KL of 4 steps equal the torch engine's up to float32 noise, and a run
    resumed from the step-2 checkpoint (its reference read back from it) ends with the
    uninterrupted run's metrics and weights, bit for bit."""
    import shutil

    full, cut, resumed, torch_run = tmp_path / "full", tmp_path / "cut", tmp_path / "resumed", tmp_path / "torch"
    out = tidal_cli("run", "quickstart_cpu", "train.backend=fsdp", f"run_dir={full}", "checkpoint_every=2", *KL_TINY, env=ENV, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    out = tidal_cli("run", "quickstart_cpu", "train.backend=torch", f"run_dir={torch_run}", *KL_TINY, env=ENV, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = runs.steps(full)
    assert steps[-1]["kl"] > 0  # the policy moved away from its reference
    runs.assert_takes_steps_of(full, torch_run)
    shutil.copytree(full / "checkpoints" / "step-000002", cut / "checkpoints" / "step-000002")
    (cut / "checkpoints" / "latest").write_text("step-000002\n")
    out = tidal_cli("run", "quickstart_cpu", "train.backend=fsdp", f"run_dir={resumed}", f"resume={cut}", "checkpoint_every=2", *KL_TINY, env=ENV, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    runs.assert_same(full, resumed, from_step=2)


def test_an_fsdp_run_with_a_critic_takes_the_torch_engines_steps_and_resumes(tidal_cli, tmp_path, runs):
    """PPO with a critic and a KL penalty in the reward on the fsdp backend (`engines.fsdp_critic`,
    and the reference's logprobs, over the local run's one-process group): the torch backend's
    steps, and an exact resume with the critic's state and the adapted KL coefficient."""
    tiny = [k for k in KL_TINY if not k.startswith(("algorithm.kl_coef", "algorithm.group_size", "algorithm.prompts_per_step"))]
    runs.assert_critic_run_is_torchs(tidal_cli, tmp_path, backend=["train.backend=fsdp"], common=[*tiny, *runs.ppo_keys], env=ENV)


@pytest.mark.slow
def test_two_fsdp_ranks_on_ray_train_together_and_publish_to_rollout(tidal_cli, tmp_path):
    run_dir = tmp_path / "run"
    num_steps = 16
    out = tidal_cli(
        "run", "quickstart_cpu", "runtime=ray", "train.backend=fsdp", f"run_dir={run_dir}", *SMALL, *FAKE_GPUS,
        "placement.train.count=2", "placement.rollout.count=1", f"algorithm.num_steps={num_steps}", "checkpoint_every=100", "--no-progress",
        env=ENV, cwd=tmp_path, timeout=480,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    steps = _steps(run_dir)
    assert [m["step"] for m in steps] == list(range(1, num_steps + 1))
    _reward_went_up(steps)
    summary = json.loads((run_dir / "summary.json").read_text())
    leader, follower = summary["trainer_ranks"]
    assert (leader["rank"], follower["rank"]) == (0, 1) and leader["pid"] != follower["pid"]
    # rank 1 built the warm start's engine and RL's, and took every step on its share of the rows
    assert follower["engines"] == 2 and follower["steps"] == 20 + num_steps and follower["rows"] > 0
    info = json.loads((run_dir / "runtime.json").read_text())
    assert [r["pid"] for r in info["trainer"]["ranks"]] == [leader["pid"], follower["pid"]]
    assert info["transport"] == "collective"
    (rollout,) = info["rollout_summaries"]
    # the warm start (0) and every update, from rank 0 alone, less those a newer one replaced
    # before they were sent (transport.overlap); the last one still reached rollout
    assert rollout["versions_received"] + info["versions_replaced"] == num_steps + 1
    assert rollout["last_version_received"] == num_steps
    assert follower["exports"] >= num_steps + 1  # each version streamed from rank 0's weight source: rank 1 gathered in step
    assert rollout["versions_applied"][0] == 0 and max(rollout["versions_applied"]) >= num_steps - 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["placement.train.count=2"], "placement.train.count=2 needs a train.backend that trains over several processes (deepspeed, fsdp, megatron); train.backend='torch'"),
        (["placement.train.count=2", "train.backend=fsdp"], "placement.train.count=2 needs runtime=ray"),
    ],
)
def test_trainer_ranks_that_cannot_run_are_config_errors(tidal_cli, tmp_path, args, message):
    out = tidal_cli("run", "quickstart_cpu", *args, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert message in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "runs").exists(), "nothing is written for an invalid config"
