"""The recipe keys of long generations (`train.max_tokens_per_micro_batch`,
`algorithm.overlong`, `algorithm.overlong_buffer`): refused naming the key when out of
bounds, documented, and handed to the engines and the workflow."""

from __future__ import annotations

import pytest

from tidal.tools.config import ConfigError, RecipeConfig, iter_keys, load_config
from tidal.tools.recipes import resolve_recipe
from tidal.tools.rl import workflow_config

KEYS = ("train.max_tokens_per_micro_batch", "algorithm.overlong", "algorithm.overlong_buffer", "task.reward_workers", "task.reward_timeout_s")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.max_tokens_per_micro_batch=1"], "train.max_tokens_per_micro_batch=1 must be >= 2"),
        (["algorithm.overlong=drop"], "algorithm.overlong='drop' is not one of none, filter, penalty"),
        (["algorithm.overlong=penalty"], "algorithm.overlong_buffer=0 must be within 1..rollout.max_new_tokens (6)"),
        (["algorithm.overlong=penalty", "algorithm.overlong_buffer=7"], "algorithm.overlong_buffer=7 must be within"),
        (["algorithm.overlong_buffer=-1"], "algorithm.overlong_buffer=-1 must be >= 0"),
    ],
)
def test_bad_values_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(resolve_recipe("quickstart_cpu"), overrides)
    assert message in str(e.value)


def test_the_keys_are_documented_and_reach_the_workflow():
    docs = {k.key: k.doc for k in iter_keys(RecipeConfig)}
    assert all(docs.get(key) for key in KEYS)
    cfg = load_config(resolve_recipe("quickstart_cpu"), ["algorithm.overlong=penalty", "algorithm.overlong_buffer=2", "train.max_tokens_per_micro_batch=256"])
    loop = workflow_config(cfg)
    assert (loop.algorithm.overlong, loop.algorithm.overlong_buffer, loop.rollout.max_new_tokens) == ("penalty", 2, 6)
    assert cfg.train.max_tokens_per_micro_batch == 256
