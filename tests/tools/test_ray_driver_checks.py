"""The driver's checks that need no Ray cluster: what `tools.ray_run.init_ray` asks a local Ray for, and where guests may sit (`flow.ray.placement`)."""

from __future__ import annotations

import pytest

from tidal.tools.config import load_config
from tidal.tools.recipes import resolve_recipe


@pytest.fixture
def ray_init_calls(monkeypatch):
    """`ray.init`'s keyword arguments, recorded instead of starting Ray, on a machine of 2 cores."""
    import ray

    import tidal.tools.ray_run as ray_run

    calls: list[dict] = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # init_ray drops it for a fake GPU node; put back afterwards
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(ray_run.os, "cpu_count", lambda: 2)
    return calls


def test_a_fake_cpu_node_with_more_devices_than_cores_declares_them(ray_init_calls):
    """A fake cluster's cpu devices are declared, as its NPUs and GPUs are: on 2 cores, two
    cpu nodes of 3 devices give Ray 6 CPUs (it failed "needs 4 CPU (the cluster has 2)")."""
    from tidal.tools.ray_run import init_ray

    cfg = load_config(resolve_recipe("quickstart_cpu"), ["runtime=ray", "cluster.fake=true", "cluster.nodes=[{name: a, kind: cpu, devices: 3, count: 2}, {name: g, kind: cuda, devices: 2}]"])
    init_ray(cfg)
    (kwargs,) = ray_init_calls
    assert kwargs["num_cpus"] == 6
    assert kwargs["num_gpus"] == 2


def test_a_fake_cluster_with_few_cpu_devices_keeps_the_machines_cores(ray_init_calls):
    """Fewer declared cpu devices than cores (or none) leave Ray every core: the trainer's
    helpers and a GPU node's actors still get CPU time."""
    from tidal.tools.ray_run import init_ray

    cfg = load_config(resolve_recipe("quickstart_cpu"), ["runtime=ray", "cluster.fake=true", "cluster.nodes=[{name: a, kind: cpu, devices: 1}, {name: g, kind: cuda, devices: 2}]"])
    init_ray(cfg)
    assert ray_init_calls[0]["num_cpus"] == 2


def _spots(*overrides: str) -> dict:
    from tidal.flow.colocate import spots
    from tidal.tools.plan import make_plan

    cluster = "cluster.nodes=[{name: box, kind: cpu, devices: 2}]"
    cfg = load_config(resolve_recipe("quickstart_cpu"), ["runtime=ray", "cluster.fake=true", cluster, "train.backend=fsdp", "placement.train.count=2", "placement.rollout.colocate_with=train", *overrides])
    plan, _ = make_plan(cfg)
    return spots(plan)


def test_a_guest_spanning_trainer_ranks_that_ray_put_on_two_nodes_is_a_placement_error():
    """The trainer's bundles are packed, not pinned, onto one node: a guest given both ranks'
    visible devices would get devices of two nodes and build on the wrong ones."""
    from tidal.flow.placement import PlacementError
    from tidal.flow.ray.placement import check_guests_on_one_node

    placed = _spots("placement.rollout.count=1", "placement.rollout.devices_each=2")
    assert placed[("rollout", 0)].turns == (0, 1)
    check_guests_on_one_node(placed, [{"node": "n1"}, {"node": "n1"}])  # packed: fine
    with pytest.raises(PlacementError, match=r"rollout instance 0 time-shares the devices of trainer ranks \[0, 1\], which Ray placed on 2 nodes \(n1, n2\).*placement.rollout.devices_each=1"):
        check_guests_on_one_node(placed, [{"node": "n1"}, {"node": "n2"}])


def test_a_guest_per_trainer_rank_may_sit_on_any_node():
    from tidal.flow.ray.placement import check_guests_on_one_node

    placed = _spots("placement.rollout.count=2")
    assert [placed[("rollout", i)].turns for i in (0, 1)] == [(0,), (1,)]
    check_guests_on_one_node(placed, [{"node": "n1"}, {"node": "n2"}])
