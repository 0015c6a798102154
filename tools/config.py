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

from tidal.flow.config import Bounded, Checked
from tidal.tools.config_keys import is_schema, iter_keys, key_type
from tidal.tools.config_schema import (  # noqa: F401 - the schema's public home is this module
    MAX_SEED,
    AlgorithmConfig,
    Attention,
    ClusterConfig,
    ConfigError,
    CriticConfig,
    DataConfig,
    EvalConfig,
    FaultConfig,
    ModelConfig,
    NodeConfig,
    PlacementConfig,
    Precision,
    RecipeConfig,
    RewardModelConfig,
    RoleConfig,
    RolloutConfig,
    Runtime,
    SFTConfig,
    TaskConfig,
    TrainConfig,
    TransportConfig,
    WandbConfig,
    WandbMode,
    longest_prompt,
    loss_config,
    loss_error,
)

# ---------------------------------------------------------------------------------------
# Loading.


def _explain(err: OmegaConfBaseException | TypeError, schema: type, origin: str, given: DictConfig, *, prefix: str = "") -> ConfigError:
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
    tree: Any = OmegaConf.to_container(given, resolve=False) if isinstance(given, DictConfig) else given
    hints = typing.get_type_hints(schema)
    for name, value in tree.items():
        tp: Any = hints.get(name)
        args = typing.get_args(tp)
        item: Any = args[0] if typing.get_origin(tp) is list and args else None
        if typing.get_origin(tp) is list and isinstance(value, dict):  # OmegaConf: a TypeError, "Cannot merge incompatible container types"
            return ConfigError(
                f"key {prefix + name!r} in {origin} expects a {key_type(schema, name)}, got a mapping {value!r}; "
                f"a list is given whole ({prefix + name}=[...]), not one entry at a time ({prefix + name}[0]...)"
            )
        entries: list[tuple[str, type, Any]]
        if is_schema(tp):
            entries = [(f"{prefix}{name}", tp, value)]
        elif is_schema(item) and isinstance(value, list):
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
    """Merge schema defaults, the recipe file and overrides; validate; return the config: an
    instance of `schema` (a `RecipeConfig` unless told otherwise).

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
    _check_strings(cfg, schema)
    typed = OmegaConf.to_object(cfg)
    check(typed)
    return typed


def select(cfg: Any, key: str) -> Any:
    """The value of dotted `key` (`train.lr`) in a loaded config."""
    for name in key.split("."):
        cfg = getattr(cfg, name)
    return cfg


def config_from_yaml(text: str, *, schema: type = RecipeConfig) -> Any:
    """A config as `to_yaml` wrote it (a run's config.yaml, or one sent to a Ray actor), typed
    again; it was checked when it was loaded."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), OmegaConf.create(text)))


def stage_threads(cfg: RecipeConfig, stage: str) -> int:
    """torch intra-op threads of an RL stage ("rollout" or "train"): its own `threads`, else
    the run's (0: torch's default)."""
    return getattr(cfg, stage).threads or cfg.threads


def check(node: Any, prefix: str = "") -> None:
    """Check a loaded config: each section's bounds (`flow.config.Bounded`) and its own
    `check()` (`Checked`), the sections inside a section before it, so the recipe's checks
    that span sections find each one sound.

    Raises:
        ConfigError: naming the key and what is wrong with it.
    """
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            check(value, f"{prefix}{f.name}.")
        elif isinstance(value, list):
            for i, entry in enumerate(value):
                if dataclasses.is_dataclass(entry):
                    check(entry, f"{prefix}{f.name}[{i}].")
    _check_bounds(node, prefix)
    if isinstance(node, Checked):
        try:
            node.check()
        except ConfigError:
            raise
        except ValueError as e:  # the checks name their keys
            raise ConfigError(str(e)) from None


def _check_bounds(node: Any, prefix: str) -> None:
    if not isinstance(node, Bounded):
        return
    bounds = node.BOUNDS
    because = {name: f": {bounds.why[name]}" if name in bounds.why else "" for name in (*bounds.at_least, *bounds.positive, *bounds.finite)}
    for name in because:
        value = getattr(node, name)
        if isinstance(value, float) and not math.isfinite(value):  # nan passes every comparison below
            raise ConfigError(f"{prefix}{name}={value} must be a finite number")
    for name, least in bounds.at_least.items():
        value = getattr(node, name)
        if value is not None and value < least:
            raise ConfigError(f"{prefix}{name}={value} must be >= {least}{because[name]}")
    for name in bounds.positive:
        value = getattr(node, name)
        if value is not None and value <= 0:
            raise ConfigError(f"{prefix}{name}={value} must be > 0{because[name]}")


def _check_strings(cfg: Any, schema: type, prefix: str = "") -> None:
    """Every entry of a list-of-strings key is a string (OmegaConf lets a mapping in)."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if f.name not in cfg:
            continue
        tp, value, key = hints[f.name], cfg[f.name], prefix + f.name
        item: Any = typing.get_args(tp)[0] if typing.get_origin(tp) is list and typing.get_args(tp) else None
        if is_schema(tp):
            _check_strings(value, tp, key + ".")
        elif is_schema(item):
            for i, entry in enumerate(value or ()):
                _check_strings(entry, item, f"{key}[{i}].")
        elif item is str and (bad := [v for v in value or () if not isinstance(v, str)]):
            raise ConfigError(f"{key} holds {bad[0]!r}: {f.name} are strings")


def to_yaml(cfg: Any) -> str:
    """The config as YAML (what run directories keep, and Ray actors are sent)."""
    return OmegaConf.to_yaml(_structured(cfg), resolve=True)


def to_dict(cfg: Any) -> dict[str, Any]:
    """The config as plain dicts, lists and scalars, an enum as its value (what config.yaml
    holds: a W&B run's config)."""
    return OmegaConf.to_container(_structured(cfg), resolve=True, enum_to_str=True)  # type: ignore[return-value]


def _structured(cfg: Any) -> DictConfig:
    return cfg if isinstance(cfg, DictConfig) else OmegaConf.structured(cfg)
