"""`tidal simulate --search`: rank placements of a recipe on a cluster by simulating each.

The candidates are placements, each a set of recipe overrides:
- disaggregated: which devices train and which roll out: on a cluster of one device type,
  the trainer takes whole nodes (a quarter to three quarters of them) and rollout the
  rest; on a mixed cluster, each type trains while another rolls out, and each type's
  trainer also takes half or three quarters of its nodes while the rest of them roll out
  beside the other types' devices (`placement.rollout.requires=[]`);
- colocated: every device of one type trains, and rollout time-shares those devices
  (`placement.rollout.colocate_with=train`);
- hybrid: a disaggregated split whose rollout also time-shares the trainer's devices
  (`colocate_with=train` with more instances than those devices hold: the rest go to
  rollout's own devices);
- multiplexed: a disaggregated split whose trainer lends its devices to extra rollout
  instances while it waits for data (`placement.train.lend_to=rollout`);
  in both, on a mixed cluster, rollout takes devices of either type (`requires=[]`: the
  trainer's devices and the other type's);
- rollout devices per instance (tensor parallel degree: 1, 2, 4 or 8, within a node),
  with `rollout.prompts_per_generate` set so that one step's prompts spread over every
  instance (a worker takes up to that many per generate call: one instance taking a
  whole step's prompts leaves the others idle);
- `algorithm.max_staleness`: 0, 1 and 2.
Each is simulated (`simulate.simulate`) and the table is ranked by samples per second; a
candidate the cost model cannot seat (the weights do not fit a rollout instance's
devices) is listed as such. The overrides of a row reproduce it with `tidal simulate`
and, on the real cluster, `tidal run`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from tidal.tools.config import ConfigError, RecipeConfig, load_config
from tidal.tools.sim.cluster import ClusterSpec
from tidal.tools.sim.simulate import Prediction, Workload, simulate

TRAIN_SHARES = (0.25, 0.375, 0.5, 0.625, 0.75)
"""Shares of a one-type cluster's nodes the trainer may take."""
MIXED_TRAIN_SHARES = (0.5, 0.75)
"""On a mixed cluster, shares of its own type's nodes a trainer may take besides all of
them (the rest roll out beside the other types' devices)."""
DEVICES_EACH = (1, 2, 4, 8)
STALENESS = (0, 1, 2)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
    """One placement: the recipe overrides that make it."""

    overrides: tuple[str, ...]
    label: str


@dataclasses.dataclass(kw_only=True)
class Ranked:
    candidate: Candidate
    prediction: Prediction | None
    why_not: str | None = None


@dataclasses.dataclass(frozen=True)
class _Split:
    train: str
    """The trainer's device type."""
    train_devices: int
    rollout: str | None
    """Rollout's device type; None: devices of every type (`requires=[]`)."""
    rollout_devices: dict[str, int]
    """Devices left to rollout, by type."""

    def instances(self, each: int, per_node: dict[str, int]) -> int:
        """Rollout instances of `each` devices (0 where `each` exceeds a node of a type rollout uses)."""
        if any(each > per_node[t] for t, n in self.rollout_devices.items() if n):
            return 0
        return sum(n // each for n in self.rollout_devices.values())

    @property
    def rollout_label(self) -> str:
        return self.rollout or "+".join(t for t, n in self.rollout_devices.items() if n)


def _train_nodes(nodes: int, shares: Sequence[float]) -> list[int]:
    """Distinct node counts, each share of `nodes` rounded, leaving rollout at least one node."""
    return sorted({min(max(1, round(nodes * share)), nodes - 1) for share in shares} - {0})


def _splits(cluster: ClusterSpec) -> Iterator[_Split]:
    """Which devices train and which roll out (module docstring)."""
    per_node = {g.device.name: g.device.devices_per_node for g in cluster.groups}
    nodes = {name: sum(g.count for g in cluster.groups if g.device.name == name) for name in per_node}
    totals = {name: sum(g.num_devices for g in cluster.groups if g.device.name == name) for name in per_node}
    if len(per_node) == 1:
        (name,) = per_node
        for train_nodes in _train_nodes(nodes[name], TRAIN_SHARES):
            yield _Split(name, train_nodes * per_node[name], name, {name: totals[name] - train_nodes * per_node[name]})
        return
    for train in per_node:
        for rollout in per_node:
            if train != rollout:
                yield _Split(train, totals[train], rollout, {rollout: totals[rollout]})
        # the trainer's type split too: the rest of its nodes roll out beside every other type's
        for train_nodes in _train_nodes(nodes[train], MIXED_TRAIN_SHARES):
            left = {t: totals[t] if t != train else totals[t] - train_nodes * per_node[t] for t in per_node}
            yield _Split(train, train_nodes * per_node[train], None, left)


LAYOUTS = ("disaggregated", "colocated", "hybrid", "multiplexed")


def _placement(cfg: RecipeConfig, train: tuple[str, int], rollout: tuple[str | None, int, int], staleness: int, *, layout: str = "disaggregated") -> tuple[str, ...]:
    """The overrides of one candidate: the trainer's (tag, devices), rollout's (tag, instances,
    devices each; tag None: devices of any type), one step's prompts spread over every
    rollout instance (a multiplexed trainer's borrowed instances not counted: they come and
    go). `layout` adds what time-shares the devices."""
    (train_tag, train_devices), (rollout_tag, count, each) = train, rollout
    return (
        f"placement.train.requires=[{train_tag}]",
        f"placement.train.count={train_devices}",
        "placement.train.devices_each=1",
        f"placement.rollout.requires=[{rollout_tag or ''}]",
        f"placement.rollout.count={count}",
        f"placement.rollout.devices_each={each}",
        *(["placement.rollout.colocate_with=train"] if layout in ("colocated", "hybrid") else []),
        *(["placement.train.lend_to=rollout"] if layout == "multiplexed" else []),
        f"rollout.prompts_per_generate={max(1, math.ceil(cfg.algorithm.prompts_per_step / count))}",
        f"algorithm.max_staleness={staleness}",
    )


def candidates(cfg: RecipeConfig, cluster: ClusterSpec, *, layouts: Sequence[str] = LAYOUTS) -> list[Candidate]:
    """Every placement `--search` simulates (module docstring), of the `layouts` asked for."""
    if not layouts or set(layouts) - set(LAYOUTS):
        raise ValueError(f"layouts are {', '.join(LAYOUTS)} (comma-separated), got {list(layouts)}")
    per_node = {g.device.name: g.device.devices_per_node for g in cluster.groups}
    out = []
    for split in _splits(cluster):
        train_tag, train_devices, rollout_tag, rollout_label = split.train, split.train_devices, split.rollout, split.rollout_label
        for each in DEVICES_EACH:
            count = split.instances(each, per_node)
            if not count:
                continue
            # time-sharing the trainer's devices too: each instance within one of its nodes
            # (a mixed cluster's split of the trainer's type is tried disaggregated only)
            shares = rollout_tag is not None and each <= per_node[train_tag] and train_devices % each == 0
            either = rollout_tag if rollout_tag == train_tag else None  # a mixed cluster's rollout takes either type
            for staleness in STALENESS:
                if "disaggregated" in layouts:
                    overrides = _placement(cfg, (train_tag, train_devices), (rollout_tag, count, each), staleness)
                    out.append(Candidate(overrides=overrides, label=f"train {train_devices} {train_tag}, rollout {count} x {each} {rollout_label}, staleness {staleness}"))
                if shares and "hybrid" in layouts:
                    hosted = train_devices // each
                    overrides = _placement(cfg, (train_tag, train_devices), (either, hosted + count, each), staleness, layout="hybrid")
                    label = f"hybrid: train {train_devices} {train_tag}, rollout {hosted} x {each} time-sharing them + {count} x {each} {rollout_label}, staleness {staleness}"
                    out.append(Candidate(overrides=overrides, label=label))
                if shares and "multiplexed" in layouts:
                    overrides = _placement(cfg, (train_tag, train_devices), (either, count, each), staleness, layout="multiplexed")
                    label = f"multiplexed: train {train_devices} {train_tag} lending to rollout, rollout {count} x {each} {rollout_label}, staleness {staleness}"
                    out.append(Candidate(overrides=overrides, label=label))
    if "colocated" in layouts:
        for tag in dict.fromkeys(g.device.name for g in cluster.groups):  # a type's devices all train, rollout time-shares them
            total = sum(g.num_devices for g in cluster.groups if g.device.name == tag)
            for each in DEVICES_EACH:
                if each > per_node[tag] or total % each:
                    continue
                for staleness in STALENESS:
                    overrides = _placement(cfg, (tag, total), (tag, total // each, each), staleness, layout="colocated")
                    out.append(Candidate(overrides=overrides, label=f"colocated on {total} {tag}: rollout {total // each} x {each}, staleness {staleness}"))
    return out


def search(
    recipe: Any,
    overrides: Sequence[str],
    cluster: ClusterSpec,
    work: Workload,
    *,
    layouts: Sequence[str] = LAYOUTS,
    progress: Callable[[str], None] | None = None,
) -> list[Ranked]:
    """Simulate every candidate placement of `recipe` (with `overrides` first) of the
    `layouts` asked for; fastest first."""
    base = load_config(recipe, overrides)
    found = candidates(base, cluster, layouts=layouts)
    ranked = []
    for k, candidate in enumerate(found, 1):
        if progress is not None:
            progress(f"[{k}/{len(found)}] {candidate.label}")
        try:
            cfg = load_config(recipe, [*overrides, *candidate.overrides])
            prediction, _ = simulate(cfg, cluster, work, tracer_events=1)
        except (ConfigError, ValueError) as e:
            ranked.append(Ranked(candidate=candidate, prediction=None, why_not=str(e)))
            continue
        ranked.append(Ranked(candidate=candidate, prediction=prediction))
    return sorted(ranked, key=lambda r: -(r.prediction.samples_per_s if r.prediction is not None else -1.0))


def table(ranked: Sequence[Ranked]) -> list[list[str]]:
    """Rows for printing, header first."""
    rows = [["rank", "placement", "samples/s", "step p50 s", "train busy", "rollout busy", "overrides"]]
    for k, r in enumerate(ranked, 1):
        p = r.prediction
        if p is None:
            rows.append(["-", r.candidate.label, "-", "-", "-", "-", f"cannot run: {r.why_not}"])
            continue
        rows.append([str(k), r.candidate.label, f"{p.samples_per_s:,.2f}", f"{p.step_s['p50']:,.2f}", f"{p.utilisation['train']:.0%}", f"{p.utilisation['rollout']:.0%}", " ".join(r.candidate.overrides)])
    return rows
