"""`tools.plan`: a recipe's cluster and placement as a plan, and errors that name the recipe key."""

import pytest

from tidal.tools.config import ConfigError, load_config
from tidal.tools.plan import make_plan
from tidal.tools.recipes import resolve_recipe

MIXED = resolve_recipe("mixed_npu_gpu")  # 2 x 8 NPUs, 2 x 8 GPUs; train on [npu] x 16, rollout on [gpu] x 8 x 2


def _plan(*overrides):
    return make_plan(load_config(MIXED, list(overrides)))[0]


def test_a_trainer_split_over_npus_and_gpus_is_refused_naming_the_key():
    """Trainer ranks form one process group of one collective backend: ranks on NPUs and
    on GPUs could not (a fake cluster's gloo group would hide it until the real run)."""
    with pytest.raises(ConfigError, match=r"placement\.train: its 20 instances are on npu \(npu-0, npu-1\) and cuda \(gpu-0\) devices.*placement\.train\.requires"):
        _plan("placement.train.requires=[]", "placement.train.count=20", "placement.rollout.count=4")


def test_rollout_may_still_span_vendors_in_a_hybrid_layout():
    """Rollout instances are independent engines (weights reach each over the host transport)."""
    plan = _plan("placement.rollout.requires=[]", "placement.rollout.colocate_with=train", "placement.rollout.count=16")
    assert {a.kind for a in plan.of("rollout")} == {"npu", "cuda"}


@pytest.mark.parametrize(
    ("nodes", "message"),
    [
        ("[{name: a, kind: tpu, devices: 2}]", r"cluster\.nodes\[0\]\.kind='tpu' is not one of cuda, npu, cpu"),
        ("[{name: a, kind: cuda, devices: -1}]", r"cluster\.nodes\[0\]\.devices=-1 must be >= 0"),
        ("[{name: a, kind: cuda, devices: 2}, {name: a, kind: npu, devices: 2}]", r"cluster\.nodes\[1\]\.name='a' names node 'a' again \(cluster\.nodes\[0\] made it\)"),
        ("[{name: a, kind: cuda, devices: 2, count: 2}, {name: a-1, kind: npu, devices: 2}]", r"cluster\.nodes\[1\]\.name='a-1' names node 'a-1' again \(cluster\.nodes\[0\]"),
    ],
)
def test_a_bad_cluster_node_names_its_recipe_key(nodes, message):
    with pytest.raises(ConfigError, match=message):
        _plan(f"cluster.nodes={nodes}")
