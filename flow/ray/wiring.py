"""How the trainer's weights reach rollout actors under `runtime: ray`: one wiring per
transport (`host`, `ipc`, `collective`), built by name (`make_wiring`). A wiring opens a
receiver on each actor (the actor's `open_receiver(transport, **params)`, which builds the
transport's receiver from `tidal.hal.transfer`'s registry), connects its sender to them,
and wires in again an actor Ray restarted (`attach`); `RayRollouts` sends through
`wiring.sender` (or `post`s, over `ipc`) and calls `abort` when an actor died. Ray is
imported only when a wiring attaches actors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def _attach_receivers(wiring: Any, actors: Sequence[Any], which: Iterable[int], transport: str) -> None:
    """Have actors `which` open a `transport` receiver bound on the wiring's host and connect
    the wiring's sender to each; a restarted actor's old receiver is gone, so it is dropped."""
    import ray  # noqa: PLC0415

    which = list(which)
    for i in which:
        if i in wiring._addresses:
            wiring.sender.disconnect(wiring._addresses.pop(i))
    opened = ray.get([actors[i].open_receiver.remote(transport, bind_host=wiring._host, token=wiring._token) for i in which])
    for i, address in zip(which, opened):
        wiring.sender.connect(address)
        wiring._addresses[i] = address


class HostWiring:
    """Weights to every rollout actor over the host transport: a socket per receiver.

    An actor that restarted gets a new receiver; the others keep theirs.
    """

    def __init__(self, platform: Any, *, host: str, token: str | None, bucket_bytes: int) -> None:
        from tidal.hal.transfer.host import HostSender  # noqa: PLC0415

        self.sender = HostSender(platform, bucket_bytes=bucket_bytes, token=token)
        self._host, self._token = host, token
        self._addresses: dict[int, str] = {}

    def attach(self, actors: Sequence[Any], which: Iterable[int]) -> None:
        _attach_receivers(self, actors, which, "host")

    def abort(self) -> None:
        self.sender.abort()

    def close(self) -> None:
        self.sender.close()


class IpcWiring:
    """Weights to rollout actors on the trainer's node over the `ipc` transport: one shared
    buffer, a socket per receiver. An actor that restarted gets a new receiver."""

    def __init__(self, platform: Any, *, host: str, token: str | None, bucket_bytes: int) -> None:
        """`bucket_bytes` is unused: a version goes through the shared buffer whole."""
        from tidal.hal.transfer.ipc import IpcSender  # noqa: PLC0415

        self.sender = IpcSender(platform, token=token)
        self._host, self._token = host, token
        self._addresses: dict[int, str] = {}

    def attach(self, actors: Sequence[Any], which: Iterable[int]) -> None:
        _attach_receivers(self, actors, which, "ipc")

    def post(self, version: int, source: Any) -> None:
        """Write `version` and announce it; the answers come with `collect` (`RayRollouts` with `overlap`)."""
        self.sender.post(version, source)

    def post_again(self) -> None:
        self.sender.post_again()

    def collect(self, timeout_s: float | None = None) -> None:
        self.sender.collect(timeout_s)

    def abort(self) -> None:
        self.sender.abort()  # a wait for a dead receiver's answer gives up

    def close(self) -> None:
        self.sender.close()


class CollectiveWiring:
    """Weights to every rollout actor in one broadcast group (the platform's collective backend).

    A group cannot lose a member: when an actor restarts, every actor's receiver is
    retired and a new group is built with all of them.
    """

    def __init__(self, platform: Any, *, host: str, token: str | None, bucket_bytes: int) -> None:
        """`token` is unused: the group's members are the actors the trainer started."""
        self._platform, self._host, self._bucket_bytes = platform, host, bucket_bytes
        self.sender: Any = None

    def attach(self, actors: Sequence[Any], which: Iterable[int]) -> None:
        import ray  # noqa: PLC0415

        from tidal.hal.transfer.collective import CollectiveSender  # noqa: PLC0415

        if self.sender is not None:
            ray.get([a.retire_receiver.remote() for a in actors])  # before the old group goes
            self.sender.close()  # the receivers still in it fail at once, their threads close them
        self.sender = CollectiveSender(self._platform, num_receivers=len(actors), host=self._host, bucket_bytes=self._bucket_bytes)
        ray.get([a.open_receiver.remote("collective", host=self._host, port=self.sender.port, rank=rank, num_receivers=len(actors)) for rank, a in enumerate(actors, start=1)])
        self.sender.join()

    def abort(self) -> None:
        pass  # a broadcast to a dead member fails by itself

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        self.sender = None


WIRINGS = {"host": HostWiring, "ipc": IpcWiring, "collective": CollectiveWiring}
"""Each weight transport's wiring (`tidal.hal.transfer.TRANSPORTS`)."""


def make_wiring(transport: str, platform: Any, *, host: str, token: str | None, bucket_bytes: int) -> Any:
    """The wiring of `transport` for a trainer on `platform` whose receivers bind on `host`.

    Raises:
        ValueError: `transport` is not one of `WIRINGS`.
    """
    if transport not in WIRINGS:
        raise ValueError(f"unknown weight transport {transport!r}; transports: {', '.join(WIRINGS)}")
    return WIRINGS[transport](platform, host=host, token=token, bucket_bytes=bucket_bytes)
