"""Ray runtime: roles as actors placed by `flow.placement` (this file grows with issue 5).

Nothing here runs under `runtime: local`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class RuntimeUnavailable(RuntimeError):
    """The Ray cluster the recipe needs cannot be reached; the message says how to start one."""


def connected_ray_nodes() -> Sequence[Mapping[str, Any]]:
    """`ray.nodes()` of the cluster at RAY_ADDRESS (or a running local one), without starting one."""
    import ray  # noqa: PLC0415

    if not ray.is_initialized():
        try:
            ray.init(address="auto", include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        except ConnectionError as e:
            raise RuntimeUnavailable(
                f"no Ray cluster is running here ({e}); start one with `ray start --head` or list the nodes in cluster.nodes"
            ) from None
    return ray.nodes()
