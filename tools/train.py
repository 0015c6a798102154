"""`tidal run` for RL recipes: build, warm-start, evaluate, run the async workflow, save.

One run writes into its run directory: `config.yaml` and `platform.json` (see `run.py`),
`metrics.jsonl` (one line per RL step; `held_out_accuracy` every `eval_every` steps), `timeline.json` (Chrome trace: one track per
stage, open it in https://ui.perfetto.dev), `progress.png` (reward, throughput and held-out accuracy by
RL step), `checkpoints/step-NNNNNN/` (model.safetensors + config.json + tokenizer.json, the
optimizer and store state for resume) and `summary.json` (accuracy before and after RL).

A resumed run is the same run: its record (a new run directory's metrics.jsonl, and so its
progress.png, start with the resumed run's steps up to the checkpoint), step numbers, `accuracy_before`, `first_reward`,
`last_reward` (a finished run resumed takes no step: its checkpoint's) and the totals the
metrics count since the run started (`failed_rewards`, `reward_timeouts`, `paused_generations`, `handed_off`,
`handoffs`) go on from its checkpoint. Its `rl_seconds`, `samples_per_s` and `tokens_per_s`
measure this process's steps, those after `resumed_at`, and `timeshare` this process's
seats since then (its `since_version`).
"""

from __future__ import annotations

import atexit
import collections
import copy
import dataclasses
import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from tidal.engines.models import ModelSource, Policy, model_source
from tidal.engines.registry import critic_class, load
from tidal.engines.rewards import answer_reader, score
from tidal.engines.sampling import truncate
from tidal.engines.tokenizers import Tokenizer
from tidal.flow.algorithms import VALUE_BASED
from tidal.flow.files import write_whole
from tidal.flow.protocols import Distributed, SupervisedStep
from tidal.flow.store import Store
from tidal.flow.trace import Tracer
from tidal.flow.trajectory import Trajectory, to_token_batch
from tidal.hal import PlatformError, current_platform
from tidal.tools.checkpoint import check_lora, load_checkpoint, truncate_metrics
from tidal.tools.config import ConfigError, EvalConfig, RecipeConfig
from tidal.tools.metrics import finite
from tidal.tools.plot import plot
from tidal.tools.prompts import EVAL_SEED_OFFSET, SEED_APART, Prompts, PromptSource, chunk_seed, held_out_prompts, prompt_source, task_prompts
from tidal.tools.rl import RL, Scorer, build_rollout_engine, make_score, own_train_keys, reward_spec, run_reward, torch_threads, unsharded, workflow_config
from tidal.tools.run import latest_checkpoint
from tidal.tools.stopping import StopRequest

__all__ = [  # the prompt and RL helpers' old home
    "EVAL_SEED_OFFSET", "SEED_APART", "Prompts", "build_rollout_engine", "chunk_seed", "held_out_prompts", "make_score",
    "task_prompts", "torch_threads", "train", "unsharded", "workflow_config",
]

log = logging.getLogger(__name__)


def _answer_trajectories(items: list[dict[str, Any]], tokenizer: Tokenizer) -> list[Trajectory]:
    """Prompt + reference answer + the first end token, for the supervised warm start."""
    out = []
    for item in items:
        answer = tokenizer.encode(str(item["answer"]), add_bos=False) + [tokenizer.eos_ids[0]]
        t = Trajectory(prompt_ids=item["prompt_ids"])
        t.extend(answer, [0.0] * len(answer), 0)
        out.append(t)
    return out


def warm_start(engine: SupervisedStep, cfg: RecipeConfig, tokenizer: Tokenizer, held_out: set[Any] | None = None, on_step: Any = None, *, stream: Iterator[dict[str, Any]] | None = None) -> list[float]:
    """Supervised steps on prompt + answer so RL starts from a policy that sometimes succeeds.
    `stream` gives the items (`PromptSource.warm_start`); without it the task's, past where RL draws."""
    if stream is None:
        stream = iter(Prompts(cfg, tokenizer, held_out or set(), position=10**9))  # a region RL never reaches
    losses = []
    for step in range(cfg.sft.steps):
        items = [next(stream) for _ in range(cfg.sft.batch_size)]
        batch = to_token_batch(_answer_trajectories(items, tokenizer), pad_id=tokenizer.pad_id)
        losses.append(engine.sft_step(batch)["loss"])
        if on_step is not None:
            on_step(step + 1, losses[-1])
    return losses


def _until_end(row: list[int], ends: set[int]) -> tuple[list[int], bool]:
    """The tokens of a generated row before its first end token, and whether it had one."""
    for k, token in enumerate(row):
        if token in ends:
            return row[:k], True
    return row, False


@dataclasses.dataclass(frozen=True)
class HeldOut:
    """What a held-out evaluation measured."""

    accuracy: float
    """The share of answers the reward scores 1.0 (with `eval.samples` > 1, of all of them: mean@N)."""
    pass_at_n: float | None = None
    """With `eval.samples` > 1: the share of prompts with at least one such answer (pass@N); else None."""
    maj_at_n: float | None = None
    """With `eval.samples` > 1 and a reward whose answers can be read (`engines.rewards.answer_reader`):
    the share of prompts whose most frequent answer is right (maj@N); else None."""

    def metrics(self) -> dict[str, float]:
        """The step metrics' fields: `held_out_accuracy`, and `held_out_pass_at_n` (and
        `held_out_maj_at_n`) when sampled N times."""
        more = {"held_out_pass_at_n": self.pass_at_n, "held_out_maj_at_n": self.maj_at_n}
        return {"held_out_accuracy": self.accuracy, **{k: v for k, v in more.items() if v is not None}}


@torch.no_grad()
def evaluate(
    model: Any, tokenizer: Tokenizer, items: list[dict[str, Any]], reward: Any, *, max_new_tokens: int, batch_size: int = 100, scorer: Scorer | None = None, sampling: EvalConfig | None = None, seed: int = 0,
    answer_of: Callable[[str], str | None] | None = None,
) -> HeldOut:
    """Held-out accuracy (`HeldOut`): the share of answers the verifier scores 1.0, with the rule RL trains
    on (the built-in verifiers' is strict: the answer alone, then an end token; generation
    stops at any of `tokenizer.eos_ids`). Greedy (plain argmax decoding: the model's
    generation config, its repetition penalty say, left out), or as `sampling` says:
    `samples` answers per prompt at `temperature`, cut to `top_k` / `top_p` as rollout cuts
    (`engines.sampling.truncate`), drawn from a generator of the evaluation's own seeded with
    `seed` (`_SampledArgmax`). Items are encoded as RL's are: their `prompt_ids`, else their
    `prompt` encoded. `batch_size` answers go in each `generate` call (at least one prompt's). With `scorer` (the run's, for `reward`)
    answers are scored as RL's are, in its worker pool under its per-sample timeout; without
    one, in this thread. With several samples and `answer_of` (the reward's answer reader):
    maj@N, each prompt's vote over the answers its responses closed with an end token give
    (ties: the answer given first), right when that answer's first response scored 1.0."""
    samples = sampling.samples if sampling is not None else 1
    sampled = sampling is not None and sampling.temperature > 0
    device = next(model.parameters()).device
    was_training, own = model.training, model.generation_config  # a transformers model: it has one (`generate` reads it)
    model.eval()
    model.generation_config = _plain_generation(tokenizer)
    processors = [_SampledArgmax(sampling, seed=seed)] if sampled and sampling is not None else []
    ends = set(tokenizer.eos_ids)
    correct = solved = voted = 0
    try:
        prompts_per_call = max(batch_size // samples, 1)  # a generate call's rows: about `batch_size`, as greedy's
        for start in range(0, len(items), prompts_per_call):
            chunk = [item for item in items[start : start + prompts_per_call] for _ in range(samples)]
            ids = [item["prompt_ids"] if "prompt_ids" in item else tokenizer.encode(item["prompt"]) for item in chunk]
            width = max(map(len, ids))
            input_ids = torch.tensor([[tokenizer.pad_id] * (width - len(x)) + x for x in ids], device=device)
            mask = (torch.arange(width, device=device)[None, :] >= torch.tensor([width - len(x) for x in ids], device=device)[:, None]).long()
            out = model.generate(input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, logits_processor=processors)
            trajectories, texts = [], []
            for item, prompt, row in zip(chunk, ids, out[:, width:].tolist()):
                tokens, stopped = _until_end(row, ends)
                meta = {k: v for k, v in item.items() if k != "prompt_ids"}
                kept = row[: len(tokens) + 1] if stopped else tokens  # as RL's trajectories hold them: through the end token
                trajectories.append(Trajectory(prompt_ids=prompt, tokens=kept, logprobs=[0.0] * len(kept), versions=[0] * len(kept), finish_reason="stop" if stopped else "length", meta=meta))
                texts.append(tokenizer.decode(tokens))
            rewards = scorer.rewards(trajectories, texts) if scorer is not None else score(reward, trajectories, texts)[0]  # a reward that fails scores the answer 0, as in RL
            right = [r == 1.0 for r in rewards]
            correct += sum(right)
            solved += sum(any(right[k : k + samples]) for k in range(0, len(right), samples))  # a prompt's answers are consecutive
            if answer_of is not None and samples > 1:
                voted += sum(_majority_right([answer_of(t) if j.finish_reason == "stop" else None for j, t in zip(trajectories[k : k + samples], texts[k : k + samples])], right[k : k + samples]) for k in range(0, len(right), samples))
    finally:
        model.train(was_training)
        model.generation_config = own
    several = samples > 1
    return HeldOut(correct / max(len(items) * samples, 1), solved / max(len(items), 1) if several else None, voted / max(len(items), 1) if several and answer_of is not None else None)


def _majority_right(answers: list[str | None], right: list[bool]) -> bool:
    """Whether a prompt's most frequent answer (None: no answer, no vote; ties: the answer
    given first) is right: the first response that gave it was scored right."""
    counts = collections.Counter(a for a in answers if a is not None)
    if not counts:
        return False
    most = max(counts.values())
    winner = next(a for a in answers if a is not None and counts[a] == most)
    return right[answers.index(winner)]


def _plain_generation(tokenizer: Tokenizer) -> Any:
    """A generation config with nothing but the end and padding ids: `generate` fills what a
    call leaves unset from the model's own `generation_config`, so a checkpoint's
    `repetition_penalty` (1.05 in Qwen2.5-Instruct's), `no_repeat_ngram_size`, `num_beams`
    or `min_new_tokens` would change what "greedy" decodes, and the held-out accuracy with it."""
    from transformers import GenerationConfig  # noqa: PLC0415

    return GenerationConfig(eos_token_id=list(tokenizer.eos_ids), pad_token_id=tokenizer.pad_id)


class _SampledArgmax:
    """A logits processor that turns greedy decoding into sampling: the scores at the
    temperature, cut to top-k / top-p, plus Gumbel noise, whose argmax is a draw from the cut
    softmax (the Gumbel-max trick). The noise comes from a CPU generator of its own, seeded
    once, so an evaluation draws nothing from the global generators a concurrent rollout
    thread samples with, and every evaluation of a run draws the same noise."""

    def __init__(self, sampling: EvalConfig, *, seed: int) -> None:
        self.sampling = sampling
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        s = self.sampling
        cut = truncate(scores.float() / s.temperature, top_k=s.top_k, top_p=s.top_p)
        uniform = torch.rand(cut.shape, generator=self.generator).clamp_(min=torch.finfo(torch.float32).tiny)
        return cut + (-torch.log(-torch.log(uniform))).to(cut.device)


def build_policy(cfg: RecipeConfig, tokenizer: Tokenizer | None = None) -> torch.nn.Module:
    """The recipe's policy module as a new run starts it (`model.source`); its tokenizer is the source's."""
    return model_source(cfg.model).build(seed=cfg.seed).module


def one_process_group(classes: list[Any], platform: Any) -> Path | None:
    """Initialise a one-process group through hal when an engine of `classes` (the train
    engine's, a critic's) needs one (`distributed`) and none exists (`runtime: local`); returns
    the rendezvous file this call made, else None. A file, not a free TCP port: a port picked
    here can be taken by another process before the group binds it."""
    import tempfile  # noqa: PLC0415

    import torch.distributed as dist  # noqa: PLC0415

    if not any(isinstance(cls, Distributed) for cls in classes) or dist.is_initialized():
        return None
    fd, name = tempfile.mkstemp(prefix="tidal-group-")
    os.close(fd)
    atexit.register(Path(name).unlink, missing_ok=True)  # gone even when the run raises (train() removes it when it ends)
    platform.init_process_group(rank=0, world_size=1, init_method=f"file://{name}")
    return Path(name)


def local_turns(cfg: RecipeConfig) -> Any:
    """A `Turns` for `runtime: local` when the plan puts its rollout engine (instance 0) on
    the trainer's devices (colocated or hybrid), else None. The plan is made only when the
    recipe asks for shared devices (`tools.plan.shares_devices`)."""
    from tidal.flow.turns import Turns  # noqa: PLC0415
    from tidal.tools.plan import make_plan, shares_devices  # noqa: PLC0415

    if not shares_devices(cfg):
        return None

    plan, _ = make_plan(cfg)
    return Turns() if plan.of("rollout")[0].mode != "own" else None


def train(cfg: RecipeConfig, run_dir: Path, *, progress: bool = True, start_rollouts: Any = None, engine_options: dict[str, Any] | None = None, turns: Any = None, stop: StopRequest | None = None) -> dict[str, Any]:
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
    run = Run(cfg, run_dir, progress=progress, start_rollouts=start_rollouts, engine_options=engine_options or {}, turns=turns)
    try:
        run.build()
        if run.resumed is None:
            run.warm_start()
        rl = RL(run, stop=stop)
        rl.run()
        return run.finish(rl)
    finally:
        run.close()


class Run:
    """One `train()` call's state, made by its phases in order: `build` (platform, model source,
    tokenizer, reward, prompts; a checkpoint's store and weights when resuming), `warm_start`
    (a new run: accuracy before, optional supervised steps), then `RL` (the engines and the
    workflow), then `finish` (final evaluation, plot, summary)."""

    def __init__(self, cfg: RecipeConfig, run_dir: Path, *, progress: bool, start_rollouts: Any, engine_options: dict[str, Any], turns: Any) -> None:
        from rich.console import Console  # noqa: PLC0415

        self.cfg, self.run_dir, self.progress = cfg, run_dir, progress
        self.start_rollouts, self.engine_options, self.turns = start_rollouts, engine_options, turns
        self.console = Console(stderr=True)
        self.budget = cfg.rollout.max_new_tokens
        self.accuracy_before: float | None = None
        self.saved: dict[str, Any] | None = None  # a resumed run's trainer.pt
        self.resumed: dict[str, Any] | None = None  # ... and its state.json
        self.totals: dict[str, Any] = {}
        self.first_reward: float | None = None
        self.last_reward: float | None = None
        self.earlier: list[dict[str, Any]] = []  # a resumed run's steps up to its checkpoint, as its metrics.jsonl holds them
        self.eval_scorer: Scorer | None = None  # held-out evaluation's reward pool, made at the first evaluation; `close` ends it

    # --- build -------------------------------------------------------------------------

    def build(self) -> None:
        """Everything the phases after it share; a resumed run's checkpoint read."""
        cfg = self.cfg
        self.train_cls = load("train.backend", cfg.train.backend)
        self.platform = current_platform()
        try:  # now, not when the RL engine is built after the warm start
            self.platform.autocast(cfg.train.precision.value)
        except PlatformError as e:
            raise ConfigError(f"train.precision={cfg.train.precision.value}: {e}") from None
        if self.turns is None and self.start_rollouts is None:
            self.turns = local_turns(cfg)  # its plan now, not after the warm start: one it refuses names the role at once
        critic = [critic_class(cfg.critic_backend)] if cfg.algorithm.advantage in VALUE_BASED else []
        self.group_file = one_process_group([self.train_cls, *critic], self.platform)
        self.source: ModelSource = model_source(cfg.model)
        self.reward = run_reward(cfg)
        self.tracer = Tracer(process="trainer" if self.start_rollouts is not None else "tidal")  # on Ray, rollout actors' spans join as processes of their own
        self.resume_from = latest_checkpoint(Path(cfg.resume)) if cfg.resume else None
        if self.resume_from is not None:
            self.store, self.model, self.tokenizer, self.saved, self.resumed = load_checkpoint(self.resume_from, source=self.source)
            check_lora(self.saved, cfg.train, resume=str(self.resume_from.parent.parent))
        else:
            self.store = Store()
            policy = self.source.build(seed=cfg.seed)
            self.model, self.tokenizer = policy.module, policy.tokenizer
        self._check_lora_targets()
        settings = {"group_size": cfg.algorithm.group_size, "max_new_tokens": self.budget, "prompts_per_generate": cfg.rollout.prompts_per_generate, "continuous": cfg.rollout.continuous_batching}
        self.launched = None
        if self.start_rollouts is not None and self.turns is None:  # rollout on devices of its own: its actors build their engines while this warms up
            self.launched = self.start_rollouts(cfg, self.store, settings)
        self.settings = settings
        self.prompts: PromptSource = self._read_prompts()
        if self.resumed is not None:
            assert self.resume_from is not None  # the checkpoint the state came from
            state = self.resumed
            self.totals, self.first_reward, self.last_reward = state.get("totals", {}), state.get("first_reward"), state.get("last_reward")  # none in a checkpoint from before they were saved
            resumed_from = Path(cfg.resume or self.resume_from)  # the folder the user named (a resumed state came from it)
            same_dir = resumed_from.resolve() == self.run_dir.resolve()
            self.earlier = truncate_metrics(resumed_from / "metrics.jsonl", state["version"], into=None if same_dir else self.run_dir / "metrics.jsonl")
            self.accuracy_before = state["accuracy_before"]
            self.console.print(f"tidal: resuming {cfg.resume} at version {state['version']} ({self.resume_from.name})", markup=False, soft_wrap=True)  # the folder as written (`exp[lr=1e-4]`), on one line

    def _check_lora_targets(self) -> None:
        """`train.lora_target_modules` names layers of this model that take adapters, before the
        warm start (the engines would refuse them only when they are built).

        Raises:
            ConfigError: naming the key and the model's linear layers (`engines.lora.check_targets`).
        """
        train = self.cfg.train
        if not train.lora_rank:
            return
        from tidal.engines.lora import check_targets, lora_settings  # noqa: PLC0415

        settings = lora_settings(train.lora_rank, train.lora_alpha, train.lora_target_modules)
        assert settings is not None  # a rank > 0
        try:
            check_targets(self.model, settings)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def _read_prompts(self) -> PromptSource:
        """The recipe's prompts (`prompt_source`), with a bar while data files are read and
        measured (a large dataset takes a while: 20k GSM8K-size prompts about 2.5 s)."""
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: PLC0415

        bar = Progress(TextColumn("[bold]reading {task.fields[key]}[/bold] prompts"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=self.console, disable=not self.progress, transient=True)
        tasks: dict[str, Any] = {}

        def on_progress(key: str, done: int, total: int) -> None:
            if key not in tasks:
                tasks[key] = bar.add_task("read", total=total, key=key)
            bar.update(tasks[key], completed=done)

        with bar:
            return prompt_source(self.cfg, self.tokenizer, on_progress=on_progress)

    def evaluate(self, model: torch.nn.Module) -> HeldOut | None:
        """What `model` does on the held-out prompts (None: the run has none)."""
        items = self.prompts.eval_items
        if not items or self.reward is None:  # no held-out prompts, or no function to score them (`task.reward=none`)
            return None
        if self.eval_scorer is None:  # its own pool: `eval_every` scores in this thread while RL's reward stage scores in its own
            self.eval_scorer = Scorer(self.cfg, self.tokenizer)  # the function's accuracy: no reward model
        return evaluate(
            model, self.tokenizer, items, self.reward, max_new_tokens=self.budget, scorer=self.eval_scorer, sampling=self.cfg.eval, seed=self.cfg.seed,
            answer_of=answer_reader(reward_spec(self.cfg)),
        )  # fmt: skip

    # --- warm start --------------------------------------------------------------------

    def warm_start(self) -> None:
        """A new run: keep the first weights, measure them, take `sft.steps` supervised steps."""
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: PLC0415

        cfg, console = self.cfg, self.console
        if self.source.built_here:  # a checkpoint directory is its own record of them
            self.source.save(self._policy(self.model), self.run_dir / "cache" / "initial")
        start = self.evaluate(self.model)
        accuracy_start = start.accuracy if start is not None else None
        if cfg.sft.steps:
            sft = self.train_cls(copy.deepcopy(self.model), lr=cfg.sft.lr, grad_clip=cfg.train.grad_clip, micro_batch_size=cfg.sft.batch_size, max_nonfinite_steps=cfg.train.max_nonfinite_steps, platform=self.platform, **own_train_keys(self.train_cls, cfg), **self.engine_options)
            bar = Progress(TextColumn("[bold]warm start[/bold] step {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=console, disable=not self.progress, transient=True)
            task = bar.add_task("sft", total=cfg.sft.steps, info="")
            with self.tracer.span("warm start", "supervised", steps=cfg.sft.steps), bar:
                losses = warm_start(sft, cfg, self.tokenizer, on_step=lambda step, loss: bar.update(task, completed=step, info=f"loss {loss:.3f}"), stream=self.prompts.warm_start())
            console.print(f"tidal: warm start: {cfg.sft.steps} supervised steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
            self.model = unsharded(self.model, sft.named_weights())
            del sft
            self.source.save(self._policy(self.model), self.run_dir / "cache" / "warm_start")
            after = self.evaluate(self.model)
            self.accuracy_before = after.accuracy if after is not None else None
            if accuracy_start is not None:
                console.print(f"tidal: held-out accuracy: {accuracy_start:.1%} untrained, {self.accuracy_before:.1%} after the warm start")
        else:
            self.accuracy_before = accuracy_start
            if accuracy_start is not None:
                console.print(f"tidal: held-out accuracy before RL: {accuracy_start:.1%} ({len(self.prompts.eval_items)} prompts; no warm start)")
        if self.reward is None and self.prompts.eval_items:
            console.print(f"tidal: the {len(self.prompts.eval_items)} held-out prompts are not scored: task.reward=none has no function to score answers with (the reward model's scores are RL's reward only)")

    def _policy(self, module: torch.nn.Module) -> Policy:
        return Policy(module, self.tokenizer)

    # --- finish ------------------------------------------------------------------------

    def finish(self, rl: RL) -> dict[str, Any]:
        """The final evaluation (unless stopped early), timeline, plot and summary.json."""
        history, totals = rl.history, self.totals
        assert rl.stop is not None  # `RL.run` made it
        accuracy_after, final = None, {}
        if rl.stop.reason is None:
            last = history[-1] if history else {}
            measured = last.get("step") == rl.trainer.version and "held_out_accuracy" in last  # at the last step (`eval_every`): these weights
            held_out = HeldOut(last["held_out_accuracy"], last.get("held_out_pass_at_n"), last.get("held_out_maj_at_n")) if measured else self.evaluate(unsharded(self.model, rl.trainer.named_weights()))
            final = held_out.metrics() if held_out is not None else {}
            accuracy_after = final.get("held_out_accuracy")
            if accuracy_after is not None:
                rl.metrics.write_final({"held_out_accuracy": {"before_rl": self.accuracy_before, "after_rl": accuracy_after}}, step=rl.trainer.version)
        rl.metrics.close()
        self.tracer.save(self.run_dir / "timeline.json")
        if steps := [*self.earlier, *history]:  # the whole run's: a resumed one's starts at its first step
            plot(steps, self.run_dir / "progress.png", accuracy={"before_rl": self.accuracy_before, "after_rl": accuracy_after})
        samples = sum(m["samples"] for m in history)
        counted = history[-1] if history else totals  # the run's totals: a finished run resumed takes no step
        seconds = rl.rl_seconds
        summary = {
            "accuracy_before": self.accuracy_before,
            "accuracy_after": accuracy_after,
            **({"pass_at_n_after": final["held_out_pass_at_n"]} if "held_out_pass_at_n" in final else {}),
            **({"maj_at_n_after": final["held_out_maj_at_n"]} if "held_out_maj_at_n" in final else {}),
            "steps": rl.trainer.version,
            "rl_seconds": seconds,
            "samples_per_s": samples / seconds if seconds else 0.0,
            "tokens_per_s": sum(m["tokens"] for m in history) / seconds if seconds else 0.0,
            "first_reward": rl.run_first_reward(),
            "last_reward": rl.run_last_reward(),
            **{key: counted.get(key, 0) for key in ("failed_rewards", "reward_timeouts", "paused_generations", "handed_off")},
        }
        if self.resumed is not None:  # rl_seconds and the rates are this process's: its steps came after this version
            summary["resumed_at"] = self.resumed["version"]
        if rl.timeshare is not None:  # the run's hand-offs, as its metrics count them; `timeshare` is this process's seats
            summary["handoffs"] = counted.get("handoffs", 0)
            summary["timeshare"] = {"since_version": self.resumed["version"] if self.resumed is not None else 0, **rl.timeshare}
        if rl.stop.reason is not None:
            summary["stopped_early"] = rl.stop.reason
        write_whole(self.run_dir / "summary.json", json.dumps(finite(summary), indent=2, allow_nan=False) + "\n")
        if self.group_file is not None:
            torch.distributed.destroy_process_group()
            self.group_file.unlink(missing_ok=True)
        return summary

    def close(self) -> None:
        """End held-out evaluation's reward workers (after `finish`, or a phase that raised)."""
        if self.eval_scorer is not None:
            self.eval_scorer.close()
