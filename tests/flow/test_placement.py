"""Placement: the four layouts from one scheduler, and infeasible requests named at once."""

import pytest

from tidal.flow.placement import MAX_CAPACITY, PlacementError, Resource, Role, resources_from_ray_nodes, schedule

MIXED = [
    Resource(node="npu-0", kind="npu", capacity=8),
    Resource(node="npu-1", kind="npu", capacity=8),
    Resource(node="gpu-0", kind="cuda", capacity=8, tags=frozenset({"h100"})),
    Resource(node="gpu-1", kind="cuda", capacity=8),
]
TRAIN = Role(name="train", requires=("npu",), count=16, devices_each=1)


def _devices(plan, role, mode=None):
    return sorted((a.node, d) for a in plan.of(role, mode=mode) for d in a.devices)


def _check_no_device_owned_twice(plan):
    owned = [(a.node, d) for a in plan.assignments if a.mode == "own" for d in a.devices]
    assert len(owned) == len(set(owned))


def test_disaggregated_puts_each_role_on_its_own_tagged_devices():
    plan = schedule(MIXED, [TRAIN, Role(name="rollout", requires=("gpu",), count=8, devices_each=2)])
    assert plan.layout == "disaggregated"
    assert {a.node for a in plan.of("train")} == {"npu-0", "npu-1"}
    assert all(a.kind == "npu" and len(a.devices) == 1 for a in plan.of("train"))
    rollout = plan.of("rollout")
    assert [a.rank for a in rollout] == list(range(8))
    assert all(a.kind == "cuda" and len(a.devices) == 2 and a.shares_with == () for a in rollout)
    assert _devices(plan, "rollout") == [(n, d) for n in ("gpu-0", "gpu-1") for d in range(8)]
    _check_no_device_owned_twice(plan)
    assert plan.of("rollout")[0].platform_spec(fake=True) == "fake:cuda:2"
    assert plan.of("train")[0].platform_spec(fake=False) == "npu"


def test_reverse_assignment_and_extra_tags():
    plan = schedule(MIXED, [Role(name="train", requires=("gpu", "h100"), count=4, devices_each=2), Role(name="rollout", requires=("npu",), count=2, devices_each=8)])
    assert {a.node for a in plan.of("train")} == {"gpu-0"}
    assert {a.node for a in plan.of("rollout")} == {"npu-0", "npu-1"}


def test_colocated_time_shares_the_hosts_devices():
    plan = schedule(MIXED, [TRAIN, Role(name="rollout", count=8, devices_each=2, colocate_with="train")])
    assert plan.layout == "colocated"
    assert _devices(plan, "rollout", "colocated") == _devices(plan, "train")
    assert all(a.shares_with == ("train",) for a in plan.of("rollout"))
    assert all(a.shares_with == ("rollout",) for a in plan.of("train"))


def test_hybrid_spills_colocated_instances_onto_free_devices():
    plan = schedule(MIXED, [TRAIN, Role(name="rollout", count=12, devices_each=2, colocate_with="train")])
    assert plan.layout == "hybrid"
    assert len(plan.of("rollout", mode="colocated")) == 8
    own = plan.of("rollout", mode="own")
    assert [a.rank for a in own] == [8, 9, 10, 11] and {a.node for a in own} == {"gpu-0"}  # packed onto one node
    _check_no_device_owned_twice(plan)


def test_multiplexed_lends_training_devices_to_rollout():
    plan = schedule(MIXED, [Role(name="train", requires=("npu",), count=16, lend_to="rollout"), Role(name="rollout", count=8, devices_each=2)])
    assert plan.layout == "multiplexed"
    borrowed = plan.of("rollout", mode="borrowed")
    assert [a.rank for a in borrowed] == list(range(8, 16))
    assert _devices(plan, "rollout", "borrowed") == _devices(plan, "train")
    assert {a.kind for a in plan.of("rollout", mode="own")} == {"cuda"}


@pytest.mark.parametrize(
    ("roles", "message"),
    [
        ([TRAIN, Role(name="rollout", requires=("gpu",), count=9, devices_each=2)], "cannot place role 'rollout'.*8 placed, 1 more do not fit.*gpu-0 0/8 free"),
        ([Role(name="train", requires=("tpu",))], "cannot place role 'train'.*no node offers those tags"),
        ([Role(name="train", requires=("npu",), devices_each=9)], "cannot place role 'train'.*npu-0 8/8 free"),
        ([TRAIN, Role(name="rollout", requires=("gpu",), colocate_with="train")], "'rollout' cannot colocate with 'train'"),
        ([TRAIN, Role(name="rollout", colocate_with="critic")], "colocate_with='critic' names no other role"),
        ([Role(name="train", requires=("npu",), lend_to="rollout"), Role(name="rollout", requires=("gpu",))], "'train' cannot lend to 'rollout'"),
    ],
)
def test_infeasible_requests_name_the_role(roles, message):
    with pytest.raises(PlacementError, match=message):
        schedule(MIXED, roles)


def test_bad_roles_and_resources_are_named():
    with pytest.raises(PlacementError, match="role 'x': count must be >= 1"):
        Role(name="x", count=0)
    with pytest.raises(PlacementError, match="node 'n': kind 'tpu'"):
        Resource(node="n", kind="tpu", capacity=1)


def test_a_node_with_a_count_out_of_range_is_named_not_listed():
    """A devices count with digits too many (a recipe's cluster.nodes, a Ray node) was a
    MemoryError from the planner listing every device."""
    assert Resource(node="big", kind="cpu", capacity=MAX_CAPACITY).capacity == MAX_CAPACITY
    for capacity in (-1, MAX_CAPACITY + 1, 10**11):
        with pytest.raises(PlacementError, match=rf"node 'n': capacity must be in 0\.\.65,536 \(devices, or CPUs of a CPU node\), got {capacity:,}"):
            Resource(node="n", kind="npu", capacity=capacity)


def test_resources_from_ray_nodes():
    nodes = [
        {"Alive": True, "NodeName": "10.0.0.1", "Resources": {"CPU": 64.0, "NPU": 8.0, "ascend910b": 8.0, "node:10.0.0.1": 1.0, "memory": 1e9}},
        {"Alive": True, "NodeName": "10.0.0.2", "Resources": {"CPU": 32.0, "GPU": 8.0, "accelerator_type:H100": 1.0}},
        {"Alive": True, "NodeName": "10.0.0.3", "Resources": {"CPU": 16.0}},
        {"Alive": False, "NodeName": "10.0.0.4", "Resources": {"GPU": 8.0}},
    ]
    res = {r.node: r for r in resources_from_ray_nodes(nodes)}
    assert set(res) == {"10.0.0.1", "10.0.0.2", "10.0.0.3"}
    assert (res["10.0.0.1"].kind, res["10.0.0.1"].capacity) == ("npu", 8) and "ascend910b" in res["10.0.0.1"].tags
    assert (res["10.0.0.2"].kind, res["10.0.0.2"].capacity) == ("cuda", 8) and {"H100", "gpu"} <= res["10.0.0.2"].tags
    assert (res["10.0.0.3"].kind, res["10.0.0.3"].capacity) == ("cpu", 16)
    assert all(r.ray_node_id is None for r in res.values())  # these nodes carry no NodeID


def test_a_plan_read_off_ray_pins_each_bundle_to_its_node():
    """PACK alone may put the 4-device trainer on the 8-device node, where the plan put the
    8-device rollout instance; pinned, each bundle goes where `tidal plan` says."""
    from tidal.flow.ray.placement import NODE_ID_LABEL, node_selectors

    nodes = [
        {"NodeName": "10.0.0.1", "NodeID": "aa11", "Resources": {"CPU": 8.0, "GPU": 8.0}},
        {"NodeName": "10.0.0.2", "NodeID": "bb22", "Resources": {"CPU": 8.0, "GPU": 4.0}},
        {"NodeName": "10.0.0.3", "NodeID": "cc33", "Resources": {"CPU": 8.0, "NPU": 2.0, "GPU": 2.0}},
    ]
    resources = resources_from_ray_nodes(nodes)
    assert {r.node: r.ray_node_id for r in resources} == {"10.0.0.1": "aa11", "10.0.0.2": "bb22", "10.0.0.3/npu": "cc33", "10.0.0.3/cuda": "cc33"}
    plan = schedule(resources, [Role(name="train", devices_each=4), Role(name="rollout", devices_each=8), Role(name="ref", requires=("npu",), count=2)])
    assert node_selectors(plan, "train") == [{NODE_ID_LABEL: "bb22"}]
    assert node_selectors(plan, "rollout") == [{NODE_ID_LABEL: "aa11"}]
    assert node_selectors(plan, "ref") == [{NODE_ID_LABEL: "cc33"}] * 2
    assert plan.to_dict()["cluster"][0]["ray_node_id"] == "aa11"
    # colocated instances have no bundle of their own; a recipe's nodes are not Ray's: Ray chooses
    colocated = schedule(resources, [Role(name="train", devices_each=4), Role(name="rollout", colocate_with="train")])
    assert node_selectors(colocated, "rollout") is None and node_selectors(colocated, "train") == [{NODE_ID_LABEL: "bb22"}]
    recipe = schedule([Resource(node="g0", kind="cuda", capacity=8)], [Role(name="train")])
    assert node_selectors(recipe, "train") is None and "ray_node_id" not in recipe.to_dict()["cluster"][0]


def test_same_named_ray_nodes_with_npus_and_gpus_stay_distinct():
    both = {"CPU": 8.0, "NPU": 2.0, "GPU": 4.0}
    nodes = [{"NodeName": "box", "Resources": both}, {"NodeName": "box", "Resources": both}, {"NodeName": "box", "Resources": {"CPU": 4.0}}]
    res = resources_from_ray_nodes(nodes)
    assert [(r.node, r.kind, r.capacity) for r in res] == [
        ("box/npu", "npu", 2), ("box/cuda", "cuda", 4), ("box#1/npu", "npu", 2), ("box#1/cuda", "cuda", 4), ("box#2", "cpu", 4)
    ]
    plan = schedule(res, [Role(name="train", requires=("npu",), count=2, devices_each=2), Role(name="rollout", requires=("gpu",), count=2, devices_each=4)])
    assert [a.node for a in plan.assignments] == ["box/npu", "box#1/npu", "box/cuda", "box#1/cuda"]


def test_roles_lending_to_each_other_are_refused():
    """Each would lend the other's borrowed seats back: the trainer would borrow its own devices."""
    one = [Resource(node="g0", kind="cuda", capacity=2)]
    with pytest.raises(PlacementError, match="role 'train' lend_to='rollout' and role 'rollout' lend_to='train'"):
        schedule(one, [Role(name="train", lend_to="rollout"), Role(name="rollout", lend_to="train")])
    # a lender lends the devices it owns: a colocated role has none of its own to lend back to its host
    with pytest.raises(PlacementError, match="'rollout' cannot lend to 'train': it holds no devices of its own"):
        schedule(one, [Role(name="train"), Role(name="rollout", colocate_with="train", lend_to="train")])
    hybrid = schedule(one, [Role(name="train"), Role(name="rollout", count=2, colocate_with="train", lend_to="train")])
    assert [(a.rank, a.devices) for a in hybrid.of("train", mode="borrowed")] == [(1, (1,))]  # only rollout's own device 1


def test_role_bundles_carry_required_custom_tags_as_ray_resources():
    from tidal.flow.ray.placement import TAG_AMOUNT, role_bundles

    nodes = [Resource(node="g0", kind="cuda", capacity=4, tags=frozenset({"fast"})), Resource(node="n0", kind="npu", capacity=2)]
    plan = schedule(nodes, [Role(name="train", requires=("npu",), devices_each=2), Role(name="rollout", requires=("gpu", "fast"), count=2, devices_each=2)])
    bundles = role_bundles(plan, {"GPU": 4, "NPU": 2, "fast": 4, "CPU": 8})
    assert bundles == {"train": [{"NPU": 2.0}], "rollout": [{"GPU": 2.0, "fast": TAG_AMOUNT}] * 2}
    assert role_bundles(plan, {"GPU": 4, "NPU": 2, "accelerator_type:fast": 1})["rollout"][0] == {"GPU": 2.0, "accelerator_type:fast": TAG_AMOUNT}
    with pytest.raises(PlacementError, match="cannot place role 'rollout': it requires tag 'fast', and no Ray node declares a resource 'fast'"):
        role_bundles(plan, {"GPU": 4, "NPU": 2})
    with pytest.raises(PlacementError, match=r"cannot place role 'rollout' on this Ray cluster: it needs 4 GPU \(the cluster has 2\)"):
        role_bundles(plan, {"GPU": 2, "NPU": 2, "fast": 4})


def test_ray_placement_groups_fail_fast_naming_the_role(ray_session):
    import time

    from tidal.flow.ray.placement import placement_groups

    plan = schedule(MIXED, [TRAIN, Role(name="rollout", requires=("gpu",), count=8, devices_each=2)])
    begin = time.monotonic()
    with pytest.raises(PlacementError, match=r"cannot place role 'train' on this Ray cluster: it needs 16 NPU \(the cluster has 0\)"):
        placement_groups(plan)
    assert time.monotonic() - begin < 10
    # colocated instances ride on the trainer's bundles (spanning two trainer instances each here): no bundle of their own to ask for
    colocated = schedule(MIXED, [TRAIN, Role(name="rollout", count=8, devices_each=2, colocate_with="train")])
    with pytest.raises(PlacementError, match=r"cannot place role 'train' on this Ray cluster: it needs 16 NPU \(the cluster has 0\)"):
        placement_groups(colocated)


def test_ray_placement_groups_for_a_plan_the_cluster_holds(ray_session):
    import ray

    from tidal.flow.ray.placement import actor_options, placement_groups

    cpu = [Resource(node="local", kind="cpu", capacity=2)]
    plan = schedule(cpu, [Role(name="train"), Role(name="rollout")])
    groups = placement_groups(plan)
    try:
        assert set(groups) == {"train", "rollout"}
        options = actor_options(plan.of("rollout")[0], groups["rollout"], 0, fake=False)
        assert options["num_cpus"] == 1.0 and options["runtime_env"]["env_vars"]["TIDAL_DEVICE"] == "cpu"
    finally:
        for pg in groups.values():
            ray.util.remove_placement_group(pg)


def test_ray_placement_groups_sit_on_the_nodes_the_plan_read_off_ray(ray_session):
    import dataclasses

    import ray
    from ray.util.placement_group import placement_group_table

    from tidal.flow.ray.placement import placement_groups

    resources = resources_from_ray_nodes(ray.nodes())
    (local,) = resources
    plan = schedule(resources, [Role(name="train"), Role(name="rollout")])
    groups = placement_groups(plan)
    try:
        assert {role: list(placement_group_table(pg)["bundles_to_node_id"].values()) for role, pg in groups.items()} == {"train": [local.ray_node_id], "rollout": [local.ray_node_id]}
    finally:
        for pg in groups.values():
            ray.util.remove_placement_group(pg)
    # a node the plan chose that has left: the group is never granted, and the error says where it was pinned
    gone = schedule([dataclasses.replace(local, ray_node_id="f" * 56)], [Role(name="train")])
    live = lambda: {k for k, pg in placement_group_table().items() if pg["state"] != "REMOVED"}
    before = live()
    with pytest.raises(PlacementError, match=rf"cannot place role 'train': its 1 bundle\(s\) .* were not granted on the node\(s\) the plan chose \({local.node}: one may have left the cluster since; `ray status` lists the nodes, and a new run plans on them as they are\)"):
        placement_groups(gone, wait_s=2)
    assert live() == before  # the refused group is removed, not left waiting


def test_an_instance_goes_to_the_fullest_node_it_fits_so_a_larger_one_still_fits_later():
    """First fit put the 4-device trainer on the 8-device node, and the 8-device rollout
    instance then fit nowhere, though the trainer fits the 4-device node exactly."""
    nodes = [Resource(node="big", kind="cuda", capacity=8), Resource(node="small", kind="cuda", capacity=4)]
    plan = schedule(nodes, [Role(name="train", devices_each=4), Role(name="rollout", devices_each=8)])
    assert [(a.role, a.node, a.devices) for a in plan.assignments] == [("train", "small", (0, 1, 2, 3)), ("rollout", "big", tuple(range(8)))]
    # ties keep the cluster's order; a role still fills the node it already uses before another
    plan = schedule(nodes + [Resource(node="small2", kind="cuda", capacity=4)], [Role(name="train", count=3, devices_each=2), Role(name="rollout", devices_each=8)])
    assert [a.node for a in plan.of("train")] == ["small", "small", "small2"] and plan.of("rollout")[0].node == "big"
