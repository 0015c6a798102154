"""Placement faults found in review: CPU fallback, a role split over vendors, Ray bundles that cannot be granted."""

import pytest

from tidal.flow.placement import PlacementError, Resource, Role, resources_from_ray_nodes, schedule

# A typical Ray cluster: a CPU-only head node (first in `ray.nodes()`), GPU and NPU workers.
RAY_NODES = [
    {"Alive": True, "NodeName": "head", "Resources": {"CPU": 16.0}},
    {"Alive": True, "NodeName": "10.0.0.2", "Resources": {"CPU": 64.0, "GPU": 8.0}},
]


def test_a_role_asking_for_no_tag_never_lands_on_the_cpus_of_a_cluster_with_accelerators():
    """DESIGN: never silently fall back from an accelerator to CPU. `requires: []` (the
    default) on a Ray cluster with a CPU-only head put the trainer on the head's CPUs."""
    resources = resources_from_ray_nodes(RAY_NODES)
    plan = schedule(resources, [Role(name="train"), Role(name="rollout")])
    assert {(a.role, a.kind, a.node) for a in plan.assignments} == {("train", "cuda", "10.0.0.2"), ("rollout", "cuda", "10.0.0.2")}
    # more than the accelerators hold is an error, not CPU instances
    with pytest.raises(PlacementError, match=r"cannot place role 'rollout'.*7 placed, 1 more do not fit.*10\.0\.0\.2 0/8 free"):
        schedule(resources, [Role(name="train"), Role(name="rollout", count=8)])
    # a role that asks for cpu still gets them, and a CPU-only cluster serves any role
    plan = schedule(resources, [Role(name="train"), Role(name="rollout", requires=("cpu",), count=2)])
    assert {a.kind for a in plan.of("rollout")} == {"cpu"}
    assert {a.kind for a in schedule([Resource(node="box", kind="cpu", capacity=2)], [Role(name="train"), Role(name="rollout")]).assignments} == {"cpu"}


def test_a_role_that_fits_no_accelerator_says_cpu_nodes_need_requires_cpu():
    only_cpu_fits = [Resource(node="g0", kind="cuda", capacity=1, tags=frozenset({"x"})), Resource(node="c0", kind="cpu", capacity=4, tags=frozenset({"fast"}))]
    with pytest.raises(PlacementError, match=r"cannot place role 'train'.*no node offers those tags.*requires: \[cpu\]"):
        schedule(only_cpu_fits, [Role(name="train", requires=("fast",))])


def test_a_hybrid_role_does_not_spill_onto_cpus():
    cluster = [Resource(node="c0", kind="cpu", capacity=8), Resource(node="g0", kind="cuda", capacity=2)]
    with pytest.raises(PlacementError, match="cannot place role 'rollout'"):
        schedule(cluster, [Role(name="train", count=2), Role(name="rollout", count=3, colocate_with="train")])


def test_a_role_keeps_to_the_device_kind_it_started_on_when_another_node_of_it_has_room():
    """Placing instance by instance, the next node after a full one was the first with room,
    whatever its kind: a trainer's ranks went to NPUs and GPUs while a second NPU node was free."""
    cluster = [Resource(node="npu-0", kind="npu", capacity=8), Resource(node="gpu-0", kind="cuda", capacity=8), Resource(node="npu-1", kind="npu", capacity=8)]
    plan = schedule(cluster, [Role(name="train", count=12)])
    assert {a.kind for a in plan.of("train")} == {"npu"}
    assert [a.node for a in plan.of("train")] == ["npu-0"] * 8 + ["npu-1"] * 4


def _two_gpu_roles():
    cluster = [Resource(node="g0", kind="cuda", capacity=8), Resource(node="g1", kind="cuda", capacity=8)]
    return schedule(cluster, [Role(name="train", requires=("gpu",), count=8), Role(name="rollout", requires=("gpu",), count=1, devices_each=8)])


def test_role_bundles_count_every_roles_devices_against_the_cluster():
    """Each role was checked against the whole cluster alone: two roles of 8 GPUs each passed
    on 8 GPUs, and the second placement group waited its 30 s blaming 'other runs'."""
    from tidal.flow.ray.placement import role_bundles

    plan = _two_gpu_roles()
    with pytest.raises(PlacementError, match=r"cannot place role 'rollout' on this Ray cluster: it needs 8 GPU \(the cluster has 8, of which 8 go to train\)"):
        role_bundles(plan, {"GPU": 8.0, "CPU": 16.0})
    assert sorted(role_bundles(plan, {"GPU": 16.0})) == ["rollout", "train"]


def test_role_bundles_refuse_an_instance_larger_than_any_ray_node():
    """A bundle must fit on one node: 16 GPUs as four nodes of 4 pass the cluster's total, hold
    no 8-GPU instance, and the placement group waited its 30 s blaming 'other runs'."""
    from tidal.flow.ray.placement import role_bundles

    plan = _two_gpu_roles()
    with pytest.raises(PlacementError, match=r"cannot place role 'rollout' on this Ray cluster: one instance needs 8 GPU on one node, and no node has more than 4"):
        role_bundles(plan, {"GPU": 16.0}, largest={"GPU": 4.0})
    assert sorted(role_bundles(plan, {"GPU": 16.0}, largest={"GPU": 8.0})) == ["rollout", "train"]


def test_largest_node_resources_of_alive_ray_nodes():
    from tidal.flow.ray.placement import largest_node_resources

    nodes = [*RAY_NODES, {"Alive": True, "NodeName": "n", "Resources": {"CPU": 8.0, "NPU": 4.0}}, {"Alive": False, "NodeName": "dead", "Resources": {"GPU": 16.0}}]
    assert largest_node_resources(nodes) == {"CPU": 64.0, "GPU": 8.0, "NPU": 4.0}
