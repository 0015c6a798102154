"""Test-session settings shared by every folder.

Hardware markers: `gpu` tests run only where CUDA is usable, `npu` tests only where
torch_npu is installed; elsewhere they are skipped with the reason. CPU is the default.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from tidal.hal import cuda, npu

    have = {"gpu": cuda.available(), "npu": npu.installed()}
    for item in items:
        for marker, ok in have.items():
            if item.get_closest_marker(marker) and not ok:
                item.add_marker(pytest.mark.skip(reason=f"needs a real {marker.upper()}"))


@pytest.fixture(autouse=True)
def _fresh_platform(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test selects its platform from a clean slate."""
    from tidal.hal import reset_platform

    monkeypatch.delenv("TIDAL_DEVICE", raising=False)
    reset_platform()
    yield
    reset_platform()


def with_env(env: dict[str, str] | None) -> dict[str, str]:
    """This process's environment (less `TIDAL_DEVICE`) with `env` over it, `PYTHONPATH`
    entries put before the inherited ones."""
    full_env = {k: v for k, v in os.environ.items() if k != "TIDAL_DEVICE"}
    for key, value in (env or {}).items():
        inherited = full_env.get(key) if key == "PYTHONPATH" else None
        full_env[key] = f"{value}{os.pathsep}{inherited}" if value and inherited else value
    return full_env


def run_tidal(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the real `tidal` command (the console script beside this interpreter). A
    `PYTHONPATH` in `env` goes before the one this process has, not in its place: where the
    package is on the interpreter's path that way (a GPU machine's bundle), replacing it lost
    tidal itself (issue 40)."""
    full_env = with_env(env)
    exe = Path(sys.executable).with_name("tidal")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "tidal.tools.cli"]
    return subprocess.run([*cmd, *args], env=full_env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


@pytest.fixture
def wait_for():
    """`wait_for(condition, timeout=5.0)`: poll `condition` until true (for effects that travel asynchronously); fail at the timeout."""
    return _wait_for


@pytest.fixture
def tidal_cli():
    return run_tidal


@pytest.fixture
def child_env():
    """`with_env(env)`: the environment `tidal_cli` gives a child process."""
    return with_env


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """One local Ray for the whole test session (it costs ~4 s and ~370 MB to start)."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


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
    import torch  # noqa: PLC0415

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
