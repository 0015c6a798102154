"""Project rules a test can see: vendor names stay in hal/, imports point down the layers."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENDOR = re.compile(r"torch\.cuda|torch\.npu|torch_npu|nccl|hccl", re.IGNORECASE)
# Code and data that ship or run the project. hal/ is where vendor names belong; tests/
# must name them to inject fakes and check error messages; docs/ explain them to users.
CHECKED = ("*.py", "*.yaml", "*.yml", "*.toml", "*.sh", "*.cfg")
EXEMPT = ("hal", "tests", "docs", ".venv", ".git", "build", "dist")

# Which tidal subpackages each folder may import (DESIGN.md, "Layout").
MAY_IMPORT = {
    "hal": {"tidal.hal"},
    "flow": {"tidal.hal", "tidal.flow"},
    "engines": {"tidal.hal", "tidal.flow", "tidal.engines"},
    "tools": {"tidal.hal", "tidal.flow", "tidal.engines", "tidal.tools"},
}


def _project_files(patterns) -> list[Path]:
    files = []
    for pattern in patterns:
        for path in ROOT.rglob(pattern):
            rel = path.relative_to(ROOT)
            if rel.parts[0] not in EXEMPT and "egg-info" not in str(rel):
                files.append(path)
    return files + [ROOT / ".ci" / "run"]


def test_no_vendor_names_outside_hal():
    offenders = []
    for path in _project_files(CHECKED):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if VENDOR.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "vendor names belong behind the HAL:\n" + "\n".join(offenders)


def test_vendor_name_check_catches_a_violation():
    assert VENDOR.search("x = torch.cuda.device_count()")
    assert VENDOR.search("os.environ['NCCL_DEBUG'] = 'INFO'")
    assert VENDOR.search("import torch_npu")
    assert not VENDOR.search("platform.device_count()")


def _tidal_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {".".join(n.split(".")[:2]) for n in names if n.startswith("tidal.")}


def test_imports_point_down_the_layers():
    offenders = []
    for folder, allowed in MAY_IMPORT.items():
        files = list((ROOT / folder).rglob("*.py"))
        assert files or folder in ("flow", "engines"), folder
        for path in files:
            bad = _tidal_imports(path) - allowed
            if bad:
                offenders.append(f"{path.relative_to(ROOT)} imports {sorted(bad)}")
    assert not offenders, "\n".join(offenders)


def test_hal_imports_no_vendor_module_at_top_level():
    for path in (ROOT / "hal").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level only; imports inside functions are lazy
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not any("torch_npu" in n for n in names), f"{path.name} imports torch_npu at import time"


# tools/ composes engines by name (`tidal.engines.registry`); this file still names the tiny
# model's own code: checkpoint.py saves through `tiny.save_model` (the checkpoint files' format).
CONCRETE_ALLOWED = {"tools/checkpoint.py"}
CONCRETE = re.compile(r"tidal\.engines\.(tiny|tokenizers\.HFTokenizer)|\b(CharTokenizer|HFTokenizer|build_tiny_qwen2)\b")


def test_tools_compose_engines_by_name():
    """Nothing in tools/ imports the tiny model or a tokenizer class (DESIGN.md: model sources are registered by name)."""
    offenders = []
    for path in sorted((ROOT / "tools").glob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel in CONCRETE_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            offenders += [f"{rel}:{node.lineno} imports {name}" for name in names if CONCRETE.search(name)]
    assert not offenders, "tools/ names engines through tidal.engines.registry / tidal.engines.models:\n" + "\n".join(offenders)


# Capabilities are Protocols checked with `isinstance` (STYLE.md 14, `tidal.flow.protocols`),
# never a probe for a name. A getattr/hasattr with a literal name in flow/ or tools/ is one
# of these, none a capability of an engine, rollout group, wiring or prompt source:
# (file, object, name): why.
NAME_LOOKUPS_ALLOWED = {
    ("flow/ray/faults.py", "error", "__notes__"): "an exception's PEP 678 notes, absent until one is added",
    ("flow/ray/faults.py", "error", "error_msg"): "the message of Ray's error types, absent on others",
    ("flow/store/client.py", "self._tls", "cancel"): "per-thread state, set only by threads that use it",
    ("flow/store/client.py", "self._tls", "wake_listener"): "per-thread state, set only by threads that use it",
    ("flow/store/thread_sockets.py", "self._tls", "sockets"): "per-thread state, set only by threads that use it",
    ("flow/store/server.py", "self._local", "retrying"): "per-thread state, set only while retrying",
    ("flow/store/persist.py", "os", "O_NOFOLLOW"): "an OS flag not every platform has",
    ("flow/store/cells.py", "value", "nbytes"): "a cell's size: arrays, tensors and remote chunks report one",
    ("flow/store/cells.py", "value", "sizes"): "a column held on another storage unit carries its rows' sizes",
    ("flow/store/cells.py", "chunk", "sizes"): "a column held on another storage unit carries its rows' sizes",
    ("flow/store/samplers.py", "sampler", "inner"): "walks a sampler chain (store-internal wrappers)",
    ("flow/store/samplers.py", "value", "shape"): "a cell's length: arrays and tensors have a shape",
    ("tools/cli.py", "args", "made_run_dir"): "an argparse namespace field only `tidal run` sets",
    ("tools/cli.py", "cause", "__notes__"): "an exception's PEP 678 notes, absent until one is added",
    ("tools/cli.py", "e", "reason"): "a stop request's reason, on the exception types that carry one",
    ("tools/cli.py", "e", "exit_code"): "a stop request's exit code, on the exception types that carry one",
    ("tools/config.py", "err", "full_key"): "OmegaConf errors carry the offending key, not all of them",
    ("tools/config.py", "err", "key"): "OmegaConf errors carry the offending key, not all of them",
    ("tools/config.py", "e", "full_key"): "OmegaConf errors carry the offending key, not all of them",
    ("tools/bench/trl.py", "reward", "__name__"): "a reward callable's name for TRL (a partial has none)",
    ("tools/config_keys.py", "tp", "__name__"): "a type annotation's name (typing constructs have none)",
    ("tools/rl.py", "self.reward", "__module__"): "the module a reward pool preloads (a callable instance may have none)",
}
CAPABILITY_HOLDER = re.compile(r"engine|trainer|rollout|receiver|wiring|sender|source|prompts")


def _name_lookups(source: str) -> list[tuple[int, str, str | None, str | None]]:
    """Every getattr/hasattr call in `source`: (line, object, literal name or None, enclosing function)."""
    found = []

    def visit(node: ast.AST, function: str | None) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2:
            name = node.args[1]
            literal = name.value if isinstance(name, ast.Constant) and isinstance(name.value, str) else None
            found.append((node.lineno, ast.unparse(node.args[0]), literal, function))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(ast.parse(source), None)
    return found


def _name_probes(rel: str, source: str) -> list[str]:
    """Lookups by name that are not on the allow-list: any literal name, and any name read off
    an engine-like object outside a `__getattr__` that forwards to it."""
    offenders = []
    for line, obj, literal, function in _name_lookups(source):
        if literal is not None and (rel, obj, literal) not in NAME_LOOKUPS_ALLOWED:
            offenders.append(f"{rel}:{line}: looks up {literal!r} on {obj}")
        elif literal is None and CAPABILITY_HOLDER.search(obj) and function != "__getattr__":
            offenders.append(f"{rel}:{line}: looks up a name held in a variable on {obj}")
    return offenders


def test_capabilities_are_protocols_not_name_probes():
    offenders = []
    for folder in ("flow", "tools"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            offenders += _name_probes(str(path.relative_to(ROOT)), path.read_text())
    assert not offenders, "declare the capability as a runtime_checkable Protocol (tidal.flow.protocols) and check it with isinstance, or allow the lookup in NAME_LOOKUPS_ALLOWED with why:\n" + "\n".join(offenders)


def test_name_probe_check_catches_a_violation():
    assert _name_probes("flow/x.py", 'park = getattr(engine, "park", None)')
    assert _name_probes("flow/x.py", 'if hasattr(wiring, "post"): pass')
    assert _name_probes("flow/x.py", 'ok = callable(getattr(self.trainer, "share_weights", None))')
    assert _name_probes("flow/x.py", "def f(engine, name):\n    return getattr(engine, name)")
    assert not _name_probes("flow/x.py", "class W:\n    def __getattr__(self, name):\n        return getattr(self.engine, name)")
    assert not _name_probes("flow/ray/faults.py", 'notes = getattr(error, "__notes__", [])')
