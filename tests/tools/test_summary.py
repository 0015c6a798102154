"""`summary.json` of a resumed run: the run's rewards and totals, and what its `timeshare` covers.

A resumed run is the same run (tools/train.py): its last reward and its hand-off total are
the run's, even when the resume takes no step; `timeshare` describes this attempt's seats
and says from which version (`since_version`). Each run is a tiny model on a fake GPU,
with rollout taking turns on the trainer's device: a few seconds.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

REWARDS = '''
def token_parity(trajectory, text):
    """A reward the samples split on, so a step's mean reward is rarely 0."""
    return float(sum(map(ord, text)) % 2)
'''

TINY = [
    "task.reward=summary_rewards:token_parity", "task.num_eval_prompts=4", "sft.steps=0",
    "algorithm.prompts_per_step=2", "algorithm.group_size=4", "algorithm.max_staleness=0",
    "threads=1", "tensorboard=false", "checkpoint_every=100", "rollout.max_new_tokens=3", "model.hidden_size=32",
    "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1", "model.intermediate_size=64",
    "device=fake:cuda:1", "placement.rollout.colocate_with=train",
]  # fmt: skip


@pytest.fixture
def rewards(reward_module) -> Any:
    return reward_module("summary_rewards", REWARDS)


def _run(run_dir: Path, *overrides: str) -> dict[str, Any]:
    from tidal.tools.recipes import resolve_recipe
    from tidal.tools.run import prepare_run
    from tidal.tools.train import train

    cfg, made = prepare_run(resolve_recipe("quickstart_cpu"), [*TINY, f"run_dir={run_dir}", *overrides])
    summary = train(cfg, made, progress=False)
    assert json.loads((made / "summary.json").read_text()) == summary
    return summary


def _last_line(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])


def test_a_resumed_runs_summary_has_the_runs_last_reward_and_handoffs_and_says_what_timeshare_covers(tmp_path, rewards):
    first, longer, again = tmp_path / "first", tmp_path / "longer", tmp_path / "again"
    summary = _run(first, "algorithm.num_steps=3")
    assert summary["last_reward"] == _last_line(first)["reward"]
    assert summary["handoffs"] == _last_line(first)["handoffs"] > 0  # the run's total, as its metrics count it
    assert summary["timeshare"]["since_version"] == 0 and summary["timeshare"]["handoffs"] > 0

    summary = _run(longer, "algorithm.num_steps=5", f"resume={first}")
    line = _last_line(longer)
    assert summary["resumed_at"] == 3 and summary["timeshare"]["since_version"] == 3  # this attempt's seats, from version 3
    assert summary["handoffs"] == line["handoffs"] > summary["timeshare"]["handoffs"]  # the run's, beyond this attempt's
    assert summary["last_reward"] == line["reward"]
    saved = json.loads((longer / "checkpoints" / "step-000005" / "state.json").read_text())
    assert saved["last_reward"] == line["reward"]

    # A finished run resumed (to evaluate it, say): no step is taken, and the summary is still the run's.
    summary = _run(again, "algorithm.num_steps=5", f"resume={longer}")
    assert summary["steps"] == 5 and (again / "metrics.jsonl").read_text() == (longer / "metrics.jsonl").read_text()  # the run's record, no step added
    assert summary["last_reward"] == line["reward"] is not None  # it was None
    assert summary["first_reward"] == _run_first_reward(first)
    assert summary["handoffs"] == saved["totals"]["handoffs"] >= line["handoffs"]
    assert summary["timeshare"]["since_version"] == 5 == summary["resumed_at"]


def _run_first_reward(run_dir: Path) -> float:
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])["reward"]


def test_a_checkpoint_from_before_last_reward_was_saved_resumes_with_none(tmp_path, rewards):
    """Such a checkpoint has no `last_reward`: a resume that takes no step reports None, as
    for `first_reward` (it does not guess one from a metrics file it may not have)."""
    first, again = tmp_path / "first", tmp_path / "again"
    _run(first, "algorithm.num_steps=1")
    path = first / "checkpoints" / "step-000001" / "state.json"
    state = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in state.items() if k != "last_reward"}))
    summary = _run(again, "algorithm.num_steps=1", f"resume={first}")
    assert summary["steps"] == 1 and summary["last_reward"] is None and summary["first_reward"] == state["first_reward"]
