"""`tidal export`: a run's checkpoint as a Hugging Face model directory.

The directory holds config.json, the safetensors weights, generation_config.json (with
the end and pad ids) and the tokenizer's files, so `AutoModelForCausalLM.from_pretrained`
and `AutoTokenizer.from_pretrained` (and servers built on them, such as vLLM) load it
unchanged. What only a resume needs (trainer.pt, store.bin, state.json) stays behind.

A run that trained LoRA adapters (`train.lora_rank`) has the merged weights in its
checkpoints' model.safetensors, which is what OUT_DIR gets; its adapters also go to
OUT_DIR/lora_adapter in peft's format (adapter_config.json, adapter_model.safetensors), for
`PeftModel.from_pretrained` or vLLM's LoRA serving on top of the weights RL started from
(`base_model_name_or_path`: the run's `model.path` when that is what it started from).

A checkpoint already is such a directory plus those files, so the model's files are
copied byte for byte; a checkpoint an older tidal wrote, whose tokenizer.json was its own
format, gets its tokenizer rewritten as a Hugging Face one. The export is written to a
temporary folder beside OUT_DIR, checked to load, and renamed to OUT_DIR only then: a
failure leaves OUT_DIR as it was (absent, empty, or, with `force`, its old contents).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from tidal.engines.models import tiny_source
from tidal.tools.config import ConfigError, load_config, select
from tidal.tools.run import latest_checkpoint

RESUME_ONLY = frozenset({"trainer.pt", "store.bin", "state.json"})
"""A checkpoint's files that only `resume=` reads (tools/checkpoint.py); the rest is the model."""
ADAPTER = "lora_adapter"
"""The folder of OUT_DIR a LoRA run's adapters go to, in peft's format."""
WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
"""One of these names the weights: a single file, or the index of a sharded save."""


def checkpoint_of(run_dir: Path, *, step: int | None = None) -> Path:
    """The checkpoint folder to export: `step`'s, else the one `checkpoints/latest` names.

    Raises:
        ConfigError: naming `run_dir` when it is not a folder or has no such checkpoint
            (the message lists the steps it has).
    """
    if not run_dir.is_dir():
        raise ConfigError(f"run directory {str(run_dir)!r} does not exist or is not a folder")
    if step is None:
        try:
            return latest_checkpoint(run_dir)
        except FileNotFoundError as e:
            raise ConfigError(f"{e}; a run writes one every checkpoint_every steps and when it ends") from None
    folder = run_dir / "checkpoints" / f"step-{step:06d}"
    if not folder.is_dir():
        have = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*") if p.is_dir() and p.name[5:].isdigit())
        raise ConfigError(f"{str(run_dir)!r} has no checkpoint {folder.name} (--step {step}); it has {', '.join(have) or 'none'}")
    return folder


def export(run_dir: Path, out_dir: Path, *, step: int | None = None, force: bool = False, trust_remote_code: bool | None = None) -> Path:
    """Write the checkpoint of `run_dir` (`checkpoint_of`) to `out_dir` as a Hugging Face
    model directory; returns the checkpoint folder exported.

    Args:
        run_dir: a `tidal run` directory.
        out_dir: where the model goes; it must not exist or be empty, unless `force`.
        step: the checkpoint's step (default: the latest).
        force: replace a non-empty `out_dir` (once the new export is whole).
        trust_remote_code: run a checkpoint's own model code (config.json's `auto_map`) to
            check the export loads; default: what the run had (`model.trust_remote_code`
            in its config.yaml; false when that is gone).

    Raises:
        ConfigError: naming the run directory without that checkpoint, the checkpoint
            file that is missing or cannot be read, or `out_dir` that is in the way.
    """
    run_dir, out_dir = Path(run_dir), Path(os.path.abspath(out_dir))  # `.` and `..` named as folders
    checkpoint = checkpoint_of(run_dir, step=step)
    _check_destination(out_dir, force=force)
    if trust_remote_code is None:
        trust_remote_code = run_trusted_remote_code(run_dir)
    if out_dir == run_dir.resolve() or out_dir in run_dir.resolve().parents:
        raise ConfigError(f"OUT_DIR {str(out_dir)!r} holds the run directory {str(run_dir)!r}: the export would replace it")
    missing = [name for name in ("config.json",) if not (checkpoint / name).is_file()]
    if not any((checkpoint / name).is_file() for name in WEIGHTS):
        missing.append(WEIGHTS[0])
    if missing:
        raise ConfigError(f"checkpoint {checkpoint} has no {', '.join(missing)}: nothing to export")
    made = next((p for p in reversed((out_dir.parent, *out_dir.parent.parents)) if not p.exists()), None)  # the outermost folder this makes
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.export-{os.getpid()}")
    aside = out_dir.with_name(f".{out_dir.name}.replaced-{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        _write(checkpoint, tmp, trust_remote_code=trust_remote_code)
        write_adapter(checkpoint, tmp / ADAPTER, base=started_from(run_dir))
        _sync_folder(tmp)  # on disk before its name says it is whole
        if out_dir.exists() and any(out_dir.iterdir()):  # `force`: the old export goes once the new one is whole
            out_dir.rename(aside)
        os.replace(tmp, out_dir)  # over an empty folder, or into its free name
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if aside.exists() and not out_dir.exists():
            aside.rename(out_dir)
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise
    shutil.rmtree(aside, ignore_errors=True)
    return checkpoint


def _check_destination(out_dir: Path, *, force: bool) -> None:
    """Refuse an `out_dir` that is a file, or a folder with files in it (without `force`)."""
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        raise ConfigError(f"OUT_DIR {str(out_dir)!r} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise ConfigError(f"OUT_DIR {str(out_dir)!r} exists and is not empty; choose another, or pass --force to replace it")


def run_trusted_remote_code(run_dir: Path) -> bool:
    """Whether the run in `run_dir` ran its checkpoint's own model code (`model.trust_remote_code`
    in its config.yaml; False when that file is gone or unreadable)."""
    try:
        return select(load_config(run_dir / "config.yaml"), "model.trust_remote_code") is True
    except ConfigError:
        return False


def _write(checkpoint: Path, folder: Path, *, trust_remote_code: bool) -> None:
    """The model directory of `checkpoint` in `folder`, checked to load with transformers.

    Raises:
        ConfigError: naming the checkpoint file that cannot be read as what it should be.
    """
    import transformers  # noqa: PLC0415 - a command that does not export never loads it
    from safetensors import safe_open  # noqa: PLC0415

    for path in sorted(checkpoint.iterdir()):
        if path.name not in RESUME_ONLY and path.is_file() and not path.is_symlink():  # a planted link is not followed out of the run
            shutil.copyfile(path, folder / path.name)
    if not (folder / "tokenizer_config.json").is_file():  # an older tidal's tokenizer.json: the tiny model's, in a format of its own
        try:
            tokenizer = tiny_source().load_tokenizer(checkpoint)  # a CharTokenizer, which saves itself as a Hugging Face one
        except (OSError, ValueError) as e:
            raise ConfigError(f"checkpoint {checkpoint} has no readable tokenizer.json ({type(e).__name__}: {e})") from None
        tokenizer.save(folder)
    custom = _custom_code(folder)
    if custom and not trust_remote_code:
        raise ConfigError(
            f"checkpoint {checkpoint}'s model is code of its own ({custom}), which the export runs to check that it loads, "
            "and trust_remote_code is off (--no-trust-remote-code, or a run without model.trust_remote_code=true): pass --trust-remote-code if you trust it"
        )
    try:
        config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ConfigError(f"checkpoint {checkpoint} has no readable config.json ({type(e).__name__}: {e})") from None
    try:
        loaded = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"checkpoint {checkpoint}'s tokenizer files do not load with AutoTokenizer ({type(e).__name__}: {e})") from None
    for name in _weight_files(folder):
        try:
            with safe_open(folder / name, framework="pt") as f:  # the header, and that the file holds what it lists
                list(f.keys())
        except Exception as e:  # noqa: BLE001 - whatever safetensors raises, the file is what to name
            raise ConfigError(f"checkpoint {checkpoint} has no readable {name} ({type(e).__name__}: {e})") from None
    _write_generation_config(folder, checkpoint=checkpoint, config=config, tokenizer=loaded)


def started_from(run_dir: Path) -> str:
    """The checkpoint directory the run's RL started from, as its config.yaml names it:
    `model.path` of a `model.source: hf` run without a warm start; "" otherwise (the tiny
    model's weights, or a warm start's, are the run's own: `cache/` in its directory)."""
    try:
        cfg = load_config(run_dir / "config.yaml")
    except ConfigError:
        return ""
    return str(cfg.model.path) if cfg.model.source == "hf" and cfg.model.path and not cfg.sft.steps else ""


def write_adapter(checkpoint: Path, folder: Path, *, base: str) -> bool:
    """`checkpoint`'s LoRA adapters (its trainer.pt's, when the run trained some) in peft's
    format in `folder`, with `base` as `base_model_name_or_path`; returns whether there were any.

    Raises:
        ConfigError: naming trainer.pt when it cannot be read, or peft when it is missing.
    """
    from tidal.engines.lora import lora_settings, peft_adapter  # noqa: PLC0415
    from tidal.tools.checkpoint import load_plain  # noqa: PLC0415

    path = checkpoint / "trainer.pt"
    if not path.is_file():
        return False
    try:
        lora = load_plain(path, mmap=True, map_location="cpu").get("lora")
    except Exception as e:  # noqa: BLE001 - whatever torch.load raises, the file is what to name
        raise ConfigError(f"checkpoint {checkpoint} has no readable trainer.pt ({type(e).__name__}: {e})") from None
    if lora is None:
        return False
    keys = lora["settings"]
    settings = lora_settings(keys["train.lora_rank"], keys["train.lora_alpha"], keys["train.lora_target_modules"])
    assert settings is not None  # a checkpoint keeps LoRA state only for a rank > 0
    try:
        config, weights = peft_adapter(settings, lora["adapters"], base=base)
    except ImportError as e:
        raise ConfigError(f"checkpoint {checkpoint} holds LoRA adapters, which are written in peft's format: {e}") from None
    from safetensors.torch import save_file  # noqa: PLC0415

    folder.mkdir()
    config.save_pretrained(folder)
    save_file(weights, folder / "adapter_model.safetensors")
    return True


def _custom_code(folder: Path) -> str:
    """What in `folder`'s config.json makes transformers run the folder's own code (its
    `auto_map`, e.g. "AutoConfig: configuration_x.XConfig"), or "" when nothing does."""
    try:
        auto_map = json.loads((folder / "config.json").read_text()).get("auto_map")
    except (OSError, ValueError, AttributeError):
        return ""  # AutoConfig says what is wrong with it
    if not isinstance(auto_map, dict) or not auto_map:
        return ""
    return "config.json auto_map: " + ", ".join(f"{k}: {v}" for k, v in auto_map.items())


def _weight_files(folder: Path) -> list[str]:
    """The safetensors files of the model in `folder`: model.safetensors, or those its
    index names.

    Raises:
        ValueError: the index is not JSON with a `weight_map`.
    """
    index = folder / WEIGHTS[1]
    if not index.is_file():
        return [WEIGHTS[0]]
    return sorted(set(json.loads(index.read_text())["weight_map"].values()))


def _write_generation_config(folder: Path, *, checkpoint: Path, config: Any, tokenizer: Any) -> None:
    """generation_config.json with the end and pad ids: the checkpoint's, else the model
    config's, with what they lack taken from the tokenizer, so `generate` stops where the
    trainer's rollouts stopped."""
    import transformers  # noqa: PLC0415

    path = folder / "generation_config.json"
    generation = transformers.GenerationConfig.from_pretrained(folder) if path.is_file() else transformers.GenerationConfig.from_model_config(config)
    if generation.eos_token_id is None:
        generation.eos_token_id = tokenizer.eos_token_id
    if generation.pad_token_id is None:
        generation.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if generation.eos_token_id is None:
        raise ConfigError(f"checkpoint {checkpoint}: neither config.json, generation_config.json nor the tokenizer names an end token (eos_token_id); generation could never stop")
    generation.save_pretrained(folder)


def _sync_folder(folder: Path) -> None:
    """fsync every file in `folder`, then the folder (its entries)."""
    for path in [*folder.iterdir(), folder]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
