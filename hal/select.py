"""Choosing this process's platform.

Order: the `TIDAL_DEVICE` variable, then the recipe's `device:` key, then detection
(NPU, then CUDA, then CPU). Detection imports nothing vendor-specific and creates no
device context. A platform that was asked for but cannot load is an error saying what is
missing; tidal never falls back from an accelerator to CPU on its own.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
from collections.abc import Callable

import torch

from tidal.hal import cuda, npu
from tidal.hal.cpu import MAX_FAKE_DEVICES, CpuPlatform, fake_platform
from tidal.hal.platform import KINDS, Platform, PlatformUnavailable

ENV_VAR = "TIDAL_DEVICE"
VALID_SPECS = f"auto, cpu, cuda, npu, fake:<kind>:<n> (kind one of cuda, npu, cpu; 0 <= n <= {MAX_FAKE_DEVICES}), e.g. fake:npu:8"
_FAKE = re.compile(r"fake:(?P<kind>[a-z]+):(?P<n>[0-9]+)")  # ASCII digits only (`\d` takes any script's)

_LOADERS: dict[str, Callable[[], Platform]] = {"cpu": CpuPlatform, "cuda": cuda.load, "npu": npu.load}


@dataclasses.dataclass(frozen=True)
class Selection:
    """The chosen platform and how it was chosen (what `tidal doctor` prints)."""

    platform: Platform
    spec: str
    """The resolved spec, e.g. `cpu` or `fake:npu:8`."""
    chosen_by: str
    """`TIDAL_DEVICE`, `recipe device key` or `detection`."""
    reason: str


def check_spec(spec: str, *, source: str = ENV_VAR) -> str:
    """Return `spec` normalised, or raise ValueError naming `source` and the valid values.

    Normalised: no surrounding spaces, lower case, and a fake platform's count without
    leading zeros (`fake:npu:08` is `fake:npu:8`), so two spellings of one platform compare
    equal (`init_platform` refuses a second, different spec).
    """
    text = spec.strip().lower()
    if text in ("auto", *KINDS):
        return text
    m = _FAKE.fullmatch(text)
    if m and m["kind"] in KINDS:
        n = m["n"].lstrip("0") or "0"
        if len(n) > len(str(MAX_FAKE_DEVICES)) or int(n) > MAX_FAKE_DEVICES:  # by length first: int() refuses over 4300 digits
            raise ValueError(f"{source}={spec!r}: a fake platform has at most {MAX_FAKE_DEVICES} devices (one machine's), got {n}")
        return f"fake:{m['kind']}:{n}"
    raise ValueError(f"{source}={spec!r} is not a platform; valid values: {VALID_SPECS}")


def detect() -> tuple[str, str]:
    """Pick a kind without importing torch_npu or creating a CUDA context; return (kind, why)."""
    if npu.installed():
        return "npu", "torch_npu is installed"
    if cuda.available():
        return "cuda", f"torch {torch.__version__} sees {torch.cuda.device_count()} CUDA device(s)"
    why = "torch_npu is not installed"
    if not torch.backends.cuda.is_built():
        why += f"; torch {torch.__version__} was built without CUDA"
    else:
        why += "; no CUDA device is visible"
    return "cpu", why


def availability() -> dict[str, tuple[bool, str]]:
    """For each kind, whether it looks loadable here and why, importing no vendor module."""
    if npu.installed():
        npu_state = (True, "torch_npu is installed (CANN is checked when it loads)")
    else:
        npu_state = (False, "needs torch_npu and the CANN toolkit")
    if cuda.available():
        cuda_state = (True, f"{torch.cuda.device_count()} CUDA device(s) visible")
    elif not torch.backends.cuda.is_built():
        cuda_state = (False, f"needs a CUDA build of torch (this is {torch.__version__})")
    else:
        cuda_state = (False, "no CUDA device is visible")
    return {"cpu": (True, "cpu is always available"), "cuda": cuda_state, "npu": npu_state}


def load(spec: str) -> Platform:
    """Load the platform for a checked, non-auto spec."""
    m = _FAKE.fullmatch(spec)
    if m:
        return fake_platform(m["kind"], int(m["n"]))
    return _LOADERS[spec]()


def select_platform(recipe_device: str | None = None) -> Selection:
    """Choose and load a platform (not cached; see `init_platform`).

    Raises:
        PlatformUnavailable: the chosen platform cannot load; the message adds who chose it
            (`TIDAL_DEVICE`, the recipe's `device` key or detection) and how to pick another.
    """
    env = os.environ.get(ENV_VAR, "").strip()
    if env and check_spec(env) != "auto":
        spec, chosen_by, reason = check_spec(env), ENV_VAR, f"{ENV_VAR}={env}"
    elif recipe_device and check_spec(recipe_device, source="device") != "auto":
        spec = check_spec(recipe_device, source="device")
        chosen_by, reason = "recipe device key", f"recipe device: {recipe_device}"
    else:
        spec, reason = detect()
        chosen_by = "detection"
    try:
        platform = load(spec)
    except PlatformUnavailable as e:  # the loader says what is missing, not where `spec` came from
        raise PlatformUnavailable(f"{e} (platform {spec!r} was chosen by {chosen_by}: {reason}; set {ENV_VAR}=cpu (or another platform) to run elsewhere)") from e
    return Selection(platform=platform, spec=spec, chosen_by=chosen_by, reason=reason)


_current: Selection | None = None
_selecting = threading.Lock()
"""Held while the platform is selected, so threads that ask at once get one platform
object, not one each (a `set_visible_devices` or peak-memory reset on one would not show
on the other). Today every process selects before it starts threads (rollout actors in
`__init__`, the trainer before its stages); a threaded Ray actor (`max_concurrency`) whose
first method call selects would race without it. Uncontended once selected: the fast
path reads `_current` without it."""

DEEPSPEED_VAR = "DS_ACCELERATOR"
"""The variable DeepSpeed reads, once, when it is first imported, to pick its accelerator."""
DEEPSPEED_SET_VAR = "TIDAL_DS_ACCELERATOR"
"""What tidal last set `DS_ACCELERATOR` to (inherited by child processes with it)."""


def name_deepspeed_accelerator(platform: Platform) -> None:
    """Set `DS_ACCELERATOR` to the DeepSpeed accelerator `platform` computes with, unless the
    user set it (it then differs from what tidal last set, `TIDAL_DS_ACCELERATOR`).

    DeepSpeed may be imported by other libraries, not only by the deepspeed train engine:
    with accelerate installed (peft needs it), every transformers `save_pretrained` imports
    it. Left to detect its accelerator it prints a warning to stdout, and the accelerator it
    picks stays for the process."""
    given, ours = os.environ.get(DEEPSPEED_VAR), os.environ.get(DEEPSPEED_SET_VAR)
    if given is None or given == ours:
        os.environ[DEEPSPEED_VAR] = os.environ[DEEPSPEED_SET_VAR] = platform.descriptor.deepspeed_accelerator


def init_platform(recipe_device: str | None = None) -> Selection:
    """Select this process's platform once; later calls return the same selection.

    Raises:
        RuntimeError: a later call names a different platform than the one selected.
    """
    global _current
    current = _current
    if current is None:
        with _selecting:
            if _current is None:
                _current = select_platform(recipe_device)
                name_deepspeed_accelerator(_current.platform)
                return _current
            current = _current
    wanted = check_spec(recipe_device, source="device") if recipe_device else "auto"
    if wanted not in ("auto", current.spec) and current.chosen_by != ENV_VAR:
        raise RuntimeError(f"this process already runs on platform {current.spec!r}; it cannot switch to {wanted!r}")
    return current


def current_platform() -> Platform:
    """The process's platform, selected on first use."""
    return init_platform().platform


def reset_platform() -> None:
    """Forget the selected platform (tests and tools that switch platforms)."""
    global _current
    with _selecting:
        _current = None
