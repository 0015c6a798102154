"""`engines.tiny.save_model` on a disk that refuses the write: all of a model or none of it."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import transformers
from safetensors import SafetensorError

from tidal.engines.tiny import CharTokenizer, build_tiny_qwen2, load_model, save_model

T = CharTokenizer()


def tiny(seed: int = 0):
    return build_tiny_qwen2(T.vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=32, seed=seed)


def fill_the_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the weights' write fail as safetensors does on a full disk, after part of the file
    went out (config.json, written before them, went through)."""

    def save_file(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 100)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", save_file)


def test_a_model_the_disk_refuses_leaves_no_folder_or_file_behind(tmp_path, monkeypatch):
    """A run's initial model (`cache/initial`) on a full disk left `config.json` in a model
    folder with no weights: the run directory held what looked like a saved model."""
    fill_the_disk(monkeypatch)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with pytest.raises(OSError) as refused:
        save_model(tiny(), T, run_dir / "cache" / "initial")
    assert refused.value.errno == errno.ENOSPC
    assert refused.value.filename == str(run_dir / "cache" / "initial" / "model.safetensors")
    assert list(run_dir.iterdir()) == []


def test_a_model_save_the_disk_refuses_leaves_the_model_that_was_there(tmp_path, monkeypatch):
    """Saved over an earlier model, a failed save keeps every file of that one as it was
    (the weights' half-written file went over them), and leaves none of its own; an error
    writing config.json names the file it was to be, not the one it was written as."""
    save_model(tiny(seed=1), T, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with monkeypatch.context() as patched:
        fill_the_disk(patched)
        with pytest.raises(OSError, match="No space left on device"):
            save_model(tiny(seed=2), T, tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before

    def config_refused(self, path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    with monkeypatch.context() as patched:
        patched.setattr(transformers.PretrainedConfig, "to_json_file", config_refused)
        with pytest.raises(OSError) as refused:
            save_model(tiny(seed=2), T, tmp_path)
    assert refused.value.filename == str(tmp_path / "config.json")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    save_model(tiny(seed=2), T, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before)
    load_model(tmp_path)
