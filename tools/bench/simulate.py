"""`tidal bench simulate`: how long `tidal simulate` takes at cluster scale.

The workload: `recipes/mixed_npu_gpu.yaml` on the 1,024-device spec
`recipes/clusters/npu512_gpu512.yaml`: 512 Ascend 910B train one Qwen2.5-7B data-parallel
group, 128 rollout engines of 4 H100 each generate, 512 prompts x 16 samples a step,
responses of 2,000 tokens on average (up to 8,192), one simulated token for 64 real ones.
The figure is real seconds per simulated step; the 200-step time is measured when
`--steps 200` is given and extrapolated (and labelled so) otherwise.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

TARGET_STEPS = 200
OVERRIDES = (
    "rollout.max_new_tokens=8192",
    "model.max_positions=16384",
    "placement.train.count=512",
    "placement.rollout.count=128",
    "placement.rollout.devices_each=4",
    "algorithm.prompts_per_step=512",
    "algorithm.group_size=16",
    "rollout.prompts_per_generate=4",
)


def run(*, num_steps: int, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    from tidal.tools.config import load_config  # noqa: PLC0415
    from tidal.tools.recipes import recipes_dir, resolve_recipe  # noqa: PLC0415
    from tidal.tools.sim.cluster import load_cluster  # noqa: PLC0415
    from tidal.tools.sim.costs import ModelShape  # noqa: PLC0415
    from tidal.tools.sim.lengths import LengthModel  # noqa: PLC0415
    from tidal.tools.sim.simulate import Workload, simulate  # noqa: PLC0415

    cluster = load_cluster(recipes_dir() / "clusters" / "npu512_gpu512.yaml")
    cfg = load_config(resolve_recipe("mixed_npu_gpu"), [*OVERRIDES, f"algorithm.num_steps={num_steps}"])
    work = Workload(model=ModelShape.qwen2_5("7b"), lengths=LengthModel(mean_tokens=2000, max_new_tokens=8192), token_scale=64)
    if progress is not None:
        progress(f"simulating {num_steps} steps on {cluster.name} ({cluster.num_devices} devices)")
    began = time.perf_counter()
    prediction, _ = simulate(cfg, cluster, work, tracer_events=1)
    wall = time.perf_counter() - began
    per_step = wall / num_steps
    return {
        "cluster": cluster.name,
        "devices": cluster.num_devices,
        "samples_per_step": cfg.algorithm.prompts_per_step * cfg.algorithm.group_size,
        "steps": num_steps,
        "wall_s": wall,
        "wall_s_per_step": per_step,
        "wall_s_200_steps": wall if num_steps == TARGET_STEPS else per_step * TARGET_STEPS,
        "extrapolated": num_steps != TARGET_STEPS,
        "simulated_s": prediction.total_s,
        "samples_per_s": prediction.samples_per_s,
    }


def table(result: dict[str, Any]) -> list[list[str]]:
    how = f"extrapolated from {result['steps']}" if result["extrapolated"] else "measured"
    return [
        ["cluster", "devices", "samples/step", "steps", "wall s", "wall s/step", "200 steps, wall s", "target"],
        [result["cluster"], str(result["devices"]), f"{result['samples_per_step']:,}", str(result["steps"]), f"{result['wall_s']:.1f}", f"{result['wall_s_per_step']:.2f}", f"{result['wall_s_200_steps']:.0f} ({how})", "< 60"],
    ]


# `tidal bench simulate-check`: the simulator's prediction of this machine against real runs.
CHECK_RECIPE = "quickstart_cpu"
CHECK_SYSTEMS = {"async": ["algorithm.max_staleness=1"], "sync": ["algorithm.max_staleness=0"], "colocated": ["algorithm.max_staleness=1", "placement.rollout.colocate_with=train"]}
"""bench e2e's `tidal-async` and `tidal-sync-1t` (the quickstart runs one torch thread a
stage), and async with rollout time-sharing the trainer's device (its turns, pauses and
parks; on the host a park moves nothing)."""
CHECK_TARGETS = {"ratio": 0.10, "step": 0.15}
"""The issue's bounds: the async / sync ratio within 10%, each step time within 15%."""


def check(*, num_steps: int = 150, seeds: Sequence[int] = (0, 1), repeats: int = 7, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the quickstart async, sync and colocated (`CHECK_SYSTEMS`; `tidal run`'s path) for each seed, profile this
    machine at the runs' shapes (decode batches, contexts, and training rows of the
    quickstart's prompt and the runs' median longest response, which a step's rows are
    padded to), simulate each run on a two-device spec of the profiled device (one core a
    role, as the runs' two threads of one torch thread each) with the run's own response
    lengths replayed, and compare.

    The step time is the run's: 128 samples over its samples/s (RL wall time, evaluations
    and the warm start excluded), and the prediction's mean step over the same steps.

    What a run costs beside its engines' profiled work is taken from the runs of another
    seed, as a user calibrates on real runs of one node before simulating a cluster: the
    run's rewards (which groups train: the trainer skips flat ones) and its own; the
    loop's reward and advantage stages per batch (`stage_s`); a weight sync (`ipc_setup_s`:
    the publish and weight-update spans); and how much longer the engines' work takes in a
    run than the profile says, nothing beside them (`train_in_run`, `rollout_in_run`: a sync
    run's train steps and generate time over those of its simulation), as the loop's threads
    share the process and its interpreter lock with them.

    How much each role's work slows beside the other's (`train_beside_rollout`,
    `rollout_beside_train`) is taken from the runs: an async run's median train step and
    generate time per token over a sync run's, of another seed (`_beside`), as a user
    calibrates on real runs of one node before simulating a cluster. The profile's own
    two-thread measurement leaves out the rest of a run's process and varies from profile
    to profile; the prediction with it is reported beside (`profile_*`). An async run's
    generate calls also pause for new weights and prefill again what they had: that
    share of its time per token is counted as slowdown here and simulated again.
    """
    from tidal.engines.models import model_source  # noqa: PLC0415
    from tidal.tools.config import load_config  # noqa: PLC0415
    from tidal.tools.prompts import prompt_source  # noqa: PLC0415
    from tidal.tools.recipes import resolve_recipe  # noqa: PLC0415
    from tidal.tools.sim.calibrate import fit, profiled_device, profiled_model  # noqa: PLC0415
    from tidal.tools.sim.cluster import PROFILED, parse_cluster  # noqa: PLC0415
    from tidal.tools.sim.lengths import LengthModel  # noqa: PLC0415
    from tidal.tools.sim.profile import measure  # noqa: PLC0415
    from tidal.tools.sim.simulate import Workload, simulate  # noqa: PLC0415

    say = progress or (lambda _line: None)
    recipe = resolve_recipe(CHECK_RECIPE)
    cfg = load_config(recipe, [])
    batch = cfg.algorithm.prompts_per_step * cfg.algorithm.group_size
    decode_batch = cfg.rollout.prompts_per_generate * cfg.algorithm.group_size
    policy = model_source(cfg.model).build(seed=cfg.seed)
    prompts = list(itertools.islice(iter(prompt_source(cfg, policy.tokenizer).train()), 64))
    prompt_tokens = max(1, round(statistics.mean(len(p["prompt_ids"]) for p in prompts)))
    context = prompt_tokens + cfg.rollout.max_new_tokens
    runs = []
    spans: dict[tuple[int, str], dict[str, float]] = {}  # (seed, system) -> the run's median train step, generate seconds per token
    for seed in seeds:
        for system, overrides in CHECK_SYSTEMS.items():
            say(f"running the quickstart {system}, seed {seed}, {num_steps} steps")
            measured, trace, spans[(seed, system)] = _real_run(recipe, [*overrides, f"seed={seed}", f"algorithm.num_steps={num_steps}"])
            runs.append((seed, system, overrides, measured, trace))
    # A training step's rows are padded to its longest response: profile rows of that shape.
    padded = max(1, round(statistics.median(max(n for group in groups for n in group) for *_, (lengths, _) in runs for groups in lengths.values())))
    say(f"profiling this machine at the runs' shapes: decode batches up to {decode_batch}, contexts up to {context}, training steps of up to {batch} rows of {prompt_tokens} + {padded} tokens")
    budget = cfg.rollout.max_new_tokens  # whole generate calls of the runs' budget, and of half of it
    profile = measure(
        cfg,
        batches=(decode_batch // 8, decode_batch),
        contexts=(prompt_tokens, context),
        train_rows=(batch // 4, batch),
        train_context=prompt_tokens + padded,
        train_prompt=prompt_tokens,
        generate_tokens=sorted({max(1, budget // 2), budget}),
        repeats=repeats,
    )
    calibration = fit(profile, source="this machine's profile")
    cluster = parse_cluster({"name": "this-machine", "nodes": [{"name": "box", "device": PROFILED, "devices_per_node": 2}]}, devices={PROFILED: profiled_device(profile)})
    model, rows = profiled_model(profile), []

    def workload(seed: int, lengths: Any, rewards: Any, stage_s: float, eff: Any) -> Workload:
        return Workload(model=model, lengths=LengthModel(mean_tokens=1.0, max_new_tokens=cfg.rollout.max_new_tokens), prompt_tokens=prompt_tokens, token_scale=1, seed=seed, replay=lengths, replay_rewards=rewards, stage_s=stage_s, eff=eff)

    # How much longer the engines' work took in each seed's sync run than its simulation on the
    # profile says (nothing beside them there, the run's own weight syncs and stage time)
    for seed, system, overrides, _, (lengths, rewards) in runs:
        if system == "sync":
            run_cfg = load_config(recipe, [*overrides, f"seed={seed}", f"algorithm.num_steps={num_steps}"])
            own = spans[(seed, system)]
            _, tracer = simulate(run_cfg, cluster, workload(seed, lengths, rewards, own["stage_s"], dataclasses.replace(calibration.eff, ipc_setup_s=own["sync_s"])))
            own.update(_in_run(own, tracer))
    for seed, system, overrides, measured, (lengths, rewards) in runs:
        run_cfg = load_config(recipe, [*overrides, f"seed={seed}", f"algorithm.num_steps={num_steps}"])
        stage_s = _from_others(spans, seed, system, ("stage_s",))["stage_s"]  # the reward and advantage spans a batch
        work = workload(seed, lengths, rewards, stage_s, calibration.eff)
        # a weight sync as the sync runs' publish and weight-update spans took it; their engines' time in a run
        in_run = _from_others(spans, seed, "sync", ("sync_s", "train_in_run", "rollout_in_run"))
        beside = {**_beside(spans, seed), "ipc_setup_s": in_run.pop("sync_s"), **in_run}
        row = {"system": system, "seed": seed, "measured_samples_per_s": measured, "measured_step_s": batch / measured, **beside, "stage_s": stage_s}
        row["profile_samples_per_s"] = simulate(run_cfg, cluster, work, tracer_events=1)[0].samples_per_s
        row["predicted_samples_per_s"] = simulate(run_cfg, cluster, dataclasses.replace(work, eff=dataclasses.replace(calibration.eff, **beside)), tracer_events=1)[0].samples_per_s
        row["predicted_step_s"] = batch / row["predicted_samples_per_s"]
        rows.append(row)
    out: dict[str, Any] = {"steps": num_steps, "seeds": list(seeds), "prompt_tokens": prompt_tokens, "train_row_tokens": prompt_tokens + padded, "efficiency": dataclasses.asdict(calibration.eff), "runs": rows, "targets": CHECK_TARGETS}
    for key in ("measured", "predicted", "profile"):
        per = {s: statistics.median(r[f"{key}_samples_per_s"] for r in rows if r["system"] == s) for s in CHECK_SYSTEMS}
        out[f"{key}_ratio"] = per["async"] / per["sync"]
        out[f"{key}_samples_per_s"] = per
    out["ratio_error"] = out["predicted_ratio"] / out["measured_ratio"] - 1
    out["step_errors"] = {s: out["measured_samples_per_s"][s] / out["predicted_samples_per_s"][s] - 1 for s in CHECK_SYSTEMS}  # predicted step / measured step - 1
    out["met"] = abs(out["ratio_error"]) <= CHECK_TARGETS["ratio"] and all(abs(e) <= CHECK_TARGETS["step"] for e in out["step_errors"].values())
    return out


def _beside(spans: Mapping[tuple[int, str], Mapping[str, float]], seed: int) -> dict[str, float]:
    """How much slower each role's work goes while the other role works, from an async run
    against a sync one (where nothing runs beside it): the engine's median train step
    (`train_beside_rollout`) and generate time per generated token (`rollout_beside_train`).
    The async run's ratio is an average over its spans, of which only a share had the other
    role at work beside them (`train_overlap`, `generate_overlap`), while the simulation
    slows a span only while the other role works: the factor is 1 + (ratio - 1) / share.
    From the runs of the other seeds (`_other_seeds`); each at least 1."""
    out = {}
    for factor, key, share in (("train_beside_rollout", "train_s", "train_overlap"), ("rollout_beside_train", "generate_s_per_token", "generate_overlap")):
        out[factor] = max(1.0, statistics.median(1 + (spans[(s, "async")][key] / spans[(s, "sync")][key] - 1) / max(spans[(s, "async")][share], MIN_OVERLAP) for s in _other_seeds(spans, seed)))
    return out


MIN_OVERLAP = 0.1
"""The least share of a role's time counted as beside the other's (`_beside`): a smaller one
would turn a few percent of noise into a large factor."""


def _from_others(spans: Mapping[tuple[int, str], Mapping[str, float]], seed: int, system: str, keys: Sequence[str]) -> dict[str, float]:
    """The medians of `keys` over `system`'s runs of the other seeds (`_other_seeds`)."""
    return {key: statistics.median(spans[(s, system)][key] for s in _other_seeds(spans, seed)) for key in keys}


def _other_seeds(spans: Mapping[tuple[int, str], Any], seed: int) -> list[int]:
    """The seeds of the runs but `seed` (a run is not calibrated on itself), or `seed` alone without another."""
    return sorted({s for s, _ in spans if s != seed}) or [seed]


def _in_run(run: Mapping[str, float], tracer: Any) -> dict[str, float]:
    """`Efficiency.train_in_run` and `rollout_in_run` of a sync run: its median train step and
    its generate time over those of its simulation (`tracer`, the same rows on the profile)."""
    train = [e["dur"] / 1e6 for e in tracer.spans("train") if e["name"] == "train"]
    generate = sum(e["dur"] / 1e6 for e in tracer.spans("rollout") if e["name"] == "generate")
    if not train or not generate:
        raise RuntimeError("the simulation of a sync run has no train step or no generation")
    return {"train_in_run": run["train_s"] / statistics.median(train), "rollout_in_run": run["generate_s"] / generate}


def _real_run(recipe: Path, overrides: list[str]) -> tuple[float, tuple[dict[int, list[list[int]]], dict[int, list[list[float]]]], dict[str, float]]:
    """One `tidal run` of `recipe` in a temporary run directory: its RL samples/s, its
    response lengths and rewards by step, and from its timeline its median train step
    (`train_s`), its generate calls' seconds per trained response token
    (`generate_s_per_token`) and its reward and advantage stages' seconds per batch the
    reward stage took (`stage_s`)."""
    from tidal.tools.run import prepare_run  # noqa: PLC0415
    from tidal.tools.sim.lengths import read_trace  # noqa: PLC0415
    from tidal.tools.train import train  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="tidal-bench-simcheck-") as tmp:
        cfg, run_dir = prepare_run(recipe, [*overrides, f"run_dir={Path(tmp) / 'run'}", "tensorboard=false", "checkpoint_every=1000000"])
        summary = train(cfg, run_dir, progress=False)
        trace = json.loads((run_dir / "timeline.json").read_text())
        events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]  # flow.trace.Tracer writes a dict
        seconds: dict[str, list[float]] = collections.defaultdict(list)  # span name -> each span's seconds
        for e in events:
            seconds[e.get("name", "")].append(e["dur"] / 1e6)
        generate_s = sum(seconds["generate"])
        lengths, rewards = read_trace(run_dir / "metrics.jsonl")
        tokens = sum(n for groups in lengths.values() for group in groups for n in group)
        if not seconds["train"] or not generate_s or not tokens or not seconds["reward"]:
            raise RuntimeError(f"the run's timeline ({run_dir / 'timeline.json'}) has no train step, no generation or no reward")
        measured = {
            "train_s": statistics.median(seconds["train"]),
            "generate_s_per_token": generate_s / tokens,
            "generate_s": generate_s,
            "stage_s": (sum(seconds["reward"]) + sum(seconds["advantage"])) / len(seconds["reward"]),
            "sync_s": sum(statistics.median(seconds[name]) for name in ("publish weights", "weight update") if seconds[name]),
            "train_overlap": _overlap(events, "train", "generate"),
            "generate_overlap": _overlap(events, "generate", "train"),
        }
        return float(summary["samples_per_s"]), (lengths, rewards), measured


def _overlap(events: list[dict[str, Any]], name: str, beside: str) -> float:
    """The share of the `name` spans' time during which a `beside` span ran too (0 without any)."""
    others = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == beside)
    merged: list[list[float]] = []
    for start, end in others:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    starts = [m[0] for m in merged]
    total = both = 0.0
    for e in (e for e in events if e.get("name") == name):
        start, end = e["ts"], e["ts"] + e["dur"]
        total += end - start
        k = max(0, bisect.bisect_right(starts, start) - 1)
        while k < len(merged) and merged[k][0] < end:
            both += max(0.0, min(end, merged[k][1]) - max(start, merged[k][0]))
            k += 1
    return both / total if total else 0.0


def check_table(result: dict[str, Any]) -> list[list[str]]:
    rows = [["system", "seed", "measured samples/s", "predicted", "step ms measured", "predicted", "error"]]
    for r in result["runs"]:
        rows.append([r["system"], str(r["seed"]), f"{r['measured_samples_per_s']:,.0f}", f"{r['predicted_samples_per_s']:,.0f}", f"{1000 * r['measured_step_s']:.1f}", f"{1000 * r['predicted_step_s']:.1f}", f"{r['predicted_step_s'] / r['measured_step_s'] - 1:+.1%}"])
    steps = ", ".join(f"{s} {e:+.1%}" for s, e in result["step_errors"].items())
    rows.append(["async / sync", "median", f"{result['measured_ratio']:.2f}x", f"{result['predicted_ratio']:.2f}x", "", "", f"{result['ratio_error']:+.1%}"])
    rows.append(["  with the profile's contention", "", "", f"{result['profile_ratio']:.2f}x", "", "", f"{result['profile_ratio'] / result['measured_ratio'] - 1:+.1%}"])
    rows.append(["target", "", "ratio within 10%", "", "steps within 15%", steps, "met" if result["met"] else "NOT met"])
    return rows
