"""`hal.versions`: what a node lacks to run its devices, read from package metadata only."""

from __future__ import annotations

import importlib.metadata
import sys

from tidal.hal.versions import missing_stack, package_versions


def test_a_node_without_the_ascend_adapter_lacks_it_for_npus(monkeypatch, tmp_path):
    assert "torch_npu is not installed" in missing_stack("npu")  # not in this environment (it would break `import torch`)
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text("raise ImportError('never imported: only found')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert missing_stack("npu") is None
    assert "torch_npu" not in sys.modules


def test_a_cpu_build_of_torch_is_named_for_gpus_and_cpu_needs_nothing():
    version = importlib.metadata.version("torch")
    assert version.endswith("+cpu")  # constraints.txt pins the CPU build here
    assert missing_stack("cuda") == f"torch {version} is a CPU-only build (install a CUDA build of torch)"
    assert missing_stack("cpu") is None


def test_versions_name_tidal_python_and_ray():
    versions = package_versions()
    assert versions["tidal-rl"] == importlib.metadata.version("tidal-rl")
    assert versions["python"].count(".") == 2 and versions["ray"] == importlib.metadata.version("ray")
