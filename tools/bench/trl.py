"""TRL's `GRPOTrainer` on a tidal recipe: the `trl` column of `tidal bench e2e`.

The run starts from the model a tidal run of the recipe starts RL from (its `model.source`:
the quickstart's tiny Qwen2 from its seed with the same supervised warm start, or a local
Hugging Face checkpoint directory as the `longtail` workload's), trains on the same prompt
stream in the same order (`prompt_source`: the task's, or `data.train_files` with the chat
template applied as tidal applies it) with the same reward function, and is evaluated by
the same greedy held-out `evaluate` (when the recipe has held-out prompts). The recipe
maps onto `GRPOConfig` as:

- lr, weight_decay, grad_clip -> learning_rate (constant, no warmup), weight_decay,
  max_grad_norm; AdamW with torch's betas and eps, as `TorchTrainEngine`;
- prompts_per_step x group_size samples per optimizer step (num_generations =
  group_size; per_device_train_batch_size = train.micro_batch_size, or the largest
  divisor of the step's samples below it, with gradient accumulation over the rest;
  one generation per optimizer step, num_iterations=1: on-policy, like `max_staleness: 0`);
- rollout.max_new_tokens -> max_completion_length, rollout.temperature, top_k, top_p ->
  temperature, top_k, top_p (TRL samples with them and trains on the full softmax); generation stops at
  the tokenizer's end ids (`Tokenizer.eos_ids`), as tidal's rollout does;
- clip_low / clip_high -> epsilon / epsilon_high; aggregation -> loss_type (token_mean is
  TRL's "dapo"); advantage -> scale_rewards (grpo divides by the group's std);
  kl_coef 0 -> beta 0 (no reference model);
- train.precision -> bf16 (accelerate's mixed precision: autocast, fp32 weights, as
  tidal's train engines do), else float32; model.gradient_checkpointing ->
  activation_checkpointing; transformers generation (no vLLM), no logging, saving or
  evaluation during training;
- threads / train.threads -> torch threads of `trainer.train()`, rollout.threads (else
  threads) -> torch threads of its `model.generate` calls (`generating_with_threads`),
  as tidal's stages get them.

TRL reads a prompt as text and tokenizes it itself, so each prompt goes to it as the text
of tidal's `prompt_ids` (the rendered chat template, special tokens included), and the run
checks that TRL's tokenizer gives those ids back (`check_prompt_ids`). TRL's tokenizer is
the policy tokenizer's own files (`save`, what checkpoints hold) loaded with
`AutoTokenizer`. The reward sees what tidal's scorer gives it: the completion decoded by the
tidal tokenizer with its end ids left out, "stop" when it has one, the prompt's other
fields as `meta`. It runs in TRL's thread, where tidal may score in worker processes
(`task.reward_workers`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.util
import itertools
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tidal.tools.config import RecipeConfig

LOSS_TYPES = {"token_mean": "dapo", "seq_mean_token_mean": "grpo", "token_sum_norm": "dr_grpo"}
"""tidal's algorithm.aggregation -> TRL's loss_type with the same normalisation."""
SCALE_REWARDS = {"grpo": "group", "grpo_no_std": "none", "dr_grpo": "none"}
"""tidal's algorithm.advantage -> TRL's scale_rewards (both centre on the group mean)."""


def available() -> bool:
    """Whether TRL is importable (it comes with the `[bench]` extra)."""
    return importlib.util.find_spec("trl") is not None


def warm_started(cfg: RecipeConfig) -> dict[str, Any]:
    """The policy a tidal run of `cfg` starts RL from, with its tokenizer, reward and prompts.

    Mirrors `tidal.tools.train.Run` up to RL: the recipe's model source builds the policy
    from the seed, its prompt source (`prompt_source`) gives the prompts, then `sft.steps`
    supervised steps on the warm start's stream train the policy in place.
    """
    from tidal.engines.models import model_source  # noqa: PLC0415
    from tidal.hal import current_platform  # noqa: PLC0415
    from tidal.tools import backends  # noqa: PLC0415
    from tidal.tools.prompts import prompt_source  # noqa: PLC0415
    from tidal.tools.rl import run_reward  # noqa: PLC0415
    from tidal.tools.train import warm_start  # noqa: PLC0415

    policy = model_source(cfg.model).build(seed=cfg.seed)
    prompts = prompt_source(cfg, policy.tokenizer)
    if cfg.sft.steps:
        train_cls = backends.load("train.backend", cfg.train.backend)
        sft = train_cls(policy.module, lr=cfg.sft.lr, grad_clip=cfg.train.grad_clip, micro_batch_size=cfg.sft.batch_size, platform=current_platform())
        warm_start(sft, cfg, policy.tokenizer, stream=prompts.warm_start())
    return {"model": policy.module, "tokenizer": policy.tokenizer, "reward": run_reward(cfg), "prompts": prompts}


def training_items(prompts: Any, cfg: RecipeConfig) -> list[dict[str, Any]]:
    """The items of the recipe's training stream (`PromptSource.train`) its RL steps take, in order.

    Raises:
        ValueError: the stream ends first (`data.num_epochs`).
    """
    algo = cfg.algorithm
    wanted = algo.num_steps * algo.prompts_per_step
    items = list(itertools.islice(prompts.train(), wanted))
    if len(items) < wanted:
        raise ValueError(f"data.num_epochs={cfg.data.num_epochs} gives {len(items)} prompts; the TRL run takes {wanted} ({algo.num_steps} steps x {algo.prompts_per_step})")
    return items


def trl_tokenizer(tokenizer: Any, folder: Path) -> Any:
    """`tokenizer` as the transformers tokenizer TRL needs: its files as a checkpoint holds
    them (every tidal tokenizer saves in transformers' format), loaded with `AutoTokenizer`."""
    import transformers  # noqa: PLC0415

    tokenizer.save(folder)  # `ModelSource.save` writes a policy's tokenizer so: any tidal tokenizer has `save`
    return transformers.AutoTokenizer.from_pretrained(folder)


def check_prompt_ids(processing_class: Any, items: Sequence[dict[str, Any]]) -> None:
    """Check that TRL, which tokenizes a prompt's text itself (`processing_class(text=...)`),
    reads each item's `prompt` as tidal's `prompt_ids`.

    Raises:
        ValueError: naming the first prompt TRL would read as other ids (say, a tokenizer
            that adds a BOS tidal's chat-templated ids do not have).
    """
    read = processing_class(text=[item["prompt"] for item in items])["input_ids"]
    for k, (item, ids) in enumerate(zip(items, read)):
        theirs, ours = list(ids), list(item["prompt_ids"])
        if theirs != ours:
            at = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
            raise ValueError(
                f"TRL's tokenizer reads training prompt {k} ({item['prompt'][:60]!r}) as other ids than tidal's prompt ids: "
                f"from token {at}, {theirs[at : at + 8]} where tidal has {ours[at : at + 8]}"
            )


def _micro_batch(samples_per_step: int, micro_batch_size: int) -> int:
    """The largest divisor of `samples_per_step` that is at most `micro_batch_size`."""
    return next(n for n in range(min(micro_batch_size, samples_per_step), 0, -1) if samples_per_step % n == 0)


def grpo_config(cfg: RecipeConfig, output_dir: str | Path) -> Any:
    """The `GRPOConfig` that matches the recipe (see the module docstring).

    Raises:
        ValueError: an algorithm setting with no TRL counterpart (names the key).
    """
    from trl import GRPOConfig  # noqa: PLC0415

    from tidal.hal import current_platform  # noqa: PLC0415

    algo = cfg.algorithm
    if algo.aggregation not in LOSS_TYPES:
        raise ValueError(f"algorithm.aggregation={algo.aggregation!r} has no TRL loss_type; the TRL run supports {sorted(LOSS_TYPES)}")
    if algo.advantage not in SCALE_REWARDS:
        raise ValueError(f"algorithm.advantage={algo.advantage!r} has no TRL counterpart; the TRL run supports {sorted(SCALE_REWARDS)}")
    if algo.kl_coef:
        raise ValueError(f"algorithm.kl_coef={algo.kl_coef}: the TRL run compares KL-free GRPO (beta=0) only")
    samples_per_step = algo.prompts_per_step * algo.group_size
    micro = _micro_batch(samples_per_step, cfg.train.micro_batch_size)
    return GRPOConfig(
        output_dir=str(output_dir),
        seed=cfg.seed,
        max_steps=algo.num_steps,
        learning_rate=cfg.train.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        weight_decay=cfg.train.weight_decay,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=cfg.train.grad_clip,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=samples_per_step // micro,
        num_generations=algo.group_size,
        num_iterations=1,
        max_completion_length=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature,
        top_k=cfg.rollout.top_k,
        top_p=cfg.rollout.top_p,
        epsilon=algo.clip_low,
        epsilon_high=algo.clip_high,
        loss_type=LOSS_TYPES[algo.aggregation],
        scale_rewards=SCALE_REWARDS[algo.advantage],
        beta=0.0,
        shuffle_dataset=False,
        use_vllm=False,
        use_cpu=current_platform().device(0).type == "cpu",
        bf16=cfg.train.precision.value == "bf16",
        fp16=False,
        activation_checkpointing=cfg.model.gradient_checkpointing,
        logging_strategy="no",
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
    )


@contextlib.contextmanager
def generating_with_threads(model: Any, num_threads: int) -> Iterator[None]:
    """Inside the block, `model.generate` (TRL's rollout: `GRPOTrainer` samples through it)
    runs with `num_threads` torch threads (0: the caller's), as `rollout.threads` sets
    tidal's rollout stage; the rest of the step (training) keeps the caller's threads.

    A count other than the caller's runs the calls on a thread of their own whose count is
    set once, as tidal's rollout stage runs on a thread with its own count (rather than
    switching one thread's count back and forth around every call).
    """
    import torch  # noqa: PLC0415

    if not num_threads or num_threads == torch.get_num_threads():
        yield
        return
    generate = model.generate
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="trl-generate", initializer=torch.set_num_threads, initargs=(num_threads,)) as pool:

        def generate_on_its_thread(*args: Any, **kwargs: Any) -> Any:  # `generate` is no_grad on any thread (its decorator)
            return pool.submit(generate, *args, **kwargs).result()

        model.generate = generate_on_its_thread
        try:
            yield
        finally:
            del model.generate  # the class's method again


def start_clock() -> Any:
    """A `TrainerCallback` whose `started` is the clock when `trainer.train()` has finished its setup.

    `train()` first builds the optimizer, scheduler and dataloader and runs accelerate's
    `prepare`; tidal builds its engines (optimizer included) before its clock starts, so
    TRL's clock starts at `on_train_begin`, just before its first step.
    """
    import transformers  # noqa: PLC0415

    class StartClock(transformers.TrainerCallback):
        started = float("nan")

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.started = time.perf_counter()

    return StartClock()


def run_trl(*, seed: int, num_steps: int, overrides: Sequence[str] = (), recipe: str = "quickstart_cpu") -> dict[str, Any]:
    """`recipe` (with `overrides`) trained by TRL's `GRPOTrainer`; a `train()`-style summary.

    samples_per_s and tokens_per_s count what the reward function scored during
    `trainer.train()` (completions, and their tokens up to and including the end token, as
    tidal's step metrics do) over the wall time of `trainer.train()` from the end of its
    setup (`start_clock`) to its return. The held-out accuracies are None for a recipe
    without held-out prompts, as tidal's are.
    """
    import datasets  # noqa: PLC0415
    import transformers  # noqa: PLC0415
    from trl import GRPOTrainer  # noqa: PLC0415

    from tidal.engines.rewards import score  # noqa: PLC0415
    from tidal.flow.trajectory import Trajectory  # noqa: PLC0415
    from tidal.tools.config import stage_threads  # noqa: PLC0415
    from tidal.tools.metrics import length_drift  # noqa: PLC0415
    from tidal.tools.recipes import resolve_recipe  # noqa: PLC0415
    from tidal.tools.run import prepare_run  # noqa: PLC0415
    from tidal.tools.train import evaluate, torch_threads  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="tidal-bench-trl-") as tmp:
        args = ["algorithm.max_staleness=0", f"seed={seed}", f"algorithm.num_steps={num_steps}", f"run_dir={Path(tmp) / 'run'}", *overrides]
        cfg, _ = prepare_run(resolve_recipe(recipe), args)
        start = warm_started(cfg)
        model, tokenizer, reward, held_items = start["model"], start["tokenizer"], start["reward"], start["prompts"].eval_items
        budget = cfg.rollout.max_new_tokens

        def held_out(policy: Any) -> float | None:
            return evaluate(policy, tokenizer, held_items, reward, max_new_tokens=budget).accuracy if held_items else None

        accuracy_before = held_out(model)

        items = training_items(start["prompts"], cfg)  # the prompts tidal trains on, in order
        processing_class = trl_tokenizer(tokenizer, Path(tmp) / "tokenizer")
        check_prompt_ids(processing_class, items)
        dataset = datasets.Dataset.from_list([{k: v for k, v in item.items() if k != "prompt_ids"} for item in items])
        model.generation_config.eos_token_id = list(tokenizer.eos_ids)  # TRL stops generating at these (and its tokenizer's end token, the first of them)
        ends = set(tokenizer.eos_ids)
        scored: list[dict[str, float]] = []

        def reward_fn(prompts: list[str], completions: list[str], completion_ids: list[list[int]], **columns: Any) -> list[float]:
            keys = [k for k in columns if k in items[0]]
            texts = [tokenizer.decode([t for t in ids if t not in ends]) for ids in completion_ids]  # as tidal's scorer decodes; TRL's ids keep the end token that ended them
            trajectories = [
                Trajectory(prompt_ids=[], finish_reason="stop" if ends.intersection(ids) else "length", meta={"prompt": p, **{k: columns[k][i] for k in keys}})
                for i, (p, ids) in enumerate(zip(prompts, completion_ids))
            ]
            rewards, _ = score(reward, trajectories, texts)
            scored.append({"samples": len(completions), "tokens": sum(map(len, completion_ids)), "reward": sum(rewards) / max(len(rewards), 1)})
            return rewards

        reward_fn.__name__ = getattr(reward, "__name__", "reward")
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # TRL 1.16 still calls transformers' renamed gradient-checkpointing API
            trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=grpo_config(cfg, Path(tmp) / "trl"), train_dataset=dataset, processing_class=processing_class)
            trainer.remove_callback(transformers.PrinterCallback)  # it prints the final metrics dict even with logging off
            clock = start_clock()
            trainer.add_callback(clock)
            with torch_threads(stage_threads(cfg, "train")), generating_with_threads(model, stage_threads(cfg, "rollout")):  # as tidal's RL stages get them
                trainer.train()
            rl_seconds = time.perf_counter() - clock.started
        policy = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False)  # the fp32 model without bf16's autocast wrapper, as tidal evaluates
        accuracy_after = held_out(policy)

    samples = sum(s["samples"] for s in scored)
    return {
        "accuracy_before": accuracy_before,
        "accuracy_after": accuracy_after,
        "steps": trainer.state.global_step,
        "samples": samples,
        "rl_seconds": rl_seconds,
        "samples_per_s": samples / rl_seconds if rl_seconds else 0.0,
        "tokens_per_s": sum(s["tokens"] for s in scored) / rl_seconds if rl_seconds else 0.0,
        "first_reward": scored[0]["reward"] if scored else None,
        "last_reward": scored[-1]["reward"] if scored else None,
        **length_drift([s["tokens"] / s["samples"] for s in scored if s["samples"]]),  # per reward call, in order
    }
