"""Selection, descriptors, and every platform concern on the cpu and fake platforms."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

from tidal import hal
from tidal.hal.cpu import CpuPlatform, fake_platform
from tidal.hal.platform import NoopEvent, NoopStream


# Selection ------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["cpu", "cuda", "npu", "auto", "fake:npu:8", "fake:cuda:0", " CPU "])
def test_check_spec_accepts_valid_values(spec):
    assert hal.check_spec(spec) == spec.strip().lower()


@pytest.mark.parametrize("spec", ["bogus", "gpu", "fake:npu", "fake:tpu:2", "fake:npu:-1", "fake:npu:x", ""])
def test_check_spec_rejects_and_lists_valid_values(spec):
    with pytest.raises(ValueError) as e:
        hal.check_spec(spec)
    assert "TIDAL_DEVICE" in str(e.value)
    assert "fake:<kind>:<n>" in str(e.value) and "cuda" in str(e.value) and "npu" in str(e.value)


@pytest.mark.parametrize(("spec", "normal"), [("fake:npu:08", "fake:npu:8"), (" FAKE:CUDA:002 ", "fake:cuda:2"), ("fake:npu:000", "fake:npu:0")])
def test_check_spec_writes_a_fake_count_without_leading_zeros(spec, normal):
    assert hal.check_spec(spec) == normal


@pytest.mark.parametrize("spec", ["fake:npu:\u0668", "fake:npu:+8", "fake: npu:8", "fake:npu:8:1", "fake:npu:8 1", "fake:NPU :8"])
def test_check_spec_takes_only_ascii_digits_and_no_inner_spaces(spec):
    """`\\d` took any script's digits (an Arabic-Indic eight made 8 fake NPUs)."""
    with pytest.raises(ValueError, match="is not a platform"):
        hal.check_spec(spec)


@pytest.mark.parametrize("count", ["1025", "100000000000", "0" * 9 + "2000", "9" * 5000])
def test_a_fake_platform_has_at_most_one_machines_devices(count):
    """A count with digits too many (fake:npu:80 for 8) reached the planner, which listed
    every device until memory ran out; one of 5000 digits is over what int() reads."""
    with pytest.raises(ValueError, match=rf"TIDAL_DEVICE='fake:npu:{count}': a fake platform has at most 1024 devices \(one machine's\), got {count.lstrip('0')}"):
        hal.check_spec(f"fake:npu:{count}")
    assert hal.check_spec("fake:npu:01024") == "fake:npu:1024"
    with pytest.raises(ValueError, match="a fake platform needs 0 <= num_devices <= 1024, got 1,025"):
        fake_platform("npu", 1025)


def test_two_spellings_of_one_fake_platform_are_one_platform():
    first = hal.init_platform("fake:npu:8")
    assert first.spec == "fake:npu:8"
    assert hal.init_platform("fake:npu:08") is first  # was "cannot switch to 'fake:npu:08'"
    hal.reset_platform()
    assert hal.init_platform("fake:npu:08").spec == "fake:npu:8"


def test_threads_selecting_at_once_get_one_platform(monkeypatch):
    """Two threads asking for the platform before it is chosen (a threaded Ray actor's
    methods) get the same object; the platform is loaded once."""
    from tidal.hal import select

    loads, second_loading = [], threading.Event()
    real_load = select.load

    def slow_load(spec):
        loads.append(spec)
        if len(loads) == 1:
            second_loading.wait(timeout=0.5)  # without the lock the other thread loads meanwhile
        else:
            second_loading.set()
        return real_load(spec)

    monkeypatch.setattr(select, "load", slow_load)
    monkeypatch.setenv("TIDAL_DEVICE", "fake:npu:2")
    got = []
    threads = [threading.Thread(target=lambda: got.append(hal.current_platform())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert len(got) == 2 and got[0] is got[1]
    assert loads == ["fake:npu:2"]


def test_detection_picks_cpu_here_and_says_why():
    kind, why = hal.detect()
    assert kind == "cpu"
    assert "torch_npu is not installed" in why


def test_env_var_wins_over_recipe(monkeypatch):
    monkeypatch.setenv("TIDAL_DEVICE", "fake:cuda:4")
    sel = hal.select_platform("fake:npu:2")
    assert sel.spec == "fake:cuda:4" and sel.chosen_by == "TIDAL_DEVICE"
    assert sel.platform.descriptor.kind == "cuda" and sel.platform.device_count() == 4


def test_recipe_device_used_without_env():
    sel = hal.select_platform("fake:npu:2")
    assert (sel.spec, sel.chosen_by) == ("fake:npu:2", "recipe device key")
    sel = hal.select_platform("auto")
    assert sel.chosen_by == "detection" and sel.spec == "cpu"


def test_requested_cuda_without_cuda_build_is_an_error_not_a_fallback(monkeypatch):
    monkeypatch.setenv("TIDAL_DEVICE", "cuda")
    if torch.backends.cuda.is_built():
        pytest.skip("this torch has CUDA")
    with pytest.raises(hal.PlatformUnavailable, match="CUDA build of torch"):
        hal.select_platform()


def test_requested_npu_without_torch_npu_says_what_is_missing(monkeypatch):
    monkeypatch.setenv("TIDAL_DEVICE", "npu")
    with pytest.raises(hal.PlatformUnavailable) as e:
        hal.select_platform()
    assert "torch_npu" in str(e.value) and "CANN" in str(e.value)


@pytest.mark.parametrize(("env", "recipe", "chosen_by"), [("npu", None, "TIDAL_DEVICE: TIDAL_DEVICE=npu"), (None, "npu", "recipe device key: recipe device: npu"), ("auto", "npu", "recipe device key: recipe device: npu")])
def test_a_platform_that_cannot_load_says_who_chose_it_and_how_to_pick_another(monkeypatch, env, recipe, chosen_by):
    """The loader's reason alone ("install torch_npu") does not tell a user whose recipe says
    `device: npu` where npu came from, nor that TIDAL_DEVICE overrides it."""
    if env is None:
        monkeypatch.delenv("TIDAL_DEVICE", raising=False)
    else:
        monkeypatch.setenv("TIDAL_DEVICE", env)
    with pytest.raises(hal.PlatformUnavailable) as e:
        hal.select_platform(recipe)
    msg = str(e.value)
    assert "needs torch_npu" in msg and "CANN" in msg  # the loader's reason, kept
    assert f"platform 'npu' was chosen by {chosen_by}" in msg and "TIDAL_DEVICE=cpu" in msg
    assert isinstance(e.value.__cause__, hal.PlatformUnavailable)


def test_init_platform_is_once_per_process():
    first = hal.init_platform("fake:npu:2")
    assert hal.init_platform() is first and hal.current_platform() is first.platform
    assert hal.init_platform("fake:npu:2") is first
    with pytest.raises(RuntimeError, match="cannot switch"):
        hal.init_platform("cpu")


def test_import_touches_no_vendor_and_no_cuda_context():
    code = textwrap.dedent(
        """
        import sys, json
        import tidal.hal as hal
        hal.detect(); hal.availability()
        import torch
        print(json.dumps({"torch_npu": "torch_npu" in sys.modules, "cuda_init": torch.cuda.is_initialized()}))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TIDAL_DEVICE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert json.loads(out.stdout) == {"torch_npu": False, "cuda_init": False}


# Descriptors ----------------------------------------------------------------------------
@pytest.mark.parametrize("platform", [CpuPlatform(), fake_platform("npu", 2)])
def test_cpu_and_fake_platforms_step_adamw_fused(platform):
    """A fake NPU computes on CPU tensors, so it takes the CPU's optimizer options."""
    assert platform.optimizer_options() == {"fused": True}
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.AdamW([weight], lr=0.1, **platform.optimizer_options())
    weight.grad = torch.ones(3)
    optimizer.step()
    assert optimizer.param_groups[0]["fused"] is True
    assert torch.allclose(weight.detach(), torch.full((3,), 1 - 0.1 * 0.01 - 0.1), atol=1e-6)  # decay lr*wd*w, then Adam's first step is lr


def test_descriptor_round_trips_through_json():
    d = fake_platform("npu", 8).descriptor
    again = hal.PlatformDescriptor.from_dict(json.loads(json.dumps(d.to_dict())))
    assert again == d
    assert (d.kind, d.device_type, d.dist_backend, d.ray_resource) == ("npu", "npu", "hccl", "NPU")
    assert d.visible_devices_var == "ASCEND_RT_VISIBLE_DEVICES"
    assert d.ray_noset_var == "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"
    assert d.device_count == 8 and d.fake
    with pytest.raises(ValueError, match="bogus"):
        hal.PlatformDescriptor.from_dict({**d.to_dict(), "bogus": 1})


def test_cuda_descriptor_identity():
    d = hal.describe("cuda", device_count=2)
    assert (d.dist_backend, d.ray_resource, d.visible_devices_var) == ("nccl", "GPU", "CUDA_VISIBLE_DEVICES")
    assert d.ray_noset_var == "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


# Every concern on cpu and fake ------------------------------------------------------------
@pytest.fixture(params=["cpu", "fake:npu:8", "fake:cuda:2"])
def platform(request):
    return hal.select_platform(request.param).platform


def test_satisfies_protocol(platform):
    assert isinstance(platform, hal.Platform)


def test_devices_are_torch_devices(platform):
    assert platform.device() == torch.device("cpu")
    assert isinstance(platform.device(0), torch.device)
    assert platform.current_device() == torch.device("cpu")
    platform.set_device(torch.device("cpu"))
    platform.set_device("cpu")
    with pytest.raises(TypeError, match="bare ints"):
        platform.set_device(0)
    with pytest.raises(IndexError, match="sees"):
        platform.device(platform.device_count())
    platform.synchronize()


@pytest.mark.parametrize("device", ["cpu:08", " cpu", "CPU", "cpu:-1", "tpu:0"])
def test_a_device_string_torch_cannot_parse_is_a_value_error_naming_it(platform, device):
    """Was torch's RuntimeError ("Expected one of cpu, cuda, ipu, ... device type")."""
    with pytest.raises(ValueError, match=rf"device '{re.escape(device)}' is not a cpu device: expected 'cpu' or 'cpu:<index>'"):
        platform.set_device(device)


def test_rng_seed_state_and_fork(platform):
    platform.seed_all(123)
    a = (random.random(), np.random.rand(), torch.rand(1).item())
    platform.seed_all(123)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == a

    state = platform.get_rng_state()
    b = (random.random(), np.random.rand(), torch.rand(1).item())
    platform.set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == b

    platform.set_rng_state(state)
    with platform.fork_rng():
        torch.rand(5), random.random(), np.random.rand()
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == b
    with pytest.raises(ValueError, match="missing"):
        platform.set_rng_state({"python": state["python"]})
    before = torch.get_rng_state()
    with pytest.raises(ValueError, match="holds device generators but this platform has none"):
        platform.set_rng_state({**state, "device": [torch.ByteTensor(16)]})  # a GPU run's checkpoint
    assert torch.equal(torch.get_rng_state(), before)  # refused before any generator was set


@pytest.mark.parametrize("part", ["torch", "numpy", "python"])
def test_a_refused_rng_state_changes_no_generator(platform, part):
    """A state one generator refuses (here a torch state of another size, as from another
    torch build) leaves every generator as it was: Python's and NumPy's were already set
    when torch's refused, and a checkpoint restore that goes on from the host-only retry
    then mixed two runs' streams."""
    platform.seed_all(1)
    state = platform.get_rng_state()
    platform.seed_all(2)
    before = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    bad = {"torch": torch.ByteTensor(3), "numpy": ("MT19937", np.zeros(3, dtype=np.uint32), 0), "python": (3, (1, 2), None)}[part]
    with pytest.raises(ValueError, match="RNG state not restored, every generator keeps its state"):
        platform.set_rng_state({**state, part: bad})
    after = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    assert after[0] == before[0]
    assert after[1][0] == before[1][0] and np.array_equal(after[1][1], before[1][1]) and after[1][2:] == before[1][2:]
    assert torch.equal(after[2], before[2])
    platform.set_rng_state(state)  # a good state still restores
    assert random.getstate() == state["python"] and torch.equal(torch.get_rng_state(), state["torch"])


def test_streams_and_events_have_the_accelerator_api(platform):
    stream = platform.new_stream()
    assert isinstance(stream, NoopStream)
    start, end = platform.new_event(enable_timing=True), platform.new_event(enable_timing=True)
    with platform.use_stream(stream):
        start.record()
        torch.ones(100).sum()
        end.record(stream)
    end.synchronize()
    stream.wait_event(end)
    stream.wait_stream(platform.current_stream())
    assert start.query() and end.query()
    assert start.elapsed_time(end) >= 0.0
    with pytest.raises(RuntimeError, match="enable_timing"):
        NoopEvent().elapsed_time(NoopEvent())
    assert isinstance(stream.record_event(), NoopEvent)


def test_memory_figures_come_from_the_process(platform):
    allocated = platform.memory_allocated()
    assert allocated > 10 * 2**20  # torch alone is more than 10 MB resident
    assert platform.memory_reserved() >= allocated // 2
    free, total = platform.mem_get_info()
    assert 0 < free <= total
    platform.reset_peak_memory_stats()
    peak0 = platform.max_memory_allocated()
    block = torch.ones(64 * 2**20 // 4)  # 64 MB, touched
    assert platform.max_memory_allocated() >= peak0 + 32 * 2**20
    del block
    platform.empty_cache()
    assert platform.pin_memory is False


def test_dtype_flags(platform):
    flags = platform.dtype_support()
    assert set(flags) == {"bf16", "fp16", "fp64", "fp8"}
    assert flags["bf16"] and flags["fp64"] and not flags["fp8"]


def test_autocast_runs_matmuls_in_the_precision_and_keeps_parameters(platform):
    layer = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    with platform.autocast("bf16"):
        y = layer(x)
        loss = torch.nn.functional.cross_entropy(y, torch.tensor([0, 2]))  # an op autocast keeps in fp32
    assert y.dtype == torch.bfloat16 and loss.dtype == torch.float32
    assert layer.weight.dtype == torch.float32
    with platform.autocast("fp32"):
        assert layer(x).dtype == torch.float32
    assert layer(x).dtype == torch.float32  # nothing left on after the block
    with pytest.raises(ValueError, match="unknown precision 'int8': expected one of fp32, bf16, fp16"):
        platform.autocast("int8")


def test_visible_devices_and_comm_env(platform, monkeypatch):
    assert platform.comm_env_defaults() == {} and platform.apply_comm_env() == {}
    assert platform.process_group_backend == "gloo"
    var = platform.descriptor.visible_devices_var
    if var is None:
        with pytest.raises(ValueError, match="no visible-devices variable"):
            platform.set_visible_devices([0])
    else:
        monkeypatch.setenv(var, "")  # recorded, so the value set below is undone after the test
        count = platform.device_count()
        for bad in ([0, count], [1, 1]):
            with pytest.raises(ValueError, match=r"\[\d\] out of range or repeated"):
                platform.set_visible_devices(bad)
        platform.set_visible_devices([1, 0])
        assert os.environ[var] == "1,0" and platform.device_count() == platform.descriptor.device_count == 2
        platform.set_visible_devices([count - 1])  # the machine's ids, not those of the last call's two
        assert os.environ[var] == str(count - 1) and platform.device_count() == 1
        with pytest.raises(ValueError, match="device ids are integers"):
            platform.set_visible_devices(["GPU-3b2f1c6e"])


def test_profile_range_runs_its_body_and_lets_errors_through(platform):
    ran = []
    with platform.profile_range("generate"):
        ran.append(True)
    assert ran == [True]
    with pytest.raises(KeyError, match="inside"), platform.profile_range("generate"):
        raise KeyError("inside")


def test_zero_devices_report_and_refuse_to_compute():
    p = hal.select_platform("fake:cuda:0").platform
    assert p.device_count() == 0 and p.descriptor.device_count == 0
    with pytest.raises(hal.NoDeviceError, match="0 cuda devices"):
        p.device()
    with pytest.raises(hal.NoDeviceError):
        p.offload(module=torch.nn.Linear(2, 2))
    for call in (p.memory_allocated, p.max_memory_allocated, p.mem_get_info, p.new_stream, p.synchronize, p.dtype_support, lambda: p.autocast("bf16")):
        with pytest.raises(hal.NoDeviceError, match="0 cuda devices"):  # as the accelerator platform refuses them
            call()


def test_cpu_platform_repr_names_fakes():
    assert repr(CpuPlatform()) == "CpuPlatform()"
    assert repr(fake_platform("npu", 8)) == "FakePlatform(npu, 8)"


def test_a_fake_platform_with_zero_devices_still_gives_fp32_autocast_as_the_accelerator_does():
    """fp32 autocast changes nothing and needs no device: the accelerator platform gives it
    with zero devices, the fake one raised NoDeviceError (it asked for its dtype flags first)."""
    p = hal.select_platform("fake:npu:0").platform
    with p.autocast("fp32"):
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.float32
    with pytest.raises(hal.NoDeviceError):
        p.autocast("bf16")


@pytest.mark.parametrize(("device", "error"), [(0, TypeError), ("cuda:0", ValueError), ("cpu:x", ValueError)])
def test_synchronize_refuses_a_device_that_is_not_the_platforms_as_set_device_does(platform, device, error):
    """The accelerator platform refuses a bare int or another kind's device; the cpu and
    fake platforms ignored the argument, so code passing one ran in CI and failed on a GPU."""
    with pytest.raises(error, match=re.escape(repr(device)) if isinstance(device, int) else re.escape(device)):
        platform.synchronize(device)
    platform.synchronize(platform.device(0))
    platform.synchronize("cpu")


@pytest.mark.parametrize("ids", ["0,1", 3])
def test_visible_devices_not_given_as_a_list_are_refused_naming_them(ids, monkeypatch):
    """The variable's own text "0,1" was split into characters (['0', ',', '1'] named as
    the ids), and a bare int was Python's "'int' object is not iterable"."""
    platform = fake_platform("cuda", 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # recorded: the test leaves it as it was
    with pytest.raises(ValueError, match=rf"cannot make devices {re.escape(repr(ids))} visible: expected a list of device ids"):
        platform.set_visible_devices(ids)
    assert platform.device_count() == 4


def test_the_platform_names_deepspeeds_accelerator_unless_the_user_did(monkeypatch):
    """DeepSpeed picks its accelerator once, when first imported, and other libraries import
    it (accelerate, from every transformers `save_pretrained`); left to detect one it prints
    a warning on stdout. A child process inherits tidal's value and sets its own platform's."""
    from tidal.hal.select import DEEPSPEED_SET_VAR, DEEPSPEED_VAR, name_deepspeed_accelerator

    monkeypatch.delenv(DEEPSPEED_VAR, raising=False)
    monkeypatch.delenv(DEEPSPEED_SET_VAR, raising=False)
    name_deepspeed_accelerator(CpuPlatform())
    assert os.environ[DEEPSPEED_VAR] == os.environ[DEEPSPEED_SET_VAR] == "cpu"
    monkeypatch.setenv(DEEPSPEED_SET_VAR, "npu")  # a parent on an NPU platform set both
    monkeypatch.setenv(DEEPSPEED_VAR, "npu")
    name_deepspeed_accelerator(fake_platform("cuda", 2))  # a fake platform computes on the host
    assert os.environ[DEEPSPEED_VAR] == "cpu"
    monkeypatch.setenv(DEEPSPEED_VAR, "cuda")  # the user's own
    name_deepspeed_accelerator(CpuPlatform())
    assert os.environ[DEEPSPEED_VAR] == "cuda"


def test_saving_a_model_prints_nothing_where_deepspeed_and_accelerate_are_installed(tmp_path):
    """transformers' `save_pretrained` imports DeepSpeed through accelerate; a run's stdout
    (and a script's JSON lines on it) stays clean."""
    pytest.importorskip("accelerate")
    pytest.importorskip("deepspeed")
    script = textwrap.dedent(f"""
        from tidal.engines.tiny import CharTokenizer, build_tiny_qwen2, save_model
        from tidal.hal import current_platform
        current_platform()
        t = CharTokenizer()
        save_model(build_tiny_qwen2(t.vocab_size, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64), t, __import__("pathlib").Path({str(tmp_path / "m")!r}))
        import sys
        assert "deepspeed" in sys.modules  # what this test is about
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "TIDAL_DS_ACCELERATOR", "TIDAL_DEVICE")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout == ""
