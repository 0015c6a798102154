"""From a recipe's `cluster:` and `placement:` blocks to a `flow.placement.Plan`.

`tidal plan <recipe>` prints it without starting anything. The cluster comes from the
recipe's nodes, else (under `runtime: ray`) from the alive nodes of the Ray cluster at
RAY_ADDRESS, which `tidal run` would join (`flow.ray.placement.ray_address`), else from
this machine's platform (where a run starts a Ray of its own).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tidal.flow.placement import KIND_TAGS, PlacementError, Plan, Resource, Role, resources_from_ray_nodes, schedule
from tidal.tools.config import ConfigError, RecipeConfig

ROLES = ("train", "rollout")
"""Roles that hold devices, in scheduling order."""


def resources_of(cfg: RecipeConfig, *, ray_nodes: Callable[[], Sequence[Mapping[str, Any]] | None] | None = None) -> tuple[list[Resource], str]:
    """The cluster a recipe runs on and where it came from (`recipe`, `ray` or `this machine`).

    `ray_nodes` (under `runtime: ray`, without `cluster.nodes`): the Ray cluster's nodes, or
    None where the run would start a Ray of its own (`flow.ray.placement.connected_ray_nodes`).
    """
    if cfg.cluster.nodes:
        return _recipe_nodes(cfg.cluster.nodes), "recipe"
    nodes = ray_nodes() if cfg.runtime.value == "ray" and ray_nodes is not None else None
    if nodes is not None:
        return resources_from_ray_nodes(nodes), "ray"
    from tidal.hal import init_platform  # noqa: PLC0415 - only when the recipe names no cluster

    platform = init_platform(cfg.device).platform
    kind = platform.descriptor.kind
    import os  # noqa: PLC0415

    capacity = platform.descriptor.device_count if kind != "cpu" else (os.cpu_count() or 1)
    return [Resource(node="localhost", kind=kind, capacity=capacity)], "this machine"


def _recipe_nodes(nodes: Sequence[Any]) -> list[Resource]:
    """`cluster.nodes` as resources, a node of `count` > 1 as <name>-0, <name>-1, ...

    Raises:
        ConfigError: naming the `cluster.nodes[i]` key that is wrong.
    """
    out: list[Resource] = []
    entry_of: dict[str, int] = {}  # node name -> the cluster.nodes index that made it
    for i, node in enumerate(nodes):
        key = f"cluster.nodes[{i}]"
        if node.count < 1:
            raise ConfigError(f"{key}.count must be >= 1, got {node.count}")
        if node.kind not in KIND_TAGS:
            raise ConfigError(f"{key}.kind={node.kind!r} is not one of {', '.join(KIND_TAGS)}")
        if node.devices < 0:
            raise ConfigError(f"{key}.devices={node.devices} must be >= 0")
        for name in [node.name] if node.count == 1 else [f"{node.name}-{k}" for k in range(node.count)]:
            if name in entry_of:
                raise ConfigError(f"{key}.name={node.name!r} names node {name!r} again (cluster.nodes[{entry_of[name]}] made it); give each node entry its own name")
            entry_of[name] = i
            out.append(Resource(node=name, kind=node.kind, capacity=node.devices, tags=frozenset(node.tags)))
    return out


def roles_of(cfg: RecipeConfig) -> list[Role]:
    roles = []
    for name in ROLES:
        rc = getattr(cfg.placement, name)
        try:
            roles.append(Role(name=name, requires=tuple(rc.requires), count=rc.count, devices_each=rc.devices_each, colocate_with=rc.colocate_with, lend_to=rc.lend_to))
        except PlacementError as e:
            raise ConfigError(f"placement.{name}: {e}") from None
    return roles


def shares_devices(cfg: RecipeConfig) -> bool:
    """Whether the recipe asks roles to share devices (`placement.rollout.colocate_with`,
    `placement.train.lend_to`): a local run then takes turns on them."""
    return bool(cfg.placement.rollout.colocate_with or cfg.placement.train.lend_to)


def make_plan(cfg: RecipeConfig, *, ray_nodes: Callable[[], Sequence[Mapping[str, Any]] | None] | None = None) -> tuple[Plan, str]:
    """The recipe's plan and where its cluster came from.

    Raises:
        ConfigError: the plan is infeasible (naming the role) or the cluster is malformed.
    """
    resources, source = resources_of(cfg, ray_nodes=ray_nodes)
    try:
        plan = schedule(resources, roles_of(cfg))
    except PlacementError as e:
        raise ConfigError(f"placement: {e}") from None
    _check_one_vendor_trainer(plan)
    return plan, source


def check_seatable(cfg: RecipeConfig, plan: Plan) -> None:
    """Under `runtime: ray`, where each actor of `plan` would sit (`flow.colocate.spots`):
    one rule for `tidal run` (`tools.run.check_plan`, and the Ray driver's `role_bundles`)
    and `tidal plan`. A local run seats its shared devices in one process: nothing to check.

    Raises:
        ConfigError: a shared layout the Ray runtime cannot seat, naming the keys to change.
    """
    if cfg.runtime.value != "ray":
        return
    from tidal.flow.colocate import spots  # noqa: PLC0415 - imports torch

    try:
        spots(plan)
    except PlacementError as e:
        raise ConfigError(f"placement: {e}") from None


def _check_one_vendor_trainer(plan: Plan) -> None:
    """Refuse trainer instances on devices of several kinds: they are the ranks of one
    process group, whose collective backend is one vendor's (a fake cluster's CPU group
    would not notice). Rollout instances are independent engines and may mix kinds.

    Raises:
        ConfigError: naming `placement.train.requires`.
    """
    train = plan.of("train", mode="own")
    nodes: dict[str, list[str]] = {}
    for a in train:
        if a.node not in nodes.setdefault(a.kind, []):
            nodes[a.kind].append(a.node)
    if len(nodes) > 1:
        where = " and ".join(f"{kind} ({', '.join(names)})" for kind, names in nodes.items())
        raise ConfigError(
            f"placement.train: its {len(train)} instances are on {where} devices; the trainer's ranks form one process group, "
            f"which runs on one device kind: set placement.train.requires to one kind (e.g. [{next(iter(nodes))}]) or fewer placement.train.count"
        )


def cluster_rows(resources: Sequence[Resource]) -> list[list[str]]:
    rows = [["node", "kind", "devices", "tags"]]
    for r in resources:
        rows.append([r.node, r.kind, str(r.capacity), ", ".join(sorted(r.tags))])
    return rows
