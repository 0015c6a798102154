"""`tidal run` with LoRA adapters (`train.lora_rank`): checkpoints hold the merged weights
for users and the base and adapters for an exact resume; a resume or a backend that does
not fit the adapters is refused by key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tidal.tools.config import ConfigError

pytest.importorskip("peft")

REWARDS = '''
def token_parity(trajectory, text):
    """A reward the samples split on, so every step changes the weights."""
    return float(sum(map(ord, text)) % 2)
'''

TINY = [
    "task.reward=lora_rewards:token_parity", "task.num_eval_prompts=4", "sft.steps=2", "sft.batch_size=8",
    "algorithm.prompts_per_step=2", "algorithm.group_size=4", "algorithm.max_staleness=0", "algorithm.num_steps=4",
    "threads=1", "tensorboard=false", "rollout.max_new_tokens=3", "model.hidden_size=32", "model.num_layers=1",
    "model.num_heads=2", "model.num_kv_heads=1", "model.intermediate_size=64",
    "train.lora_rank=4", "train.lr=0.01", "algorithm.kl_coef=0.01",
]  # fmt: skip


@pytest.fixture
def rewards(reward_module) -> Any:
    return reward_module("lora_rewards", REWARDS)


def _run(run_dir: Path, *overrides: str) -> dict[str, Any]:
    from tidal.tools.recipes import resolve_recipe
    from tidal.tools.run import prepare_run
    from tidal.tools.train import train

    cfg, made = prepare_run(resolve_recipe("quickstart_cpu"), [*TINY, f"run_dir={run_dir}", *overrides])
    return train(cfg, made, progress=False)


@pytest.mark.parametrize("backend", ["torch", "fsdp"])  # deepspeed: tests/tools/test_deepspeed_run.py (a process per run)
def test_a_lora_run_resumed_repeats_the_uninterrupted_run(runs, tmp_path, rewards, backend):
    """The warm start and RL train adapters; the KL term's reference is the base. A finished
    run continued for more steps ends with the longer run's metrics and weights, bit for bit,
    which needs the checkpoint's base and adapters (the merged weights alone would move the
    base by float rounding)."""
    full, short, longer = tmp_path / "full", tmp_path / "short", tmp_path / "longer"
    engine = f"train.backend={backend}"
    _run(full, engine)
    _run(short, engine, "algorithm.num_steps=2")
    _run(longer, engine, f"resume={short}")
    runs.assert_same(full, longer, from_step=2)
    assert all(m["kl"] > 0 for m in runs.steps(full)[1:])
    trainer = torch.load(full / "checkpoints" / "step-000004" / "trainer.pt", weights_only=True)
    merged = load_file(full / "checkpoints" / "step-000004" / "model.safetensors")
    base, adapters = trainer["lora"]["base"], trainer["lora"]["adapters"]
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    changed = {n for n in merged if not torch.equal(merged[n], base[n])}
    assert changed and all(n.endswith("proj.weight") for n in changed)  # the checkpoint's model is merged, its base is not


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.lora_rank=8", r"trained LoRA adapters with train.lora_rank=4, the recipe says 8; resume with train.lora_rank=4"),
        ("train.lora_rank=0", r"trained LoRA adapters with train.lora_rank=4, the recipe says 0"),
        ("train.lora_target_modules=[q_proj]", r"train.lora_target_modules=\['all-linear'\], the recipe says \['q_proj'\]"),
    ],
    ids=["rank", "none", "targets"],
)
def test_a_resume_with_other_adapters_is_refused_before_it_starts(tmp_path, rewards, override, message):
    first = tmp_path / "first"
    _run(first, "algorithm.num_steps=1", "sft.steps=0")
    with pytest.raises(ConfigError, match=message):
        _run(tmp_path / "second", override, f"resume={first}")
    assert not (tmp_path / "second").exists()


def test_targets_the_model_lacks_are_refused_before_the_warm_start(tmp_path, rewards):
    with pytest.raises(ConfigError, match=r"train.lora_target_modules=\['qkv'\] matches no module of the model; its linear layers are down_proj, gate_proj, k_proj"):
        _run(tmp_path / "run", "train.lora_target_modules=[qkv]")
    assert not (tmp_path / "run" / "cache").exists()  # no warm start, no initial weights kept: the run directory holds what prepare_run wrote


def test_a_run_without_adapters_is_not_resumed_with_them(tmp_path, rewards):
    first = tmp_path / "first"
    _run(first, "algorithm.num_steps=1", "sft.steps=0", "train.lora_rank=0")
    with pytest.raises(ConfigError, match="its checkpoint trained every weight, and train.lora_rank=4 trains adapters"):
        _run(tmp_path / "second", f"resume={first}")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.backend=megatron"], "train.lora_rank=4 needs train.backend torch or fsdp or deepspeed.*train.backend=megatron trains every weight"),
        (["train.lora_alpha=0"], "train.lora_alpha"),
        (["train.lora_rank=-1"], "train.lora_rank"),
        (["train.lora_target_modules=[]"], "train.lora_target_modules is empty"),
    ],
    ids=["backend", "alpha", "rank", "targets"],
)
def test_lora_keys_are_checked_when_the_recipe_loads(overrides, message):
    from tidal.tools.config import load_config
    from tidal.tools.recipes import resolve_recipe

    with pytest.raises(ConfigError, match=message):
        load_config(resolve_recipe("quickstart_cpu"), ["train.lora_rank=4", *overrides])


def test_the_export_is_the_merged_model_and_peft_loads_its_adapter_onto_the_base(tmp_path, rewards):
    """OUT_DIR is a plain model (the merged weights); OUT_DIR/lora_adapter, put onto the
    weights RL started from with peft, computes the same logits."""
    import json

    import transformers
    from peft import PeftModel

    from tidal.tools.export import export

    run = tmp_path / "run"
    _run(run, "algorithm.num_steps=2", "sft.steps=0")
    out = tmp_path / "out"
    export(run, out)
    merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any(".lora_" in name for name in merged.state_dict())
    config = json.loads((out / "lora_adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["task_type"]) == (4, 16.0, "CAUSAL_LM")
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    base = transformers.AutoModelForCausalLM.from_pretrained(out)
    started = torch.load(run / "checkpoints" / "step-000002" / "trainer.pt", weights_only=True)["lora"]["base"]
    base.load_state_dict(started)
    adapted = PeftModel.from_pretrained(base, out / "lora_adapter").eval()
    ids = torch.tensor([[1, 5, 9, 12, 3, 7]])
    with torch.no_grad():
        torch.testing.assert_close(adapted(input_ids=ids).logits, merged(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
        with adapted.disable_adapter():  # the adapters matter
            assert not torch.allclose(adapted(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-5)


@pytest.mark.parametrize(("overrides", "base"), [(["sft.steps=0"], "/models/qwen"), (["sft.steps=3"], ""), (["model.source=tiny", "sft.steps=0"], "")], ids=["hf", "warm-start", "tiny"])
def test_the_adapters_base_is_the_checkpoint_rl_started_from(tmp_path, overrides, base):
    from tidal.tools.config import load_config, to_yaml
    from tidal.tools.export import started_from
    from tidal.tools.recipes import resolve_recipe

    cfg = load_config(resolve_recipe("quickstart_cpu"), ["model.source=hf", "model.path=/models/qwen", *overrides])
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    assert started_from(tmp_path) == base
    assert started_from(tmp_path / "gone") == ""
