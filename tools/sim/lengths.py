"""Response lengths for the cluster simulator: a sampler, and a replay of a recorded trace.

`LengthModel` draws a step's responses in groups (one group of `group_size` responses per
prompt, as GRPO-style RL samples them). Lengths are lognormal twice over: a prompt's
difficulty scales its group's mean (`prompt_sigma`), and responses spread around that
within the group (`group_sigma`). Both factors have mean 1, so the expected length before
truncation is `mean_tokens * (1 + drift) ** step`: RL often lengthens responses as
training goes on. Lengths are cut at `max_new_tokens`, and the sampler says which were cut.

`replay` reads the lengths a real run produced, from a JSONL trace, one line per step:

    {"step": 3, "lengths": [[120, 340, 95, 410], [2048, 1800, 2048, 990]]}

`lengths` holds one list per prompt (its group), each a list of response lengths in
tokens (integers >= 0). Other keys are ignored, so a run's `metrics.jsonl` (each step's
line has `step` and `lengths`) is such a trace. Blank lines are skipped; each step
appears once.

`replay_rewards` reads the rewards beside them (`read_trace` both at once), where a line has `rewards` (a run's
metrics.jsonl has, since 2026-11-30): one number per response, grouped as `lengths`. A
simulation that replays them trains the groups the run trained: a group whose samples all
got one reward has no advantage, and the trainer skips its rows.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class LengthModel:
    """Response lengths of one RL workload (see the module docstring)."""

    mean_tokens: float
    """Expected length at step 0 before truncation."""
    prompt_sigma: float = 0.5
    """Lognormal sigma of the per-prompt mean (how much prompts differ in difficulty)."""
    group_sigma: float = 0.3
    """Lognormal sigma of responses around their prompt's mean."""
    max_new_tokens: int | None = None
    """Longest response: longer draws are cut here and flagged truncated. None: no cap."""
    drift: float = 0.0
    """Growth of the mean per step: mean x (1 + drift) ** step; > -1."""
    min_tokens: int = 1
    """Shortest response (an EOS as the first token still costs one decode step)."""

    def __post_init__(self) -> None:
        if not self.mean_tokens > 0:
            raise ValueError(f"LengthModel.mean_tokens must be > 0, got {self.mean_tokens!r}")
        if self.prompt_sigma < 0 or self.group_sigma < 0:
            raise ValueError(f"LengthModel sigmas must be >= 0, got prompt_sigma={self.prompt_sigma!r}, group_sigma={self.group_sigma!r}")
        if not self.drift > -1:
            raise ValueError(f"LengthModel.drift must be > -1, got {self.drift!r}")
        if self.min_tokens < 0:
            raise ValueError(f"LengthModel.min_tokens must be >= 0, got {self.min_tokens!r}")
        if self.max_new_tokens is not None and self.max_new_tokens < max(self.min_tokens, 1):
            raise ValueError(f"LengthModel.max_new_tokens must be >= max(min_tokens, 1), got {self.max_new_tokens!r}")

    def mean_at(self, step: int) -> float:
        """Expected length at `step`, before truncation."""
        return self.mean_tokens * (1 + self.drift) ** step

    def sample_flagged(self, *, step: int, num_prompts: int, group_size: int, rng: random.Random) -> tuple[list[list[int]], list[list[bool]]]:
        """`num_prompts` groups of `group_size` lengths, and for each whether it was cut at
        `max_new_tokens`. Deterministic for a given `rng` state."""
        if num_prompts < 0 or group_size < 1:
            raise ValueError(f"need num_prompts >= 0 and group_size >= 1, got {num_prompts} and {group_size}")
        # mu = log(mean) - sigma^2/2 makes each lognormal factor's mean the target mean
        mu = math.log(self.mean_at(step))
        cap = self.max_new_tokens
        lengths, truncated = [], []
        for _ in range(num_prompts):
            prompt_mu = mu + self.prompt_sigma * rng.gauss(0.0, 1.0) - self.prompt_sigma**2 / 2
            group, cut = [], []
            for _ in range(group_size):
                raw = math.exp(prompt_mu + self.group_sigma * rng.gauss(0.0, 1.0) - self.group_sigma**2 / 2)
                n = max(self.min_tokens, round(raw))
                group.append(n if cap is None else min(n, cap))
                cut.append(cap is not None and n > cap)
            lengths.append(group)
            truncated.append(cut)
        return lengths, truncated

    def sample(self, *, step: int, num_prompts: int, group_size: int, rng: random.Random) -> list[list[int]]:
        """`num_prompts` groups of `group_size` response lengths (cut at `max_new_tokens`)."""
        return self.sample_flagged(step=step, num_prompts=num_prompts, group_size=group_size, rng=rng)[0]


def replay(path: str | Path) -> dict[int, list[list[int]]]:
    """Each step's groups of response lengths, read from a JSONL trace (module docstring).

    Raises:
        ValueError: the file is missing or unreadable, or a line is not a valid row; the
            message names the file and the line number.
    """
    return read_trace(path)[0]


def replay_rewards(path: str | Path) -> dict[int, list[list[float]]]:
    """Each step's groups of rewards, from the lines of a trace that have `rewards`; {} when
    none has (a trace of lengths alone, or an older run's). Raises as `read_trace`."""
    return read_trace(path)[1]


def read_trace(path: str | Path) -> tuple[dict[int, list[list[int]]], dict[int, list[list[float]]]]:
    """`replay`'s lengths and `replay_rewards`' rewards, in one reading of the trace.

    Raises:
        ValueError: as `replay`, and for `rewards` that are not numbers grouped as the
            line's `lengths` (the message names the file and the line number).
    """
    lengths: dict[int, list[list[int]]] = {}
    steps: dict[int, list[list[float]]] = {}
    for where, step, groups, row in _rows(path):
        lengths[step] = groups
        rewards = row.get("rewards")
        if rewards is None:
            continue
        if not isinstance(rewards, list) or [len(r) if isinstance(r, list) else None for r in rewards] != [len(g) for g in groups]:
            raise ValueError(f"{where}: rewards must be grouped as lengths are (one number per response)")
        for r in rewards:
            for x in r:
                if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                    raise ValueError(f"{where}: rewards must be finite numbers, got {x!r}")
        steps[step] = [[float(x) for x in r] for r in rewards]
    return lengths, steps


def _rows(path: str | Path) -> Iterator[tuple[str, int, list[list[int]], dict[str, Any]]]:
    """(file:line, step, its groups of lengths, the whole row) of each line of a trace."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"{path}: cannot read the length trace: {e.strerror or e}") from e
    seen: set[int] = set()
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON: {e.msg}") from e
        step, groups = _check_row(row, where=where)
        if step in seen:
            raise ValueError(f"{where}: step {step} appears twice")
        seen.add(step)
        yield where, step, groups, row


def _check_row(row: object, *, where: str) -> tuple[int, list[list[int]]]:
    if not isinstance(row, dict) or not {"step", "lengths"} <= set(row):
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise ValueError(f'{where}: a row is {{"step": int, "lengths": [[int, ...], ...], ...}} (a run\'s metrics.jsonl line), got {keys}')
    step, groups = row["step"], row["lengths"]
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{where}: step must be an integer >= 0, got {step!r}")
    if not isinstance(groups, list) or not all(isinstance(g, list) and g for g in groups):
        raise ValueError(f"{where}: lengths must be a list of non-empty lists (one per prompt)")
    for g in groups:
        for n in g:
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"{where}: lengths must be integers >= 0, got {n!r}")
    return step, groups
