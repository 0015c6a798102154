"""Relative `run_dir`, `output_dir` and `resume` are made absolute (against the current
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
