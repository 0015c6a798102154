"""The vLLM API the `vllm` rollout adapter relies on: the fake vLLM (tests/engines/fake_vllm) and,
where one is installed, the real one have the signatures of `vllm_api_0.32.0.json`, the
snapshot read from the vllm-0.32.0 wheel (`vllm_api_snapshot.py`); the adapter uses nothing
outside it."""

from __future__ import annotations

import enum
import importlib
import importlib.util
import inspect
import json
import typing
from pathlib import Path
from typing import Any

import pytest

SNAPSHOT = json.loads((Path(__file__).resolve().parent / "vllm_api_0.32.0.json").read_text())


def canonical_default(value: Any) -> Any:
    """A default as the snapshot writes it (JSON: literals as they are, enums by name, ...)."""
    if isinstance(value, enum.Enum):
        return {"enum": f"{type(value).__name__}.{value.name}"}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {"tuple": [canonical_default(v) for v in value]}
    if isinstance(value, list):
        return [canonical_default(v) for v in value]
    if repr(value) == "<factory>":
        return {"factory": True}
    return {"repr": repr(value)}


def _params(obj: Any) -> list[dict[str, Any]]:
    out = []
    for p in inspect.signature(obj).parameters.values():
        entry: dict[str, Any] = {"name": p.name, "kind": p.kind.name}
        if p.default is not inspect.Parameter.empty:
            entry["default"] = canonical_default(p.default)
        out.append(entry)
    return out


def _callable_kind(key: str) -> tuple[str, Any]:
    """What `key` ("module:Class" or "module:Class.method") is, and what `inspect.signature`
    reads: a class itself, a method as its class holds it, a classmethod bound to its class."""
    module, _, path = key.partition(":")
    owner: Any = getattr(importlib.import_module(module), path.split(".")[0])
    if "." not in path:
        return "class", owner
    name = path.split(".")[1]
    static = inspect.getattr_static(owner, name)
    if isinstance(static, classmethod):
        return "classmethod", getattr(owner, name)
    func = static.__func__ if isinstance(static, staticmethod) else static
    return "async_generator" if inspect.isasyncgenfunction(func) else "coroutine" if inspect.iscoroutinefunction(func) else "function", func


def api_differences() -> list[str]:
    """How the importable `vllm` differs from the snapshot, for what the adapter uses."""
    problems = []
    for key, want in SNAPSHOT["api"].items():
        module, _, path = key.partition(":")
        try:
            obj = getattr(importlib.import_module(module), path.split(".")[0])
            kind = want["is"]
            if kind in ("class", "function", "coroutine", "async_generator", "classmethod"):
                got_kind, obj = _callable_kind(key)
        except (ImportError, AttributeError) as e:
            problems.append(f"{key}: missing ({e})")
            continue
        if kind in ("class", "function", "coroutine", "async_generator", "classmethod"):
            if got_kind != kind:
                problems.append(f"{key}: is a {got_kind}, vLLM's is a {kind}")
            got = _params(obj)
            if want.get("subset"):
                by_name = {p["name"]: p for p in got}
                problems += [f"{key}: parameter {p['name']}: {by_name.get(p['name'])} != {p}" for p in want["params"] if by_name.get(p["name"]) != p]
            elif got != want["params"]:
                problems.append(f"{key}: parameters {got} != {want['params']}")
        elif kind == "enum":
            got_members = {m.name: m.value for m in obj}
            if got_members != want["members"]:
                problems.append(f"{key}: members {got_members} != {want['members']}")
        elif kind == "literal":
            if list(typing.get_args(obj)) != want["values"]:
                problems.append(f"{key}: values {typing.get_args(obj)} != {want['values']}")
        elif kind == "typeddict":
            keys = sorted(obj.__required_keys__ | obj.__optional_keys__)
            if keys != want["keys"] or not set(want["required"]) <= obj.__required_keys__:
                problems.append(f"{key}: keys {keys} (required {sorted(obj.__required_keys__)}) != {want['keys']} (required {want['required']})")
    return problems


def test_the_fake_has_the_signatures_of_the_vllm_snapshot(fake_vllm):
    assert SNAPSHOT["vllm_version"] == fake_vllm.__version__ == "0.32.0"
    assert api_differences() == []


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vLLM installed (a vLLM environment)")
def test_the_installed_vllm_has_the_signatures_of_the_snapshot():
    import vllm

    assert not getattr(vllm, "FAKE", False)
    assert api_differences() == [], f"vLLM {vllm.__version__} differs from the snapshot of {SNAPSHOT['vllm_version']}"


def test_the_adapter_stays_inside_the_snapshot():
    """What the adapter passes and names is what the snapshot covers: its dtypes are vLLM's, and no
    name of the worker extension is a name of vLLM's worker class (vLLM refuses such an extension)."""
    from tidal.engines.vllm_rollout import DTYPES
    from tidal.engines.vllm_worker import TidalWorkerExtension

    assert list(DTYPES) == SNAPSHOT["api"]["vllm.config.model:ModelDType"]["values"]
    worker_names = set(SNAPSHOT["api"]["vllm.v1.worker.gpu_worker:Worker"]["names"])
    own = {a for a in dir(TidalWorkerExtension) if not a.startswith("__")}
    assert own and not own & worker_names
