"""Write the snapshot of the vLLM API the `vllm` rollout adapter relies on, read from vLLM's source.

Run by hand when vLLM's pin moves, on an unpacked wheel (nothing is imported from it, so no
GPU and no vLLM environment are needed):

    pip download vllm==0.32.0 --no-deps -d /tmp/vllm-wheel
    unzip -o -q /tmp/vllm-wheel/vllm-*.whl 'vllm/*.py' -d /tmp/vllm-src
    python tests/engines/vllm_api_snapshot.py /tmp/vllm-src 0.32.0 > tests/engines/vllm_api_0.32.0.json

The output has, for every class or function the adapter (`tidal.engines.vllm_rollout`,
`tidal.engines.vllm_worker`) or the fake (`tests/engines/fake_vllm`) names, its parameters as
`inspect.signature` gives them: name, kind, and default in the form `canonical_default`
(tests/engines/test_vllm_api.py) writes, which both the fake's and a live vLLM's
signatures are compared in. Classes with hundreds of fields (`AsyncEngineArgs`,
`SamplingParams`) are snapshotted for the fields the adapter passes (`"subset": true`).
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from typing import Any

KINDS = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD", "VAR_POSITIONAL", "KEYWORD_ONLY", "VAR_KEYWORD")

ENGINE_ARGS_FIELDS = (
    "model", "dtype", "seed", "trust_remote_code", "max_model_len", "tensor_parallel_size", "gpu_memory_utilization",
    "logprobs_mode", "enforce_eager", "worker_extension_cls", "enable_sleep_mode",
)  # fmt: skip
"""The `AsyncEngineArgs` fields the adapter passes."""
SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "max_tokens", "logprobs", "detokenize", "output_kind")
"""The `SamplingParams` fields the adapter passes."""
ASYNC_LLM_METHODS = (
    "from_engine_args", "shutdown", "generate", "abort", "pause_generation", "resume_generation",
    "reset_prefix_cache", "sleep", "wake_up", "is_sleeping", "collective_rpc",
)  # fmt: skip
"""The `AsyncLLM` methods the adapter calls, or the snapshot records because the adapter's
docstring explains why it does not (`pause_generation` / `resume_generation`)."""


class Source:
    """vLLM's source tree, parsed file by file on demand."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.trees: dict[str, ast.Module] = {}

    def module(self, dotted: str) -> ast.Module:
        if dotted not in self.trees:
            path = self.root / Path(*dotted.split("."))
            path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
            self.trees[dotted] = ast.parse(path.read_text(), str(path))
        return self.trees[dotted]

    def top(self, dotted: str, name: str) -> ast.AST:
        for node in self.module(dotted).body:
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return node
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return node
        raise KeyError(f"{dotted}:{name}")

    def cls(self, dotted: str, name: str) -> ast.ClassDef:
        node = self.top(dotted, name)
        assert isinstance(node, ast.ClassDef), (dotted, name)
        return node


def _decorators(node: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    return {ast.unparse(d) for d in node.decorator_list}


def _what(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    if isinstance(node, ast.AsyncFunctionDef):
        has_yield = any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in ast.walk(node))
        return "async_generator" if has_yield else "coroutine"
    return "classmethod" if "classmethod" in _decorators(node) else "staticmethod" if "staticmethod" in _decorators(node) else "function"


def _default(node: ast.expr, src: Source, module: str) -> Any:
    """`canonical_default` of a default written as `node` in `module`."""
    try:
        value = ast.literal_eval(node)
    except ValueError:
        value = ...
    if value is not ...:
        return {"tuple": list(value)} if isinstance(value, tuple) else value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        owner = node.value.id
        for config_module in ("vllm.config.model", "vllm.config.parallel", "vllm.config.cache"):
            try:
                cls = src.cls(config_module, owner)
            except KeyError:
                continue
            return _field_default(cls, node.attr, src, config_module)
        return {"enum": f"{owner}.{node.attr}"}
    if isinstance(node, ast.Call) and ast.unparse(node.func) in ("Field", "field"):
        for kw in node.keywords:
            if kw.arg == "default":
                return _default(kw.value, src, module)
            if kw.arg == "default_factory":
                return {"factory": True}
    return {"repr": ast.unparse(node)}


def _field_default(cls: ast.ClassDef, name: str, src: Source, module: str) -> Any:
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return _default(node.value, src, module) if node.value is not None else {"required": True}
    raise KeyError(f"{cls.name}.{name}")


def function_entry(node: ast.FunctionDef | ast.AsyncFunctionDef, src: Source, module: str, *, bound: bool) -> dict[str, Any]:
    """`node`'s parameters as `inspect.signature` lists them (`bound`: without the first, as for a
    classmethod read off its class or a constructor read through its class)."""
    a = node.args
    params: list[dict[str, Any]] = []
    positional = [*a.posonlyargs, *a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        p: dict[str, Any] = {"name": arg.arg, "kind": KINDS[0] if i < len(a.posonlyargs) else KINDS[1]}
        if default is not None:
            p["default"] = _default(default, src, module)
        params.append(p)
    if a.vararg:
        params.append({"name": a.vararg.arg, "kind": KINDS[2]})
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        p = {"name": arg.arg, "kind": KINDS[3]}
        if default is not None:
            p["default"] = _default(default, src, module)
        params.append(p)
    if a.kwarg:
        params.append({"name": a.kwarg.arg, "kind": KINDS[4]})
    what = _what(node)
    if bound or what == "classmethod":
        params = params[1:]
    return {"is": what, "params": params}


def dataclass_entry(cls: ast.ClassDef, src: Source, module: str, fields: tuple[str, ...] | None = None) -> dict[str, Any]:
    """A dataclass's (or msgspec Struct's) constructor: its annotated fields in order, each
    positional-or-keyword; `fields`: only these (a subset, in this order)."""
    found: dict[str, dict[str, Any]] = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and not node.target.id.startswith("_"):
            p: dict[str, Any] = {"name": node.target.id, "kind": KINDS[1]}
            if node.value is not None:
                default = _default(node.value, src, module)
                if default == {"factory": True}:
                    p["default"] = {"factory": True}
                else:
                    p["default"] = default
            found[node.target.id] = p
    names = fields if fields is not None else tuple(found)
    entry: dict[str, Any] = {"is": "class", "params": [found[n] for n in names]}
    if fields is not None:
        entry["subset"] = True
    return entry


def enum_entry(cls: ast.ClassDef) -> dict[str, Any]:
    members = {}
    for node in cls.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            members[node.targets[0].id] = ast.literal_eval(node.value)
    return {"is": "enum", "members": members}


def literal_entry(node: ast.AST) -> dict[str, Any]:
    assert isinstance(node, ast.Assign)
    sub = node.value
    assert isinstance(sub, ast.Subscript), ast.unparse(sub)
    values = ast.literal_eval(sub.slice)
    return {"is": "literal", "values": list(values) if isinstance(values, tuple) else [values]}


def typeddict_entry(src: Source, module: str, name: str) -> dict[str, Any]:
    """A TypedDict's keys (its bases' in the same module too) and the required ones."""
    keys: list[str] = []
    required: list[str] = []

    def walk(cls: ast.ClassDef) -> None:
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id != "TypedDict":
                walk(src.cls(module, base.id))
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                keys.append(node.target.id)
                if not ast.unparse(node.annotation).startswith("NotRequired"):
                    required.append(node.target.id)

    walk(src.cls(module, name))
    return {"is": "typeddict", "keys": sorted(keys), "required": sorted(required)}


def class_attributes(src: Source, module: str, name: str) -> list[str]:
    """Names a class and its bases (found in vllm.v1.worker) define at class level: what
    vLLM's `WorkerWrapperBase` checks a worker extension's names against (`hasattr(worker_class, attr)`)."""
    names: set[str] = set()
    cls = src.cls(module, name)
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id == "WorkerBase":
            names |= set(class_attributes(src, "vllm.v1.worker.worker_base", "WorkerBase"))
    return sorted(n for n in names if not n.startswith("__"))


def snapshot(root: Path, version: str) -> dict[str, Any]:
    src = Source(root)
    api: dict[str, Any] = {}
    api["vllm.engine.arg_utils:AsyncEngineArgs"] = dataclass_entry(src.cls("vllm.engine.arg_utils", "EngineArgs"), src, "vllm.engine.arg_utils", ENGINE_ARGS_FIELDS)
    llm = src.cls("vllm.v1.engine.async_llm", "AsyncLLM")
    methods = {n.name: n for n in llm.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    for name in ASYNC_LLM_METHODS:
        api[f"vllm.v1.engine.async_llm:AsyncLLM.{name}"] = function_entry(methods[name], src, "vllm.v1.engine.async_llm", bound=False)
    api["vllm.sampling_params:SamplingParams"] = dataclass_entry(src.cls("vllm.sampling_params", "SamplingParams"), src, "vllm.sampling_params", SAMPLING_FIELDS)
    api["vllm.sampling_params:RequestOutputKind"] = enum_entry(src.cls("vllm.sampling_params", "RequestOutputKind"))
    api["vllm.inputs:TokensPrompt"] = typeddict_entry(src, "vllm.inputs.llm", "TokensPrompt")
    request_output = next(n for n in src.cls("vllm.outputs", "RequestOutput").body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    api["vllm.outputs:RequestOutput"] = {**function_entry(request_output, src, "vllm.outputs", bound=True), "is": "class"}
    api["vllm.outputs:CompletionOutput"] = dataclass_entry(src.cls("vllm.outputs", "CompletionOutput"), src, "vllm.outputs")
    api["vllm.logprobs:Logprob"] = dataclass_entry(src.cls("vllm.logprobs", "Logprob"), src, "vllm.logprobs")
    api["vllm.usage.usage_lib:UsageContext"] = enum_entry(src.cls("vllm.usage.usage_lib", "UsageContext"))
    api["vllm.config.model:LogprobsMode"] = literal_entry(src.top("vllm.config.model", "LogprobsMode"))
    api["vllm.config.model:ModelDType"] = literal_entry(src.top("vllm.config.model", "ModelDType"))
    api["vllm.v1.engine:PauseMode"] = literal_entry(src.top("vllm.v1.engine", "PauseMode"))
    api["vllm.v1.worker.gpu_worker:Worker"] = {"is": "class_attributes", "names": class_attributes(src, "vllm.v1.worker.gpu_worker", "Worker")}
    return {
        "vllm_version": version,
        "source": f"vllm-{version} wheel from PyPI (pip download vllm=={version} --no-deps), read with tests/engines/vllm_api_snapshot.py",
        "api": api,
    }


if __name__ == "__main__":
    root, version = Path(sys.argv[1]), sys.argv[2]
    json.dump(snapshot(root, version), sys.stdout, indent=1)
    sys.stdout.write("\n")
