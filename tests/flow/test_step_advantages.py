"""REINFORCE++-baseline through the real `Workflow` (scripted engines: each response's length
fixed by its place in its group): the trainer gets each row's reward minus its group's mean,
whitened over the step's loss tokens, so a step's advantages have token mean 0 and std 1."""

from __future__ import annotations

from typing import Any

import torch

from tests.flow.test_overlong import LENGTHS, MAX_NEW_TOKENS, RecordingTrainer, ScriptedRollout
from tidal.flow.store import Store
from tidal.flow.workflow import Workflow, WorkflowConfig


def _score(trajectories: Any) -> tuple[list[float], list[int]]:
    """Rewards that differ between the prompts' groups (its answer) and within them (length)."""
    return [float(t.meta["answer"]) + (t.num_generated < 8) for t in trajectories], []


def test_reinforce_plus_plus_baseline_whitens_each_steps_advantages_over_its_tokens():
    cfg = WorkflowConfig.from_keys(num_steps=2, prompts_per_step=2, group_size=4, max_staleness=0, max_new_tokens=MAX_NEW_TOKENS, prompts_per_generate=1, tis_cap=None, decoupled=False, advantage="reinforce_plus_plus_baseline")
    trainer = RecordingTrainer()
    prompts = iter([{"prompt_ids": [1, 2], "answer": k % 3} for k in range(8)])
    Workflow(store=Store(), rollout=ScriptedRollout(), trainer=trainer, prompts=prompts, score=_score, config=cfg).run()
    assert len(trainer.advantages) == 2
    for advantages, mask in zip(trainer.advantages, trainer.masks):
        tokens = mask.sum(1)
        assert sorted(tokens.tolist()) == sorted(LENGTHS * 2)
        per_token = torch.repeat_interleave(advantages.double(), tokens.long())
        assert abs(float(per_token.mean())) < 1e-6 and abs(float(per_token.std()) - 1.0) < 1e-6
        centered = torch.tensor([0.5 if n < 8 else -0.5 for n in tokens.tolist()], dtype=torch.float64)  # each group: 1 on its two short responses, 0 on the long ones
        by_token = torch.repeat_interleave(centered, tokens.long())
        assert torch.allclose(advantages.double(), (centered - by_token.mean()) / by_token.std(), atol=1e-5)
