"""`tidal bench e2e`: async vs sync GRPO vs TRL's `GRPOTrainer` on the quickstart.

Every system trains the quickstart's tiny model on its arithmetic task from the same
warm start (the supervised phase is deterministic for a seed), with the same batch size,
group size, token budget and number of samples, on this machine, in this process. For
each seed it reports RL samples/s, tokens/s, wall time and held-out accuracy after RL;
the table shows means over seeds and the ratios against sync and against TRL.

Held-out accuracy is the recipe's verifier on greedy answers: for the quickstart's
arithmetic the strict rule (the answer alone, then the end token). Stability: each run's
mean response length over its first and last tenth of RL steps; a run whose length grew
by more than `DRIFT_RATIO` drifted (a policy that stops ending its answers grows them to
the token budget), and the table counts such runs. `--systems` picks some systems, e.g.
`tidal-async,tidal-sync` over many seeds for the stability figures alone.

Systems: `tidal-async` (`max_staleness: 1`), `tidal-sync` (`max_staleness: 0`), both
in one process (`runtime: local`), and `tidal-async-ray` (`max_staleness: 1` with
`runtime: ray`: trainer and rollout as two actors, one torch thread each; Ray's start
and the actors' are outside the RL wall time). `trl`: TRL 1.16 `GRPOTrainer` with
transformers generation (no vLLM), on-policy, on the same prompts in the same order,
the same reward function and the same greedy held-out evaluation (`bench/trl.py` says
how the recipe maps onto `GRPOConfig`); its wall time is `trainer.train()` from the end of
its setup (optimizer, dataloader, accelerate's `prepare`: tidal builds its engines before
its clock too). TRL comes with the `[bench]` extra; without it the `trl` row says how to
install it.

torch threads: `tidal-async` runs its rollout and train stages at once, as two threads
of one process, with the recipe's `threads` (1 in the quickstart: one core each);
`tidal-async-ray` gives each actor one thread. `tidal-sync` and `trl` run one stage at a
time, so each runs with every thread torch would use by default (`ALL_CORES`) and, as
`tidal-sync-1t` / `trl-1t`, with one (set explicitly for each run since all systems
share this process); `tidal-sync-split` / `trl-split` give their rollout (TRL: its
`generate`) one thread and their training all of them (`rollout.threads`,
`train.threads`: decoding small batches loses to a second thread's overhead where a
train step gains from it). Which is fastest varies with the machine (on one 2-vCPU VM
two threads made sync a third slower on one day and did nothing the day before), so
the "x sync" and "x TRL" baselines are the fastest variant of each, measured in the
same run.

Workloads (`--workload`): `quickstart` (the default, all of the above) and `longtail`:
the `gsm8k_qwen` recipe on a small local Qwen2 checkpoint whose sampled responses have
long-tailed lengths (`tidal.tools.bench.fixture.build_longtail_workload` says how; built
once into ~/.cache/tidal and reused), with `LONGTAIL_OVERRIDES`: most responses end early
and a few run to the token budget, the case where a sync step waits on its stragglers.
TRL's systems run it too: `GRPOTrainer` on the same checkpoint directory, the same prompts
in the same order as tidal's token ids (the chat template applied as tidal applies it),
the recipe's math reward and the same overrides (`bench/trl.py` says how).
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from tidal.tools.metrics import length_drift

TRL_INSTALL = "pip install -c constraints.txt -e '.[bench]'"

ALL_CORES = torch.get_num_threads()
"""torch's default intra-op threads in this process, read before any run changes them."""
THREAD_VARIANTS = {"": ALL_CORES, **({"-1t": 1} if ALL_CORES > 1 else {})}
"""Name suffix -> torch threads, for the systems that run one stage at a time."""
SYNC_SYSTEMS = {
    **{f"tidal-sync{suffix}": ["algorithm.max_staleness=0", f"threads={n}"] for suffix, n in THREAD_VARIANTS.items()},
    **({"tidal-sync-split": ["algorithm.max_staleness=0", "rollout.threads=1", f"train.threads={ALL_CORES}"]} if ALL_CORES > 1 else {}),
}
SYSTEMS = {
    "tidal-async": ["algorithm.max_staleness=1"],
    **SYNC_SYSTEMS,
    "tidal-async-ray": ["algorithm.max_staleness=1", "runtime=ray", "threads=1"],
}
TRL_SYSTEMS = {
    **{f"trl{suffix}": [f"threads={n}"] for suffix, n in THREAD_VARIANTS.items()},
    **({"trl-split": ["rollout.threads=1", f"train.threads={ALL_CORES}"]} if ALL_CORES > 1 else {}),
}
"""TRL's runs: its generation and training take `rollout.threads` / `train.threads` as tidal's
stages do, so TRL gets every thread setting the sync baseline gets."""
BASELINES = {"sync": list(SYNC_SYSTEMS), "TRL": list(TRL_SYSTEMS)}
"""Each ratio's baseline: the fastest of these systems in the run."""
LONGTAIL_OVERRIDES = [
    "rollout.max_new_tokens=256", "algorithm.prompts_per_step=8", "algorithm.group_size=4",
    "train.micro_batch_size=8", "train.precision=fp32", "model.gradient_checkpointing=false", "threads=1",
]  # fmt: skip
"""The `longtail` workload's recipe overrides (before the systems' and the user's): a token
budget of a few hundred, small batches for a CPU, one torch thread per stage as the
quickstart has."""
DRIFT_RATIO = 1.5
"""A run drifted when its mean response length over the last tenth of its steps is more
than this times that over the first tenth."""


def drifted(run: dict[str, Any]) -> bool | None:
    """Whether a run's response length drifted (`DRIFT_RATIO`); None when it was not measured."""
    if "response_len_start" not in run:
        return None
    return run["response_len_end"] > DRIFT_RATIO * run["response_len_start"]


WORKLOADS = ("quickstart", "longtail")
"""`--workload` choices; `workload_args` maps each to its recipe and overrides."""


def workload_args(workload: str) -> tuple[str, list[str]]:
    """A workload's recipe name and the overrides that set it up (building its files first).

    Raises:
        ValueError: `workload` is not one of `WORKLOADS`.
    """
    if workload == "quickstart":
        return "quickstart_cpu", []
    if workload == "longtail":
        from tidal.tools.bench.fixture import longtail_workload  # noqa: PLC0415

        files = longtail_workload()
        return "gsm8k_qwen", [f"model.path={files['model']}", f"data.train_files=[{files['train']}]", *LONGTAIL_OVERRIDES]
    raise ValueError(f"unknown e2e workload {workload!r}; workloads: {', '.join(WORKLOADS)}")


def run_tidal(system_overrides: Sequence[str], *, seed: int, num_steps: int, overrides: Sequence[str] = (), recipe: str = "quickstart_cpu", workload: Sequence[str] = ()) -> dict[str, Any]:
    """One run of `recipe` with the `workload`'s overrides, then a system's, then `overrides`; returns its summary."""
    from tidal.tools.recipes import resolve_recipe  # noqa: PLC0415
    from tidal.tools.run import prepare_run  # noqa: PLC0415
    from tidal.tools.train import train  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="tidal-bench-e2e-") as tmp:
        args = [*workload, *system_overrides, f"seed={seed}", f"algorithm.num_steps={num_steps}", f"checkpoint_every={num_steps + 1}", f"run_dir={Path(tmp) / 'run'}", "tensorboard=false", *overrides]  # TRL's run logs nowhere either
        cfg, run_dir = prepare_run(resolve_recipe(recipe), args)
        if cfg.runtime.value == "ray":
            import ray  # noqa: PLC0415

            from tidal.tools.ray_run import run_on_ray  # noqa: PLC0415

            try:
                summary = run_on_ray(cfg, run_dir, progress=False)
            finally:
                ray.shutdown()
        else:
            summary = train(cfg, run_dir, progress=False)
        steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        return {**summary, **length_drift([m["response_len"] for m in steps if "response_len" in m])}


def run(
    *,
    seeds: Sequence[int] = (0, 1),
    num_steps: int = 200,
    overrides: Sequence[str] = (),
    systems: Sequence[str] | None = None,
    workload: str = "quickstart",
    progress: Callable[[str], None] = print,
) -> dict[str, list[dict[str, Any]]]:
    """Every system (or those named in `systems`) for every seed on `workload`; TRL's only
    when TRL is installed (else its rows say how to install it).

    One round per seed runs every system once, in the order of `SYSTEMS` then TRL's on
    even rounds and in reverse on odd ones. This machine's speed drifts over the minutes
    a bench takes; rounds spread the drift over every system instead of charging it to
    the systems that run last, and alternating cancels a steady drift over two rounds.
    """
    from tidal.flow.placement import PlacementError  # noqa: PLC0415
    from tidal.tools.bench import trl as bench_trl  # noqa: PLC0415

    if workload not in WORKLOADS:
        raise ValueError(f"unknown e2e workload {workload!r}; workloads: {', '.join(WORKLOADS)}")

    def run_one(system: str, seed: int) -> dict[str, Any]:
        if system in SYSTEMS:
            return run_tidal(SYSTEMS[system], seed=seed, num_steps=num_steps, overrides=overrides, recipe=recipe, workload=workload_overrides)
        # the precedence tidal's systems get in `run_tidal`: the system's, the workload's, the user's
        return bench_trl.run_trl(seed=seed, num_steps=num_steps, overrides=[*workload_overrides, *TRL_SYSTEMS[system], *overrides], recipe=recipe)

    unknown = [name for name in systems or () if name not in SYSTEMS and name not in TRL_SYSTEMS]
    if unknown:
        raise ValueError(f"unknown e2e system(s) {unknown}; systems: {', '.join([*SYSTEMS, *TRL_SYSTEMS])}")
    chosen = list(SYSTEMS) if systems is None else [name for name in SYSTEMS if name in systems]
    wants_trl = [name for name in TRL_SYSTEMS if systems is None or name in systems]
    results: dict[str, list[dict[str, Any]]] = {}
    if wants_trl and bench_trl.available():
        chosen += wants_trl
    elif wants_trl:
        progress(f"trl: skipped, TRL is not installed ({TRL_INSTALL})")
    systems = chosen
    recipe, workload_overrides = workload_args(workload)
    failed: set[str] = set()
    for round_, seed in enumerate(seeds):
        for system in systems if round_ % 2 == 0 else systems[::-1]:
            if system in failed:
                continue
            progress(f"{system}: seed {seed}, {num_steps} steps")
            try:
                results.setdefault(system, []).append(run_one(system, seed))
            except Exception as e:  # noqa: BLE001 - one system that cannot run never loses the others' numbers
                why = f"its roles do not fit this machine: {e}" if isinstance(e, PlacementError) else f"failed at seed {seed}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                progress(f"{system}: skipped, {why}")
                failed.add(system)
                if not results.get(system):  # runs of earlier seeds stay in the table
                    results[system] = [{"skipped": why}]
    return results


def baseline(results: dict[str, list[dict[str, Any]]], name: str) -> str | None:
    """The system the `name` ratio ("sync" or "TRL") is taken against: its fastest measured variant."""
    measured = [s for s in BASELINES[name] if results.get(s) and "skipped" not in results[s][0]]
    return max(measured, key=lambda s: statistics.mean(r["samples_per_s"] for r in results[s]), default=None)


def table(results: dict[str, list[dict[str, Any]]], *, with_trl: bool = True) -> list[list[str]]:
    """The bench's rows, header first. `with_trl`: a row for TRL says why it was not measured
    (off when `--systems` named none of TRL's)."""
    def mean(system: str, key: str) -> float:
        return statistics.mean(r[key] for r in results[system])

    def spread(system: str, key: str) -> str:
        values = [r[key] for r in results[system] if r.get(key) is not None]
        if not values:  # a workload without held-out prompts
            return "-"
        return f"{statistics.mean(values):.1%} (+-{statistics.pstdev(values):.1%})"

    def ratio(system: str, base: str | None) -> str:
        return f"{mean(system, 'samples_per_s') / mean(base, 'samples_per_s'):.2f}" if base is not None else "-"

    def held_out(system: str, key: str) -> str:
        values = [r[key] for r in results[system] if r.get(key) is not None]
        return f"{statistics.mean(values):.1%}" if values else "-"

    def lengths(system: str) -> str:
        runs = [r for r in results[system] if drifted(r) is not None]
        if not runs:
            return "-"
        return f"{statistics.mean(r['response_len_start'] for r in runs):.2f} -> {statistics.mean(r['response_len_end'] for r in runs):.2f}"

    def drifts(system: str) -> str:
        measured = [d for d in map(drifted, results[system]) if d is not None]
        return f"{sum(measured)} of {len(measured)}" if measured else "-"

    sync, trl = baseline(results, "sync"), baseline(results, "TRL")
    rows = [[
        "system", "samples/s", f"x sync ({sync or '-'})", f"x TRL ({trl or '-'})", "tokens/s", "RL wall s", "held-out before",
        "held-out after (mean +- sd over seeds)", "response length, first -> last tenth", f"runs drifted (length x{DRIFT_RATIO}+)",
    ]]
    skipped = {system: runs[0]["skipped"] for system, runs in results.items() if runs and "skipped" in runs[0]}
    results = {system: runs for system, runs in results.items() if system not in skipped}
    for system in results:
        rows.append([
            system,
            f"{mean(system, 'samples_per_s'):.1f}",
            ratio(system, sync),
            ratio(system, trl),
            f"{mean(system, 'tokens_per_s'):.1f}",
            f"{mean(system, 'rl_seconds'):.1f}",
            held_out(system, "accuracy_before"),
            spread(system, "accuracy_after"),
            lengths(system),
            drifts(system),
        ])
    blank = ["-"] * (len(rows[0]) - 2)
    for system, why in skipped.items():
        rows.append([system, *blank, f"not measured: {why}"])
    if trl is None and with_trl and not any(system in TRL_SYSTEMS for system in skipped):
        rows.append(["trl", *blank, f"not measured: TRL is not installed ({TRL_INSTALL})"])
    return rows
