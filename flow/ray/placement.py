"""Ray placement for `runtime: ray`: a placement plan (`flow.placement`) as Ray bundles,
placement groups and actor options.

Each role's devices become one bundle per instance (`{"GPU": 2}`, `{"NPU": 1}`, plus the
custom resources its tags need), packed into a placement group per role; an actor is
scheduled on its bundle with `TIDAL_DEVICE` naming the devices (or a fake platform) it
selects in its own process. Ray is imported only when a placement group is made.

When the plan's cluster was read off Ray (`flow.placement.resources_from_ray_nodes`, what
`tidal run` does without `cluster.nodes`), each bundle is pinned to the node the plan chose
(a `ray.io/node-id` label selector), so the run sits where `tidal plan` says: left to
PACK, Ray could put the trainer's 4 devices on an 8-device node, and an 8-device rollout
instance that the plan had placed there would wait for a node that no longer has room.
The trainer's bundles are packed, not pinned: once its ranks run, the driver checks that a
rollout guest spanning several of them has them on one node (`check_guests_on_one_node`).
"""

from __future__ import annotations

import collections
import os
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from tidal.flow.placement import KIND_TAGS, RAY_RESOURCES, Assignment, PlacementError, Plan

KIND_TAG_NAMES = frozenset(t for tags in KIND_TAGS.values() for t in tags)
"""Tags a device has by its kind; any other tag a role requires is a custom Ray resource."""

RESOURCE_WAIT_S = 30.0
"""How long a placement group may wait for its resources before the run fails naming the role."""


class RuntimeUnavailable(RuntimeError):
    """The Ray cluster the recipe needs cannot be reached; the message says how to start one."""


def ray_address() -> str | None:
    """The Ray cluster `runtime: ray` joins, one rule for `tidal run` and `tidal plan`:
    RAY_ADDRESS when set; None: `tidal run` starts a local Ray of its own (`tools.ray_run.init_ray`),
    whose nodes are this machine, even where another Ray is running."""
    return os.environ.get("RAY_ADDRESS") or None


def connected_ray_nodes() -> Sequence[Mapping[str, Any]] | None:
    """`ray.nodes()` of the cluster a run would join (`ray_address`), joined now; None where
    a run would start its own: its plan is then this machine's, and nothing is started."""
    address = ray_address()
    if address is None:
        return None
    import ray  # noqa: PLC0415

    if not ray.is_initialized():
        try:
            ray.init(address=address, include_dashboard=False, logging_level="ERROR", log_to_driver=False)  # type: ignore[arg-type]  # a level's name works too
        except ConnectionError as e:
            raise RuntimeUnavailable(
                f"no Ray cluster at RAY_ADDRESS={address} ({e}); start one with `ray start --head`, unset RAY_ADDRESS "
                "(a run then starts a Ray of its own), or list the nodes in cluster.nodes"
            ) from None
    return ray.nodes()


# Placement groups ------------------------------------------------------------------------
NODE_ID_LABEL = "ray.io/node-id"
"""The label every Ray node carries: its `NodeID`, which pins a bundle to that node."""
TAG_AMOUNT = 0.001
"""How much of a custom-tag resource one bundle asks for: the tag is a label, not a quantity."""


def bundle_of(assignment: Assignment, tags: Mapping[str, float] | None = None) -> dict[str, float]:
    """The Ray resources of one role instance: its devices, counted by its kind's resource,
    plus a sliver of each custom tag resource its role requires (so Ray picks a node carrying it)."""
    return {RAY_RESOURCES[assignment.kind]: float(len(assignment.devices)), **(tags or {})}


def largest_node_resources(nodes: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The most of each device resource (CPU, GPU, NPU) that one alive node of `ray.nodes()` has."""
    out: dict[str, float] = {}
    for node in nodes:
        if node.get("Alive", True):
            for key in RAY_RESOURCES.values():
                out[key] = max(out.get(key, 0.0), float(node.get("Resources", {}).get(key, 0.0)))
    return out


def role_bundles(plan: Plan, have: Mapping[str, float], *, largest: Mapping[str, float] | None = None) -> dict[str, list[dict[str, float]]]:
    """Each role's bundles, checked against the cluster's resources `have`, which all the
    roles' bundles share, and against `largest` (`largest_node_resources`): one bundle is
    one instance, on one node. Ray would otherwise keep such a group waiting.

    A tag a role requires beyond its kind's (`requires: [gpu, fast]`) must be a custom
    resource of the Ray nodes that carry it (`fast`, or `accelerator_type:fast`).

    Only instances with devices of their own have bundles: one that time-shares a
    trainer's devices (colocated, borrowed) sits on that trainer's bundle (`flow.colocate.spots`).

    Raises:
        PlacementError: a role needs more than the cluster has beside the roles before it,
            an instance needs more devices than any node has, a tag no node declares, or
            a shared layout `flow.colocate.spots` cannot seat.
    """
    from tidal.flow.colocate import spots  # noqa: PLC0415

    spots(plan)  # a shared layout this runtime cannot seat fails here, before anything starts
    out: dict[str, list[dict[str, float]]] = {}
    taken: collections.Counter[str] = collections.Counter()  # by the roles before this one
    for role in plan.roles:
        if not plan.of(role.name, mode="own"):
            continue
        tags = _tag_slivers(role.name, role.requires, have)
        bundles = [bundle_of(a, tags) for a in plan.of(role.name, mode="own")]
        need: collections.Counter[str] = collections.Counter()
        for b in bundles:
            need.update(b)
        short = {k: v for k, v in need.items() if have.get(k, 0.0) - taken[k] < v - 1e-9}
        if short:
            what = ", ".join(f"{v:g} {k} (the cluster has {have.get(k, 0.0):g}{_taken_by(k, taken, out)})" for k, v in short.items())
            raise PlacementError(f"cannot place role {role.name!r} on this Ray cluster: it needs {what}")
        _check_one_node(role.name, bundles, largest)
        taken.update(need)
        out[role.name] = bundles
    return out


def _tag_slivers(role: str, requires: Sequence[str], have: Mapping[str, float]) -> dict[str, float]:
    """A sliver of the custom resource of each tag `requires` names beyond the device kind's."""
    tags: dict[str, float] = {}
    for tag in requires:
        if tag in KIND_TAG_NAMES:
            continue
        key = tag if tag in have else f"accelerator_type:{tag}"
        if key not in have:
            raise PlacementError(f"cannot place role {role!r}: it requires tag {tag!r}, and no Ray node declares a resource {tag!r} (start the nodes with --resources '{{\"{tag}\": 1}}')")
        tags[key] = TAG_AMOUNT
    return tags


def _check_one_node(role: str, bundles: Sequence[Mapping[str, float]], largest: Mapping[str, float] | None) -> None:
    if largest is None:
        return
    for key in RAY_RESOURCES.values():
        most = max((b.get(key, 0.0) for b in bundles), default=0.0)
        if most > largest.get(key, 0.0) + 1e-9:
            raise PlacementError(
                f"cannot place role {role!r} on this Ray cluster: one instance needs {most:g} {key} on one node, and no node has more than "
                f"{largest.get(key, 0.0):g}; set placement.{role}.devices_each to at most that"
            )


def _taken_by(key: str, taken: Mapping[str, float], earlier: Mapping[str, list[dict[str, float]]]) -> str:
    if not taken.get(key):
        return ""
    return f", of which {taken[key]:g} go to {', '.join(r for r, bundles in earlier.items() if any(key in b for b in bundles))}"


def node_selectors(plan: Plan, role: str) -> list[dict[str, str]] | None:
    """A label selector per bundle of `role` (its own instances, in bundle order) pinning it
    to the Ray node the plan put it on; None where the plan's nodes are not Ray's (a recipe's
    `cluster.nodes`: Ray chooses, packing each role's bundles)."""
    node_ids = {r.node: r.ray_node_id for r in plan.resources}
    own = plan.of(role, mode="own")
    if not own or not all(node_ids.get(a.node) for a in own):
        return None
    return [{NODE_ID_LABEL: str(node_ids[a.node])} for a in own]


def placement_groups(plan: Plan, *, wait_s: float = RESOURCE_WAIT_S) -> dict[str, Any]:
    """One placement group per role (a bundle per instance, packed, each pinned to its
    plan's node where the plan was read off Ray: `node_selectors`); fails fast naming the role.

    Raises:
        PlacementError: the cluster lacks the resources (checked against
            `ray.cluster_resources()` and its largest node first, see `role_bundles`), or a
            group is not ready within `wait_s`.
    """
    import ray  # noqa: PLC0415
    from ray.util.placement_group import placement_group  # noqa: PLC0415

    groups: dict[str, Any] = {}
    for role, bundles in role_bundles(plan, ray.cluster_resources(), largest=largest_node_resources(ray.nodes())).items():
        selectors = node_selectors(plan, role)
        pg = placement_group(bundles, strategy="PACK", name=f"tidal-{role}-{secrets.token_hex(3)}", bundle_label_selector=selectors)
        ready, _ = ray.wait([pg.ready()], timeout=wait_s)
        if not ready:
            ray.util.remove_placement_group(pg)
            for other in groups.values():
                ray.util.remove_placement_group(other)
            nodes = list(dict.fromkeys(a.node for a in plan.of(role, mode="own")))
            where = f" on the node(s) the plan chose ({', '.join(nodes)}: one may have left the cluster since; `ray status` lists the nodes, and a new run plans on them as they are)" if selectors else ""
            raise PlacementError(f"cannot place role {role!r}: its {len(bundles)} bundle(s) {bundles[0]} were not granted{where} within {wait_s:.0f}s (other runs may hold them)")
        groups[role] = pg
    return groups


def actor_options(assignment: Assignment, pg: Any, index: int, *, fake: bool, env: Mapping[str, str] | None = None, resources: Mapping[str, float] | None = None) -> dict[str, Any]:
    """`.options(...)` for the actor of one assignment: its bundle, and the platform it must select.

    `resources`: what it asks of the bundle (a time-shared bundle's seats ask for a part,
    see `flow.colocate.spots`); by default all of the assignment's devices.
    """
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: PLC0415

    resources = dict(resources) if resources is not None else bundle_of(assignment)  # the tags' slivers stay with the bundle: they only steer where it goes
    options: dict[str, Any] = {
        "scheduling_strategy": PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index),
        "runtime_env": {"env_vars": {"TIDAL_DEVICE": assignment.platform_spec(fake=fake), **(env or {})}},
        "num_cpus": resources.pop("CPU", 0.0),
    }
    if "GPU" in resources:
        options["num_gpus"] = resources.pop("GPU")
    if resources:
        options["resources"] = resources
    return options


def check_guests_on_one_node(placed: Mapping[tuple[str, int], Any], where: Sequence[Mapping[str, Any]]) -> None:
    """A rollout guest of several trainer ranks' devices gets all of them
    (`flow.ray.rollouts.visible_devices`): the ranks must be on one node, which the trainer's
    "PACK" placement group prefers but does not promise. `placed`: `flow.colocate.spots`;
    `where`: each rank's `TrainerActor.where`.

    Raises:
        PlacementError: naming the rollout instance, the ranks, their nodes and the fix.
    """
    for (role, rank), spot in placed.items():
        nodes = sorted({where[r]["node"] for r in spot.turns})
        if role == "rollout" and len(nodes) > 1:
            raise PlacementError(
                f"rollout instance {rank} time-shares the devices of trainer ranks {list(spot.turns)}, which Ray placed on {len(nodes)} nodes ({', '.join(nodes)}): "
                "one process uses devices of one node; set placement.rollout.devices_each=1 (a guest per trainer rank), or give the trainer one node's devices"
            )
