"""`tools/train.py` helpers that the quickstart tests do not isolate."""

from __future__ import annotations

import threading

import torch

from tidal.tools.train import prune_checkpoints, torch_threads


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


def test_prune_checkpoints_keeps_the_newest_and_never_the_latest(tmp_path):
    for name in ("step-000010", "step-000020", "step-000030", "step-000100", "step-000040.tmp"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "trainer.pt").write_text("x")
    (tmp_path / "latest").write_text("step-000100\n")
    assert prune_checkpoints(tmp_path, keep=2, latest="step-000100") == ["step-000010", "step-000020"]  # by step, not by name length
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000030", "step-000040.tmp", "step-000100"]
    assert prune_checkpoints(tmp_path, keep=1, latest="step-000030") == []  # the one `latest` names stays, whatever its age
    assert (tmp_path / "step-000030").is_dir() and (tmp_path / "step-000100").is_dir()
