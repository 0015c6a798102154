"""Reward functions: rule-based verifiers and user functions named `module:function`.

A reward function takes a finished trajectory and its decoded continuation (end tokens
left out) and returns a float; the reference it checks against lives in
`trajectory.meta`, and `trajectory.finish_reason` says how the response ended ("stop": an
end token; "length": cut at the token budget).

The built-in verifiers are strict: the response must be the answer and nothing else,
closed by an end token. A response cut at the budget scores 0 whatever its text, and so
does one with anything after the answer: a lenient rule (the first integer anywhere)
paid full reward for `10c8c1` as an answer to `3+7=`, and a policy trained on it learnt
to stop emitting the end token.

`score` runs one over a batch and never lets a failing function stop a run: a function
that raises or returns NaN/inf gives that row 0.0 and reports it as failed (counted in
the step metrics).
"""

from __future__ import annotations

import ast
import importlib
import logging
import math
import operator
import os
import sys
from collections.abc import Callable, Sequence
from fractions import Fraction

from tidal.flow.trajectory import Trajectory

log = logging.getLogger(__name__)
RewardFn = Callable[[Trajectory, str], float]


def ended(trajectory: Trajectory) -> bool:
    """Whether the response was closed by an end token (not cut at the token budget)."""
    return trajectory.finish_reason == "stop"


def exact_match(trajectory: Trajectory, text: str) -> float:
    """1.0 when the continuation, stripped of surrounding whitespace, equals `meta["answer"]`
    and ended with an end token."""
    return float(ended(trajectory) and text.strip() == str(trajectory.meta["answer"]).strip())


def arithmetic(trajectory: Trajectory, text: str) -> float:
    """1.0 when the continuation is the integer `meta["answer"]` and nothing else (surrounding
    whitespace aside; written as `str(int(answer))`: no leading zeros, no `+`), ended with an
    end token; 0.0 otherwise."""
    return float(ended(trajectory) and text.strip() == str(int(trajectory.meta["answer"])))


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: lambda a, b: Fraction(a) / b}
"""Exact arithmetic: a division gives a `Fraction`, never a rounded float."""


def _evaluate(node: ast.AST, available: list[int]) -> Fraction | int:
    """The expression's exact value; each number it uses is taken from `available` before any
    arithmetic, so one that is not there (or a huge literal) fails before it is computed."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, available)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_evaluate(node.left, available), _evaluate(node.right, available))
    if isinstance(node, ast.Constant) and type(node.value) is int:
        if node.value not in available:
            raise ValueError(f"{node.value} is not one of the numbers left")
        available.remove(node.value)
        return node.value
    raise ValueError(f"not allowed in a countdown expression: {type(node).__name__}")


def countdown(trajectory: Trajectory, text: str) -> float:
    """1.0 for an expression that uses each of `meta["numbers"]` exactly once (as the task
    asks: a subset would solve many prompts more easily) and equals `meta["target"]`; 0.1 for
    such an expression with another value; 0.0 otherwise, and for a response that is more
    than the expression (a second line) or did not end with an end token. Parsed with `ast`,
    never eval'd, and computed exactly (fractions): a float tolerance let a value near a
    large target score 1.0."""
    expression = text.strip()
    if not ended(trajectory) or "\n" in expression:
        return 0.0
    left = list(trajectory.meta["numbers"])
    try:
        value = _evaluate(ast.parse(expression, mode="eval"), left)
    # MemoryError and RecursionError: how the parser and `_evaluate` answer deep nesting
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, OverflowError, MemoryError):
        return 0.0
    if left:
        return 0.0
    return 1.0 if value == Fraction(trajectory.meta["target"]) else 0.1


NO_VERIFIER = "none"
"""`task.reward=none`: no function scores the answers; a reward model's score is the whole
reward (`reward_model.path`), and no held-out accuracy is measured."""
REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, "arithmetic": arithmetic, "countdown": countdown}
MODULE_REWARDS = {"math": "tidal.engines.math_rewards:math_answer", "math_format": "tidal.engines.math_rewards:math_format", "math_with_format": "tidal.engines.math_rewards:math_with_format"}
"""Registered rewards imported when first named: math-verify takes a second or more to import."""
POOLED_REWARDS = frozenset(MODULE_REWARDS)
"""Registered rewards a run scores in worker processes unless `task.reward_workers` says
otherwise: math-verify bounds a parse with `signal.alarm`, which works only in a process's
main thread, never in the reward stage's."""
DEFAULT_REWARD_WORKERS = 2
"""Worker processes of a pooled reward when `task.reward_workers` is null."""


def stripped(text: str) -> str | None:
    """A strict verifier's answer: the response, surrounding whitespace aside (None when empty)."""
    return text.strip() or None


def answer_reader(spec: str) -> Callable[[str], str | None] | None:
    """The function that reads the answer a response to registered reward `spec` gives (what
    majority voting counts: `held_out_maj_at_n`): the response itself for the strict
    verifiers (`REWARDS`), math-verify's final answer for the math ones (imported now); None
    for a user's `module:function` reward."""
    if spec in REWARDS:
        return stripped
    if spec in MODULE_REWARDS:
        return importlib.import_module("tidal.engines.math_rewards").final_answer
    return None


def resolve_reward(spec: str) -> RewardFn:
    """A registry name, or `module:function` imported from the Python path or, after it,
    the current directory (a `tidal` console script does not have it on the path; the
    actors of a local Ray start there and do)."""
    if spec in REWARDS:
        return REWARDS[spec]
    if spec in MODULE_REWARDS:
        module_name, _, attr = MODULE_REWARDS[spec].partition(":")
        return getattr(importlib.import_module(module_name), attr)
    if ":" not in spec:
        raise ValueError(f"unknown reward {spec!r}; registered: {sorted([*REWARDS, *MODULE_REWARDS])}, or give module:function")
    module_name, _, attr = spec.partition(":")
    if not module_name or module_name.startswith(".") or not attr:  # import_module: ValueError, TypeError
        raise ValueError(f"reward {spec!r}: give module:function with an absolute module name, e.g. my_rewards:score")
    if not {"", os.getcwd()} & set(sys.path):
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r} ({e})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: module {module_name!r} has no function {attr!r}")
    return fn


FLOAT32_MAX = 3.4028234663852886e38
"""Rewards are stored as float32: a larger finite value would become inf there."""


def score(fn: RewardFn, trajectories: Sequence[Trajectory], texts: Sequence[str]) -> tuple[list[float], list[int]]:
    """Rewards for every row, and the indexes of rows whose reward function failed: it
    raised, or returned NaN, an infinity or a value beyond float32's range. Each function's
    first failure of each kind is logged."""
    rewards, failed = [], []
    name = getattr(fn, "__name__", repr(fn))
    for k, (trajectory, text) in enumerate(zip(trajectories, texts)):
        try:
            value = float(fn(trajectory, text))
            if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
                raise ValueError(f"reward is {value}" + ("" if not math.isfinite(value) else ", beyond float32's range"))
        except Exception as e:  # noqa: BLE001 - a bad reward marks the row failed, never the run
            _warn_once((name, type(e).__name__), f"reward function {name!r} failed: {type(e).__name__}: {e}")
            rewards.append(0.0)
            failed.append(k)
            continue
        rewards.append(value)
    return rewards, failed


_warned: set[tuple[str, str]] = set()


def _warn_once(key: tuple[str, str], message: str) -> None:
    """Log `message` the first time `key` (function, error type) fails: a reward raising
    with each row's text in its message logs once, and this set stays small."""
    if key not in _warned:
        _warned.add(key)
        log.warning("%s (the row scores 0 and is counted as failed; later failures of this kind are counted, not logged)", message)
