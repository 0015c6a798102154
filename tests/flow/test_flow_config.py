"""The loop's settings are the recipe's own `algorithm` and `rollout` sections (`flow.config`)."""

from __future__ import annotations

import pytest

from tidal.flow.config import AlgorithmConfig, Checked, RolloutConfig, check_overlong
from tidal.flow.workflow import WorkflowConfig


def test_flat_keys_go_to_the_section_that_has_them():
    cfg = WorkflowConfig.from_keys(num_steps=3, group_size=4, max_new_tokens=16, prompts_per_generate=2, lease_s=60.0, rollout_threads=1)
    assert (cfg.algorithm.num_steps, cfg.algorithm.group_size, cfg.rollout.max_new_tokens, cfg.rollout.prompts_per_generate) == (3, 4, 16, 2)
    assert (cfg.lease_s, cfg.rollout_threads) == (60.0, 1)
    assert cfg.algorithm.prompts_per_step == AlgorithmConfig().prompts_per_step  # untouched keys keep the schema's defaults
    assert cfg.batch_size == cfg.algorithm.prompts_per_step * 4


def test_a_key_no_section_has_is_named():
    with pytest.raises(TypeError, match="'max_stalenes'"):
        WorkflowConfig.from_keys(max_stalenes=2)


def test_the_loss_follows_the_algorithm_keys_and_refuses_a_bad_bound_at_once():
    cfg = WorkflowConfig.from_keys(clip_low=0.1, aggregation="token_sum_norm", max_new_tokens=32, tis_cap=None)
    assert (cfg.loss.clip_low, cfg.loss.aggregation, cfg.loss.max_tokens, cfg.loss.tis_cap) == (0.1, "token_sum_norm", 32, None)
    assert cfg.loss.proximal_is_policy is False  # the workflow sets it per step from `decoupled`
    with pytest.raises(ValueError, match="clip_low"):
        WorkflowConfig.from_keys(clip_low=1.5)


def test_the_sections_check_their_names_and_the_overlong_buffer():
    assert isinstance(AlgorithmConfig(), Checked)
    AlgorithmConfig().check()
    with pytest.raises(ValueError, match=r"algorithm.advantage='ppo' is not one of grpo"):
        AlgorithmConfig(advantage="ppo").check()
    with pytest.raises(ValueError, match=r"algorithm.overlong_buffer=0 must be within 1..rollout.max_new_tokens \(6\)"):
        check_overlong(AlgorithmConfig(overlong="penalty"), RolloutConfig())
    check_overlong(AlgorithmConfig(overlong="penalty", overlong_buffer=6), RolloutConfig())
