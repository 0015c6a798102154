"""`tidal doctor`: what this machine is, as tidal sees it.

Prints the platform tidal would choose and why, its device count and identity, the
versions of the stacks tidal builds on (from `tidal.hal.versions`, which reads package
metadata and imports nothing), each rollout and train engine (installed or not, its
packages' versions, usable here or why not), and which shipped recipes can run here.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the CLI starts without loading the schema's imports
    from tidal.tools.config import RecipeConfig


def _can_run(cfg: RecipeConfig, *, kind_ok: dict[str, tuple[bool, str]], selected: str | None) -> tuple[bool, str]:
    """Whether recipe `cfg` runs here and why, given the platform doctor selected (None:
    it could not load) and each kind's availability."""
    from tidal.hal import ENV_VAR, check_spec  # noqa: PLC0415

    if cfg.runtime.name == "ray" and importlib.util.find_spec("ray") is None:
        return False, "runtime ray needs the ray package"
    from tidal.engines.registry import missing  # noqa: PLC0415

    kinds = sorted({node.kind for node in cfg.cluster.nodes} - {"cpu"})
    engines = (("rollout.backend", cfg.rollout.backend), ("train.backend", cfg.train.backend))
    on_cpu = [why for kind in kinds for key, name in engines if (why := missing(key, name, kind=kind, fake=True))]
    if kinds and (not cfg.cluster.fake or on_cpu):
        hint = f"; {on_cpu[0]}" if on_cpu else " (cluster.fake=true runs it on CPU)"
        return False, f"needs a Ray cluster with {' and '.join(kinds)} nodes{hint}"
    env = os.environ.get(ENV_VAR, "").strip()
    if env and check_spec(env) != "auto":  # it wins over the recipe's device, as when the recipe runs
        if selected:
            return True, f"{ENV_VAR} overrides its device; runs on {selected}"
        return False, f"{ENV_VAR}={env} overrides its device ({cfg.device}) and cannot load here (see the platform error)"
    device = cfg.device
    if device == "auto":
        return (True, f"device auto: runs on {selected}") if selected else (False, "no platform could load")
    if device.startswith("fake:"):
        return True, "fake platforms compute on CPU"
    ok, why = kind_ok[device]
    return ok, why


def shared_memory(*, clean: bool = False) -> dict[str, Any]:
    """`/dev/shm`, where the store and the weight transport put large buffers: whether it
    is usable, its free bytes, tidal's files in it now, and which of those killed
    processes left behind (`orphans`; `unknown`: files whose holder cannot be told, of
    another pid namespace or an older tidal). With `clean`, the orphans are deleted first
    and listed as `removed`."""
    from tidal.flow.store import shm  # noqa: PLC0415
    from tidal.hal import owner  # noqa: PLC0415

    removed = owner.sweep(shm.DIR) if clean else []
    files = shm.leftovers()
    holders = {name: owner.holder(name) for name in files}
    try:
        st = os.statvfs(shm.DIR)
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = 0
    return {
        "dir": shm.DIR,
        "usable": shm.host_id() is not None,
        "free_bytes": free,
        "files": files,
        "files_bytes": sum(files.values()),
        "orphans": [name for name, who in holders.items() if who == "gone"],
        "unknown": [name for name, who in holders.items() if who == "unknown"],
        "removed": removed,
    }


def engines(*, kind: str | None, fake: bool) -> list[dict[str, Any]]:
    """One row per registered rollout and train engine: the packages it needs beyond tidal's
    own and their versions, and whether it runs on this machine's platform (`kind`; None: no
    platform could load) or why not. Reads package metadata only (imports no engine)."""
    from tidal.engines.registry import ROLLOUT, TRAIN, missing, needs, version  # noqa: PLC0415

    rows = []
    for key, registry in (("rollout.backend", ROLLOUT), ("train.backend", TRAIN)):
        for name in registry:
            need = needs(key, name)
            packages = {p: version(p) or "not installed" for p in (*need.packages, *(p for kind_packages in need.on_kind.values() for p in kind_packages))}
            why = missing(key, name, kind=kind, fake=fake) if kind else "no platform could load"
            rows.append({"key": key, "engine": name, "packages": packages, "usable": why is None, "why": why or f"runs on {kind}{' (fake: on CPU)' if fake else ''}"})
    return rows


def report(*, clean: bool = False) -> tuple[dict[str, Any], int]:
    """Everything doctor shows, as plain data, and the exit code (0, or 1 if no platform);
    `clean` deletes the files killed processes left in `/dev/shm` first."""
    from tidal.hal import PlatformError, select  # noqa: PLC0415
    from tidal.hal.versions import package_versions  # noqa: PLC0415
    from tidal.tools.config import ConfigError, load_config  # noqa: PLC0415
    from tidal.tools.recipes import shipped_recipes  # noqa: PLC0415

    data: dict[str, Any] = {"versions": package_versions(), "platform": None, "error": None, "recipes": [], "shared_memory": shared_memory(clean=clean)}
    code = 0
    try:
        sel = select.select_platform()
        data["platform"] = {
            "spec": sel.spec,
            "chosen_by": sel.chosen_by,
            "reason": sel.reason,
            **sel.platform.descriptor.to_dict(),
        }
        var = sel.platform.descriptor.visible_devices_var
        data["platform"]["visible_devices"] = os.environ.get(var, "<unset>") if var else "-"
    except PlatformError as e:
        data["error"] = str(e)
        code = 1
    selected = data["platform"]["spec"] if data["platform"] else None
    data["engines"] = engines(kind=data["platform"]["kind"] if data["platform"] else None, fake=bool(data["platform"] and data["platform"]["fake"]))
    kind_ok = select.availability()
    for path in shipped_recipes():
        entry: dict[str, Any] = {"recipe": path.stem, "path": str(path)}
        try:
            cfg = load_config(path)
            ok, why = _can_run(cfg, kind_ok=kind_ok, selected=selected)
            entry.update(description=cfg.description, device=cfg.device, runtime=cfg.runtime.name, runs_here=ok, why=why)
        except ConfigError as e:
            entry.update(description="", device="?", runtime="?", runs_here=False, why=f"invalid recipe: {e}")
        data["recipes"].append(entry)
    return data, code


def render(data: dict[str, Any]) -> None:
    from rich.console import Console  # noqa: PLC0415
    from rich.markup import escape  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    console = Console(highlight=False)
    if data["platform"]:
        p = data["platform"]
        table = Table(title="platform", show_header=False)
        table.add_column("", style="bold")
        table.add_column("")
        kind = f"{p['kind']} (fake: computes on CPU)" if p["fake"] else p["kind"]
        rows = [
            ("platform", p["spec"]),
            ("chosen by", p["reason"] if p["chosen_by"] != "detection" else f"detection: {p['reason']}"),
            ("kind", kind),
            ("device type", p["device_type"]),
            ("device count", str(p["device_count"])),
            ("dist backend", p["dist_backend"]),
            ("ray resource", p["ray_resource"]),
            ("visible devices", f"{p['visible_devices_var'] or '-'} = {p['visible_devices']}"),
        ]
        for key, value in rows:
            table.add_row(key, escape(value))
        console.print(table)
    else:
        console.print(f"[bold red]platform error:[/] {escape(data['error'])}", soft_wrap=True)

    versions = Table(title="versions")
    versions.add_column("package")
    versions.add_column("version")
    for name, version in data["versions"].items():
        versions.add_row(name, version)
    console.print(versions)

    recipes = Table(title="shipped recipes")
    recipes.add_column("recipe", no_wrap=True)
    for col in ("device", "runtime", "runs here"):
        recipes.add_column(col)
    recipes.add_column("why", overflow="fold")  # long words (key=value) fold, not cut to an ellipsis
    for r in data["recipes"]:
        ok = "[green]yes[/]" if r["runs_here"] else "[red]no[/]"
        recipes.add_row(escape(r["recipe"]), escape(r["device"]), r["runtime"], ok, escape(r["why"]))
    console.print(recipes)

    table = Table(title="engines")
    for col in ("recipe key", "engine", "needs", "usable here"):
        table.add_column(col)
    table.add_column("why", overflow="fold")
    for e in data["engines"]:
        packages = ", ".join(f"{name} {v}" for name, v in e["packages"].items()) or "-"
        table.add_row(e["key"], e["engine"], escape(packages), "[green]yes[/]" if e["usable"] else "[red]no[/]", escape(e["why"]))
    console.print(table)

    shared = data["shared_memory"]
    if not shared["usable"]:
        console.print(f"shared memory: {shared['dir']} is not usable or is turned off (TIDAL_STORE_SHM=0); the store sends every row over its sockets")
    else:
        line = f"shared memory: {shared['dir']}, {shared['free_bytes'] / 2**30:.1f} GiB free"
        if shared["removed"]:
            line += f"; removed {len(shared['removed'])} files that killed tidal processes left"
        if shared["files"]:
            orphans, unknown = len(shared["orphans"]), len(shared["unknown"])
            held = len(shared["files"]) - orphans - unknown
            line += f"; {len(shared['files'])} tidal files ({shared['files_bytes'] / 2**20:.1f} MiB): {held} held by running processes"
            if orphans:
                line += f", {orphans} left by killed processes (`tidal doctor --clean` deletes them)"
            if unknown:
                line += f", {unknown} whose holder cannot be told: delete them if no tidal process runs"
        console.print(escape(line))
