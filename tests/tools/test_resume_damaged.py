"""`resume=` a run whose checkpoint lost or damaged a file: a clear error naming the file
(exit code 2 from `tidal run`), not a traceback from deep inside a loader."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tidal.tools.config import ConfigError

TINY = [
    "sft.steps=0", "task.num_eval_prompts=4", "algorithm.prompts_per_step=2", "algorithm.group_size=2", "threads=1",
    "tensorboard=false", "rollout.max_new_tokens=3", "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
    "model.num_kv_heads=1", "model.intermediate_size=64",
]  # fmt: skip


def _run(run_dir: Path, *overrides: str) -> dict:
    from tidal.tools.recipes import resolve_recipe
    from tidal.tools.run import prepare_run
    from tidal.tools.train import train

    cfg, made = prepare_run(resolve_recipe("quickstart_cpu"), [*TINY, f"run_dir={run_dir}", *overrides])
    return train(cfg, made, progress=False)


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run of one step, with its checkpoint."""
    from tidal.hal import reset_platform

    run_dir = tmp_path_factory.mktemp("resume-damaged") / "run"
    reset_platform()
    _run(run_dir, "algorithm.num_steps=1")
    reset_platform()
    return run_dir


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _drop_key(path: Path) -> None:  # a state.json of another tidal's format
    state = json.loads(path.read_text())
    del state["prompt_position"]
    path.write_text(json.dumps(state))


@pytest.mark.parametrize(
    ("name", "damage"),
    [
        ("store.bin", _truncate),
        ("model.safetensors", _truncate),
        ("trainer.pt", _truncate),
        ("state.json", _truncate),
        ("state.json", _drop_key),
        ("tokenizer.json", _truncate),
        ("config.json", _truncate),
        ("store.bin", Path.unlink),
        ("model.safetensors", Path.unlink),
        ("trainer.pt", Path.unlink),
        ("state.json", Path.unlink),
        ("tokenizer.json", Path.unlink),
    ],
    ids=lambda x: x if isinstance(x, str) else x.__name__.strip("_"),
)
def test_a_damaged_checkpoint_file_is_an_error_naming_it(finished, tmp_path, name, damage):
    damaged = tmp_path / "damaged"
    shutil.copytree(finished, damaged)
    damage(damaged / "checkpoints" / "step-000001" / name)
    with pytest.raises(ConfigError, match=f"resume=.*its checkpoint step-000001 has no readable {re.escape(name)}"):
        _run(tmp_path / "resumed", f"resume={damaged}", "algorithm.num_steps=2")


def test_the_undamaged_checkpoint_resumes(finished, tmp_path):
    """The control: the same copy, undamaged, continues."""
    shutil.copytree(finished, tmp_path / "copy")
    assert _run(tmp_path / "resumed", f"resume={tmp_path / 'copy'}", "algorithm.num_steps=2")["steps"] == 2


def test_a_damaged_config_json_is_named_where_the_run_was_not_checked_first(finished, tmp_path):
    """A trainer restarted by the Ray driver loads the checkpoint without `tidal run`'s check
    of config.json: the loader names it, not the weights it reads with it."""
    from tidal.tools.checkpoint import load_checkpoint

    damaged = tmp_path / "damaged"
    shutil.copytree(finished, damaged)
    _truncate(damaged / "checkpoints" / "step-000001" / "config.json")
    with pytest.raises(ConfigError, match="its checkpoint step-000001 has no readable config.json"):
        load_checkpoint(damaged / "checkpoints" / "step-000001", attention="eager")
