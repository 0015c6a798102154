"""The tokenizer protocol every model source supplies, and its Hugging Face adapter.

Engines, data sources and rewards see a tokenizer only through `Tokenizer`: text to ids,
ids to text, the chat template, and the special ids generation and batching need. A
model source hands one out with its module and weights (DESIGN.md, "models, tokenizers,
data"). `HFTokenizer` wraps a transformers tokenizer loaded from a local checkpoint
directory; the character tokenizer of the tiny model (`tidal.engines.tiny.CharTokenizer`)
is the other implementation.

The protocol is `runtime_checkable`, so `isinstance(tokenizer, Tokenizer)` says whether
an object has every member (not whether their signatures agree).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """What tidal needs of a tokenizer.

    Stop tokens are a list (`eos_ids`): instruct models end a turn with one token
    (`<|im_end|>`, `<|eot_id|>`) and a document with another, and their generation
    configs list both. `pad_id` fills batches; it is never trained on, so it may be one
    of the end ids.
    """

    @property
    def eos_ids(self) -> list[int]:
        """Token ids that end a response, in order of preference (the first is the one a
        supervised answer is closed with); never empty."""
        ...

    pad_id: int
    """Token id that pads batches."""

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (every id is below it). A model's
        embedding table may be larger (Qwen pads it to a multiple of 128)."""
        ...

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        """The ids of `text`, with the special tokens the model expects around plain text
        (a BOS for models that use one) unless `add_bos` is False (a continuation, such
        as a supervised answer after its prompt)."""
        ...

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """The text of `ids`; special tokens left out unless `skip_special` is False."""
        ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *, template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """The ids of a conversation (`[{"role": ..., "content": ...}, ...]`) rendered with
        the model's chat template, ending with the header of the assistant's turn (the
        generation prompt), ready for the model to answer. `template_kwargs`: variables the
        template reads besides the messages (Qwen3's `enable_thinking`, say).

        Raises:
            ValueError: the tokenizer has no chat template.
        """
        ...

    def save(self, directory: str | Path) -> None:
        """Write the tokenizer's files into `directory` (a checkpoint's, an export's), from
        which its source loads it back."""
        ...


class HFTokenizer:
    """A transformers tokenizer behind `Tokenizer`.

    Args:
        tokenizer: a `transformers.PreTrainedTokenizerBase`.
        extra_eos_ids: end ids besides the tokenizer's own (`from_pretrained` passes the
            checkpoint's `generation_config.json` ones).

    Raises:
        ValueError: the tokenizer has no end token and no `extra_eos_ids` were given.
    """

    def __init__(self, tokenizer: Any, *, extra_eos_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.eos_ids: list[int] = list(dict.fromkeys([*eos, *(int(i) for i in extra_eos_ids)]))
        if not self.eos_ids:
            raise ValueError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r} has no end token (eos_token) "
                "and its generation_config.json lists no eos_token_id: a response could never end"
            )
        self.pad_id: int = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str], *, trust_remote_code: bool = False) -> HFTokenizer:
        """The tokenizer of a local checkpoint directory (`AutoTokenizer.from_pretrained`),
        with the end ids of the tokenizer and of the directory's `generation_config.json`.

        `trust_remote_code`: the checkpoint's model (or tokenizer) is code of its own
        (`model.trust_remote_code`). AutoTokenizer reads the model's config too; left
        unsaid, transformers would stop to ask on the terminal for such a checkpoint.

        Raises:
            ValueError: `directory` is not a folder, or transformers cannot load a
                tokenizer from it (the message says which and why).
        """
        import transformers  # noqa: PLC0415 - loaded by the model sources that need it

        path = Path(directory)
        if not path.is_dir():
            raise ValueError(f"tokenizer directory {str(path)!r} does not exist or is not a folder")
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"cannot load a tokenizer from {str(path)!r}: {type(e).__name__}: {e}") from e
        extra: list[int] = []
        if (path / "generation_config.json").is_file():
            eos = transformers.GenerationConfig.from_pretrained(path).eos_token_id
            extra = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return cls(tokenizer, extra_eos_ids=extra)

    @property
    def vocab_size(self) -> int:
        """Ids of the base vocabulary and the added tokens (`len(tokenizer)`)."""
        return len(self.tokenizer)

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_bos))

    def save(self, directory: str | os.PathLike[str]) -> None:
        """The tokenizer's files (`save_pretrained`), which `from_pretrained` loads back; the
        end ids of a generation config travel with the model's own `generation_config.json`."""
        self.tokenizer.save_pretrained(directory)

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        # no clean-up of spaces: decoding must give back the text a byte-level BPE encoded
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special, clean_up_tokenization_spaces=False)

    def render_chat(self, messages: Sequence[Mapping[str, str]], *, template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The text of `apply_chat_template`'s ids (the template rendered, not tokenized)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"tokenizer {self.tokenizer.name_or_path!r} has no chat template (no chat_template in its tokenizer_config.json "
                "and no chat_template.jinja): give one, or feed the raw prompt text (data.chat_template=false)"
            )
        return self.tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False, add_generation_prompt=True, **dict(template_kwargs or {}))

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *, template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        # rendered, then tokenized without added specials: the template writes them itself
        # (a BOS in the text), so adding them again would double them
        return list(self.tokenizer.encode(self.render_chat(messages, template_kwargs=template_kwargs), add_special_tokens=False))
