"""Every engine, model source and task tidal can build, by the name a recipe gives it.

torchtitan's `TrainSpec` shape: a name maps to its builder, and tools/ composes a run from
names (`rollout.backend`, `train.backend`, `model.source`, `task.name`) without naming a
concrete class. Entries are `module:attribute` strings, imported only when a run builds
them, so checking a recipe's names (before any run directory is made) imports nothing
heavy. A new backend is one module plus one line here.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
from typing import Any

ROLLOUT = {"hf": "tidal.engines.hf_rollout:HFRolloutEngine", "vllm": "tidal.engines.vllm_rollout:VLLMRolloutEngine"}
"""rollout.backend -> adapter class (`vllm` needs vLLM installed where the rollout runs; it is
built from the checkpoint directory: its class's `builds_from_checkpoint`)."""
TRAIN = {"torch": "tidal.engines.torch_train:TorchTrainEngine", "fsdp": "tidal.engines.fsdp_train:FSDPTrainEngine", "deepspeed": "tidal.engines.deepspeed_train:DeepSpeedTrainEngine", "megatron": "tidal.engines.megatron_train:MegatronTrainEngine"}
"""train.backend -> adapter class."""
MULTI_RANK = {"fsdp": "tidal.engines.fsdp_lead:follow", "deepspeed": "tidal.engines.deepspeed_lead:follow", "megatron": "tidal.engines.megatron_lead:follow"}
"""train.backend values that train over several processes, one per `placement.train` instance
-> what every rank but 0 runs (`follow(share)`, until rank 0's `stop_followers()`; `follower`)."""
TIME_SHARES = ("torch", "fsdp", "deepspeed", "megatron")
"""train.backend values whose engine parks its state for a rollout guest on its devices and
takes it back (`flow.colocate`): the ones a colocated or multiplexed layout can use."""
KL_REFERENCE = ("torch", "fsdp", "deepspeed", "megatron")
"""train.backend values whose engine holds a frozen reference policy (`kl_reference=True`):
the ones a loss with `algorithm.kl_coef > 0` can use."""
LORA = ("torch", "fsdp", "deepspeed")
"""train.backend values whose engine trains LoRA adapters (`train.lora_rank` > 0; `engines.lora`)."""
CRITIC = {
    "torch": "tidal.engines.critic:Critic",
    "fsdp": "tidal.engines.fsdp_critic:FSDPCritic",
    "deepspeed": "tidal.engines.deepspeed_critic:DeepSpeedCritic",
    "megatron": "tidal.engines.fsdp_critic:FSDPCritic",  # megatron-core holds the policy; the value model is a transformers one, FSDP2-sharded
}
"""train.backend values that train a critic beside the policy (`algorithm.advantage=gae`), and
the values of `critic.backend` (another backend's critic than the train backend's own) ->
its class, built as `cls(start_model, head=..., lr=..., ...)` (and the `train.*` keys it
takes: `TakesTrainKeys`) on rank 0 (a multi-rank one leads the other ranks, whose `follow()`
builds theirs: `fsdp_lead.follow_engines`). Their train engines give a batch's logprobs under
the KL reference too (`LogprobsUnderReference`), which `algorithm.kl_in_reward` (gae only) reads."""
MODEL_SOURCES = {"tiny": "tidal.engines.models:TinySource", "hf": "tidal.engines.models:HFSource"}
"""model.source -> `ModelSource` class, built from the recipe's `model` section."""
TASKS = {"arithmetic": "tidal.engines.tasks:ARITHMETIC", "countdown": "tidal.engines.tasks:COUNTDOWN"}
"""task.name -> `TaskSpec` of a generated task (prompts from data files need no task: `data.train_files`)."""
REGISTRIES = {"rollout.backend": ROLLOUT, "train.backend": TRAIN, "model.source": MODEL_SOURCES, "task.name": TASKS}
"""Recipe key -> its registry."""
CHECKED_ON_LOAD = ("rollout.backend", "train.backend", "model.source")
"""Keys whose names a recipe must get right to load at all (`tidal config` shows a recipe
whose `task.name` is unknown; `tidal run` refuses it)."""


def unknown(key: str, value: str) -> str | None:
    """An error message naming `key` when `value` is not registered under it, else None."""
    registry = REGISTRIES[key]
    if value in registry:
        return None
    return f"{key}={value!r} is not available in this version; choices: {', '.join(sorted(registry))}"


def load(key: str, value: str) -> Any:
    """What `value` is registered as under `key` (imported now).

    Raises:
        ValueError: naming `key`, when `value` is not registered.
    """
    message = unknown(key, value)
    if message:
        raise ValueError(message)
    return imported(REGISTRIES[key][value])


def critic_class(backend: str) -> Any:
    """The critic class of the train backend `backend` (`CRITIC`), imported now."""
    return imported(CRITIC[backend])


def follower(backend: str) -> Any:
    """The function every rank but 0 of a `backend` train group runs (`MULTI_RANK`), imported now."""
    return imported(MULTI_RANK[backend])


def imported(entry: str) -> Any:
    """What a `module:attribute` entry names, its module imported now."""
    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclasses.dataclass(frozen=True)
class Needs:
    """What an engine needs to run on a machine: Python distributions, and platform kinds."""

    packages: tuple[str, ...] = ()
    """Distributions (as pip names them) it imports, on every platform."""
    kinds: tuple[str, ...] = ("cpu", "cuda", "npu")
    """Platform kinds it computes on (a fake platform computes on CPU)."""
    on_kind: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    """Further distributions it needs on one kind (vLLM's Ascend plugin on NPUs)."""
    extra: str = ""
    """The `tidal-rl` extra that installs its packages."""
    host_precisions: tuple[str, ...] = ("fp32", "bf16")
    """`train.precision`s it trains in where it computes on the host (a cpu or fake platform)."""


NEEDS = {
    ("rollout.backend", "vllm"): Needs(packages=("vllm",), kinds=("cuda", "npu"), on_kind={"npu": ("vllm-ascend",)}, extra="vllm"),
    ("train.backend", "deepspeed"): Needs(packages=("deepspeed",), extra="deepspeed"),
    ("train.backend", "megatron"): Needs(packages=("megatron-core",), on_kind={"npu": ("mindspeed",)}, extra="megatron", host_precisions=("fp32",)),  # hal.megatron.check_precision
}
"""(recipe key, name) -> what that engine needs beyond tidal's own dependencies (the others
need nothing more and run on every platform)."""


def needs(key: str, name: str) -> Needs:
    """What the engine registered as `name` under `key` needs (`NEEDS`, else nothing more)."""
    return NEEDS.get((key, name), Needs())


def missing(key: str, name: str, *, kind: str, fake: bool = False, precision: str | None = None, here: str = "here") -> str | None:
    """Why the engine `name` under `key` cannot run here, on a platform of `kind` (`fake`: a
    fake platform, which computes on CPU), in `precision` (`train.precision`, for a train
    engine), from package metadata alone (imports nothing); None when it can. `here`: how
    the answer names the place it was asked (a cluster node's probe: "on that node")."""
    need = needs(key, name)
    computes_on = "cpu" if fake else kind
    where = f"a fake {kind} platform, which computes on CPU" if fake else f"a {kind} platform"
    if computes_on not in need.kinds:
        return f"{key}={name} runs on {' or '.join(need.kinds)} devices, not on {where}"
    absent = [p for p in (*need.packages, *need.on_kind.get(computes_on, ())) if version(p) is None]  # a fake NPU computes on CPU: no Ascend plugin
    if absent:
        hint = f" (pip install 'tidal-rl[{need.extra}]')" if need.extra and set(absent) & set(need.packages) else ""
        return f"{key}={name} needs {', '.join(absent)}, not installed {here}{hint}"
    if precision is not None and computes_on == "cpu" and precision not in need.host_precisions:
        return f"train.precision={precision}: {key}={name} trains in {' or '.join(need.host_precisions)} on {where}; set train.precision={need.host_precisions[0]}"
    return None


def version(distribution: str) -> str | None:
    """The installed version of `distribution`, or None (package metadata: imports nothing)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
