"""The learning-rate schedule: its curve by hand, the `lr` each engine's steps report, and
its position carried through `state_dict()` and the fsdp engine's sharded checkpoint."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist

from tidal.engines.fsdp_train import FSDPTrainEngine
from tidal.engines.lr_schedule import LRSchedule
from tidal.engines.tiny import CharTokenizer, build_tiny_qwen2
from tidal.engines.torch_train import TorchTrainEngine
from tidal.flow.algorithms import PolicyLossConfig
from tidal.flow.trajectory import TokenBatch, Trajectory, to_token_batch
from tidal.hal import current_platform

T = CharTokenizer()
COSINE = LRSchedule(kind="cosine", warmup_steps=2, num_steps=5, min_lr_ratio=0.0)
"""lr x 1/3, 2/3 (warmup), then 1, 1/2, 0: the cosine from its top to its end over steps 2..4."""


def _model() -> torch.nn.Module:
    return build_tiny_qwen2(T.vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=32)


def _batch() -> tuple[TokenBatch, torch.Tensor]:
    rows = []
    for prompt, response in [("1+2=", [5, 6]), ("13-4=", [5, 6, 7, 8, 9])]:
        t = Trajectory(prompt_ids=T.encode(prompt))
        t.extend(response, [-1.0] * len(response), 0)
        rows.append(t)
    return to_token_batch(rows, pad_id=T.pad_id), torch.tensor([1.0, -0.5])


def _lrs(engine, steps: int) -> list[float]:
    batch, advantages = _batch()
    return [engine.train_step(batch, advantages, loss=PolicyLossConfig())["lr"] for _ in range(steps)]


def test_the_curve_by_hand():
    warmup = LRSchedule(warmup_steps=3, num_steps=10)
    assert [warmup.factor(k) for k in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]  # constant after the ramp
    cosine = LRSchedule(kind="cosine", num_steps=5, min_lr_ratio=0.1)
    assert cosine.factor(0) == 1.0
    assert cosine.factor(2) == pytest.approx(0.55)  # the midpoint: halfway between 1 and min_lr_ratio
    assert cosine.factor(1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert cosine.factor(4) == pytest.approx(0.1) and cosine.factor(9) == pytest.approx(0.1)  # the last step, and past it
    assert [COSINE.factor(k) for k in range(5)] == pytest.approx([1 / 3, 2 / 3, 1.0, 0.5, 0.0])


@pytest.mark.parametrize(("field", "value"), [("kind", "linear"), ("warmup_steps", -1), ("num_steps", 0), ("min_lr_ratio", 1.5)])
def test_a_schedule_out_of_bounds_is_refused_naming_its_field(field, value):
    with pytest.raises(ValueError, match=field.replace("kind", "lr_schedule")):
        LRSchedule(**{field: value})


def test_the_torch_engine_steps_at_the_scheduled_lr_and_resumes_on_the_curve():
    engine = TorchTrainEngine(_model(), lr=0.3, lr_schedule=COSINE)
    assert _lrs(engine, 2) == pytest.approx([0.1, 0.2])
    state = copy.deepcopy(engine.state_dict())  # as through a checkpoint file: no tensors shared
    resumed = TorchTrainEngine(_model(), lr=0.3, lr_schedule=COSINE)
    resumed.load_state_dict(state)
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(0.3)  # step 2's, before it is taken
    lrs = _lrs(resumed, 3)
    assert lrs == _lrs(engine, 3) and lrs == pytest.approx([0.3, 0.15, 0.0])
    assert all(torch.equal(a, b) for a, b in zip(engine.model.state_dict().values(), resumed.model.state_dict().values()))


def test_a_state_from_before_schedules_resumes_at_its_version():
    engine = TorchTrainEngine(_model(), lr=0.3)
    assert _lrs(engine, 3) == [0.3] * 3  # no schedule: constant
    state = {k: v for k, v in engine.state_dict().items() if k != "lr_scheduler"}
    resumed = TorchTrainEngine(_model(), lr=0.3, lr_schedule=COSINE)
    resumed.load_state_dict(state)
    assert _lrs(resumed, 1) == pytest.approx([0.15])  # step 3 of the curve


@pytest.fixture
def group(tmp_path):
    """A process group of this process alone."""
    current_platform().init_process_group(rank=0, world_size=1, init_method=f"file://{tmp_path / 'group'}")
    yield
    dist.destroy_process_group()


def test_the_fsdp_engine_keeps_the_position_in_its_state_and_its_checkpoint(group, tmp_path):
    engine = FSDPTrainEngine(_model(), lr=0.3, lr_schedule=COSINE)
    assert _lrs(engine, 2) == pytest.approx([0.1, 0.2])
    engine.save_checkpoint(tmp_path / "ckpt")
    state = engine.state_dict()
    for load in (lambda e: e.load_state_dict(state), lambda e: e.load_checkpoint(tmp_path / "ckpt")):
        resumed = FSDPTrainEngine(_model(), lr=0.3, lr_schedule=COSINE)
        load(resumed)
        assert resumed.scheduler.last_epoch == 2
        assert _lrs(resumed, 3) == pytest.approx([0.3, 0.15, 0.0])
