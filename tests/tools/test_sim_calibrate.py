"""Calibration: efficiency factors fitted from a profile, and `tidal simulate --profile`."""

from __future__ import annotations

import json

import pytest

from tidal.tools.cli import main
from tidal.tools.sim import costs
from tidal.tools.sim.calibrate import extrapolations, fit, profiled_device, profiled_model
from tidal.tools.sim.costs import Efficiency

MODEL = {"num_params": 500_000_000, "num_layers": 24, "hidden_size": 896, "num_kv_heads": 2, "head_dim": 64, "bytes_per_param": 2, "name": "synthetic"}
PEAK = {"flops": 100e12, "bytes_per_s": 1e12}


def _profile(*, decode: float, prefill: float, mfu: float, fixed: tuple[float, float, float] = (0.0, 0.0, 0.0)) -> dict:
    """A profile whose every time is the roofline's at the given efficiencies, plus the
    `fixed` seconds of each decode step, prefill and training step."""
    base = {"version": 1, "date": "2026-11-29T00:00:00Z", "recipe": "synthetic", "platform": {"kind": "cuda", "device_count": 8}, "torch": "x", "model": MODEL, "peak": PEAK, "weights": {"bytes": 10**9, "export_s": 0.1, "load_s": 0.1}, "host_device_bytes_per_s": 2e10}
    device, model = profiled_device(base), profiled_model(base)
    eff = Efficiency(decode_bandwidth=decode, prefill_compute=prefill, train_mfu=mfu, decode_step_overhead_s=fixed[0], prefill_overhead_s=fixed[1], train_step_overhead_s=fixed[2])
    grid = [(b, c) for b in (1, 4, 16) for c in (64, 256)]
    base["decode"] = [{"batch": b, "context": c, "seconds": costs.decode_step_s(model, device, tp=1, batch=b, context_tokens=b * c, eff=eff)} for b, c in grid]
    base["prefill"] = [{"batch": b, "context": c, "seconds": costs.prefill_s(model, device, tp=1, tokens=b * c, eff=eff)} for b, c in grid]
    base["train"] = [{"rows": r, "context": 256, "tokens": r * 256, "seconds": fixed[2] + 6 * model.num_params * r * 256 / (device.flops * mfu)} for r in (4, 16)]
    return base


def test_fit_recovers_the_efficiencies_a_profile_was_made_with():
    cal = fit(_profile(decode=0.55, prefill=0.35, mfu=0.25), source="synthetic.json")
    assert cal.eff.decode_bandwidth == pytest.approx(0.55) and cal.eff.prefill_compute == pytest.approx(0.35) and cal.eff.train_mfu == pytest.approx(0.25)
    assert (cal.max_decode_batch, cal.max_context, cal.max_train_tokens) == (16, 256, 16 * 256)
    assert "synthetic.json (cuda, synthetic" in cal.source


def test_a_profile_of_a_recipe_that_recomputes_activations_fits_the_flops_it_ran():
    """The same measured train times, taken with `model.gradient_checkpointing` on, did 8/6 the
    FLOPs: a higher fitted MFU, which a simulated recipe that also recomputes spends again."""
    plain = _profile(decode=0.5, prefill=0.5, mfu=0.3)
    recomputed = {**plain, "train": [{**p, "recompute": True} for p in plain["train"]]}
    assert fit(plain, source="p.json").eff.train_mfu == pytest.approx(0.3)
    assert fit(recomputed, source="p.json").eff.train_mfu == pytest.approx(0.4)


def test_fit_takes_a_generate_calls_own_cost_from_whole_calls():
    """Whole calls that took `generate_s` at the fitted factors, plus 5 ms a call and 0.3 ms a
    decode step that the bare forward passes did not show (sampling, the engine's loop)."""
    profile = _profile(decode=0.5, prefill=0.5, mfu=0.5, fixed=(0.001, 0.0, 0.0))
    base = fit(profile, source="p.json").eff
    device, model = profiled_device(profile), profiled_model(profile)
    profile["generate"] = [
        {"batch": b, "prompt": 64, "new_tokens": n, "seconds": 0.005 + 0.0003 * n + costs.generate_s(model, device, tp=1, prompt_tokens=64, response_tokens=[n] * b, slots=b, eff=base)}
        for b in (1, 16)
        for n in (4, 16)
    ]
    eff = fit(profile, source="p.json").eff
    assert eff.generate_call_overhead_s == pytest.approx(0.005) and eff.decode_step_overhead_s == pytest.approx(0.001 + 0.0003)
    assert base.generate_call_overhead_s == 0  # no generate points: nothing assumed
    # a call predicted at the fitted figures is the call measured
    for call in profile["generate"]:
        predicted = costs.generate_s(model, device, tp=1, prompt_tokens=64, response_tokens=[call["new_tokens"]] * call["batch"], slots=call["batch"], eff=eff)
        assert predicted == pytest.approx(call["seconds"])


def test_fit_separates_each_steps_fixed_cost_from_the_work():
    cal = fit(_profile(decode=0.55, prefill=0.35, mfu=0.25, fixed=(0.002, 0.004, 0.03)), source="synthetic.json")
    eff = cal.eff
    assert (eff.decode_bandwidth, eff.train_mfu) == pytest.approx((0.55, 0.25))
    assert (eff.decode_step_overhead_s, eff.train_step_overhead_s) == pytest.approx((0.002, 0.03))
    # the shortest prefills are bound by reading the weights, not by compute: not quite a line
    assert eff.prefill_compute == pytest.approx(0.35, rel=0.01) and eff.prefill_overhead_s == pytest.approx(0.004, rel=0.1)
    # a ratio alone would have charged the fixed cost to the work: a lower factor
    assert min(cal.factors["train_mfu"]) < 0.25


def test_a_fit_that_is_not_a_line_falls_back_to_the_median_ratio():
    profile = _profile(decode=0.5, prefill=0.5, mfu=0.5)
    small, large = profile["train"]
    large["seconds"] = small["seconds"] * 8  # 4x the tokens in 8x the time: the line's fixed cost would be negative
    cal = fit(profile, source="p.json")
    assert cal.eff.train_step_overhead_s == 0 and cal.eff.train_mfu == pytest.approx((0.5 + 0.25) / 2)  # the median ratio
    single = {**_profile(decode=0.5, prefill=0.5, mfu=0.5, fixed=(0.0, 0.0, 0.01)), "train": [profile["train"][0]]}
    assert fit(single, source="p.json").eff.train_step_overhead_s == 0


def test_fixed_costs_are_charged_once_a_step_and_never_to_no_work():
    model, dev = costs.ModelShape.qwen2_5("0.5b"), profiled_device(_profile(decode=0.5, prefill=0.5, mfu=0.5))
    plain, fixed = Efficiency(), Efficiency(decode_step_overhead_s=0.001, prefill_overhead_s=0.002, train_step_overhead_s=0.01)
    assert costs.decode_step_s(model, dev, tp=1, batch=4, context_tokens=400, eff=fixed) == pytest.approx(costs.decode_step_s(model, dev, tp=1, batch=4, context_tokens=400, eff=plain) + 0.001)
    assert costs.prefill_s(model, dev, tp=1, tokens=100, eff=fixed) == pytest.approx(costs.prefill_s(model, dev, tp=1, tokens=100, eff=plain) + 0.002)
    assert costs.train_step_s(model, dev, num_devices=1, tokens=100, eff=fixed) == pytest.approx(costs.train_step_s(model, dev, num_devices=1, tokens=100, eff=plain) + 0.01)
    assert costs.decode_step_s(model, dev, tp=1, batch=0, context_tokens=0, eff=fixed) == 0 and costs.prefill_s(model, dev, tp=1, tokens=0, eff=fixed) == 0
    with pytest.raises(ValueError, match="train_step_overhead_s must be >= 0"):
        Efficiency(train_step_overhead_s=-1.0)


def test_extrapolations_name_what_runs_past_the_profile():
    cal = fit(_profile(decode=0.5, prefill=0.5, mfu=0.5), source="p.json")
    assert extrapolations(cal, decode_batch=16, context=256, train_tokens=4096) == []
    beyond = extrapolations(cal, decode_batch=256, context=4352, train_tokens=100_000)
    assert len(beyond) == 3 and "256 sequences" in beyond[0] and "up to 16" in beyond[0] and "4352 tokens" in beyond[1]


def test_a_profile_without_points_is_refused_naming_it():
    empty = {**_profile(decode=0.5, prefill=0.5, mfu=0.5), "train": []}
    with pytest.raises(ValueError, match="p.json: the profile has no train points"):
        fit(empty, source="p.json")


def test_simulate_with_a_profile_uses_its_factors_and_says_where_it_extrapolates(tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_profile(decode=0.3, prefill=0.3, mfu=0.2)))
    args = ["simulate", "mixed_npu_gpu", "cluster=npu64_gpu32", "rollout.max_new_tokens=1024", "model.max_positions=2048", "--steps", "2", "--model", "0.5b", "--mean-tokens", "300", "--trace", str(tmp_path / "t.json"), "--json"]
    assert main([*args, "--profile", str(path)]) == 0
    calibrated = json.loads(capsys.readouterr().out)
    assert calibrated["calibrated"].startswith(str(path)) and calibrated["efficiency"]["train_mfu"] == pytest.approx(0.2)
    assert any("contexts of up to" in line for line in calibrated["extrapolations"])  # 256 + up to 1024 tokens against a profile of 256
    assert main(args) == 0
    assumed = json.loads(capsys.readouterr().out)
    assert assumed["calibrated"] is False and assumed["extrapolations"] == []
    assert calibrated["total_s"] > assumed["total_s"]  # lower efficiencies than the assumed ones: a slower cluster


def test_cli_profile_writes_a_profile_that_simulate_fits(tmp_path, capsys):
    from tidal.tools.sim.profile import load

    out = tmp_path / "cpu.json"
    assert main(["profile", "quickstart_cpu", "--out", str(out), "--batches", "1,2", "--contexts", "8", "--train-rows", "2", "--train-context", "7", "--train-prompt", "5", "--repeats", "1"]) == 0
    printed = capsys.readouterr().out
    assert "fitted: decode bandwidth" in printed and str(out) in printed
    profile = load(out)
    assert [(p["batch"], p["context"]) for p in profile["decode"]] == [(1, 8), (2, 8)]
    assert [(p["rows"], p["context"], p["tokens"]) for p in profile["train"]] == [(2, 7, 14)]
    cal = fit(profile, source=str(out))
    assert 0 < cal.eff.decode_bandwidth <= 1 and 0 < cal.eff.train_mfu <= 1


def test_cli_profile_refuses_a_bad_grid(capsys):
    with pytest.raises(SystemExit):
        main(["profile", "quickstart_cpu", "--batches", "0,2"])
    assert "integers >= 1" in capsys.readouterr().err


def test_a_spec_and_a_model_may_be_the_profiled_ones(tmp_path, capsys):
    from tidal.tools.sim.cluster import parse_cluster

    profile = {**_profile(decode=0.5, prefill=0.5, mfu=0.5), "platform": {"kind": "cpu", "device_count": 1}}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile))
    spec = tmp_path / "box.yaml"
    spec.write_text("nodes:\n  - {name: box, device: profiled, devices_per_node: 2}\n")
    with pytest.raises(ValueError, match="'profiled', the device a `tidal profile` measured, needs --profile"):
        parse_cluster({"nodes": [{"name": "box", "device": "profiled"}]})
    args = ["simulate", "quickstart_cpu", f"cluster={spec}", "--steps", "2", "--token-scale", "1", "--mean-tokens", "3", "--prompt-tokens", "5", "--trace", str(tmp_path / "t.json"), "--json"]
    assert main([*args, "--model", "profiled"]) == 2
    assert "box.yaml: nodes[0].device: unknown device 'profiled'" in capsys.readouterr().err
    assert main(["simulate", "quickstart_cpu", "cluster=gpu64", "--model", "profiled"]) == 2
    assert "--model profiled simulates the model a `tidal profile` timed: give the profile with --profile" in capsys.readouterr().err
    assert main([*args, "--model", "profiled", "--profile", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["roles"]["train"] == {"devices": 1, "kind": "cpu"} and out["roles"]["transport"] == "ipc"  # two cores of one host share memory
    assert out["efficiency"]["train_mfu"] == pytest.approx(0.5) and out["samples_per_s"] > 0


def test_a_profiles_contention_becomes_the_slowdowns_beside_the_other_role():
    profile = {**_profile(decode=0.5, prefill=0.5, mfu=0.5), "contention": {"train": 1.3, "rollout": 0.97}}
    eff = fit(profile, source="p.json").eff
    assert (eff.train_beside_rollout, eff.rollout_beside_train) == (1.3, 1.0)  # faster beside the other is noise: 1
    plain = fit(_profile(decode=0.5, prefill=0.5, mfu=0.5), source="p.json").eff
    assert (plain.train_beside_rollout, plain.rollout_beside_train) == (1.0, 1.0)
    with pytest.raises(ValueError, match="train_beside_rollout must be >= 1"):
        Efficiency(train_beside_rollout=0.5)


def test_an_ipc_weight_sync_costs_what_the_profile_measured_exporting_and_loading_the_weights():
    profile = _profile(decode=0.5, prefill=0.5, mfu=0.5)  # 1 GB of weights exported and loaded in 0.1 s each
    eff = fit(profile, source="p.json").eff
    device, model = profiled_device(profile), profiled_model(profile)
    assert eff.ipc_setup_s == pytest.approx(0.2 - 10**9 / (1e12 * 0.5))  # less the copy the cost model charges
    assert model.weight_bytes == 10**9 and costs.weight_sync_s(model, transport="ipc", src=device, dst=device, eff=eff) == pytest.approx(0.2)
    quick = {**profile, "weights": {"bytes": 10**9, "export_s": 0.0005, "load_s": 0.0005}}  # faster than the copy: no fixed cost below 0
    assert fit(quick, source="p.json").eff.ipc_setup_s == 0.0
    assert Efficiency().ipc_setup_s == costs.IPC_SETUP_S  # uncalibrated: the assumption
    with pytest.raises(ValueError, match="ipc_setup_s"):
        Efficiency(ipc_setup_s=-1.0)
