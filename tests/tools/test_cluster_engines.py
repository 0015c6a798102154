"""A Ray cluster a run joins: each node the plan gives a role is checked, by that node's own
probe, for the role's engine (`tools.cluster.check_cluster`, `tools.run.RecipeEngineCheck`)."""

from __future__ import annotations

from tidal.flow.ray.cluster import NodeReport, probe_cluster
from tidal.tools.cluster import check_cluster, engine_problems
from tidal.tools.config import load_config
from tidal.tools.plan import make_plan
from tidal.tools.recipes import resolve_recipe
from tidal.tools.run import RecipeEngineCheck

RAY_NODES = [
    {"NodeID": "n1", "NodeName": "npu-0", "Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 8.0, "NPU": 2.0}},
    {"NodeID": "n2", "NodeName": "gpu-0", "Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 8.0, "GPU": 2.0}},
]


def _report(node_id: str, name: str, devices: dict, engines: dict) -> NodeReport:
    return NodeReport(node_id=node_id, name=name, address="10.0.0.9", devices=devices, resources={}, free=None, versions={}, missing={}, listens="", unreachable={}, engines=engines)


def test_a_node_is_blamed_only_for_an_engine_of_a_role_the_plan_gives_it():
    cfg = load_config(resolve_recipe("mixed_npu_gpu"), ["cluster.nodes=[]", "placement.train.count=2", "placement.rollout.count=1"])
    plan, _ = make_plan(cfg, ray_nodes=lambda: RAY_NODES)
    assert {(a.role, a.node) for a in plan.assignments} == {("train", "npu-0"), ("rollout", "gpu-0")}
    reports = [
        # npu-0 could not run the rollout engine either, but holds no rollout instance
        _report("n1", "npu-0", {"npu": 2}, {"npu": {"train": "train.backend=fsdp needs x, not installed on that node", "rollout": "rollout.backend=vllm needs vllm-ascend"}}),
        _report("n2", "gpu-0", {"cuda": 2}, {"cuda": {"train": "train.backend=fsdp needs y"}}),
    ]
    assert engine_problems(plan, reports) == [
        "node npu-0 (2 npu) would hold train instance(s) 0, 1, but train.backend=fsdp needs x, not installed on that node; "
        "or keep train off the node (placement.train.requires)"
    ]
    assert engine_problems(plan, [_report("n1", "npu-0", {"npu": 2}, {}), _report("n2", "gpu-0", {"cuda": 2}, {})]) == []


def test_the_recipe_check_answers_for_each_role_on_a_kind():
    check = RecipeEngineCheck(rollout="vllm", train="megatron", precision="bf16", fake=False)
    found = check("cpu", here="on that node")
    assert found["rollout"] == "rollout.backend=vllm runs on cuda or npu devices, not on a cpu platform"
    assert found["train"].startswith("train.precision=bf16: train.backend=megatron trains in fp32 on a cpu platform")
    assert RecipeEngineCheck(rollout="hf", train="torch", precision="bf16", fake=True)("npu") == {}


def test_each_nodes_probe_runs_the_check_there_and_the_cluster_check_names_the_node(ray_session):
    import ray

    reports = probe_cluster(check=RecipeEngineCheck(rollout="vllm", train="torch", precision="fp32", fake=False))
    (node,) = reports
    assert node.engines == {"cpu": {"rollout": "rollout.backend=vllm runs on cuda or npu devices, not on a cpu platform"}}
    assert probe_cluster()[0].engines == {}  # no recipe: nothing to check

    cfg = load_config(resolve_recipe("quickstart_cpu"), ["runtime=ray", "train.backend=megatron", "train.precision=bf16"])
    found = check_cluster(cfg)
    name = ray.nodes()[0].get("NodeName") or ray.nodes()[0]["NodeManagerAddress"]
    assert found.problems == [
        f"node {name} (cpu only) would hold train instance(s) 0, but train.precision=bf16: train.backend=megatron trains in fp32 on a cpu platform; "
        "set train.precision=fp32; or keep train off the node (placement.train.requires)"
    ], found.problems

