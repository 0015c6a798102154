"""`train.backend=megatron` through the real `tidal run`: two rank actors under Ray that learn the
quickstart, one process locally whose checkpoint resumes exactly (megatron-core on CPU, gloo);
what it needs (`engines.registry.NEEDS`); and the settings it cannot run refused before a run
directory.

Under Ray (a fake cluster of GPUs: CPU tensors, gloo, hal's host patches) `placement.train.count=2`
starts two trainer ranks: rank 0 runs the workflow and leads, rank 1 follows
(`megatron_lead.follow`) and trains on its share of every batch, as with the `deepspeed` backend
(tests/tools/test_deepspeed_run.py).

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
SMALL = ["task.max_value=9", "task.num_eval_prompts=40", "sft.steps=20", "task.reward=tidal_test_rewards:starts_with_seven", "threads=1"]
FAKE_GPUS = ["cluster.fake=true", "cluster.nodes=[{name: gpu, kind: cuda, devices: 3}]", "placement.train.requires=[gpu]", "placement.rollout.requires=[gpu]"]


@pytest.mark.slow
@pytest.mark.skipif(not HAS_MEGATRON, reason="megatron-core is not installed")
def test_two_megatron_ranks_on_ray_learn_the_quickstart(tidal_cli, tmp_path, runs):
    run_dir = tmp_path / "run"
    num_steps = 16
    out = tidal_cli(
        "run", "quickstart_cpu", "runtime=ray", "train.backend=megatron", f"run_dir={run_dir}", *SMALL, *FAKE_GPUS,
        "placement.train.count=2", "placement.rollout.count=1", f"algorithm.num_steps={num_steps}", "checkpoint_every=100", "--no-progress",
        env=ENV, cwd=tmp_path, timeout=480,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    steps = runs.steps(run_dir)
    assert [m["step"] for m in steps] == list(range(1, num_steps + 1))
    first, last = sum(m["reward"] for m in steps[:4]) / 4, sum(m["reward"] for m in steps[-4:]) / 4
    assert last > first + 0.1, f"reward did not go up: {first:.2f} -> {last:.2f}"
    assert all(m["nonfinite_grad"] == 0.0 and m["grad_norm"] > 0 for m in steps)
    leader, follower = json.loads((run_dir / "summary.json").read_text())["trainer_ranks"]
    assert (leader["rank"], follower["rank"]) == (0, 1) and leader["pid"] != follower["pid"]
    # rank 1 built the warm start's engine and RL's, took every step on its share of the rows, and
    # exported nothing: every rank holds the whole model, and rank 0 publishes its own
    assert follower["engines"] == 2 and follower["steps"] == 20 + num_steps and follower["rows"] > 0 and follower["exports"] == 0
    (rollout,) = json.loads((run_dir / "runtime.json").read_text())["rollout_summaries"]
    assert rollout["last_version_received"] == num_steps


@pytest.mark.skipif(not HAS_MEGATRON, reason="megatron-core is not installed")
def test_a_megatron_run_resumed_from_its_periodic_checkpoint_repeats_the_uninterrupted_run(tidal_cli, tmp_path, runs):
    """The tiny quickstart's Qwen2 as megatron-core's GPTModel: the warm start, 4 RL steps, a
    checkpoint at step 2; a run resumed from it ends with the uninterrupted run's metrics and
    weights, bit for bit."""
    full, cut, resumed = tmp_path / "full", tmp_path / "cut", tmp_path / "resumed"
    common = ["train.backend=megatron", *TINY, "algorithm.num_steps=4", "--no-progress"]
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


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["placement.train.count=2"], "placement.train.count=2 needs runtime=ray"),
        (["placement.rollout.colocate_with=train"], "train.backend='megatron' cannot park its state for a guest"),
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
    assert "megatron" in registry.MULTI_RANK and "megatron" not in registry.TIME_SHARES
