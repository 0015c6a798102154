"""Dynamic sampling (`algorithm.filter_groups`, DAPO): groups whose samples all got one
reward are left out, admission starts other prompts in their place, and a run where no
group carries signal stops with an error naming the key; through the real `Workflow` with
scripted engines (each response's length fixed by its position in its group)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.flow.test_overlong import MAX_NEW_TOKENS, RecordingTrainer, ScriptedRollout
from tidal.flow.algorithms import grpo, silent_groups
from tidal.flow.store import Store
from tidal.flow.workflow import Workflow, WorkflowConfig

GROUP = 4


def _score(trajectories: Any) -> tuple[list[float], list[int]]:
    """A "solved" prompt scores 1 on every sample; a "mixed" one 1 on its two shortest
    (lengths 2 and 7 of ScriptedRollout's 2, 7, 9, 10), 0 on the others."""
    return [1.0 if t.meta["answer"] == "solved" or t.num_generated < 8 else 0.0 for t in trajectories], []


def _run(prompts: list[str], **keys: Any) -> tuple[list[dict[str, Any]], RecordingTrainer]:
    cfg = WorkflowConfig.from_keys(prompts_per_step=2, group_size=GROUP, max_new_tokens=MAX_NEW_TOKENS, prompts_per_generate=1, tis_cap=None, decoupled=False, **{"num_steps": 3, "max_staleness": 0, **keys})
    steps: list[dict[str, Any]] = []
    trainer = RecordingTrainer()
    source = iter([{"prompt_ids": [1, 2], "answer": answer} for answer in prompts])
    Workflow(store=Store(), rollout=ScriptedRollout(), trainer=trainer, prompts=source, score=_score, config=cfg, on_step=steps.append).run()
    return steps, trainer


def test_silent_groups_marks_every_row_of_a_group_without_an_advantage():
    nan = float("nan")
    # all one reward | two values | all failed | tied in float32 | one scored | two scored and a failure
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, nan, nan, 0.1, 0.1, 0.1, nan, 2.0, nan, 0.0, 1.0])
    groups = [0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 3, 4, 4, 5, 5, 5]
    silent = silent_groups(rewards, groups)
    assert silent.tolist() == [True] * 3 + [False] * 3 + [True] * 2 + [True] * 3 + [True] * 2 + [False] * 3
    # the groups it marks are exactly those every estimator gives advantage 0 throughout
    advantages = grpo(rewards, groups)
    for g in set(groups):
        rows = [k for k, h in enumerate(groups) if h == g]
        assert bool(silent[rows[0]]) == all(advantages[k] == 0 for k in rows)


def test_each_step_trains_only_groups_with_signal_and_counts_those_left_out():
    prompts = ["solved", "mixed"] * 6  # 3 steps of 2 mixed prompts need all 12
    steps, trainer = _run(prompts, filter_groups=True)
    assert [m["step"] for m in steps] == [1, 2, 3]
    for m, advantages in zip(steps, trainer.advantages):
        assert m["samples"] == 2 * GROUP and sorted(map(sorted, m["rewards"])) == [[0.0, 0.0, 1.0, 1.0]] * 2
        assert (advantages != 0).all()
    assert [m["filtered_groups"] for m in steps] == [2, 2, 2]  # every solved prompt, each once, in the step its version trained


def test_without_the_filter_solved_groups_train_with_advantage_zero():
    steps, trainer = _run(["solved", "mixed"] * 6)
    assert "filtered_groups" not in steps[0]
    for m, advantages in zip(steps, trainer.advantages):
        assert sorted(map(sorted, m["rewards"])) == [[0.0, 0.0, 1.0, 1.0], [1.0] * 4]
        assert int((advantages == 0).sum()) == GROUP


def test_async_admission_starts_replacements_for_the_groups_left_out():
    steps, trainer = _run(["solved", "solved", "mixed"] * 30, filter_groups=True, max_staleness=1, num_steps=4)
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    assert all((advantages != 0).all() and len(advantages) == 2 * GROUP for advantages in trainer.advantages)
    assert all(max(m["version_gap"]) <= 1 for m in steps)


def test_a_source_used_up_by_the_filter_names_it():
    with pytest.raises(RuntimeError, match=r"prompt source ran out: .*and 8 started.*, 4 groups left out without signal \(algorithm.filter_groups\)"):
        _run(["solved", "mixed"] * 4, filter_groups=True)


def test_a_run_that_leaves_out_too_many_groups_in_a_row_stops_naming_the_key():
    with pytest.raises(RuntimeError, match=r"algorithm.filter_groups left out (\d+) groups in a row, each with one reward for all its samples \(rewards seen: \[1.0\]\), more than algorithm.max_filtered_in_a_row=2") as raised:
        _run(["solved"] * 50, filter_groups=True, max_filtered_in_a_row=2)
    assert 3 <= int(raised.value.args[0].split()[3]) <= 4  # the groups of one advantage batch count together: the 2 a step admits at once
    steps, _ = _run(["solved", "solved", "mixed"] * 10, filter_groups=True, max_filtered_in_a_row=2)  # two in a row, then one kept: within the limit
    assert len(steps) == 3
