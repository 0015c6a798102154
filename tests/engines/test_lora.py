"""LoRA adapters in the torch train engine (`train.lora_rank`, `engines.lora`): what trains,
what leaves the engine (merged weights under the base's names), the KL reference, exact
state round trips, and the refusals."""

from __future__ import annotations

import copy

import pytest
import torch

from tidal.engines import lora
from tidal.engines.tiny import CharTokenizer, build_tiny_qwen2
from tidal.engines.torch_train import TorchTrainEngine
from tidal.flow.algorithms import PolicyLossConfig
from tidal.tools.rl import unsharded

pytest.importorskip("peft")

T = CharTokenizer()


def tiny(seed: int = 0) -> torch.nn.Module:
    return build_tiny_qwen2(T.vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=32, seed=seed, attention="sdpa")


def _logits(model: torch.nn.Module, batch) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=batch.input_ids).logits


def test_only_the_adapters_train_and_the_merged_weights_are_the_adapted_model(six_rows):
    base, (batch, advantages) = tiny(), six_rows
    engine = TorchTrainEngine(copy.deepcopy(base), lr=1e-2, lora_rank=4, lora_alpha=8)
    trained = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert len(engine.optimizer.param_groups[0]["params"]) == len(trained)  # AdamW holds state for the adapters only
    start = dict(engine.named_weights())
    assert list(start) == list(base.state_dict())  # the base model's names, in its order
    assert all(torch.equal(start[n], t) for n, t in base.state_dict().items())  # B starts at 0: the base
    for _ in range(2):
        engine.train_step(batch, advantages, loss=PolicyLossConfig())
    assert all(torch.equal(t, base.state_dict()[n]) for n, t in lora.base_weights(engine.model).items())  # the base never moves
    merged = dict(engine.named_weights())
    changed = [n for n in merged if not torch.equal(merged[n], start[n])]
    assert changed and all(n.endswith("proj.weight") for n in changed)  # adapted linear layers only
    assert [s.name for s in engine.named_weights().specs()] == list(merged)
    plain = unsharded(base, engine.named_weights())  # what rollout, evaluation and checkpoints get
    torch.testing.assert_close(_logits(plain, batch), _logits(engine.model, batch), rtol=1e-5, atol=1e-5)


def test_target_modules_choose_the_adapted_layers():
    engine = TorchTrainEngine(tiny(), lora_rank=2, lora_target_modules=["q_proj", "v_proj"])
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in lora.adapter_weights(engine.model)}
    assert adapted == {"q_proj", "v_proj"}


def test_the_kl_reference_is_the_base_with_the_adapters_off(six_rows):
    """No copy of the model: the reference logprobs are the base's, while the policy's move."""
    base, (batch, advantages) = tiny(), six_rows
    engine = TorchTrainEngine(copy.deepcopy(base), lr=1e-2, lora_rank=4, kl_reference=True)
    assert engine.reference is None
    full = TorchTrainEngine(copy.deepcopy(base), kl_reference=True)
    engine.train_step(batch, advantages, loss=PolicyLossConfig(kl_coef=0.1))
    metrics = engine.train_step(batch, advantages, loss=PolicyLossConfig(kl_coef=0.1))
    assert metrics["kl"] > 0  # the policy has moved away from the base
    torch.testing.assert_close(engine._reference_logprobs(batch), full._reference_logprobs(batch), rtol=0, atol=1e-6)
    assert all(p.requires_grad for n, p in engine.model.named_parameters() if ".lora_" in n)  # switched back on, still trained


def test_a_state_round_trip_resumes_exactly(six_rows):
    """As a resume does it: a new engine around the merged weights (the checkpoint's model),
    given the saved base, adapters and optimizer, takes the very step the first one takes."""
    base, (batch, advantages) = tiny(), six_rows
    first = TorchTrainEngine(copy.deepcopy(base), lr=1e-2, lora_rank=4)
    first.train_step(batch, advantages, loss=PolicyLossConfig())
    saved = copy.deepcopy(first.state_dict())
    assert saved["lora"]["settings"] == {"train.lora_rank": 4, "train.lora_alpha": 16.0, "train.lora_target_modules": ["all-linear"]}
    second = TorchTrainEngine(unsharded(base, first.named_weights()), lr=1e-2, lora_rank=4)
    second.load_state_dict({**second.state_dict(), "optimizer": saved["optimizer"], "version": saved["version"], "lora": saved["lora"]})
    for engine in (first, second):
        engine.train_step(batch, advantages, loss=PolicyLossConfig())
    a, b = dict(first.named_weights()), dict(second.named_weights())
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert all(torch.equal(t, base.state_dict()[n]) for n, t in lora.base_weights(second.model).items())


def test_a_state_without_adapters_is_refused():
    engine = TorchTrainEngine(tiny(), lora_rank=4)
    full = TorchTrainEngine(tiny())
    with pytest.raises(ValueError, match=r"train.lora_rank=4: the state has no LoRA base"):
        engine.load_state_dict(full.state_dict())
    other = TorchTrainEngine(tiny(), lora_rank=4, lora_target_modules=["q_proj"])
    with pytest.raises(ValueError, match="does not fit this model"):
        engine.load_state_dict(other.state_dict())


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (["no_such_layer"], r"train.lora_target_modules=\['no_such_layer'\] matches no module of the model; its linear layers are down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"),
        (["embed_tokens"], r"'model.embed_tokens' \(Embedding\), whose weight is not a linear layer's own"),
        (["lm_head"], r"'lm_head' \(Linear\), whose weight is not a linear layer's own"),  # tied to the embedding
    ],
    ids=["no-match", "embedding", "tied-head"],
)
def test_targets_that_cannot_take_adapters_are_refused(targets, message):
    model = tiny()
    with pytest.raises(ValueError, match=message):
        TorchTrainEngine(model, lora_rank=4, lora_target_modules=targets)
    assert not lora.adapter_weights(model)  # refused before any adapter was made


def test_settings_are_checked():
    assert lora.lora_settings(0, 16.0, ["all-linear"]) is None
    with pytest.raises(ValueError, match="train.lora_alpha=0.0 must be > 0"):
        lora.lora_settings(4, 0.0, ["all-linear"])
    with pytest.raises(ValueError, match="train.lora_target_modules is empty"):
        lora.lora_settings(4, 16.0, [])


def test_weights_are_not_kept_in_a_transports_memory():
    """`share_weights` refuses before anything moves: a publish merges and copies them."""
    engine = TorchTrainEngine(tiny(), lora_rank=4)

    def place(*_):
        raise AssertionError("nothing is placed")

    with pytest.raises(ValueError, match="merged from the base and the adapters"):
        engine.share_weights(place, before_change=lambda: None)


def test_adapters_are_the_same_whatever_the_generators_state_and_leave_it_as_it_was():
    """Every rank of a multi-rank engine, and every engine, makes the same adapters from the
    same model (`ADAPTER_SEED`); the run's generator goes on as if none were made."""
    torch.manual_seed(1)
    first = lora.adapter_weights(TorchTrainEngine(tiny(), lora_rank=4).model)
    after = torch.rand(3)
    torch.manual_seed(1)
    assert torch.equal(torch.rand(3), after)
    torch.manual_seed(2)
    second = lora.adapter_weights(TorchTrainEngine(tiny(), lora_rank=4).model)
    assert first.keys() == second.keys() and all(torch.equal(first[n], second[n]) for n in first)
    assert any(t.abs().sum() > 0 for n, t in first.items() if ".lora_A." in n)


def test_adapters_on_a_bfloat16_base_train_in_float32_and_merge_into_its_dtype(six_rows):
    """As peft's `get_peft_model` makes them: AdamW steps float32 adapters; the merged weights
    keep the base's dtype (a bfloat16 rollout model takes them as they are)."""
    base, (batch, advantages) = tiny().to(torch.bfloat16), six_rows
    engine = TorchTrainEngine(copy.deepcopy(base), lr=1e-2, lora_rank=4)
    assert {t.dtype for t in lora.adapter_weights(engine.model).values()} == {torch.float32}
    engine.train_step(batch, advantages, loss=PolicyLossConfig())
    merged = dict(engine.named_weights())
    assert {t.dtype for t in merged.values()} == {torch.bfloat16}
    assert [s.dtype for s in engine.named_weights().specs()] == ["bfloat16"] * len(merged)
    assert any(not torch.equal(merged[n], t) for n, t in base.state_dict().items())
