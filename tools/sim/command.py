"""`tidal simulate RECIPE cluster=SPEC`: its arguments, and the prediction it prints."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from tidal.tools.cli_types import count, non_negative, positive_ints, share, whole

SIMULATE_HELP = """\
Predict a recipe's throughput on a cluster you do not have: the recipe's own workflow,
store, admission control and placement scheduler run on a virtual clock, with rollout
and training engines whose durations come from roofline cost models of the cluster's
devices (tools/sim/costs.py; hardware figures and their sources in tools/sim/hardware.py).

  tidal simulate mixed_npu_gpu cluster=recipes/clusters/npu64_gpu32.yaml
  tidal simulate mixed_npu_gpu cluster=npu64_gpu32 --model 7b --mean-tokens 2000 \\
      placement.train.count=32 algorithm.max_staleness=2

cluster= names a cluster spec file (or a shipped one in recipes/clusters/); the recipe's
placement is scheduled on it as `tidal plan` would. The prediction: samples/s, trained
tokens/s, step times, each role's busy share, the trainer's wait for data and rollout's
waits for weights and prompts, paused generations and the version-gap histogram; the
simulated timeline goes to --trace (Chrome trace JSON: open in Perfetto).

Uncalibrated unless --profile gives a `tidal profile` of a real device: the efficiency
factors are then fitted to it (and a prediction that runs past the profiled batches,
contexts or step sizes says so); otherwise they are the assumptions in docs/simulate.md.
Every layout is simulated; where rollout time-shares the trainer's devices (colocated,
hybrid, multiplexed), on the real turns, with parks costed over PCIe.
"""


SEARCH_STEPS = 20
"""Steps each candidate of `--search` is simulated for, unless --steps says otherwise."""


def _clusters() -> Path:
    """Shipped cluster specs: recipes/clusters/ (tidal/recipes/clusters in a wheel)."""
    from tidal.tools.recipes import recipes_dir  # noqa: PLC0415

    return recipes_dir() / "clusters"


def _shipped() -> str:
    return ", ".join(sorted(p.stem for p in _clusters().glob("*.yaml")))


def add_parser(sub: Any, fmt: type[argparse.HelpFormatter]) -> None:
    """The `simulate` subcommand and its options."""
    p = sub.add_parser("simulate", help="predict a recipe's throughput on a cluster spec (virtual clock)", description=SIMULATE_HELP, formatter_class=fmt)
    p.add_argument("recipe", help="recipe YAML file or shipped recipe name")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides; cluster=SPEC names the cluster spec")
    p.add_argument("--model", default="7b", help="Qwen2.5 size whose shape is simulated: 0.5b, 1.5b, 3b, 7b, 14b or 32b, or `profiled`: the model --profile timed (default: 7b)")
    p.add_argument("--mean-tokens", type=float, default=1024.0, help="mean response length in tokens (default: 1024)")
    p.add_argument("--prompt-sigma", type=float, default=0.5, help="lognormal spread of the mean length across prompts (default: 0.5)")
    p.add_argument("--group-sigma", type=float, default=0.3, help="lognormal spread within a prompt's group (default: 0.3)")
    p.add_argument("--drift", type=float, default=0.0, help="growth of the mean length per step, e.g. 0.01 (default: 0)")
    p.add_argument("--lengths", default=None, metavar="PATH", help="replay response lengths recorded by a real run (its metrics.jsonl) instead of sampling them, and its rewards where it has them")
    p.add_argument("--prompt-tokens", type=int, default=256, help="tokens of every prompt (default: 256)")
    p.add_argument("--reward-ms", type=non_negative, default=0.0, help="milliseconds one sample's reward takes; a batch's samples are scored side by side on task.reward_workers (default: 0, free)")
    p.add_argument("--flat-groups", type=share, default=0.0, help="share of prompts whose samples all get one reward, so the trainer skips their rows (a run's skipped_rows over its rows; default: 0); a --lengths trace's own rewards come first")
    p.add_argument("--stage-ms", type=non_negative, default=0.0, help="milliseconds of the loop's own work (the reward and advantage stages' Python) for each batch the reward stage takes (default: 0, free)")
    p.add_argument("--token-scale", type=int, default=16, help="real tokens one simulated token stands for (default: 16)")
    p.add_argument("--profile", default=None, metavar="PATH", help="fit the efficiency factors from a `tidal profile` of a real device (default: the assumed ones, uncalibrated)")
    p.add_argument("--trace", default=None, help="where the simulated timeline goes (default: simulate-<recipe>.trace.json)")
    p.add_argument("--steps", type=count, default=None, help="steps to simulate (default: the recipe's algorithm.num_steps; 20 with --search)")
    p.add_argument("--search", action="store_true", help="simulate candidate placements (layout, train : rollout split, devices per rollout instance, staleness) and rank them")
    p.add_argument("--layouts", default=None, metavar="LIST", help="with --search: the layouts to try, comma-separated, of disaggregated, colocated, hybrid and multiplexed (default: all four)")
    p.add_argument("--top", type=whole, default=10, metavar="N", help="with --search: print the N fastest placements (default: 10; 0: every one; --json gives every one)")
    p.add_argument("--json", action="store_true", help="print the prediction (or the ranking) as JSON")


def _cluster_path(given: str) -> Path:
    from tidal.tools.config import ConfigError  # noqa: PLC0415

    for path in (Path(given), _clusters() / given, _clusters() / f"{given}.yaml"):
        if path.is_file():
            return path
    raise ConfigError(f"cluster={given!r}: no such cluster spec file (shipped: {_shipped()})")


def cmd_simulate(args: argparse.Namespace) -> int:
    from tidal.tools.config import ConfigError, load_config  # noqa: PLC0415
    from tidal.tools.recipes import resolve_recipe  # noqa: PLC0415
    from tidal.tools.sim.calibrate import extrapolations, fit, profiled_device, profiled_model  # noqa: PLC0415
    from tidal.tools.sim.cluster import PROFILED, load_cluster  # noqa: PLC0415
    from tidal.tools.sim.costs import ModelShape  # noqa: PLC0415
    from tidal.tools.sim.lengths import LengthModel, read_trace  # noqa: PLC0415
    from tidal.tools.sim.profile import load as load_profile  # noqa: PLC0415
    from tidal.tools.sim.simulate import Workload, simulate  # noqa: PLC0415

    clusters = [o.split("=", 1)[1] for o in args.overrides if o.startswith("cluster=")]
    if len(clusters) != 1:
        raise ConfigError("tidal simulate needs one cluster=SPEC (a cluster spec file, or one in recipes/clusters/: " + _shipped() + ")")
    recipe = resolve_recipe(args.recipe)
    overrides = [o for o in args.overrides if not o.startswith("cluster=")]
    steps = args.steps if args.steps is not None else (SEARCH_STEPS if args.search else None)
    if steps is not None:
        overrides.insert(0, f"algorithm.num_steps={steps}")  # a num_steps override given too wins
    cfg = load_config(recipe, overrides)
    try:
        profile = load_profile(args.profile) if args.profile else None
        calibration = fit(profile, source=args.profile) if profile is not None else None
        cluster = load_cluster(_cluster_path(clusters[0]), devices={PROFILED: profiled_device(profile)} if profile is not None else None)
        if args.model == PROFILED and profile is None:
            raise ConfigError(f"--model {PROFILED} simulates the model a `tidal profile` timed: give the profile with --profile")
        trace = read_trace(args.lengths) if args.lengths else None
        work = Workload(
            model=profiled_model(profile) if profile is not None and args.model == PROFILED else ModelShape.qwen2_5(args.model),
            lengths=LengthModel(mean_tokens=args.mean_tokens, prompt_sigma=args.prompt_sigma, group_sigma=args.group_sigma, drift=args.drift, max_new_tokens=cfg.rollout.max_new_tokens),
            prompt_tokens=args.prompt_tokens,
            token_scale=args.token_scale,
            seed=cfg.seed,
            replay=trace[0] if trace else None,
            replay_rewards=trace[1] if trace else None,
            reward_s=args.reward_ms / 1000,
            stage_s=args.stage_ms / 1000,
            flat_groups=args.flat_groups,
            **({"eff": calibration.eff} if calibration is not None else {}),
        )
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.layouts is not None and not args.search:
        raise ConfigError("--layouts chooses what --search tries: give --search too")
    if args.search:
        layouts = None if args.layouts is None else tuple(name.strip() for name in args.layouts.split(",") if name.strip())
        return _search(recipe, overrides, cluster, work, as_json=args.json, calibration=calibration, layouts=layouts, top=args.top)
    prediction, tracer = simulate(cfg, cluster, work)
    trace_path = Path(args.trace or f"simulate-{recipe.stem}.trace.json")
    tracer.save(trace_path)
    beyond = [] if calibration is None else extrapolations(calibration, **_ranges(prediction))
    if args.json:
        calibrated = {"calibrated": calibration.source if calibration else False, "efficiency": dataclasses.asdict(work.eff), "extrapolations": beyond}
        print(json.dumps({**prediction.summary(), "trace": str(trace_path), **calibrated}, indent=2))
        return 0
    print(_banner(calibration, work.eff))
    for line in beyond:
        print(f"WARNING: extrapolated past the profile: {line}")
    _print(prediction, cluster_name=cluster.name, trace=trace_path)
    return 0


def _ranges(prediction: Any) -> dict[str, int]:
    r = prediction.engine_ranges
    return {"decode_batch": r["decode_batch"], "context": r["context"], "train_tokens": r["train_tokens_per_device"]}


def _overheads(eff: Any) -> str:
    """The fixed costs a profile fitted, for the banner (none: nothing)."""
    parts = [f"{name} {1000 * seconds:.2f} ms" for name, seconds in (("decode step", eff.decode_step_overhead_s), ("prefill", eff.prefill_overhead_s), ("train step", eff.train_step_overhead_s), ("generate call", eff.generate_call_overhead_s)) if seconds]
    return "; fixed cost a " + ", a ".join(parts) if parts else ""


def _banner(calibration: Any, eff: Any) -> str:
    factors = f"decode bandwidth {eff.decode_bandwidth:.2f}, prefill compute {eff.prefill_compute:.2f}, train MFU {eff.train_mfu:.2f}" + _overheads(eff)
    if calibration is None:
        return f"UNCALIBRATED: efficiency factors are assumptions ({factors}; docs/simulate.md), not fitted to a profile"
    return f"calibrated from {calibration.source}: {factors}"


def _search(recipe: Path, overrides: list[str], cluster: Any, work: Any, *, as_json: bool, calibration: Any, layouts: tuple[str, ...] | None, top: int) -> int:
    import sys  # noqa: PLC0415

    from tidal.tools.config import ConfigError  # noqa: PLC0415
    from tidal.tools.sim.search import LAYOUTS, search, table  # noqa: PLC0415

    try:
        ranked = search(recipe, overrides, cluster, work, layouts=LAYOUTS if layouts is None else layouts, progress=lambda line: print(line, file=sys.stderr))
    except ConfigError:
        raise
    except ValueError as e:  # the layouts (a candidate's own errors are its row's)
        raise ConfigError(f"--layouts {','.join(layouts or ())}: {e}") from None
    if as_json:
        rows = [{"placement": r.candidate.label, "overrides": list(r.candidate.overrides), **({"prediction": r.prediction.summary()} if r.prediction else {"cannot_run": r.why_not})} for r in ranked]
        print(json.dumps({"cluster": cluster.name, "calibrated": calibration.source if calibration else False, "ranking": rows}, indent=2))
        return 0
    print(_banner(calibration, work.eff))
    from tidal.tools.tables import print_table  # noqa: PLC0415

    shown = ranked[:top] if top else ranked
    print_table(f"placements on {cluster.name}, fastest first" + (f": the {len(shown)} fastest of {len(ranked)}" if len(shown) < len(ranked) else ""), table(shown))
    if len(shown) < len(ranked):
        print(f"{len(ranked) - len(shown)} more placement(s): --top 0 prints every one, --json gives each with its whole prediction")
    return 0


def _print(p: Any, *, cluster_name: str, trace: Path) -> None:
    roles = p.roles
    print(f"cluster {cluster_name}: {p.layout}; train {roles['train']['devices']} x {roles['train']['kind']}, rollout {roles['rollout']['instances']} x {roles['rollout']['devices_each']} {roles['rollout']['kind']}; weights over {roles['transport']}")
    print(f"{len(p.steps)} steps in {p.total_s:,.1f} simulated s ({p.wall_s:.1f} s to simulate)")
    print(f"  samples/s        {p.samples_per_s:,.2f}")
    print(f"  trained tokens/s {p.tokens_per_s:,.0f}")
    print("  step s           " + "  ".join(f"{k} {v:,.2f}" for k, v in p.step_s.items()))
    print("  busy             " + "  ".join(f"{k} {v:.0%}" for k, v in p.utilisation.items()))
    print("  idle             " + "  ".join(f"{k.replace('_', ' ')} {v:.0%}" for k, v in p.idle.items()))
    print(f"  paused generations {p.paused_generations}" + (f" (prefilling their tokens again took {p.reprefill_share:.1%} of the run)" if p.paused_generations else ""))
    if p.layout != "disaggregated":
        print(f"  hand-offs        {p.handoffs} (the shared devices changing hands, over every trainer instance)" + (f"; {p.handed_off} paused groups handed back by borrowed instances" if p.layout == "multiplexed" else ""))
    total = sum(p.version_gaps.values()) or 1
    print("  version gap      " + "  ".join(f"{gap}: {n / total:.0%}" for gap, n in p.version_gaps.items()))
    print(f"trace: {trace}")


PROFILE_HELP = """\
Measure this machine's device for the simulator's calibration: the recipe's policy model
on the platform tidal picks (TIDAL_DEVICE, the recipe's `device`, or detection), timed at
decode steps over batch and context, prefills, whole generate calls of the recipe's
rollout engine, training steps, weight export and load, host <-> device copies, and the
device's own achievable matmul FLOP/s and copy bandwidth.
The profile (JSON) goes to --out; `tidal simulate ... --profile PATH` fits its efficiency
factors from it.

  tidal profile quickstart_cpu --out cpu.profile.json
  tidal profile gsm8k_cuda model.path=/models/Qwen2.5-7B --batches 1,8,32,128 --contexts 512,2048
"""


def add_profile_parser(sub: Any, fmt: type[argparse.HelpFormatter]) -> None:
    """The `profile` subcommand and its options."""
    p = sub.add_parser("profile", help="measure this device for the simulator's calibration", description=PROFILE_HELP, formatter_class=fmt)
    p.add_argument("recipe", help="recipe YAML file or shipped recipe name (its model is what is timed)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides, e.g. model.path=...")
    p.add_argument("--out", default=None, help="where the profile goes (default: profile-<recipe>.json)")
    p.add_argument("--batches", type=positive_ints, default="1,4,16", help="decode and prefill batch sizes (default: 1,4,16)")
    p.add_argument("--contexts", type=positive_ints, default="32,128", help="contexts in tokens a sequence (default: 32,128)")
    p.add_argument("--train-rows", type=positive_ints, default="4,16", help="rows of a training step (default: 4,16)")
    p.add_argument("--train-context", type=count, default=None, help="tokens of each training row (default: the longest of --contexts that fits)")
    p.add_argument("--train-prompt", type=count, default=None, help="prompt tokens of each training row, the rest response: a response token costs a run more (default: half)")
    p.add_argument("--generate-tokens", type=positive_ints, default="4,16", help="new tokens of the whole generate calls timed, at the smallest and largest batch (default: 4,16)")
    p.add_argument("--repeats", type=count, default=3, help="timed repeats of each point; the median counts (default: 3)")


def cmd_profile(args: argparse.Namespace) -> int:
    from tidal.tools.config import load_config  # noqa: PLC0415
    from tidal.tools.recipes import resolve_recipe  # noqa: PLC0415
    from tidal.tools.sim.calibrate import fit  # noqa: PLC0415
    from tidal.tools.sim.profile import measure, save  # noqa: PLC0415

    recipe = resolve_recipe(args.recipe)
    cfg = load_config(recipe, args.overrides)
    import sys  # noqa: PLC0415

    profile = measure(
        cfg,
        batches=tuple(args.batches),
        contexts=tuple(args.contexts),
        train_rows=tuple(args.train_rows),
        train_context=args.train_context,
        train_prompt=args.train_prompt,
        generate_tokens=tuple(args.generate_tokens),
        repeats=args.repeats,
        progress=lambda line: print(f"tidal profile: {line}", file=sys.stderr),
    )
    out = Path(args.out or f"profile-{recipe.stem}.json")
    save(profile, out)
    eff = fit(profile, source=str(out)).eff
    peak = profile["peak"]
    print(f"profiled {profile['platform']['kind']} with {profile['model']['name']} ({profile['model']['num_params']:,} parameters): peak {peak['flops'] / 1e9:,.1f} GFLOP/s, {peak['bytes_per_s'] / 1e9:,.1f} GB/s")
    print(f"fitted: decode bandwidth {eff.decode_bandwidth:.3f}, prefill compute {eff.prefill_compute:.3f}, train MFU {eff.train_mfu:.3f}" + _overheads(eff))
    print(f"profile: {out}")
    return 0
