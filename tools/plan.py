"""From a recipe's `cluster:` and `placement:` blocks to a `flow.placement.Plan`.

`tidal plan <recipe>` prints it without starting anything. The cluster comes from the
recipe's nodes, else (under `runtime: ray`) from the alive nodes of the Ray cluster at
RAY_ADDRESS, which `tidal run` would join (`flow.ray_placement.ray_address`), else from
this machine's platform (where a run starts a Ray of its own).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tidal.flow.placement import Plan, PlacementError, Resource, Role, resources_from_ray_nodes, schedule
from tidal.tools.config import ConfigError

ROLES = ("train", "rollout")
"""Roles that hold devices, in scheduling order."""


def resources_of(cfg: Any, *, ray_nodes: Callable[[], Sequence[Mapping[str, Any]] | None] | None = None) -> tuple[list[Resource], str]:
    """The cluster a recipe runs on and where it came from (`recipe`, `ray` or `this machine`).

    `ray_nodes` (under `runtime: ray`, without `cluster.nodes`): the Ray cluster's nodes, or
    None where the run would start a Ray of its own (`flow.ray_placement.connected_ray_nodes`).
    """
    if cfg.cluster.nodes:
        out = []
        for i, node in enumerate(cfg.cluster.nodes):
            names = [node.name] if node.count == 1 else [f"{node.name}-{k}" for k in range(node.count)]
            if node.count < 1:
                raise ConfigError(f"cluster.nodes[{i}].count must be >= 1, got {node.count}")
            for name in names:
                try:
                    out.append(Resource(node=name, kind=node.kind, capacity=node.devices, tags=frozenset(node.tags)))
                except PlacementError as e:
                    raise ConfigError(f"cluster.nodes[{i}]: {e}") from None
        return out, "recipe"
    nodes = ray_nodes() if cfg.runtime.value == "ray" and ray_nodes is not None else None
    if nodes is not None:
        return resources_from_ray_nodes(nodes), "ray"
    from tidal.hal import init_platform  # noqa: PLC0415 - only when the recipe names no cluster

    platform = init_platform(cfg.device).platform
    kind = platform.descriptor.kind
    import os  # noqa: PLC0415

    capacity = platform.descriptor.device_count if kind != "cpu" else (os.cpu_count() or 1)
    return [Resource(node="localhost", kind=kind, capacity=capacity)], "this machine"


def roles_of(cfg: Any) -> list[Role]:
    roles = []
    for name in ROLES:
        rc = cfg.placement[name]
        try:
            roles.append(Role(name=name, requires=tuple(rc.requires), count=rc.count, devices_each=rc.devices_each, colocate_with=rc.colocate_with, lend_to=rc.lend_to))
        except PlacementError as e:
            raise ConfigError(f"placement.{name}: {e}") from None
    return roles


def shares_devices(cfg: Any) -> bool:
    """Whether the recipe asks roles to share devices (`placement.rollout.colocate_with`,
    `placement.train.lend_to`): a local run then takes turns on them."""
    return bool(cfg.placement.rollout.colocate_with or cfg.placement.train.lend_to)


def make_plan(cfg: Any, *, ray_nodes: Callable[[], Sequence[Mapping[str, Any]]] | None = None) -> tuple[Plan, str]:
    """The recipe's plan and where its cluster came from.

    Raises:
        ConfigError: the plan is infeasible (naming the role) or the cluster is malformed.
    """
    resources, source = resources_of(cfg, ray_nodes=ray_nodes)
    try:
        return schedule(resources, roles_of(cfg)), source
    except PlacementError as e:
        raise ConfigError(f"placement: {e}") from None


def cluster_rows(resources: Sequence[Resource]) -> list[list[str]]:
    rows = [["node", "kind", "devices", "tags"]]
    for r in resources:
        rows.append([r.node, r.kind, str(r.capacity), ", ".join(sorted(r.tags))])
    return rows
