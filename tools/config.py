"""Typed recipe configuration: OmegaConf structured configs built from dataclasses.

The dataclasses (`config_schema`, re-exported here: import them from this module) are the
source of truth; a recipe YAML is only data. Every field has a docstring (the string
literal under it), which `tidal config --keys` prints and a test checks (`config_keys`
reads them). Loading merges schema defaults <- recipe file <-
`key=value` overrides, and turns OmegaConf's errors into `ConfigError`s that name the
key: an unknown key comes with close matches, a wrong type with the expected type and
the value given.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from tidal.engines import tasks
from tidal.tools.config_keys import iter_keys, key_type
from tidal.tools.config_schema import (  # noqa: F401 - the schema's public home is this module
    AlgorithmConfig,
    Attention,
    ClusterConfig,
    DataConfig,
    FaultConfig,
    ModelConfig,
    NodeConfig,
    PlacementConfig,
    Precision,
    RecipeConfig,
    RoleConfig,
    RolloutConfig,
    Runtime,
    SFTConfig,
    TaskConfig,
    TrainConfig,
    TransportConfig,
)


class ConfigError(ValueError):
    """A user mistake in a recipe or an override; the CLI prints it and exits with code 2."""


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
        if typing.get_origin(tp) is list and isinstance(value, dict):  # OmegaConf: a TypeError, "Cannot merge incompatible container types"
            return ConfigError(
                f"key {prefix + name!r} in {origin} expects a {key_type(schema, name)}, got a mapping {value!r}; "
                f"a list is given whole ({prefix + name}=[...]), not one entry at a time ({prefix + name}[0]...)"
            )
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


_YAML_OCTAL = re.compile(r"[-+]?0[0-7_]+")
_YAML_BASE_60 = re.compile(r"[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?")
"""Number forms of YAML 1.1 that read otherwise than they look: `010` is 8, `1:30` is 90."""


def _as_written(given: DictConfig, overrides: Sequence[str], schema: type, *, origin: str | None = None) -> None:
    """Fix what YAML made of an override's text where its key's type wants the text: a
    string key keeps it as written (YAML reads `run_dir=001` as 1 and `name=no` as False,
    which a str key holds as '1' and 'False'); a number key refuses YAML 1.1's octal and
    base-60 forms (`seed=010` is 8). `overrides` are `key=text`; `origin` names the recipe
    file they were written in (None: the command line).

    Raises:
        ConfigError: naming the override (or the recipe's key) whose number YAML reads as another.
    """
    written = dict(item.partition("=")[::2] for item in overrides)  # a key given twice: its last text, the one `given` holds
    types = {k.key: k.type for k in iter_keys(schema)}
    for key, text in written.items():
        kind, text = types.get(key), text.strip()
        if kind not in ("str", "str or null", "int", "float", "float or null"):
            continue
        value = OmegaConf.select(given, key, default=None, throw_on_resolution_failure=False)  # `${...}`: resolved later
        if kind.startswith("str") and isinstance(value, (bool, int, float)):
            OmegaConf.update(given, key, text)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and (_YAML_BASE_60.fullmatch(text) or (_YAML_OCTAL.fullmatch(text) and value != int(text.replace("_", "")))):
            written_as = f"{key}={text}" if origin is None else f"key {key!r} in {origin} ({text})"
            raise ConfigError(f"{written_as}: YAML reads it as {value} (octal or base 60); write the number in plain decimal")


def _plain_scalars(text: str) -> list[str]:
    """`key=text` for each unquoted scalar in a YAML document's mappings (keys dotted, none
    inside lists), as written: what `_as_written` checks in a recipe file."""
    found: list[str] = []

    def walk(node: yaml.Node, prefix: str) -> None:
        for key, value in node.value if isinstance(node, yaml.MappingNode) else ():
            name = f"{prefix}{key.value}"
            if isinstance(value, yaml.ScalarNode) and value.style is None:
                found.append(f"{name}={value.value}")
            walk(value, name + ".")

    walk(yaml.compose(text, Loader=yaml.SafeLoader), "")
    return found


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
        except Exception as e:  # YAML errors come in many types
            raise ConfigError(f"recipe {str(path)!r} is not valid YAML: {e}") from e
        if not isinstance(data, DictConfig):
            raise ConfigError(f"recipe {str(path)!r} must be a mapping of keys to values")
        _as_written(data, _plain_scalars(path.read_text(encoding="utf-8")), schema, origin=f"recipe {str(path)!r}")
        try:
            cfg = OmegaConf.merge(cfg, data)
        except (OmegaConfBaseException, TypeError) as e:
            origin = f"recipe {str(path)!r}"
            raise _misplaced(schema, data, origin=origin) or _explain(e, schema, origin, data) from None
    if overrides:
        given = parse_overrides(overrides)
        _as_written(given, overrides, schema)
        try:
            cfg = OmegaConf.merge(cfg, given)
        except (OmegaConfBaseException, TypeError) as e:
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
    "seed": 0, "threads": 0, "checkpoint_every": 1, "keep_checkpoints": 0, "eval_every": 0, "train.warmup_steps": 0,
    "model.hidden_size": 1, "model.num_layers": 1, "model.num_heads": 1, "model.num_kv_heads": 1, "model.intermediate_size": 1, "model.max_positions": 2,
    "task.max_value": 0, "task.reward_workers": 0, "task.num_eval_prompts": 1, "task.num_numbers": 1, "task.max_number": 1, "sft.steps": 0, "sft.batch_size": 1,
    "rollout.max_new_tokens": 1, "rollout.chunk_tokens": 1, "rollout.prompts_per_generate": 1, "rollout.threads": 0,
    "train.micro_batch_size": 1, "train.max_tokens_per_micro_batch": 2, "train.weight_decay": 0, "train.threads": 0, "train.max_nonfinite_steps": 0, "cluster.nodes[].count": 1,
    "algorithm.num_steps": 1, "algorithm.prompts_per_step": 1, "algorithm.group_size": 2, "algorithm.max_staleness": 0,
    "algorithm.clip_low": 0, "algorithm.clip_high": 0, "algorithm.kl_coef": 0, "algorithm.overlong_buffer": 0,
    "transport.bucket_mb": 1, "fault.rollout_restarts": 0, "fault.trainer_restarts": 0, "fault.liveness_s": 0, "fault.liveness_grace_s": 0,
    "placement.train.count": 1, "placement.train.devices_each": 1, "placement.rollout.count": 1, "placement.rollout.devices_each": 1,
}
"""Recipe keys and their smallest valid value (checked when a recipe loads, not mid-run); `a[].b`: b of each entry of list a."""
MAX_SEED = 2**64 - 1
"""The largest `seed` (torch.manual_seed's bound; larger ones failed with a traceback once the run directory was made)."""
_POSITIVE = ("rollout.temperature", "train.lr", "sft.lr", "train.grad_clip", "algorithm.tis_cap", "algorithm.seq_mask_high", "lease_s", "task.reward_timeout_s")
"""Recipe keys that must be > 0 when set."""
_FINITE = ("algorithm.seq_mask_low", "algorithm.dual_clip", "algorithm.entropy_coef")
"""Recipe keys with no bound of their own here that must be finite when set (the loss checks the rest)."""
_WHY = {
    "algorithm.group_size": "every advantage estimator compares a prompt's samples with each other, so one sample learns nothing",
    "rollout.temperature": "rollout samples, and its behavior logprobs are taken at this temperature",
    "train.grad_clip": "gradients are clipped to this norm",
    "algorithm.tis_cap": "the importance weight is truncated at it; null for no cap",
    "algorithm.seq_mask_high": "sequences whose behavior weight is above it are left out, and every weight is > 0, so all would be; null for no upper bound",
}


def _check_values(cfg: Any) -> None:
    """Checks a type cannot express, each naming its key."""
    from tidal.engines.registry import CHECKED_ON_LOAD, unknown  # noqa: PLC0415
    from tidal.hal.select import check_spec  # noqa: PLC0415 - only recipes with a device need it

    if "device" in cfg:
        try:
            check_spec(cfg.device, source="device")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if "task" in cfg:
        try:
            tasks.check_ops(cfg.task.ops)  # the arithmetic prompts' own check, before the run directory
        except ValueError:
            raise ConfigError(f"task.ops={cfg.task.ops!r} is not a non-empty set of the operators + - * (e.g. +-)") from None
    if "train" in cfg and "lr_schedule" in cfg.train:
        from tidal.engines.lr_schedule import LR_SCHEDULES  # noqa: PLC0415

        if cfg.train.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(f"train.lr_schedule={cfg.train.lr_schedule!r} is not one of {', '.join(LR_SCHEDULES)}")
        if not 0 <= cfg.train.min_lr_ratio <= 1:  # nan fails it too
            raise ConfigError(f"train.min_lr_ratio={cfg.train.min_lr_ratio} must be in [0, 1]: the cosine schedule's last lr as a share of train.lr")
    if "train" in cfg and cfg.train.get("zero_stage", 1) not in (1, 2, 3):  # `engines.deepspeed_setup.ZERO_STAGES`
        raise ConfigError(f"train.zero_stage={cfg.train.zero_stage} is not one of 1, 2, 3 (DeepSpeed ZeRO: 1 shards the optimizer state, 2 also the gradients, 3 also the weights)")
    if "transport" in cfg and cfg.transport.name not in ("auto", "ipc", "collective", "host"):
        raise ConfigError(f"transport.name={cfg.transport.name!r} is not one of auto, ipc, collective, host")
    for name, value in (item for key in (*_AT_LEAST, *_POSITIVE, *_FINITE) for item in _selected(cfg, key)):
        if isinstance(value, float) and not math.isfinite(value):  # nan passes every comparison below
            raise ConfigError(f"{name}={value} must be a finite number")
    for key, least in _AT_LEAST.items():
        for name, value in _selected(cfg, key):
            if value is not None and value < least:
                raise ConfigError(f"{name}={value} must be >= {least}" + (f": {_WHY[key]}" if key in _WHY else ""))
    if "seed" in cfg and cfg.seed is not None and cfg.seed > MAX_SEED:
        raise ConfigError(f"seed={cfg.seed} must be <= {MAX_SEED}: torch's generators take a 64-bit seed")
    for key in _POSITIVE:
        value = OmegaConf.select(cfg, key)
        if value is not None and value <= 0:
            raise ConfigError(f"{key}={value} must be > 0" + (f": {_WHY[key]}" if key in _WHY else ""))
    if "model" in cfg and "num_kv_heads" in cfg.model:
        m = cfg.model
        if m.hidden_size % m.num_heads or m.num_heads % m.num_kv_heads:
            raise ConfigError(f"model.hidden_size={m.hidden_size}, model.num_heads={m.num_heads}, model.num_kv_heads={m.num_kv_heads}: hidden_size must be a multiple of num_heads, and num_heads of num_kv_heads")
    if "algorithm" in cfg:
        from tidal.flow.algorithms import ADVANTAGES, AGGREGATIONS, KL_ESTIMATORS, LEVELS, OVERLONG  # noqa: PLC0415

        for key, names in (("advantage", ADVANTAGES), ("aggregation", AGGREGATIONS), ("level", LEVELS), ("kl_estimator", KL_ESTIMATORS), ("overlong", OVERLONG)):
            if key in cfg.algorithm and cfg.algorithm[key] not in names:
                raise ConfigError(f"algorithm.{key}={cfg.algorithm[key]!r} is not one of {', '.join(names)}")
        if cfg.algorithm.get("overlong") == "penalty" and "rollout" in cfg:
            buffer, budget = cfg.algorithm.overlong_buffer, cfg.rollout.max_new_tokens
            if not 1 <= buffer <= budget:
                raise ConfigError(f"algorithm.overlong_buffer={buffer} must be within 1..rollout.max_new_tokens ({budget}) with algorithm.overlong=penalty: the tokens before the limit over which the penalty falls to -1")
        if "rollout" in cfg:
            loss_config(cfg)  # every bound of the loss, now rather than after the warm start
    for key in CHECKED_ON_LOAD:
        section, _, field = key.partition(".")
        if section in cfg and field in cfg[section] and (message := unknown(key, cfg[section][field])):
            raise ConfigError(message)
    if "model" in cfg and "dtype" in cfg.model:
        from tidal.engines.models import DTYPES  # noqa: PLC0415

        if cfg.model.dtype not in DTYPES:
            raise ConfigError(f"model.dtype={cfg.model.dtype!r} is not one of {', '.join(DTYPES)}")
    if "data" in cfg:
        from tidal.engines.data import DataError, check_config  # noqa: PLC0415

        try:
            check_config(cfg.data)
        except DataError as e:
            raise ConfigError(str(e)) from None
    if all(section in cfg for section in ("task", "model", "rollout")) and _generated_prompts_on_tiny(cfg):
        _check_lengths(cfg)


def _generated_prompts_on_tiny(cfg: Any) -> bool:
    """Whether the run's prompts are the task's and its model the tiny one: the case whose
    longest sequence is known before any file is read."""
    return cfg.model.get("source", "tiny") == "tiny" and not ("data" in cfg and cfg.data.train_files)


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


_LOSS_KEYS = {"max_tokens": "rollout.max_new_tokens", "proximal_is_policy": "algorithm.decoupled"}
"""`PolicyLossConfig` fields whose recipe key is not `algorithm.<field>`."""


def loss_config(cfg: Any) -> Any:
    """The recipe's policy loss (`flow.algorithms.PolicyLossConfig`): every field from the
    `algorithm.*` key of its name, but "token_sum_norm"'s `max_tokens`, which is
    `rollout.max_new_tokens` (the longest response), and `proximal_is_policy`, which the
    workflow sets from `algorithm.decoupled`.

    Raises:
        ConfigError: naming the recipe key whose value the loss refuses.
    """
    from tidal.flow.algorithms import PolicyLossConfig  # noqa: PLC0415

    algo = cfg.algorithm
    own = [f.name for f in dataclasses.fields(PolicyLossConfig) if f.name not in _LOSS_KEYS]
    try:
        return PolicyLossConfig(**{name: algo[name] for name in own}, max_tokens=cfg.rollout.max_new_tokens)
    except ValueError as e:  # the loss names its fields: clip_low, clip_high, ...
        raise loss_error(e) from None


def loss_error(error: ValueError) -> ConfigError:
    """`PolicyLossConfig`'s `error` as a `ConfigError` that names recipe keys: each field it
    names becomes that field's key (`algorithm.<field>`, or `_LOSS_KEYS`'), and Python's
    None the recipe's null."""
    from tidal.flow.algorithms import PolicyLossConfig  # noqa: PLC0415

    fields = re.compile(r"\b(" + "|".join(f.name for f in dataclasses.fields(PolicyLossConfig)) + r")\b")
    message = fields.sub(lambda m: _LOSS_KEYS.get(m[1], f"algorithm.{m[1]}"), str(error))
    return ConfigError(re.sub(r"\bNone\b", "null", message))


def to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)
