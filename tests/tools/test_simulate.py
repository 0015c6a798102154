"""`tidal simulate`: the real workflow on a virtual clock, checked against what its timeline must be."""

from __future__ import annotations

import json
import math
import statistics

import pytest

from tidal.tools.cli import main
from tidal.tools.config import ConfigError, TrainConfig, load_config
from tidal.tools.recipes import resolve_recipe
from tidal.tools.sim import costs
from tidal.tools.sim import simulate as sim_module
from tidal.tools.sim.cluster import parse_cluster
from tidal.tools.sim.costs import Efficiency, ModelShape
from tidal.tools.sim.hardware import device
from tidal.tools.sim.lengths import LengthModel, replay, replay_rewards
from tidal.tools.sim.simulate import Workload, simulate, train_shape

# Two H100 servers, one for training and one for rollout; a network so fast that weight
# syncs cost next to nothing, so a step is generation and training alone.
CLUSTER = parse_cluster({"network": {"scale_out_gbps": 1e5}, "nodes": [{"name": "t", "device": "h100"}, {"name": "r", "device": "h100"}]})
DISJOINT = ["placement.train.requires=[]", "placement.rollout.requires=[]", "placement.train.count=8", "placement.rollout.count=4", "rollout.prompts_per_generate=4"]


def _run(*, staleness: int, sigma: float, mean: float = 1000, steps: int = 8, overrides: tuple[str, ...] = (), reward_s: float = 0.0, **work_args):
    cfg = load_config(resolve_recipe("mixed_npu_gpu"), [f"algorithm.num_steps={steps}", "rollout.max_new_tokens=2048", "model.max_positions=4096", *DISJOINT, f"algorithm.max_staleness={staleness}", *overrides])
    work = Workload(model=ModelShape.qwen2_5("1.5b"), lengths=LengthModel(mean_tokens=mean, prompt_sigma=sigma, group_sigma=sigma, max_new_tokens=2048), token_scale=16, reward_s=reward_s, **work_args)
    return simulate(cfg, CLUSTER, work)


def _durations(tracer, track: str, name: str) -> list[float]:
    return [e["dur"] / 1e6 for e in tracer.spans(track) if e["name"] == name]


def test_the_same_simulation_gives_the_same_timeline():
    first, _ = _run(staleness=1, sigma=1.0)
    second, _ = _run(staleness=1, sigma=1.0)
    assert [s["step_s"] for s in first.steps] == [s["step_s"] for s in second.steps]
    assert first.version_gaps == second.version_gaps and first.total_s == second.total_s
    assert first.paused_generations == second.paused_generations > 0


def test_max_staleness_0_is_the_synchronous_timeline():
    prediction, tracer = _run(staleness=0, sigma=0.0)
    assert set(prediction.version_gaps) == {0}
    generate, train = _durations(tracer, "rollout", "generate"), _durations(tracer, "train", "train")
    publish = _durations(tracer, "train", "publish weights")
    # every step after the first: generate, then train, then the weights' transfer, nothing overlapping
    for step in prediction.steps[1:]:
        assert step["step_s"] == pytest.approx(max(generate) + max(train) + max(publish), rel=0.01)
    assert prediction.idle["train_waiting_for_data"] > 0.5  # the trainer idles while rollout generates


@pytest.mark.parametrize(("train_devices", "bound"), [(2, "train"), (8, "generate")])
def test_constant_lengths_async_speedup_is_the_overlap_of_generation_and_training(train_devices, bound):
    overrides = (f"placement.train.count={train_devices}",)
    sync, sync_trace = _run(staleness=0, sigma=0.0, overrides=overrides)
    overlapped, _ = _run(staleness=1, sigma=0.0, overrides=overrides)
    t_gen = statistics.median(_durations(sync_trace, "rollout", "generate"))
    t_train = statistics.median(_durations(sync_trace, "train", "train"))
    assert (t_train > t_gen) == (bound == "train")
    period = {name: statistics.fmean(s["step_s"] for s in p.steps[2:]) for name, p in (("sync", sync), ("async", overlapped))}
    ideal = (t_gen + t_train) / max(t_gen, t_train)
    # Generation-bound, each weight update pauses the running generation, whose rows then
    # prefill again (KV recomputed under the new weights, as tidal's engines do): async's
    # generation takes that much longer a step. Training-bound, rollout is idle when the
    # weights come: no pause, no cost. (About 1.7% is left generation-bound: the decode step
    # each pause loses in flight, and what else a pause costs that is not counted here.)
    repeat = overlapped.reprefill_share * overlapped.total_s / len(overlapped.steps)
    assert (repeat > 0) == (bound == "generate") and (overlapped.paused_generations > 0) == (bound == "generate")
    paused = (t_gen + t_train) / max(t_gen + repeat, t_train)
    assert period["sync"] / period["async"] == pytest.approx(paused, rel=0.02)
    assert period["sync"] / period["async"] <= ideal * 1.001


def test_long_tails_cost_sync_what_streaming_keeps():
    speedup = {}
    for sigma in (0.0, 1.0):
        sync, _ = _run(staleness=0, sigma=sigma)
        overlapped, _ = _run(staleness=1, sigma=sigma)
        speedup[sigma] = sync.total_s / overlapped.total_s
    assert speedup[1.0] > speedup[0.0] * 1.15


COLOCATED = ("placement.rollout.colocate_with=train", "placement.rollout.count=8", "placement.rollout.devices_each=1")


def test_ppo_adds_the_critics_passes_and_a_kl_in_the_reward_a_reference_pass_on_the_trainers_devices():
    """PPO with a critic (`algorithm.advantage=gae`, one sample per prompt, as many samples a
    step as GRPO's 16 x 8): each synchronous step adds the critic's forward pass over the
    step's rows (a third of a step's FLOPs, no all-reduce) before the policy trains, and its
    training step (the policy's, as every row trains) after; a KL penalty in the reward adds
    the reference's forward pass. The policy's own step is GRPO's."""
    grpo, grpo_trace = _run(staleness=0, sigma=0.0, steps=4)
    ppo_keys = ("algorithm.advantage=gae", "algorithm.group_size=1", "algorithm.prompts_per_step=128")
    ppo, ppo_trace = _run(staleness=0, sigma=0.0, steps=4, overrides=ppo_keys)
    kl, kl_trace = _run(staleness=0, sigma=0.0, steps=4, overrides=(*ppo_keys, "algorithm.kl_in_reward=0.05"))
    train = max(_durations(grpo_trace, "train", "train"))
    assert max(_durations(ppo_trace, "train", "train")) == pytest.approx(train, rel=1e-6)
    critic, values = max(_durations(ppo_trace, "train", "critic")), max(_durations(ppo_trace, "train", "values"))
    assert critic == pytest.approx(train, rel=1e-6) and 0.2 * train < values < train / 3 + 1e-9
    generate = max(_durations(ppo_trace, "rollout", "generate"))
    assert ppo.steps[-1]["step_s"] >= generate + values + train + critic  # synchronous: one after the other (one sample a prompt generates otherwise than groups)
    assert max(_durations(kl_trace, "train", "reference")) == pytest.approx(values, rel=1e-6)
    assert kl.steps[-1]["step_s"] == pytest.approx(ppo.steps[-1]["step_s"] + values, rel=0.01)
    colocated, _ = _run(staleness=1, sigma=0.0, steps=4, overrides=(*ppo_keys, *COLOCATED))  # the critic takes the trainer's turns, parked with it
    warm, warm_trace = _run(staleness=0, sigma=0.0, steps=4, overrides=(*ppo_keys, "algorithm.critic_warmup=2"))  # the policy sits out steps 1 and 2
    assert len(_durations(warm_trace, "train", "train")) == 2 and len(_durations(warm_trace, "train", "critic")) == 4
    assert [w["step_s"] + train * (k < 2) for k, w in enumerate(warm.steps)] == pytest.approx([p["step_s"] for p in ppo.steps], rel=0.01)
    assert colocated.utilisation["train"] + colocated.utilisation["rollout"] <= 1.0 and len(colocated.steps) == 4


def test_a_colocated_plan_takes_turns_on_the_shared_devices():
    """Rollout time-shares the trainer's 8 devices through the real `flow.timeshare` turns on
    the virtual clock: the roles never compute at once (their busy shares add up to at most
    the whole run), the devices change hands on each trainer instance every step, and the
    timeline is the same on every run."""
    steps = 6
    first, _ = _run(staleness=1, sigma=0.0, steps=steps, overrides=COLOCATED)
    again, _ = _run(staleness=1, sigma=0.0, steps=steps, overrides=COLOCATED)
    assert first.layout == "colocated" and first.roles["transport"] == "ipc"
    assert [s["step_s"] for s in first.steps] == [s["step_s"] for s in again.steps]
    assert first.utilisation["train"] + first.utilisation["rollout"] <= 1.0
    assert first.handoffs >= steps * 8  # each of the 8 trainer instances' devices change hands at least once a step
    disaggregated, _ = _run(staleness=1, sigma=0.0, steps=steps)
    assert first.utilisation["rollout"] < disaggregated.utilisation["rollout"]  # rollout waits out training on the shared devices


def test_a_multiplexed_plan_lends_the_trainers_idle_devices_to_borrowed_rollout_instances():
    """`placement.train.lend_to=rollout`: rollout instances of their own plus borrowed ones on
    the trainer's devices, in hand-off mode. The borrowed devices generate while the trainer
    waits, so a step takes less time than with the rollout's own devices alone; the run is
    the same on every run."""
    steps = 6
    lent, _ = _run(staleness=1, sigma=0.0, steps=steps, overrides=("placement.train.lend_to=rollout",))
    again, _ = _run(staleness=1, sigma=0.0, steps=steps, overrides=("placement.train.lend_to=rollout",))
    alone, _ = _run(staleness=1, sigma=0.0, steps=steps)
    assert lent.layout == "multiplexed" and lent.roles["rollout"]["instances"] > alone.roles["rollout"]["instances"]
    assert [s["step_s"] for s in lent.steps] == [s["step_s"] for s in again.steps] and lent.handed_off == again.handed_off
    assert lent.handoffs > 0 and lent.total_s < alone.total_s


def test_a_hybrid_plan_seats_only_the_colocated_instances():
    """More rollout instances than the trainer has devices: the first share them, the rest
    have devices of their own and take no turns; each gets the transport the runtime would
    pick for it."""
    hybrid, _ = _run(staleness=1, sigma=0.0, steps=4, overrides=("placement.rollout.colocate_with=train", "placement.rollout.count=10", "placement.rollout.devices_each=1"))
    assert hybrid.layout == "hybrid" and hybrid.roles["transport"] == "collective+ipc" and hybrid.handoffs > 0


def test_cli_prints_the_prediction_and_writes_the_trace(tmp_path, capsys):
    trace = tmp_path / "sim.json"
    code = main(["simulate", "mixed_npu_gpu", "cluster=npu64_gpu32", "algorithm.num_steps=4", "--model", "0.5b", "--mean-tokens", "200", "--trace", str(trace), "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["calibrated"] is False and out["roles"]["transport"] == "host"
    assert out["roles"]["train"] == {"devices": 16, "kind": "npu"} and out["samples_per_s"] > 0
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("name") == "generate" for e in events) and any(e.get("name") == "train" for e in events)


def test_cli_prints_a_colocated_prediction_with_its_hand_offs(tmp_path, capsys):
    placed = ["placement.train.requires=[]", "placement.rollout.requires=[]", "placement.train.count=8", *COLOCATED]
    code = main(["simulate", "mixed_npu_gpu", "cluster=gpu64", *placed, "algorithm.num_steps=4", "--model", "0.5b", "--mean-tokens", "200", "--trace", str(tmp_path / "sim.json")])
    assert code == 0
    out = capsys.readouterr().out
    assert "cluster gpu64: colocated; train 8 x cuda, rollout 8 x 1 cuda; weights over ipc" in out
    (line,) = [line for line in out.splitlines() if "hand-offs" in line]
    assert int(line.split()[1]) > 0


def test_a_transport_the_devices_cannot_use_is_a_config_error():
    cfg = load_config(resolve_recipe("mixed_npu_gpu"), ["transport.name=collective"])
    work = Workload(model=ModelShape.qwen2_5("0.5b"), lengths=LengthModel(mean_tokens=100))
    npu_gpu = parse_cluster({"nodes": [{"name": "npu", "device": "910b", "count": 2}, {"name": "gpu", "device": "h100", "count": 2}]})
    with pytest.raises(ConfigError, match="transport.name=collective"):
        simulate(cfg, npu_gpu, work)


@pytest.mark.parametrize(
    "override, nodes, expected",
    [
        ("auto", [{"name": "gpu", "device": "h100", "count": 4}], "collective"),  # one kind: the runtime's collective
        ("auto", [{"name": "npu", "device": "910b", "count": 2}, {"name": "gpu", "device": "h100", "count": 2}], "host"),
        ("ipc", [{"name": "gpu", "device": "h100", "count": 4}], "ipc needs"),  # never colocated here: the runtime's own refusal
    ],
)
def test_the_weight_transport_is_the_one_the_runtime_would_choose(override, nodes, expected):
    cfg = load_config(resolve_recipe("mixed_npu_gpu"), [f"transport.name={override}", "algorithm.num_steps=1", "placement.train.requires=[]", "placement.rollout.requires=[]"])
    work = Workload(model=ModelShape.qwen2_5("0.5b"), lengths=LengthModel(mean_tokens=50, max_new_tokens=64))
    cluster = parse_cluster({"nodes": nodes})
    if expected.endswith("needs"):
        with pytest.raises(ConfigError, match=f"transport.name=ipc: transport={expected}"):
            simulate(cfg, cluster, work)
        return
    prediction, _ = simulate(cfg, cluster, work)
    assert prediction.roles["transport"] == expected


def test_cli_names_a_missing_cluster_spec(capsys):
    assert main(["simulate", "mixed_npu_gpu", "cluster=nowhere"]) == 2
    assert "cluster='nowhere'" in capsys.readouterr().err


def test_recorded_lengths_replace_the_sampler(tmp_path, capsys):
    trace = tmp_path / "metrics.jsonl"  # as a run writes it: other keys beside step and lengths
    trace.write_text("\n".join(json.dumps({"step": k, "reward": 0.5, "lengths": [[64] * 8] * 16}) for k in range(2)) + "\n")
    args = ["simulate", "mixed_npu_gpu", "cluster=npu64_gpu32", "rollout.max_new_tokens=1024", "model.max_positions=2048", "--steps", "2", "--model", "0.5b", "--token-scale", "16", "--trace", str(tmp_path / "t.json"), "--json"]
    assert main([*args, "--lengths", str(trace)]) == 0
    replayed = json.loads(capsys.readouterr().out)
    assert replayed["tokens_per_s"] * replayed["total_s"] == pytest.approx(2 * 16 * 8 * 64)  # every response 64 tokens, as recorded
    assert main(args) == 0
    sampled = json.loads(capsys.readouterr().out)
    assert sampled["tokens_per_s"] * sampled["total_s"] != pytest.approx(2 * 16 * 8 * 64)
    assert main([*args, "--lengths", str(trace), "--flat-groups", "1"]) == 0  # no rewards recorded: every group flat
    assert json.loads(capsys.readouterr().out)["total_s"] < replayed["total_s"]
    assert [e["dur"] for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e.get("name") == "train"] == [0, 0]
    trace.write_text("\n".join(json.dumps({"step": k, "lengths": [[64] * 8] * 16, "rewards": [[1] * 8] * 16}) for k in range(2)) + "\n")
    assert main([*args, "--lengths", str(trace)]) == 0
    flat = json.loads(capsys.readouterr().out)  # every group all right: nothing trains
    trained = [e["dur"] for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"] if e.get("name") == "train"]
    assert trained == [0, 0] and flat["total_s"] < replayed["total_s"]
    assert main([*args, "--lengths", str(trace), "--stage-ms", "250"]) == 0
    staged = json.loads(capsys.readouterr().out)
    assert staged["total_s"] > flat["total_s"] + 0.25  # a synchronous step waits for its last batch's stages


def test_bench_simulate_times_a_1024_device_cluster(capsys):
    code = main(["bench", "simulate", "--steps", "1", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["devices"] == 1024 and result["samples_per_step"] == 512 * 16 and result["extrapolated"] is True
    assert result["wall_s_200_steps"] == pytest.approx(result["wall_s"] * 200) and result["simulated_s"] > 0


def test_bench_simulate_check_compares_each_run_with_its_prediction(monkeypatch, capsys):
    """The harness with the real runs stood in for (their RL takes minutes): a profile of this
    machine, a simulation of each run with its lengths, and the errors against the targets.
    The train step's slowdown beside rollout comes from the other seed's pair of runs."""
    from tidal.tools.bench import simulate as bench_simulate

    measured = {"algorithm.max_staleness=1": 2000.0, "algorithm.max_staleness=0": 1500.0, "placement.rollout.colocate_with=train": 1200.0}
    train_s = {("seed=0", "async"): 0.060, ("seed=1", "async"): 0.050}  # sync and colocated: 0.040 (nothing beside them)
    per_token = {("seed=0", "async"): 0.003, ("seed=1", "async"): 0.0024}  # the others: 0.002
    stage_s = {"seed=0": 0.002, "seed=1": 0.003}
    sync_s = {"seed=0": 0.001, "seed=1": 0.004}
    rewards = {1: [[1.0, 0.0] * 4] * 16, 2: [[1.0] * 8] * 8 + [[0.0, 1.0] * 4] * 8}  # step 2: half its groups all right
    ran: list[list[str]] = []

    def fake_run(recipe, overrides):
        ran.append(overrides)
        key = overrides[1] if overrides[1].startswith("placement.") else overrides[0]
        system = "async" if overrides == ["algorithm.max_staleness=1", *overrides[-2:]] else "other"
        spans = {
            "train_s": train_s.get((overrides[-2], system), 0.040),
            "generate_s_per_token": per_token.get((overrides[-2], system), 0.002),
            "generate_s": 0.2 if overrides[-2] == "seed=1" else 0.1,
            "stage_s": stage_s[overrides[-2]],
            "sync_s": sync_s[overrides[-2]],
            "train_overlap": 0.5 if overrides[-2] == "seed=1" else 1.0,  # seed 1's steps had rollout beside them half the time
            "generate_overlap": 1.0,
        }
        return measured[key], ({1: [[2] * 8] * 16, 2: [[3] * 8] * 16}, rewards), spans

    simulated = []
    real_simulate = sim_module.simulate

    def recording(cfg, cluster, work, **kw):
        prediction, tracer = real_simulate(cfg, cluster, work, **kw)
        simulated.append((work, prediction, tracer))
        return prediction, tracer

    monkeypatch.setattr(bench_simulate, "_real_run", fake_run)
    monkeypatch.setattr(sim_module, "simulate", recording)
    assert main(["bench", "simulate-check", "--steps", "2", "--seeds", "0,1", "--repeats", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    calibrating, simulated = simulated[:2], simulated[2:]  # first each seed's sync run on the profile, with its own stages and syncs
    assert [(work.stage_s, work.eff.ipc_setup_s, work.eff.train_in_run) for work, *_ in calibrating] == [(0.002, 0.001, 1.0), (0.003, 0.004, 1.0)]
    assert {work.stage_s for work, *_ in simulated[:6]} == {0.003} and {work.stage_s for work, *_ in simulated[6:]} == {0.002}  # the other seed's stages
    assert all(work.replay_rewards == rewards for work, *_ in simulated)
    assert [work.eff.ipc_setup_s for work, *_ in simulated[:2]] == [result["efficiency"]["ipc_setup_s"], 0.004]  # the profile's, then the runs'

    skipped = [step["skipped_rows"] for step in simulated[0][1].steps]
    assert skipped == [0.0, 64.0]  # the run's rewards replayed: step 2's eight flat groups do not train
    assert [o[:-2] for o in ran[:3]] == [["algorithm.max_staleness=1"], ["algorithm.max_staleness=0"], ["algorithm.max_staleness=1", "placement.rollout.colocate_with=train"]]
    assert [o[-2:] for o in ran] == [["seed=0", "algorithm.num_steps=2"]] * 3 + [["seed=1", "algorithm.num_steps=2"]] * 3
    runs = {(r["system"], r["seed"]): r for r in result["runs"]}
    assert runs[("async", 0)]["measured_samples_per_s"] == 2000.0 and runs[("sync", 0)]["measured_step_s"] == pytest.approx(128 / 1500)
    assert runs[("colocated", 1)]["measured_samples_per_s"] == 1200.0
    assert all(r["predicted_samples_per_s"] > 0 for r in runs.values())
    assert runs[("colocated", 0)]["predicted_samples_per_s"] < runs[("async", 0)]["predicted_samples_per_s"]  # one device, taking turns: no overlap
    assert runs[("async", 0)]["train_beside_rollout"] == pytest.approx(1 + (0.050 / 0.040 - 1) / 0.5)  # the other seed's runs: slower only while rollout worked
    assert (runs[("sync", 0)]["ipc_setup_s"], runs[("sync", 1)]["ipc_setup_s"]) == (0.004, 0.001)  # a weight sync as the other seed's sync run took it
    assert runs[("sync", 0)]["rollout_in_run"] == pytest.approx(2 * runs[("sync", 1)]["rollout_in_run"])  # seed 1's generate took twice seed 0's
    assert runs[("async", 0)]["train_in_run"] == runs[("sync", 0)]["train_in_run"] > 0
    assert runs[("async", 1)]["train_beside_rollout"] == pytest.approx(0.060 / 0.040)
    assert (runs[("async", 0)]["rollout_beside_train"], runs[("async", 1)]["rollout_beside_train"]) == pytest.approx((1.2, 1.5))
    *_, tracer = calibrating[1]  # its engines' time in the run over that in its simulation: seed 0's factors
    assert runs[("sync", 0)]["train_in_run"] == pytest.approx(0.040 / statistics.median(_durations(tracer, "train", "train")))
    assert runs[("sync", 0)]["rollout_in_run"] == pytest.approx(0.2 / sum(_durations(tracer, "rollout", "generate")))
    assert result["measured_ratio"] == pytest.approx(2000 / 1500)
    assert result["ratio_error"] == pytest.approx(result["predicted_ratio"] / result["measured_ratio"] - 1)
    for system in ("async", "sync", "colocated"):
        predicted = statistics.median(r["predicted_step_s"] for (s, _), r in runs.items() if s == system)
        assert result["step_errors"][system] == pytest.approx(result["measured_samples_per_s"][system] / result["predicted_samples_per_s"][system] - 1)
        assert predicted > 0
    within = abs(result["ratio_error"]) <= 0.1 and all(abs(e) <= 0.15 for e in result["step_errors"].values())
    assert result["met"] is within
    rows = bench_simulate.check_table(result)
    assert rows[-1][-1] == ("met" if within else "NOT met") and rows[-3][0] == "async / sync" and "profile" in rows[-2][0]


def test_work_beside_the_other_roles_on_one_host_slows_by_the_measured_factor():
    """A node both roles work on: async's overlapping work slows by the factors; sync, whose
    roles take turns, does not; on separate nodes nothing slows."""
    one_node = parse_cluster({"nodes": [{"name": "box", "device": "h100"}]})
    placed = ["placement.train.requires=[]", "placement.rollout.requires=[]", "placement.train.count=4", "placement.rollout.count=2", "placement.rollout.devices_each=2", "rollout.prompts_per_generate=4"]
    slow = Efficiency(train_beside_rollout=1.5, rollout_beside_train=1.2)

    def step_and_train(staleness: int, eff: Efficiency, cluster=one_node) -> tuple[float, float]:
        cfg = load_config(resolve_recipe("mixed_npu_gpu"), ["algorithm.num_steps=6", "rollout.max_new_tokens=2048", "model.max_positions=4096", *placed, f"algorithm.max_staleness={staleness}"])
        work = Workload(model=ModelShape.qwen2_5("1.5b"), lengths=LengthModel(mean_tokens=1000, prompt_sigma=0.0, group_sigma=0.0, max_new_tokens=2048), token_scale=16, eff=eff)
        prediction, tracer = simulate(cfg, cluster, work)
        return statistics.fmean(s["step_s"] for s in prediction.steps[2:]), max(_durations(tracer, "train", "train"))

    sync_plain, sync_slow = step_and_train(0, Efficiency()), step_and_train(0, slow)
    assert sync_slow == pytest.approx(sync_plain, rel=1e-9)  # taking turns, neither works beside the other
    async_plain, async_slow = step_and_train(1, Efficiency()), step_and_train(1, slow)
    assert async_slow[1] == pytest.approx(1.5 * async_plain[1], rel=1e-6)  # a training step that starts beside rollout's work
    assert async_slow[0] > async_plain[0] * 1.05
    two_nodes = parse_cluster({"nodes": [{"name": "t", "device": "h100", "devices_per_node": 4}, {"name": "r", "device": "h100", "devices_per_node": 4}]})
    assert step_and_train(1, slow, two_nodes) == pytest.approx(step_and_train(1, Efficiency(), two_nodes), rel=1e-9)


@pytest.mark.parametrize("claiming", [True, False])
def test_a_seated_rollout_engine_hands_the_devices_over_at_its_next_step(claiming):
    """A guest decoding one long row gives the devices up once the trainer asks for its turn
    (a real engine looks at `should_pause` after each decode step), not when the row ends."""
    import torch

    from tidal.flow.algorithms import PolicyLossConfig
    from tidal.flow.timeshare import Seat, SharedRolloutEngine, SharedTrainEngine
    from tidal.flow.trajectory import Trajectory, to_token_batch
    from tidal.flow.turns import Turns
    from tidal.flow.virtual_clock import VirtualClock
    from tidal.tools.sim.engines import SimRolloutEngine
    from tidal.tools.sim.simulate import _Claiming
    from tidal.tools.sim.trainer import SimTrainEngine

    clock, h100, model = VirtualClock(), device("h100"), ModelShape.qwen2_5("0.5b")
    engine = SimRolloutEngine(clock=clock, model=model, device=h100, token_scale=64)
    trainer = SimTrainEngine(clock=clock, model=model, device=h100, token_scale=64)
    rows = [Trajectory(prompt_ids=[1] * 4, tokens=[1] * 8, logprobs=[-1.0] * 8, versions=[0] * 8, finish_reason="stop")]
    batch, long_row = to_token_batch(rows, pad_id=0), [Trajectory(prompt_ids=[1] * 4, meta={"lengths": [64]})]  # 64 x 64 = 4,096 decode steps
    turns = Turns(clock=clock)

    def main():
        guest_seat = Seat(turns, "rollout-0", park=lambda: None, unpark=lambda: None, clock=clock)
        train_seat = Seat(turns, "train", park=lambda: None, unpark=lambda: None, clock=clock)
        guest = SharedRolloutEngine(engine, guest_seat)
        shared = SharedTrainEngine(trainer, train_seat)
        seated = _Claiming(shared, [engine], clock) if claiming else shared
        generating = clock.thread(lambda: guest.generate(long_row, max_new_tokens=64), name="guest")
        generating.start()
        clock.sleep(0.05)  # the row is decoding, its end seconds away
        asked = clock.now()
        train_s = seated.train_step(batch, torch.zeros(1), loss=PolicyLossConfig())["train_s"]
        waited = clock.now() - asked - train_s
        generating.join()
        for seat in (guest_seat, train_seat):
            seat.close()
        return waited, long_row[0].num_generated

    waited, generated = clock.run(main)
    step_s = costs.decode_step_s(model, h100, tp=1, batch=1, context_tokens=4 * 64, eff=costs.DEFAULT_EFFICIENCY)
    if claiming:
        assert waited < 2 * step_s and generated < 64  # paused mid-row, within a decode step
    else:
        assert generated == 64 and waited > 1000 * step_s  # without it: the row's whole end


def test_a_hybrid_plans_host_transfers_go_to_its_own_instances_only():
    """The host transport's sender pushes the weights to each of its receivers: those with
    devices of their own. The guests on the trainer's devices get theirs by ipc, and add
    nothing to that fan-out."""
    base = ["algorithm.num_steps=2", "rollout.max_new_tokens=256", "model.max_positions=512", "placement.train.requires=[h100]", "placement.train.count=8", "placement.rollout.devices_each=8"]
    cluster = parse_cluster({"nodes": [{"name": "npu", "device": "910b"}, {"name": "gpu", "device": "h100"}]})
    work = Workload(model=ModelShape.qwen2_5("7b"), lengths=LengthModel(mean_tokens=100, max_new_tokens=256), token_scale=16)
    recipe = resolve_recipe("mixed_npu_gpu")
    alone, alone_trace = simulate(load_config(recipe, [*base, "placement.rollout.requires=[910b]", "placement.rollout.count=1"]), cluster, work)
    hybrid, hybrid_trace = simulate(load_config(recipe, [*base, "placement.rollout.requires=[]", "placement.rollout.count=2", "placement.rollout.colocate_with=train"]), cluster, work)
    assert (alone.roles["transport"], hybrid.roles["transport"], hybrid.layout) == ("host", "host+ipc", "hybrid")
    one_receiver = costs.weight_sync_s(work.model, transport="host", src=device("h100"), dst=device("910b"), num_nodes_between=1, num_receivers=1)
    for trace in (alone_trace, hybrid_trace):
        assert _durations(trace, "train", "publish weights") == pytest.approx([one_receiver] * 2)


def test_the_train_step_costs_the_padding_the_recipes_engine_runs():
    assert train_shape(TrainConfig()) == costs.TrainShape(micro_batch_size=64)  # padding-free where the model can
    assert train_shape(TrainConfig(backend="megatron", micro_batch_size=8)) == costs.TrainShape(padded=True, micro_batch_size=8)  # always padded, rows sorted
    fsdp = train_shape(TrainConfig(backend="fsdp", padding_free=False))
    assert fsdp.padded and not fsdp.sorted_rows and not fsdp.cropped  # a rank's rows in order, as wide as the batch
    assert train_shape(TrainConfig(backend="deepspeed", padding_free=False, max_tokens_per_micro_batch=4096)).cropped  # a budget crops them
    # long-tailed lengths: padded micro-batches of rows in the batch's order cost far more than the real tokens
    runs = {
        padding_free: _run(staleness=0, sigma=1.0, steps=3, overrides=("train.backend=fsdp", "train.micro_batch_size=8", f"train.padding_free={padding_free}"))
        for padding_free in ("null", "false")
    }
    train_s = {k: statistics.median(_durations(tracer, "train", "train")) for k, (_, tracer) in runs.items()}
    assert train_s["false"] > 1.25 * train_s["null"]  # 1.42 when written: the rows padded to the batch's longest (2,048 tokens) against a mean near 900
    assert runs["false"][0].samples_per_s < runs["null"][0].samples_per_s


def test_a_recipe_that_recomputes_activations_trains_a_forward_pass_longer():
    assert train_shape(TrainConfig(), recompute=True).recompute and not train_shape(TrainConfig()).recompute
    # constant lengths: the same rows each step, so the steps differ only by the recomputed forward
    steps = {flag: _durations(_run(staleness=0, sigma=0.0, steps=2, overrides=(f"model.gradient_checkpointing={flag}",))[1], "train", "train") for flag in ("false", "true")}
    ratio = statistics.median(steps["true"]) / statistics.median(steps["false"])
    assert 1.25 < ratio <= 8 / 6  # 8 x params x tokens against 6; the gradient all-reduce is the same


def test_rewards_take_their_time_on_the_recipes_reward_workers():
    free, _ = _run(staleness=0, sigma=0.0, steps=2)
    for workers in (0, 4):  # 0: in the reward stage's thread, one sample after another
        costly, tracer = _run(staleness=0, sigma=0.0, steps=2, reward_s=0.5, overrides=(f"task.reward_workers={workers}",))
        spans = [e for e in tracer.spans("reward") if e["name"] == "reward"]
        assert spans and all(e["dur"] / 1e6 == pytest.approx(math.ceil(e["args"]["rows"] / max(workers, 1)) * 0.5) for e in spans)
        assert costly.step_s["mean"] > free.step_s["mean"] + 0.5  # the last batch's rewards hold up a synchronous step
    with pytest.raises(ValueError, match="reward_s"):
        Workload(model=ModelShape.qwen2_5("1.5b"), lengths=LengthModel(mean_tokens=10, max_new_tokens=20), reward_s=-1.0)


def test_the_loops_own_work_is_charged_once_a_reward_batch():
    free, _ = _run(staleness=0, sigma=0.0, steps=2)
    costly, tracer = _run(staleness=0, sigma=0.0, steps=2, reward_s=0.1, stage_s=0.5)
    spans = [e for e in tracer.spans("reward") if e["name"] == "reward"]
    assert spans and all(e["dur"] / 1e6 == pytest.approx(e["args"]["rows"] * 0.1 + 0.5) for e in spans)
    assert costly.step_s["mean"] > free.step_s["mean"] + 0.5  # the last batch's stage time holds up a synchronous step
    with pytest.raises(ValueError, match="stage_s"):
        Workload(model=ModelShape.qwen2_5("1.5b"), lengths=LengthModel(mean_tokens=10, max_new_tokens=20), stage_s=-1.0)


def test_a_runs_rewards_replayed_decide_which_groups_train(tmp_path):
    groups = 16  # mixed_npu_gpu: prompts_per_step
    flat, mixed = [[1.0] * 8] * groups, [[1.0, 0.0, 0.0, 0.0] * 2] * groups
    trace = tmp_path / "metrics.jsonl"
    trace.write_text("".join(json.dumps({"step": k, "lengths": [[512] * 8] * groups, "rewards": rewards}) + "\n" for k, rewards in ((1, mixed), (2, flat))))
    replayed, tracer = _run(staleness=0, sigma=0.0, steps=2, replay=replay(trace), replay_rewards=replay_rewards(trace))
    assert [step["skipped_rows"] for step in replayed.steps] == [0.0, 8.0 * groups]
    assert [step["reward"] for step in replayed.steps] == [0.25, 1.0]
    train = _durations(tracer, "train", "train")
    assert train[0] > 0 and train[1] == 0  # every group of step 2 is flat: nothing to pass over
    unrecorded, _ = _run(staleness=0, sigma=0.0, steps=2, replay=replay(trace))
    assert [step["skipped_rows"] for step in unrecorded.steps] == [0.0, 0.0] and [step["reward"] for step in unrecorded.steps] == [0.5, 0.5]


def test_a_share_of_flat_groups_leaves_their_rows_untrained():
    every, _ = _run(staleness=0, sigma=0.0, steps=4)
    half, _ = _run(staleness=0, sigma=0.0, steps=4, flat_groups=0.5)
    again, _ = _run(staleness=0, sigma=0.0, steps=4, flat_groups=0.5)
    _, tracer = _run(staleness=0, sigma=0.0, steps=2, flat_groups=1.0)
    rows = sum(step["samples"] for step in half.steps)
    skipped = sum(step["skipped_rows"] for step in half.steps)
    assert sum(step["skipped_rows"] for step in every.steps) == 0 and 0.3 < skipped / rows < 0.7
    assert [step["skipped_rows"] for step in again.steps] == [step["skipped_rows"] for step in half.steps]  # seeded
    assert half.total_s < every.total_s and _durations(tracer, "train", "train") == [0, 0]
    assert [step["response_len"] for step in half.steps] == [step["response_len"] for step in every.steps]  # the lengths are the same draws
    with pytest.raises(ValueError, match="flat_groups"):
        Workload(model=ModelShape.qwen2_5("1.5b"), lengths=LengthModel(mean_tokens=10, max_new_tokens=20), flat_groups=1.5)


@pytest.mark.parametrize("runtime", ["local", "ray"])
def test_transport_overlap_spares_the_trainer_the_weight_sync_under_ray_only(runtime):
    cluster = parse_cluster({"network": {"scale_out_gbps": 1}, "nodes": [{"name": "t", "device": "h100"}, {"name": "r", "device": "h100"}]})
    steps = {}
    for overlap in ("true", "false"):
        cfg = load_config(resolve_recipe("mixed_npu_gpu"), ["algorithm.num_steps=4", "rollout.max_new_tokens=2048", "model.max_positions=4096", *DISJOINT, "algorithm.max_staleness=1", f"runtime={runtime}", f"transport.overlap={overlap}", "transport.name=host"])  # over 1 Gb/s: a sync the trainer would notice
        work = Workload(model=ModelShape.qwen2_5("1.5b"), lengths=LengthModel(mean_tokens=1000, prompt_sigma=0.0, group_sigma=0.0, max_new_tokens=2048), token_scale=16)
        _, tracer = simulate(cfg, cluster, work)
        steps[overlap] = statistics.median(_durations(tracer, "train", "publish weights"))
    if runtime == "ray":  # the trainer goes on; the weights arrive a transfer later
        assert steps["true"] < steps["false"] / 10
    else:  # a local run publishes in the trainer's thread: transport.overlap is a Ray setting
        assert steps["true"] == steps["false"] > 0


def test_a_negative_reward_time_is_refused_naming_the_option(capsys):
    from tidal.tools.cli import main

    with pytest.raises(SystemExit):
        main(["simulate", "mixed_npu_gpu", "cluster=npu64_gpu32", "--reward-ms", "-1"])
    assert "--reward-ms: '-1' is not a number >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["simulate", "mixed_npu_gpu", "cluster=npu64_gpu32", "--stage-ms", "-2"])
    assert "--stage-ms: '-2' is not a number >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["simulate", "mixed_npu_gpu", "cluster=npu64_gpu32", "--flat-groups", "1.5"])
    assert "--flat-groups: '1.5' is not a share in [0, 1]" in capsys.readouterr().err
