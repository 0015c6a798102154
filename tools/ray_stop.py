"""How Ctrl-C or SIGTERM at the driver of a `runtime: ray` run reaches trainer rank 0.

The driver (`tools.ray_run.run_on_ray`) starts one `StopSignal` actor per trainer attempt
and asks it to stop on the first signal; rank 0's `train()` gets a `StopRequest` that the
actor's request reaches (`relay_stop`), so the run ends after the trainer's current RL
step with a checkpoint, as a local run does.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from tidal.tools.stopping import StopRequest


class StopSignal:
    """Body of an async actor that carries the driver's request to stop (Ctrl-C or SIGTERM
    at `tidal run`) to trainer rank 0, whose `train()` then ends after its current RL step
    with a checkpoint. One per trainer attempt; rank 0 waits on it from a thread."""

    def __init__(self) -> None:
        self._done = asyncio.Event()
        self._reason: str | None = None

    async def request(self, reason: str) -> None:
        if self._reason is None:
            self._reason = reason
        self._done.set()

    async def release(self) -> None:
        """The attempt is over: a waiting `wait` returns None."""
        self._done.set()

    async def wait(self) -> str | None:
        await self._done.wait()
        return self._reason


def relay_stop(stopper: Any) -> Any:
    """Rank 0: a `StopRequest` that `stopper`'s request reaches (through a waiting thread)."""
    import ray  # noqa: PLC0415

    stop = StopRequest()

    def relay() -> None:
        try:
            reason = ray.get(stopper.wait.remote())
        except ray.exceptions.RayError:  # the driver is gone: its Ray shutdown ends this process too
            return
        if reason is not None:
            stop.request(reason)

    threading.Thread(target=relay, name="tidal-stop-relay", daemon=True).start()
    return stop
