"""What a checkpoint's files may hold and what a run's checkpoints folder keeps: trainer.pt
loads without pickle (a run directory may come from anyone), and the `.tmp` folder of a
save that was killed does not stay for good; its tokenizer loads with `AutoTokenizer`."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers

from tidal.engines.tiny import CharTokenizer
from tidal.engines.torch_train import TorchTrainEngine
from tidal.flow.store import Store, persist
from tidal.tools.checkpoint import check_checkpoint, load_checkpoint, remove_abandoned, save_checkpoint, set_rng_state
from tidal.tools.config import ConfigError
from tidal.tools.run import latest_checkpoint

TINY = ["model.hidden_size=32", "model.num_layers=1", "model.num_heads=2", "model.num_kv_heads=1", "model.intermediate_size=64"]


def _save(run_dir: Path, *, version: int) -> Path:
    """A checkpoint of quickstart_cpu's model with `TINY`'s shape, at `version`."""
    from tidal.tools.config import load_config
    from tidal.tools.recipes import resolve_recipe
    from tidal.tools.train import build_policy

    tokenizer = CharTokenizer()
    cfg = load_config(resolve_recipe("quickstart_cpu"), TINY)
    trainer = TorchTrainEngine(build_policy(cfg, tokenizer), version=version)
    save_data = lambda path: persist.save(Store(), path) or {"prompt_position": 0}
    return save_checkpoint(run_dir, trainer=trainer, template=build_policy(cfg, tokenizer), tokenizer=tokenizer, save_data=save_data, extra={"accuracy_before": 0.0})


class WritesAMarker:
    """What a hostile trainer.pt can hold: unpickling it opens (creates) a file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def test_a_trainer_pt_that_needs_pickle_is_refused_and_not_run(tmp_path, capsys):
    """`resume=` and even `tidal run --check` unpickled trainer.pt (`weights_only=False`),
    running whatever code a run directory from someone else put there. Now neither builds
    anything but tensors and plain values: the file is refused in one line naming it."""
    from tidal.tools.cli import main

    folder = _save(tmp_path / "theirs", version=1)
    marker = tmp_path / "marker"
    saved = torch.load(folder / "trainer.pt", weights_only=True)
    torch.save({**saved, "extra": WritesAMarker(marker)}, folder / "trainer.pt")
    refused = r"resume=.*: its checkpoint step-000001 has a trainer.pt that only pickle can load \(it names io.open\), refused unread"
    with pytest.raises(ConfigError, match=refused):
        load_checkpoint(folder, attention="eager")
    assert not marker.exists()
    assert main(["run", "quickstart_cpu", *TINY, f"run_dir={tmp_path / 'new'}", f"resume={tmp_path / 'theirs'}", "--check"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "tidal run: error: " in err and "trainer.pt that only pickle can load" in err, err
    assert not marker.exists() and not (tmp_path / "new").exists()


@pytest.mark.parametrize("allowed_by_a_library", [False, True])
def test_a_checkpoint_from_before_loads_no_numpy_array_by_pickle(tmp_path, allowed_by_a_library):
    """An older tidal saved NumPy's RNG state as an array, which only pickle loads: such a
    checkpoint is refused (naming what it needs), not loaded with `weights_only=False`; also
    where an imported library added NumPy's classes to torch's allow-list (megatron-core does),
    which is left as it was."""
    folder = _save(tmp_path, version=1)
    saved = torch.load(folder / "trainer.pt", weights_only=True)
    torch.save({**saved, "rng": {**saved["rng"], "numpy": np.random.get_state()}}, folder / "trainer.pt")
    before = torch.serialization.get_safe_globals()
    extra = [np.core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype("uint32"))] if allowed_by_a_library else []
    torch.serialization.add_safe_globals(extra)
    try:
        with pytest.raises(ConfigError, match=r"trainer.pt that only pickle can load \(it names numpy\.\S*_reconstruct\)"):
            load_checkpoint(folder, attention="eager")
        assert set(map(str, torch.serialization.get_safe_globals())) == set(map(str, [*before, *extra]))
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


def test_the_rng_state_a_checkpoint_saves_loads_without_pickle_and_continues_every_stream(tmp_path):
    """Python's, NumPy's and torch's generators go on from the checkpoint as they went on
    after it was saved."""
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    folder = _save(tmp_path, version=1)
    after = (random.random(), np.random.rand(3).tolist(), torch.rand(3))
    torch.load(folder / "trainer.pt", weights_only=True)  # the whole file, no pickle
    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    _, _, _, saved, _ = load_checkpoint(folder, attention="eager")
    set_rng_state(saved["rng"])
    again = (random.random(), np.random.rand(3).tolist(), torch.rand(3))
    assert after[:2] == again[:2] and torch.equal(after[2], again[2])


HOLD_THE_LOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)  # as a save in progress holds it
print("locked", flush=True)
sys.stdin.read()
"""


def test_resuming_a_run_removes_the_tmp_folders_of_saves_that_were_killed(tmp_path):
    """A trainer killed while saving left `step-NNNNNN.tmp`, as large as the weights; its
    run is resumed in a new directory, so no later save in this one removed it. Loading
    the checkpoint removes it, but not the `.tmp` another process is still writing (a run
    resumed while it goes on): that one goes once its writer is gone."""
    run_dir = tmp_path / "run"
    _save(run_dir, version=1)
    checkpoints = run_dir / "checkpoints"
    (checkpoints / "step-000002.tmp").mkdir()
    (checkpoints / "step-000002.tmp" / "model.safetensors").write_bytes(b"\0" * 1000)  # its writer was killed
    (checkpoints / "step-000003.tmp").mkdir()
    writer = subprocess.Popen([sys.executable, "-c", HOLD_THE_LOCK, str(checkpoints / "step-000003.tmp")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline() == "locked\n"
        load_checkpoint(latest_checkpoint(run_dir), attention="eager")
        assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step-000001", "step-000003.tmp"]
    finally:
        writer.kill()
        writer.wait(30)
    assert remove_abandoned(checkpoints, latest="step-000001") == ["step-000003.tmp"]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step-000001"]


def test_a_save_starts_its_tmp_folder_afresh(tmp_path):
    """A save of a step whose earlier save was killed wrote into the folder that one left,
    and what only that one wrote went into the checkpoint."""
    (tmp_path / "checkpoints" / "step-000001.tmp").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-000001.tmp" / "stray").write_text("left by a killed save")
    folder = _save(tmp_path, version=1)
    assert not (folder / "stray").exists()


def test_a_checkpoints_tokenizer_loads_with_auto_tokenizer_and_an_older_ones_still_resumes(tmp_path):
    """A checkpoint's tokenizer.json was tidal's own format, which AutoTokenizer refused
    (`KeyError: 'added_tokens'`); now it is a Hugging Face tokenizer with the same ids, and a
    checkpoint saved before, with the old tokenizer.json alone, still loads."""
    folder = _save(tmp_path / "run", version=1)
    tokenizer = CharTokenizer()
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    assert hf.encode("7-3=") == tokenizer.encode("7-3=") and (hf.pad_token_id, hf.eos_token_id) == (tokenizer.pad_id, tokenizer.eos_id)
    assert load_checkpoint(folder, attention="eager")[2].alphabet == tokenizer.alphabet
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        (folder / name).unlink()
    (folder / "tokenizer.json").write_text(json.dumps({"type": "tidal-char", "alphabet": tokenizer.alphabet, "specials": ["<pad>", "<bos>", "<eos>"]}))
    check_checkpoint(folder)
    assert load_checkpoint(folder, attention="eager")[2].alphabet == tokenizer.alphabet
