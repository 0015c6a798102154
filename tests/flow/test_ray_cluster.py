"""`flow.ray.cluster`: the problems a cluster's probe reports turn into, each naming its node."""

from __future__ import annotations

from tidal.flow.ray.cluster import NodeReport, cluster_problems, node_devices

DRIVER = {"tidal-rl": "0.1.0", "python": "3.11.9", "ray": "2.60.0", "torch": "2.13.0"}


def _node(node_id: str, name: str, *, devices=None, versions=None, missing=None, unreachable=None) -> NodeReport:
    return NodeReport(
        node_id=node_id, name=name, address="10.0.0.1", devices=devices or {}, resources={}, free=None, versions={**DRIVER, **(versions or {})},
        missing=missing or {}, listens=f"10.0.0.{node_id}:4000{node_id}", unreachable=unreachable or {},
    )  # fmt: skip


def test_a_sound_cluster_has_no_problem():
    assert cluster_problems([_node("1", "npu-0", devices={"npu": 8}), _node("2", "gpu-0", devices={"cuda": 8})], driver_versions=DRIVER) == []


def test_another_tidal_release_on_a_node_is_named_with_both_versions():
    (problem,) = cluster_problems([_node("1", "npu-0"), _node("2", "gpu-0", versions={"tidal-rl": "0.2.0"})], driver_versions=DRIVER)
    assert problem.startswith("node gpu-0 (cpu only) runs tidal-rl 0.2.0, the driver 0.1.0: install the same tidal-rl on every node")


def test_devices_without_their_stack_are_a_problem_unless_the_run_is_fake():
    nodes = [_node("1", "npu-0", devices={"npu": 8}, missing={"npu": "torch_npu is not installed"})]
    (problem,) = cluster_problems(nodes, driver_versions=DRIVER)
    assert problem == "node npu-0 advertises 8 npu device(s) to Ray but torch_npu is not installed: install it there, or start the node without them"
    assert cluster_problems(nodes, driver_versions=DRIVER, fake=True) == []


def test_a_node_that_cannot_reach_another_names_both_and_the_port():
    nodes = [_node("1", "npu-0", devices={"npu": 8}, unreachable={"2": "TimeoutError: timed out"}), _node("2", "gpu-0", devices={"cuda": 8})]
    (problem,) = cluster_problems(nodes, driver_versions=DRIVER)
    assert problem.startswith("node npu-0 (8 npu) cannot connect to node gpu-0 (8 cuda) at 10.0.0.2:40002: TimeoutError: timed out; ")
    assert "allow TCP between the cluster's nodes" in problem


def test_devices_are_read_as_placement_reads_them():
    assert node_devices({"CPU": 4.0, "NPU": 8.0, "memory": 1e9}) == {"npu": 8}
    assert node_devices({"CPU": 4.0, "GPU": 2.0, "NPU": 0.0}) == {"cuda": 2}
    assert node_devices({"CPU": 4.0}) == {}
