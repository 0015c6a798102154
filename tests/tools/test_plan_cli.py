"""`tidal plan` says what `tidal run` will do: the same refusals, and the cluster in --json."""

import json

import pytest

from tidal.tools.cli import main

# Two guests on different devices of one 2-device trainer instance: the plan can be made,
# but under runtime=ray each guest would be given both devices (`flow.colocate.spots`).
SPLIT_GUESTS = [
    "placement.rollout.requires=[]", "placement.rollout.colocate_with=train", "placement.train.count=8",
    "placement.train.devices_each=2", "placement.rollout.count=16", "placement.rollout.devices_each=1",
]
TRAINER_AS_GUEST = ["placement.train.requires=[]", "placement.train.colocate_with=rollout", "placement.rollout.count=4"]
REFUSED = "tidal run would refuse this: "


def _tidal(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _run_error(capsys, tmp_path, recipe, overrides):
    """What `tidal run --check` says of the recipe (its message after `tidal run: error: `)."""
    code, _, err = _tidal(capsys, "run", recipe, *overrides, f"run_dir={tmp_path / 'run'}", "--check")
    assert code == 2 and not (tmp_path / "run").exists()
    (line,) = [x for x in err.splitlines() if x.startswith("tidal run: error: ")]
    return line.removeprefix("tidal run: error: ")


@pytest.mark.parametrize(
    ("overrides", "words"),
    [(SPLIT_GUESTS, "placement: rollout instances 0 and 1 use different devices"), (TRAINER_AS_GUEST, "placement.train.colocate_with=rollout: only rollout time-shares")],
)
def test_plan_shows_a_layout_run_refuses_and_says_so_in_runs_words(capsys, tmp_path, overrides, words):
    """`tidal plan` printed these plans and exited 0; `tidal run` then refused them. The plan is
    still shown (it is what the refusal talks about), followed by run's message, exit 2."""
    message = _run_error(capsys, tmp_path, "mixed_npu_gpu", overrides)
    assert message.startswith(words)
    code, out, err = _tidal(capsys, "plan", "mixed_npu_gpu", *overrides)
    assert code == 2
    assert "plan: " in out and "npu-0" in out
    assert f"tidal plan: error: {REFUSED}{message}" in err.splitlines()


def test_plan_json_of_a_refused_layout_carries_the_refusal(capsys, tmp_path):
    message = _run_error(capsys, tmp_path, "mixed_npu_gpu", SPLIT_GUESTS)
    code, out, err = _tidal(capsys, "plan", "mixed_npu_gpu", *SPLIT_GUESTS, "--json")
    assert code == 2 and f"{REFUSED}{message}" in err
    data = json.loads(out)
    assert data["run_refuses"] == message and data["layout"] == "colocated"


def test_plan_that_cannot_be_made_reports_what_run_reports_first(capsys, tmp_path):
    """runtime=local with two rollout instances: `tidal run` refuses the count (check_runnable)
    before it plans; `tidal plan` said instead that this machine has no room for the second."""
    overrides = ["placement.rollout.count=2", "cluster.nodes=[{name: box, kind: cpu, devices: 1}]"]
    message = _run_error(capsys, tmp_path, "quickstart_cpu", overrides)
    assert message.startswith("placement.rollout.count=2 needs runtime=ray")
    code, out, err = _tidal(capsys, "plan", "quickstart_cpu", *overrides)
    assert code == 2 and out == ""
    assert err.splitlines() == [f"tidal plan: error: {message}"]


def test_plan_json_includes_the_cluster_and_no_refusal_for_a_runnable_recipe(capsys):
    code, out, err = _tidal(capsys, "plan", "mixed_npu_gpu", "cluster.nodes=[{name: n, kind: npu, devices: 16, tags: [fast]}, {name: g, kind: cuda, devices: 16, count: 2}]", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["cluster_from"] == "recipe" and data["run_refuses"] is None
    assert data["cluster"] == [
        {"node": "n", "kind": "npu", "capacity": 16, "tags": ["fast", "npu"]},
        {"node": "g-0", "kind": "cuda", "capacity": 16, "tags": ["cuda", "gpu"]},
        {"node": "g-1", "kind": "cuda", "capacity": 16, "tags": ["cuda", "gpu"]},
    ]
    assert {a["node"] for a in data["assignments"] if a["role"] == "train"} == {"n"}


def test_a_plan_read_off_a_running_ray_names_each_nodes_ray_id_and_says_instances_are_pinned(capsys, monkeypatch, ray_session):
    """Under RAY_ADDRESS the plan's cluster is Ray's nodes; `tidal run` pins each bundle to the
    node the plan chose (`flow.ray.placement.node_selectors`), by the id --json shows."""
    import ray

    monkeypatch.setenv("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    (node,) = [n for n in ray.nodes() if n["Alive"]]
    code, out, _ = _tidal(capsys, "plan", "quickstart_cpu", "runtime=ray", "--json")
    assert code == 0
    plan = json.loads(out)
    assert plan["cluster_from"] == "ray" and [c["ray_node_id"] for c in plan["cluster"]] == [node["NodeID"]]
    code, out, _ = _tidal(capsys, "plan", "quickstart_cpu", "runtime=ray")
    assert code == 0 and "cluster (from ray)" in out and "tidal run pins each instance with devices of its own to the Ray node named here" in out
    monkeypatch.delenv("RAY_ADDRESS")
    code, out, _ = _tidal(capsys, "plan", "quickstart_cpu", "runtime=ray")
    assert code == 0 and "cluster (from this machine)" in out and "pinned" not in out


def test_node_names_and_tags_print_as_written_not_as_rich_markup(capsys):
    """The plan's tables read each cell as rich markup: a node named `box[a100]` printed as
    `box`, and `box[/x]` (or a tag `[/old]`) stopped `tidal plan` with a MarkupError traceback."""
    nodes = "cluster.nodes=[{name: 'box[/x]', kind: cpu, devices: 2, tags: ['[a100]']}]"
    code, out, _ = _tidal(capsys, "plan", "quickstart_cpu", nodes)
    assert code == 0 and "box[/x]" in out and "[a100]" in out
