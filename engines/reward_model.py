"""A reward model: a Hugging Face sequence-classification checkpoint that scores a prompt
and its response with one number (the Bradley-Terry reward models of RLHF, as OpenRLHF's
`--reward_pretrain`, TRL's `reward_funcs` given a model and verl's `reward_model` load them).

The reward model reads the conversation in its own format, never the policy's tokens: the
policy and the reward model often have different tokenizers and templates. Each sample is
rendered as `messages + [{"role": "assistant", "content": response}]` with the reward
model's chat template (`messages`: the prompt's conversation, which the data loader keeps in
each item it renders with a template; otherwise the prompt text as the one user turn), or,
for a reward model without a chat template, as the prompt text followed by the response.
An input longer than `max_length` tokens loses its beginning: the score is read at its last
token, so the response's end is kept.

The score is the model's one logit at the last token that is not padding, as
transformers' `*ForSequenceClassification` forward computes it (the padding token is the
tokenizer's, or its end token when it has none).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch


def conversation(meta: Mapping[str, Any]) -> list[dict[str, str]]:
    """The prompt's messages from a trajectory's `meta`: its `messages`, else its `prompt`
    text as the one user turn."""
    messages = meta.get("messages")
    if messages:
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]
    return [{"role": "user", "content": str(meta.get("prompt", ""))}]


def not_a_reward_model(folder: Path) -> str | None:
    """Why the checkpoint directory `folder` is no reward model, from its config.json alone
    (cheap: `tidal run` asks before any work); None when it looks like one. Given another
    model, transformers would load it with a score head of random weights."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        return f"no readable config.json ({type(e).__name__}: {e})"
    architectures = config.get("architectures") or []
    if not any(str(name).endswith("ForSequenceClassification") for name in architectures):
        return f"its config.json's architectures are {architectures}: not a sequence-classification model (a reward model is a *ForSequenceClassification with one label)"
    labels = len(config["id2label"]) if config.get("id2label") else config.get("num_labels", 2)  # transformers' default: 2
    if labels != 1:
        return f"the model has {labels} labels; a reward model has one (its score)"
    return None


def refusal(path: str | Path) -> str | None:
    """Why `reward_model.path=path` cannot be loaded as a reward model, naming the key (no
    folder, or `not_a_reward_model`); None when it can. What `tidal run` checks before any
    work and `RewardModel` before it loads."""
    where = f"reward_model.path={str(path)!r}"
    if not Path(path).is_dir():
        return f"{where} does not exist or is not a folder"
    why = not_a_reward_model(Path(path))
    return None if why is None else f"{where}: {why}"


class RewardModel:
    """A sequence-classification reward model on one device, scoring in batches.

    Args:
        path: local checkpoint directory (config.json with a `*ForSequenceClassification`
            architecture and one label, the weights, the tokenizer files).
        device: where the model runs (the trainer's device in a run).
        dtype: the weights' dtype as loaded ("auto": the checkpoint's).
        batch_size: samples per forward pass.
        max_length: longest input in tokens; a longer one loses its beginning.
        trust_remote_code: let transformers run code shipped with the checkpoint.

    Raises:
        ValueError: naming `reward_model.path` when it is not a folder, is not a
            sequence-classification checkpoint, or has other than one label.
    """

    def __init__(self, path: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype | str = torch.float32, batch_size: int = 8, max_length: int = 2048, trust_remote_code: bool = False) -> None:
        import transformers  # noqa: PLC0415

        if (why := refusal(path)) is not None:
            raise ValueError(why)
        folder, where = Path(path), f"reward_model.path={str(path)!r}"
        transformers.utils.logging.disable_progress_bar()
        try:
            self.tokenizer = transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
            model = transformers.AutoModelForSequenceClassification.from_pretrained(folder, dtype=dtype, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, KeyError) as e:
            raise ValueError(f"{where}: cannot load the model and its tokenizer ({type(e).__name__}: {e})") from None
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        if pad_id is None:
            raise ValueError(f"{where}: its tokenizer has neither a padding nor an end token to pad a batch with")
        self.tokenizer.pad_token_id = pad_id
        self.tokenizer.padding_side, self.tokenizer.truncation_side = "right", "left"
        model.config.pad_token_id = pad_id  # where the forward finds each row's last token
        self.model = model.eval().to(device)
        self.device, self.batch_size, self.max_length = torch.device(device), batch_size, max_length
        self.templated = bool(self.tokenizer.chat_template)

    def text(self, messages: Sequence[Mapping[str, str]], response: str) -> str:
        """What the reward model reads for `response` to the conversation `messages`."""
        if self.templated:
            return str(self.tokenizer.apply_chat_template([*(dict(m) for m in messages), {"role": "assistant", "content": response}], tokenize=False))
        return "".join(str(m["content"]) for m in messages) + response

    @torch.no_grad()
    def score(self, conversations: Sequence[Sequence[Mapping[str, str]]], responses: Sequence[str]) -> list[float]:
        """The reward model's score of each response to its conversation."""
        texts = [self.text(messages, response) for messages, response in zip(conversations, responses, strict=True)]
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            encoded = self.tokenizer(
                texts[start : start + self.batch_size], padding=True, truncation=True, max_length=self.max_length,
                add_special_tokens=not self.templated, return_tensors="pt",
            )  # fmt: skip
            logits = self.model(input_ids=encoded["input_ids"].to(self.device), attention_mask=encoded["attention_mask"].to(self.device)).logits
            scores.extend(logits[:, 0].float().cpu().tolist())
        return scores
