"""A small Hugging Face checkpoint and GSM8K-format data files, built locally.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on synthetic text, the
model a tiny Qwen2 with random weights, saved as `save_pretrained` saves one. The tests'
`tiny_hf_dir` / `gsm8k_files` fixtures and `tidal bench e2e --workload longtail` build
theirs with these functions, so both load the same kind of directory with the Auto classes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_NAMES = ("Tom", "Ava", "Liam", "Mia", "Noah", "Emma")
_ITEMS = ("apples", "books", "marbles", "stickers", "coins")


def gsm8k_rows(num_rows: int, *, seed: int) -> list[dict[str, str]]:
    """GSM8K-format rows: `{"question": "...", "answer": "... #### 42"}`. Every fifth
    question has a long preamble (for tests that drop long prompts); answers over 999 are
    written with a thousands comma, as GSM8K's are."""
    import random  # noqa: PLC0415

    rng = random.Random(seed)
    rows = []
    for k in range(num_rows):
        name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
        a, b, c = rng.randint(2, 900), rng.randint(2, 300), rng.randint(2, 9)
        total = (a + b) * c
        preamble = f"{name} keeps a notebook of everything {name} owns and counts it every single morning before school. " if k % 5 == 4 else ""
        question = f"{preamble}{name} has {a} {item} and buys {b} more. Then {name} gets {c} times as many. How many {item} does {name} have now?"
        answer = f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item}.\n{c} times that is {a + b} * {c} = <<{a + b}*{c}={total}>>{total}.\n#### {total:,}"
        rows.append({"question": question, "answer": answer})
    return rows


def _tokenizer(directory: Path, *, vocab_size: int, seed: int) -> Any:
    """A byte-level BPE trained on synthetic GSM8K text, with the Qwen chat template, saved in `directory`."""
    import transformers  # noqa: PLC0415
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    corpus = [f"{r['question']}\n{r['answer']}" for r in gsm8k_rows(200, seed=seed)]
    corpus += ["system\nuser\nassistant\nYou are a helpful assistant. Put the final answer in \\boxed{} or after ####."]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(corpus, trainer=trainer)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False, model_max_length=4096,
    )
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return tokenizer


def _qwen2_config(tokenizer: Any, *, hidden_size: int, **extra: Any) -> Any:
    import transformers  # noqa: PLC0415

    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    return transformers.Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=im_end, pad_token_id=endoftext, **extra,
    )


def build_tiny_hf_checkpoint(directory: Path, *, vocab_size: int = 320, hidden_size: int = 32, seed: int = 0) -> Path:
    """A Qwen2 checkpoint folder as `save_pretrained` writes one: a byte-level BPE tokenizer
    (trained on synthetic GSM8K text; `<|endoftext|>` pads, `<|im_end|>` ends a turn) with a
    Qwen chat template, a 2-layer `Qwen2ForCausalLM` in safetensors, and a
    generation_config.json that lists both end tokens (`<|im_end|>` first), as instruct
    models' do."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    tokenizer = _tokenizer(directory, vocab_size=vocab_size, seed=seed)
    config = _qwen2_config(tokenizer, hidden_size=hidden_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(config)
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(directory, safe_serialization=True)
    transformers.GenerationConfig(eos_token_id=[config.eos_token_id, config.pad_token_id], pad_token_id=config.pad_token_id, bos_token_id=None).save_pretrained(directory)
    return directory


def build_tiny_reward_model(directory: Path, *, vocab_size: int = 300, hidden_size: int = 32, seed: int = 1, chat_template: bool = True, last_token_only: bool = False) -> Path:
    """A reward model folder as `save_pretrained` writes one: a 2-layer
    `Qwen2ForSequenceClassification` with one label and random weights, and a tokenizer of
    its own (another vocabulary than `build_tiny_hf_checkpoint`'s), with the Qwen chat
    template unless `chat_template` is false. `last_token_only`: the attention and MLP
    outputs are zero, so the score is a function of the last token alone (and the score
    head's weights are drawn large): a reward a tiny policy learns in a few steps."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    tokenizer = _tokenizer(directory, vocab_size=vocab_size, seed=seed)
    if not chat_template:
        tokenizer.chat_template = None
        (directory / "chat_template.jinja").unlink(missing_ok=True)
        tokenizer.save_pretrained(directory)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2ForSequenceClassification(_qwen2_config(tokenizer, hidden_size=hidden_size, num_labels=1))
        if last_token_only:
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.self_attn.o_proj.weight.zero_()
                    layer.mlp.down_proj.weight.zero_()
                model.score.weight.normal_(0.0, 1.0)
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def write_gsm8k_files(directory: Path, *, num_train: int = 40, num_eval: int = 10) -> dict[str, Path]:
    """Train and eval rows (`gsm8k_rows`) as JSON lines and as parquet (written with pyarrow):
    keys train_jsonl, train_parquet, eval_jsonl, eval_parquet. The two train files hold
    different rows (seeds 1 and 2), as do the eval files (3 and 4)."""
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, n, seeds in (("train", num_train, (1, 2)), ("eval", num_eval, (3, 4))):
        jsonl, parquet = directory / f"{split}.jsonl", directory / f"{split}.parquet"
        jsonl.write_text("".join(json.dumps(row) + "\n" for row in gsm8k_rows(n, seed=seeds[0])))
        pq.write_table(pa.Table.from_pylist(gsm8k_rows(n, seed=seeds[1])), parquet)
        paths[f"{split}_jsonl"], paths[f"{split}_parquet"] = jsonl, parquet
    return paths


LONGTAIL_VERSION = 1
"""Bumped whenever `build_longtail_workload` changes what it writes, so a cached copy is rebuilt."""


def build_longtail_workload(directory: Path, *, end_token_scale: float = 12.0, num_prompts: int = 64, seed: int = 0) -> dict[str, Path]:
    """A checkpoint and prompt file whose sampled responses have long-tailed lengths.

    The model is `build_tiny_hf_checkpoint`'s with the end token's (tied) embedding row
    multiplied by `end_token_scale`: the end token's logit is then that row dotted with the
    context's hidden state, so it swings far up or down with the prompt and the tokens
    decoded so far. Some responses end within a few tokens, others go on until the token
    budget cuts them. A synthetic long tail, not a trained model's; the math reward scores
    it 0 throughout, so the length distribution stays as built while RL runs.

    Written into `directory` (created); returns keys `model` (the checkpoint directory) and
    `train` (a GSM8K-format JSON-lines file of `num_prompts` rows). Deterministic for `seed`.
    """
    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    model = build_tiny_hf_checkpoint(directory / "model", seed=seed)
    weights_file = model / "model.safetensors"
    weights = load_file(weights_file)
    end_id = json.loads((model / "config.json").read_text())["eos_token_id"]
    weights["model.embed_tokens.weight"][end_id] *= end_token_scale
    save_file(weights, weights_file, metadata={"format": "pt"})
    train = directory / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in gsm8k_rows(num_prompts, seed=seed + 1)))
    return {"model": model, "train": train}


def longtail_workload(cache_dir: Path | None = None) -> dict[str, Path]:
    """`build_longtail_workload`'s files, built once into `cache_dir` (default
    `$XDG_CACHE_HOME/tidal/bench-longtail-v<LONGTAIL_VERSION>`, else under ~/.cache) and
    reused: built in a temporary folder beside it and renamed into place, so an interrupted
    build leaves nothing half written."""
    import os  # noqa: PLC0415
    import shutil  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    if cache_dir is None:
        cache_dir = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tidal" / f"bench-longtail-v{LONGTAIL_VERSION}"
    paths = {"model": cache_dir / "model", "train": cache_dir / "train.jsonl"}
    if (paths["model"] / "model.safetensors").is_file() and paths["train"].is_file():
        return paths
    cache_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{cache_dir.name}-", dir=cache_dir.parent))
    try:
        build_longtail_workload(staging)
        try:
            staging.rename(cache_dir)
        except OSError:  # another process built it first (or a stale partial folder): use what is there if whole
            if not (paths["model"] / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return paths
