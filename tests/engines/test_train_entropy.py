"""The train engines' entropy: the `entropy` metric is the model's own, packed or not, and
the entropy bonus (`entropy_coef`) trains rows without advantage and raises the entropy."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from tidal.engines import torch_train
from tidal.engines.fsdp_train import FSDPTrainEngine
from tidal.engines.tiny import CharTokenizer, build_tiny_qwen2
from tidal.engines.torch_train import TorchTrainEngine
from tidal.flow.algorithms import PolicyLossConfig, token_entropy
from tidal.flow.trajectory import Trajectory, to_token_batch
from tidal.hal import current_platform

T = CharTokenizer()
RESPONSES = [[5, 6], [7], [5, 8, 9], [6, 2]]
ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.25, -0.25, 0.75, -0.75], dtype=torch.float64)
"""Every row of `_grouped_batch` with a signal: every row runs."""


def tiny(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return build_tiny_qwen2(T.vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=32).to(dtype)


def _grouped_batch():
    """Two groups of four rows, each group sharing its prompt (so the torch engine packs them)."""
    rows = []
    for prompt in ("7=", "13-4="):
        for response in RESPONSES:
            t = Trajectory(prompt_ids=T.encode(prompt))
            t.extend(response, [-1.0] * len(response), 0)
            rows.append(t)
    batch = to_token_batch(rows, pad_id=T.pad_id)
    assert torch_train._shared_prompts(batch) is not None  # the packed path is the one taken
    return batch


def _entropy_by_hand(model: torch.nn.Module, batch) -> float:
    """The mean over loss tokens of each predicting position's entropy, from one plain forward."""
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1]
        entropy = token_entropy(torch.log_softmax(logits.double(), dim=-1))
    mask = batch.loss_mask.double()
    return float((entropy * mask).sum() / mask.sum())


@pytest.mark.parametrize("packs", [True, False], ids=["packed", "plain"])
def test_the_entropy_metric_is_the_models_over_loss_tokens(monkeypatch, packs):
    batch = _grouped_batch()
    if not packs:
        monkeypatch.setattr(torch_train, "_shared_prompts", lambda batch: None)
    engine = TorchTrainEngine(tiny(dtype=torch.float64), lr=1e-2, micro_batch_size=4)
    expected = _entropy_by_hand(copy.deepcopy(engine.model).eval(), batch)
    metrics = engine.train_step(batch, ADVANTAGES, loss=PolicyLossConfig(proximal_is_policy=True))
    assert metrics["entropy"] == pytest.approx(expected, rel=1e-6)


def test_the_packed_entropy_has_the_plain_gradient(monkeypatch):
    batch = _grouped_batch()
    grads = []
    for packs in (True, False):
        if not packs:
            monkeypatch.setattr(torch_train, "_shared_prompts", lambda batch: None)
        engine = TorchTrainEngine(tiny(dtype=torch.float64), micro_batch_size=16)
        _, entropy = engine._token_stats(batch, entropy="grad")
        (entropy * batch.loss_mask).sum().backward()
        grads.append([p.grad for p in engine.model.parameters()])
    for packed, plain in zip(*grads):
        torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-7)  # float64, up to the float32 rotary positions


def test_an_entropy_bonus_trains_rows_without_advantage_and_raises_the_entropy():
    batch = _grouped_batch()
    zeros = torch.zeros_like(ADVANTAGES)
    engine = TorchTrainEngine(tiny(dtype=torch.float64), lr=1e-2, micro_batch_size=4)
    assert engine.train_step(batch, zeros, loss=PolicyLossConfig())["skipped_rows"] == len(batch)  # no bonus: nothing to learn
    before = _entropy_by_hand(engine.model.eval(), batch)
    for _ in range(3):
        metrics = engine.train_step(batch, zeros, loss=PolicyLossConfig(entropy_coef=1.0))
        assert metrics["skipped_rows"] == 0
    assert _entropy_by_hand(engine.model.eval(), batch) > before + 1e-3


def test_the_fsdp_engine_reports_the_entropy_and_trains_the_bonus(tmp_path):
    batch = _grouped_batch()
    current_platform().init_process_group(rank=0, world_size=1, init_method=f"file://{tmp_path / 'group'}")
    try:
        engine = FSDPTrainEngine(tiny(), lr=1e-2, micro_batch_size=4)
        expected = _entropy_by_hand(tiny().eval(), batch)
        metrics = engine.train_step(batch, ADVANTAGES.float(), loss=PolicyLossConfig(proximal_is_policy=True))
        assert metrics["entropy"] == pytest.approx(expected, rel=1e-4)
        zeros = torch.zeros(len(batch))
        assert engine.train_step(batch, zeros, loss=PolicyLossConfig())["skipped_rows"] == len(batch)
        bonus = engine.train_step(batch, zeros, loss=PolicyLossConfig(entropy_coef=1.0))
        assert bonus["skipped_rows"] == 0 and bonus["loss"] == pytest.approx(-bonus["entropy"], rel=1e-5)
    finally:
        dist.destroy_process_group()


def _uneven_batch():
    """Rows of 5, 1, 3 and 1 loss tokens under two prompts, and a row without one (an environment turn alone)."""
    rows = []
    for prompt, response in [("7=", [5, 6, 7, 8, 9]), ("7=", [5]), ("13-4=", [6, 2, 7]), ("13-4=", [8])]:
        t = Trajectory(prompt_ids=T.encode(prompt))
        t.extend(response, [-1.0] * len(response), 0)
        rows.append(t)
    env_only = Trajectory(prompt_ids=T.encode("9="))
    env_only.append_env([5, 6])
    return to_token_batch([*rows, env_only], pad_id=T.pad_id), torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0], dtype=torch.float64)


@pytest.mark.parametrize("aggregation, entropy_coef", [("seq_mean_token_mean", 0.0), ("token_sum_norm", 1e-3)])
def test_the_token_metrics_are_means_over_loss_tokens_whatever_the_aggregation(aggregation, entropy_coef):
    """`entropy`, `ratio_mean` and the like are means over loss tokens, one micro-batch per row
    as with one for all: once each micro-batch's were weighed by its share of the loss
    (sequences, rows), a row without a loss token (it runs for the entropy bonus) counted as a
    ratio of 0, and a one-token row as much as a five-token one."""
    batch, advantages = _uneven_batch()
    config = PolicyLossConfig(aggregation=aggregation, max_tokens=8, proximal_is_policy=True, entropy_coef=entropy_coef)
    expected = _entropy_by_hand(tiny(dtype=torch.float64).eval(), batch)
    runs = [TorchTrainEngine(tiny(dtype=torch.float64), lr=1e-2, micro_batch_size=micro).train_step(batch, advantages, loss=config) for micro in (1, 8)]
    for metrics in runs:
        assert metrics["entropy"] == pytest.approx(expected, rel=1e-6)
        assert metrics["ratio_mean"] == pytest.approx(1.0, rel=1e-9)  # the proximal policy is the policy
    assert runs[0] == pytest.approx(runs[1], rel=1e-6)


def test_the_fsdp_engine_averages_the_token_metrics_over_loss_tokens(tmp_path):
    batch, advantages = _uneven_batch()
    config = PolicyLossConfig(aggregation="token_sum_norm", max_tokens=8, proximal_is_policy=True, entropy_coef=1e-3)
    current_platform().init_process_group(rank=0, world_size=1, init_method=f"file://{tmp_path / 'group'}")
    try:
        expected = _entropy_by_hand(tiny().eval(), batch)
        runs = [FSDPTrainEngine(tiny(), lr=1e-2, micro_batch_size=micro).train_step(batch, advantages.float(), loss=config) for micro in (1, 8)]
        for metrics in runs:
            assert metrics["entropy"] == pytest.approx(expected, rel=1e-4)
            assert metrics["ratio_mean"] == pytest.approx(1.0, rel=1e-6)
        assert runs[0] == pytest.approx(runs[1], rel=1e-4)
    finally:
        dist.destroy_process_group()
