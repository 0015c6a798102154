"""Tag-driven placement: which role instance runs on which node's devices, and when.

A cluster is a list of `Resource`s (devices of one kind on one node, carrying tags); a
run is a list of `Role`s (what tags their devices must carry, how many instances, how
many devices each). One greedy scheduler turns them into a `Plan`, and the four layouts
are four configurations of the roles, not four code paths:

- **disaggregated**: every role on devices of its own;
- **colocated**: `Role(colocate_with="train")`: the role's instances time-share the
  devices of `train` (rollout sleeps/offloads through the HAL while training runs);
- **hybrid**: a colocated role with more instances than the host's devices hold: the
  rest go to free devices that carry its tags;
- **multiplexed**: `Role(lend_to="rollout")` on `train`: while the trainer waits for
  data its devices run extra rollout instances (`borrowed`), reclaimed before the next
  optimizer step (their generations pause through partial rollout and resume with the
  seat's next turn; `flow.colocate` runs the shared layouts).

An infeasible request is a `PlacementError` naming the role and what it lacked, raised
before anything starts. Nothing here imports Ray or torch: under `runtime: ray` the plan
is turned into placement groups by `flow.ray.placement`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

KIND_TAGS = {"cuda": ("cuda", "gpu"), "npu": ("npu",), "cpu": ("cpu",)}
"""Tags every device of a kind carries implicitly (so `requires: [gpu]` matches CUDA nodes)."""
RAY_RESOURCES = {"cuda": "GPU", "npu": "NPU", "cpu": "CPU"}
"""The Ray resource that counts a kind's devices (`PlatformDescriptor.ray_resource`)."""
_RAY_BUILTIN = {"CPU", "GPU", "NPU", "memory", "object_store_memory"}


class PlacementError(ValueError):
    """A role cannot be placed; the message names the role and what it lacked."""


MAX_CAPACITY = 65_536
"""The most devices one node may have: far above any machine's accelerators or CPUs, and
low enough that a count with digits too many is an error rather than a planner listing
every device until memory runs out."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Resource:
    """`capacity` devices of one `kind` on `node`, carrying `tags`."""

    node: str
    kind: str
    capacity: int
    tags: frozenset[str] = frozenset()
    ray_node_id: str | None = None
    """The Ray node (`ray.nodes()`'s `NodeID`) these devices are on, for a cluster read off
    Ray: its placement groups are pinned to the node the plan chose (`flow.ray.placement`).
    None for a recipe's `cluster.nodes`, whose names are not Ray's."""

    def __post_init__(self) -> None:
        if self.kind not in KIND_TAGS:
            raise PlacementError(f"node {self.node!r}: kind {self.kind!r} is not one of {', '.join(KIND_TAGS)}")
        if not 0 <= self.capacity <= MAX_CAPACITY:
            raise PlacementError(f"node {self.node!r}: capacity must be in 0..{MAX_CAPACITY:,} (devices, or CPUs of a CPU node), got {self.capacity:,}")
        object.__setattr__(self, "tags", frozenset(self.tags) | frozenset(KIND_TAGS[self.kind]))

    def offers(self, requires: Iterable[str]) -> bool:
        return set(requires) <= self.tags


@dataclasses.dataclass(frozen=True, kw_only=True)
class Role:
    """What a role needs: devices carrying `requires`, `count` instances of `devices_each`."""

    name: str
    requires: tuple[str, ...] = ()
    """Tags every device of an instance must carry (its node's kind and tags)."""
    count: int = 1
    """Instances (data-parallel workers or engine replicas)."""
    devices_each: int = 1
    """Devices one instance spans, all on one node (e.g. a tensor-parallel group)."""
    colocate_with: str | None = None
    """Time-share the devices of this role; instances beyond its devices go to free ones (hybrid)."""
    lend_to: str | None = None
    """While this role waits for data its devices run instances of that role (multiplexed)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "requires", tuple(self.requires))
        if self.count < 1:
            raise PlacementError(f"role {self.name!r}: count must be >= 1, got {self.count}")
        if self.devices_each < 1:
            raise PlacementError(f"role {self.name!r}: devices_each must be >= 1, got {self.devices_each}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Assignment:
    """One role instance on one node's devices."""

    role: str
    rank: int
    """Index of the instance within its role (borrowed instances follow the role's own)."""
    node: str
    kind: str
    devices: tuple[int, ...]
    """Device indices on the node."""
    mode: str = "own"
    """`own`, `colocated` (time-shares a host role's devices) or `borrowed` (runs on a lender's idle devices)."""
    shares_with: tuple[str, ...] = ()
    """Roles that also use these devices."""

    def platform_spec(self, *, fake: bool) -> str:
        """The `TIDAL_DEVICE` value for the process of this instance."""
        return f"fake:{self.kind}:{len(self.devices)}" if fake else self.kind


@dataclasses.dataclass(frozen=True)
class Plan:
    """The result of scheduling: every assignment, in role order."""

    assignments: tuple[Assignment, ...]
    resources: tuple[Resource, ...]
    roles: tuple[Role, ...]

    def of(self, role: str, *, mode: str | None = None) -> list[Assignment]:
        return [a for a in self.assignments if a.role == role and (mode is None or a.mode == mode)]

    @property
    def layout(self) -> str:
        """colocated, hybrid, multiplexed or disaggregated (what `tidal plan` calls it)."""
        modes = {a.mode for a in self.assignments}
        if "borrowed" in modes:
            return "multiplexed"
        colocated_roles = {a.role for a in self.assignments if a.mode == "colocated"}
        if any(self.of(role, mode="own") for role in colocated_roles):
            return "hybrid"
        return "colocated" if colocated_roles else "disaggregated"

    def table(self) -> list[list[str]]:
        """Rows for printing, header first; consecutive instances alike but for rank share a row."""
        rows = [["role", "ranks", "node", "kind", "devices", "each", "mode", "time-shares with"]]
        groups: list[list[Assignment]] = []
        for a in self.assignments:
            last = groups[-1][-1] if groups else None
            alike = last is not None and (last.role, last.node, last.mode, last.shares_with, len(last.devices)) == (a.role, a.node, a.mode, a.shares_with, len(a.devices))
            if alike and last is not None and last.rank + 1 == a.rank:
                groups[-1].append(a)
            else:
                groups.append([a])
        for g in groups:
            first = g[0]
            ranks = _span([a.rank for a in g])
            devices = _span([d for a in g for d in a.devices])
            rows.append([first.role, ranks, first.node, first.kind, devices, str(len(first.devices)), first.mode, ", ".join(first.shares_with) or "-"])
        return rows

    def to_dict(self) -> dict[str, Any]:
        """The layout, the cluster it was placed on (each node's kind, capacity and every tag
        it offers, its kind's included) and every assignment: what `tidal plan --json` prints."""
        cluster = [{"node": r.node, "kind": r.kind, "capacity": r.capacity, "tags": sorted(r.tags), **({"ray_node_id": r.ray_node_id} if r.ray_node_id else {})} for r in self.resources]
        return {"layout": self.layout, "cluster": cluster, "assignments": [dataclasses.asdict(a) for a in self.assignments]}


def schedule(resources: Sequence[Resource], roles: Sequence[Role]) -> Plan:
    """Place every role; raise `PlacementError` naming the first role that does not fit.

    Roles with devices of their own are placed first, in the given order, each instance
    on a node with room that the role already uses (else one of a device kind it already
    uses, else any), so a role packs onto few nodes of one vendor; among those, on the one
    with the fewest free devices that fit it (`_pick`). On a
    cluster with NPUs or GPUs only roles that require `cpu` get CPU nodes (`_serves`).
    Colocated roles follow on their host's devices; then each lender's own devices are
    lent out (two roles may not lend to each other: each would borrow its own devices
    back).
    """
    by_name = {r.name: r for r in roles}
    if len(by_name) != len(roles):
        raise PlacementError(f"role names repeat: {[r.name for r in roles]}")
    nodes = [r.node for r in resources]
    if len(set(nodes)) != len(nodes):
        raise PlacementError(f"node names repeat: {nodes}")
    for role in roles:
        for other, what in ((role.colocate_with, "colocate_with"), (role.lend_to, "lend_to")):
            if other is not None and (other not in by_name or other == role.name):
                raise PlacementError(f"role {role.name!r}: {what}={other!r} names no other role; roles: {', '.join(by_name)}")
        if role.colocate_with and by_name[role.colocate_with].colocate_with:
            raise PlacementError(f"role {role.name!r}: colocate_with={role.colocate_with!r}, which is itself colocated; name the role that owns the devices")
        if role.lend_to and by_name[role.lend_to].lend_to == role.name:
            raise PlacementError(
                f"role {role.name!r} lend_to={role.lend_to!r} and role {role.lend_to!r} lend_to={role.name!r}: each would borrow its own devices back "
                "through the other; keep the lend_to of the role that waits for data"
            )

    free = {r.node: list(range(r.capacity)) for r in resources}
    owners: dict[tuple[str, int], list[str]] = {}
    placed: dict[str, list[Assignment]] = {}
    accelerated = _has_accelerators(resources)

    def take(role: Role, rank: int, res: Resource, devices: list[int], mode: str) -> Assignment:
        for d in devices:
            owners.setdefault((res.node, d), []).append(role.name)
        return Assignment(role=role.name, rank=rank, node=res.node, kind=res.kind, devices=tuple(devices), mode=mode)

    def place_own(role: Role, ranks: range) -> list[Assignment]:
        out: list[Assignment] = []
        for rank in ranks:
            fits = [r for r in resources if _serves(r, role, accelerated=accelerated) and len(free[r.node]) >= role.devices_each]
            if not fits:
                raise PlacementError(_explain(role, resources, free, missing=ranks.stop - rank, placed_before=rank))
            res = _pick(fits, out, free)
            devices, free[res.node] = free[res.node][: role.devices_each], free[res.node][role.devices_each :]
            out.append(take(role, rank, res, devices, "own"))
        return out

    for role in roles:
        if role.colocate_with is None:
            placed[role.name] = place_own(role, range(role.count))
    for role in roles:
        if role.colocate_with is None:
            continue
        host = role.colocate_with
        out: list[Any] = []
        for res, spare in _devices_by_node(placed[host], resources):
            if not res.offers(role.requires):
                continue
            while len(out) < role.count and len(spare) >= role.devices_each:
                devices, spare = spare[: role.devices_each], spare[role.devices_each :]
                out.append(take(role, len(out), res, devices, "colocated"))
        if not out:
            raise PlacementError(
                f"role {role.name!r} cannot colocate with {host!r}: no node holds {role.devices_each} of {host}'s devices "
                f"carrying {list(role.requires) or 'any tag'}"
            )
        out += place_own(role, range(len(out), role.count))
        placed[role.name] = out
    for role in roles:
        if role.lend_to is None:
            continue
        borrower = by_name[role.lend_to]
        owned = [a for a in placed[role.name] if a.mode == "own"]  # not the host's devices it time-shares
        if not owned:
            raise PlacementError(f"role {role.name!r} cannot lend to {borrower.name!r}: it holds no devices of its own (colocate_with={role.colocate_with!r})")
        extra = []
        rank = len(placed[borrower.name])
        for res, spare in _devices_by_node(owned, resources):
            if not res.offers(borrower.requires):
                continue
            while len(spare) >= borrower.devices_each:
                devices, spare = spare[: borrower.devices_each], spare[borrower.devices_each :]
                extra.append(take(borrower, rank, res, devices, "borrowed"))
                rank += 1
        if not extra:
            raise PlacementError(
                f"role {role.name!r} cannot lend to {borrower.name!r}: no node holds {borrower.devices_each} of its devices "
                f"carrying {list(borrower.requires) or 'any tag'}"
            )
        placed[borrower.name] += extra

    assignments = []
    for role in roles:
        for a in placed[role.name]:
            shares = sorted({o for d in a.devices for o in owners[(a.node, d)]} - {role.name})
            assignments.append(dataclasses.replace(a, shares_with=tuple(shares)))
    return Plan(tuple(assignments), tuple(resources), tuple(roles))


def _has_accelerators(resources: Sequence[Resource]) -> bool:
    return any(r.kind != "cpu" and r.capacity > 0 for r in resources)


def _serves(res: Resource, role: Role, *, accelerated: bool) -> bool:
    """Whether `res` may hold devices of `role` itself (not time-shared ones).

    On a cluster with NPUs or GPUs a role gets CPU "devices" only when it requires `cpu`:
    a role that names no tag (the default) must not fall back to a CPU-only node, such as
    a Ray head node, and train or generate there (DESIGN: no silent CPU fallback).
    """
    return res.offers(role.requires) and not (accelerated and res.kind == "cpu" and "cpu" not in role.requires)


def _pick(fits: Sequence[Resource], placed: Sequence[Assignment], free: Mapping[str, list[int]]) -> Resource:
    """The node for a role's next instance: among the nodes the role already uses, else those
    of a device kind it already uses (so its ranks stay on one vendor where they can), else
    all that fit, the one with the fewest free devices (best fit; the first of equals).

    Best fit keeps large free blocks for instances that need them: first fit put a 4-device
    instance on an 8-device node beside a free 4-device one, and an 8-device instance of the
    next role then fit nowhere.
    """
    used = {a.node for a in placed}
    kinds = {a.kind for a in placed}
    preferred = [r for r in fits if r.node in used] or [r for r in fits if r.kind in kinds] or list(fits)
    return min(preferred, key=lambda r: len(free[r.node]))


def _devices_by_node(assignments: Sequence[Assignment], resources: Sequence[Resource]) -> list[tuple[Resource, list[int]]]:
    """A role's devices grouped by node, in placement order."""
    by_node: dict[str, list[int]] = {}
    for a in assignments:
        by_node.setdefault(a.node, []).extend(a.devices)
    return [(next(r for r in resources if r.node == node), devices) for node, devices in by_node.items()]


def _explain(role: Role, resources: Sequence[Resource], free: Mapping[str, list[int]], *, missing: int, placed_before: int) -> str:
    matching = [r for r in resources if _serves(r, role, accelerated=_has_accelerators(resources))]
    wants = f"{role.count} instance(s) x {role.devices_each} device(s) carrying {list(role.requires) or 'any tag'} on one node each"
    if not matching:
        have = ", ".join(f"{r.node} ({r.kind}: {', '.join(sorted(r.tags))})" for r in resources) or "no nodes"
        cpu_only = any(r.offers(role.requires) for r in resources)  # only CPU nodes would: they need an explicit cpu tag
        hint = "; CPU nodes of a cluster with NPUs or GPUs take only roles with requires: [cpu]" if cpu_only else ""
        return f"cannot place role {role.name!r}: it needs {wants}, and no node offers those tags{hint}; nodes: {have}"
    room = ", ".join(f"{r.node} {len(free[r.node])}/{r.capacity} free" for r in matching)
    return (
        f"cannot place role {role.name!r}: it needs {wants}; {placed_before} placed, {missing} more do not fit. "
        f"Matching nodes: {room}"
    )


def _span(devices: Sequence[int]) -> str:
    if len(devices) > 1 and list(devices) == list(range(devices[0], devices[-1] + 1)):
        return f"{devices[0]}-{devices[-1]}"
    return ",".join(map(str, devices))


def resources_from_ray_nodes(nodes: Sequence[Mapping[str, Any]]) -> list[Resource]:
    """Resources of the alive nodes in `ray.nodes()` output.

    A node's NPU and GPU counts become npu and cuda resources, a node with neither
    offers its CPUs; custom resources (not `node:` or `accelerator_type:` entries) become
    tags, and `accelerator_type:X` becomes tag X. A resource is named by its node
    (`NodeName`, with `#<index>` added when an earlier node had the name), and by
    `<node>/npu` and `<node>/cuda` when the node carries both. Each resource keeps its
    node's `NodeID` (`Resource.ray_node_id`).
    """
    out = []
    names: set[str] = set()  # every node's name, and every resource's
    for i, node in enumerate(n for n in nodes if n.get("Alive", True)):
        res = node.get("Resources", {})
        name = node.get("NodeName") or node.get("NodeManagerAddress") or f"node{i}"
        name = f"{name}#{i}" if names & {name, f"{name}/npu", f"{name}/cuda"} else name
        tags = {k.split(":", 1)[1] if k.startswith("accelerator_type:") else k for k in res if k not in _RAY_BUILTIN and not k.startswith("node:")}
        tags = {t for t in tags if not t.startswith("tidal_node_")}
        node_id = node.get("NodeID") or None
        for kind in ("npu", "cuda"):
            if res.get(RAY_RESOURCES[kind], 0) >= 1:
                out.append(Resource(node=f"{name}/{kind}" if res.get("NPU") and res.get("GPU") else name, kind=kind, capacity=int(res[RAY_RESOURCES[kind]]), tags=frozenset(tags), ray_node_id=node_id))
        if not res.get("NPU") and not res.get("GPU"):
            out.append(Resource(node=name, kind="cpu", capacity=int(res.get("CPU", 0)), tags=frozenset(tags), ray_node_id=node_id))
        names |= {name, *(r.node for r in out)}
    return out
