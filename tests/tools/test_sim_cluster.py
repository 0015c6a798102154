"""Cluster specs for the simulator (tools/sim/cluster.py) and the shipped recipes/clusters/."""

from __future__ import annotations

from pathlib import Path

import pytest

from tidal.flow.placement import PlacementError, Role, schedule
from tidal.tools.sim.cluster import load_cluster
from tidal.tools.sim.hardware import device

CLUSTERS = Path(__file__).resolve().parents[2] / "recipes" / "clusters"


def test_shipped_specs_load():
    sizes = {p.stem: load_cluster(p).num_devices for p in sorted(CLUSTERS.glob("*.yaml"))}
    assert sizes == {"gpu64": 64, "h20x32": 32, "h20x64": 64, "h20x128": 128, "npu128": 128, "npu64_gpu32": 96, "npu512_gpu512": 1024}


def test_mixed_spec_becomes_resources():
    spec = load_cluster(CLUSTERS / "npu64_gpu32.yaml")
    assert [(g.name, g.device.name, g.count) for g in spec.groups] == [("npu", "910b", 8), ("gpu", "h100", 4)]
    assert spec.groups[0].device == device("910b")
    resources = spec.resources()
    assert [r.node for r in resources] == [f"npu-{i}" for i in range(8)] + [f"gpu-{i}" for i in range(4)]
    assert resources[0].kind == "npu" and resources[0].capacity == 8 and resources[0].tags == {"910b", "npu"}
    assert resources[-1].kind == "cuda" and resources[-1].tags == {"h100", "cuda", "gpu"}
    assert spec.group_of("gpu-3").device.name == "h100"


def test_the_scheduler_places_roles_on_a_spec():
    resources = load_cluster(CLUSTERS / "npu64_gpu32.yaml").resources()
    plan = schedule(resources, [Role(name="train", requires=("npu",), count=64), Role(name="rollout", requires=("h100",), count=16, devices_each=2)])
    assert plan.layout == "disaggregated"
    assert {a.node for a in plan.of("train")} == {f"npu-{i}" for i in range(8)}
    assert {a.node for a in plan.of("rollout")} == {f"gpu-{i}" for i in range(4)}
    with pytest.raises(PlacementError, match="rollout"):
        schedule(load_cluster(CLUSTERS / "npu128.yaml").resources(), [Role(name="rollout", requires=("h100",))])


def test_network_overrides_and_devices_per_node(tmp_path):
    path = tmp_path / "small.yaml"
    path.write_text(
        "network: {scale_out_gbps: 12.5}\n"
        "nodes:\n"
        "  - {name: a, device: H200, count: 2, devices_per_node: 4}\n"
        "  - {name: b, device: 910c, overrides: {scale_out_gbps: 50, hbm_gbps: 3000}}\n"
    )
    spec = load_cluster(path)
    a, b = spec.groups
    assert spec.name == "small"
    assert (a.device.scale_out_gbps, a.device.devices_per_node, a.count) == (12.5, 4, 2)
    assert (b.device.scale_out_gbps, b.device.hbm_gbps, b.count) == (50, 3000, 1)  # a group's override wins
    assert [r.capacity for r in spec.resources()] == [4, 4, 8]


@pytest.mark.parametrize(
    ("text", "key", "message"),
    [
        ("nodes:\n  - {name: a, device: h800}\n", "nodes[0].device", r"'h800'.*910b, 910c, h100, h200, h20"),
        ("nodes:\n  - {name: a, device: h100, gpus: 8}\n", "nodes[0].gpus", "unknown key"),
        ("nodes:\n  - {name: a, device: h100, count: 0}\n", "nodes[0].count", ">= 1"),
        ("nodes:\n  - {name: a, device: h100}\n  - {name: a, device: h100}\n", "nodes[1].name", "earlier group"),
        ("nodes:\n  - {name: a, device: h100, overrides: {nvlink: 900}}\n", "nodes[0].overrides.nvlink", "unknown key"),
        ("nodes:\n  - {name: a, device: h100, overrides: {hbm_gbps: -1}}\n", "nodes[0].overrides", "hbm_gbps must be"),
        ("network: {scale_out_gbps: fast}\nnodes:\n  - {name: a, device: h100}\n", "network.scale_out_gbps", "number > 0"),
        ("nodes: []\n", "nodes", "non-empty list"),
        ("node:\n  - {name: a, device: h100}\n", "node", "unknown key"),
    ],
)
def test_errors_name_the_file_and_key(tmp_path, text, key, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as err:
        load_cluster(path)
    assert str(err.value).startswith(f"{path}: {key}:")


def test_unreadable_specs_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="missing.yaml"):
        load_cluster(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("nodes: [\n")
    with pytest.raises(ValueError, match=r"broken.yaml: not valid YAML"):
        load_cluster(broken)
