"""`resume=` a run whose checkpoint lost or damaged a file: a clear error naming the file
(exit code 2 from `tidal run`), not a traceback from deep inside a loader."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

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


def test_a_run_folder_with_brackets_in_its_name_resumes_and_is_named_as_written(finished, tmp_path, capsys):
    """"tidal: resuming <folder>" went through rich's markup: `exp[lr=1e-4]` printed as
    `exp`, and `exp[/old]` stopped the resume with a MarkupError traceback; a long one was
    split over two lines of the log."""
    copy = tmp_path / "exp[/old]"
    shutil.copytree(finished, copy)
    assert _run(tmp_path / "resumed", f"resume={copy}", "algorithm.num_steps=1")["steps"] == 1
    assert f"tidal: resuming {copy} at version 1" in capsys.readouterr().err


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
    from tidal.engines import models
    from tidal.tools.cli import main

    for source in (models.TinySource, models.HFSource):  # every way a checkpoint's model is loaded
        monkeypatch.setattr(source, "load", lambda *a, **k: pytest.fail("the check loaded the model"))
    assert main(["run", "quickstart_cpu", *TINY, f"run_dir={tmp_path / 'new'}", f"resume={finished}", "--check"]) == 0
    assert (tmp_path / "new" / "config.yaml").is_file()


SAVE_ON_A_FULL_DISK = """
import json, resource, signal, sys
from pathlib import Path
from tidal.engines.tiny import CharTokenizer, build_tiny_qwen2
from tidal.engines.torch_train import TorchTrainEngine
from tidal.flow.store import Store, persist
from tidal.tools.checkpoint import save_checkpoint
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
run_dir = Path(sys.argv[1])
tokenizer = CharTokenizer()
model = lambda: build_tiny_qwen2(tokenizer.vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
trainer = TorchTrainEngine(model(), version=1)
save_data = lambda path: persist.save(Store(), path) or {"prompt_position": 0}
save = lambda pad: save_checkpoint(run_dir, trainer=trainer, template=model(), tokenizer=tokenizer, save_data=save_data, extra={"accuracy_before": 0.0, "pad": "x" * pad})
save(0)
trainer.version = 2
for limit, pad in ((100_000, 200_000), (20_000, 0)):  # state.json refused; model.safetensors refused
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    try:
        save(pad)
    except Exception as e:
        print(json.dumps({"error": type(e).__name__, "filename": getattr(e, "filename", None), "left": sorted(p.name for p in (run_dir / "checkpoints").iterdir())}))
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
"""


def test_a_checkpoint_the_disk_refuses_leaves_the_last_one_named_and_none_of_its_own_files(tmp_path):
    """A full disk (a file-size limit stands in for it) while a checkpoint is written: `latest`
    still names the last whole one, and the half-written `step-NNNNNN.tmp` is gone (it was
    left, as large as the weights, on the disk that was full, in a run directory no later
    save cleans: `resume=` continues in a new one). The OSError names the checkpoint (it
    named no file, so `tidal run` printed a traceback)."""
    import subprocess
    import sys

    from tidal.tools.checkpoint import load_checkpoint
    from tidal.tools.run import latest_checkpoint

    out = subprocess.run([sys.executable, "-c", SAVE_ON_A_FULL_DISK, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    state_json, safetensors = (json.loads(line) for line in out.stdout.splitlines())
    assert state_json == {"error": "OSError", "filename": str(tmp_path / "checkpoints" / "step-000002"), "left": ["latest", "step-000001"]}
    assert safetensors == {"error": "OSError", "filename": str(tmp_path / "checkpoints" / "step-000002.tmp" / "model.safetensors"), "left": ["latest", "step-000001"]}  # was SafetensorError: a traceback
    assert latest_checkpoint(tmp_path).name == "step-000001"
    load_checkpoint(latest_checkpoint(tmp_path), attention="eager")


def test_a_second_ctrl_c_while_a_checkpoint_is_written_leaves_the_last_one_and_no_half_of_the_new_one(tmp_path):
    """The second Ctrl-C stops at once, often while the checkpoint the first asked for is
    written: its half-written folder went with it, not left in the run directory."""
    from tidal.engines.tiny import CharTokenizer, build_tiny_qwen2
    from tidal.engines.torch_train import TorchTrainEngine
    from tidal.flow.store import Store, persist
    from tidal.tools.checkpoint import save_checkpoint
    from tidal.tools.run import latest_checkpoint

    tokenizer = CharTokenizer()
    model = lambda: build_tiny_qwen2(tokenizer.vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    trainer = TorchTrainEngine(model(), version=1)

    def save_data(path: Path) -> dict:
        persist.save(Store(), path)
        if trainer.version == 2:
            raise KeyboardInterrupt  # the second Ctrl-C, once the weights are written
        return {"prompt_position": 0}

    save_checkpoint(tmp_path, trainer=trainer, template=model(), tokenizer=tokenizer, save_data=save_data, extra={})
    trainer.version = 2
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, trainer=trainer, template=model(), tokenizer=tokenizer, save_data=save_data, extra={})
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-000001"]
    assert latest_checkpoint(tmp_path).name == "step-000001"


def test_a_checkpoint_folders_new_name_reaches_the_disk_before_latest_names_it(tmp_path, monkeypatch):
    """`step-NNNNNN.tmp` renamed to `step-NNNNNN` and `latest.tmp` renamed over `latest`
    are two entries of `checkpoints/`: until the folder is flushed, a power loss may keep
    the second rename without the first (POSIX orders neither), and `latest` would name a
    folder that is not there. The folder was flushed only after both."""
    import os

    from tidal.engines.tiny import CharTokenizer, build_tiny_qwen2
    from tidal.engines.torch_train import TorchTrainEngine
    from tidal.flow.store import Store, persist
    from tidal.tools import checkpoint as checkpoint_module

    tokenizer = CharTokenizer()
    model = lambda: build_tiny_qwen2(tokenizer.vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    trainer = TorchTrainEngine(model(), version=1)
    events: list[tuple[str, str]] = []
    fsync, replace, rename = os.fsync, os.replace, Path.rename

    def noted_fsync(fd: int) -> None:
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}")).name))
        fsync(fd)

    def noted_replace(src: Any, dst: Any) -> None:
        events.append(("replace", Path(dst).name))
        replace(src, dst)

    def noted_rename(self: Path, target: Any) -> Path:
        events.append(("rename", Path(target).name))
        return rename(self, target)

    monkeypatch.setattr(checkpoint_module.os, "fsync", noted_fsync)
    monkeypatch.setattr(checkpoint_module.os, "replace", noted_replace)
    monkeypatch.setattr(Path, "rename", noted_rename)
    save_data = lambda path: persist.save(Store(), path) or {"prompt_position": 0}
    checkpoint_module.save_checkpoint(tmp_path, trainer=trainer, template=model(), tokenizer=tokenizer, save_data=save_data, extra={})
    renamed, named = events.index(("rename", "step-000001")), events.index(("replace", "latest"))
    assert ("fsync", "checkpoints") in events[renamed:named]


def test_a_save_cut_after_setting_the_steps_old_checkpoint_aside_puts_it_back(tmp_path, monkeypatch):
    """Saving a step again (a resumed finished run) sets the old one aside as `.old` before
    the new one takes its name, while `latest` names that step. A save cut between the two
    renames (a second Ctrl-C) removed the new one and left `latest` naming no folder."""
    from tidal.engines.tiny import CharTokenizer, build_tiny_qwen2
    from tidal.engines.torch_train import TorchTrainEngine
    from tidal.flow.store import Store, persist
    from tidal.tools.checkpoint import load_checkpoint, save_checkpoint
    from tidal.tools.run import latest_checkpoint

    tokenizer = CharTokenizer()
    model = lambda: build_tiny_qwen2(tokenizer.vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)
    trainer = TorchTrainEngine(model(), version=1)
    save_data = lambda path: persist.save(Store(), path) or {"prompt_position": 0}
    save_checkpoint(tmp_path, trainer=trainer, template=model(), tokenizer=tokenizer, save_data=save_data, extra={"attempt": "first", "accuracy_before": 0.0})
    rename = Path.rename

    def cut_before_the_new_one_is_named(self: Path, target: Any) -> Path:
        if self.name.endswith(".tmp") and Path(target).name == "step-000001":
            raise KeyboardInterrupt
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", cut_before_the_new_one_is_named)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, trainer=trainer, template=model(), tokenizer=tokenizer, save_data=save_data, extra={"attempt": "second", "accuracy_before": 0.0})
    monkeypatch.setattr(Path, "rename", rename)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-000001"]
    assert json.loads((latest_checkpoint(tmp_path) / "state.json").read_text())["attempt"] == "first"
    load_checkpoint(latest_checkpoint(tmp_path), attention="eager")
