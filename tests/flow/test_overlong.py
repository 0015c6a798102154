"""Long responses: the length metrics of each step and `algorithm.overlong` (DAPO's filter
and soft penalty), with hand-computed values, through the real `Workflow` with scripted
fake engines (each response's length and end are fixed by its position in its group)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tidal.flow.algorithms import filter_truncated, overlong_penalty
from tidal.flow.store import Store
from tidal.flow.workflow import Workflow, WorkflowConfig

LENGTHS = [2, 7, 9, 10]
"""Generated tokens of a group's samples, in order; with max_new_tokens=10 the last is cut."""
MAX_NEW_TOKENS = 10


class ScriptedRollout:
    """Sample k of a group (k = its position in the generate call) gets LENGTHS[k] tokens;
    it ends with an end token (`stop`) unless that is the whole budget (`length`)."""

    pad_id = 0

    def __init__(self) -> None:
        self.version = 0

    def generate(self, trajectories: Any, *, max_new_tokens: int, should_pause: Any = None, refill: Any = None) -> list[Any]:
        for k, t in enumerate(trajectories):
            n = LENGTHS[k % len(LENGTHS)]
            t.extend([3] * n, [-1.0] * n, self.version)
            t.finish_reason = "length" if n == max_new_tokens else "stop"
        return list(trajectories)

    def load_weights(self, version: int, named_tensors: Any) -> None:
        self.version = version


class RecordingTrainer:
    """Keeps each step's loss mask and advantages; trains nothing."""

    def __init__(self) -> None:
        self.version, self.masks, self.advantages = 0, [], []

    def logprobs(self, batch: Any) -> torch.Tensor:
        return torch.zeros(batch.loss_mask.shape)

    def train_step(self, batch: Any, advantages: torch.Tensor, *, loss: Any, proximal_logprobs: Any = None) -> dict[str, float]:
        self.masks.append(batch.loss_mask.clone())
        self.advantages.append(advantages.clone())
        self.version += 1
        return {"loss": 0.0}

    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        return [("w", torch.zeros(1))]

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _run(**overlong: Any) -> tuple[list[dict[str, Any]], RecordingTrainer]:
    cfg = WorkflowConfig.from_keys(num_steps=2, prompts_per_step=1, group_size=4, max_staleness=0, max_new_tokens=MAX_NEW_TOKENS, prompts_per_generate=1, tis_cap=None, decoupled=False, **overlong)
    prompts = iter([{"prompt_ids": [1, 2], "answer": "x"} for _ in range(10)])
    steps: list[dict[str, Any]] = []
    trainer = RecordingTrainer()

    def score(trajectories: Any) -> tuple[list[float], list[int]]:
        return [1.0] * len(trajectories), []  # every answer right: any spread of the rewards is the penalty's

    Workflow(store=Store(), rollout=ScriptedRollout(), trainer=trainer, prompts=prompts, score=score, config=cfg, on_step=steps.append).run()
    return steps, trainer


@pytest.mark.parametrize(("length", "expected"), [(0, 0.0), (5, 0.0), (6, 0.0), (7, -0.25), (8, -0.5), (9, -0.75), (10, -1.0), (12, -1.0)])
def test_the_soft_penalty_falls_linearly_over_the_buffer(length, expected):
    assert overlong_penalty(length, max_tokens=10, buffer=4) == expected


def test_a_buffer_outside_the_budget_is_refused():
    for buffer in (0, 11):
        with pytest.raises(ValueError, match="buffer"):
            overlong_penalty(3, max_tokens=10, buffer=buffer)


def test_filter_zeroes_only_the_rows_cut_at_the_limit():
    mask = torch.ones(3, 4)
    assert filter_truncated(mask, ["stop", "length", None]).tolist() == [[1] * 4, [0] * 4, [1] * 4]
    assert mask.sum() == 12  # not changed in place


def test_each_step_reports_mean_and_longest_response_and_the_share_cut():
    steps, trainer = _run()
    for m in steps:
        assert m["response_len"] == (2 + 7 + 9 + 10) / 4 and m["response_len_max"] == 10
        assert m["truncated_fraction"] == 0.25
        assert sorted(n for group in m["lengths"] for n in group) == [2, 7, 9, 10]  # each response's length, by group: a trace `tidal simulate --lengths` replays
        assert [len(group) for group in m["rewards"]] == [len(group) for group in m["lengths"]] and sum(map(sum, m["rewards"])) == pytest.approx(4 * m["reward"])  # and its reward
    assert all(int(mask.sum()) == 28 for mask in trainer.masks)  # overlong=none: every token trains


def test_filter_gives_the_cut_response_no_loss_token():
    steps, trainer = _run(overlong="filter")
    for mask in trainer.masks:
        assert mask.sum(1).tolist() == [2, 7, 9, 0]
    assert all(m["response_len"] == 7.0 and m["truncated_fraction"] == 0.25 for m in steps)  # the metrics count what was generated


def test_penalty_is_added_to_the_reward_before_the_advantage():
    steps, trainer = _run(overlong="penalty", overlong_buffer=4)
    rewards = torch.tensor([1.0, 1.0 - 0.25, 1.0 - 0.75, 1.0 - 1.0])  # lengths 2, 7, 9, 10 with the limit 10, buffer 4
    assert all(m["reward"] == pytest.approx(float(rewards.mean())) for m in steps)
    expected = (rewards - rewards.mean()) / (rewards.std() + 1e-6)  # GRPO
    for advantages in trainer.advantages:
        assert torch.allclose(advantages, expected, atol=1e-4), advantages
