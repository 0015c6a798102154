"""Field documentation of the typed recipe schema (`tidal.tools.config`).

Every field of a schema dataclass has a docstring, the string literal under it; these
functions read them and flatten the schema into its keys (`a.b`, and `a[].b` for the
fields of a list's entries), which `tidal config --keys` prints and `docs/recipes.md` lists.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import textwrap
import types
import typing
from collections.abc import Iterator, Sequence
from typing import Any, TypeGuard


def field_docs(cls: type) -> dict[str, str]:
    """Map each field of dataclass `cls` to the docstring written under it."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


@dataclasses.dataclass(frozen=True)
class KeyDoc:
    key: str
    type: str
    default: Any
    doc: str


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and type(None) in args:  # Optional[X] and X | None alike
        inner = [a for a in args if a is not type(None)]
        return f"{type_name(inner[0])} or null" if len(inner) == 1 else " | ".join(map(type_name, args))
    if origin in (list, Sequence):
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict:
        return f"mapping of {type_name(args[0])} to {type_name(args[1])}" if args else "mapping"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + " | ".join(m.name for m in tp)
    return getattr(tp, "__name__", str(tp))


def is_schema(tp: Any) -> TypeGuard[type]:
    """`tp` is a dataclass (a section of the schema), not an instance of one."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def iter_keys(cls: type, prefix: str = "") -> Iterator[KeyDoc]:
    """Every leaf key of schema `cls` (nested dataclasses flattened to `a.b`) with its doc."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = prefix + f.name
        if is_schema(tp):
            yield from iter_keys(tp, key + ".")
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = "???"
        if isinstance(default, enum.Enum):
            default = default.name
        yield KeyDoc(key=key, type=type_name(tp), default=default, doc=docs.get(f.name, ""))
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list and typing.get_args(tp) else None
        if is_schema(item):
            yield from iter_keys(item, key + "[].")  # fields of each list entry


def key_type(cls: type, key: str) -> str | None:
    """The type of leaf `key` of schema `cls`, as `iter_keys` names it; None for no such key."""
    for entry in iter_keys(cls):
        if entry.key == key:
            return entry.type
    return None
