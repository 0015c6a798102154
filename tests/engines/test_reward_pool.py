"""Rewards in worker processes with a per-sample timeout (`tidal.engines.reward_pool`).

The misbehaving rewards live in a module written to a temporary folder put on `sys.path`:
workers import a reward function by name, and a test module (imported by pytest under
`--import-mode=importlib`) cannot be imported by name in a child.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
import time

import psutil
import pytest

from tidal.engines.math_rewards import math_answer
from tidal.engines.reward_pool import RewardPool
from tidal.engines.rewards import score
from tidal.flow.trajectory import Trajectory

MODULE = "tidal_test_pool_rewards"
SOURCE = '''
import math
import os
import time


def by_text(trajectory, text):
    """Behave as the text says: hang, exit (kills the worker), raise, nan, or a number."""
    if text == "hang":
        time.sleep(3600)
    if text == "exit":
        os._exit(3)
    if text == "raise":
        raise RuntimeError("bad reward")
    if text == "nan":
        return math.nan
    return float(text)
'''


@pytest.fixture(scope="module")
def rewards_module(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pool-rewards")
    (folder / f"{MODULE}.py").write_text(textwrap.dedent(SOURCE))
    sys.path.insert(0, str(folder))
    try:
        yield importlib.import_module(MODULE)
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop(MODULE, None)


@pytest.fixture(scope="module")
def pool(rewards_module):
    with RewardPool(num_workers=2, timeout_s=1.0) as pool:
        yield pool


def rows(texts, answer="0"):
    return [Trajectory(prompt_ids=[1], finish_reason="stop", meta={"answer": answer}) for _ in texts], list(texts)


def test_scores_like_score_in_process(pool, rewards_module):
    trajectories, texts = rows(["1", "0.5", "raise", "nan", "2"])
    rewards, failed, num_timeouts = pool.score(rewards_module.by_text, trajectories, texts)
    assert (rewards, failed) == score(rewards_module.by_text, trajectories, texts) == ([1.0, 0.5, 0.0, 0.0, 2.0], [2, 3])
    assert num_timeouts == 0


def test_math_answers_score_in_the_pool(pool):
    answer = "3 * 14 = 42\n#### 42"
    texts = ["so #### 42", "\\boxed{42}", "#### 41", "\\boxed{42.0}", "the answer is 42"]
    trajectories, texts = rows(texts, answer=answer)
    assert pool.score(math_answer, trajectories, texts) == ([1.0, 1.0, 0.0, 1.0, 0.0], [], 0)


def test_a_hanging_reward_times_out_is_counted_and_its_worker_replaced(pool, rewards_module):
    replaced = pool.num_replaced
    pids_before = set(pool.worker_pids)
    start = time.monotonic()
    rewards, failed, num_timeouts = pool.score(rewards_module.by_text, *rows(["1", "hang", "2", "3"]))
    assert time.monotonic() - start < 30
    assert (rewards, failed, num_timeouts) == ([1.0, 0.0, 2.0, 3.0], [1], 1)
    assert pool.num_replaced == replaced + 1
    assert len(pool.worker_pids) == 2 and all(psutil.pid_exists(pid) for pid in pool.worker_pids)
    assert len(set(pool.worker_pids) - pids_before) == 1  # one new worker, the other kept
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids_before - set(pool.worker_pids))
    assert pool.score(rewards_module.by_text, *rows(["4", "5", "6"])) == ([4.0, 5.0, 6.0], [], 0)


def test_a_reward_that_kills_its_worker_fails_that_sample_and_the_next_batch_still_scores(pool, rewards_module):
    replaced = pool.num_replaced
    rewards, failed, num_timeouts = pool.score(rewards_module.by_text, *rows(["1", "exit", "2", "exit", "3"]))
    assert (rewards, failed, num_timeouts) == ([1.0, 0.0, 2.0, 0.0, 3.0], [1, 3], 0)
    assert pool.num_replaced == replaced + 2
    assert pool.score(rewards_module.by_text, *rows(["7", "8"])) == ([7.0, 8.0], [], 0)


def test_every_worker_hanging_at_once_still_finishes(pool, rewards_module):
    rewards, failed, num_timeouts = pool.score(rewards_module.by_text, *rows(["hang", "hang", "hang", "9"]))
    assert (rewards, failed, num_timeouts) == ([0.0, 0.0, 0.0, 9.0], [0, 1, 2], 3)


def test_a_reward_not_importable_by_name_is_refused(pool):
    with pytest.raises(ValueError, match="must be importable by name"):
        pool.score(lambda trajectory, text: 1.0, *rows(["1"]))


def test_a_reward_the_workers_cannot_import_is_refused(rewards_module):
    def local(trajectory, text):
        return 1.0

    local.__module__, local.__qualname__ = "no_such_module_anywhere", "local"
    sys.modules["no_such_module_anywhere"] = type(sys)("no_such_module_anywhere")
    sys.modules["no_such_module_anywhere"].local = local
    try:
        with RewardPool(num_workers=1, timeout_s=5.0) as pool, pytest.raises(ValueError, match="cannot be loaded in a worker process: ModuleNotFoundError"):
            pool.score(local, *rows(["1"]))
    finally:
        del sys.modules["no_such_module_anywhere"]


def test_close_stops_every_worker(rewards_module):
    pool = RewardPool(num_workers=2, timeout_s=5.0)
    assert pool.score(rewards_module.by_text, *rows(["1"])) == ([1.0], [], 0)
    pids = pool.worker_pids
    pool.close()
    assert len(pids) == 2 and not any(psutil.pid_exists(pid) for pid in pids)
    assert pool.worker_pids == []


@pytest.mark.parametrize(("settings", "message"), [({"num_workers": 0}, "num_workers"), ({"timeout_s": 0}, "timeout_s"), ({"start_method": "fork"}, "start_method")])
def test_bad_arguments_are_named(settings, message):
    with pytest.raises(ValueError, match=message):
        RewardPool(**settings)


def test_another_function_right_after_a_replacement_scores_with_that_function(pool, rewards_module):
    """The batch ends while the hung worker's replacement is still starting with `by_text`;
    the next batch's function must be the one every worker runs."""
    assert pool.score(rewards_module.by_text, *rows(["hang"])) == ([0.0], [0], 1)
    trajectories, texts = rows(["#### 5", "#### 6", "\\boxed{5}"], answer="#### 5")
    assert pool.score(math_answer, trajectories, texts) == ([1.0, 0.0, 1.0], [], 0)
    assert pool.score(rewards_module.by_text, *rows(["3", "4"])) == ([3.0, 4.0], [], 0)
