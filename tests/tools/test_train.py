"""`tools/train.py` helpers that the quickstart tests do not isolate."""

from __future__ import annotations

import threading

import torch

from tidal.tools.train import torch_threads


def test_torch_threads_reach_stage_threads_started_inside_and_are_restored_after():
    before = torch.get_num_threads()
    wanted = before + 1  # differs from the default on any machine, so the check can fail
    seen: list[int] = []
    with torch_threads(wanted):
        assert torch.get_num_threads() == wanted
        stage = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))  # as the workflow starts rollout
        stage.start()
        stage.join()
    assert seen == [wanted]
    assert torch.get_num_threads() == before  # the evaluation after RL gets torch's default again


def test_torch_threads_zero_leaves_the_default():
    before = torch.get_num_threads()
    with torch_threads(0):
        assert torch.get_num_threads() == before
    assert torch.get_num_threads() == before
