"""How a run builds the `vllm` rollout engine (`tools.rl.build_rollout_engine`, and a Ray
rollout actor's `make_rollout_engine`), against the fake vLLM of tests/engines/fake_vllm: from
`model.path`, tensor parallel over `placement.rollout.devices_each`, in `model.dtype`, with
the recipe's `rollout.*` keys, given the trainer's weights when they differ from the
checkpoint's; a Ray actor builds it without building the model itself."""

from __future__ import annotations

import copy
import importlib

import pytest
import torch


@pytest.fixture
def fake_llms(fake_vllm):
    """The fake vLLM's `async_llm` module (tests/conftest.py's `fake_vllm`): its `INSTANCES`."""
    return importlib.import_module("vllm.v1.engine.async_llm")


def _cfg(tiny_hf_dir, gsm8k_files, *more):
    from tidal.tools.config import load_config
    from tidal.tools.recipes import resolve_recipe

    return load_config(
        resolve_recipe("gsm8k_qwen"),
        [f"model.path={tiny_hf_dir}", f"data.train_files=[{gsm8k_files['train_jsonl']}]", "rollout.backend=vllm", "rollout.gpu_memory_utilization=0.5", "rollout.max_model_len=256", "rollout.enforce_eager=true", *more],
    )


def test_a_run_builds_vllm_from_the_checkpoint_with_its_keys_and_sends_the_trainers_weights(fake_llms, tiny_hf_dir, gsm8k_files):
    from tidal.engines.models import model_source
    from tidal.hal import current_platform
    from tidal.tools.rl import build_rollout_engine

    cfg = _cfg(tiny_hf_dir, gsm8k_files, "placement.rollout.devices_each=2", "model.dtype=float32", "seed=5")
    policy = model_source(cfg.model).build(seed=cfg.seed)
    engine = build_rollout_engine(cfg, copy.deepcopy(policy.module), policy.tokenizer, platform=current_platform(), version=0)  # a new run without warm start: the checkpoint's weights
    try:
        llm = fake_llms.INSTANCES[-1]
        args = engine.engine_args
        assert (args.model, args.tensor_parallel_size, args.dtype, args.seed) == (str(tiny_hf_dir), 2, "float32", 5)
        assert (args.gpu_memory_utilization, args.max_model_len, args.enforce_eager) == (0.5, 256, True)
        assert engine.version == 0 and not [c for c in llm.calls if c[0] == "collective_rpc" and c[1] == "tidal_load_bucket"]
        assert set(engine.eos_ids) == set(policy.tokenizer.eos_ids) and engine.pad_id == policy.tokenizer.pad_id
    finally:
        engine.close()

    trained = copy.deepcopy(policy.module)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01)
    engine = build_rollout_engine(cfg, trained, policy.tokenizer, platform=current_platform(), version=4)  # resumed at version 4
    try:
        llm = fake_llms.INSTANCES[-1]
        assert engine.version == 4 and [w.tidal_weight_version() for w in llm.workers] == [4, 4]
        got = llm.workers[0].get_model().hf_state()
        assert all(torch.equal(got[name], tensor) for name, tensor in trained.state_dict().items())
    finally:
        engine.close()


def test_a_ray_rollout_actor_builds_vllm_without_building_the_model(fake_llms, tiny_hf_dir, gsm8k_files, monkeypatch):
    from tidal.engines import models
    from tidal.tools.config import to_yaml
    from tidal.tools.ray_run import make_rollout_engine

    cfg = _cfg(tiny_hf_dir, gsm8k_files, "runtime=ray")
    monkeypatch.setattr(models.HFSource, "build", lambda self, *, seed: pytest.fail("the actor built the model; vLLM loads it itself"))
    engine = make_rollout_engine(to_yaml(cfg), rank=0)
    try:
        assert engine.version == -1  # the trainer's version arrives over the weight transport before the first generate
        names = dict(engine.named_weights())
        assert "model.embed_tokens.weight" in names and all(t.device.type == "meta" for t in names.values())
    finally:
        engine.close()


def test_a_ray_rollout_actor_receives_vllms_weights_into_host_memory(fake_llms, tiny_hf_dir, gsm8k_files):
    """vLLM's model lives in processes of its own, which `load_weights` sends host tensors to:
    a version received onto the actor's device would sit beside the KV cache vLLM sized the
    device for. The `hf` engine generates in the actor's process: its versions go to its device."""
    from tidal.engines.hf_rollout import HFRolloutEngine
    from tidal.flow.ray.runtime import weights_device
    from tidal.tools.config import to_yaml
    from tidal.tools.ray_run import make_rollout_engine

    engine = make_rollout_engine(to_yaml(_cfg(tiny_hf_dir, gsm8k_files, "runtime=ray")), rank=0)
    try:
        assert weights_device(engine, shared=False) == torch.device("cpu")
    finally:
        engine.close()
    hf = HFRolloutEngine.__new__(HFRolloutEngine)
    assert weights_device(hf, shared=False) is None and weights_device(hf, shared=True) == torch.device("cpu")
