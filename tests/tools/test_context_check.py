"""A run's longest sequence (`data.max_prompt_tokens` + `rollout.max_new_tokens`, or vLLM's
`rollout.max_model_len`) fits the checkpoint's context, or `tidal run` refuses it before
its run directory, naming the keys and the checkpoint's config.json
(`tools.run.check_context`)."""

from __future__ import annotations

import json
import shutil

import pytest

from tidal.tools.config import ConfigError
from tidal.tools.recipes import resolve_recipe
from tidal.tools.run import checkpoint_context, prepare_run


def _with_config(tmp_path, tiny_hf_dir, **changes):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_hf_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


def test_the_context_is_read_as_vllm_derives_it(tmp_path):
    def context(config):
        (tmp_path / "config.json").write_text(json.dumps(config))
        return checkpoint_context(tmp_path)

    assert context({"max_position_embeddings": 32768}) == (32768, "max_position_embeddings=32768")
    assert context({"max_position_embeddings": 32768, "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}) == (
        131072, "max_position_embeddings=32768 x its yarn RoPE factor 4"
    )  # fmt: skip
    assert context({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})[0] == 131072  # already the whole context
    assert context({"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})[0] == 4096
    assert context({"text_config": {"max_position_embeddings": 8192}, "vision_config": {}})[0] == 8192
    assert context({"hidden_size": 8}) is None
    (tmp_path / "config.json").write_text("{not json")
    assert checkpoint_context(tmp_path) is None


def test_a_run_longer_than_the_checkpoints_context_is_refused_before_its_run_directory(tmp_path, tiny_hf_dir, gsm8k_files):
    folder = _with_config(tmp_path, tiny_hf_dir, max_position_embeddings=768)
    run = ["runtime=local", f"model.path={folder}", f"data.train_files=[{gsm8k_files['train_jsonl']}]", f"run_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError) as e:
        prepare_run(resolve_recipe("gsm8k_qwen"), run)  # 512 + 512
    assert str(e.value) == (
        f"data.max_prompt_tokens=512 + rollout.max_new_tokens=512 = 1024 tokens is longer than the checkpoint's context "
        f"(max_position_embeddings=768 in {str(folder / 'config.json')!r}): lower one of them (a model that was made for a longer context says so in its config.json)"
    )
    assert not (tmp_path / "run").exists()
    cfg, _ = prepare_run(resolve_recipe("gsm8k_qwen"), [*run, "rollout.max_new_tokens=256"])
    assert cfg.rollout.max_new_tokens == 256


def test_vllms_max_model_len_is_held_to_the_context_and_caps_the_sequences(tmp_path, tiny_hf_dir, gsm8k_files):
    from tidal.tools.config import load_config
    from tidal.tools.run import check_context

    folder = _with_config(tmp_path, tiny_hf_dir, max_position_embeddings=768)
    run = ["runtime=local", f"model.path={folder}", f"data.train_files=[{gsm8k_files['train_jsonl']}]", "rollout.backend=vllm"]
    with pytest.raises(ConfigError, match=r"rollout\.max_model_len=1024 is longer than the checkpoint's context \(max_position_embeddings=768 in "):
        prepare_run(resolve_recipe("gsm8k_qwen"), [*run, "rollout.max_model_len=1024", f"run_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()
    check_context(load_config(resolve_recipe("gsm8k_qwen"), [*run, "rollout.max_model_len=700"]))  # vLLM cuts each sequence at 700
    with pytest.raises(ConfigError, match="1024 tokens is longer"):
        check_context(load_config(resolve_recipe("gsm8k_qwen"), run))
    yarn = _with_config(tmp_path / "y", tiny_hf_dir, max_position_embeddings=768, rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 768})
    check_context(load_config(resolve_recipe("gsm8k_qwen"), [*run, f"model.path={yarn}"]))
