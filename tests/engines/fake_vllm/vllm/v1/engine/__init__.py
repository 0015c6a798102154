from __future__ import annotations

from typing import Literal

PauseMode = Literal["abort", "wait", "keep"]


class EngineDeadError(RuntimeError):
    """The engine was shut down (or died): no request can run."""
