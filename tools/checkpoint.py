"""Checkpoints of an RL run: what `tidal run` saves every `checkpoint_every` steps and at
the end, and what `resume=` reads back.

A checkpoint is a folder `checkpoints/step-NNNNNN/` of the run directory: the model
(model.safetensors, config.json, generation_config.json) and its tokenizer as a Hugging
Face one (tokenizer.json, tokenizer_config.json, special_tokens_map.json; an older tidal
wrote its own tokenizer.json only, which `CharTokenizer.load` reads too), `trainer.pt`
(optimizer, version, RNG states, reference policy, the lr schedule's position; with LoRA
adapters the base weights, the adapters and their settings, while model.safetensors holds
the merged weights), `store.bin` (the store's rows and
counts) and `state.json` (version, the prompt stream's position, the run's running totals
that its metrics report, such as `failed_rewards`, and what its summary keeps: accuracy
before RL, first reward).
It is written to `step-NNNNNN.tmp`, flushed to disk (files and folder), renamed, and only
then named by `checkpoints/latest`; older ones are pruned after that (`keep_checkpoints`).

Nothing in a checkpoint is unpickled: a run directory may come from anyone, and
unpickling a file runs whatever code it names. trainer.pt holds only tensors and plain
values (NumPy's RNG state is saved as a list) and is read with `weights_only=True`; one
that needs pickle (an older tidal's, or not tidal's) is refused, naming it.
"""

from __future__ import annotations

import copy
import fcntl
import json
import logging
import os
import pickle
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch

from tidal.engines.models import ModelSource, tiny_source
from tidal.engines.tiny import save_model
from tidal.engines.tokenizers import Tokenizer
from tidal.engines.torch_train import TorchTrainEngine
from tidal.flow.files import naming, write_whole
from tidal.flow.store import Store, persist
from tidal.hal import current_platform
from tidal.tools.config import ConfigError

log = logging.getLogger(__name__)



def load_plain(path: Path, **options: Any) -> Any:
    """`torch.load(path, weights_only=True)` with torch's own allow-list only: libraries add
    classes to it when imported (megatron-core adds 26, numpy's among them), which would let a
    checkpoint build them; they are set aside for the load and put back after it."""
    extra = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        return torch.load(path, weights_only=True, **options)
    finally:
        torch.serialization.add_safe_globals(extra)

def rng_state() -> dict[str, Any]:
    """Python's, NumPy's, torch's CPU and every device's generator (rollout samples on the device)."""
    return current_platform().get_rng_state()


def set_rng_state(state: dict[str, Any]) -> None:
    """Set what `rng_state` saved. A checkpoint from another platform (or from before device
    generators were saved) restores the host generators; the devices keep their seeding.

    Raises:
        ValueError: the host generators' states were refused (the platform sets all or
            none): a checkpoint without device states has nothing a host-only retry drops.
    """
    platform = current_platform()
    try:
        platform.set_rng_state({"device": [], **state})
    except (ValueError, RuntimeError) as e:  # device states from another platform, or another device count
        if not state.get("device"):
            raise
        log.warning("the checkpoint's device RNG states do not fit this platform (%s); restoring the host generators only", e)
        platform.set_rng_state({**state, "device": []})


def _plain_rng(state: dict[str, Any]) -> dict[str, Any]:
    """`state` as `torch.load(weights_only=True)` reads it back: NumPy's key array as a
    list of ints (`np.random.set_state` takes either); the rest is tuples, ints and tensors."""
    name, key, pos, has_gauss, cached_gaussian = state["numpy"]
    return {**state, "numpy": (name, [int(k) for k in key], int(pos), int(has_gauss), float(cached_gaussian))}


def save_checkpoint(run_dir: Path, *, trainer: TorchTrainEngine, template: torch.nn.Module, tokenizer: Tokenizer, save_data: Callable[[Path], dict[str, Any]], extra: dict[str, Any], keep: int = 0, rng: dict[str, Any] | None = None, critic: dict[str, Any] | None = None) -> Path:
    """Everything a resume needs, written to a temporary folder, flushed to disk, then
    renamed (never half a checkpoint, even after a power loss).

    The weights and optimizer come from `trainer.state_dict()` (the full state, whatever the
    engine's sharding), so any train engine resumes from any engine's checkpoint.
    `save_data(path)` saves the store to `path` and returns what state.json records with
    it: at least `prompt_position`, the prompt stream's position then (`Workflow.save`
    adds the run's `totals`); `extra` goes there too. `keep` > 0: once this one is complete
    and `latest` names it, all but the newest `keep` are deleted. `rng`: the RNG state to
    save (`QuietRollout.rng`), else this moment's. `critic`: the value model's state
    (`algorithm.advantage=gae`), kept in trainer.pt.

    Raises:
        OSError: naming the checkpoint's folder, when the disk refuses a write whose error
            names no file; a save that fails (so, or interrupted) removes what it wrote, and
            `latest` names the last whole checkpoint.
    """
    final = run_dir / "checkpoints" / f"step-{trainer.version:06d}"
    tmp = final.with_name(final.name + ".tmp")
    old = final.with_name(final.name + ".old")
    pointer = run_dir / "checkpoints" / "latest"
    try:
        with naming(final):  # a refused write that names no file names the checkpoint
            if tmp.exists():  # what a save of this step that was killed left
                shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            with _writing(tmp):
                state = trainer.state_dict()
                model = copy.deepcopy(template)
                model.load_state_dict(state["model"])
                save_model(model, tokenizer, tmp)  # type: ignore[arg-type]  # a transformers model: the run's (`Run.model`)
                torch.save({"optimizer": state.get("optimizer"), "version": trainer.version, "rng": _plain_rng(rng_state() if rng is None else rng), "reference": state.get("reference"), "lr_scheduler": state.get("lr_scheduler"), "lora": state.get("lora"), "critic": critic}, tmp / "trainer.pt")
                saved = save_data(tmp / "store.bin")
                (tmp / "state.json").write_text(json.dumps({"version": trainer.version, **saved, **extra}, indent=2))
                _sync_folder(tmp)  # on disk before `latest` names it and older ones are pruned (a power loss, a preempted VM)
                if final.exists():  # saved again at the same step (a resumed finished run): set it aside until
                    shutil.rmtree(old, ignore_errors=True)  # the new one is in place; `latest` may name it meanwhile
                    final.rename(old)
                tmp.rename(final)
            _sync(final.parent)  # its new name on disk before `latest` names it (POSIX orders no two renames)
            _write_synced(pointer.with_suffix(".tmp"), final.name + "\n")
            os.replace(pointer.with_suffix(".tmp"), pointer)  # a crash leaves the old pointer or the new one
    except BaseException:  # a full disk, a second Ctrl-C: `latest` names the last whole one; no half of this one stays
        shutil.rmtree(tmp, ignore_errors=True)
        pointer.with_suffix(".tmp").unlink(missing_ok=True)
        if old.exists() and not final.exists():  # cut between setting the step's old one aside and naming the new one: `latest` may name it
            old.rename(final)
        raise
    _sync(pointer.parent)  # the renames, before anything older is deleted
    for leftover in pointer.parent.glob("step-*"):  # `old`, and what saves a crash cut short left behind
        if leftover.name.endswith((".tmp", ".old")) and leftover.is_dir():
            shutil.rmtree(leftover, ignore_errors=True)
    if keep:
        prune_checkpoints(run_dir / "checkpoints", keep=keep, latest=final.name)
    return final


def prune_checkpoints(folder: Path, *, keep: int, latest: str) -> list[str]:
    """Delete all but the newest `keep` complete checkpoints (by step) in `folder`, never
    `latest`; returns the names deleted. (`save_checkpoint` deletes unfinished `.tmp` and
    set-aside `.old` folders once `latest` names the new one.)"""
    done = sorted((p for p in folder.iterdir() if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit()), key=lambda p: int(p.name[5:]))
    deleted = []
    for old in done[: max(len(done) - keep, 0)]:
        if old.name != latest:
            shutil.rmtree(old)
            deleted.append(old.name)
    return deleted


@contextmanager
def _writing(folder: Path) -> Iterator[None]:
    """Hold an exclusive `flock` on `folder` while a save writes it. The kernel releases it
    when the process ends, however it ends, so `remove_abandoned` tells the `.tmp` folder of
    a save that was killed from one another process is still writing (`resume=` a run that
    is still going). Where the filesystem has no such lock, the folder stays unlocked, and
    `remove_abandoned`, which cannot lock it either, leaves it alone."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        with suppress(OSError):  # no flock here: see above
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield
    finally:
        os.close(fd)


def remove_abandoned(folder: Path, *, latest: str) -> list[str]:
    """Delete the `step-NNNNNN.tmp` folders in `folder` (a run's `checkpoints/`) that no
    save is writing (`_writing`): what a trainer killed while saving left there, as large
    as the weights. Its run is resumed in a new directory, where the saves that clean up
    after themselves (`save_checkpoint`) happen, so without this they stayed for good.
    Never `latest` (the folder being resumed from), never a set-aside `.old` (a resume may
    read it: `latest_checkpoint`); a folder that cannot be deleted (a run directory this
    user may only read) is left. Returns the names deleted."""
    deleted = []
    for tmp in sorted(folder.glob("step-*.tmp")):
        if tmp.name != latest and tmp.is_dir() and not tmp.is_symlink() and not _being_written(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
            if not tmp.exists():
                deleted.append(tmp.name)
    if deleted:
        log.info("removed the unfinished checkpoints %s of %s (saves that were cut short)", ", ".join(deleted), folder)
    return deleted


def _being_written(folder: Path) -> bool:
    """Whether a save holds `folder`'s lock (`_writing`); true as well when that cannot be
    told (no lock on this filesystem, no permission), so that nothing is deleted on a guess."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released by the close below
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


STATE_KEYS = ("version", "prompt_position", "accuracy_before")
"""Keys every state.json has (`totals` and `first_reward` came later: a resume without them starts them afresh)."""
TRAINER_KEYS = ("optimizer", "version", "rng")


def load_checkpoint(folder: Path, *, attention: str = "sdpa", source: ModelSource | None = None) -> tuple[Store, torch.nn.Module, Tokenizer, dict[str, Any], dict[str, Any]]:
    """What `save_checkpoint` wrote to `folder`: the store, model, tokenizer, trainer.pt and
    state.json; a ConfigError names a file that is missing, cannot be read, or needs pickle.
    `source` (the run's `model.source`) reads the model and tokenizer; without one, the tiny
    model's with `attention`. Once all is read, the unfinished saves beside it go (`remove_abandoned`)."""
    source = source or tiny_source(attention=attention)
    read = _reader(folder)
    read("config.json", lambda path: json.loads(path.read_text()))  # what the source reads besides the weights
    read("tokenizer.json", lambda _: source.load_tokenizer(folder))
    policy = read("model.safetensors", lambda _: source.load(folder))
    model, tokenizer = policy.module, policy.tokenizer
    saved = read("trainer.pt", lambda path: load_plain(path), *TRAINER_KEYS)
    state = read("state.json", lambda path: json.loads(path.read_text()), *STATE_KEYS)
    store = read("store.bin", persist.load)
    remove_abandoned(folder.parent, latest=folder.name)
    return store, model, tokenizer, saved, state


def check_lora(saved: dict[str, Any], train: Any, *, resume: str) -> None:
    """That a checkpoint's trainer.pt (`saved`) trained what the recipe's `train` section
    trains: LoRA adapters with the same keys (`train.lora_*`), or every weight.

    Raises:
        ConfigError: naming the key that differs and the checkpoint's value.
    """
    lora = saved.get("lora")
    if lora is None:
        if train.lora_rank:
            raise ConfigError(f"resume={resume!r}: its checkpoint trained every weight, and train.lora_rank={train.lora_rank} trains adapters (AdamW's state would not fit them); resume with train.lora_rank=0")
        return
    for key, value in lora["settings"].items():  # `LoraSettings.keys()`: "train.<field>" -> its value
        given = getattr(train, key.removeprefix("train."))
        if given != value:
            raise ConfigError(f"resume={resume!r}: its checkpoint trained LoRA adapters with {key}={value}, the recipe says {given}; resume with {key}={value}")


def check_checkpoint(folder: Path, *, source: ModelSource | None = None, train: Any = None) -> None:
    """Open each file `load_checkpoint` reads, only as far as it takes to find one missing,
    cut short or without its keys, so that `tidal run` (and `--check`) refuse a damaged
    checkpoint before they make a run directory: the safetensors header, and that the file
    holds every tensor it lists (the weights are not read); trainer.pt's keys, its tensors
    mapped, not read (a truncated archive has no directory to map them from); the small
    files whole.

    `train` (the recipe's `train` section): that the checkpoint trained what it trains (`check_lora`).

    Raises:
        ConfigError: as `load_checkpoint` would, naming the file.
    """
    from safetensors import safe_open  # noqa: PLC0415

    def tensor_names(path: Path) -> list[str]:
        with safe_open(path, framework="pt") as f:  # checks the header, and that the file covers it
            return list(f.keys())

    read = _reader(folder)
    read("config.json", lambda path: json.loads(path.read_text()))
    read("tokenizer.json", lambda _: (source or tiny_source()).load_tokenizer(folder))
    read("model.safetensors", tensor_names)
    saved = read("trainer.pt", lambda path: load_plain(path, mmap=True, map_location="cpu"), *TRAINER_KEYS)
    if train is not None:
        check_lora(saved, train, resume=str(folder.parent.parent))
    read("state.json", lambda path: json.loads(path.read_text()), *STATE_KEYS)
    read("store.bin", persist.load)  # the rows in flight: a few steps' samples, small beside the weights


def _reader(folder: Path) -> Callable[..., Any]:
    """`read(name, load, *keys)`: `load(folder / name)`, which must hold `keys`; whatever goes
    wrong is a ConfigError naming the file."""

    def read(name: str, load: Callable[[Path], Any], *keys: str) -> Any:
        try:
            loaded = load(folder / name)
            if missing := [k for k in keys if k not in loaded]:
                raise KeyError(f"no {', '.join(missing)}")
            return loaded
        except pickle.UnpicklingError as e:  # torch.load(weights_only=True) met what only pickle builds, and built nothing
            raise ConfigError(
                f"resume={str(folder.parent.parent)!r}: its checkpoint {folder.name} has a {name} that only pickle can load "
                f"({_needs(e)}), refused unread: unpickling runs whatever code the file names; "
                "a checkpoint tidal writes holds only tensors and plain values (an older tidal's NumPy RNG state needed pickle)"
            ) from None
        except Exception as e:  # noqa: BLE001 - whatever its loader raises, the file is what to name
            raise ConfigError(f"resume={str(folder.parent.parent)!r}: its checkpoint {folder.name} has no readable {name} ({type(e).__name__}: {e}); to continue from an earlier checkpoint the run kept, name it in checkpoints/latest") from None

    return read


def _needs(e: pickle.UnpicklingError) -> str:
    """What torch's weights-only unpickler refused, in a few words (its message is a page)."""
    if found := re.search(r"GLOBAL (\S+) was not an allowed global", str(e)):
        return f"it names {found[1]}"
    if found := re.search(r"WeightsUnpickler error:\s*(.+)", str(e)):
        return found[1].strip()
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def truncate_metrics(path: Path, version: int, *, into: Path | None = None) -> list[dict[str, Any]]:
    """Keep only the steps up to `version` (a run resumed in its own directory redoes the
    rest), and drop a line cut short (a process killed while writing it). `into`: write
    them there instead, `path` left as it was (a run resumed in a new directory starts its
    record with the resumed run's steps, so each step of the run is in it once). Returns
    those steps' metrics; none when `path` is missing."""
    if not path.exists():
        return []
    kept = [line for line in path.read_text().splitlines() if (step := _step_of(line)) is not None and step <= version]
    write_whole(into or path, "".join(line + "\n" for line in kept))
    return [json.loads(line) for line in kept]


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def _sync(path: Path) -> None:
    """fsync a file or folder (a folder: its entries, so renames in it survive a power loss)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_folder(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            _sync(path)
    _sync(folder)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
