"""`tidal run` for RL recipes: build, warm-start, evaluate, run the async workflow, save.

One run writes into its run directory: `config.yaml` and `platform.json` (see `run.py`),
`metrics.jsonl` (one line per RL step), `timeline.json` (Chrome trace: one track per
stage, open it in https://ui.perfetto.dev), `progress.png` (reward and throughput against
time), `checkpoints/step-NNNNNN/` (model.safetensors + config.json + tokenizer.json, the
optimizer and store state for resume) and `summary.json` (accuracy before and after RL).

A resumed run is the same run: its step numbers, `accuracy_before`, `first_reward`,
`last_reward` (a finished run resumed takes no step: its checkpoint's) and the totals the
metrics count since the run started (`failed_rewards`, `paused_generations`, `handed_off`,
`handoffs`) go on from its checkpoint. Its `rl_seconds`, `samples_per_s` and `tokens_per_s`
measure this process's steps, those after `resumed_at`, and `timeshare` this process's
seats since then (its `since_version`).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import gc
import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from tidal.engines.rewards import resolve_reward, score
from tidal.engines.tasks import TASK_REWARDS, TASKS, problem_key
from tidal.engines.tiny import CharTokenizer, build_tiny_qwen2, save_model
from tidal.engines.torch_train import TorchTrainEngine
from tidal.flow.files import naming, write_whole
from tidal.flow.store import Store
from tidal.flow.trace import Tracer
from tidal.flow.trajectory import Trajectory, to_token_batch
from tidal.flow.workflow import Workflow, WorkflowConfig
from tidal.hal import PlatformError, current_platform
from tidal.tools import backends
from tidal.tools.config import ConfigError, loss_config, stage_threads
from tidal.tools.metrics import MetricsLog, finite
from tidal.tools.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state, truncate_metrics
from tidal.tools.run import latest_checkpoint
from tidal.tools.stopping import QuietRollout, StopRequest, stop_on_signals

log = logging.getLogger(__name__)

EVAL_SEED_OFFSET = 1_000_003
"""The held-out set is drawn with seed `seed + EVAL_SEED_OFFSET` (`held_out_prompts`)."""
SEED_APART = 2**64
"""Added to the one training chunk seed that would be the held-out set's (`chunk_seed`)."""


def chunk_seed(seed: int, k: int) -> int:
    """The seed of training prompt chunk `k` (prompts 512k .. 512k + 511) of run seed `seed`:
    `seed * 7919 + k`, except where that is the held-out set's seed (for each seed up to 126,
    chunk k = 1,000,003 - 7918 * seed: it would draw the held-out prompts, in order). That
    chunk takes a seed `SEED_APART` past its own: never the held-out set's, and no other
    chunk's short of chunk k + 2**64. Compared by absolute value: `random.Random`, which the
    tasks draw with, seeds with it."""
    drawn = seed * 7919 + k
    if abs(drawn) == abs(seed + EVAL_SEED_OFFSET):
        return abs(drawn) + SEED_APART
    return drawn


class Prompts:
    """An endless, seeded stream of training prompts; `position` resumes it.

    Prompts whose problem (`tasks.problem_key`: for countdown, the same numbers in any
    order and target) is in `held_out` are skipped. (On a small task such as
    single-digit arithmetic the held-out set is a fixed sample of the same distribution
    drawn with another seed, and `held_out` is left empty: every sum can appear in both.)
    """

    def __init__(self, cfg: Any, tokenizer: CharTokenizer, held_out: set[Any], position: int = 0) -> None:
        self.cfg, self.tokenizer, self.held_out = cfg, tokenizer, held_out
        self.position = position

    def _chunk(self, k: int) -> list[dict[str, Any]]:
        return task_prompts(self.cfg, 512, seed=chunk_seed(self.cfg.seed, k))

    MAX_SKIPPED = 100_000
    """Held-out prompts skipped in a row before the stream gives up: the task has (almost)
    none left to train on."""

    def __iter__(self) -> Iterator[dict[str, Any]]:
        skipped = 0
        for k in itertools.count(self.position // 512):
            for j, item in enumerate(self._chunk(k)):
                if k * 512 + j < self.position:
                    continue
                self.position = k * 512 + j + 1
                if problem_key(item) in self.held_out:
                    skipped += 1
                    if skipped >= self.MAX_SKIPPED:
                        raise ConfigError(
                            f"task.exclude_eval_prompts=true leaves no prompt to train on: the last {skipped:,} drawn were all among the "
                            f"{len(self.held_out)} held-out ones (task.num_eval_prompts={self.cfg.task.num_eval_prompts}); "
                            "a task this small has no unseen prompts: set task.exclude_eval_prompts=false or draw from a larger task"
                        )
                    continue
                skipped = 0
                yield {**item, "prompt_ids": self.tokenizer.encode(item["prompt"])}


def task_prompts(cfg: Any, n: int, *, seed: int) -> list[dict[str, Any]]:
    """`n` items of the recipe's task (prompt, answer, task fields), drawn with `seed`."""
    task = TASKS.get(cfg.task.name)
    if task is None:
        raise ValueError(f"task.name {cfg.task.name!r} is unknown; tasks: {sorted(TASKS)}")
    if cfg.task.name == "arithmetic":
        return task(n, seed=seed, max_value=cfg.task.max_value, ops=cfg.task.ops)
    if cfg.task.name == "countdown":
        return task(n, seed=seed, num_numbers=cfg.task.num_numbers, max_number=cfg.task.max_number)
    return task(n, seed=seed)


def held_out_prompts(cfg: Any) -> tuple[list[dict[str, Any]], set[Any]]:
    """The held-out evaluation items, and the problems (`problem_key`) training leaves out for them
    (none unless `task.exclude_eval_prompts`)."""
    items = task_prompts(cfg, cfg.task.num_eval_prompts, seed=cfg.seed + EVAL_SEED_OFFSET)
    return items, ({problem_key(item) for item in items} if cfg.task.exclude_eval_prompts else set())


def make_score(cfg: Any, tokenizer: CharTokenizer) -> Callable[[Sequence[Trajectory]], tuple[list[float], list[int]]]:
    """The recipe's reward over finished trajectories: (rewards, indexes of failed rows)."""
    reward = resolve_reward(cfg.task.reward or TASK_REWARDS[cfg.task.name])

    def texts_and_score(trajectories: Sequence[Trajectory]) -> tuple[list[float], list[int]]:
        texts = [tokenizer.decode([t for t in traj.tokens if t != tokenizer.eos_id]) for traj in trajectories]
        return score(reward, trajectories, texts)

    return texts_and_score


def workflow_config(cfg: Any) -> WorkflowConfig:
    """The recipe's RL loop settings."""
    algo = cfg.algorithm
    loss = loss_config(cfg)
    return WorkflowConfig(
        num_steps=algo.num_steps,
        prompts_per_step=algo.prompts_per_step,
        group_size=algo.group_size,
        max_staleness=algo.max_staleness,
        max_new_tokens=cfg.rollout.max_new_tokens,
        prompts_per_generate=cfg.rollout.prompts_per_generate,
        advantage=algo.advantage,
        loss=loss,
        decoupled=algo.decoupled,
        rollout_threads=stage_threads(cfg, "rollout"),
        lease_s=cfg.lease_s,
    )


def _answer_trajectories(items: list[dict[str, Any]], tokenizer: CharTokenizer) -> list[Trajectory]:
    """Prompt + reference answer + EOS, for the supervised warm start."""
    out = []
    for item in items:
        answer = tokenizer.encode(str(item["answer"]), add_bos=False) + [tokenizer.eos_id]
        t = Trajectory(prompt_ids=tokenizer.encode(item["prompt"]))
        t.extend(answer, [0.0] * len(answer), 0)
        out.append(t)
    return out


def warm_start(engine: TorchTrainEngine, cfg: Any, tokenizer: CharTokenizer, held_out: set[Any], on_step: Any = None) -> list[float]:
    """Supervised steps on prompt + answer so RL starts from a policy that sometimes succeeds."""
    losses = []
    stream = iter(Prompts(cfg, tokenizer, held_out, position=10**9))  # a region RL never reaches
    for step in range(cfg.sft.steps):
        items = [next(stream) for _ in range(cfg.sft.batch_size)]
        batch = to_token_batch(_answer_trajectories(items, tokenizer), pad_id=tokenizer.pad_id)
        losses.append(engine.sft_step(batch)["loss"])
        if on_step is not None:
            on_step(step + 1, losses[-1])
    return losses


@torch.no_grad()
def evaluate(model: torch.nn.Module, tokenizer: CharTokenizer, items: list[dict[str, Any]], reward: Any, *, max_new_tokens: int, batch_size: int = 100) -> float:
    """Greedy accuracy: the share of prompts whose answer the verifier scores 1.0, with the
    rule RL trains on (the built-in verifiers' is strict: the answer alone, then the end token)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct = 0
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        ids = [tokenizer.encode(item["prompt"]) for item in chunk]
        width = max(map(len, ids))
        input_ids = torch.tensor([[tokenizer.pad_id] * (width - len(x)) + x for x in ids], device=device)
        mask = (torch.arange(width, device=device)[None, :] >= torch.tensor([width - len(x) for x in ids], device=device)[:, None]).long()
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_id, eos_token_id=tokenizer.eos_id)
        trajectories, texts = [], []
        for item, row in zip(chunk, out[:, width:].tolist()):
            stopped = tokenizer.eos_id in row
            tokens = row[: row.index(tokenizer.eos_id)] if stopped else row
            meta = {k: v for k, v in item.items() if k != "prompt_ids"}
            trajectories.append(Trajectory(prompt_ids=[], finish_reason="stop" if stopped else "length", meta=meta))
            texts.append(tokenizer.decode(tokens))
        rewards, _ = score(reward, trajectories, texts)  # a reward that fails scores the answer 0, as in RL
        correct += sum(r == 1.0 for r in rewards)
    model.train(was_training)
    return correct / max(len(items), 1)


def unsharded(template: torch.nn.Module, named_weights: Iterable[tuple[str, torch.Tensor]]) -> torch.nn.Module:
    """A copy of the un-sharded `template` holding an engine's `named_weights()`, whatever the
    engine's sharding (the copy stays where `template` is: on the host).

    Consumes `named_weights` to the end (for a sharded engine a collective) and copies one
    tensor at a time, so no second full copy is held.
    """
    model = copy.deepcopy(template)
    own = model.state_dict()
    seen = set()
    with torch.no_grad():
        for name, tensor in named_weights:
            own[name].copy_(tensor)
            seen.add(name)
    if set(own) - seen:
        raise ValueError(f"the train engine exported no weights for {sorted(set(own) - seen)[:5]}")
    return model


def plot(metrics: list[dict[str, Any]], path: Path) -> None:
    """Reward and samples/s against wall time since the first step."""
    import matplotlib  # noqa: PLC0415 - only when a plot is written

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    t0 = metrics[0]["time"] - metrics[0]["step_s"]
    times = [m["time"] - t0 for m in metrics]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
    top.plot(times, [m["reward"] for m in metrics], marker=".")
    top.set_ylabel("mean reward")
    bottom.plot(times, [m["samples"] / m["step_s"] if m["step_s"] else float("nan") for m in metrics], marker=".", color="tab:orange")  # a step timed at 0 s: no rate
    bottom.set_ylabel("samples / s")
    bottom.set_xlabel("seconds since RL started")
    top.set_title("tidal: reward and throughput")
    fig.tight_layout()
    try:
        with naming(path):  # a full disk fails in the PNG writer's buffered write, which names no file
            fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch intra-op threads `n` of this thread inside the block (0: unchanged), then as
    before. The RL stages run at once and share the cores; the warm start and evaluations
    run alone and keep every thread torch would use."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def build_policy(cfg: Any, tokenizer: CharTokenizer) -> torch.nn.Module:
    """The recipe's policy model, freshly initialised from its seed."""
    m = cfg.model
    return build_tiny_qwen2(
        tokenizer.vocab_size,
        hidden_size=m.hidden_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads,
        intermediate_size=m.intermediate_size,
        max_positions=m.max_positions,
        seed=cfg.seed,
        attention=m.attention.value,
    )


def build_rollout_engine(cfg: Any, model: torch.nn.Module, tokenizer: CharTokenizer, *, platform: Any, version: int) -> Any:
    """The recipe's rollout engine around `model`."""
    rollout_cls = backends.load("rollout.backend", cfg.rollout.backend)  # names were checked when the recipe loaded
    return rollout_cls(model, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id, temperature=cfg.rollout.temperature, chunk_tokens=cfg.rollout.chunk_tokens, platform=platform, version=version)


def _one_process_group(train_cls: Any, platform: Any) -> Path | None:
    """Initialise a one-process group through hal when the engine needs one (`distributed`) and
    none exists (`runtime: local`); returns the rendezvous file this call made, else None. A file,
    not a free TCP port: a port picked here can be taken by another process before the group binds it."""
    import tempfile  # noqa: PLC0415

    import torch.distributed as dist  # noqa: PLC0415

    if not getattr(train_cls, "distributed", False) or dist.is_initialized():
        return None
    fd, name = tempfile.mkstemp(prefix="tidal-group-")
    os.close(fd)
    atexit.register(Path(name).unlink, missing_ok=True)  # gone even when the run raises (train() removes it when it ends)
    platform.init_process_group(rank=0, world_size=1, init_method=f"file://{name}")
    return Path(name)


def local_turns(cfg: Any) -> Any:
    """A `Turns` for `runtime: local` when the plan puts its rollout engine (instance 0) on
    the trainer's devices (colocated or hybrid), else None. The plan is made only when the
    recipe asks for shared devices (`tools.plan.shares_devices`)."""
    from tidal.flow.timeshare import Turns  # noqa: PLC0415
    from tidal.tools.plan import make_plan, shares_devices  # noqa: PLC0415

    if not shares_devices(cfg):
        return None

    plan, _ = make_plan(cfg)
    return Turns() if plan.of("rollout")[0].mode != "own" else None


def train(cfg: Any, run_dir: Path, *, progress: bool = True, start_rollouts: Any = None, engine_options: dict[str, Any] | None = None, turns: Any = None, stop: StopRequest | None = None) -> dict[str, Any]:
    """Run an RL recipe end to end; return the summary (also written to summary.json).

    `start_rollouts(cfg, store, settings)` puts the rollout stage elsewhere (the Ray
    runtime's actors): it starts them and returns what `.connect(trainer)` turns into a
    `RolloutGroup` with a `close()`; rollout on devices of its own is started before the
    warm start, so its engines get built meanwhile, one that time-shares the trainer's
    devices (`turns`) after it. Without it rollout is a thread of this process.
    `engine_options` go to every train engine this builds (the Ray runtime's rank 0 of an
    fsdp group passes `rank0_leads=True`).

    `turns` (a `flow.timeshare.Turns`, or a proxy to one) seats the RL train engine at
    devices it time-shares with rollout; without it and without `start_rollouts`, a
    plan that puts rollout on the trainer's devices gets an in-process `Turns` for both
    engines (`local_turns`). The summary's `timeshare` says what happened on these devices
    in this process (from its `since_version`), and its `handoffs` the run's hand-offs.

    `stop` (without one: a first SIGINT / SIGTERM during RL or its final checkpoint, in the
    main thread) ends the run after its current RL step: a checkpoint is written, the final
    evaluation skipped, and the summary's `stopped_early` names the reason (`RunStopped` is the CLI's to raise).

    The engines never see the un-sharded model this keeps (`template`, on the host): each
    gets a copy, and evaluation, checkpoints and rollout's weights go through the engine's
    `named_weights()` / `state_dict()`, so a sharded engine works like the plain one.
    """
    from rich.console import Console  # noqa: PLC0415
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: PLC0415

    console = Console(stderr=True)
    train_cls = backends.load("train.backend", cfg.train.backend)
    platform = current_platform()
    try:  # now, not when the RL engine is built after the warm start
        platform.autocast(cfg.train.precision.value)
    except PlatformError as e:
        raise ConfigError(f"train.precision={cfg.train.precision.value}: {e}") from None
    engine_options = engine_options or {}
    if turns is None and start_rollouts is None:
        turns = local_turns(cfg)  # its plan now, not after the warm start: one it refuses names the role at once
    group_file = _one_process_group(train_cls, platform)
    tokenizer = CharTokenizer()
    reward = resolve_reward(cfg.task.reward or TASK_REWARDS[cfg.task.name])
    held_items, held_out = held_out_prompts(cfg)
    tracer = Tracer(process="trainer" if start_rollouts is not None else "tidal")  # on Ray, rollout actors' spans join as processes of their own
    budget = cfg.rollout.max_new_tokens

    resume_from = latest_checkpoint(Path(cfg.resume)) if cfg.resume else None
    if resume_from is not None:
        store, model, tokenizer, saved, state = load_checkpoint(resume_from, attention=cfg.model.attention.value)
    else:
        store = Store()
    settings = {"group_size": cfg.algorithm.group_size, "max_new_tokens": budget, "prompts_per_generate": cfg.rollout.prompts_per_generate}
    launched = None
    if start_rollouts is not None and turns is None:  # rollout on devices of its own: its actors build their engines while this warms up
        launched = start_rollouts(cfg, store, settings)
    if resume_from is not None:
        prompts = Prompts(cfg, tokenizer, held_out, position=state["prompt_position"])
        totals, first_reward, last_reward = state.get("totals", {}), state.get("first_reward"), state.get("last_reward")  # none in a checkpoint from before they were saved
        if Path(cfg.resume).resolve() == run_dir.resolve():
            truncate_metrics(run_dir / "metrics.jsonl", state["version"])
        accuracy_before = state["accuracy_before"]
        console.print(f"tidal: resuming {cfg.resume} at version {state['version']} ({resume_from.name})", markup=False, soft_wrap=True)  # the folder as written (`exp[lr=1e-4]`), on one line
    else:
        model = build_policy(cfg, tokenizer)
        save_model(model, tokenizer, run_dir / "cache" / "initial")
        accuracy_start = evaluate(model, tokenizer, held_items, reward, max_new_tokens=budget)
        if cfg.sft.steps:
            sft = train_cls(copy.deepcopy(model), lr=cfg.sft.lr, grad_clip=cfg.train.grad_clip, micro_batch_size=cfg.sft.batch_size, max_nonfinite_steps=cfg.train.max_nonfinite_steps, platform=platform, **engine_options)
            sft_bar = Progress(TextColumn("[bold]warm start[/bold] step {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console, disable=not progress, transient=True)
            sft_task = sft_bar.add_task("sft", total=cfg.sft.steps, info="")
            with tracer.span("warm start", "supervised", steps=cfg.sft.steps), sft_bar:
                losses = warm_start(sft, cfg, tokenizer, held_out, on_step=lambda step, loss: sft_bar.update(sft_task, completed=step, info=f"loss {loss:.3f}"))
            console.print(f"tidal: warm start: {cfg.sft.steps} supervised steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
            model = unsharded(model, sft.named_weights())
            del sft
            save_model(model, tokenizer, run_dir / "cache" / "warm_start")
        accuracy_before = evaluate(model, tokenizer, held_items, reward, max_new_tokens=budget)
        console.print(f"tidal: held-out accuracy: {accuracy_start:.1%} untrained, {accuracy_before:.1%} after the warm start")
        saved, prompts = None, Prompts(cfg, tokenizer, held_out)
        totals, first_reward, last_reward = {}, None, None

    template = model
    trainer = train_cls(
        copy.deepcopy(template),
        lr=cfg.train.lr,
        weight_decay=cfg.train.weight_decay,
        grad_clip=cfg.train.grad_clip,
        micro_batch_size=cfg.train.micro_batch_size,
        temperature=cfg.rollout.temperature,
        precision=cfg.train.precision.value,
        max_nonfinite_steps=cfg.train.max_nonfinite_steps,
        platform=platform,
        **({"kl_reference": True} if cfg.algorithm.kl_coef > 0 else {}),  # the warm start's weights: the reference policy
        **engine_options,
    )
    if saved is not None:
        reference = {"reference": saved["reference"]} if saved.get("reference") is not None else {}  # a run saved without one: this checkpoint's weights
        trainer.load_state_dict({**trainer.state_dict(), "optimizer": saved["optimizer"], "version": saved["version"], **reference})
        set_rng_state(saved["rng"])
    rollout = build_rollout_engine(cfg, copy.deepcopy(template), tokenizer, platform=platform, version=trainer.version)  # the trainer's weights too
    sharing = None
    if turns is not None:
        from tidal.flow.colocate import Sharing  # noqa: PLC0415

        sharing = Sharing(turns, platform)
        trainer = sharing.train(trainer)
        if start_rollouts is None:
            rollout = sharing.rollout(rollout)
    algo = cfg.algorithm
    wf_cfg = workflow_config(cfg)
    metrics = MetricsLog(run_dir, tensorboard=cfg.tensorboard, first_step=trainer.version + 1)
    history: list[dict[str, Any]] = []

    bar = Progress(TextColumn("[bold]RL[/bold] step {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console, disable=not progress)
    task_id = bar.add_task("rl", total=algo.num_steps, completed=trainer.version, info="waiting for the first batch")

    resumed_here = resume_from is not None and Path(cfg.resume).resolve() == run_dir.resolve()
    checkpointed = [trainer.version] if resumed_here else []  # versions whose state run_dir holds

    def periodic(step: int) -> bool:  # RL step `step` (from 1) ends with a periodic checkpoint
        return step % cfg.checkpoint_every == 0 and step < algo.num_steps

    def run_first_reward() -> float | None:  # the run's: a resumed one's comes from its checkpoint
        return first_reward if first_reward is not None or not history else history[0]["reward"]

    def run_last_reward() -> float | None:  # the run's: a resume that takes no step has its checkpoint's
        return history[-1]["reward"] if history else last_reward

    def save_data(path: Path) -> dict[str, Any]:
        saved = workflow.save(path)
        if sharing is not None:
            saved["totals"]["handoffs"] = handoffs()
        return saved

    def checkpoint() -> None:
        if checkpointed[-1:] != [trainer.version]:  # e.g. a run stopped just after a periodic checkpoint
            extra = {"accuracy_before": accuracy_before, "first_reward": run_first_reward(), "last_reward": run_last_reward()}
            save_checkpoint(run_dir, trainer=trainer, template=template, tokenizer=tokenizer, save_data=save_data, extra=extra, keep=cfg.keep_checkpoints, rng=quiet.rng() if quiet is not None else None)
            checkpointed.append(trainer.version)

    def handoffs() -> int:  # in the run so far, on the trainer's devices
        return totals.get("handoffs", 0) + sharing.turns.state()["handoffs"]

    def on_step(m: dict[str, Any]) -> None:
        if sharing is not None:
            m["handoffs"] = handoffs()
        history.append(m)
        metrics.write(m)
        recent = history[-5:]
        rate = sum(x["samples"] for x in recent) / max(sum(x["step_s"] for x in recent), 1e-9)
        gap = max(m["version_gap"]) if m["version_gap"] else 0
        bar.update(task_id, completed=m["step"], info=f"reward {m['reward']:.2f}  {rate:.0f} samples/s  staleness<={gap}")
        if periodic(m["step"]):
            with tracer.span("train", "checkpoint", step=m["step"]):
                checkpoint()
        if quiet is not None:
            quiet.open.set()

    quiet = QuietRollout(store, trainer, rollout, rng_state=rng_state, checkpoints=periodic) if algo.max_staleness == 0 and start_rollouts is None else None
    remote = None
    if start_rollouts is not None:
        remote = (launched or start_rollouts(cfg, store, settings)).connect(trainer)
    workflow = Workflow(store=store, rollout=rollout, trainer=trainer, prompts=prompts, score=make_score(cfg, tokenizer), config=wf_cfg, on_step=on_step, tracer=tracer, rollouts=remote, totals=totals)

    def stop_workflow(reason: str) -> None:
        console.print(f"tidal: {reason}: stopping after the current step and saving a checkpoint (again to stop at once)")
        workflow.stop()

    signals: Any = contextlib.nullcontext()  # a caller that passes `stop` handles its own signals
    if stop is None:
        stop = StopRequest()
        signals = stop_on_signals(stop)
    stop.on_request(stop_workflow)
    # What setup made (model, optimizer, data, the warm start's leftovers) is never scanned by
    # the cyclic GC again: without this, a run's full collections paused every thread of
    # the trainer for up to 0.25 s, and its GC took 0.53 s of a 300-step quickstart on Ray
    # (0.09 s with it).
    gc.collect()
    gc.freeze()
    started = time.perf_counter()
    nonfinite, failed = None, False
    with signals:  # through the final checkpoint: a signal while it is written stops the run once it is whole
        try:
            with bar, torch_threads(stage_threads(cfg, "train")):
                workflow.run()
        except FloatingPointError as e:  # gradients stayed non-finite: the engine skipped those steps, so its state is the last finite one
            nonfinite = e
        except BaseException:
            failed = True
            metrics.close()  # what TensorBoard has not written yet (metrics.jsonl has every step)
            raise
        finally:
            gc.unfreeze()  # a caller that runs again in this process (tests, the benchmark) can free this run's objects
            if remote is not None:
                remote.close()
                for i, timeline in enumerate(remote.timelines):
                    if timeline is not None:  # an actor that died last has none
                        tracer.merge(timeline, process=f"rollout actor {i}")
            timeshare = sharing.summary() if sharing is not None else None
            if sharing is not None:
                sharing.close()
            if failed or nonfinite is not None:  # what the run did up to the failure (open spans marked unfinished)
                with contextlib.suppress(Exception):  # the failure is what the run reports
                    tracer.save(run_dir / "timeline.json")
        rl_seconds = time.perf_counter() - started
        checkpoint()
    if nonfinite is not None:  # saved above: a resume with, say, a lower train.lr loses no finite step
        metrics.close()
        raise nonfinite
    accuracy_after = None
    if stop.reason is None:
        accuracy_after = evaluate(unsharded(template, trainer.named_weights()), tokenizer, held_items, reward, max_new_tokens=budget)
        metrics.write_final({"held_out_accuracy": {"before_rl": accuracy_before, "after_rl": accuracy_after}}, step=trainer.version)
    metrics.close()
    tracer.save(run_dir / "timeline.json")
    if history:
        plot(history, run_dir / "progress.png")
    samples = sum(m["samples"] for m in history)
    counted = history[-1] if history else totals  # the run's totals: a finished run resumed takes no step
    summary = {
        "accuracy_before": accuracy_before,
        "accuracy_after": accuracy_after,
        "steps": trainer.version,
        "rl_seconds": rl_seconds,
        "samples_per_s": samples / rl_seconds if rl_seconds else 0.0,
        "tokens_per_s": sum(m["tokens"] for m in history) / rl_seconds if rl_seconds else 0.0,
        "first_reward": run_first_reward(),
        "last_reward": run_last_reward(),
        **{key: counted.get(key, 0) for key in ("failed_rewards", "paused_generations", "handed_off")},
    }
    if resume_from is not None:  # rl_seconds and the rates are this process's: its steps came after this version
        summary["resumed_at"] = state["version"]
    if timeshare is not None:  # the run's hand-offs, as its metrics count them; `timeshare` is this process's seats
        summary["handoffs"] = counted.get("handoffs", 0)
        summary["timeshare"] = {"since_version": state["version"] if resume_from is not None else 0, **timeshare}
    if stop.reason is not None:
        summary["stopped_early"] = stop.reason
    write_whole(run_dir / "summary.json", json.dumps(finite(summary), indent=2, allow_nan=False) + "\n")
    if group_file is not None:
        torch.distributed.destroy_process_group()
        group_file.unlink(missing_ok=True)
    return summary
