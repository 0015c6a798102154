"""`rollout.top_k` / `rollout.top_p` through `tidal run`: they reach rollout and the trainer
alike, so an on-policy step's PPO ratio against the behavior policy is 1 (a trainer taking
its logprobs from the full softmax would put it near the kept mass: 0.1 here, the
untrained model's distribution being nearly flat)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tidal.tools.config import ConfigError

REWARD = "def parity(trajectory, text):\n    return float(sum(map(ord, text)) % 2)\n"
"""A reward the untrained model's samples split on: every group trains."""

SMALL = [
    "sft.steps=0", "task.num_eval_prompts=4", "algorithm.num_steps=2", "algorithm.prompts_per_step=4", "algorithm.group_size=4",
    "algorithm.max_staleness=0", "algorithm.decoupled=false", "train.micro_batch_size=64", "tensorboard=false", "threads=1",
    "task.reward=sampling_rewards:parity", "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1", "model.intermediate_size=64",
]  # fmt: skip


def _run(run_dir: Path, *overrides: str) -> dict[str, Any]:
    from tidal.tools.recipes import resolve_recipe
    from tidal.tools.run import prepare_run
    from tidal.tools.train import train

    cfg, made = prepare_run(resolve_recipe("quickstart_cpu"), [*SMALL, f"run_dir={run_dir}", *overrides])
    return train(cfg, made, progress=False)


def test_an_on_policy_step_under_top_k_and_top_p_has_ratio_one(tmp_path, reward_module):
    reward_module("sampling_rewards", REWARD)
    run_dir = tmp_path / "run"
    _run(run_dir, "rollout.top_k=8", "rollout.top_p=0.7")
    rollout = yaml.safe_load((run_dir / "config.yaml").read_text())["rollout"]
    assert (rollout["top_k"], rollout["top_p"]) == (8, 0.7)
    first = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert first["ratio_mean"] == pytest.approx(1.0, abs=1e-5), first  # one micro-batch: the ratio before the update


@pytest.mark.parametrize(("override", "message"), [("rollout.top_k=-1", r"rollout.top_k=-1 must be >= 0: 0 turns it off"), ("rollout.top_p=1.5", r"rollout.top_p=1.5 must be <= 1"), ("rollout.top_p=0", r"rollout.top_p=0.0 must be > 0")])
def test_a_cut_out_of_bounds_is_refused_naming_the_key(override, message):
    from tidal.tools.config import load_config
    from tidal.tools.recipes import resolve_recipe

    with pytest.raises(ConfigError, match=message):
        load_config(resolve_recipe("quickstart_cpu"), [override])
