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


DAMAGES = [
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
]
damages = pytest.mark.parametrize(("name", "damage"), DAMAGES, ids=lambda x: x if isinstance(x, str) else x.__name__.strip("_"))


@damages
def test_a_damaged_checkpoint_file_is_an_error_naming_it(finished, tmp_path, name, damage):
    """From `tidal run` before its run directory is made, and from the loader itself (a
    trainer the Ray driver restarted loads the checkpoint without `tidal run`'s checks)."""
    from tidal.tools.checkpoint import load_checkpoint

    damaged = tmp_path / "damaged"
    shutil.copytree(finished, damaged)
    damage(damaged / "checkpoints" / "step-000001" / name)
    named = f"resume=.*its checkpoint step-000001 has no readable {re.escape(name)}"
    with pytest.raises(ConfigError, match=named):
        _run(tmp_path / "resumed", f"resume={damaged}", "algorithm.num_steps=2")
    assert not (tmp_path / "resumed").exists()
    with pytest.raises(ConfigError, match=named):
        load_checkpoint(damaged / "checkpoints" / "step-000001", attention="eager")


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


@damages
def test_run_check_opens_the_checkpoint_and_names_a_damaged_file_before_making_a_run_directory(finished, tmp_path, capsys, name, damage):
    """`tidal run --check resume=...` reads the checkpoint as the run would (it once found a
    damaged file only when the real run loaded it, in a run directory already made)."""
    from tidal.tools.cli import main

    damaged = tmp_path / "damaged"
    shutil.copytree(finished, damaged)
    damage(damaged / "checkpoints" / "step-000001" / name)
    new = tmp_path / "new"
    assert main(["run", "quickstart_cpu", *TINY, f"run_dir={new}", f"resume={damaged}", "--check"]) == 2
    assert re.search(f"tidal run: error: resume=.*its checkpoint step-000001 has no readable {re.escape(name)}", capsys.readouterr().err)
    assert not new.exists()


def test_run_check_of_a_whole_checkpoint_passes_without_loading_its_weights(finished, tmp_path, monkeypatch):
    """The check reads headers and small files: the weights, the largest file, stay on disk."""
    from tidal.tools import checkpoint
    from tidal.tools.cli import main

    monkeypatch.setattr(checkpoint, "load_model", lambda *a, **k: pytest.fail("the check loaded the model"))
    assert main(["run", "quickstart_cpu", *TINY, f"run_dir={tmp_path / 'new'}", f"resume={finished}", "--check"]) == 0
    assert (tmp_path / "new" / "config.yaml").is_file()
