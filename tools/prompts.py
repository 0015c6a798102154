"""Where a run's prompts come from: the recipe's generated task, or local dataset files.

`prompt_source(cfg, tokenizer)` picks one by the recipe: with `data.train_files` the files'
prompts (`tidal.engines.data`: chat template, length limit, seeded shuffle, epochs), held
out from `data.eval_files`; otherwise the task `task.name` names
(`tidal.engines.registry.TASKS`), drawn in seeded chunks, held out with another seed. Both
give the same four things (`PromptSource`): the held-out items, the training stream (an
iterable with a `position` the checkpoint records), the warm start's stream, and what else
a checkpoint must hold for the stream to resume exactly.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from tidal.engines.registry import load
from tidal.engines.tasks import Task
from tidal.engines.tokenizers import Tokenizer
from tidal.tools.config import ConfigError, RecipeConfig

EVAL_SEED_OFFSET = 1_000_003
"""The held-out set is drawn with seed `seed + EVAL_SEED_OFFSET` (`held_out_prompts`)."""
SEED_APART = 2**64
"""Added to the one training chunk seed that would be the held-out set's (`chunk_seed`)."""
WARM_START_POSITION = 10**9
"""Where a task's warm start draws from its training stream: a region RL never reaches."""


def chunk_seed(seed: int, k: int) -> int:
    """The seed of training prompt chunk `k` (prompts 512k .. 512k + 511) of run seed `seed`:
    `seed * 7919 + k`, except where that is the held-out set's seed (for each seed up to 126,
    chunk k = 1,000,003 - 7918 * seed: it would draw the held-out prompts, in order). That
    chunk takes a seed `SEED_APART` past its own: never the held-out set's, and no other
    chunk's short of chunk k + 2**64. Compared by absolute value: `random.Random`, which the
    tasks draw with, seeds with it."""
    drawn = seed * 7919 + k
    if abs(drawn) == abs(seed + EVAL_SEED_OFFSET):
        return abs(drawn) + SEED_APART
    return drawn


def the_task(cfg: RecipeConfig) -> Task:
    """The recipe's task (`task.name`) with its `task.*` settings.

    Raises:
        ValueError: naming `task.name`, when no task has that name.
    """
    return load("task.name", cfg.task.name).bind(cfg.task)


def task_prompts(cfg: RecipeConfig, n: int, *, seed: int) -> list[dict[str, Any]]:
    """`n` items of the recipe's task (prompt, answer, task fields), drawn with `seed`."""
    return the_task(cfg).prompts(n, seed=seed)


def held_out_prompts(cfg: RecipeConfig) -> tuple[list[dict[str, Any]], set[Any]]:
    """The held-out evaluation items, and the problems (`Task.problem_key`) training leaves out for them
    (none unless `task.exclude_eval_prompts`)."""
    task = the_task(cfg)
    items = task.prompts(cfg.task.num_eval_prompts, seed=cfg.seed + EVAL_SEED_OFFSET)
    return items, ({task.problem_key(item) for item in items} if cfg.task.exclude_eval_prompts else set())


class Prompts:
    """An endless, seeded stream of the task's training prompts; `position` resumes it.

    Prompts whose problem (`Task.problem_key`: for countdown, the same numbers in any
    order and target) is in `held_out` are skipped. (On a small task such as
    single-digit arithmetic the held-out set is a fixed sample of the same distribution
    drawn with another seed, and `held_out` is left empty: every sum can appear in both.)
    """

    def __init__(self, cfg: RecipeConfig, tokenizer: Tokenizer, held_out: set[Any], position: int = 0) -> None:
        self.cfg, self.tokenizer, self.held_out = cfg, tokenizer, held_out
        self.task = the_task(cfg)
        self.position = position

    def _chunk(self, k: int) -> list[dict[str, Any]]:
        return self.task.prompts(512, seed=chunk_seed(self.cfg.seed, k))

    MAX_SKIPPED = 100_000
    """Held-out prompts skipped in a row before the stream gives up: the task has (almost)
    none left to train on."""

    def __iter__(self) -> Iterator[dict[str, Any]]:
        skipped = 0
        for k in itertools.count(self.position // 512):
            for j, item in enumerate(self._chunk(k)):
                if k * 512 + j < self.position:
                    continue
                self.position = k * 512 + j + 1
                if self.task.problem_key(item) in self.held_out:
                    skipped += 1
                    if skipped >= self.MAX_SKIPPED:
                        raise ConfigError(
                            f"task.exclude_eval_prompts=true leaves no prompt to train on: the last {skipped:,} drawn were all among the "
                            f"{len(self.held_out)} held-out ones (task.num_eval_prompts={self.cfg.task.num_eval_prompts}); "
                            "a task this small has no unseen prompts: set task.exclude_eval_prompts=false or draw from a larger task"
                        )
                    continue
                skipped = 0
                yield {**item, "prompt_ids": self.tokenizer.encode(item["prompt"])}


class PromptSource(Protocol):
    """A run's prompts: held out, for training, for the warm start."""

    eval_items: list[dict[str, Any]]
    """Held-out items, each with its `prompt_ids` (empty: the run has no evaluation set)."""

    def train(self, state: dict[str, Any] | None = None) -> Iterable[dict[str, Any]]:
        """The training stream with a `position`; from a checkpoint's `state.json` (`state`) where it stopped."""
        ...

    def warm_start(self) -> Iterator[dict[str, Any]]:
        """Items with an `answer` for the supervised warm start, apart from what RL trains on first."""
        ...

    def saved(self, stream: Any) -> dict[str, Any]:
        """What a checkpoint's state.json records beside `prompt_position` for `stream` to resume exactly."""
        ...


class TaskPrompts:
    """The generated task's prompts (`Prompts`), held out with seed `seed + EVAL_SEED_OFFSET`."""

    def __init__(self, cfg: RecipeConfig, tokenizer: Tokenizer) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        items, self.held_out = held_out_prompts(cfg)
        self.eval_items = [{**item, "prompt_ids": tokenizer.encode(item["prompt"])} for item in items]

    def train(self, state: dict[str, Any] | None = None) -> Prompts:
        return Prompts(self.cfg, self.tokenizer, self.held_out, position=state["prompt_position"] if state else 0)

    def warm_start(self) -> Iterator[dict[str, Any]]:
        return iter(Prompts(self.cfg, self.tokenizer, self.held_out, position=WARM_START_POSITION))

    def saved(self, stream: Any) -> dict[str, Any]:
        return {}


class FilePrompts:
    """The prompts of `data.train_files` (`PromptStream`), held out from `data.eval_files`.

    Raises:
        ConfigError: a data file or setting that gives no prompts (`DataError`'s message:
            the file, column and row).
    """

    def __init__(self, cfg: RecipeConfig, tokenizer: Tokenizer, *, on_progress: Callable[[str, int, int], None] | None = None) -> None:
        from tidal.engines.data import DataError, load_prompts  # noqa: PLC0415 - imports datasets

        self.cfg = cfg

        def progress(key: str) -> Callable[[int, int], None] | None:
            return None if on_progress is None else lambda done, total: on_progress(key, done, total)

        try:
            keep = bool(cfg.reward_model.path)  # a reward model reads each conversation in its own template
            self.prompts = load_prompts(list(cfg.data.train_files), tokenizer, config=cfg.data, on_progress=progress("data.train_files"), keep_messages=keep)
            held: Any = load_prompts(list(cfg.data.eval_files), tokenizer, config=cfg.data, key="data.eval_files", on_progress=progress("data.eval_files")) if cfg.data.eval_files else []
        except DataError as e:
            raise ConfigError(str(e)) from None
        except ValueError as e:  # the tokenizer refused: no chat template
            raise ConfigError(f"data.chat_template={cfg.data.chat_template}: {e}") from None
        self.eval_items = list(held)

    def train(self, state: dict[str, Any] | None = None) -> Any:
        from tidal.engines.data import DataError, PromptStream  # noqa: PLC0415

        stream = PromptStream.from_config(self.prompts, self.cfg.data)
        if state is not None:
            try:
                stream.load_state_dict({**stream.state_dict(), **state.get("data", {}), "position": state["prompt_position"]})
            except DataError as e:
                raise ConfigError(f"resume={self.cfg.resume!r}: {e}") from None
        return stream

    def warm_start(self) -> Iterator[dict[str, Any]]:
        from tidal.engines.data import PromptStream  # noqa: PLC0415

        return iter(PromptStream(self.prompts, seed=self.cfg.data.seed + EVAL_SEED_OFFSET, shuffle=True))  # another order than RL's

    def saved(self, stream: Any) -> dict[str, Any]:
        return {"data": {k: v for k, v in stream.state_dict().items() if k != "position"}}


def prompt_source(cfg: RecipeConfig, tokenizer: Tokenizer, *, on_progress: Callable[[str, int, int], None] | None = None) -> PromptSource:
    """The recipe's prompts: its data files when `data.train_files` is set, else its task.
    `on_progress(key, rows checked, rows)` follows the reading of each key's files."""
    return FilePrompts(cfg, tokenizer, on_progress=on_progress) if cfg.data.train_files else TaskPrompts(cfg, tokenizer)
