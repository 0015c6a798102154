"""`tidal.hal.megatron.prepare_megatron`: the host patches megatron-core 0.16.1 needs on CPU and
fake platforms (applied once, reversible, seen by megatron-core only), nothing on GPUs, and
MindSpeed's adaptor on NPUs, imported before megatron-core or refused by name.

The host patches run against the real megatron-core; the NPU path against a stand-in
`mindspeed` package in a fresh interpreter (MindSpeed needs CANN and an NPU)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from tidal.hal import PlatformError, describe
from tidal.hal.megatron import check_precision, prepare_megatron, restore_megatron

HAS_MEGATRON = importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None
needs_megatron = pytest.mark.skipif(not HAS_MEGATRON, reason="megatron-core is not installed")


def _platform(kind: str, *, fake: bool = False) -> SimpleNamespace:
    """What `prepare_megatron` reads of a platform: its descriptor (a real NPU or GPU platform cannot load here)."""
    return SimpleNamespace(descriptor=describe(kind, device_count=2, fake=fake))


@pytest.fixture
def unpatched():
    """megatron-core as it ships before and after the test."""
    restore_megatron()
    yield
    restore_megatron()


def _modules():
    from megatron.core import utils
    from megatron.core.models.common.embeddings import rotary_pos_embedding

    return rotary_pos_embedding, utils


@needs_megatron
@pytest.mark.parametrize("platform", [_platform("cpu"), _platform("cuda", fake=True), _platform("npu", fake=True)], ids=["cpu", "fake-cuda", "fake-npu"])
def test_host_platforms_get_megatrons_current_device_and_rng_on_the_host(unpatched, platform):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel import random
    from megatron.core.utils import GlobalMemoryBuffer

    prepare_megatron(platform)
    rotary, utils = _modules()
    for module in (rotary, utils):
        assert module.torch.cuda.current_device() == "cpu"
        assert module.torch.float32 is torch.float32 and module.torch.cuda.is_available is torch.cuda.is_available  # torch in all else
    assert torch.cuda.current_device is not rotary.torch.cuda.current_device  # torch itself is untouched
    emb = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    assert emb.get_emb(5).device.type == "cpu"  # moved to "the current device" at the first forward
    assert GlobalMemoryBuffer().get_tensor((2, 3), torch.float32, "scores").device.type == "cpu"
    before = torch.get_rng_state()
    with random.get_cuda_rng_tracker().fork():  # attention's dropout context: megatron's no-op tracker
        pass
    assert torch.equal(before, torch.get_rng_state())


@needs_megatron
def test_the_patches_apply_once_and_undo(unpatched):
    rotary, utils = _modules()
    originals = (rotary.torch, utils.torch)
    assert originals == (torch, torch)
    prepare_megatron(_platform("cpu"))
    patched = (rotary.torch, utils.torch)
    prepare_megatron(_platform("cpu"))  # a second engine in the process
    assert (rotary.torch, utils.torch) == patched and patched != originals
    restore_megatron()
    assert (rotary.torch, utils.torch) == originals
    from megatron.core.tensor_parallel import random

    with pytest.raises(Exception, match="cuda rng state model-parallel-rng is not added"), random.get_cuda_rng_tracker().fork():
        pass  # megatron's default tracker again, unseeded


@needs_megatron
def test_gpus_get_megatron_as_it_ships(unpatched):
    prepare_megatron(_platform("cuda"))
    rotary, utils = _modules()
    assert rotary.torch is torch and utils.torch is torch


def test_mixed_precision_is_for_accelerators():
    """On the host megatron's linear layers would multiply bf16 gradients with fp32 weights."""
    for platform in (_platform("cpu"), _platform("npu", fake=True)):
        check_precision(platform, "fp32")
        with pytest.raises(PlatformError, match="precision=bf16: megatron-core's linear layers take mixed precision on accelerators only"):
            check_precision(platform, "bf16")
    check_precision(_platform("cuda"), "bf16")
    check_precision(_platform("npu"), "bf16")


NPU_SCRIPT = textwrap.dedent(
    """
    import sys
    from types import SimpleNamespace

    from tidal.hal import describe
    from tidal.hal.megatron import prepare_megatron

    npu = SimpleNamespace(descriptor=describe("npu", device_count=1))
    try:
        prepare_megatron(npu)
    except RuntimeError as e:
        print("without:", e)
    sys.path.insert(0, sys.argv[1])  # a stand-in mindspeed
    prepare_megatron(npu)
    prepare_megatron(npu)  # once
    from mindspeed import megatron_adaptor
    print("imports:", megatron_adaptor.imports, "megatron first:", megatron_adaptor.megatron_first)
    """
)


def test_npus_import_mindspeeds_adaptor_before_megatron_or_say_it_is_missing(tmp_path):
    adaptor = tmp_path / "mindspeed" / "megatron_adaptor.py"
    adaptor.parent.mkdir()
    (adaptor.parent / "__init__.py").write_text("")
    adaptor.write_text("import sys\nimports = 1\nmegatron_first = 'megatron.core' in sys.modules\n")
    out = subprocess.run([sys.executable, "-c", NPU_SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "without: train.backend=megatron on Ascend NPUs needs MindSpeed (the `mindspeed` package" in out.stdout
    assert "imports: 1 megatron first: False" in out.stdout


@needs_megatron
def test_npus_refuse_a_process_where_megatron_came_before_the_adaptor():
    import megatron.core  # noqa: F401 - this process has imported it (other tests here do too)

    with pytest.raises(RuntimeError, match=r"megatron-core was imported in this process before MindSpeed's adaptor \(mindspeed.megatron_adaptor\)"):
        prepare_megatron(_platform("npu"))
