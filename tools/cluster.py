"""The cluster checks of `tidal doctor --cluster` and of `tidal run` on a Ray cluster.

Both probe every node of the cluster at RAY_ADDRESS (`flow.ray.cluster.probe_cluster`)
and list what would break a run there: versions that differ from the driver's, a node that
advertises devices without their vendor's torch, nodes that cannot connect to each other,
and, given a recipe, roles that the cluster's nodes cannot hold. `tidal run` refuses the
cluster with that list before it starts an actor.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tidal.tools.config import ConfigError, RecipeConfig, load_config
from tidal.tools.recipes import resolve_recipe

if TYPE_CHECKING:
    from tidal.flow.placement import Plan
    from tidal.flow.ray.cluster import NodeReport


@dataclasses.dataclass
class ClusterCheck:
    """The nodes as their probes saw them, and each problem found (empty: none)."""

    address: str
    nodes: list[Any]
    problems: list[str]


def check_cluster(cfg: RecipeConfig | None = None) -> ClusterCheck:
    """Probe the cluster this process joined (`ray.init(address=...)`), and with a recipe
    plan its roles on the cluster's own nodes (not `cluster.nodes`, which describes the
    cluster the recipe expects) and check, on each node the plan gives a role, that the
    role's engine can run there (installed, on that kind of device: `RecipeEngineCheck`).

    Raises:
        TimeoutError: a node's probe did not answer (`probe_cluster`).
    """
    import ray  # noqa: PLC0415

    from tidal.flow.ray.cluster import cluster_problems, probe_cluster  # noqa: PLC0415
    from tidal.flow.ray.placement import ray_address  # noqa: PLC0415
    from tidal.hal.versions import package_versions  # noqa: PLC0415
    from tidal.tools.plan import make_plan  # noqa: PLC0415
    from tidal.tools.run import RecipeEngineCheck  # noqa: PLC0415

    fake = bool(cfg and cfg.cluster.fake)
    reports = probe_cluster(check=RecipeEngineCheck.of(cfg, fake=fake) if cfg is not None else None)
    problems = cluster_problems(reports, driver_versions=package_versions(), fake=fake)
    if cfg is not None:
        on_ray = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, nodes=[]))
        try:
            plan, _ = make_plan(on_ray, ray_nodes=ray.nodes)
        except ConfigError as e:
            problems.append(f"recipe {cfg.name!r} cannot be placed on this cluster's nodes: {e}")
        else:
            problems += engine_problems(plan, reports)
    return ClusterCheck(address=ray_address() or "", nodes=reports, problems=problems)


def engine_problems(plan: Plan, reports: Sequence[NodeReport]) -> list[str]:
    """One sentence per node and role of `plan` whose engine that node's probe found it
    cannot run (`NodeReport.engines`), naming the node, the role's instances and the fix."""
    node_ids = {r.node: r.ray_node_id for r in plan.resources}
    by_id = {r.node_id: r for r in reports}
    held: dict[tuple[str, str, str], list[int]] = {}  # (node id, role, kind) -> the role's ranks there
    for a in plan.assignments:
        if (node_id := node_ids.get(a.node)) is not None and node_id in by_id:
            held.setdefault((node_id, a.role, a.kind), []).append(a.rank)
    problems = []
    for (node_id, role, kind), ranks in held.items():
        report = by_id[node_id]
        if why := report.engines.get(kind, {}).get(role):
            problems.append(
                f"node {report.name} ({report.kinds}) would hold {role} instance(s) {', '.join(map(str, sorted(set(ranks))))}, "
                f"but {why}; or keep {role} off the node (placement.{role}.requires)"
            )
    return problems


def refuse_bad_cluster(cfg: RecipeConfig) -> None:
    """`tidal run` on a cluster it joined (RAY_ADDRESS): the checks, before any actor starts.

    Raises:
        ConfigError: listing every problem, each naming its node.
    """
    found = check_cluster(cfg)
    if found.problems:
        raise ConfigError(f"the Ray cluster at {found.address} cannot run this recipe (`tidal doctor --cluster` shows every node):\n" + "\n".join(f"  - {p}" for p in found.problems))


def join_cluster() -> str:
    """Connect this process to the cluster at RAY_ADDRESS; its address.

    Raises:
        ConfigError: RAY_ADDRESS is not set.
    """

    import ray  # noqa: PLC0415

    from tidal.flow.ray.placement import ray_address  # noqa: PLC0415

    address = ray_address()
    if address is None:
        raise ConfigError("RAY_ADDRESS is not set: `tidal doctor --cluster` checks the Ray cluster that address names (docs/deploy.md), e.g. RAY_ADDRESS=10.0.0.1:6379")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    return address


SHARED_VERSIONS = ("tidal-rl", "python", "ray", "torch")
"""Versions shown once above the node table when every node runs the same (the usual case),
else in a column each."""


def render(found: ClusterCheck, console: Any = None) -> None:
    """The nodes as a table that fits the terminal: versions every node shares said once
    above it, a node's address only where its name is not its address; where the table is
    still wider than the terminal, one block of lines per node instead."""
    from rich.console import Console  # noqa: PLC0415
    from rich.markup import escape  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    console = console or Console(highlight=False)
    rows = [_node_fields(r, len(found.nodes)) for r in found.nodes]
    shared = {k: rows[0][k] for k in SHARED_VERSIONS if rows and all(row[k] == rows[0][k] for row in rows)}
    columns = [c for c in rows[0] if c not in shared and (c != "address" or any(row["address"] != row["node"] for row in rows))] if rows else ["node"]
    title = f"Ray cluster at {found.address}: {len(found.nodes)} node(s)"
    table = Table(title=title)
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*(escape(row[c]) if c != "reaches" else row[c] for c in columns))
    if shared:
        console.print("every node runs " + ", ".join(f"{k} {escape(v)}" for k, v in shared.items()))
    if _natural_width(table) <= console.width:  # rich would squeeze the columns of a wider one to a few letters each
        console.print(table)
    else:  # too wide for this terminal: one node at a time
        console.print(title)
        for row in rows:
            console.print(f"[bold]{escape(row['node'])}[/]")
            for c in columns[1:]:
                console.print(f"  {c}: {escape(row[c]) if c != 'reaches' else row[c]}", soft_wrap=True)
    if found.problems:
        console.print(f"[bold red]{len(found.problems)} problem(s) would break a run:[/]")
        for p in found.problems:
            console.print(f"  - {escape(p)}", soft_wrap=True)
    else:
        console.print("no problem found: every node runs the driver's tidal, python and ray, has its devices' stacks, and reaches every other node")


def _natural_width(table: Any) -> int:
    """How wide `table` prints where nothing makes it wrap."""
    import io  # noqa: PLC0415

    from rich.console import Console  # noqa: PLC0415

    wide = Console(width=10_000, file=io.StringIO(), color_system=None)
    with wide.capture() as captured:
        wide.print(table)
    return max(map(len, captured.get().splitlines()), default=0)


def _node_fields(r: NodeReport, count: int) -> dict[str, str]:
    """One node's row, column -> text (`reaches` is rich markup, the rest plain)."""
    from tidal.hal.versions import VENDOR_PACKAGES  # noqa: PLC0415

    builtin = {"CPU", "GPU", "NPU", "memory", "object_store_memory"}
    tags = sorted(k for k in r.resources if k not in builtin and not k.startswith(("node:", "accelerator_type:", "tidal_node_")))
    vendor = ", ".join(f"{p} {r.versions.get(p)}" for p in VENDOR_PACKAGES if r.versions.get(p, "not installed") != "not installed") or "-"
    reaches = "all" if not r.unreachable else f"[red]{count - 1 - len(r.unreachable)} of {count - 1}[/]"
    free = "?" if r.free is None else ", ".join(f"{r.free.get(name, 0):g} {name}" for name in ("NPU", "GPU", "CPU") if r.resources.get(name))
    return {
        "node": r.name, "address": r.address, "devices": r.kinds, "free": free, "tags": ", ".join(tags) or "-",
        **{k: r.versions.get(k, "?") for k in SHARED_VERSIONS}, "vendor": vendor, "reaches": reaches,
    }  # fmt: skip


def as_json(found: ClusterCheck) -> dict[str, Any]:
    return {"address": found.address, "nodes": [dataclasses.asdict(r) for r in found.nodes], "problems": found.problems}


def doctor_cluster(recipe: str | None, overrides: Sequence[str], *, clean: bool, as_json_output: bool) -> int:
    """`tidal doctor --cluster [--recipe RECIPE key=value ...]`: join the cluster at RAY_ADDRESS,
    probe it and print what it found; 1 when a problem was found, else 0.

    Raises:
        ConfigError: `--clean` given (it cleans one machine's /dev/shm), or a bad recipe or override.
    """
    if clean:
        raise ConfigError("--clean cleans this machine's /dev/shm; run `tidal doctor --clean` on each node")
    cfg = load_config(resolve_recipe(recipe), list(overrides)) if recipe else None
    join_cluster()
    found = check_cluster(cfg)
    if as_json_output:
        print(json.dumps(as_json(found), indent=2))
    else:
        render(found)
    return 1 if found.problems else 0
