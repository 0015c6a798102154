"""Prompt generators for the built-in tasks, deterministic for a seed, behind one `Task` protocol.

A task is what a recipe's `task.name` picks (`tidal.engines.registry.TASKS`): it draws
prompt items (`{"prompt": ..., "answer": ..., task fields}`) for a seed, names the reward
that checks them, says when two items are the same problem, and bounds its prompts'
length. `TaskSpec` is the one implementation: a generator function and the `task.*` keys it
takes. Prompts read from files (`data.train_files`) need no task: only a reward.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable


def check_ops(ops: str) -> None:
    """Raise ValueError unless `ops` is a non-empty string of the operators + - * (`arithmetic`'s)."""
    if not ops or set(ops) - set("+-*"):
        raise ValueError(f"ops must be a non-empty subset of '+-*', got {ops!r}")


def arithmetic(num_prompts: int, *, seed: int, min_value: int = 0, max_value: int = 20, ops: str = "+-") -> list[dict[str, Any]]:
    """`{"prompt": "12+7=", "answer": "19"}` items; answers have 1-3 characters (may be negative)."""
    check_ops(ops)
    if max_value < min_value:
        raise ValueError(f"max_value ({max_value}) must be >= min_value ({min_value})")
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        a, b, op = rng.randint(min_value, max_value), rng.randint(min_value, max_value), rng.choice(ops)
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        out.append({"prompt": f"{a}{op}{b}=", "answer": str(answer)})
    return out


def countdown(num_prompts: int, *, seed: int, num_numbers: int = 3, max_number: int = 10) -> list[dict[str, Any]]:
    """`{"prompt": "3 5 7>22:", "numbers": [3, 5, 7], "target": 22, "answer": "5*3+7"}`:
    reach the target with + - * and each number once. `answer` is one solution (the one
    the target was built from), for a supervised warm start; the verifier accepts any."""
    for name, value in (("num_numbers", num_numbers), ("max_number", max_number)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    while len(out) < num_prompts:
        numbers = [rng.randint(1, max_number) for _ in range(num_numbers)]
        order = rng.sample(numbers, len(numbers))
        target, answer = order[0], str(order[0])
        for n in order[1:]:
            op = rng.choice("+-*")
            target = target + n if op == "+" else target - n if op == "-" else target * n
            # applied left to right: a product of a sum needs its brackets
            answer = f"({answer}){op}{n}" if op == "*" and ("+" in answer or "-" in answer) else f"{answer}{op}{n}"
        if target <= 0:
            continue
        out.append({"prompt": f"{' '.join(map(str, numbers))}>{target}:", "numbers": numbers, "target": target, "answer": answer})
    return out


def problem_key(item: dict[str, Any]) -> Any:
    """What makes two items the same problem, for keeping held-out problems out of training:
    a countdown item's numbers in any order and its target (its prompt text lists them in
    the order drawn), otherwise the prompt text."""
    if "numbers" in item and "target" in item:
        return (tuple(sorted(item["numbers"])), item["target"])
    return item["prompt"]


def longest_prompt(name: str, params: dict[str, Any]) -> int | None:
    """Characters of the longest prompt task `name` can draw with these keyword arguments
    (those of `PROMPT_PARAMS[name]`); None for a task without a known bound."""
    if name == "arithmetic":  # "<a><op><b>=", a and b in 0..max_value
        return 2 * len(str(params["max_value"])) + 2
    if name == "countdown":  # "<n> <n> ...><target>:", numbers in 1..max_number; + and * only grow a target
        num_numbers, max_number = params["num_numbers"], params["max_number"]
        target = max_number
        for _ in range(num_numbers - 1):
            target = max(target + max_number, target * max_number)
        return num_numbers * (len(str(max_number)) + 1) + len(str(target)) + 1
    return None


@runtime_checkable
class Task(Protocol):
    """A generated task with its settings bound (`TaskSpec.bind`)."""

    reward: str
    """The reward that checks its answers (a `tidal.engines.rewards` name), unless the recipe names another."""

    def prompts(self, num_prompts: int, *, seed: int) -> list[dict[str, Any]]:
        """`num_prompts` items drawn with `seed` (the same for the same seed)."""
        ...

    def problem_key(self, item: dict[str, Any]) -> Any:
        """What makes two items the same problem (see `problem_key`)."""
        ...

    def longest_prompt(self) -> int | None:
        """Characters of the longest prompt it can draw; None without a known bound."""
        ...


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """A task by its generator: `generate(num_prompts, seed=..., **params)`, where `params`
    are the `task.<name>` keys listed in `params` (those in `length_params` bound the
    prompts' length, `longest_prompt`)."""

    name: str
    generate: Callable[..., list[dict[str, Any]]]
    params: tuple[str, ...]
    length_params: tuple[str, ...]
    reward: str

    def bind(self, settings: Any) -> BoundTask:
        """The task with its parameters taken from the attributes of `settings` (the recipe's `task` section)."""
        return BoundTask(self, {k: getattr(settings, k) for k in self.params})


@dataclasses.dataclass(frozen=True)
class BoundTask:
    """A `TaskSpec` with its parameter values: the `Task` a run draws from."""

    spec: TaskSpec
    values: dict[str, Any]

    @property
    def reward(self) -> str:
        return self.spec.reward

    def prompts(self, num_prompts: int, *, seed: int) -> list[dict[str, Any]]:
        return self.spec.generate(num_prompts, seed=seed, **self.values)

    def problem_key(self, item: dict[str, Any]) -> Any:
        return problem_key(item)

    def longest_prompt(self) -> int | None:
        return longest_prompt(self.spec.name, {k: self.values[k] for k in self.spec.length_params})


ARITHMETIC = TaskSpec("arithmetic", arithmetic, params=("max_value", "ops"), length_params=("max_value",), reward="arithmetic")
COUNTDOWN = TaskSpec("countdown", countdown, params=("num_numbers", "max_number"), length_params=("num_numbers", "max_number"), reward="countdown")

TASKS: dict[str, Callable[..., list[dict[str, Any]]]] = {"arithmetic": arithmetic, "countdown": countdown}
"""The generator functions by name (`tidal.engines.registry.TASKS` names their `TaskSpec`s)."""
PROMPT_PARAMS = {spec.name: spec.length_params for spec in (ARITHMETIC, COUNTDOWN)}
"""The arguments of each task that its prompts' length follows from."""
TASK_REWARDS = {spec.name: spec.reward for spec in (ARITHMETIC, COUNTDOWN)}
