"""The RL phase of `tidal run` (`tools.train`): the engines, the workflow, checkpoints on the way.

`RL(run)` builds the RL train engine from the run's model (a resumed run's optimizer and
RNG from its checkpoint), the rollout engine (here, or the Ray runtime's actors), time-sharing
when rollout sits on the trainer's devices, and the `Workflow`; `run()` runs it until its
last step or a stop, and writes the final checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from tidal.engines.lr_schedule import LRSchedule
from tidal.engines.models import DTYPES
from tidal.engines.registry import critic_class, load
from tidal.engines.reward_model import RewardModel, conversation, not_a_reward_model
from tidal.engines.reward_pool import RewardPool
from tidal.engines.rewards import DEFAULT_REWARD_WORKERS, FLOAT32_MAX, NO_VERIFIER, POOLED_REWARDS, resolve_reward, score
from tidal.engines.tasks import TASK_REWARDS
from tidal.engines.tokenizers import Tokenizer
from tidal.flow.algorithms import VALUE_BASED
from tidal.flow.protocols import BuildsFromCheckpoint, Critic, TakesTrainKeys
from tidal.flow.store import Store
from tidal.flow.trajectory import Trajectory
from tidal.flow.workflow import Workflow, WorkflowConfig
from tidal.hal import current_platform
from tidal.tools.checkpoint import rng_state, save_checkpoint, set_rng_state
from tidal.tools.config import ConfigError, RecipeConfig, loss_config, stage_threads, to_dict
from tidal.tools.metrics import MetricsLog
from tidal.tools.stopping import QuietRollout, StopRequest, stop_on_signals


class BuiltRun(Protocol):
    """What the RL phase reads of a built run (`tools.train.Run` after its build phase)."""

    cfg: RecipeConfig
    run_dir: Path
    console: Any
    progress: bool
    platform: Any
    tracer: Any
    train_cls: Any
    engine_options: dict[str, Any]
    store: Store
    model: torch.nn.Module
    tokenizer: Tokenizer
    prompts: Any
    settings: dict[str, Any]
    start_rollouts: Any
    launched: Any
    turns: Any
    resume_from: Path | None
    resumed: dict[str, Any] | None
    saved: dict[str, Any] | None
    earlier: list[dict[str, Any]]
    totals: dict[str, Any]
    first_reward: float | None
    last_reward: float | None
    accuracy_before: float | None

    def evaluate(self, model: torch.nn.Module) -> Any:
        """What `model` does on the held-out prompts (`tools.train.HeldOut`; None without held-out prompts)."""
        ...


def reward_spec(cfg: RecipeConfig) -> str:
    """The name of the recipe's reward: `task.reward`, else the task's own verifier's."""
    return cfg.task.reward or TASK_REWARDS[cfg.task.name]


def run_reward(cfg: RecipeConfig) -> Any:
    """The recipe's reward function (`reward_spec`); None for `task.reward=none` (`NO_VERIFIER`)."""
    spec = reward_spec(cfg)
    return None if spec == NO_VERIFIER else resolve_reward(spec)


def reward_workers(cfg: RecipeConfig) -> int:
    """`task.reward_workers`, null resolved: `DEFAULT_REWARD_WORKERS` for the rewards that
    need a main thread (`POOLED_REWARDS`), else 0 (in the reward stage's thread); 0 with no
    reward function (`task.reward=none`)."""
    if reward_spec(cfg) == NO_VERIFIER:
        return 0
    if cfg.task.reward_workers is not None:
        return cfg.task.reward_workers
    return DEFAULT_REWARD_WORKERS if reward_spec(cfg) in POOLED_REWARDS else 0


class Scores(Protocol):
    """What scores responses to conversations: a `RewardModel`, or one seated on shared devices."""

    def score(self, conversations: Sequence[Sequence[Mapping[str, str]]], responses: Sequence[str]) -> list[float]: ...


class Scorer:
    """The recipe's reward over finished trajectories, as the workflow's `score`: (rewards,
    indexes of failed rows, how many of them timed out). With `reward_workers(cfg)` > 0 it
    runs in a `RewardPool` (each sample under `task.reward_timeout_s`), whose workers start
    at the first call and end with `close()`; else in the caller's thread, with no timeout.
    With `reward_model`, each reward is the function's (0 with `task.reward=none`) plus
    `reward_model.weight` x the model's score; a score that is not finite makes the row
    failed, as a function's does. Held-out evaluation's scorer has none: accuracy is the
    function's alone."""

    def __init__(self, cfg: RecipeConfig, tokenizer: Tokenizer, *, reward_model: Scores | None = None) -> None:
        self.reward, self.tokenizer = run_reward(cfg), tokenizer
        self.reward_model, self.weight = reward_model, cfg.reward_model.weight
        self._ends = set(tokenizer.eos_ids)
        workers = reward_workers(cfg)
        preload = ("tidal.flow.trajectory", getattr(self.reward, "__module__", None) or "tidal.engines.rewards")
        self.pool = RewardPool(num_workers=workers, timeout_s=cfg.task.reward_timeout_s, preload=preload) if workers else None
        self._scored = [0.0, 0.0, 0]  # since `take_scores`: the reward model's scores and the function's rewards summed, over this many samples
        self._scored_lock = threading.Lock()  # reward stages may score on several threads

    def __call__(self, trajectories: Sequence[Trajectory]) -> tuple[list[float], list[int], int]:
        texts = [self.tokenizer.decode([t for t in traj.tokens if t not in self._ends]) for traj in trajectories]
        if self.reward is None:
            rewards, failed, timeouts = [0.0] * len(trajectories), list[int](), 0
        elif self.pool is None:
            rewards, failed = score(self.reward, trajectories, texts)
            timeouts = 0
        else:
            rewards, failed, timeouts = self.pool.score(self.reward, trajectories, texts)
        if self.reward_model is None:
            return rewards, failed, timeouts
        scores = self.reward_model.score([conversation(t.meta) for t in trajectories], texts)
        counted = [(rewards[k], s) for k, s in enumerate(scores) if k not in failed and math.isfinite(s)]
        with self._scored_lock:
            self._scored[0] += sum(s for _, s in counted)
            self._scored[1] += sum(r for r, _ in counted)
            self._scored[2] += len(counted)
        for k, s in enumerate(scores):
            value = rewards[k] + self.weight * s
            if math.isfinite(value) and abs(value) <= FLOAT32_MAX:
                rewards[k] = value
            elif k not in failed:
                failed.append(k)  # the function's reward stays: 0 when it failed too
        return rewards, sorted(failed), timeouts

    def take_scores(self) -> dict[str, float]:
        """With a reward model: the mean of its scores (`reward_model_score`) and of the reward
        function's rewards (`reward_function`, 0 with `task.reward=none`) over the samples scored
        since the last call (a failed one left out); {} without one, or with nothing scored."""
        with self._scored_lock:
            scores, rewards, n = self._scored
            self._scored = [0.0, 0.0, 0]
        if self.reward_model is None or n == 0:
            return {}
        return {"reward_model_score": scores / n, "reward_function": rewards / n}

    def rewards(self, trajectories: Sequence[Trajectory], texts: Sequence[str]) -> list[float]:
        """Rewards of `texts` (each its trajectory's decoded answer), a failed or timed-out
        one 0.0: held-out evaluation's scores, under the pool's per-sample timeout as RL's
        are (the function's: no reward model)."""
        assert self.reward is not None, "held-out evaluation needs a reward function (`task.reward=none` measures none)"
        if self.pool is None:
            return score(self.reward, trajectories, texts)[0]
        return self.pool.score(self.reward, trajectories, texts).rewards

    def close(self) -> None:
        """End the pool's workers (none to end without a pool, or before the first call)."""
        if self.pool is not None:
            self.pool.close()


def reward_model(cfg: RecipeConfig) -> RewardModel | None:
    """The recipe's reward model (`reward_model.path`) on this process's first device; None without one.

    Raises:
        ConfigError: naming `reward_model.path` when it does not load as one.
    """
    section = cfg.reward_model
    if not section.path:
        return None
    try:
        return RewardModel(
            section.path, device=current_platform().device(0), dtype=DTYPES[section.dtype], batch_size=section.batch_size,
            max_length=section.max_length, trust_remote_code=section.trust_remote_code,
        )  # fmt: skip
    except ValueError as e:
        raise ConfigError(str(e)) from None


def make_score(cfg: RecipeConfig, tokenizer: Tokenizer, *, sharing: Any = None) -> Scorer:
    """RL's reward over finished trajectories (`Scorer`, with the recipe's reward model; close
    it after the run). `sharing` (`flow.colocate.Sharing`): the trainer's devices are
    time-shared, and the reward model takes turns there, parked between its scorings."""
    judge: Scores | None = reward_model(cfg)
    if judge is not None and sharing is not None:
        judge = sharing.reward_model(judge)
    return Scorer(cfg, tokenizer, reward_model=judge)


def build_critic(cfg: RecipeConfig, policy: torch.nn.Module, *, platform: Any) -> Critic:
    """The value model of `algorithm.advantage=gae` (`critic.*`), of the train backend's kind
    (`engines.registry.CRITIC`: one process's, or sharded over the trainer's ranks as the
    policy is): from the policy's body as it is now, or from `critic.path` (a reward model's
    body and score head; `tools.run.check_critic_path` checked it reads the policy's tokens).

    Raises:
        ConfigError: naming `critic.path` when it does not load.
    """
    c = cfg.critic
    start, head = policy, None
    if c.path:
        import transformers  # noqa: PLC0415

        classifier = not_a_reward_model(Path(c.path)) is None
        kind = transformers.AutoModelForSequenceClassification if classifier else transformers.AutoModelForCausalLM
        try:
            start = kind.from_pretrained(c.path, dtype=DTYPES[cfg.model.dtype], trust_remote_code=cfg.model.trust_remote_code)
            head = start.score if classifier else None
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise ConfigError(f"critic.path={c.path!r}: cannot load a model to start the critic from ({type(e).__name__}: {e})") from None
    cls = critic_class(cfg.critic_backend)
    return cls(
        start, lr=c.lr, value_clip=c.value_clip, micro_batch_size=c.micro_batch_size or cfg.train.micro_batch_size, grad_clip=c.grad_clip,
        weight_decay=c.weight_decay, precision=cfg.train.precision.value, platform=platform, head=head, **own_train_keys(cls, cfg),
    )  # fmt: skip


def workflow_config(cfg: RecipeConfig) -> WorkflowConfig:
    """The recipe's RL loop settings: its `algorithm` and `rollout` sections, as they are."""
    loss_config(cfg)  # the loss's bounds (a loaded recipe has passed them), named by recipe key
    return WorkflowConfig(algorithm=cfg.algorithm, rollout=cfg.rollout, lease_s=cfg.lease_s, rollout_threads=stage_threads(cfg, "rollout"))


def lr_schedule(cfg: RecipeConfig) -> LRSchedule:
    """The recipe's learning-rate curve over its RL steps (`train.lr_schedule`, `train.warmup_steps`, `train.min_lr_ratio`)."""
    train = cfg.train
    return LRSchedule(kind=train.lr_schedule, warmup_steps=train.warmup_steps, num_steps=cfg.algorithm.num_steps, min_lr_ratio=train.min_lr_ratio)


def own_train_keys(train_cls: Any, cfg: RecipeConfig) -> dict[str, Any]:
    """The recipe's `train.*` keys that the train engine class takes besides those every engine
    takes (`TakesTrainKeys`: the deepspeed engine's `zero_stage`), by name."""
    return section_values(cfg.train, train_cls.train_keys) if isinstance(train_cls, TakesTrainKeys) else {}


def section_values(section: Any, keys: Sequence[str]) -> dict[str, Any]:
    """`keys` of a recipe section (one of the schema's dataclasses), by name, with their values."""
    values = vars(section)
    return {key: values[key] for key in keys}


def build_train_engine(cfg: RecipeConfig, train_cls: Any, model: torch.nn.Module, *, platform: Any, engine_options: Mapping[str, Any] | None = None) -> Any:
    """The recipe's RL train engine (`train_cls`, the `train.backend` class) around `model`,
    as a run builds it (`tidal profile` times the same engine)."""
    return train_cls(
        model,
        lr=cfg.train.lr,
        weight_decay=cfg.train.weight_decay,
        grad_clip=cfg.train.grad_clip,
        micro_batch_size=cfg.train.micro_batch_size,
        max_tokens_per_micro_batch=cfg.train.max_tokens_per_micro_batch,
        padding_free=cfg.train.padding_free,
        temperature=cfg.rollout.temperature,
        top_k=cfg.rollout.top_k,  # the trainer's logprobs are taken under rollout's truncation
        top_p=cfg.rollout.top_p,
        precision=cfg.train.precision.value,
        max_nonfinite_steps=cfg.train.max_nonfinite_steps,
        lr_schedule=lr_schedule(cfg),
        platform=platform,
        **({"kl_reference": True} if cfg.algorithm.kl_coef > 0 or cfg.algorithm.kl_in_reward > 0 else {}),  # the warm start's weights: the reference policy
        **own_train_keys(train_cls, cfg),
        **(engine_options or {}),
    )


def build_rollout_engine(cfg: RecipeConfig, model: torch.nn.Module | None, tokenizer: Tokenizer, *, platform: Any, version: int) -> Any:
    """The recipe's rollout engine, stopping at any of the tokenizer's end ids: around `model`,
    or, for an engine that loads the checkpoint itself (`BuildsFromCheckpoint`), from
    `model.path` in the trainer's `model.dtype` (the weights it is sent then match), then given
    `model`'s weights as `version` when `model` is given and differs from the checkpoint (a
    warm start or a resumed run: `version` > 0 or `sft.steps`)."""
    rollout_cls = load("rollout.backend", cfg.rollout.backend)  # names were checked when the recipe loaded
    common = {"eos_id": list(tokenizer.eos_ids), "pad_id": tokenizer.pad_id, "temperature": cfg.rollout.temperature, "top_k": cfg.rollout.top_k, "top_p": cfg.rollout.top_p, "chunk_tokens": cfg.rollout.chunk_tokens, "platform": platform}
    if not isinstance(rollout_cls, BuildsFromCheckpoint):
        return rollout_cls(model, version=version, **common)
    own = section_values(cfg.rollout, rollout_cls.rollout_keys)
    builds: Any = rollout_cls  # a class (`BuildsFromCheckpoint` describes it, not its constructor)
    engine = builds(cfg.model.path, version=version, tensor_parallel_size=cfg.placement.rollout.devices_each, seed=cfg.seed, dtype=cfg.model.dtype, trust_remote_code=cfg.model.trust_remote_code, **own, **common)
    if model is not None and (version > 0 or cfg.sft.steps):
        engine.load_weights(version, model.state_dict().items())
    return engine


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


class RL:
    """The RL phase of one run: engines and workflow built from `run` (`tools.train.Run`);
    `run()` trains and writes the final checkpoint. What `Run.finish` reads: `trainer`,
    `history`, `metrics`, `rl_seconds`, `timeshare`, `stop` and the run's first and last reward."""

    def __init__(self, run: BuiltRun, *, stop: StopRequest | None) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: PLC0415

        self.r, cfg = run, run.cfg
        self.template = run.model
        self.trainer = build_train_engine(cfg, run.train_cls, copy.deepcopy(self.template), platform=run.platform, engine_options=run.engine_options)
        if run.saved is not None:
            saved = run.saved
            reference = {"reference": saved["reference"]} if saved.get("reference") is not None else {}  # a run saved without one: this checkpoint's weights
            lora = {"lora": saved["lora"]} if saved.get("lora") is not None else {}  # the base and adapters, exactly (`Run.build` checked the keys)
            # "model": the checkpoint's weights, which the engine was built from (asking the engine for its state
            # would gather it whole, a collective of a sharded engine and a merged copy of a LoRA one, to be dropped)
            state = {"model": self.template.state_dict(), "optimizer": saved["optimizer"], "version": saved["version"], "lr_scheduler": saved.get("lr_scheduler")}
            self.trainer.load_state_dict({**state, **reference, **lora})
            set_rng_state(saved["rng"])
        self.critic: Any = build_critic(cfg, self.template, platform=run.platform) if cfg.algorithm.advantage in VALUE_BASED else None  # built as the trainer is, before any rollout guest runs
        if self.critic is not None and run.saved is not None and run.saved.get("critic") is not None:  # a checkpoint of a run without one: a fresh critic
            self.critic.load_state_dict(run.saved["critic"])
        self.rollout = build_rollout_engine(cfg, copy.deepcopy(self.template), run.tokenizer, platform=run.platform, version=self.trainer.version)  # the trainer's weights too
        self.sharing = None
        if run.turns is not None:
            from tidal.flow.colocate import Sharing  # noqa: PLC0415

            self.sharing = Sharing(run.turns, run.platform)
            self.trainer = self.sharing.train(self.trainer)
            if self.critic is not None:  # on the trainer's devices too: parked as the trainer is
                self.critic = self.sharing.critic(self.critic)
            if run.start_rollouts is None:
                self.rollout = self.sharing.rollout(self.rollout)
        self.metrics = MetricsLog(
            run.run_dir, tensorboard=cfg.tensorboard, first_step=self.trainer.version + 1, earlier=run.earlier,
            wandb=cfg.wandb, config=to_dict(cfg) if cfg.wandb.project else None,
        )  # fmt: skip
        self.history: list[dict[str, Any]] = []
        self.bar = Progress(TextColumn("[bold]RL[/bold] step {task.completed}/{task.total}"), BarColumn(), TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=run.console, disable=not run.progress)
        self.bar_task = self.bar.add_task("rl", total=cfg.algorithm.num_steps, completed=self.trainer.version, info="waiting for the first batch")
        resumed_here = run.resume_from is not None and cfg.resume is not None and Path(cfg.resume).resolve() == run.run_dir.resolve()
        self.checkpointed = [self.trainer.version] if resumed_here else []  # versions whose state run_dir holds
        self.prompts = run.prompts.train(run.resumed)
        self.quiet = QuietRollout(run.store, self.trainer, self.rollout, rng_state=rng_state, checkpoints=self.periodic) if cfg.algorithm.max_staleness == 0 and run.start_rollouts is None else None
        self.remote = None
        if run.start_rollouts is not None:
            self.remote = (run.launched or run.start_rollouts(cfg, run.store, run.settings)).connect(self.trainer)
        self.scorer = make_score(cfg, run.tokenizer, sharing=self.sharing)  # closed by `_close`
        self.workflow = Workflow(
            store=run.store, rollout=self.rollout, trainer=self.trainer, prompts=self.prompts, score=self.scorer,
            config=workflow_config(cfg), on_step=self.on_step, tracer=run.tracer, rollouts=self.remote, totals=run.totals, critic=self.critic,
        )
        self.stop = stop
        self.rl_seconds = 0.0
        self.timeshare: dict[str, Any] | None = None

    def periodic(self, step: int) -> bool:
        """Whether RL step `step` (from 1) ends with a periodic checkpoint."""
        return step % self.r.cfg.checkpoint_every == 0 and step < self.r.cfg.algorithm.num_steps

    def run_first_reward(self) -> float | None:
        """The run's: a resumed one's comes from its checkpoint."""
        return self.r.first_reward if self.r.first_reward is not None or not self.history else self.history[0]["reward"]

    def run_last_reward(self) -> float | None:
        """The run's: a resume that takes no step has its checkpoint's."""
        return self.history[-1]["reward"] if self.history else self.r.last_reward

    def handoffs(self) -> int:
        """Hand-offs in the run so far, on the trainer's devices."""
        assert self.sharing is not None  # only a run whose trainer shares its devices counts hand-offs
        return self.r.totals.get("handoffs", 0) + self.sharing.turns.state()["handoffs"]

    def save_data(self, path: Path) -> dict[str, Any]:
        saved = self.workflow.save(path)
        if self.sharing is not None:
            saved["totals"]["handoffs"] = self.handoffs()
        return {**saved, **self.r.prompts.saved(self.prompts)}

    def checkpoint(self) -> None:
        if self.checkpointed[-1:] != [self.trainer.version]:  # e.g. a run stopped just after a periodic checkpoint
            extra = {"accuracy_before": self.r.accuracy_before, "first_reward": self.run_first_reward(), "last_reward": self.run_last_reward()}
            rng = self.quiet.rng() if self.quiet is not None else None
            save_checkpoint(
                self.r.run_dir, trainer=self.trainer, template=self.template, tokenizer=self.r.tokenizer, save_data=self.save_data, extra=extra,
                keep=self.r.cfg.keep_checkpoints, rng=rng, critic=self.critic.state_dict() if self.critic is not None else None,
            )  # fmt: skip
            self.checkpointed.append(self.trainer.version)

    def evaluates(self, step: int) -> bool:
        """Whether RL step `step` ends with a held-out evaluation (`eval_every`; a run with
        held-out prompts and a reward function to score them: not `task.reward=none`)."""
        every = self.r.cfg.eval_every
        return bool(every) and step % every == 0 and bool(self.r.prompts.eval_items) and reward_spec(self.r.cfg) != NO_VERIFIER

    def on_step(self, m: dict[str, Any]) -> None:
        m.update(self.scorer.take_scores())
        if self.sharing is not None:
            m["handoffs"] = self.handoffs()
        if self.evaluates(m["step"]):  # this step's weights; the next step waits. Greedy, or sampled from the evaluation's own generator: the run's samples stay as they were
            with self.r.tracer.span("train", "evaluate", step=m["step"]):
                m.update(self.r.evaluate(unsharded(self.template, self.trainer.named_weights())).metrics())
        self.history.append(m)
        self.metrics.write(m)
        recent = self.history[-5:]
        rate = sum(x["samples"] for x in recent) / max(sum(x["step_s"] for x in recent), 1e-9)
        gap = max(m["version_gap"]) if m["version_gap"] else 0
        self.bar.update(self.bar_task, completed=m["step"], info=f"reward {m['reward']:.2f}  {rate:.0f} samples/s  staleness<={gap}")
        if self.periodic(m["step"]):
            with self.r.tracer.span("train", "checkpoint", step=m["step"]):
                self.checkpoint()
        if self.quiet is not None:
            self.quiet.open.set()

    def _stop_workflow(self, reason: str) -> None:
        self.r.console.print(f"tidal: {reason}: stopping after the current step and saving a checkpoint (again to stop at once)")
        self.workflow.stop()

    def run(self) -> None:
        """Train until the last step or a stop, then write the final checkpoint.

        Raises:
            FloatingPointError: gradients stayed non-finite (after the checkpoint of the last finite state).
        """
        signals: Any = contextlib.nullcontext()  # a caller that passes `stop` handles its own signals
        if self.stop is None:
            self.stop = StopRequest()
            signals = stop_on_signals(self.stop)
        self.stop.on_request(self._stop_workflow)
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
                with self.bar, torch_threads(stage_threads(self.r.cfg, "train")):
                    self.workflow.run()
            except FloatingPointError as e:  # gradients stayed non-finite: the engine skipped those steps, so its state is the last finite one
                nonfinite = e
            except BaseException:
                failed = True
                self.metrics.close()  # what TensorBoard has not written yet (metrics.jsonl has every step)
                raise
            finally:
                gc.unfreeze()  # a caller that runs again in this process (tests, the benchmark) can free this run's objects
                self._close(failed or nonfinite is not None)
            self.rl_seconds = time.perf_counter() - started
            self.checkpoint()
        if nonfinite is not None:  # saved above: a resume with, say, a lower train.lr loses no finite step
            self.metrics.close()
            raise nonfinite

    def _close(self, failed: bool) -> None:
        """End the reward workers, the remote rollouts and time-sharing; on a failure, save what the timeline has."""
        self.scorer.close()
        if self.remote is not None:
            self.remote.close()
            for i, timeline in enumerate(self.remote.timelines):
                if timeline is not None:  # an actor that died last has none
                    self.r.tracer.merge(timeline, process=f"rollout actor {i}")
        if self.sharing is not None:
            self.timeshare = self.sharing.summary()
            self.sharing.close()
        if failed:  # what the run did up to the failure (open spans marked unfinished)
            with contextlib.suppress(Exception):  # the failure is what the run reports
                self.r.tracer.save(self.r.run_dir / "timeline.json")
