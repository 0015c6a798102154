"""A reward model (`engines.reward_model`) on small sequence-classification checkpoints built
here (`tools.bench.fixture.build_tiny_reward_model`), and the run's scorer that adds its
score to the task's reward (`tools.rl.Scorer`)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tidal.engines.reward_model import RewardModel, conversation
from tidal.flow.trajectory import Trajectory
from tidal.tools.bench.fixture import build_tiny_hf_checkpoint, build_tiny_reward_model

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tom has 3 apples and buys 4 more. How many?"}]
RESPONSES = ["7", "Tom has 3 + 4 = 7 apples.\n#### 7", "apples " * 30, ""]


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_reward_model(tmp_path_factory.mktemp("rm"))


def _by_hand(model: RewardModel, text: str) -> float:
    """The score head on the last token's final hidden state, one unpadded text at a time."""
    ids = model.tokenizer(text, add_special_tokens=not model.templated, return_tensors="pt")["input_ids"][:, -model.max_length :]
    with torch.no_grad():
        hidden = model.model.model(input_ids=ids).last_hidden_state[0, -1]
        return float(model.model.score(hidden)[0])


def test_a_batch_is_scored_as_each_text_alone_at_its_last_token(reward_dir):
    model = RewardModel(reward_dir, batch_size=3)  # batches of 3 and 1, padded on the right
    scores = model.score([CONVERSATION] * len(RESPONSES), RESPONSES)
    expected = [_by_hand(model, model.text(CONVERSATION, r)) for r in RESPONSES]
    assert scores == pytest.approx(expected, abs=1e-5)
    assert len(set(round(s, 6) for s in scores)) == len(scores)  # the response changes the score


def test_the_reward_model_reads_the_conversation_in_its_own_chat_template(reward_dir):
    model = RewardModel(reward_dir)
    assert model.text(CONVERSATION, "7") == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nTom has 3 apples and buys 4 more. How many?<|im_end|>\n<|im_start|>assistant\n7<|im_end|>\n"


def test_without_a_chat_template_it_reads_the_prompt_text_then_the_response(tmp_path):
    model = RewardModel(build_tiny_reward_model(tmp_path / "rm", chat_template=False))
    assert not model.templated and model.text([{"role": "user", "content": "3+4="}], "7") == "3+4=7"
    assert model.score([[{"role": "user", "content": "3+4="}]], ["7"]) == pytest.approx([_by_hand(model, "3+4=7")], abs=1e-5)


def test_a_long_input_keeps_its_end(reward_dir):
    full = RewardModel(reward_dir)
    cut = RewardModel(reward_dir, max_length=16)
    text = cut.text(CONVERSATION, RESPONSES[2])
    ids = cut.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 16
    scored = cut.score([CONVERSATION], [RESPONSES[2]])[0]
    with torch.no_grad():
        last16 = full.model.model(input_ids=torch.tensor([ids[-16:]])).last_hidden_state[0, -1]
        assert scored == pytest.approx(float(full.model.score(last16)[0]), abs=1e-5)
    assert scored != pytest.approx(full.score([CONVERSATION], [RESPONSES[2]])[0], abs=1e-4)


def test_a_folder_that_is_not_a_one_label_classifier_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"reward_model.path='.*nowhere' does not exist"):
        RewardModel(tmp_path / "nowhere")
    policy = build_tiny_hf_checkpoint(tmp_path / "policy")  # a causal LM would get a score head of random weights
    with pytest.raises(ValueError, match=r"reward_model.path=.*architectures are \['Qwen2ForCausalLM'\]: not a sequence-classification model"):
        RewardModel(policy)
    two = build_tiny_reward_model(tmp_path / "two")
    config = json.loads((two / "config.json").read_text())
    config["id2label"] = {"0": "bad", "1": "good"}
    (two / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"reward_model.path=.*has 2 labels; a reward model has one"):
        RewardModel(two)


def test_conversation_is_the_items_messages_or_its_prompt_as_the_user_turn():
    assert conversation({"messages": CONVERSATION, "prompt": "<|im_start|>..."}) == CONVERSATION
    assert conversation({"prompt": "3+4="}) == [{"role": "user", "content": "3+4="}]


class _FixedModel:
    """A reward model that gives the scores it is told, recording what it read."""

    def __init__(self, scores: list[float]) -> None:
        self.scores, self.read = scores, []

    def score(self, conversations: Any, responses: Any) -> list[float]:
        self.read.append((list(conversations), list(responses)))
        return self.scores


def _trajectories(tokenizer: Any, answers: list[str]) -> list[Trajectory]:
    out = []
    for answer in answers:
        t = Trajectory(prompt_ids=tokenizer.encode("3+4="), meta={"prompt": "3+4=", "answer": "7"})
        ids = tokenizer.encode(answer)[1:] + list(tokenizer.eos_ids)[:1]  # no <bos>; closed by the end token
        t.extend(ids, [0.0] * len(ids), 0)
        t.finish_reason = "stop"
        out.append(t)
    return out


def _scorer(overrides: list[str], model: Any) -> Any:
    from tidal.tools.config import load_config
    from tidal.tools.recipes import resolve_recipe
    from tidal.tools.rl import Scorer

    cfg = load_config(resolve_recipe("quickstart_cpu"), overrides)
    from tidal.engines.tiny import CharTokenizer

    return Scorer(cfg, CharTokenizer(), reward_model=model), CharTokenizer()


def test_the_scorer_adds_the_weighted_score_to_the_tasks_reward():
    model = _FixedModel([0.5, -2.0, 0.25])
    scorer, tokenizer = _scorer(["reward_model.weight=2.0"], model)
    rewards, failed, timeouts = scorer(_trajectories(tokenizer, ["7", "8", "7"]))
    assert rewards == [1.0 + 1.0, 0.0 - 4.0, 1.0 + 0.5] and failed == [] and timeouts == 0
    assert model.read == [([[{"role": "user", "content": "3+4="}]] * 3, ["7", "8", "7"])]  # the answers as the verifier reads them


def test_with_task_reward_none_the_score_is_the_reward_and_a_non_finite_one_fails_the_row():
    scorer, tokenizer = _scorer(["task.reward=none", "reward_model.weight=0.5"], _FixedModel([3.0, math.nan, math.inf]))
    assert scorer.reward is None and scorer.pool is None
    rewards, failed, _ = scorer(_trajectories(tokenizer, ["7", "7", "7"]))
    assert rewards == [1.5, 0.0, 0.0] and failed == [1, 2]
