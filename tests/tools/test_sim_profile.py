"""`tools.sim.profile`: the measurements of `tidal profile`, on this machine's platform (CPU
in CI) with the quickstart recipe's tiny model and small grids. No timing thresholds:
timings are noisy, so the tests check shapes, keys and that every timing is a real number."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tidal.tools.config import load_config
from tidal.tools.recipes import resolve_recipe
from tidal.tools.sim import ModelShape
from tidal.tools.sim.profile import KEYS, load, measure, save
from tidal.tools.train import build_policy

BATCHES = (1, 2)
CONTEXTS = (8, 16, 62, 200)
"""With repeats=1 a decode point needs context + 3 <= 64 positions: 62 is prefilled but not
decoded, 200 neither."""


@pytest.fixture(scope="module")
def cfg() -> Any:
    return load_config(resolve_recipe("quickstart_cpu"))


@pytest.fixture(scope="module")
def profile(cfg: Any) -> dict[str, Any]:
    lines: list[str] = []
    out = measure(cfg, batches=BATCHES, contexts=CONTEXTS, train_rows=(1, 2), train_context=16, repeats=1, progress=lines.append)
    out["_progress"] = lines  # for the progress test; not part of the profile
    return out


def _plain(profile: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in profile.items() if k != "_progress"}


def _timings(profile: dict[str, Any]) -> list[float]:
    points = [p["seconds"] for key in ("decode", "prefill", "train") for p in profile[key]]
    return points + [profile["peak"]["flops"], profile["peak"]["bytes_per_s"], profile["weights"]["export_s"], profile["weights"]["load_s"]]


def test_profile_has_every_key_and_positive_finite_timings(profile):
    plain = _plain(profile)
    assert set(plain) == {*KEYS, "generate", "contention"}  # both optional; contention: a host profile's
    json.dumps(plain, allow_nan=False)
    assert plain["version"] == 1 and plain["recipe"] == "quickstart_cpu"
    assert plain["platform"] == {"kind": "cpu", "device_count": 1}
    assert plain["host_device_bytes_per_s"] is None  # the CPU's device is the host
    assert all(isinstance(t, float) and math.isfinite(t) and t > 0 for t in _timings(plain))
    assert profile["_progress"] and all(isinstance(line, str) for line in profile["_progress"])


def test_grid_points_that_fit_the_model_and_only_those(profile):
    decoded = [(p["batch"], p["context"]) for p in profile["decode"]]
    prefilled = [(p["batch"], p["context"]) for p in profile["prefill"]]
    assert decoded == [(b, c) for b in BATCHES for c in (8, 16)]
    assert prefilled == [(b, c) for b in BATCHES for c in (8, 16, 62)]


def test_train_points_count_rows_times_context(profile):
    train = profile["train"]
    assert [(p["rows"], p["context"], p["tokens"]) for p in train] == [(1, 16, 16), (2, 16, 32)]
    assert all(a["tokens"] < b["tokens"] for a, b in zip(train, train[1:]))


def test_model_shape_is_the_policy_build_policy_returns(cfg, profile):
    model = build_policy(cfg)
    shape = ModelShape(**profile["model"])  # what the simulator's cost models take
    assert shape.name == "tiny"
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    assert (shape.num_layers, shape.hidden_size, shape.num_kv_heads) == (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_kv_heads)
    assert shape.head_dim == cfg.model.hidden_size // cfg.model.num_heads
    assert shape.bytes_per_param == 4  # float32
    assert profile["weights"]["bytes"] == shape.num_params * shape.bytes_per_param  # tied weights cloned once


def test_save_load_round_trip(profile, tmp_path):
    path = tmp_path / "sub" / "profile.json"
    save(_plain(profile), path)
    assert load(path) == _plain(profile)
    assert [p.name for p in path.parent.iterdir()] == ["profile.json"]  # no temporary file left


def test_generate_points_are_whole_calls_that_run_to_their_budget(profile, cfg):
    """The smallest and largest batch x the default new tokens (4, 16), prompts of the
    shortest context; `_generate_points` raises if a row stopped short of its budget."""
    calls = [(p["batch"], p["prompt"], p["new_tokens"]) for p in profile["generate"]]
    assert calls == [(b, 8, n) for b in BATCHES for n in (4, 16)]
    by = {(p["batch"], p["new_tokens"]): p["seconds"] for p in profile["generate"]}
    assert by[(2, 16)] > by[(2, 4)]  # more decode steps, longer calls
    assert "generate" not in measure(cfg, batches=(1,), contexts=(8,), train_rows=(1,), generate_tokens=(), repeats=1, contention=False)


def test_each_row_of_a_profiled_generate_call_has_a_prompt_of_its_own(cfg, monkeypatch):
    """Rows sharing a prompt share its prefill (the hf engine prefills distinct inputs once):
    a call of repeated prompts would time less prefill than the simulator charges for it."""
    from tidal.engines.hf_rollout import HFRolloutEngine

    prompts: list[list[tuple[int, ...]]] = []
    real_generate = HFRolloutEngine.generate

    def recording(self, trajectories, **kwargs):
        prompts.append([tuple(t.prompt_ids) for t in trajectories])
        return real_generate(self, trajectories, **kwargs)

    monkeypatch.setattr(HFRolloutEngine, "generate", recording)
    measure(cfg, batches=(64,), contexts=(3,), train_rows=(1,), generate_tokens=(1,), repeats=1, contention=False)
    assert prompts and all(len(set(call)) == len(call) == 64 for call in prompts)


@pytest.mark.parametrize(("drop", "named"), [("peak", "'peak'"), ("model.head_dim", "'model.head_dim'"), ("decode.seconds", "'decode[0].seconds'"), ("generate.new_tokens", "'generate[0]'")])
def test_load_names_the_file_and_the_missing_key(profile, tmp_path, drop, named):
    data = json.loads(json.dumps(_plain(profile)))
    section, _, key = drop.partition(".")
    if not key:
        del data[section]
    elif isinstance(data[section], list):
        del data[section][0][key]
    else:
        del data[section][key]
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="broken.json") as e:
        load(path)
    assert named in str(e.value)


def test_load_refuses_another_version_and_bad_values(profile, tmp_path: Path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**_plain(profile), "version": 2}))
    with pytest.raises(ValueError, match="'version'"):
        load(path)
    path.write_text(json.dumps({**_plain(profile), "peak": {"flops": -1.0, "bytes_per_s": 1.0}}))
    with pytest.raises(ValueError, match="p.json.*'peak.flops'"):
        load(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="p.json"):
        load(path)


def test_measure_refuses_a_train_context_beyond_the_model(cfg):
    with pytest.raises(ValueError, match="train_context=100"):
        measure(cfg, batches=(1,), contexts=(8,), train_rows=(1,), train_context=100, repeats=1)


def test_training_is_timed_on_the_recipes_engine_with_the_prompt_share_asked_for(cfg, monkeypatch):
    from tidal.engines.registry import load

    steps = []
    engine_cls = load("train.backend", cfg.train.backend)
    real_step = engine_cls.train_step

    def counting(self, batch, advantages, **kwargs):
        steps.append((batch.input_ids.shape, int(batch.loss_mask.sum(dim=1)[0]), int(torch.get_num_threads())))
        return real_step(self, batch, advantages, **kwargs)

    monkeypatch.setattr(engine_cls, "train_step", counting)
    out = measure(cfg, batches=(1,), contexts=(8,), train_rows=(3,), train_context=8, train_prompt=5, repeats=1)
    assert out["train"] == [{"rows": 3, "context": 8, "tokens": 24, "seconds": out["train"][0]["seconds"], "recompute": False}]
    assert steps and all(shape == (3, 8) and loss == 3 for shape, loss, _ in steps)  # 5 prompt + 3 response tokens a row
    assert {threads for *_, threads in steps} == {cfg.threads}  # the run's train-stage threads
    with pytest.raises(ValueError, match="train_prompt must be >= 1"):
        measure(cfg, batches=(1,), contexts=(8,), train_rows=(1,), train_prompt=0, repeats=1)


def test_a_host_profile_times_each_role_beside_the_others_work(profile, cfg):
    assert set(profile["contention"]) == {"train", "rollout"}
    assert all(math.isfinite(v) and v > 0 for v in profile["contention"].values())
    without = measure(cfg, batches=(1,), contexts=(8,), train_rows=(1,), repeats=1, contention=False)
    assert "contention" not in without


def test_a_train_point_says_whether_the_model_recomputed_activations(cfg, monkeypatch):
    """`calibrate.fit` counts a recomputed forward pass in such a point's FLOPs."""
    import tidal.tools.train

    real_build = tidal.tools.train.build_policy

    def checkpointed(cfg):
        model = real_build(cfg)
        model.gradient_checkpointing_enable()  # what `model.gradient_checkpointing: true` does to an hf model
        return model

    monkeypatch.setattr(tidal.tools.train, "build_policy", checkpointed)
    out = measure(cfg, batches=(1,), contexts=(8,), train_rows=(2,), train_context=8, repeats=1, contention=False)
    assert [p["recompute"] for p in out["train"]] == [True]
