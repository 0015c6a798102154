"""A tiny Qwen2-architecture model and a character tokenizer, both made locally.

Used by the CPU recipes and the tests: nothing is downloaded. The model is a real
`transformers.Qwen2ForCausalLM` built from a `Qwen2Config`, so every code path that
runs it (generate, logprobs, save_pretrained) is the one a real model takes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import SafetensorError

from tidal.engines.tokenizers import Tokenizer

DEFAULT_ALPHABET = "0123456789+-*/=() ,?:abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.>"
SPECIALS = ("<pad>", "<bos>", "<eos>")


class CharTokenizer:
    """One token per character of `alphabet`, after `<pad>`=0, `<bos>`=1, `<eos>`=2."""

    def __init__(self, alphabet: str = DEFAULT_ALPHABET) -> None:
        if len(set(alphabet)) != len(alphabet):
            raise ValueError("the tokenizer alphabet has a repeated character")
        self.alphabet = alphabet
        self._ids = {c: i + len(SPECIALS) for i, c in enumerate(alphabet)}

    pad_id, bos_id, eos_id = 0, 1, 2

    @property
    def eos_ids(self) -> list[int]:
        """The one end token (`Tokenizer.eos_ids`)."""
        return [self.eos_id]

    def apply_chat_template(self, messages: object, *, template_kwargs: object = None) -> list[int]:
        """Refused: a character model has no chat template (`Tokenizer.apply_chat_template`).

        Raises:
            ValueError: always, saying to feed raw prompt text.
        """
        raise ValueError("the character tokenizer of the tiny model has no chat template: set data.chat_template=false to feed the raw prompt text")

    @property
    def vocab_size(self) -> int:
        return len(SPECIALS) + len(self.alphabet)

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        try:
            ids = [self._ids[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in the tokenizer's alphabet {self.alphabet!r}") from None
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        out = []
        for i in ids:
            if i < 0:  # would index SPECIALS from the end
                raise ValueError(f"token id {i} is outside the vocabulary ({self.vocab_size})")
            if i < len(SPECIALS):
                if not skip_special:
                    out.append(SPECIALS[i])
            elif i < self.vocab_size:
                out.append(self.alphabet[i - len(SPECIALS)])
            else:
                raise ValueError(f"token id {i} is outside the vocabulary ({self.vocab_size})")
        return "".join(out)

    def save(self, directory: str | Path) -> None:
        """Write the tokenizer to `directory` as a Hugging Face tokenizer (`hf_tokenizer`):
        tokenizer.json, tokenizer_config.json and special_tokens_map.json, which
        `transformers.AutoTokenizer.from_pretrained(directory)` loads with the same ids."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        hf_tokenizer(self).save_pretrained(directory)
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        # transformers 5 names its fast class TokenizersBackend; PreTrainedTokenizerFast is
        # the same class there and the one transformers 4 (and tools built on it) know
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_path.write_text(json.dumps(config, indent=2) + "\n")
        specials = {"pad_token": SPECIALS[self.pad_id], "bos_token": SPECIALS[self.bos_id], "eos_token": SPECIALS[self.eos_id]}
        (directory / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")  # transformers 5 writes none; older loaders read it

    @classmethod
    def load(cls, directory: str | Path) -> CharTokenizer:
        """The tokenizer `save` wrote to `directory`, or one in the format tidal wrote before
        (a tokenizer.json of `{"type": "tidal-char", "alphabet": ...}`), so older
        checkpoints resume.

        Raises:
            ValueError: naming `directory/tokenizer.json` when it is neither: not a
                character tokenizer with `<pad>`, `<bos>`, `<eos>` as ids 0, 1, 2.
        """
        path = Path(directory) / "tokenizer.json"
        data = json.loads(path.read_text())
        if data.get("type") == "tidal-char":
            return cls(data["alphabet"])
        model = data.get("model") or {}
        vocab = model.get("vocab") if model.get("type") == "WordLevel" else None
        if not isinstance(vocab, dict):
            raise ValueError(f"{path} is not a tidal character tokenizer (no WordLevel vocabulary in it)")
        by_id = sorted(vocab.items(), key=lambda item: item[1])
        if [token for token, _ in by_id[: len(SPECIALS)]] != list(SPECIALS) or [i for _, i in by_id] != list(range(len(by_id))):
            raise ValueError(f"{path} is not a tidal character tokenizer: its ids must be {', '.join(SPECIALS)} (0, 1, 2), then one per character")
        alphabet = [token for token, _ in by_id[len(SPECIALS) :]]
        if any(len(token) != 1 for token in alphabet):
            raise ValueError(f"{path} is not a tidal character tokenizer: token {next(t for t in alphabet if len(t) != 1)!r} is more than one character")
        return cls("".join(alphabet))


def hf_tokenizer(tokenizer: CharTokenizer) -> transformers.PreTrainedTokenizerFast:
    """`tokenizer` as a transformers fast tokenizer with the same ids.

    Every character is one token; `<pad>`, `<bos>`, `<eos>` are its special tokens and
    encoding prepends `<bos>`, as `CharTokenizer.encode` does. Decoding joins the
    characters without spaces. A character outside the alphabet raises.
    """
    import tokenizers  # noqa: PLC0415 - the Hugging Face library (transformers' own dependency)

    vocab = {token: i for i, token in enumerate(SPECIALS)}
    vocab.update({c: i + len(SPECIALS) for i, c in enumerate(tokenizer.alphabet)})
    assert [vocab[t] for t in SPECIALS] == [tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id]
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
    backend.decoder = tokenizers.decoders.Fuse()
    backend.post_processor = tokenizers.processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", tokenizer.bos_id)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", clean_up_tokenization_spaces=False)


def build_tiny_qwen2(
    vocab_size: int,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_positions: int = 128,
    seed: int = 0,
    attention: str = "sdpa",
) -> transformers.Qwen2ForCausalLM:
    """A Qwen2 causal LM with tied embeddings, initialised deterministically from `seed`.

    With the defaults and the character tokenizer it has about 0.3 M parameters; the
    quickstart's (hidden_size=192, 3 layers, 6 heads, intermediate_size=512) about 1.2 M.
    `attention` is the transformers attention implementation, "sdpa" or "eager".
    """
    config = transformers.Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=CharTokenizer.pad_id,
        bos_token_id=CharTokenizer.bos_id,
        eos_token_id=CharTokenizer.eos_id,
        **_attention(attention),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(config)
    return model


def _attention(name: str) -> dict[str, Any]:
    """The config keyword that picks transformers' attention implementation (a `PretrainedConfig`
    keyword that `Qwen2Config`'s signature does not list)."""
    return {"attn_implementation": name}


def save_model(model: transformers.PreTrainedModel, tokenizer: Tokenizer, directory: str | Path) -> None:
    """safetensors weights, config.json, generation_config.json and the tokenizer's files
    (`CharTokenizer.save`), all or none: they are written to
    `directory/.partial/` and moved up once every one is whole, so a save that fails (a full
    disk) leaves no config.json without its weights, no folder it made, and a model that
    was there as it was.

    Raises:
        OSError: naming the file in `directory` that could not be written (a full disk):
            safetensors raises its own error, which says "os error N" in its text only.
    """
    directory = Path(directory)
    made = next((p for p in reversed((directory, *directory.parents)) if not p.exists()), None)  # the outermost folder this save makes
    partial = directory / ".partial"
    try:
        if partial.exists():  # what a save killed part way left
            shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        _write_model(model, tokenizer, partial, named=directory)
        for path in partial.iterdir():
            os.replace(path, directory / path.name)
        partial.rmdir()
    except BaseException:
        shutil.rmtree(partial if made is None else made, ignore_errors=True)
        raise


def _write_model(model: transformers.PreTrainedModel, tokenizer: Tokenizer, folder: Path, *, named: Path) -> None:
    """Write the model's files to `folder`; an operating-system error names the file as it
    is called in `named`, where the files go once all are written."""
    transformers.utils.logging.disable_progress_bar()  # no shard bars in a run's output
    try:
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save(folder)
    except SafetensorError as e:
        code = _OS_ERROR.search(str(e))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(named / "model.safetensors")) from e
    except OSError as e:
        if e.filename is None or Path(e.filename).parent != folder:
            raise
        raise OSError(e.errno, e.strerror, str(named / Path(e.filename).name)) from e


_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def load_model(directory: str | Path, *, attention: str = "sdpa") -> tuple[transformers.PreTrainedModel, CharTokenizer]:
    """A saved model and tokenizer; `attention` as in `build_tiny_qwen2` (a checkpoint
    does not record it)."""
    transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bar in a resumed run's output
    model = transformers.Qwen2ForCausalLM.from_pretrained(directory, attn_implementation=attention)
    return model, CharTokenizer.load(directory)
