"""What the multi-rank LoRA tests (test_fsdp_lora.py, test_deepspeed_lora.py) share: the
model, the engine settings and the plan of steps, the torch engine's run of them they are
held to, and the checks against it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from tidal.engines import lora
from tidal.engines.tiny import CharTokenizer, build_tiny_qwen2
from tidal.engines.torch_train import TorchTrainEngine

T = CharTokenizer()
MODEL = dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=32)
ENGINE = dict(lr=1e-2, weight_decay=0.01, micro_batch_size=2, padding_free=False, kl_reference=True, lora_rank=4, lora_alpha=8.0)
SHARDS = [[0, 1, 2, 3], [4, 5]]
PLAN = [{"aggregation": "token_mean"}, "sft", {"aggregation": "token_mean", "kl_coef": 0.5}, {"aggregation": "seq_mean_token_mean", "kl_coef": 0.5}]
"""Policy steps with and without a KL term (every row runs then: rank 1's one micro-batch
against rank 0's two, so a dummy pass joins a reference pass), and a supervised step."""
RESUME = [{"aggregation": "token_mean", "kl_coef": 0.5}]


def model(seed: int = 0) -> torch.nn.Module:
    return build_tiny_qwen2(T.vocab_size, seed=seed, **MODEL)


def torch_reference(six_rows: tuple, run_torch: Any) -> dict:
    """The same steps by one `TorchTrainEngine` with the same adapters on all six rows, its
    state, and an engine that loaded that state and took `RESUME`."""
    batch, advantages = six_rows
    engine = TorchTrainEngine(model(0), **ENGINE)
    metrics = run_torch(engine, batch, advantages, PLAN)
    state = copy.deepcopy(engine.state_dict())  # the engine's own tensors otherwise: a step of the engine that loads it would change them
    continued = TorchTrainEngine(model(7), **ENGINE)
    continued.load_state_dict(copy.deepcopy(state))  # AdamW takes the given moments as its own
    run_torch(continued, batch, advantages, RESUME)
    return {"engine": engine, "batch": batch, "advantages": advantages, "metrics": metrics, "weights": list(engine.named_weights()), "state": state, "continued": list(continued.named_weights())}


def write_run_data(write_data: Any, work: Any, reference: dict, **fields: Any) -> None:
    """The worker pair's data: the reference's rows, the plan, the settings and its state."""
    fields = {"shards": SHARDS, **fields}  # each rank's rows, unless the test gives its own
    write_data(work, reference["batch"], reference["advantages"], plan=PLAN, resume=RESUME, model=MODEL, engine=ENGINE, vocab_size=T.vocab_size, torch_state=reference["state"], **fields)


def assert_same_weights(got: list, want: list) -> None:
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, a), (_, b) in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def assert_trains_the_torch_engines_adapters(run: dict, reference: dict) -> None:
    """Only adapters trained; the steps' metrics, the merged weights and their names are the torch engine's."""
    assert run["trained"] and all(".lora_" in n for n in run["trained"])
    for got, want in zip(run["metrics"], reference["metrics"], strict=True):
        for key in ("loss", "grad_norm", "num_tokens", *(["kl"] if "kl" in want else [])):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), key
    assert run["metrics"][-1]["kl"] > 0  # the adapters moved the policy from the base
    assert_same_weights(run["weights"], reference["weights"])  # merged, under the base's names
    assert [s.name for s in run["specs"]] == list(model(0).state_dict())


def assert_state_is_the_torch_engines(run: dict, reference: dict) -> None:
    """The state's model, base, adapters and optimizer layout are the torch engine's, the base
    is the one loaded, and an engine that loaded the torch engine's state goes on as it does."""
    state, want = run["state"], reference["state"]
    assert state["model"].keys() == want["model"].keys() and state["lora"]["settings"] == want["lora"]["settings"]
    for part in ("base", "adapters"):
        assert state["lora"][part].keys() == want["lora"][part].keys()
        for name, tensor in state["lora"][part].items():
            torch.testing.assert_close(tensor, want["lora"][part][name], rtol=1e-4, atol=1e-5, msg=name)
    base = lora.base_weights(TorchTrainEngine(model(0), lora_rank=4).model)
    assert all(torch.equal(state["lora"]["base"][n], t) for n, t in base.items())  # the base never moved
    assert state["optimizer"]["param_groups"][0]["params"] == want["optimizer"]["param_groups"][0]["params"]
    assert state["optimizer"]["state"].keys() == want["optimizer"]["state"].keys()
    assert_same_weights(run["from_torch"], reference["continued"])
