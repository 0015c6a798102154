"""Prompt generators for the built-in tasks, deterministic for a seed."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any


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
    out = []
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


TASKS: dict[str, Callable[..., list[dict[str, Any]]]] = {"arithmetic": arithmetic, "countdown": countdown}
PROMPT_PARAMS = {"arithmetic": ("max_value",), "countdown": ("num_numbers", "max_number")}
"""The arguments of each task that its prompts' length follows from."""
TASK_REWARDS = {"arithmetic": "arithmetic", "countdown": "countdown"}
