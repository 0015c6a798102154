"""Prompt datasets from local files: JSON lines, JSON and parquet, read with `datasets`.

A data source turns the rows of a few local files (GSM8K's `{"question": ..., "answer":
"... #### 42"}`, say) into the items the workflow puts in the store:

    {"prompt": str, "prompt_ids": list[int], "messages": [...], "answer": ..., "meta": {"file": str, "row": int}}

`prompt_ids` are what the model reads (the chat template applied, or the raw text
tokenized) and `prompt` is their text (the rendered template, or the raw text); `messages`
(with the chat template, asked for with `keep_messages`) is the conversation the template
rendered, which a reward model renders in its own template; `answer` is the reference the reward checks
(`trajectory.meta["answer"]`), `meta` says where the row came from. This is the shape
`tools/train.py`'s task prompts have (`{"prompt", "answer", "prompt_ids"}`), so either
feeds the same workflow.

Files are read with `datasets.load_dataset("json" | "parquet" | "arrow", data_files=...)`
(pyarrow underneath; the Arrow copy it makes goes to `cache_dir`, by default datasets' own
cache); a folder that `Dataset.save_to_disk` wrote is read with `datasets.load_from_disk`
(memory-mapped, no copy).
Each file is read on its own so that every mistake in one names it: a missing file, an
unsupported suffix, a missing column (with the columns it has), no rows, a prompt that
is not text (its row, counted from 0, and its type). These raise `DataError`, a
ValueError. Prompts longer than `max_prompt_tokens` are dropped when the files are read
and counted (`PromptSet.num_dropped`, logged once).

`PromptStream` walks a `PromptSet` epoch by epoch, each epoch in an order drawn from
`(seed, epoch)`; its `state_dict()` is one position, and a stream loaded from it yields
exactly the item that would have come next.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import logging
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tidal.engines.tokenizers import Tokenizer

log = logging.getLogger(__name__)

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
"""File suffix -> the `datasets` builder that reads it (JSON: one object per line, or a list
of objects; Arrow: a file `Dataset.save_to_disk` wrote)."""

SAVED_DATASET = ("state.json", "dataset_info.json")
"""The files that mark a folder `datasets.Dataset.save_to_disk` wrote (read whole with `load_from_disk`)."""


class DataError(ValueError):
    """A data file or data setting that cannot give prompts; the message names the file,
    the column and the row (counted from 0) where they are known."""


@dataclasses.dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where the prompts come from and how they become the model's input."""

    train_files: list[str] = dataclasses.field(default_factory=list)
    """Local files of training prompts (.jsonl, .json, .parquet or .arrow; glob patterns such
    as `data/train-*.parquet` are expanded), or folders `datasets.Dataset.save_to_disk` wrote
    (one split's), read in this order. Relative paths are taken from
    where tidal run starts (a leading ~ is the home folder) and stored absolute in config.yaml."""
    eval_files: list[str] = dataclasses.field(default_factory=list)
    """Local files of held-out prompts, for evaluation (same formats and paths); none: no evaluation set."""
    prompt_key: str = "question"
    """Column holding the prompt: its text (GSM8K's name), or a conversation, a list of
    {role, content} messages (verl's `prompt` column) rendered with the chat template. A
    dotted name reads a field of a struct column."""
    answer_key: str | None = "answer"
    """Column holding the reference answer the reward checks (`meta["answer"]`); a dotted
    name reads a field of a struct column (verl's `reward_model.ground_truth`); null: the
    rows have none."""
    system_prompt: str | None = None
    """System message put before each prompt (needs `chat_template`)."""
    chat_template: bool = True
    """Render each prompt as a user turn with the tokenizer's chat template, ending with the
    assistant's header (add_generation_prompt=True); false: the model reads the raw prompt text."""
    chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Variables the chat template reads besides the messages, as `apply_chat_template`'s
    keyword arguments (verl's `apply_chat_template_kwargs`, TRL's `chat_template_kwargs`):
    `{enable_thinking: false}` turns Qwen3's thinking off. Needs `chat_template`."""
    max_prompt_tokens: int = 1024
    """Longest prompt kept, in tokens (template included); longer ones are dropped and counted when the files are read."""
    shuffle: bool = True
    """Visit the training prompts in a new order each epoch, drawn from `seed` and the epoch."""
    seed: int = 0
    """Seed of the shuffled order."""
    num_epochs: int | None = None
    """Passes over the training prompts; null: as many as the run takes."""


TEMPLATE_ARGUMENTS = frozenset({"conversation", "tokenize", "add_generation_prompt", "continue_final_message", "return_tensors", "return_dict"})
"""`apply_chat_template` arguments that tidal sets itself: not `chat_template_kwargs`."""


def check_config(config: DataConfig) -> None:
    """Raise DataError, naming the key, for settings no file could satisfy."""
    if not config.prompt_key:
        raise DataError("data.prompt_key must name a column")
    if config.answer_key == config.prompt_key:
        raise DataError(f"data.answer_key and data.prompt_key are both {config.prompt_key!r}: the answer would be the prompt")
    if config.max_prompt_tokens < 1:
        raise DataError(f"data.max_prompt_tokens must be >= 1, got {config.max_prompt_tokens}")
    if config.num_epochs is not None and config.num_epochs < 1:
        raise DataError(f"data.num_epochs must be >= 1 or null (no limit), got {config.num_epochs}")
    if config.system_prompt is not None and not config.chat_template:
        raise DataError("data.system_prompt needs data.chat_template=true: without a template there is no system turn to put it in")
    if config.chat_template_kwargs and not config.chat_template:
        raise DataError("data.chat_template_kwargs needs data.chat_template=true: without a template nothing reads them")
    if taken := sorted(set(config.chat_template_kwargs) & TEMPLATE_ARGUMENTS):
        raise DataError(f"data.chat_template_kwargs: {', '.join(taken)} {'is' if len(taken) == 1 else 'are'} set by tidal itself (the prompt ends with the generation prompt, rendered to text)")


def expand_files(patterns: Sequence[str], *, key: str) -> list[Path]:
    """The files `patterns` name, in order; each glob pattern expanded (sorted).

    Raises:
        DataError: naming `key` and the entry: none given, a pattern that matches nothing,
            a path that does not exist or is a folder, or a suffix other than `FORMATS`'.
    """
    if isinstance(patterns, str):
        patterns = [patterns]
    if not patterns:
        raise DataError(f"{key} lists no file")
    paths: list[Path] = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(glob.glob(pattern))
            if not matches:
                raise DataError(f"{key}: {pattern!r} matches no file")
            paths.extend(Path(m) for m in matches)
        else:
            paths.append(Path(pattern))
    for path in paths:
        if not path.exists():
            raise DataError(f"{key}: {str(path)!r} does not exist")
        if path.is_dir():
            _check_saved_dataset(path, key=key)
        elif path.suffix.lower() not in FORMATS:
            raise DataError(f"{key}: {str(path)!r} has suffix {path.suffix!r}; readable: {', '.join(FORMATS)}, or a folder Dataset.save_to_disk wrote")
    return paths


def _check_saved_dataset(path: Path, *, key: str) -> None:
    """`path`, a folder, is one `Dataset.save_to_disk` wrote (a split, not a DatasetDict).

    Raises:
        DataError: naming `key` and the folder: a DatasetDict's (with its splits' folders),
            or any other folder (with a pattern for its files).
    """
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if all((p / name).is_file() for name in SAVED_DATASET))
        shown = ", ".join(repr(str(path / s)) for s in splits) or "none found"
        raise DataError(f"{key}: {str(path)!r} holds a DatasetDict (several splits); name one split's folder: {shown}")
    if not all((path / name).is_file() for name in SAVED_DATASET):
        raise DataError(
            f"{key}: {str(path)!r} is a folder, and not one Dataset.save_to_disk wrote (no {' and '.join(SAVED_DATASET)}): "
            f"list its files, or give a pattern such as {str(path / '*.parquet')!r}"
        )


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """No progress bars and no error log lines from `datasets` while a file is read: a run's
    output stays its own, and a file it cannot parse is reported once, by `DataError`."""
    import datasets  # noqa: PLC0415 - only data sources need it

    was_enabled, verbosity = datasets.is_progress_bar_enabled(), datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if was_enabled:
            datasets.enable_progress_bars()


def _num_parquet_rows(path: Path) -> int:
    """Rows a parquet file's footer declares (datasets fails on a file of none with an
    unhelpful "BatchSize must be greater than 0")."""
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot be read as parquet: {type(e).__name__}: {e}") from e


def read_table(path: Path, *, columns: Mapping[str, str], cache_dir: str | None = None) -> Any:
    """The rows of one file as a `datasets.Dataset` with only `columns` (column name -> the
    setting that names it, for errors).

    Raises:
        DataError: naming the file: it cannot be parsed (with the parser's reason, which
            names the row for JSON), has no rows, or lacks one of `columns` (naming its
            setting and listing the columns it has).
    """
    import datasets  # noqa: PLC0415

    if path.is_dir():
        builder = "a saved dataset"
    elif path.stat().st_size == 0:
        raise DataError(f"{path}: the file is empty")
    else:
        builder = FORMATS[path.suffix.lower()]
    if builder == "parquet" and _num_parquet_rows(path) == 0:
        raise DataError(f"{path}: no rows")
    try:
        with _quiet_datasets():
            if path.is_dir():
                table = datasets.load_from_disk(str(path))
            else:
                table = datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache_dir)
    except Exception as e:  # every parser failure of a user's file becomes one error naming it
        cause = e.__cause__ or e
        raise DataError(f"{path}: cannot be read as {builder}: {type(cause).__name__}: {cause}") from e
    tops = []
    for column, key in columns.items():
        top, rest = _split(column, table.column_names)
        if top not in table.column_names:
            raise DataError(f"{path}: no column {top!r} ({key}); its columns: {table.column_names}")
        feature = table.features[top]
        for depth, part in enumerate(rest):
            fields = feature if isinstance(feature, dict) else {}
            if part not in fields:
                inside = ".".join([top, *rest[:depth]])
                raise DataError(f"{path}: no field {part!r} in column {inside!r} ({key}={column!r}); its fields: {sorted(fields) or 'none (not a struct)'}")
            feature = fields[part]
        tops.append(top)
    if table.num_rows == 0:
        raise DataError(f"{path}: no rows")
    return table.select_columns(list(dict.fromkeys(tops)))


def _split(key: str, names: Sequence[str]) -> tuple[str, list[str]]:
    """The column `key` names and the fields inside it: a column of that very name, else
    `top.field...` (a dotted key into a struct column)."""
    if key in names or "." not in key:
        return key, []
    top, *rest = key.split(".")
    return top, rest


def field(record: Mapping[str, Any], key: str) -> Any:
    """The value `key` names in one row (`read_table`'s): a column, or a field of a struct
    column for a dotted key."""
    top, rest = _split(key, list(record))
    value = record[top]
    for part in rest:
        value = value[part]
    return value


def _column(table: Any, key: str) -> list[Any]:
    """Every row's value of `key` (a column, or a dotted field of a struct column)."""
    top, rest = _split(key, table.column_names)
    values = table[top]
    for part in rest:
        values = [None if v is None else v[part] for v in values]
    return list(values)


def messages_of(prompt: str | Sequence[Mapping[str, str]], *, system_prompt: str | None) -> list[dict[str, str]]:
    """The conversation a prompt becomes under a chat template: an optional system turn, then
    the user's text (a text prompt) or the prompt's own messages (a conversation)."""
    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [{"role": m["role"], "content": m["content"]} for m in prompt]
    return ([{"role": "system", "content": system_prompt}] if system_prompt is not None else []) + turns


def _why_not_a_prompt(prompt: Any, config: DataConfig) -> str | None:
    """What is wrong with one row's prompt (None: it is text, or a conversation the settings
    can render)."""
    if isinstance(prompt, str):
        return None if prompt.strip() else "the prompt is empty"
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return f"the prompt is {type(prompt).__name__} {_short(prompt)}, not text nor a conversation (a list of {{role, content}} messages)"
    for k, message in enumerate(prompt):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            return f"message {k} of the conversation is {_short(message)}, not {{role: text, content: text}}"
    if not config.chat_template:
        return "the prompt is a conversation, which only a chat template renders: set data.chat_template=true"
    if config.system_prompt is not None and prompt[0]["role"] == "system":
        return "the conversation has a system turn of its own, and data.system_prompt is set too: unset data.system_prompt"
    return None


class PromptSet:
    """The usable prompts of some files, in file order; `len`, indexing and iteration give items.

    Built by `load_prompts`. Items are tokenized when asked for (not kept), so a large
    dataset costs little memory: two integers per prompt.
    """

    def __init__(self, *, tables: list[Any], files: list[Path], file_index: np.ndarray, rows: np.ndarray, config: DataConfig, tokenizer: Tokenizer, num_dropped: int, keep_messages: bool = False) -> None:
        self._tables, self.files, self._file_index, self._rows = tables, files, file_index, rows
        self.config, self.tokenizer = config, tokenizer
        self.keep_messages = keep_messages and config.chat_template
        """Items carry the conversation the template rendered (`messages`): for a reader with a
        template of its own, a reward model. Off, every sample row is lighter by it."""
        self.num_dropped = num_dropped
        """Prompts left out for being longer than `config.max_prompt_tokens`."""

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, k: int) -> dict[str, Any]:
        f, row = int(self._file_index[k]), int(self._rows[k])
        record = self._tables[f][row]
        prompt = field(record, self.config.prompt_key)
        ids = encode_prompt(prompt, self.tokenizer, self.config)
        # the text that encodes to `ids`, as task prompts have it: the rendered template, or the raw prompt
        item: dict[str, Any] = {"prompt": self.tokenizer.decode(ids, skip_special=False) if self.config.chat_template else prompt, "prompt_ids": ids}
        if self.keep_messages:
            item["messages"] = messages_of(prompt, system_prompt=self.config.system_prompt)
        if self.config.answer_key is not None:
            item["answer"] = field(record, self.config.answer_key)
        item["meta"] = {"file": str(self.files[f]), "row": row}
        return item

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[k] for k in range(len(self)))


def encode_prompt(prompt: str | Sequence[Mapping[str, str]], tokenizer: Tokenizer, config: DataConfig) -> list[int]:
    """The model's input for `prompt` (text, or a conversation): the chat template applied,
    or the raw text tokenized."""
    if config.chat_template:
        return tokenizer.apply_chat_template(messages_of(prompt, system_prompt=config.system_prompt), template_kwargs=config.chat_template_kwargs)
    assert isinstance(prompt, str), "a conversation needs the chat template (`_why_not_a_prompt`)"
    return tokenizer.encode(prompt)


PROGRESS_EVERY = 2048
"""Rows between two `on_progress` calls of `load_prompts`."""


def load_prompts(
    files: Sequence[str], tokenizer: Tokenizer, *, config: DataConfig, key: str = "data.train_files", cache_dir: str | None = None, on_progress: Callable[[int, int], None] | None = None,
    keep_messages: bool = False,
) -> PromptSet:
    """Read `files` and keep the prompts that fit `config.max_prompt_tokens`.

    Args:
        files: paths or glob patterns (`config.train_files` or `config.eval_files`).
        tokenizer: renders and tokenizes prompts (its chat template when `config.chat_template`).
        config: the data settings.
        key: the setting `files` came from, named in errors.
        cache_dir: where `datasets` keeps its Arrow copy of the files (None: its default).
        on_progress: called with (rows checked, rows in all files) once the files are read,
            every `PROGRESS_EVERY` rows while each prompt is rendered and tokenized to measure
            it (the long part: about 0.1-0.2 ms a prompt), and at the end.
        keep_messages: items carry `messages` too (with the chat template; `PromptSet`).

    Raises:
        DataError: a bad setting or file (see `check_config`, `expand_files`, `read_table`),
            a prompt that is not text or is empty, a null answer (each naming file, column
            and row), or no prompt that fits `max_prompt_tokens`.
    """
    check_config(config)
    paths = expand_files(files, key=key)
    columns = {config.prompt_key: "data.prompt_key", **({config.answer_key: "data.answer_key"} if config.answer_key is not None else {})}
    tables = [read_table(path, columns=columns, cache_dir=cache_dir) for path in paths]
    total, done = sum(len(table) for table in tables), 0
    file_index, rows = [], []
    num_dropped = longest = 0
    if on_progress is not None:
        on_progress(0, total)
    for f, (path, table) in enumerate(zip(paths, tables)):
        if config.answer_key is not None:
            for row, answer in enumerate(_column(table, config.answer_key)):
                if answer is None:
                    raise DataError(f"{path}: row {row}, column {config.answer_key!r}: the answer is null")
        for row, prompt in enumerate(_column(table, config.prompt_key)):
            if why := _why_not_a_prompt(prompt, config):
                raise DataError(f"{path}: row {row}, column {config.prompt_key!r}: {why}")
            length = len(encode_prompt(prompt, tokenizer, config))
            done += 1
            if on_progress is not None and done % PROGRESS_EVERY == 0:
                on_progress(done, total)
            if length > config.max_prompt_tokens:
                num_dropped += 1
                longest = max(longest, length)
                continue
            file_index.append(f)
            rows.append(row)
    if on_progress is not None:
        on_progress(total, total)
    if not rows:
        raise DataError(f"{key}: none of the {num_dropped} prompts fits data.max_prompt_tokens={config.max_prompt_tokens} (the longest has {longest} tokens)")
    if num_dropped:
        log.warning("%s: dropped %d of %d prompts longer than data.max_prompt_tokens=%d tokens (the longest: %d)", key, num_dropped, num_dropped + len(rows), config.max_prompt_tokens, longest)
    return PromptSet(
        tables=tables, files=paths, file_index=np.asarray(file_index, dtype=np.int32), rows=np.asarray(rows, dtype=np.int64),
        config=config, tokenizer=tokenizer, num_dropped=num_dropped, keep_messages=keep_messages,
    )


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class PromptStream:
    """The items of a `PromptSet`, epoch after epoch; `position` (items handed out) resumes it.

    Epoch e visits every prompt once, in an order drawn from `(seed, e)` when `shuffle`
    (file order otherwise), so a run's order depends on its seed alone. The stream ends
    after `num_epochs` epochs (None: never).
    """

    def __init__(self, prompts: PromptSet, *, seed: int = 0, shuffle: bool = True, num_epochs: int | None = None, position: int = 0) -> None:
        if num_epochs is not None and num_epochs < 1:
            raise DataError(f"data.num_epochs must be >= 1 or null (no limit), got {num_epochs}")
        self.prompts, self.seed, self.shuffle, self.num_epochs = prompts, seed, shuffle, num_epochs
        self.position = position
        """Items handed out so far (over all epochs): the next item is number `position`."""
        self._order: tuple[int, np.ndarray] | None = None

    @classmethod
    def from_config(cls, prompts: PromptSet, config: DataConfig) -> PromptStream:
        """The training stream `config` describes (its seed, shuffle and epochs)."""
        return cls(prompts, seed=config.seed, shuffle=config.shuffle, num_epochs=config.num_epochs)

    @property
    def epoch(self) -> int:
        """The epoch the next item belongs to (from 0)."""
        return self.position // len(self.prompts)

    def order(self, epoch: int) -> np.ndarray:
        """Indexes into the prompt set, in the order epoch `epoch` visits them."""
        if self._order is None or self._order[0] != epoch:
            order = list(range(len(self.prompts)))
            if self.shuffle:
                # a string seed is hashed (sha512) by `random`: stable across runs and Python versions
                random.Random(f"tidal-data:{self.seed}:{epoch}").shuffle(order)
            self._order = (epoch, np.asarray(order, dtype=np.int64))
        return self._order[1]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        n = len(self.prompts)
        while self.num_epochs is None or self.position < self.num_epochs * n:
            epoch, k = divmod(self.position, n)
            item = self.prompts[int(self.order(epoch)[k])]
            self.position += 1  # before the yield: a state saved while the consumer holds the item resumes after it
            yield item

    def state_dict(self) -> dict[str, Any]:
        """Where the stream is, and what makes a position mean the same item."""
        return {"position": self.position, "num_prompts": len(self.prompts), "seed": self.seed, "shuffle": self.shuffle}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from `state` (a `state_dict()`): the next item is the one that would have followed.

        Raises:
            DataError: the state was taken over another number of prompts, another seed or
                another shuffle setting (the files or settings changed): its position
                would name other items.
        """
        mine = self.state_dict()
        for name in ("num_prompts", "seed", "shuffle"):
            if state.get(name) != mine[name]:
                raise DataError(
                    f"the saved data position was taken with {name}={state.get(name)!r}, these prompts have {name}={mine[name]!r}: "
                    "the data files or data settings changed since, and the position would not continue the same order"
                )
        position = state["position"]
        if not isinstance(position, int) or position < 0:
            raise DataError(f"the saved data position must be an integer >= 0, got {position!r}")
        self.position = position
