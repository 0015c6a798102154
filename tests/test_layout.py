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


# tools/ composes engines by name (`tidal.engines.registry`); these files still name the tiny
# model's own code: checkpoint.py saves through `tiny.save_model` (the checkpoint files'
# format), bench_trl.py hands TRL the character tokenizer as a transformers one.
CONCRETE_ALLOWED = {"tools/checkpoint.py", "tools/bench_trl.py"}
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
