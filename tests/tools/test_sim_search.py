"""`tidal simulate --search`: placements ranked by their simulated throughput, each row the
overrides that reproduce its prediction (`tools.sim.search`)."""

from __future__ import annotations

import json

import pytest

from tidal.tools.cli import main
from tidal.tools.config import load_config
from tidal.tools.recipes import resolve_recipe
from tidal.tools.sim.cluster import parse_cluster
from tidal.tools.sim.costs import ModelShape
from tidal.tools.sim.lengths import LengthModel
from tidal.tools.sim.simulate import Workload, simulate


def test_search_ranks_placements_and_each_row_reproduces_its_prediction():
    from tidal.tools.sim.search import candidates, search

    recipe = resolve_recipe("mixed_npu_gpu")
    base = ["rollout.max_new_tokens=2048", "model.max_positions=4096", "algorithm.num_steps=3"]
    cluster = parse_cluster({"nodes": [{"name": "n", "device": "h100", "count": 2}]})
    work = Workload(model=ModelShape.qwen2_5("1.5b"), lengths=LengthModel(mean_tokens=600, prompt_sigma=1.0, group_sigma=1.0, max_new_tokens=2048), token_scale=32)
    found = candidates(load_config(recipe, base), cluster)
    # one split of two nodes, as it is (disaggregated), rollout also time-sharing the trainer's
    # node (hybrid) or borrowing it (multiplexed); or all 16 devices colocated; each with
    # 1, 2, 4, 8 devices per rollout instance and staleness 0, 1, 2
    assert len(found) == 4 * 4 * 3
    assert sum("placement.train.lend_to=rollout" in c.overrides for c in found) == 4 * 3
    assert sum("placement.rollout.colocate_with=train" in c.overrides for c in found) == 2 * 4 * 3  # colocated and hybrid
    assert [c.label for c in candidates(load_config(recipe, base), cluster, layouts=("colocated",))] == [c.label for c in found if c.label.startswith("colocated")]
    ranked = search(recipe, base, cluster, work, layouts=("disaggregated", "multiplexed"))  # the CLI tests run the other two
    assert len(ranked) == 2 * 4 * 3
    speeds = [r.prediction.samples_per_s for r in ranked]
    assert speeds == sorted(speeds, reverse=True) and len(set(speeds)) > 1
    for r in ranked:  # each candidate runs the layout its label names
        named = r.candidate.label.split(":")[0] if ":" in r.candidate.label.split(",")[0] else "disaggregated"
        assert r.prediction.layout == named.split(" on ")[0], r.candidate.label
    best = ranked[0]
    assert "algorithm.max_staleness=0" not in best.candidate.overrides  # long tails: async wins
    again, _ = simulate(load_config(recipe, [*base, *best.candidate.overrides]), cluster, work)
    assert again.samples_per_s == best.prediction.samples_per_s
    lent = next(r for r in ranked if r.prediction.layout == "multiplexed" and "rollout 2 x 4" in r.candidate.label and "staleness 2" in r.candidate.label)
    alone = next(r for r in ranked if r.candidate.label == "train 8 h100, rollout 2 x 4 h100, staleness 2")
    assert lent.prediction.roles["rollout"]["instances"] == 4 > alone.prediction.roles["rollout"]["instances"]  # its 2 own and the trainer's node lent as 2 more
    assert lent.prediction.handoffs > 0 and alone.prediction.handoffs == 0


def test_search_on_a_mixed_cluster_also_splits_the_trainers_type():
    from tidal.tools.sim.search import candidates

    recipe = resolve_recipe("mixed_npu_gpu")
    cluster = parse_cluster({"nodes": [{"name": "npu", "device": "910b", "count": 2}, {"name": "gpu", "device": "h100"}]})
    base = ["algorithm.num_steps=2", "rollout.max_new_tokens=1024", "model.max_positions=2048"]
    found = candidates(load_config(recipe, base), cluster, layouts=("disaggregated",))
    labels = [c.label for c in found]
    # 16 910b train and 8 h100 roll out, or the reverse; or 8 910b train and the other 8 roll out beside the h100s
    # (the one h100 node cannot be split); each with 1, 2, 4, 8 devices per instance and staleness 0, 1, 2
    assert len(found) == 3 * 4 * 3
    assert "train 8 910b, rollout 4 x 4 910b+h100, staleness 1" in labels and not any(label.startswith("train 4 h100") for label in labels)
    split = found[labels.index("train 8 910b, rollout 4 x 4 910b+h100, staleness 1")]
    assert "placement.rollout.requires=[]" in split.overrides and "placement.train.count=8" in split.overrides
    work = Workload(model=ModelShape.qwen2_5("0.5b"), lengths=LengthModel(mean_tokens=100, max_new_tokens=1024), token_scale=64)
    prediction, _ = simulate(load_config(recipe, [*base, *split.overrides]), cluster, work)
    assert prediction.roles["train"] == {"devices": 8, "kind": "npu"}
    assert prediction.roles["rollout"]["instances"] == 4 and set(prediction.roles["rollout"]["kind"].split("+")) == {"npu", "cuda"}
    assert len(candidates(load_config(recipe, base), cluster)) == len(found) + 2 * 2 * 4 * 3 + 2 * 4 * 3  # whole types only: hybrid and multiplexed; each type colocated


def test_cli_search_prints_a_ranking(tmp_path, capsys):
    spec = tmp_path / "two.yaml"
    spec.write_text("nodes:\n  - {name: npu, device: 910b}\n  - {name: gpu, device: h100}\n")
    args = ["simulate", "mixed_npu_gpu", f"cluster={spec}", "--search", "--steps", "3", "--model", "0.5b", "--mean-tokens", "100", "--token-scale", "64", "--json"]
    code = main([*args, "--layouts", "disaggregated,colocated"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    ranking = out["ranking"]
    assert {r["placement"].split(",")[0] for r in ranking} == {"train 8 910b", "train 8 h100"} | {f"colocated on 8 {tag}: rollout {8 // each} x {each}" for tag in ("910b", "h100") for each in (1, 2, 4, 8)}  # each type trains while the other rolls out, or alone
    speeds = [r["prediction"]["samples_per_s"] for r in ranking if "prediction" in r]
    assert speeds == sorted(speeds, reverse=True)
    assert all(o.startswith(("placement.", "rollout.", "algorithm.")) for r in ranking for o in r["overrides"])


def test_cli_search_tries_hybrid_and_multiplexed_placements_on_a_mixed_cluster(tmp_path, capsys):
    """Rollout on the other type's devices and, time-sharing, on the trainer's: both kinds."""
    spec = tmp_path / "two.yaml"
    spec.write_text("nodes:\n  - {name: npu, device: 910b}\n  - {name: gpu, device: h100}\n")
    args = ["simulate", "mixed_npu_gpu", f"cluster={spec}", "--search", "--steps", "2", "--model", "0.5b", "--mean-tokens", "100", "--token-scale", "64", "--json"]
    assert main([*args, "--layouts", "hybrid,multiplexed"]) == 0
    ranking = json.loads(capsys.readouterr().out)["ranking"]
    assert len(ranking) == 2 * 2 * 4 * 3 and all("prediction" in r for r in ranking)  # 2 splits x 2 layouts x 4 sizes x 3 stalenesses: every one runs
    for r in ranking:
        layout = r["placement"].split(":")[0]
        assert r["prediction"]["layout"] == layout and "placement.rollout.requires=[]" in r["overrides"]  # either type
        assert r["prediction"]["handoffs"] > 0
    hybrid = next(r["prediction"] for r in ranking if r["placement"].startswith("hybrid: train 8 h100, rollout 1 x 8"))
    assert hybrid["roles"]["rollout"]["instances"] == 2 and set(hybrid["roles"]["rollout"]["kind"].split("+")) == {"cuda", "npu"}
    assert main([*args, "--layouts", "hybrid,sideways"]) == 2
    assert "--layouts hybrid,sideways: layouts are disaggregated, colocated, hybrid, multiplexed" in capsys.readouterr().err
    assert main([a for a in args if a != "--search"] + ["--layouts", "hybrid"]) == 2
    assert "give --search too" in capsys.readouterr().err


def test_cli_search_prints_the_fastest_placements_and_says_how_many_more(tmp_path, capsys, monkeypatch):
    """A search of a large cluster ranks a hundred placements or more: the table shows the
    --top N (10 by default), and says how to see the rest."""
    import types

    from tidal.tools.sim import search as search_module

    def prediction(speed: float) -> types.SimpleNamespace:
        return types.SimpleNamespace(samples_per_s=speed, step_s={"p50": 1.0}, utilisation={"train": 0.5, "rollout": 0.5}, summary=lambda: {"samples_per_s": speed})

    ranked = [search_module.Ranked(candidate=search_module.Candidate(overrides=(f"placement.train.count={k}",), label=f"split {k}"), prediction=prediction(100.0 - k)) for k in range(25)]
    monkeypatch.setattr(search_module, "search", lambda *a, **k: ranked)
    args = ["simulate", "mixed_npu_gpu", "cluster=npu64_gpu32", "--search", "--steps", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "the 10 fastest of 25" in out and "split 9 " in out and "split 10 " not in out
    assert "15 more placement(s): --top 0 prints every one, --json gives each with its whole prediction" in out
    assert main([*args, "--top", "0"]) == 0
    out = capsys.readouterr().out
    assert "split 24 " in out and "more placement" not in out and "fastest of" not in out
    assert main([*args, "--top", "3", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["ranking"]) == 25
    with pytest.raises(SystemExit):
        main([*args, "--top", "-1"])
    assert "'-1' is not an integer >= 0" in capsys.readouterr().err
