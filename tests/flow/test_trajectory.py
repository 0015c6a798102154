"""Trajectories: token in / token out, per-token versions, environment turns, batch layout."""

from __future__ import annotations

import pytest
import torch

from tidal.flow.trajectory import ENV_VERSION, Trajectory, to_token_batch


def test_multi_turn_trajectory_keeps_versions_and_masks_environment_tokens():
    t = Trajectory(prompt_ids=[1, 5, 6])
    t.extend([7, 8], [-0.5, -0.25], version=3)
    t.finish_reason = "stop"  # the turn ended at EOS
    t.append_env([9, 9, 9])  # a tool's reply, already token ids: never decoded or re-tokenized
    assert not t.done  # open again for the next turn (generate skipped it as finished)
    t.extend([10], [-1.0], version=4)
    assert t.ids == [1, 5, 6, 7, 8, 9, 9, 9, 10]
    assert t.versions == [3, 3, ENV_VERSION, ENV_VERSION, ENV_VERSION, 4]
    assert t.loss_mask == [1, 1, 0, 0, 0, 1] and t.num_generated == 3
    assert t.versions_used == [3, 4] and t.oldest_version == 3 and not t.done
    with pytest.raises(ValueError, match="2 tokens but 1 logprobs"):
        t.extend([1, 2], [0.0], version=5)


def test_token_batch_aligns_each_token_with_the_position_that_predicts_it():
    a = Trajectory(prompt_ids=[1, 5])
    a.extend([7, 2], [-0.1, -0.2], version=0)
    b = Trajectory(prompt_ids=[1, 5, 6, 6])
    b.extend([8], [-0.3], version=1)
    batch = to_token_batch([a, b], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 5, 7, 2, 0], [1, 5, 6, 6, 8]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    # position t predicts input_ids[:, t + 1]: a's tokens at positions 1, 2; b's at 3
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0], [0, 0, 0, 1]]
    assert torch.allclose(batch.behavior_logprobs, torch.tensor([[0, -0.1, -0.2, 0], [0, 0, 0, -0.3]]))
    assert batch.versions.tolist() == [[-1, 0, 0, -1], [-1, -1, -1, 1]]
    assert len(batch.select([1])) == 1 and batch.select(slice(0, 1)).input_ids.tolist() == [[1, 5, 7, 2, 0]]


def test_fields_of_different_lengths_are_refused():
    with pytest.raises(ValueError, match="3 tokens, 0 logprobs, 0 versions"):
        Trajectory(prompt_ids=[1], tokens=[5, 6, 7])  # made a TokenBatch whose tensors disagreed in width
    with pytest.raises(ValueError, match="2 tokens, 2 logprobs, 1 versions"):
        Trajectory(prompt_ids=[1], tokens=[5, 6], logprobs=[-0.1, -0.2], versions=[0])
    t = Trajectory(prompt_ids=[1, 2], tokens=[5, 6], logprobs=[-0.1, -0.2], versions=[0, 0])
    t.versions.pop()  # changed after it was made
    with pytest.raises(ValueError, match="2 tokens, 2 logprobs, 1 versions"):
        to_token_batch([t], pad_id=0)


def test_tokens_of_several_versions_through_pause_resume_and_an_environment_turn():
    # Version 3 writes two tokens and pauses (new weights); version 4 resumes and stops at EOS;
    # a tool answers; version 5 writes the last turn and runs out of budget.
    t = Trajectory(prompt_ids=[1, 5])
    t.extend([7, 8], [-0.5, -0.25], version=3)
    assert not t.done  # paused: unfinished, resumed by the next generate
    t.extend([2], [-0.125], version=4)
    t.finish_reason = "stop"
    t.append_env([9])
    t.extend([10, 11], [-1.0, -2.0], version=5)
    t.finish_reason = "length"
    assert t.versions == [3, 3, 4, ENV_VERSION, 5, 5] and t.versions_used == [3, 4, 5] and t.oldest_version == 3
    assert t.num_generated == 5 and t.done
    batch = to_token_batch([t], pad_id=0)
    # Position p - 1 + j = 1 + j predicts tokens[j]; the tool token (position 4) is out of the loss.
    assert batch.input_ids.tolist() == [[1, 5, 7, 8, 2, 9, 10, 11]]
    assert batch.loss_mask.tolist() == [[0, 1, 1, 1, 0, 1, 1]]
    assert batch.versions.tolist() == [[-1, 3, 3, 4, -1, 5, 5]]
    assert batch.behavior_logprobs.tolist() == [[0.0, -0.5, -0.25, -0.125, 0.0, -1.0, -2.0]]
    assert batch.crop(4).loss_mask.tolist() == [[0, 1, 1]]


def test_extend_refuses_a_version_below_zero():
    # Version -1 is the environment's: the policy's tokens were silently left out of the loss.
    t = Trajectory(prompt_ids=[1])
    with pytest.raises(ValueError, match="version=-1"):
        t.extend([5], [-0.1], version=ENV_VERSION)
    assert t.tokens == [] and t.loss_mask == []


def test_extend_refuses_a_finished_trajectory():
    # Tokens after EOS (or past the budget) went in with finish_reason still "stop"; the next
    # turn starts with `append_env`, which opens the trajectory again.
    t = Trajectory(prompt_ids=[1])
    t.extend([5, 2], [-0.1, -0.2], version=0)
    t.finish_reason = "stop"
    with pytest.raises(ValueError, match="finish_reason='stop'"):
        t.extend([6], [-0.3], version=0)
    assert t.tokens == [5, 2]
    t.append_env([9])
    t.extend([6], [-0.3], version=1)
    assert t.tokens == [5, 2, 9, 6] and not t.done
