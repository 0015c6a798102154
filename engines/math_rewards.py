"""Math rewards: the response's final answer checked against the reference with `math-verify`.

A response may reason first; its *final answer* is what it marks as such, last: the
content of its last `\\boxed{...}` (the MATH / DeepSeek-R1 convention), or the rest of its
last `####` line (GSM8K's). Nothing but whitespace and punctuation (`$`, `.`, `**`, `\\]`)
may follow a box, and a `####` answer is the rest of the text on one line: a response
that marks an answer and then goes on has not given it. The reference is
`trajectory.meta["answer"]`, GSM8K's `"...reasoning... #### 1,234"` (the part after the
last `####`, thousands commas removed) or a bare answer (`"42"`, `"\\frac{1}{2}"`).

Both are parsed by Hugging Face's `math_verify.parse` (LaTeX and plain expressions) and
compared with `math_verify.verify`: numerically (`42` = `42.0`, `\\frac{1}{2}` = `0.5`) and
symbolically (`x^2+1` = `1+x^2`, `2\\sqrt{2}` = `\\sqrt{8}`); an answer that is no
expression at all (`?!`) is compared as text.

Like the built-in verifiers of `tidal.engines.rewards`, these are strict: a response cut
at the token budget (`finish_reason` "length") scores 0 whatever its text. A reference
that is empty (`"#### "`) raises ValueError: `rewards.score` counts that row as failed
(a data problem, not a wrong answer).

math-verify bounds each parse and comparison with `signal.alarm`, which works only in a
process's main thread; in any other thread these functions run without that bound (run
them in a `tidal.engines.reward_pool.RewardPool`, whose workers call them in their main
thread and whose per-sample timeout covers everything).
"""

from __future__ import annotations

import functools
import re
import threading
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from tidal.flow.trajectory import Trajectory

TIMEOUT_S = 5
"""math-verify's own bound on one parse or comparison, in seconds (main thread only)."""

_EXTRACTION = (LatexExtractionConfig(), ExprExtractionConfig())
_BOXED = "\\boxed{"
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?")
_AFTER_BOX = re.compile(r"[\s$.*\\\])]*")
"""What may follow the final box: `$\\boxed{42}$.`, `**\\boxed{42}**`, `\\[\\boxed{42}\\]`."""


def _timeout() -> int | None:
    """math-verify's timeout where its `signal.alarm` works (the main thread), none elsewhere."""
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _normalize(answer: str) -> str:
    """An answer ready for parsing: `$` signs (currency, inline math) gone, a final full stop
    gone, and thousands commas removed from a lone number (`1,234` -> `1234`; `(1,2)` stays)."""
    answer = answer.replace("$", "").strip().removesuffix(".").strip()
    if _THOUSANDS.fullmatch(answer):
        answer = answer.replace(",", "")
    return answer


def reference_answer(answer: Any) -> str:
    """The reference a dataset row gives: what follows the last `####` (GSM8K), or the
    whole answer, normalized as final answers are (`1,234` -> `1234`)."""
    text = str(answer)
    if "####" in text:
        text = text.rpartition("####")[2]
    return _normalize(text)


def _last_box(text: str) -> tuple[int, str | None, str]:
    """(where the last `\\boxed{` starts or -1, its content or None if its braces never
    close, the text after its closing brace)."""
    start = text.rfind(_BOXED)
    if start < 0:
        return -1, None, ""
    depth, i = 1, start + len(_BOXED)
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return start, text[start + len(_BOXED) : i], text[i + 1 :]
        i += 1
    return start, None, ""


def final_answer(text: str) -> str | None:
    """The final answer `text` marks (normalized), or None: no `\\boxed{}` and no `####`,
    an empty one, a box that never closes, or text after the last marked answer."""
    box, content, after = _last_box(text)
    hashes = text.rfind("####")
    if box > hashes:
        if content is None or not _AFTER_BOX.fullmatch(after):
            return None
        answer = content
    elif hashes >= 0:
        answer = text[hashes + 4 :].strip()
        if "\n" in answer:
            return None
    else:
        return None
    answer = _normalize(answer)
    return answer or None


def _parse(answer: str, *, fallback: bool = True) -> list[Any]:
    """math-verify's reading of `answer`: sympy objects, then (with `fallback`) the text
    itself when it is no expression, which `verify` then compares as a string."""
    mode = "first_match" if fallback else "no_fallback"
    return parse(_BOXED + answer + "}", list(_EXTRACTION), fallback_mode=mode, parsing_timeout=_timeout())


@functools.lru_cache(maxsize=4096)
def _parsed_reference(reference: str) -> tuple[Any, ...]:
    parsed = _parse(reference) if reference else []
    if not parsed:
        raise ValueError(f"the reference answer {reference!r} is empty or cannot be parsed by math-verify")
    return tuple(parsed)


def _ended(trajectory: Trajectory) -> bool:
    return trajectory.finish_reason == "stop"


def math_answer(trajectory: Trajectory, text: str) -> float:
    """1.0 when the response ended with an end token and its final answer (`final_answer`)
    equals `meta["answer"]` (`reference_answer`) numerically or symbolically; 0.0 otherwise.

    Raises:
        ValueError: the reference is empty (the row is counted as failed).
    """
    if not _ended(trajectory):
        return 0.0
    gold = _parsed_reference(reference_answer(trajectory.meta["answer"]))
    answer = final_answer(text)
    if answer is None:
        return 0.0
    predicted = _parse(answer)
    return float(bool(predicted) and verify(list(gold), predicted, timeout_seconds=_timeout()))


def math_format(trajectory: Trajectory, text: str) -> float:
    """1.0 when the response ended with an end token and closes with a final answer in the
    expected form (`\\boxed{...}` or a `####` line) that math-verify reads as an expression
    (not `\\boxed{??}`); 0.0 otherwise. Says nothing about whether the answer is right."""
    if not _ended(trajectory):
        return 0.0
    answer = final_answer(text)
    return float(answer is not None and bool(_parse(answer, fallback=False)))


FORMAT_SCORE = 0.1
"""What `math_with_format` pays a well-formed wrong answer (as `rewards.countdown` pays a valid wrong expression)."""


def math_with_format(trajectory: Trajectory, text: str) -> float:
    """1.0 for a right final answer (`math_answer`), `FORMAT_SCORE` for a well-formed wrong
    one (`math_format`), 0.0 otherwise."""
    if math_answer(trajectory, text) == 1.0:
        return 1.0
    return FORMAT_SCORE * math_format(trajectory, text)


MATH_REWARDS = {"math": math_answer, "math_format": math_format, "math_with_format": math_with_format}
"""The names `tidal.engines.rewards.MODULE_REWARDS` registers these under."""
