"""Helpers shared by the engine tests of this folder that run a process group of real processes.

A worker script is written into the test's folder and run once per rank (a plain `pytest`
run cannot import `tests.*` in a child); it reads what to do from `data.pt` there
(`write_rank_data`) and writes its results beside it. The helpers are handed to tests as
session fixtures (`spawn`, `write_data`, `six_rows`): test files of this folder cannot
import each other or this file.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tidal.engines.tiny import CharTokenizer
from tidal.flow.trajectory import TokenBatch, Trajectory, to_token_batch


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (rank 0 hosts the group's store there)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(work: Path, script: str, world: int = 2, device: str | None = None) -> None:
    """Run `script` as ranks 0 .. world-1 of one group (gloo on CPU, or the `device` platform's
    backend); fail with every rank's exit code and log if one fails. The ranks run with
    faulthandler on, so a crash in native code (a SIGABRT from a C++ thread at exit, say)
    leaves each thread's Python stack in its rank's log."""
    from tidal.engines.fsdp_train import TORCHRUN_VARS  # noqa: PLC0415 - torch.distributed only for the tests that spawn

    (work / "worker.py").write_text(script)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("TIDAL_DEVICE", *TORCHRUN_VARS)}
    env.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", **({"TIDAL_DEVICE": device} if device else {}))
    logs = [work / f"rank{rank}.log" for rank in range(world)]  # files, not pipes: a full pipe would stall a rank
    procs = []
    for rank, log in enumerate(logs):
        with log.open("w") as out:
            procs.append(subprocess.Popen([sys.executable, "-X", "faulthandler", str(work / "worker.py"), str(rank), str(world), str(port), str(work)], env=env, stdout=out, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=300)
        codes = [p.returncode for p in procs]
        assert codes == [0] * world, "\n".join(f"rank {rank} exited {code}:\n{log.read_text()[-3000:]}" for rank, (code, log) in enumerate(zip(codes, logs)))
    finally:
        for p in procs:  # only the processes this helper started
            if p.poll() is None:
                p.kill()
                p.wait()


def write_rank_data(work: Path, batch: TokenBatch, advantages: torch.Tensor, **fields: Any) -> None:
    """`work/data.pt`, what the worker scripts load: the batch (its fields as a tuple, in
    `TokenBatch` order), the advantages, and `fields` (each rank's rows under "shards", the
    model's and the engine's keyword arguments, ...)."""
    torch.save({"batch": batch.tensors(), "advantages": advantages, **fields}, work / "data.pt")


def six_row_batch(tokenizer: CharTokenizer) -> tuple[TokenBatch, torch.Tensor]:
    """Six rows of different lengths; rows 2 and 3 have no policy token (no loss), rows 4
    and 5 no advantage (both engines skip all four in policy steps: in an SPMD pair whose
    rank 0 holds rows 0-3, rank 1 has no row to run)."""
    g = torch.Generator().manual_seed(0)
    trajectories = []
    for row in range(6):
        prompt = torch.randint(3, tokenizer.vocab_size, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
        tokens = torch.randint(3, tokenizer.vocab_size, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
        t = Trajectory(prompt_ids=prompt)
        if row in (2, 3):
            t.append_env(tokens)
        else:
            t.extend(tokens, (-0.5 - 3 * torch.rand(len(tokens), generator=g)).tolist(), 0)
        trajectories.append(t)
    advantages = torch.randn(6, generator=g)
    advantages[4:] = 0.0
    return to_token_batch(trajectories, pad_id=tokenizer.pad_id), advantages


@pytest.fixture(scope="session")
def spawn():
    """`spawn(work, script, world=2, device=None)`: see `spawn_ranks`."""
    return spawn_ranks


@pytest.fixture(scope="session")
def write_data():
    """`write_data(work, batch, advantages, **fields)`: see `write_rank_data`."""
    return write_rank_data


@pytest.fixture(scope="module")
def six_rows() -> tuple[TokenBatch, torch.Tensor]:
    """`six_row_batch` for the character tokenizer: (batch, advantages), one per test file."""
    return six_row_batch(CharTokenizer())


# --- a small Hugging Face checkpoint and GSM8K-format data files, built locally -----------------
# Nothing is downloaded: the tokenizer is trained here on synthetic text, the model is a tiny
# Qwen2 with random weights. Tests load both back with AutoTokenizer / AutoModelForCausalLM.

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


def build_tiny_hf_checkpoint(directory: Path, *, vocab_size: int = 320, hidden_size: int = 32, seed: int = 0) -> Path:
    """A Qwen2 checkpoint folder as `save_pretrained` writes one: a byte-level BPE tokenizer
    (trained on synthetic GSM8K text; `<|endoftext|>` pads, `<|im_end|>` ends a turn) with a
    Qwen chat template, a 2-layer `Qwen2ForCausalLM` in safetensors, and a
    generation_config.json that lists both end tokens (`<|im_end|>` first), as instruct
    models' do."""
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
        clean_up_tokenization_spaces=False, model_max_length=512,
    )
    tokenizer.chat_template = QWEN_CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    config = transformers.Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=im_end, pad_token_id=endoftext,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.Qwen2ForCausalLM(config)
    transformers.utils.logging.disable_progress_bar()
    model.save_pretrained(directory, safe_serialization=True)
    transformers.GenerationConfig(eos_token_id=[im_end, endoftext], pad_token_id=endoftext, bos_token_id=None).save_pretrained(directory)
    return directory


def write_gsm8k_files(directory: Path, *, num_train: int = 40, num_eval: int = 10) -> dict[str, Path]:
    """Train and eval rows (`gsm8k_rows`) as JSON lines and as parquet (written with pyarrow):
    keys train_jsonl, train_parquet, eval_jsonl, eval_parquet. The two train files hold
    different rows (seeds 1 and 2), as do the eval files (3 and 4)."""
    import json  # noqa: PLC0415

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


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local Qwen2 checkpoint folder (`build_tiny_hf_checkpoint`), built once per session; do not modify it."""
    return build_tiny_hf_checkpoint(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def gsm8k_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """GSM8K-format train / eval files in jsonl and parquet (`write_gsm8k_files`), written once per session."""
    return write_gsm8k_files(tmp_path_factory.mktemp("gsm8k"))
