"""Rewards in worker processes (`task.reward_workers`, `task.reward_timeout_s`) on the real
run path: a reward that hangs on some samples times out, scores 0, is counted in the step
metrics (`reward_timeouts`, within `failed_rewards`) and in the summary, and the run ends
as usual, its reward workers ended with it."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

TINY = [
    "task.num_eval_prompts=4", "sft.steps=2", "sft.batch_size=8", "algorithm.prompts_per_step=2", "algorithm.group_size=4",
    "algorithm.max_staleness=0", "algorithm.num_steps=3", "threads=1", "tensorboard=false", "rollout.max_new_tokens=3",
    "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1", "model.intermediate_size=64",
]  # fmt: skip


def test_a_reward_that_hangs_times_out_is_counted_and_never_stops_the_run(tidal_cli, tmp_path):
    run_dir = tmp_path / "run"
    reward = ["task.reward=tidal_test_rewards:first_token_even_or_hangs", "task.reward_workers=2", "task.reward_timeout_s=0.5"]
    out = tidal_cli("run", "quickstart_cpu", *TINY, *reward, f"run_dir={run_dir}", "--no-progress", env={"PYTHONPATH": str(Path(__file__).parent)}, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2, 3]
    timeouts = [m["reward_timeouts"] for m in steps]
    assert timeouts == sorted(timeouts) and timeouts[-1] > 0, timeouts  # a running total, as failed_rewards is
    assert all(m["failed_rewards"] >= m["reward_timeouts"] for m in steps)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["reward_timeouts"] == timeouts[-1]
    assert "took more than 0.5 s on one sample" in out.stderr  # logged once


def test_the_reward_workers_end_with_the_run(tmp_path):
    """In this process: no reward worker outlives `train` (they are daemons, so without the
    close they would live until the process exits)."""
    from tidal.tools.recipes import resolve_recipe
    from tidal.tools.run import prepare_run
    from tidal.tools.train import train

    overrides = [*TINY, "algorithm.num_steps=1", "task.reward=tidal.engines.rewards:arithmetic", "task.reward_workers=1", f"run_dir={tmp_path / 'run'}"]
    cfg, made = prepare_run(resolve_recipe("quickstart_cpu"), overrides)
    summary = train(cfg, made, progress=False)
    assert summary["steps"] == 1 and summary["reward_timeouts"] == 0
    assert [p for p in multiprocessing.active_children() if p.name == "tidal-reward"] == []


@pytest.mark.parametrize(("reward", "workers", "expected"), [("math", None, 2), ("math_with_format", None, 2), ("math", 0, 0), ("arithmetic", None, 0), ("tidal_test_rewards:first_token_even", 3, 3)])
def test_math_rewards_run_in_worker_processes_by_default(reward, workers, expected):
    from omegaconf import OmegaConf

    from tidal.tools.config import RecipeConfig
    from tidal.tools.rl import reward_workers

    cfg = OmegaConf.structured(RecipeConfig)
    cfg.task.reward, cfg.task.reward_workers = reward, workers
    assert reward_workers(cfg) == expected


@pytest.mark.parametrize(("override", "named"), [("task.reward_workers=-1", "task.reward_workers=-1 must be >= 0"), ("task.reward_timeout_s=0", "task.reward_timeout_s=0.0 must be > 0")])
def test_bad_reward_worker_keys_are_refused_naming_the_key(override, named):
    from tidal.tools.config import ConfigError, load_config
    from tidal.tools.recipes import resolve_recipe

    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        load_config(resolve_recipe("quickstart_cpu"), [override])
