"""`tidal doctor --cluster`'s node table fits the terminal: every value whole, never
squeezed to a few letters (`tools.cluster.render`)."""

from __future__ import annotations

import io

from rich.console import Console

from tidal.flow.ray.cluster import NodeReport
from tidal.tools.cluster import ClusterCheck, render

VERSIONS = {"tidal-rl": "0.1.0", "python": "3.11.9", "ray": "2.60.0", "torch": "2.13.0"}


def _node(i: int, name: str, devices: dict, resources: dict, *, versions=None, unreachable=None) -> NodeReport:
    return NodeReport(
        node_id=str(i), name=name, address=f"10.0.0.{i}", devices=devices, resources=resources, free=dict(resources),
        versions={**VERSIONS, **(versions or {})}, missing={}, listens=f"10.0.0.{i}:40001", unreachable=unreachable or {},
    )  # fmt: skip


def _printed(found: ClusterCheck, width: int) -> list[str]:
    out = io.StringIO()
    render(found, Console(width=width, file=out, color_system=None, highlight=False))
    return out.getvalue().splitlines()


NODES = [_node(1, "npu-0", {"npu": 8}, {"CPU": 64.0, "NPU": 8.0}), _node(2, "gpu-0", {"cuda": 8}, {"CPU": 64.0, "GPU": 8.0}, unreachable={"1": "refused"})]


def test_versions_every_node_shares_are_said_once_and_the_table_fits_80_columns():
    lines = _printed(ClusterCheck(address="10.0.0.1:6379", nodes=NODES, problems=["node gpu-0 cannot connect"]), 80)
    assert lines[0] == "every node runs tidal-rl 0.1.0, python 3.11.9, ray 2.60.0, torch 2.13.0"
    rows = [line for line in lines if line.startswith("│")]
    assert len(rows) == 2 and all(len(line) <= 80 for line in lines[:-1])
    assert "npu-0" in rows[0] and "8 npu" in rows[0] and "8 NPU, 64 CPU" in rows[0] and "10.0.0.1 " in rows[0] and "all" in rows[0]
    assert "gpu-0" in rows[1] and "0 of 1" in rows[1] and "…" not in "".join(lines)
    assert lines[-1] == "  - node gpu-0 cannot connect"


def test_a_version_that_differs_gets_its_column_and_a_table_too_wide_becomes_a_block_per_node():
    nodes = [_node(1, "npu-0", {"npu": 8}, {"CPU": 64.0, "NPU": 8.0}, versions={"torch_npu": "2.13.0.post1"}), _node(2, "gpu-0", {"cuda": 8}, {"CPU": 64.0, "GPU": 8.0, "rollout": 8.0}, versions={"tidal-rl": "9.9.0"})]
    found = ClusterCheck(address="10.0.0.1:6379", nodes=nodes, problems=[])
    wide = _printed(found, 160)
    assert wide[0] == "every node runs python 3.11.9, ray 2.60.0, torch 2.13.0"
    header = next(line for line in wide if "node" in line and "tidal-rl" in line)
    assert "torch " not in header
    assert any("gpu-0" in line and "9.9.0" in line and "rollout" in line for line in wide)
    narrow = _printed(found, 60)
    assert "Ray cluster at 10.0.0.1:6379: 2 node(s)" in narrow
    block = narrow[narrow.index("gpu-0"):]
    assert block[1:5] == ["  address: 10.0.0.2", "  devices: 8 cuda", "  free: 8 GPU, 64 CPU", "  tags: rollout"]
    assert "  tidal-rl: 9.9.0" in block and "  vendor: -" in block and "  vendor: torch_npu 2.13.0.post1" in narrow
    assert all(len(line) <= 60 for line in narrow if not line.startswith("no problem"))
