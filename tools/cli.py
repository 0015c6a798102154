"""The `tidal` command line."""

from __future__ import annotations

import argparse
import errno
import json
import os
import shlex
import sys
import textwrap
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tidal.tools.cli_help import BENCH_HELP, CONFIG_HELP, DESCRIPTION, DOCTOR_HELP, EPILOG, EXPORT_HELP, PLAN_HELP, RUN_HELP
from tidal.tools.cli_types import count, int_list
from tidal.tools.sim.command import add_parser as add_simulate_parser
from tidal.tools.sim.command import add_profile_parser, cmd_profile, cmd_simulate
from tidal.tools.tables import print_table

if TYPE_CHECKING:  # the CLI starts without loading the schema's imports
    from tidal.tools.config import RecipeConfig

RUN_FILES = ("metrics.jsonl", "tensorboard/", "timeline.json", "progress.png", "checkpoints/")
"""What a finished `tidal run` names in its last line, of what its run directory holds."""


def _sizes(text: str) -> list[int]:
    """An argparse type: comma-separated sizes in MB, each >= 1."""
    values = int_list(text)
    if min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every size must be >= 1 MB")
    return values


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="tidal", description=DESCRIPTION, epilog=EPILOG, formatter_class=fmt)
    parser.add_argument("--version", action="store_true", help="print tidal's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser("run", help="run a recipe", description=RUN_HELP, formatter_class=fmt)
    run.add_argument("recipe", help="recipe YAML file, or the name of a shipped recipe")
    run.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. seed=1")
    run.add_argument(
        "--check",
        action="store_true",
        help="validate the recipe (with resume=, open its checkpoint's files), select the platform and write the run directory's config, then stop",
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bar (for logs and CI)")

    doctor = sub.add_parser("doctor", help="show platform, versions and runnable recipes", description=DOCTOR_HELP, formatter_class=fmt)
    doctor.add_argument("--json", action="store_true", help="print the report as JSON instead of tables")
    doctor.add_argument("--clean", action="store_true", help="delete the files killed tidal processes left in /dev/shm (never those of running ones)")
    doctor.add_argument("--cluster", action="store_true", help="check every node of the Ray cluster at RAY_ADDRESS instead of this machine")
    doctor.add_argument("--recipe", default=None, help="with --cluster: also check that this recipe's roles can be placed on the cluster")
    doctor.add_argument("overrides", nargs="*", metavar="key=value", help="with --recipe: overrides, e.g. cluster.fake=true")

    config = sub.add_parser("config", help="print a resolved recipe or every config key", description=CONFIG_HELP, formatter_class=fmt)
    config.add_argument("recipe", nargs="?", help="recipe YAML file or shipped recipe name (default: schema defaults)")
    config.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. seed=1")
    config.add_argument("--keys", action="store_true", help="list every key with its type, default and documentation")

    plan = sub.add_parser("plan", help="show where each role would run", description=PLAN_HELP, formatter_class=fmt)
    plan.add_argument("recipe", help="recipe YAML file or shipped recipe name")
    plan.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. placement.rollout.colocate_with=train")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")

    bench = sub.add_parser("bench", help="run a benchmark (store, e2e, weights, simulate, simulate-check)", description=BENCH_HELP, formatter_class=fmt)
    bench.add_argument("name", choices=["store", "e2e", "weights", "simulate", "simulate-check"], help="which benchmark")
    bench.add_argument("overrides", nargs="*", metavar="key=value", help="e2e: recipe overrides applied to every system (and TRL), e.g. device=cuda")
    bench.add_argument("--systems", default=None, help="comma-separated systems to measure (default: all)")
    bench.add_argument("--trials", type=count, default=200, help="hand-off latency trials per system (default: 200)")
    bench.add_argument("--repeats", type=count, default=None, help="runs per system; store reports the median (and the spread), weights the best (default: 3); simulate-check: timed repeats of each profile point (default: 7)")
    bench.add_argument("--transport", choices=["tcp", "ipc"], default="tcp", help="store: what tidal and raw ZeroMQ run over - loopback TCP or Unix-domain sockets (same machine) (default: tcp)")
    bench.add_argument("--put-window", type=count, default=4, help="store: puts tidal-tuned keeps in flight (tidal waits for each reply) (default: 4)")
    bench.add_argument("--steps", type=count, default=None, help="e2e: RL steps per run (default: 200); simulate: steps simulated (default: 10); simulate-check: steps of each real run (default: 150)")
    bench.add_argument("--workload", choices=["quickstart", "longtail"], default="quickstart", help="e2e: what every system trains on - the quickstart, or a checkpoint with long-tailed response lengths (default: quickstart)")
    bench.add_argument("--seeds", type=int_list, default="0,1", help="e2e, simulate-check: comma-separated seeds (default: 0,1)")
    bench.add_argument("--sizes", type=_sizes, default="4,64,256,1024", help="weights: comma-separated model sizes in MB (default: 4,64,256,1024)")
    bench.add_argument("--json", action="store_true", help="print raw results as JSON")

    store = sub.add_parser("store", help="run a store server on its own (tidal store serve --help)", description="tidal store serve: a store server process on its own; `tidal store serve --help` lists its options.")
    store.add_argument("action", choices=["serve"], help="serve: run a store server until Ctrl-C or SIGTERM")
    store.add_argument("options", nargs=argparse.REMAINDER, help="see `tidal store serve --help`")

    add_simulate_parser(sub, fmt)
    add_profile_parser(sub, fmt)

    export = sub.add_parser("export", help="write a run's checkpoint as a Hugging Face model directory", description=EXPORT_HELP, formatter_class=fmt)
    export.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (what `tidal run` printed last)")
    export.add_argument("out_dir", metavar="OUT_DIR", help="where the model directory goes")
    export.add_argument("--step", type=int, default=None, metavar="N", help="export checkpoints/step-N (default: the one checkpoints/latest names)")
    export.add_argument("--force", action="store_true", help="replace OUT_DIR when it is not empty")
    export.add_argument(
        "--trust-remote-code", action=argparse.BooleanOptionalAction, default=None,
        help="run the checkpoint's own model code (config.json auto_map) to check the export loads (default: what the run's model.trust_remote_code was)",
    )  # fmt: skip
    return parser


def _systems(given: str | None, known: tuple[str, ...]) -> tuple[str, ...] | None:
    """The systems `--systems` names (all of `known` without it); None, said why, when one is unknown."""
    if given is None:
        return known
    systems = tuple(s.strip() for s in given.split(",") if s.strip())
    unknown = sorted(set(systems) - set(known))
    if unknown or not systems:
        why = f"unknown system(s) {unknown}" if unknown else f"--systems {given!r} names no system"
        print(f"tidal bench: error: {why}; systems: {', '.join(known)}", file=sys.stderr)
        return None
    return systems


def _cmd_bench(args: argparse.Namespace) -> int:
    from tidal.tools.bench import store as bench_store  # noqa: PLC0415

    if args.name == "e2e":
        from tidal.tools.bench import e2e as bench_e2e  # noqa: PLC0415

        systems = _systems(args.systems, (*bench_e2e.SYSTEMS, *bench_e2e.TRL_SYSTEMS))
        if systems is None:
            return 2
        _check_device_variable()  # before minutes of runs, not at the first one
        results = bench_e2e.run(seeds=args.seeds, num_steps=args.steps or 200, overrides=args.overrides, systems=systems, workload=args.workload, progress=lambda m: print(f"tidal bench: {m}", file=sys.stderr))
        if args.json:
            print(json.dumps(results, indent=2))
        else:
            with_trl = any(name in bench_e2e.TRL_SYSTEMS for name in systems)
            title = "quickstart task, same warm start and samples" if args.workload == "quickstart" else "longtail workload: gsm8k_qwen on a checkpoint with long-tailed response lengths"
            print_table(f"tidal bench e2e ({title})", bench_e2e.table(results, with_trl=with_trl))
        return 0

    if args.overrides:
        print(f"tidal bench: error: {args.name} takes no recipe overrides (got {' '.join(args.overrides)}); only e2e does", file=sys.stderr)
        return 2
    if args.name == "simulate-check":
        from tidal.tools.bench import simulate as bench_simulate  # noqa: PLC0415

        result = bench_simulate.check(num_steps=args.steps or 150, seeds=args.seeds, repeats=args.repeats or 7, progress=lambda m: print(f"tidal bench: {m}", file=sys.stderr))
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print_table("tidal bench simulate-check (tidal simulate's prediction of this machine against real quickstart runs)", bench_simulate.check_table(result))
        return 0
    if args.name == "simulate":
        from tidal.tools.bench import simulate as bench_simulate  # noqa: PLC0415

        result = bench_simulate.run(num_steps=args.steps or 10, progress=lambda m: print(f"tidal bench: {m}", file=sys.stderr))
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print_table("tidal bench simulate (real seconds to simulate a 1,024-device cluster)", bench_simulate.table(result))
        return 0
    if args.name == "weights":
        from tidal.tools.bench import weights as bench_weights  # noqa: PLC0415

        systems = _systems(args.systems, bench_weights.SYSTEMS)
        if systems is None:
            return 2
        measured = bench_weights.run(sizes_mb=args.sizes, systems=systems, repeats=args.repeats or 3, progress=lambda m: print(f"tidal bench: {m}", file=sys.stderr))
        if args.json:
            print(json.dumps(measured, indent=2))
        else:
            print_table("tidal bench weights (GB/s, trainer process -> rollout process)", bench_weights.table(measured))
        return 0

    systems = _systems(args.systems, bench_store.SYSTEMS)
    if systems is None:
        return 2
    store_results = bench_store.run(systems=systems, num_trials=args.trials, repeats=args.repeats or 3, transport=args.transport, put_window=args.put_window, progress=lambda m: print(f"tidal bench: {m}", file=sys.stderr))
    if args.json:
        print(json.dumps(store_results, indent=2))
        return 0
    print_table("tidal bench store (higher rows/s and MB/s, lower latency are better)", bench_store.table(store_results))
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from tidal.tools.recipes import resolve_recipe  # noqa: PLC0415
    from tidal.tools.run import prepare_run, resume_changes  # noqa: PLC0415

    _check_device_variable()
    cfg, run_dir = prepare_run(resolve_recipe(args.recipe), args.overrides)
    print(f"tidal: resolved config written to {run_dir / 'config.yaml'}")
    if changes := resume_changes(cfg):
        print(f"tidal: resuming {cfg.resume} with these keys changed (the others as it ran):\n  " + "\n  ".join(changes))
    if args.check:
        return 0
    args.made_run_dir = run_dir  # a run that stops early: `main` says how to continue it
    if cfg.runtime.value == "ray":
        import ray  # noqa: PLC0415

        from tidal.tools.ray_run import run_on_ray  # noqa: PLC0415

        try:
            summary = run_on_ray(cfg, run_dir, progress=not args.no_progress)
        finally:
            ray.shutdown()  # now, not at exit: the actors' last log lines come before what this prints
    else:
        from tidal.tools.train import train  # noqa: PLC0415 - imports torch and transformers

        summary = train(cfg, run_dir, progress=not args.no_progress)
    if summary.get("stopped_early"):
        from tidal.tools.stopping import RunStopped  # noqa: PLC0415

        raise RunStopped(summary["stopped_early"])  # its checkpoint is written: `main` prints how to continue
    exact = " (strict)" if strict_reward(cfg) else ""
    totals = f"({summary['steps']} steps, {summary['rl_seconds']:.0f}s, {summary['samples_per_s']:.1f} samples/s)"
    if summary["accuracy_before"] is None:  # prompts from files without data.eval_files
        print(f"tidal: trained {totals}; no held-out accuracy (no data.eval_files)")
    else:
        print(f"tidal: held-out accuracy{exact} {summary['accuracy_before']:.1%} before RL -> {summary['accuracy_after']:.1%} after {totals}")
    written = [name for name in RUN_FILES if (run_dir / name.rstrip("/")).exists()]  # a finished run resumed writes no step
    print(f"tidal: run directory {run_dir} ({', '.join(written)})")
    return 0


def _print_resume_hint(args: argparse.Namespace) -> None:
    """After a run that stopped early (interrupted, or failed): the command that continues it
    from its last checkpoint, when it wrote one - the same recipe and overrides, `resume=` it."""
    run_dir: Path | None = getattr(args, "made_run_dir", None)
    pointer = None if run_dir is None else run_dir / "checkpoints" / "latest"
    if pointer is None or not pointer.is_file():
        return
    kept = [o for o in args.overrides if o.split("=", 1)[0] not in ("run_dir", "resume")]
    command = shlex.join(["tidal", "run", args.recipe, *kept, f"resume={run_dir}"])
    print(f"tidal run: stopped early; its last checkpoint is {pointer.read_text().strip()}, continue with:\n  {command}", file=sys.stderr)


def _check_device_variable() -> None:
    """A TIDAL_DEVICE that names no platform is a usage error (exit 2), as a bad `device` key is.

    Raises:
        ConfigError: naming the variable and the valid values.
    """
    from tidal.hal import ENV_VAR, check_spec  # noqa: PLC0415 - imports torch
    from tidal.tools.config import ConfigError  # noqa: PLC0415

    if os.environ.get(ENV_VAR):
        try:
            check_spec(os.environ[ENV_VAR])
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _cmd_doctor(args: argparse.Namespace) -> int:
    from tidal.hal.versions import explain_torch_import_failure  # noqa: PLC0415 - imports no torch

    try:
        import torch  # noqa: F401, PLC0415
    except Exception as e:  # noqa: BLE001 - report any failure of the torch import itself
        print(f"tidal doctor: {explain_torch_import_failure(e)}", file=sys.stderr)
        return 1
    from tidal.tools.config import ConfigError  # noqa: PLC0415

    if args.cluster:
        from tidal.tools.cluster import doctor_cluster  # noqa: PLC0415 - loads the config schema

        return doctor_cluster(args.recipe, args.overrides, clean=args.clean, as_json_output=args.json)
    if args.recipe or args.overrides:
        raise ConfigError("--recipe and key=value overrides go with --cluster (tidal doctor --cluster --recipe RECIPE key=value ...)")
    from tidal.tools.doctor import render, report  # noqa: PLC0415

    _check_device_variable()
    data, code = report(clean=args.clean)
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        render(data)
    return code


def _cmd_plan(args: argparse.Namespace) -> int:
    from tidal.tools.config import ConfigError, load_config  # noqa: PLC0415
    from tidal.tools.plan import cluster_rows, make_plan  # noqa: PLC0415
    from tidal.tools.recipes import resolve_recipe  # noqa: PLC0415
    from tidal.tools.run import (  # noqa: PLC0415
        check_runnable,
        run_refusal,
    )

    _check_device_variable()
    cfg = load_config(resolve_recipe(args.recipe), args.overrides)
    ray_nodes = None
    if cfg.runtime.value == "ray" and not cfg.cluster.nodes:
        from tidal.flow.ray.placement import connected_ray_nodes  # noqa: PLC0415

        ray_nodes = connected_ray_nodes
    try:
        plan, source = make_plan(cfg, ray_nodes=ray_nodes)
    except ConfigError:
        check_runnable(cfg)  # what `tidal run` says first, before it plans
        raise
    refusal = run_refusal(cfg, plan)
    if args.json:
        print(json.dumps({"cluster_from": source, **plan.to_dict(), "run_refuses": refusal}, indent=2))
    else:
        print_table(f"cluster (from {source})", cluster_rows(plan.resources))
        print_table(f"plan: {plan.layout}", plan.table())
        if any(r.ray_node_id for r in plan.resources):
            print("tidal run pins each instance with devices of its own to the Ray node named here")
    if refusal is None:
        return 0
    sys.stdout.flush()  # the plan, then why it would not run
    print(f"tidal plan: error: tidal run would refuse this: {refusal}", file=sys.stderr)
    return 2


def strict_reward(cfg: RecipeConfig) -> bool:
    """Whether the recipe's reward is a built-in verifier: strict (the answer alone or its
    math-verify equivalent, then an end token), so its held-out accuracy is labelled so."""
    from tidal.engines.rewards import MODULE_REWARDS, REWARDS  # noqa: PLC0415
    from tidal.tools.rl import reward_spec  # noqa: PLC0415

    return reward_spec(cfg) in {*REWARDS, *MODULE_REWARDS}


def _cmd_export(args: argparse.Namespace) -> int:
    from tidal.tools.export import export  # noqa: PLC0415 - imports torch and transformers

    checkpoint = export(Path(args.run_dir), Path(args.out_dir), step=args.step, force=args.force, trust_remote_code=args.trust_remote_code)
    files = sorted(p.name for p in Path(args.out_dir).iterdir())
    print(f"tidal: exported {checkpoint.name} of {args.run_dir} to {args.out_dir} ({', '.join(files)})")
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    from tidal.tools.config import RecipeConfig, iter_keys, load_config, to_yaml  # noqa: PLC0415
    from tidal.tools.recipes import resolve_recipe  # noqa: PLC0415

    if args.keys:
        for k in iter_keys(RecipeConfig):
            print(f"{k.key}  ({k.type}, default {k.default!r})")
            print(textwrap.indent(textwrap.fill(k.doc, 84), "    "))
        return 0
    if args.recipe and "=" in args.recipe and not Path(args.recipe).is_file():  # `tidal config seed=1`: the schema defaults, overridden
        args.recipe, args.overrides = None, [args.recipe, *args.overrides]
    path = resolve_recipe(args.recipe) if args.recipe else None
    print(to_yaml(load_config(path, args.overrides)), end="")
    return 0


def _cmd_store(args: argparse.Namespace) -> int:
    from tidal.flow.store import serve  # noqa: PLC0415

    return serve.main(args.options, prog=f"tidal store {args.action}")


COMMANDS = {"run": _cmd_run, "doctor": _cmd_doctor, "config": _cmd_config, "plan": _cmd_plan, "bench": _cmd_bench, "export": _cmd_export, "store": _cmd_store, "simulate": cmd_simulate, "profile": cmd_profile}


STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS})
"""A write refused by the disk (full, over quota, past a file-size limit, read-only): said
in one line naming the file, not as a traceback."""

SIGPIPE_EXIT = 128 + 13
"""The exit code when stdout's reader went away (`tidal config --keys | head`), as a
process killed by SIGPIPE reports it in a shell."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `tidal` command `argv` (default: the process's) and return its exit code."""
    try:
        code = _dispatch(argv)
        sys.stdout.flush()  # now, not at exit: a reader that went away is answered below
    except BrokenPipeError:
        return _reader_gone()
    return code


def _reader_gone() -> int:
    """stdout's reader closed the pipe: stop quietly, as SIGPIPE would. Python ignores the
    signal, so the write raised instead; stdout now points at /dev/null, or the interpreter's
    last flush would print "Exception ignored ... BrokenPipeError" on the way out."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # a stdout with no file descriptor (captured): nothing to flush at exit
        pass
    return SIGPIPE_EXIT


def _unrecognized(extra: list[str], *, takes_overrides: bool) -> str:
    """The usage error for arguments argparse did not take; `--seed=3` where an override
    `seed=3` was meant says so."""
    message = f"unrecognized arguments: {' '.join(extra)}"
    meant = [x.lstrip("-") for x in extra if x.startswith("--") and "=" in x]
    if takes_overrides and meant:
        message += f"; overrides are key=value without dashes: {' '.join(meant)}"
    return message


def _one_line(command: str, error: Exception) -> str | None:
    """What `tidal COMMAND` prints for an error that needs no traceback, or None: tidal's own
    runtime errors (PlatformError and friends: actionable), non-finite gradients (the train
    engines' FloatingPointError) and a write the disk refused. Under `runtime: ray` the
    error raised inside an actor counts, not Ray's wrapper with the remote traceback, and a
    dead actor is named in one line (`flow.ray.faults.remote_cause`)."""
    from tidal.flow.ray.faults import remote_cause  # noqa: PLC0415 - imports no Ray

    cause = remote_cause(error)
    if (isinstance(cause, RuntimeError) and type(cause).__module__.startswith("tidal.")) or isinstance(cause, FloatingPointError):
        return "\n".join([f"tidal {command}: error: {cause}", *getattr(cause, "__notes__", ())])
    if isinstance(cause, OSError) and cause.errno in STORAGE_ERRNOS and cause.filename:
        remedy = "the filesystem takes no writes" if cause.errno == errno.EROFS else "free space there"
        return f"tidal {command}: error: cannot write {cause.filename}: {cause.strerror}; {remedy}, or choose another run_dir or output_dir"
    return None


def _dispatch(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    takes_overrides = args.command in ("run", "config", "plan", "bench", "simulate", "profile")
    if extra and takes_overrides and all("=" in x and not x.startswith("-") for x in extra):
        args.overrides += extra  # key=value overrides that came after an option such as --check
    elif extra:
        parser.error(_unrecognized(extra, takes_overrides=takes_overrides))
    if args.version:
        from tidal import __version__  # noqa: PLC0415

        print(f"tidal {__version__}")
        return 0
    if not args.command:
        parser.print_help()
        return 2
    from tidal.tools.config import ConfigError  # noqa: PLC0415

    try:
        return COMMANDS[args.command](args)
    except ConfigError as e:
        print(f"tidal {args.command}: error: {e}", file=sys.stderr)
        _remove_unused_run_dir(args)  # a mistake to mend: the same run_dir= takes the mended command
        code = 2
    except KeyboardInterrupt as e:  # Ctrl-C, or a run that stopped early on SIGINT / SIGTERM (RunStopped)
        reason = getattr(e, "reason", None)
        print(f"tidal {args.command}: interrupted" + (f" ({reason}), after saving a checkpoint" if reason else ""), file=sys.stderr)
        code = getattr(e, "exit_code", 130)
    except BrokenPipeError:  # stdout's reader went away: `main` ends quietly (a run that wrote a checkpoint says how to continue, on stderr)
        _print_resume_hint(args)
        raise
    except Exception as e:  # noqa: BLE001 - printed here, so the resume command below comes last
        message = _one_line(args.command, e)
        if message is None:
            traceback.print_exc()
        else:
            print(message, file=sys.stderr)
        code = 1
    _print_resume_hint(args)
    return code


PREPARED_FILES = frozenset({"config.yaml", "platform.json"})
"""What `prepare_run` writes in a new run directory before the run starts."""


def _remove_unused_run_dir(args: argparse.Namespace) -> None:
    """After a run stopped by a mistake in its input before it wrote anything of its own (a
    data file it could not read: a `ConfigError`): its run directory holds only what
    `prepare_run` wrote, and goes, so that the same `run_dir=` works once the mistake is
    mended. A run that fails otherwise keeps its config.yaml, to reproduce it."""
    run_dir: Path | None = getattr(args, "made_run_dir", None)
    if run_dir is None or not run_dir.is_dir() or not {p.name for p in run_dir.iterdir()} <= PREPARED_FILES:
        return
    for name in PREPARED_FILES:
        (run_dir / name).unlink(missing_ok=True)
    run_dir.rmdir()
    print(f"tidal {args.command}: removed {run_dir}: the run wrote nothing there yet", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
