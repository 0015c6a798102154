"""Cluster specs for the simulator: which servers, with which accelerators, and their links.

A spec is a YAML file (shipped ones in `recipes/clusters/`):

    name: npu64_gpu32                 # optional, for reports
    description: ...                  # optional
    network: {scale_out_gbps: 25}     # optional: every device's inter-node bandwidth
    nodes:
      - name: npu                     # nodes npu-0 .. npu-7
        device: 910b                  # a key of tools.sim.hardware.DEVICES
        count: 8                      # servers in the group (default 1)
        devices_per_node: 8           # optional, default the profile's
        overrides: {hbm_gbps: 1200}   # optional, any figure of the profile

A group's devices are its profile with `network`, then `overrides`, then
`devices_per_node` applied. `ClusterSpec.resources()` turns the groups into the
`flow.placement.Resource`s the real scheduler places roles on: node `<name>-<i>`, kind
`npu` or `cuda`, tagged with the device name (`h100`) beside the kind's own tags.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from tidal.flow.placement import MAX_CAPACITY, Resource
from tidal.tools.sim.hardware import DEVICES, OVERRIDABLE, Device, device

_TOP_KEYS = ("name", "description", "network", "nodes")
PROFILED = "profiled"
"""The device name a spec gives a node group of the device `tidal simulate --profile` read."""
_NODE_KEYS = ("name", "device", "count", "devices_per_node", "overrides")
_NETWORK_KEYS = ("scale_out_gbps",)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NodeGroup:
    """`count` alike servers, each with `device.devices_per_node` devices of `device`."""

    name: str
    device: Device
    count: int

    @property
    def node_names(self) -> list[str]:
        return [f"{self.name}-{i}" for i in range(self.count)]

    @property
    def num_devices(self) -> int:
        return self.count * self.device.devices_per_node


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """A cluster read from a spec file: its node groups, in file order."""

    name: str
    groups: tuple[NodeGroup, ...]
    path: str | None = None
    """The file it was read from, for messages."""

    @property
    def num_devices(self) -> int:
        return sum(g.num_devices for g in self.groups)

    def group_of(self, node: str) -> NodeGroup:
        """The group a node (`<name>-<i>`) belongs to."""
        for g in self.groups:
            if node in g.node_names:
                return g
        raise KeyError(node)

    def resources(self) -> list[Resource]:
        """One `Resource` per server, for `tidal.flow.placement.schedule`."""
        return [
            Resource(node=node, kind=g.device.kind, capacity=g.device.devices_per_node, tags=frozenset({g.device.name}))
            for g in self.groups
            for node in g.node_names
        ]


def load_cluster(path: str | Path, *, devices: Mapping[str, Device] | None = None) -> ClusterSpec:
    """Read and check a cluster spec (module docstring); `devices`: profiles a node group
    may name besides `hardware.DEVICES` (`PROFILED`: the device a `tidal profile` measured).

    Raises:
        ValueError: the file is missing or not YAML, or a key is unknown or wrong; the
            message names the file and the key (`nodes[1].device`).
    """
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ValueError(f"{path}: cannot read the cluster spec: {e.strerror or e}") from e
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from e
    return parse_cluster(data, source=str(path), devices=devices)


def parse_cluster(data: Any, *, source: str = "<cluster spec>", devices: Mapping[str, Device] | None = None) -> ClusterSpec:
    """A `ClusterSpec` from a spec already read (a mapping); `source` names it in errors;
    `devices` as `load_cluster`'s."""
    known = {**DEVICES, **(devices or {})}

    def fail(key: str, message: str) -> ValueError:
        return ValueError(f"{source}: {key}: {message}")

    if not isinstance(data, Mapping):
        raise ValueError(f"{source}: a cluster spec is a mapping with a `nodes` list, got {type(data).__name__}")
    _known(data, _TOP_KEYS, key="", fail=fail)
    name = data.get("name", Path(source).stem)
    if not isinstance(name, str) or not name:
        raise fail("name", f"must be a non-empty string, got {name!r}")
    network = data.get("network") or {}
    if not isinstance(network, Mapping):
        raise fail("network", f"must be a mapping, got {network!r}")
    _known(network, _NETWORK_KEYS, key="network", fail=fail)
    for k, v in network.items():
        _positive(v, key=f"network.{k}", fail=fail)

    nodes = data.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise fail("nodes", f"must be a non-empty list of node groups, got {nodes!r}")
    groups = []
    seen: set[str] = set()
    for i, node in enumerate(nodes):
        key = f"nodes[{i}]"
        if not isinstance(node, Mapping):
            raise fail(key, f"must be a mapping with name and device, got {node!r}")
        _known(node, _NODE_KEYS, key=key, fail=fail)
        group_name = node.get("name")
        if not isinstance(group_name, str) or not group_name:
            raise fail(f"{key}.name", f"must be a non-empty string, got {group_name!r}")
        if group_name in seen:
            raise fail(f"{key}.name", f"{group_name!r} names an earlier group too")
        seen.add(group_name)
        kind = node.get("device")
        if not isinstance(kind, str) or kind.lower() not in known:
            hint = f" ({PROFILED!r}, the device a `tidal profile` measured, needs --profile)" if PROFILED not in known else ""
            raise fail(f"{key}.device", f"unknown device {kind!r}; valid devices: {', '.join(known)}{hint}")
        count = node.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise fail(f"{key}.count", f"must be an integer >= 1, got {count!r}")
        overrides = node.get("overrides") or {}
        if not isinstance(overrides, Mapping):
            raise fail(f"{key}.overrides", f"must be a mapping of figures, got {overrides!r}")
        _known(overrides, OVERRIDABLE, key=f"{key}.overrides", fail=fail)
        figures = {**network, **overrides}
        if "devices_per_node" in node:
            if "devices_per_node" in overrides:
                raise fail(f"{key}.devices_per_node", "is also set in overrides: set it once")
            figures["devices_per_node"] = node["devices_per_node"]
        dpn = figures.get("devices_per_node")
        if dpn is not None and (isinstance(dpn, bool) or not isinstance(dpn, int) or not 1 <= dpn <= MAX_CAPACITY):
            raise fail(f"{key}.devices_per_node", f"must be an integer in 1..{MAX_CAPACITY}, got {dpn!r}")
        try:
            profile = device(kind, known=known, **figures)
        except ValueError as e:
            raise fail(f"{key}.overrides", str(e)) from e
        groups.append(NodeGroup(name=group_name, device=profile, count=count))
    return ClusterSpec(name=name, groups=tuple(groups), path=None if source.startswith("<") else source)


def _known(mapping: Mapping[str, Any], allowed: tuple[str, ...], *, key: str, fail: Callable[[str, str], ValueError]) -> None:
    unknown = sorted(str(k) for k in mapping if k not in allowed)
    if unknown:
        where = f"{key}.{unknown[0]}" if key else unknown[0]
        raise fail(where, f"unknown key; valid keys{' of ' + key if key else ''}: {', '.join(allowed)}")


def _positive(value: Any, *, key: str, fail: Callable[[str, str], ValueError]) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise fail(key, f"must be a number > 0, got {value!r}")
