"""The production recipes (gsm8k_cuda, gsm8k_npu, gsm8k_mixed: vLLM rollout, FSDP2 or DeepSpeed
training, on GPUs, NPUs and both) pass `tidal plan` and `tidal run --check` with fake
platforms (`cluster.fake=true`), on a local checkpoint and data files, in every variant their
comments give; and what they must not be run with is refused by name."""

from __future__ import annotations

import json

import pytest
import yaml

from tidal.tools.cli import main
from tidal.tools.recipes import resolve_recipe

VARIANTS = {
    "gsm8k_cuda": [
        [], ["placement.train.count=8", "placement.rollout.count=4", "placement.rollout.colocate_with=train"], ["train.backend=deepspeed", "train.zero_stage=3"],
        ["train.backend=deepspeed", "train.zero_stage=3", "placement.train.count=8", "placement.rollout.count=4", "placement.rollout.colocate_with=train"],
        ["algorithm.advantage=gae", "algorithm.group_size=1", "algorithm.prompts_per_step=512", "placement.train.count=8", "placement.rollout.count=4", "placement.rollout.colocate_with=train"],  # PPO: fsdp's critic
    ],
    "gsm8k_npu": [[], ["placement.train.count=8", "placement.rollout.count=4", "placement.rollout.colocate_with=train"]],
    "gsm8k_mixed": [[]],
}
KINDS = {"gsm8k_cuda": ({"cuda"}, {"cuda"}), "gsm8k_npu": ({"npu"}, {"npu"}), "gsm8k_mixed": ({"npu"}, {"cuda"})}
"""recipe -> (the trainer's device kinds, the rollout engines')."""


def _files(tiny_hf_dir, gsm8k_files) -> list[str]:
    return [f"model.path={tiny_hf_dir}", f"data.train_files=[{gsm8k_files['train_parquet']}]", f"data.eval_files=[{gsm8k_files['eval_jsonl']}]", "cluster.fake=true"]


@pytest.mark.parametrize(("recipe", "variant"), [(r, v) for r, variants in VARIANTS.items() for v in range(len(variants))])
def test_each_production_recipe_passes_plan_and_run_check_on_fake_platforms(capsys, tmp_path, tiny_hf_dir, gsm8k_files, recipe, variant):
    overrides = [*_files(tiny_hf_dir, gsm8k_files), *VARIANTS[recipe][variant]]
    assert main(["plan", recipe, *overrides, "--json"]) == 0, capsys.readouterr().err
    plan = json.loads(capsys.readouterr().out)
    assert plan["run_refuses"] is None
    roles = {}
    for row in plan["assignments"]:
        roles.setdefault(row["role"], []).append(row)
    train_kinds, rollout_kinds = KINDS[recipe]
    assert {row["kind"] for row in roles["train"]} == train_kinds and {row["kind"] for row in roles["rollout"]} == rollout_kinds
    assert all(len(row["devices"]) == 2 for row in roles["rollout"])  # vLLM's tensor parallel size

    run_dir = tmp_path / "run"
    assert main(["run", recipe, *overrides, f"run_dir={run_dir}", "--check"]) == 0, capsys.readouterr().err
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["rollout"]["backend"] == "vllm" and saved["runtime"] == "ray" and saved["model"]["path"] == str(tiny_hf_dir)


def test_the_recipes_say_what_they_need(tiny_hf_dir, gsm8k_files):
    from tidal.tools.config import load_config

    for recipe in VARIANTS:
        text = resolve_recipe(recipe).read_text()
        cfg = load_config(resolve_recipe(recipe))
        assert cfg.rollout.backend == "vllm" and cfg.model.source == "hf" and cfg.model.path is None and cfg.task.reward == "math"
        assert "tidal run " + recipe in text  # the command, in the file's comments
    assert load_config(resolve_recipe("gsm8k_mixed")).transport.name == "host"  # between an NPU torch build and a CUDA one


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["model.source=tiny", "model.path=null", "data.train_files=[]", "rollout.max_new_tokens=6"], "rollout.backend=vllm loads a Hugging Face checkpoint directory itself; model.source='tiny'"),
        (["rollout.gpu_memory_utilization=1.5"], "rollout.gpu_memory_utilization=1.5 must be <= 1"),
        (["rollout.gpu_memory_utilization=0"], "rollout.gpu_memory_utilization=0.0 must be > 0"),
    ],
)
def test_what_the_production_recipes_cannot_run_with_is_refused_by_name(capsys, tmp_path, tiny_hf_dir, gsm8k_files, overrides, named):
    code = main(["run", "gsm8k_cuda", *_files(tiny_hf_dir, gsm8k_files), *overrides, f"run_dir={tmp_path / 'run'}", "--check"])
    err = capsys.readouterr().err
    assert code == 2 and named in err, err
    assert not (tmp_path / "run").exists()
