"""The store controller (or a storage unit) as a Ray actor, for `runtime: ray`.

The actor only hosts a `StoreServer`; rows never travel through Ray's object store.
Clients connect with `RemoteStore(address)`, where `address` is what `start_store_actor`
returns. Ray is imported only when an actor is started.
"""

from __future__ import annotations

from typing import Any

from tidal.flow.store.memory import freeze_startup_objects, retain_freed_memory
from tidal.flow.store.prometheus import MetricsServer
from tidal.flow.store.server import StoreServer
from tidal.flow.store.table import Store
from tidal.flow.store.units import StorageUnit


class StoreActor:
    """Body of the Ray actor: a store (controller) or a storage unit behind a server.

    `host` is the address to bind; anything but loopback needs `token`. With
    `metrics_port` set, Prometheus metrics are served on it as well. `persist_dir`: where
    clients may save the store (`RemoteStore.save`); None refuses them (`save` here, a
    call of the actor, writes anywhere). The actor's process
    keeps the memory its rows free for the next rows (`memory.retain_freed_memory`), and
    leaves its start-up objects out of garbage collections (`memory.freeze_startup_objects`).
    """

    def __init__(self, *, role: str = "controller", host: str = "127.0.0.1", token: str | None = None, metrics_port: int | None = None, persist_dir: str | None = None) -> None:
        if role not in ("controller", "unit"):
            raise ValueError(f"role must be 'controller' or 'unit', got {role!r}")
        retain_freed_memory()
        self.store = Store() if role == "controller" else None
        self.server = StoreServer(self.store, unit=StorageUnit() if role == "unit" else None, address=f"tcp://{host}:0", token=token, persist_dir=persist_dir)
        metrics_host = "0.0.0.0" if host == "*" else host  # ZeroMQ's wildcard; HTTP names every interface so
        self.metrics_server = MetricsServer(self.store.metrics, host=metrics_host, port=metrics_port) if self.store is not None and metrics_port is not None else None
        self._host = host
        freeze_startup_objects()

    def address(self) -> str:
        """The address clients connect to (the node's IP when bound to all interfaces)."""
        if self._host in ("0.0.0.0", "*"):
            import ray  # noqa: PLC0415 - Ray only where this runs as an actor

            return self.server.address.replace("//0.0.0.0:", f"//{ray.util.get_node_ip_address()}:")  # ZeroMQ reports "*" as 0.0.0.0
        return self.server.address

    def metrics(self) -> dict[str, Any]:
        return self.store.metrics() if self.store is not None else {}

    def save(self, path: str) -> None:
        if self.store is None:
            raise ValueError("a storage-unit actor has no store state to save")
        self.server.save(path)  # reads the rows the store keeps on storage units

    def close(self) -> None:
        self.server.close()
        if self.metrics_server is not None:
            self.metrics_server.close()


def start_store_actor(*, role: str = "controller", num_cpus: float = 0.0, host: str = "127.0.0.1", token: str | None = None, metrics_port: int | None = None, persist_dir: str | None = None, **options: Any) -> tuple[Any, str]:
    """Start a `StoreActor` (Ray must be initialised); return (actor handle, address).

    `num_cpus` defaults to 0: the server is mostly idle I/O and must not starve the
    workers of CPUs. Extra `options` go to `ray.remote(...).options` (name, resources,
    scheduling_strategy, max_restarts...).
    """
    import ray  # noqa: PLC0415 - Ray only where this runs as an actor

    # Any: Ray types the handle as ActorHandle[T] | type[T], which has no `.remote` on a method not decorated with @ray.method
    actor: Any = ray.remote(StoreActor).options(num_cpus=num_cpus, **options).remote(role=role, host=host, token=token, metrics_port=metrics_port, persist_dir=persist_dir)
    return actor, ray.get(actor.address.remote())
