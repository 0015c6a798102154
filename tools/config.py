"""Typed recipe configuration: OmegaConf structured configs built from dataclasses.

The dataclasses are the source of truth; a recipe YAML is only data. Every field has a
docstring (the string literal under it), which `tidal config --keys` prints and a test
checks (`config_keys` reads them). Loading merges schema defaults <- recipe file <-
`key=value` overrides, and turns OmegaConf's errors into `ConfigError`s that name the
key: an unknown key comes with close matches, a wrong type with the expected type and
the value given.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from tidal.engines import tasks
from tidal.tools.config_keys import iter_keys, key_type


class ConfigError(ValueError):
    """A user mistake in a recipe or an override; the CLI prints it and exits with code 2."""


class Runtime(enum.Enum):
    local = "local"
    ray = "ray"


class Precision(enum.Enum):
    """Compute precisions of the train engines (`Platform.autocast`). No fp16: it needs
    loss scaling, which the engines do not do."""

    fp32 = "fp32"
    bf16 = "bf16"


class Attention(enum.Enum):
    """transformers attention implementations the tiny model runs with."""

    sdpa = "sdpa"
    eager = "eager"


@dataclasses.dataclass
class ModelConfig:
    """The policy model. The CPU recipes build a tiny Qwen2-architecture model locally."""

    hidden_size: int = 128
    """Width of the tiny model."""
    num_layers: int = 2
    """Transformer layers of the tiny model."""
    num_heads: int = 4
    """Attention heads."""
    num_kv_heads: int = 2
    """Key/value heads (grouped-query attention)."""
    intermediate_size: int = 256
    """MLP width."""
    max_positions: int = 64
    """Longest sequence (prompt + answer) in tokens: at least the task's longest prompt (and <bos>) plus `rollout.max_new_tokens`."""
    attention: Attention = Attention.sdpa
    """transformers attention implementation: sdpa (torch's fused kernels) or eager (plain
    matmuls: faster on CPU for sequences of a few tokens, where the fused CPU kernel's
    per-call cost dominates)."""


@dataclasses.dataclass
class TaskConfig:
    """What the policy learns: prompts and the verifier that scores answers."""

    name: str = "arithmetic"
    """Prompt generator: arithmetic | countdown."""
    reward: str = ""
    """Reward: a registry name (arithmetic, countdown, exact_match) or `module:function` (from the Python path, then the current directory); empty = the task's own."""
    max_value: int = 20
    """Largest operand of arithmetic prompts."""
    ops: str = "+-"
    """Operators arithmetic prompts use."""
    num_numbers: int = 3
    """Numbers in a countdown prompt (each used once to reach its target)."""
    max_number: int = 10
    """Largest number of countdown prompts (numbers are 1..max_number)."""
    num_eval_prompts: int = 200
    """Held-out prompts (drawn with another seed) for the accuracy reported before and after RL."""
    exclude_eval_prompts: bool = False
    """Never train on a problem of the evaluation set (countdown: the same numbers, in any order, and target; use for tasks with many distinct prompts)."""


@dataclasses.dataclass
class SFTConfig:
    """Supervised warm start, so RL begins with some signal."""

    steps: int = 150
    """Optimizer steps of supervised training on prompt + answer (0 = none)."""
    batch_size: int = 64
    """Examples per supervised step."""
    lr: float = 3e-3
    """Learning rate of the warm start."""


@dataclasses.dataclass
class RolloutConfig:
    """The rollout engine."""

    backend: str = "hf"
    """Rollout adapter: hf (a transformers model sampled with a KV cache, any platform)."""
    temperature: float = 1.0
    """Sampling temperature (behavior logprobs are computed at it)."""
    max_new_tokens: int = 6
    """Generated-token budget per sample."""
    chunk_tokens: int = 3
    """Tokens decoded between safe points, where new weights may be applied (partial rollout)."""
    prompts_per_generate: int = 16
    """Prompts (times group_size samples) per generate batch."""
    threads: int = 0
    """torch intra-op threads of the rollout stage; 0 = the run's `threads`."""


@dataclasses.dataclass
class TrainConfig:
    """The train engine."""

    backend: str = "torch"
    """Train adapter: torch (plain torch, one process) | fsdp (FSDP2, a process per placement.train instance)."""
    lr: float = 1e-3
    """AdamW learning rate of the RL phase."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Gradient norm clip."""
    max_nonfinite_steps: int = 5
    """Optimizer steps in a row whose gradient norm is NaN or infinite that are skipped (weights and optimizer state kept, the step still counts) before the run stops with an error; 0 = stop at the first."""
    micro_batch_size: int = 64
    """Sequences per forward/backward (gradients accumulate over a step)."""
    threads: int = 0
    """torch intra-op threads of the train stage; 0 = the run's `threads`."""
    precision: Precision = Precision.fp32
    """Compute precision of the RL phase's forward passes: fp32 | bf16 (matmuls in bf16 under the platform's autocast; weights, gradients, optimizer state and logprobs stay fp32; the warm start stays fp32)."""


@dataclasses.dataclass
class AlgorithmConfig:
    """The RL algorithm and its staleness bound."""

    num_steps: int = 30
    """Optimizer steps of RL."""
    prompts_per_step: int = 8
    """Prompts per optimizer step."""
    group_size: int = 8
    """Samples per prompt (GRPO group)."""
    max_staleness: int = 1
    """A sample from version v is trainable by versions v .. v + max_staleness; 0 = synchronous on-policy."""
    advantage: str = "grpo"
    """Advantage estimator: grpo | grpo_no_std | rloo | dr_grpo."""
    clip_low: float = 0.2
    """PPO clip below 1."""
    clip_high: float = 0.28
    """PPO clip above 1 (clip-higher when larger than clip_low)."""
    aggregation: str = "token_mean"
    """Loss aggregation: token_mean | seq_mean_token_mean | seq_mean_token_sum | token_sum_norm."""
    decoupled: bool = True
    """Decoupled PPO: ratio against the trainer's weights before the step (its own logprobs, no extra pass), weighted by behavior IS."""
    tis_cap: Optional[float] = 2.0
    """Truncate the behavior importance weight at this value (truncated IS); null = no cap."""
    kl_coef: float = 0.0
    """KL penalty to the initial (warm-started) policy, a frozen copy the train engine keeps
    (and checkpoints); 0 = none. train.backend=torch only."""


@dataclasses.dataclass
class NodeConfig:
    """Nodes of one shape in the cluster."""

    name: str = "node"
    """Node name; with count > 1 the nodes are named <name>-0, <name>-1, ..."""
    kind: str = "cpu"
    """Device kind of the node: cuda | npu | cpu."""
    devices: int = 1
    """Devices per node (for cpu nodes: processes that may run one role instance each)."""
    tags: list[str] = dataclasses.field(default_factory=list)
    """Extra tags the devices carry (their kind is a tag already; cuda devices also carry `gpu`)."""
    count: int = 1
    """How many such nodes."""


@dataclasses.dataclass
class ClusterConfig:
    """The devices a run may use (`tidal plan` shows what goes where)."""

    nodes: list[NodeConfig] = dataclasses.field(default_factory=list)
    """Nodes and their devices; empty = discovered (Ray's nodes under runtime ray, else this machine)."""
    fake: bool = False
    """Each process runs the fake:<kind>:<n> platform of its placement (CPU tensors): CI runs of NPU/GPU layouts."""


@dataclasses.dataclass
class RoleConfig:
    """Where one role's instances go."""

    requires: list[str] = dataclasses.field(default_factory=list)
    """Tags every device of an instance must carry, e.g. [npu] or [gpu, h100]; empty = any NPU or GPU, or any device on a cluster without them (CPU nodes of a cluster with NPUs or GPUs serve only roles that require [cpu])."""
    count: int = 1
    """Instances of the role (engine replicas or data-parallel ranks)."""
    devices_each: int = 1
    """Devices per instance, all on one node."""
    colocate_with: Optional[str] = None
    """Time-share that role's devices (colocated); instances beyond them take free devices (hybrid)."""
    lend_to: Optional[str] = None
    """While this role waits for data, its devices run instances of that role (multiplexed)."""


@dataclasses.dataclass
class TransportConfig:
    """How new weights travel from the trainer to rollout (runtime ray)."""

    name: str = "auto"
    """auto | ipc | collective | host; auto picks from the two platforms: ipc on one node (any two CPU processes of it; CUDA only colocated), else collective for one vendor, else host (NPU <-> GPU)."""
    bucket_mb: int = 16
    """Bucket size in MB: the unit that is copied off the device while the previous one is sent."""
    overlap: bool = False
    """The trainer stops waiting for the rollout actors to receive (rollout still waits for the
    version its prompts need). Over ipc the trainer's weights live in the shared buffer (the
    `torch` engine: a publish copies nothing, only announces the version, and the engine waits
    for the answers before its next optimizer step; `runtime.json`'s `weights_in_place`), or
    are written into it and announced, the answers collected before the next one; over
    collective and host it is sent from a copy on a thread of its own while the trainer takes
    its next step (one copy of the model on the trainer's device). Not with a rollout that
    time-shares the trainer's devices (a weight pass must end inside its turn)."""


@dataclasses.dataclass
class PlacementConfig:
    """Which devices each role uses; kept apart from the algorithm's settings."""

    train: RoleConfig = dataclasses.field(default_factory=RoleConfig)
    """The trainer."""
    rollout: RoleConfig = dataclasses.field(default_factory=RoleConfig)
    """The rollout engines."""


@dataclasses.dataclass
class FaultConfig:
    """What a `runtime: ray` run does when one of its actors dies."""

    rollout_restarts: int = 3
    """How many times Ray restarts each dead rollout actor; it takes the current weights and continues, and the prompts it held are generated again."""
    trainer_restarts: int = 1
    """How many times a dead trainer actor is started again; it resumes from the run's last checkpoint (weights, optimizer, data, store)."""


@dataclasses.dataclass
class RecipeConfig:
    """A tidal recipe: what to run, on which platform, and where its files go."""

    name: str = "run"
    """Short name of the run; the default run directory is `<output_dir>/<name>-<timestamp>`."""
    description: str = ""
    """One line saying what this recipe trains; `tidal doctor` lists it."""
    device: str = "auto"
    """Platform: auto | cpu | cuda | npu | fake:<kind>:<n>. The TIDAL_DEVICE variable overrides it."""
    runtime: Runtime = Runtime.local
    """Where roles run: `local` (one process) or `ray` (actors on a Ray cluster)."""
    seed: int = 0
    """Seed for Python, NumPy, torch and every device generator."""
    output_dir: str = "runs"
    """Folder under which run directories are created."""
    run_dir: Optional[str] = None
    """Directory for this run's files (resolved config, metrics, checkpoints); must be new or empty."""
    resume: Optional[str] = None
    """A previous run directory to continue from its last checkpoint (weights, optimizer, data, version, RNG, store); its model's shape is kept."""
    checkpoint_every: int = 10
    """Save a checkpoint every this many RL steps (and always at the end)."""
    keep_checkpoints: int = 0
    """How many of the newest checkpoints to keep; older ones are deleted once a newer one is complete. 0 = keep all."""
    lease_s: float = 3600.0
    """Seconds a stage may hold rows it took from the store before they are handed out again.
    Must outlast any generation and two train steps; a stage that dies gives its rows back
    at once, so this only frees rows that a hung one holds."""
    tensorboard: bool = True
    """Also write each step's metrics as TensorBoard scalars to run_dir/tensorboard, when the tensorboard package is installed."""
    threads: int = 0
    """torch intra-op threads of the RL stages (rollout and training); 0 = torch's default.
    `rollout.threads` and `train.threads` set one stage's. The warm start and the evaluations
    run alone and always get torch's default: every core in one process; under `runtime: ray`
    the trainer actor's CPUs (Ray sets `OMP_NUM_THREADS` to them, 1 on the CPU quickstart)."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """The policy model."""
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    """Prompts and reward."""
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)
    """Supervised warm start."""
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    """Rollout engine."""
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    """Train engine."""
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    """RL algorithm and staleness bound."""
    cluster: ClusterConfig = dataclasses.field(default_factory=ClusterConfig)
    """Nodes and devices (empty = discovered)."""
    placement: PlacementConfig = dataclasses.field(default_factory=PlacementConfig)
    """Which devices each role uses."""
    transport: TransportConfig = dataclasses.field(default_factory=TransportConfig)
    """Weight transport from trainer to rollout."""
    fault: FaultConfig = dataclasses.field(default_factory=FaultConfig)
    """Restarts after an actor dies (`runtime: ray`)."""


# ---------------------------------------------------------------------------------------
# Loading.


def _explain(err: OmegaConfBaseException, schema: type, origin: str, given: DictConfig, *, prefix: str = "") -> ConfigError:
    """A `ConfigError` for OmegaConf's `err` while merging `given` (the recipe file's or
    the overrides' keys, as the user wrote them) into `schema`; `prefix` is where `given`
    sits in the recipe (`cluster.nodes[1].` for a list entry)."""
    key = str(getattr(err, "full_key", "") or getattr(err, "key", "") or "")
    if isinstance(err, ConfigKeyError) or "not in" in str(err):
        key = _first_written_leaf(given, key)  # OmegaConf names the unknown node: `algoritm` of `algoritm.num_steps`
        known = [k.key for k in iter_keys(schema)]
        close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
        if not close:  # A typo in the last part only: compare leaf names too.
            leaf = key.rsplit(".", 1)[-1]
            close = [k for k in known if difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1]], cutoff=0.7)]
        hint = f"; did you mean {' or '.join(repr(prefix + c) for c in close[:3])}?" if close else ""
        return ConfigError(f"unknown key {prefix + key!r} in {origin}{hint} (`tidal config --keys` lists every key)")
    if isinstance(err, ValidationError):
        expected = key_type(schema, key) or "another type"
        return ConfigError(f"key {prefix + key!r} in {origin} expects {expected}, got {_given_value(err)}")
    return ConfigError(f"{origin}: {err}")


def _misplaced(schema: type, given: Any, *, origin: str, prefix: str = "") -> ConfigError | None:
    """The first mistake in `given` (a mapping, as the user wrote it) that OmegaConf reports
    without its key: a section (`algorithm`) or list entry (`cluster.nodes[0]`) given
    something other than a mapping, or a bad key of a list entry (`cluster.nodes[1].devices`)."""
    tree = OmegaConf.to_container(given, resolve=False) if isinstance(given, DictConfig) else given
    hints = typing.get_type_hints(schema)
    for name, value in tree.items():
        tp = hints.get(name)
        args = typing.get_args(tp)
        item = args[0] if typing.get_origin(tp) is list and args else None
        if dataclasses.is_dataclass(tp):
            entries = [(f"{prefix}{name}", tp, value)]
        elif dataclasses.is_dataclass(item) and isinstance(value, list):
            entries = [(f"{prefix}{name}[{i}]", item, entry) for i, entry in enumerate(value)]
        else:
            continue
        for key, cls, entry in entries:
            if not isinstance(entry, dict):
                fields = ", ".join(f.name for f in dataclasses.fields(cls))
                return ConfigError(f"key {key!r} in {origin} expects a mapping of its keys ({fields}), got {entry!r} of type {type(entry).__name__}")
            if mistake := _misplaced(cls, entry, origin=origin, prefix=key + "."):
                return mistake
            if cls is item:  # OmegaConf checks a list's entries apart from the list, and names their keys without it
                try:
                    OmegaConf.merge(OmegaConf.structured(cls), entry)
                except OmegaConfBaseException as e:
                    return _explain(e, cls, origin, OmegaConf.create(entry), prefix=key + ".")
    return None


def _first_written_leaf(given: DictConfig, key: str) -> str:
    """The first full key the user wrote at or under `key` (`key` itself when it is a value)."""
    try:
        node = OmegaConf.select(given, key, default=None, throw_on_missing=False) if key else None
    except OmegaConfBaseException:  # e.g. an interpolation that does not resolve: name the node
        return key
    tree = OmegaConf.to_container(node, resolve=False) if isinstance(node, DictConfig) else None
    while isinstance(tree, dict) and tree:
        name, tree = next(iter(tree.items()))
        key = f"{key}.{name}"
    return key


def _given_value(err: ValidationError) -> str:
    msg = str(err).splitlines()[0]
    # OmegaConf messages look like "Value 'abc' of type 'str' could not be converted to Integer".
    if msg.startswith("Value '"):
        end = msg.find("' of type '")
        if end > 0:
            value_type = msg[end + len("' of type '") :].split("'", 1)[0]
            return f"{msg[len('Value ') : end + 1]} of type {value_type}"
    if msg.startswith("Invalid value '"):
        return msg[len("Invalid value ") :].split(",", 1)[0]
    return f"a value it cannot hold ({msg})"


def parse_overrides(overrides: Sequence[str]) -> DictConfig:
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not key=value (for example seed=1)")
    try:
        return OmegaConf.from_dotlist(list(overrides))
    except (OmegaConfBaseException, yaml.YAMLError) as e:
        bad = next((item for item in overrides if not _parses(item)), None)  # name the one at fault
        if bad is not None:
            key, _, value = bad.partition("=")
            first = str(e).strip().splitlines()[0]
            raise ConfigError(f"{key}={value}: the value is not valid YAML ({first}); quote it, for example {key}='{value}'") from None
        raise ConfigError(f"cannot parse overrides {list(overrides)}: {e}") from e


def _parses(item: str) -> bool:
    try:
        OmegaConf.from_dotlist([item])
    except (OmegaConfBaseException, yaml.YAMLError):
        return False
    return True


def load_config(path: str | Path | None, overrides: Sequence[str] = (), *, schema: type = RecipeConfig) -> Any:
    """Merge schema defaults, the recipe file and overrides; validate; return the config.

    Raises:
        ConfigError: naming the file or override, the key, and what is wrong with it.
    """
    cfg = OmegaConf.structured(schema)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"recipe file {str(path)!r} does not exist")
        try:
            data = OmegaConf.load(path)
        except Exception as e:  # noqa: BLE001 - YAML errors come in many types
            raise ConfigError(f"recipe {str(path)!r} is not valid YAML: {e}") from e
        if not isinstance(data, DictConfig):
            raise ConfigError(f"recipe {str(path)!r} must be a mapping of keys to values")
        try:
            cfg = OmegaConf.merge(cfg, data)
        except OmegaConfBaseException as e:
            origin = f"recipe {str(path)!r}"
            raise _misplaced(schema, data, origin=origin) or _explain(e, schema, origin, data) from None
    if overrides:
        given = parse_overrides(overrides)
        try:
            cfg = OmegaConf.merge(cfg, given)
        except OmegaConfBaseException as e:
            origin = "the command-line overrides"
            raise _misplaced(schema, given, origin=origin) or _explain(e, schema, origin, given) from None
    try:
        OmegaConf.resolve(cfg)  # ${...} interpolations, now: one that cannot resolve names its key here
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        raise ConfigError(f"{key or 'an interpolation'}: {str(e).strip().splitlines()[0]}") from None
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"required keys have no value: {missing}")
    _check_values(cfg)
    _check_strings(cfg, schema)
    return cfg


def stage_threads(cfg: Any, stage: str) -> int:
    """torch intra-op threads of an RL stage ("rollout" or "train"): its own `threads`, else
    the run's (0: torch's default)."""
    return getattr(cfg, stage).threads or cfg.threads


_AT_LEAST = {
    "seed": 0, "threads": 0, "checkpoint_every": 1, "keep_checkpoints": 0,
    "model.hidden_size": 1, "model.num_layers": 1, "model.num_heads": 1, "model.num_kv_heads": 1, "model.intermediate_size": 1, "model.max_positions": 2,
    "task.num_eval_prompts": 1, "task.num_numbers": 1, "task.max_number": 1, "sft.steps": 0, "sft.batch_size": 1,
    "rollout.max_new_tokens": 1, "rollout.chunk_tokens": 1, "rollout.prompts_per_generate": 1, "rollout.threads": 0,
    "train.micro_batch_size": 1, "train.weight_decay": 0, "train.threads": 0, "train.max_nonfinite_steps": 0, "cluster.nodes[].count": 1,
    "algorithm.num_steps": 1, "algorithm.prompts_per_step": 1, "algorithm.group_size": 2, "algorithm.max_staleness": 0,
    "algorithm.clip_low": 0, "algorithm.clip_high": 0, "algorithm.kl_coef": 0,
    "transport.bucket_mb": 1, "fault.rollout_restarts": 0, "fault.trainer_restarts": 0,
    "placement.train.count": 1, "placement.train.devices_each": 1, "placement.rollout.count": 1, "placement.rollout.devices_each": 1,
}
"""Recipe keys and their smallest valid value (checked when a recipe loads, not mid-run); `a[].b`: b of each entry of list a."""
_POSITIVE = ("rollout.temperature", "train.lr", "sft.lr", "train.grad_clip", "algorithm.tis_cap", "lease_s")
"""Recipe keys that must be > 0 when set."""
_WHY = {
    "algorithm.group_size": "every advantage estimator compares a prompt's samples with each other, so one sample learns nothing",
    "rollout.temperature": "rollout samples, and its behavior logprobs are taken at this temperature",
    "train.grad_clip": "gradients are clipped to this norm",
    "algorithm.tis_cap": "the importance weight is truncated at it; null for no cap",
}


def _check_values(cfg: Any) -> None:
    """Checks a type cannot express, each naming its key."""
    from tidal.hal.select import check_spec  # noqa: PLC0415 - only recipes with a device need it

    from tidal.tools.backends import REGISTRIES, unknown  # noqa: PLC0415

    if "device" in cfg:
        try:
            check_spec(cfg.device, source="device")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if "transport" in cfg and cfg.transport.name not in ("auto", "ipc", "collective", "host"):
        raise ConfigError(f"transport.name={cfg.transport.name!r} is not one of auto, ipc, collective, host")
    for name, value in (item for key in (*_AT_LEAST, *_POSITIVE) for item in _selected(cfg, key)):
        if isinstance(value, float) and not math.isfinite(value):  # nan passes every comparison below
            raise ConfigError(f"{name}={value} must be a finite number")
    for key, least in _AT_LEAST.items():
        for name, value in _selected(cfg, key):
            if value is not None and value < least:
                raise ConfigError(f"{name}={value} must be >= {least}" + (f": {_WHY[key]}" if key in _WHY else ""))
    for key in _POSITIVE:
        value = OmegaConf.select(cfg, key)
        if value is not None and value <= 0:
            raise ConfigError(f"{key}={value} must be > 0" + (f": {_WHY[key]}" if key in _WHY else ""))
    if "model" in cfg and "num_kv_heads" in cfg.model:
        m = cfg.model
        if m.hidden_size % m.num_heads or m.num_heads % m.num_kv_heads:
            raise ConfigError(f"model.hidden_size={m.hidden_size}, model.num_heads={m.num_heads}, model.num_kv_heads={m.num_kv_heads}: hidden_size must be a multiple of num_heads, and num_heads of num_kv_heads")
    if "algorithm" in cfg:
        from tidal.flow.algorithms import ADVANTAGES, AGGREGATIONS  # noqa: PLC0415

        for key, names in (("advantage", ADVANTAGES), ("aggregation", AGGREGATIONS)):
            if key in cfg.algorithm and cfg.algorithm[key] not in names:
                raise ConfigError(f"algorithm.{key}={cfg.algorithm[key]!r} is not one of {', '.join(names)}")
        if "rollout" in cfg:
            loss_config(cfg)  # every bound of the loss, now rather than after the warm start
    for key in REGISTRIES:
        section, _, field = key.partition(".")
        if section in cfg and (message := unknown(key, cfg[section][field])):
            raise ConfigError(message)
    if all(section in cfg for section in ("task", "model", "rollout")):
        _check_lengths(cfg)


def _selected(cfg: Any, key: str) -> list[tuple[str, Any]]:
    """(full key, value) of `key`, or of each list entry's field for `a[].b` (`a[0].b`, ...)."""
    head, sep, field = key.partition("[].")
    if not sep:
        return [(key, OmegaConf.select(cfg, key))]
    return [(f"{head}[{i}].{field}", entry[field]) for i, entry in enumerate(OmegaConf.select(cfg, head) or ())]


def _check_strings(cfg: Any, schema: type, prefix: str = "") -> None:
    """Every entry of a list-of-strings key is a string (OmegaConf lets a mapping in)."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if f.name not in cfg:
            continue
        tp, value, key = hints[f.name], cfg[f.name], prefix + f.name
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list and typing.get_args(tp) else None
        if dataclasses.is_dataclass(tp):
            _check_strings(value, tp, key + ".")
        elif dataclasses.is_dataclass(item):
            for i, entry in enumerate(value or ()):
                _check_strings(entry, item, f"{key}[{i}].")
        elif item is str and (bad := [v for v in value or () if not isinstance(v, str)]):
            raise ConfigError(f"{key} holds {bad[0]!r}: {f.name} are strings")


def longest_prompt(cfg: Any) -> int | None:
    """Tokens of the longest prompt the recipe's task can draw, <bos> included (the
    character tokenizer: a token per character); None for a task without a known bound."""
    keys = tasks.PROMPT_PARAMS.get(cfg.task.name, ())
    chars = tasks.longest_prompt(cfg.task.name, {k: cfg.task[k] for k in keys})
    return None if chars is None else 1 + chars


def _check_lengths(cfg: Any) -> None:
    """`model.max_positions` holds the longest sequence: the longest prompt and every token rollout may add."""
    prompt = longest_prompt(cfg)
    if prompt is None:
        return
    budget, limit = cfg.rollout.max_new_tokens, cfg.model.max_positions
    if prompt + budget > limit:
        keys = ", ".join(f"task.{k}={cfg.task[k]}" for k in tasks.PROMPT_PARAMS[cfg.task.name])
        raise ConfigError(
            f"model.max_positions={limit} is shorter than the longest sequence: {prompt} prompt tokens (<bos> and the longest {cfg.task.name} prompt, {keys}) "
            f"+ rollout.max_new_tokens={budget} = {prompt + budget} tokens; raise model.max_positions or lower one of the others"
        )


def loss_config(cfg: Any) -> Any:
    """The recipe's policy loss (`flow.algorithms.PolicyLossConfig`); "token_sum_norm"
    divides by `rollout.max_new_tokens`, the longest response.

    Raises:
        ConfigError: naming the `algorithm.*` key whose value the loss refuses.
    """
    from tidal.flow.algorithms import PolicyLossConfig  # noqa: PLC0415

    algo = cfg.algorithm
    try:
        return PolicyLossConfig(clip_low=algo.clip_low, clip_high=algo.clip_high, aggregation=algo.aggregation, tis_cap=algo.tis_cap, kl_coef=algo.kl_coef, max_tokens=cfg.rollout.max_new_tokens)
    except ValueError as e:  # the loss names its field: clip_low, clip_high, ...
        raise ConfigError(f"algorithm.{e}") from None


def to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)
