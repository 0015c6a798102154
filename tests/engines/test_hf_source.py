"""`model.source: hf` (`HFSource`) on the locally built Qwen2 checkpoint (`tiny_hf_dir`)."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from tidal.engines.models import HFSource, recomputes_activations


def _section(path, **keys):
    base = {"path": str(path), "dtype": "float32", "trust_remote_code": False, "attention": "sdpa", "gradient_checkpointing": False}
    return types.SimpleNamespace(**{**base, **keys})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_checkpoint_loads_in_the_dtype_the_recipe_names(tiny_hf_dir, dtype):
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    policy = HFSource(_section(tiny_hf_dir, dtype=name)).build(seed=0)
    assert {p.dtype for p in policy.module.parameters()} == {dtype}


def test_gradient_checkpointing_turns_recomputation_on_without_a_deprecation_warning(tiny_hf_dir):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        policy = HFSource(_section(tiny_hf_dir, gradient_checkpointing=True)).build(seed=0)
        assert recomputes_activations(policy.module)
        assert not recomputes_activations(HFSource(_section(tiny_hf_dir)).build(seed=0).module)
    assert not recomputes_activations(torch.nn.Linear(2, 2))
