"""`tidal run`: load and validate a recipe, choose the platform, set up the run directory.

The run directory always receives `config.yaml` (the resolved config, every default
filled in) and `platform.json` (the platform descriptor and how it was chosen), before
any work starts, so every run can be reproduced from its own folder.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tidal.flow.files import write_whole
from tidal.flow.placement import Plan
from tidal.flow.ray.placement import ray_address
from tidal.tools.config import ConfigError, RecipeConfig, iter_keys, load_config, select, to_yaml

FIXED_ON_RESUME = {
    "model.hidden_size": "hidden_size", "model.num_layers": "num_hidden_layers", "model.num_heads": "num_attention_heads",
    "model.num_kv_heads": "num_key_value_heads", "model.intermediate_size": "intermediate_size", "model.max_positions": "max_position_embeddings",
}
"""Keys a resumed run takes from its checkpoint (the model's shape), with their names in the
checkpoint's `config.json`: `resume=` with another value is an error."""
_NOT_COMPARED = ("run_dir", "resume", "output_dir")
_NO_EFFECT_ON_RESUME = "sft."
"""Keys a resumed run does not use: its warm start is done."""
_HELD_OUT_KEYS = ("seed", "data.eval_files", "task.name", "task.max_value", "task.ops", "task.num_numbers", "task.max_number", "task.num_eval_prompts")
"""Keys that draw the held-out set (`tools.train.held_out_prompts`): changed on resume, the
accuracy after RL is measured on other prompts than the checkpoint's accuracy before."""


def _new_run_dir(cfg: RecipeConfig) -> Path:
    """Make the run's directory: `run_dir`, else `<output_dir>/<name>-<timestamp>`.

    Raises:
        ConfigError: naming the key, when `run_dir` holds files, either key names a file,
            or the directory cannot be made there (read-only, under a file, no permission).
    """
    key = "run_dir" if cfg.run_dir else "output_dir"
    try:
        return _make_run_dir(cfg)
    except OSError as e:  # read-only filesystem, a file in the path, no permission
        raise ConfigError(
            f"{key}={getattr(cfg, key)!r}: cannot create the run directory {e.filename or getattr(cfg, key)!r} ({e.strerror or e}); "
            "choose a writable run_dir or output_dir"
        ) from None


def _make_run_dir(cfg: RecipeConfig) -> Path:
    key = "run_dir" if cfg.run_dir else "output_dir"  # the one that names where the run goes
    if Path(getattr(cfg, key)).exists() and not Path(getattr(cfg, key)).is_dir():
        raise ConfigError(f"{key}={getattr(cfg, key)!r} is a file, not a directory")
    if cfg.run_dir:
        run_dir = Path(cfg.run_dir)
        if run_dir.exists() and any(run_dir.iterdir()):
            raise ConfigError(
                f"run_dir {str(run_dir)!r} already holds files; tidal never writes over a run: "
                "choose a new run_dir (or leave it unset for a timestamped one)"
            )
        run_dir.mkdir(parents=True, exist_ok=True)
        return run_dir
    stem = Path(cfg.output_dir) / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    stem.parent.mkdir(parents=True, exist_ok=True)
    run_dir, n = stem, 1
    while True:  # claimed by creating it: two runs started in the same second get one each
        try:
            run_dir.mkdir()
            return run_dir
        except FileExistsError:
            run_dir, n = Path(f"{stem}-{n}"), n + 1


def latest_checkpoint(run_dir: Path) -> Path:
    """The checkpoint folder `run_dir/checkpoints/latest` names.

    Raises:
        FileNotFoundError: the run has no checkpoint.
    """
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.exists():
        raise FileNotFoundError(f"{run_dir} has no checkpoint to resume from (no checkpoints/latest)")
    try:
        name = pointer.read_text().strip()
    except (OSError, ValueError) as e:  # a folder (a symlink to one), or bytes that are no text
        raise FileNotFoundError(f"{run_dir}'s checkpoints/latest cannot be read ({e}); write the name of one, e.g. step-000010") from None
    if name in ("", ".", "..") or "/" in name or "\\" in name:  # one folder beside `latest`, never the folder itself or one elsewhere
        raise FileNotFoundError(f"{run_dir}'s checkpoints/latest names {name!r}, which is no checkpoint folder (write the name of one, e.g. step-000010)")
    named = run_dir / "checkpoints" / name
    set_aside = named.with_name(named.name + ".old")
    if not named.exists() and set_aside.exists():  # a save of the same step stopped between its renames
        return set_aside
    if not named.is_dir():
        raise FileNotFoundError(f"{run_dir}'s checkpoints/latest names {named.name!r}, which is not there (deleted?)")
    return named


def _values(cfg: RecipeConfig) -> dict[str, Any]:
    """Every schema key a resume compares, with its value in `cfg`."""
    return {k.key: select(cfg, k.key) for k in iter_keys(RecipeConfig) if "[]" not in k.key and k.key not in _NOT_COMPARED}


def _shown(value: Any) -> Any:
    return value.name if isinstance(value, enum.Enum) else value


def resume_changes(cfg: RecipeConfig) -> list[str]:
    """For `resume=<run_dir>`: each key whose value differs from that run's `config.yaml`,
    as "key: old -> new" (empty without `resume`, or when the run kept no readable config).

    Raises:
        ConfigError: `resume` names no run with a checkpoint, or a key of FIXED_ON_RESUME
            differs from the checkpoint's model.
    """
    if not cfg.resume:
        return []
    previous = Path(cfg.resume)
    try:
        checkpoint = latest_checkpoint(previous)
    except FileNotFoundError as e:
        raise ConfigError(f"resume={cfg.resume!r}: {e}") from None
    now = _values(cfg) | {key: _absolute(select(cfg, key)) for key in INPUT_KEYS}  # as config.yaml has them
    _check_the_model(cfg, checkpoint, now)
    try:
        before = _values(load_config(previous / "config.yaml"))
    except ConfigError:  # missing, or written by a tidal whose keys differ: the checkpoint still loads
        return []
    changed = [key for key in now if now[key] != before[key]]
    return [f"{key}: {_shown(before[key])} -> {_shown(now[key])}{_note(key)}" for key in changed]


def _note(key: str) -> str:
    """What a changed key means for a resumed run, beyond its new value."""
    if key.startswith(_NO_EFFECT_ON_RESUME):
        return " (no effect: the warm start is done)"
    if key in _HELD_OUT_KEYS:
        return " (another held-out set: accuracy before and after RL are measured on different prompts)"
    if key == "task.reward":
        return " (another reward: accuracy before and after RL are scored differently)"
    return ""


def _check_the_model(cfg: RecipeConfig, checkpoint: Path, now: dict[str, Any]) -> None:
    """The model's shape keys against the checkpoint's own `config.json` (its run's
    config.yaml may be gone; the checkpoint is what loads)."""
    try:
        saved = json.loads((checkpoint / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"resume={cfg.resume!r}: its checkpoint {checkpoint.name} has no readable config.json ({e})") from None
    if cfg.model.source != "tiny":  # a checkpoint directory's model: the shape keys do not describe it
        return
    fixed = [key for key, field in FIXED_ON_RESUME.items() if field in saved and now[key] != saved[field]]
    if fixed:
        raise ConfigError(
            f"resume={cfg.resume!r} continues that run's model, but "
            + ", ".join(f"{key}={_shown(now[key])} (the run's: {saved[FIXED_ON_RESUME[key]]})" for key in fixed)
            + ": drop the override, or start a new run without resume"
        )


def check_critic_path(cfg: RecipeConfig) -> None:
    """`critic.path` is a checkpoint the critic can start from: a folder, with a model the
    policy's tokens mean the same to (its tokenizer's vocabulary is the policy's), for a run
    with a critic.

    Raises:
        ConfigError: naming `critic.path` and what is wrong.
    """
    from tidal.flow.algorithms import VALUE_BASED  # noqa: PLC0415

    key = f"critic.path={cfg.critic.path!r}"
    if cfg.algorithm.advantage not in VALUE_BASED:
        raise ConfigError(f"{key} is read only with a critic (algorithm.advantage=gae); algorithm.advantage={cfg.algorithm.advantage}: unset critic.path")
    if cfg.critic.path is None or not Path(cfg.critic.path).is_dir():
        raise ConfigError(f"{key} does not exist or is not a folder")
    if cfg.model.source != "hf" or not cfg.model.path:
        raise ConfigError(f"{key} must read the policy's tokens, and model.source={cfg.model.source} has no checkpoint tokenizer to compare: start the critic from the policy (unset critic.path)")
    import transformers  # noqa: PLC0415

    try:
        vocabularies = [transformers.AutoTokenizer.from_pretrained(p, trust_remote_code=cfg.model.trust_remote_code).get_vocab() for p in (cfg.model.path, cfg.critic.path)]
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"{key}: no readable tokenizer ({type(e).__name__}: {e})") from None
    if vocabularies[0] != vocabularies[1]:
        raise ConfigError(f"{key}: its tokenizer's vocabulary ({len(vocabularies[1])} tokens) is not the policy's ({len(vocabularies[0])}): the critic reads the policy's tokens, which would mean other words to it")


def _as_the_resumed_run(cfg: RecipeConfig, key: str) -> str:
    """For a required key a `resume=` run lacks: the override that gives it the value the run
    it continues had ("" without `resume`, or when that run kept no readable config.yaml or
    had no value either). A resumed run takes the recipe and the overrides given now, not the
    earlier run's: a key set on that run's command line must be given again."""
    if not cfg.resume:
        return ""
    try:
        value = select(load_config(Path(cfg.resume) / "config.yaml"), key)
    except ConfigError:
        return ""
    if not value:
        return ""
    shown = "[" + ",".join(map(str, value)) + "]" if isinstance(value, list) else value
    return f"; the run resume={cfg.resume!r} continues had {key}={shown}: a resumed run takes the recipe and the overrides given now, so give it again (with that run's other overrides: the command it printed when it stopped has them)"


def check_runnable(cfg: RecipeConfig) -> None:
    """Combinations `tidal run` cannot run (`tidal config` still shows them; `tidal plan`
    shows the plan and this error, `run_refusal`).

    Raises:
        ConfigError: naming the key, when `task.name` is no task, or `task.reward` no
            registered reward nor importable `module:function` (nor none with a
            `reward_model.path`); when `algorithm.advantage=gae` with a train backend that
            holds no critic (`engines.registry.CRITIC`), or a `critic.path` it cannot start from (`check_critic_path`); when
            `reward_model.path` is no folder or no reward model's
            (`engines.reward_model.refusal`); when a data file is missing
            or of no readable kind (`engines.data.expand_files`); when the trainer would be the
            guest (`placement.train.colocate_with`, `placement.rollout.lend_to`: only rollout
            time-shares the trainer's devices), or would time-share them with a train backend
            that cannot park its state (`TIME_SHARES`); when `placement.train.count` > 1 with a train backend
            that trains in one process, or under `runtime: local`; when `runtime: local`
            (one trainer and one rollout engine in this process) is asked for several
            rollout instances (`placement.rollout.count` > 1, or `placement.train.lend_to`,
            whose borrowed instances continue paused groups on the others).
    """
    from tidal.engines.data import DataError, expand_files  # noqa: PLC0415
    from tidal.engines.registry import CRITIC, KL_REFERENCE, MULTI_RANK, TASKS, TIME_SHARES, critic_class, version  # noqa: PLC0415
    from tidal.engines.reward_model import refusal as reward_model_refusal  # noqa: PLC0415
    from tidal.engines.rewards import NO_VERIFIER, resolve_reward  # noqa: PLC0415
    from tidal.flow.algorithms import VALUE_BASED  # noqa: PLC0415
    from tidal.flow.protocols import RefusesTrainKeys  # noqa: PLC0415

    if cfg.task.name not in TASKS:
        raise ConfigError(f"task.name={cfg.task.name!r} is not one of {', '.join(TASKS)}")
    if cfg.model.source == "hf" and not cfg.model.path:
        raise ConfigError("model.source=hf needs model.path: a local Hugging Face checkpoint directory (config.json, safetensors, tokenizer files)" + _as_the_resumed_run(cfg, "model.path"))
    if cfg.model.path and cfg.model.source != "hf":
        raise ConfigError(f"model.path={cfg.model.path!r} is read only with model.source=hf; model.source={cfg.model.source!r}: set model.source=hf or unset model.path")
    if cfg.model.path and not Path(cfg.model.path).is_dir():
        raise ConfigError(f"model.path={cfg.model.path!r} does not exist or is not a folder")
    if cfg.rollout.backend == "vllm" and cfg.model.source != "hf":
        raise ConfigError(f"rollout.backend=vllm loads a Hugging Face checkpoint directory itself; model.source={cfg.model.source!r}: set model.source=hf and model.path")
    if cfg.model.source == "hf" and cfg.model.path:
        check_context(cfg)
    if cfg.model.source != "tiny" and not cfg.data.train_files:
        raise ConfigError(f"model.source={cfg.model.source} trains on prompts from files: set data.train_files (the generated tasks are for the tiny model's character tokenizer)" + _as_the_resumed_run(cfg, "data.train_files"))
    if cfg.wandb.project and version("wandb") is None:  # now, not after the warm start (the trainer makes the W&B run)
        raise ConfigError(f"wandb.project={cfg.wandb.project!r} needs the wandb package, not installed here (pip install 'tidal-rl[wandb]'); or leave wandb.project unset")
    if cfg.data.train_files and not cfg.task.reward:
        raise ConfigError("data.train_files needs task.reward: the reward that checks the answers of the files' prompts (e.g. math), or none with a reward model (reward_model.path)")
    if cfg.task.reward == NO_VERIFIER and not cfg.reward_model.path:
        raise ConfigError(f"task.reward={NO_VERIFIER} leaves nothing to score the answers: set reward_model.path (a reward model's score is then the reward), or name a reward")
    if cfg.reward_model.path and (why := reward_model_refusal(cfg.reward_model.path)) is not None:  # its config.json now, not after the run directory and the warm start
        raise ConfigError(why)
    if cfg.data.train_files and cfg.sft.steps and cfg.data.answer_key is None:
        raise ConfigError(f"sft.steps={cfg.sft.steps}: a warm start trains on the reference answers, and data.answer_key is null: set sft.steps=0")
    for key, files in (("data.train_files", cfg.data.train_files), ("data.eval_files", cfg.data.eval_files)):  # found and of a readable kind now, not after the run directory is made
        try:
            if files:
                expand_files(list(files), key=key)
        except DataError as e:
            raise ConfigError(str(e)) from None
    if cfg.task.reward and cfg.task.reward != NO_VERIFIER:  # imported now (a user's module), not after the run directory and the warm start
        try:
            resolve_reward(cfg.task.reward)
        except ValueError as e:
            raise ConfigError(f"task.reward={cfg.task.reward!r}: {e}") from None
    count = cfg.placement.train.count
    if count > 1 and cfg.train.backend not in MULTI_RANK:
        raise ConfigError(
            f"placement.train.count={count} needs a train.backend that trains over several processes "
            f"({', '.join(sorted(MULTI_RANK))}); train.backend={cfg.train.backend!r} trains in one: set train.backend=fsdp or placement.train.count=1"
        )
    if cfg.critic.backend is not None and cfg.algorithm.advantage not in VALUE_BASED:
        raise ConfigError(f"critic.backend={cfg.critic.backend!r} is read only with a critic (algorithm.advantage=gae); algorithm.advantage={cfg.algorithm.advantage}: unset critic.backend")
    if cfg.critic.backend is not None and cfg.critic.backend not in CRITIC:
        raise ConfigError(f"critic.backend={cfg.critic.backend!r} is not one of {', '.join(sorted(CRITIC))}")
    if cfg.algorithm.advantage in VALUE_BASED and cfg.train.backend not in CRITIC and cfg.critic.backend is None:
        raise ConfigError(
            f"algorithm.advantage={cfg.algorithm.advantage} trains a critic beside the policy, which train.backend={cfg.train.backend!r} cannot hold yet: "
            f"set train.backend to one that can ({', '.join(sorted(CRITIC))}), critic.backend, or another advantage"
        )
    if cfg.algorithm.advantage in VALUE_BASED and isinstance(critic := critic_class(cfg.critic_backend), RefusesTrainKeys):
        refused = critic.refusal(**{key: getattr(cfg.train, key) for key in critic.train_keys})
        if refused:
            raise ConfigError(refused)
    if cfg.critic.path:
        check_critic_path(cfg)
    if cfg.algorithm.kl_coef > 0 and cfg.train.backend not in KL_REFERENCE:
        holders = ", ".join(KL_REFERENCE[:-1]) + f" or {KL_REFERENCE[-1]}"
        raise ConfigError(f"algorithm.kl_coef={cfg.algorithm.kl_coef} needs a reference policy, which only train.backend={holders} holds; train.backend={cfg.train.backend!r}: set algorithm.kl_coef=0 or train.backend={KL_REFERENCE[0]}")
    for key, value, why in (
        ("placement.train.colocate_with", cfg.placement.train.colocate_with, "only rollout time-shares the trainer's devices (placement.rollout.colocate_with=train)"),
        ("placement.rollout.lend_to", cfg.placement.rollout.lend_to, "only the trainer lends its devices (placement.train.lend_to=rollout)"),
    ):
        if value:
            raise ConfigError(f"{key}={value}: {why}; neither runtime seats the trainer on rollout's devices: unset {key}")
    shared = ("placement.rollout.colocate_with", cfg.placement.rollout.colocate_with) if cfg.placement.rollout.colocate_with else ("placement.train.lend_to", cfg.placement.train.lend_to)
    if shared[1] and cfg.train.backend not in TIME_SHARES:
        raise ConfigError(
            f"{shared[0]}={shared[1]} time-shares the trainer's devices, and train.backend={cfg.train.backend!r} cannot park its state for a guest; "
            f"set train.backend to one of {', '.join(TIME_SHARES)}, or unset {shared[0]}"
        )
    if count > 1 and cfg.runtime.value == "local":
        raise ConfigError(f"placement.train.count={count} needs runtime=ray (a process per trainer rank); runtime=local trains in this one process: set runtime=ray or placement.train.count=1")
    if cfg.runtime.value == "local":
        rollouts = cfg.placement.rollout.count
        if rollouts > 1:
            raise ConfigError(f"placement.rollout.count={rollouts} needs runtime=ray (an actor per rollout instance); runtime=local runs one rollout engine in this process: set runtime=ray or placement.rollout.count=1")
        if cfg.placement.train.lend_to:
            raise ConfigError(
                f"placement.train.lend_to={cfg.placement.train.lend_to} (multiplexed: borrowed rollout instances beside rollout's own) needs runtime=ray; "
                "runtime=local runs one rollout engine in this process: set runtime=ray, or placement.rollout.colocate_with=train for that engine to take turns on the trainer's device"
            )


_FIXED_CONTEXT_ROPE = ("default", "llama3", "longrope", "su", "mrope")
"""RoPE types whose checkpoint's `max_position_embeddings` is already the whole context;
another type's `factor` stretches it (yarn, dynamic, linear), as vLLM derives its limit."""


def checkpoint_context(path: Path) -> tuple[int, str] | None:
    """The longest sequence the checkpoint at `path` was made for, and how its config.json
    says so; None where config.json cannot be read or names no `max_position_embeddings`
    (the model's load reports an unreadable one)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = (config.get("text_config") or config) if isinstance(config, dict) else {}  # a multimodal config nests the language model's
    positions = text.get("max_position_embeddings") if isinstance(text, dict) else None
    if not isinstance(positions, int) or isinstance(positions, bool) or positions < 1:
        return None
    rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    factor = rope.get("factor") if isinstance(rope, dict) and kind not in _FIXED_CONTEXT_ROPE else None
    if isinstance(factor, int | float) and not isinstance(factor, bool) and factor > 1:
        return int(positions * factor), f"max_position_embeddings={positions} x its {kind} RoPE factor {factor:g}"
    return positions, f"max_position_embeddings={positions}"


def check_context(cfg: RecipeConfig) -> None:
    """The longest sequence a run makes (`data.max_prompt_tokens`, longer prompts are
    dropped, + `rollout.max_new_tokens`; at most vLLM's `rollout.max_model_len`) fits the
    checkpoint's context: past it the model meets positions it was never trained at (the
    `hf` engine generates on with worse answers; vLLM refuses to start).

    Raises:
        ConfigError: naming the keys, their sum and the checkpoint's limit.
    """
    if not cfg.model.path:  # no checkpoint (the tiny model): no context to exceed
        return
    found = checkpoint_context(Path(cfg.model.path))
    if found is None:
        return
    limit, why = found
    where = f"the checkpoint's context ({why} in {str(Path(cfg.model.path) / 'config.json')!r})"
    served = cfg.rollout.max_model_len if cfg.rollout.backend == "vllm" else None
    if served is not None and served > limit:
        raise ConfigError(f"rollout.max_model_len={served} is longer than {where}: lower it, or leave it null (vLLM then serves the checkpoint's)")
    longest = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    if longest > limit and served is None:  # a max_model_len within the context caps each sequence there
        raise ConfigError(
            f"data.max_prompt_tokens={cfg.data.max_prompt_tokens} + rollout.max_new_tokens={cfg.rollout.max_new_tokens} = {longest} tokens "
            f"is longer than {where}: lower one of them (a model that was made for a longer context says so in its config.json)"
        )


@dataclasses.dataclass(frozen=True)
class RecipeEngineCheck:
    """What the recipe's engines need of a place that holds its roles: called with a device
    kind, it answers each role (rollout, train) whose engine cannot run there, and why
    (`engines.registry.missing`, from package metadata). Small and picklable: a Ray
    cluster's node probes run it on their nodes (`tools.cluster.check_cluster`)."""

    rollout: str
    train: str
    precision: str
    fake: bool
    lora_rank: int = 0

    @classmethod
    def of(cls, cfg: RecipeConfig, *, fake: bool) -> RecipeEngineCheck:
        return cls(rollout=cfg.rollout.backend, train=cfg.train.backend, precision=cfg.train.precision.value, fake=fake, lora_rank=cfg.train.lora_rank)

    def __call__(self, kind: str, *, here: str = "here") -> dict[str, str]:
        from tidal.engines.registry import missing, version  # noqa: PLC0415

        found = {
            "rollout": missing("rollout.backend", self.rollout, kind=kind, fake=self.fake, here=here),
            "train": missing("train.backend", self.train, kind=kind, fake=self.fake, precision=self.precision, here=here),
        }
        if found["train"] is None and self.lora_rank and version("peft") is None:  # LoRA adapters are peft's (`engines.lora`)
            found["train"] = f"train.lora_rank={self.lora_rank} needs peft, not installed {here} (pip install 'tidal-rl[lora]')"
        return {role: why for role, why in found.items() if why}


def check_engines_here(cfg: RecipeConfig, *, kind: str, fake: bool, plan: Plan | None = None) -> None:
    """The recipe's rollout and train engines can run in this machine's environment: their
    packages are installed, they compute on the device kind, and the train engine in
    `train.precision` there (`RecipeEngineCheck`). A local run's engines are built in this
    process, on its platform (`kind`, `fake`); a Ray run that starts a Ray of its own puts
    every actor on this machine, each role on the device kinds its `plan` gives it (on
    the platform's `kind` where the plan is made only once Ray runs).

    Raises:
        ConfigError: naming the key, the engine and what it lacks.
    """
    check = RecipeEngineCheck.of(cfg, fake=fake)
    for role in ("rollout", "train"):
        for on in sorted({a.kind for a in plan.of(role)}) if plan is not None else [kind]:
            if why := check(on).get(role):
                raise ConfigError(why)


def check_plan(cfg: RecipeConfig) -> Plan | None:
    """Make the recipe's plan now (and return it), as `tidal plan` does, where it can be made without Ray:
    the recipe lists its cluster (`cluster.nodes`), or a local run shares devices
    (`placement.rollout.colocate_with`, `placement.train.lend_to`); under `runtime: ray`
    also where each actor would sit (`flow.colocate.spots`). A Ray run without
    `cluster.nodes` plans against the cluster it joins, once it has.

    Raises:
        ConfigError: the plan is infeasible, naming the role, or shares devices in a way
            the Ray runtime cannot seat.
    """
    from tidal.tools.plan import check_seatable, make_plan, shares_devices  # noqa: PLC0415

    if not (cfg.cluster.nodes or (cfg.runtime.value == "local" and shares_devices(cfg))):
        return None
    plan, _ = make_plan(cfg)
    check_seatable(cfg, plan)
    return plan


def run_refusal(cfg: RecipeConfig, plan: Plan) -> str | None:
    """Why `tidal run` would refuse a recipe whose `plan` can be made, in its words (the
    message after `tidal run: error: `); None when it would run it.

    `tidal plan` still shows such a plan: a refusal is mostly about where roles sit (a
    guest or count a runtime cannot seat), which the plan's table shows. Checks `check_runnable`, then `tools.plan.check_seatable`, in the
    order `tidal run` does; not the platform, the run directory or a `resume`.
    """
    from tidal.tools.plan import check_seatable  # noqa: PLC0415

    try:
        check_runnable(cfg)
        check_seatable(cfg, plan)
    except ConfigError as e:
        return str(e)
    return None


NOT_WRITABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
"""Errors of a write to a folder that takes none (a read-only filesystem, no permission),
where freeing space would not help."""

PATH_KEYS = ("run_dir", "output_dir", "resume")
"""Keys naming folders: `prepare_run` makes them absolute."""
INPUT_KEYS = ("model.path", "reward_model.path", "critic.path", "data.train_files", "data.eval_files")
"""Keys naming the run's inputs (a folder, files or glob patterns): made absolute too."""


def _absolute(value: Any, *, home_only: bool = False) -> Any:
    """A path, or each of a list of paths or glob patterns, with a leading `~` expanded
    (the shell leaves it in `model.path=~/...`) and made absolute against the current
    directory (not following links); `home_only`: the `~` expanded, nothing else. None and ""
    as they are."""

    def one(path: str) -> str:
        path = os.path.expanduser(path)
        return path if home_only else os.path.abspath(path)

    if isinstance(value, str):
        return one(value) if value else value
    return None if value is None else [one(v) for v in value]


def _make_paths_absolute(cfg: RecipeConfig, *, home_only: bool = False) -> None:
    """Each of PATH_KEYS and INPUT_KEYS that is set, with a leading `~` expanded and made
    absolute against the current directory (`home_only`: the `~` expanded, nothing else):
    the config goes into config.yaml, which a later `resume=` reads from anywhere, and under
    `runtime: ray` to actors whose working directory (on other nodes, in Ray's session
    folder) is not this one, which would resolve a relative path elsewhere."""
    for key in (*PATH_KEYS, *INPUT_KEYS):
        *section, name = key.split(".")
        owner = getattr(cfg, section[0]) if section else cfg
        setattr(owner, name, _absolute(getattr(owner, name), home_only=home_only))


def prepare_run(recipe: Path, overrides: Sequence[str]) -> tuple[Any, Path]:
    """Validate `recipe` + `overrides`, select the platform, write the run directory.

    `run_dir`, `output_dir` and `resume` are made absolute before config.yaml is written
    (`_make_paths_absolute`): it and the returned config name the folders the user meant
    from here, wherever they are read.

    Raises:
        ConfigError: a bad key or value, a combination `tidal run` cannot run, a plan
            that cannot be placed (`check_plan`), or a `resume` that cannot continue
            (`resume_changes`, or a checkpoint file missing or damaged: `check_checkpoint`),
            or a run directory that cannot be made or written (read-only, no permission);
            the CLI exits with code 2.
        PlatformError: the platform the recipe or TIDAL_DEVICE asks for cannot load.
    """
    from tidal.hal import init_platform  # noqa: PLC0415 - imports torch

    cfg = load_config(recipe, overrides)
    _make_paths_absolute(cfg, home_only=True)  # `~` before anything reads them; the rest after the checks
    check_runnable(cfg)
    resume_changes(cfg)
    selection = init_platform(cfg.device)
    if cfg.runtime.value == "local":  # its engines are built in this process
        check_engines_here(cfg, kind=selection.platform.descriptor.kind, fake=selection.platform.descriptor.fake)
    plan = check_plan(cfg)
    if cfg.runtime.value == "ray" and not cfg.cluster.fake and ray_address() is None:
        # a Ray of its own, on this machine: its actors find this environment. A cluster it
        # joins is checked node by node when it has joined (`tools.cluster.refuse_bad_cluster`);
        # fake devices compute on CPU, where a production recipe's engines cannot: `--check`
        # of such a recipe on fake platforms checks its config and plan.
        check_engines_here(cfg, kind=selection.platform.descriptor.kind, fake=False, plan=plan)
    if cfg.resume:  # its files, before the run directory is made (and under --check)
        from tidal.engines.models import model_source  # noqa: PLC0415
        from tidal.tools.checkpoint import check_checkpoint  # noqa: PLC0415 - imports transformers

        check_checkpoint(latest_checkpoint(Path(cfg.resume)), source=model_source(cfg.model), train=cfg.train)
    selection.platform.seed_all(cfg.seed)
    key = "run_dir" if cfg.run_dir else "output_dir"
    asked = getattr(cfg, key)
    cfg.run_dir = str(_new_run_dir(cfg))
    _make_paths_absolute(cfg)  # after the checks, whose errors name the folders as the user wrote them
    run_dir = Path(cfg.run_dir)
    try:
        write_whole(run_dir / "config.yaml", to_yaml(cfg))
    except OSError as e:  # an existing run_dir this process may not write: a full disk's advice (free space) would mislead
        if e.errno not in NOT_WRITABLE:
            raise
        raise ConfigError(f"{key}={asked!r}: cannot write the run directory {str(run_dir)!r} ({e.strerror}); choose a writable run_dir or output_dir") from None
    platform_info = {
        "spec": selection.spec,
        "chosen_by": selection.chosen_by,
        "reason": selection.reason,
        "descriptor": selection.platform.descriptor.to_dict(),
    }
    write_whole(run_dir / "platform.json", json.dumps(platform_info, indent=2) + "\n")
    return cfg, run_dir
