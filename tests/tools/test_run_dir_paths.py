"""Relative `run_dir`, `output_dir`, `resume` and the run's inputs (`model.path`, the data files) are made absolute (against the current
directory) before config.yaml is written and the config reaches Ray actors, whose working
directory on another node is not the driver's."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

TINY = [
    "sft.steps=0", "task.num_eval_prompts=4", "algorithm.prompts_per_step=2", "algorithm.group_size=2", "threads=1",
    "tensorboard=false", "rollout.max_new_tokens=3", "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
    "model.num_kv_heads=1", "model.intermediate_size=64",
]  # fmt: skip


def _prepare(*overrides: str):
    from tidal.tools.recipes import resolve_recipe
    from tidal.tools.run import prepare_run

    return prepare_run(resolve_recipe("quickstart_cpu"), [*TINY, *overrides])


def _saved(run_dir: Path) -> dict:
    return yaml.safe_load((run_dir / "config.yaml").read_text())


def test_a_relative_run_dir_is_made_under_the_current_directory_and_saved_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg, run_dir = _prepare("run_dir=runs/../runs/first")
    where = tmp_path / "runs" / "first"
    assert run_dir == where and run_dir.is_absolute() and (where / "config.yaml").is_file()
    assert cfg.run_dir == str(where) and _saved(where)["run_dir"] == str(where)


def test_a_relative_output_dir_gives_an_absolute_run_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg, run_dir = _prepare("output_dir=out")
    assert run_dir.is_absolute() and run_dir.parent == tmp_path / "out"
    assert _saved(run_dir)["run_dir"] == cfg.run_dir == str(run_dir)
    assert _saved(run_dir)["output_dir"] == str(tmp_path / "out")


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of one step, with its checkpoint."""
    from tidal.hal import reset_platform
    from tidal.tools.train import train

    reset_platform()
    cfg, run_dir = _prepare(f"run_dir={tmp_path_factory.mktemp('run-dir-paths') / 'first'}", "algorithm.num_steps=1")
    train(cfg, run_dir, progress=False)
    reset_platform()
    return run_dir


def test_a_relative_resume_is_saved_absolute(finished, monkeypatch):
    from tidal.tools.cli import main

    monkeypatch.chdir(finished.parent)
    assert main(["run", "quickstart_cpu", *TINY, "run_dir=second", "resume=first", "--check"]) == 0
    saved = _saved(finished.parent / "second")
    assert saved["resume"] == str(finished) and saved["run_dir"] == str(finished.parent / "second")


def test_errors_still_name_the_folder_as_the_user_wrote_it(tmp_path, monkeypatch):
    from tidal.tools.config import ConfigError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"resume='no_such_run': no_such_run has no checkpoint"):
        _prepare("resume=no_such_run")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ConfigError, match=r"run_dir 'full' already holds files"):
        _prepare("run_dir=full")


# --- the run's inputs: model.path, data.train_files, data.eval_files ---


def _prepare_qwen(*overrides: str):
    from tidal.tools.recipes import resolve_recipe
    from tidal.tools.run import prepare_run

    return prepare_run(resolve_recipe("gsm8k_qwen"), ["algorithm.num_steps=1", "tensorboard=false", *overrides])


@pytest.fixture
def relative_inputs(tiny_hf_dir, gsm8k_files, tmp_path, monkeypatch) -> tuple[list[str], dict[str, object]]:
    """Overrides naming the checkpoint and data files relative to the current directory
    (`tmp_path`), an eval glob pattern among them, and what config.yaml should hold for each."""
    import os

    monkeypatch.chdir(tmp_path)
    rel = {name: os.path.relpath(path, tmp_path) for name, path in {"model": tiny_hf_dir, **gsm8k_files}.items()}
    pattern = os.path.join(os.path.dirname(rel["eval_jsonl"]), "eval*.jsonl")
    overrides = [f"model.path={rel['model']}", f"data.train_files=[{rel['train_parquet']}]", f"data.eval_files=[{pattern}]"]
    return overrides, {"path": str(tiny_hf_dir), "train_files": [str(gsm8k_files["train_parquet"])], "eval_files": [str(gsm8k_files["eval_jsonl"].parent / "eval*.jsonl")]}


def test_a_checkpoint_and_data_files_named_relatively_are_saved_absolute(relative_inputs):
    """config.yaml is read again by `resume=` from any directory, and by Ray actors whose
    working directory is another: model.path and the data files stayed as typed."""
    overrides, want = relative_inputs
    cfg, run_dir = _prepare_qwen(*overrides, "run_dir=first")
    saved = _saved(run_dir)
    assert saved["model"]["path"] == cfg.model.path == want["path"]
    assert saved["data"]["train_files"] == cfg.data.train_files == want["train_files"]
    assert saved["data"]["eval_files"] == want["eval_files"]  # a glob pattern stays one, made absolute


def test_a_resume_lists_no_change_for_an_input_named_relatively_again(relative_inputs, tiny_hf_dir, tmp_path):
    import shutil

    from tidal.tools.run import resume_changes

    overrides, _ = relative_inputs
    _prepare_qwen(*overrides, "run_dir=first")
    step = tmp_path / "first" / "checkpoints" / "step-000001"
    step.mkdir(parents=True)
    shutil.copy(tiny_hf_dir / "config.json", step / "config.json")
    (step.parent / "latest").write_text(step.name)
    from tidal.tools.config import load_config
    from tidal.tools.recipes import resolve_recipe

    cfg = load_config(resolve_recipe("gsm8k_qwen"), ["algorithm.num_steps=3", "tensorboard=false", *overrides, "resume=first"])
    assert resume_changes(cfg) == ["algorithm.num_steps: 1 -> 3"]


def test_a_resume_without_the_runs_checkpoint_or_files_names_the_values_that_run_had(relative_inputs):
    """`resume=` takes the recipe and the overrides given now: a run started with
    `model.path=...` and resumed without it failed with "needs model.path" alone."""
    from tidal.tools.config import ConfigError

    overrides, want = relative_inputs
    _prepare_qwen(*overrides, "run_dir=first")
    with pytest.raises(ConfigError, match=rf"needs model.path: .*; the run resume='first' continues had model.path={want['path']}: .*give it again"):
        _prepare_qwen("resume=first", *overrides[1:])
    with pytest.raises(ConfigError, match=rf"set data.train_files .*; the run resume='first' continues had data.train_files=\[{want['train_files'][0]}\]"):
        _prepare_qwen("resume=first", overrides[0])
    with pytest.raises(ConfigError, match=r"needs model.path: a local Hugging Face checkpoint directory \(config.json, safetensors, tokenizer files\)$"):
        _prepare_qwen(*overrides[1:])  # no resume: no hint


def test_a_leading_tilde_is_the_home_folder(tiny_hf_dir, gsm8k_files, tmp_path, monkeypatch):
    """The shell leaves `~` in `model.path=~/...` (not an assignment): it was read as a folder
    named `~`, and the run refused a checkpoint that was there."""
    home = tiny_hf_dir.parent
    assert gsm8k_files["train_parquet"].parent.parent == home  # the session's fixtures sit side by side
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    train = gsm8k_files["train_parquet"].relative_to(home)
    cfg, run_dir = _prepare_qwen(f"model.path=~/{tiny_hf_dir.name}", f"data.train_files=[~/{train}]", "run_dir=first")
    saved = _saved(run_dir)
    assert saved["model"]["path"] == cfg.model.path == str(tiny_hf_dir)
    assert saved["data"]["train_files"] == [str(gsm8k_files["train_parquet"])]
