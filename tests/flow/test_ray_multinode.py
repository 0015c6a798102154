"""Placement on a real multi-node Ray cluster: three raylets on this machine
(`ray.cluster_utils.Cluster`), a CPU head and two worker nodes declaring 8 and 4 GPUs
(Ray counts them; nothing computes on them). Run in a process of its own, since the
test session's Ray (`ray_session`) is a one-node cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group_table
    from tidal.flow.placement import Role, resources_from_ray_nodes, schedule
    from tidal.flow.ray.placement import placement_groups

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        eight = cluster.add_node(num_cpus=1, num_gpus=8)
        four = cluster.add_node(num_cpus=1, num_gpus=4)
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
        cluster.wait_for_nodes()
        plan = schedule(resources_from_ray_nodes(ray.nodes()), [Role(name="train", devices_each=4), Role(name="rollout", devices_each=8)])
        groups = placement_groups(plan, wait_s=30)
        out = {
            "ids": {"eight": eight.node_id, "four": four.node_id},
            "plan": {a.role: next(r.ray_node_id for r in plan.resources if r.node == a.node) for a in plan.assignments},
            "granted": {role: list(placement_group_table(pg)["bundles_to_node_id"].values()) for role, pg in groups.items()},
        }
        print("RESULT " + json.dumps(out))
    finally:
        ray.shutdown()
        cluster.shutdown()
    """
)


@pytest.mark.slow
def test_each_bundle_sits_on_the_node_the_plan_chose_on_a_multi_node_ray_cluster():
    """Best fit puts the 4-GPU trainer on the 4-GPU node and the 8-GPU rollout instance on
    the 8-GPU one. Left to PACK, Ray put the trainer's bundle on the 8-GPU node, and the
    rollout group then waited until it failed (seen in two of two runs before the bundles
    were pinned to their nodes)."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=180, env=env)
    line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert done.returncode == 0 and line is not None, f"rc {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    out = json.loads(line.removeprefix("RESULT "))
    ids = out["ids"]
    assert out["plan"] == {"train": ids["four"], "rollout": ids["eight"]}
    assert out["granted"] == {"train": [ids["four"]], "rollout": [ids["eight"]]}
