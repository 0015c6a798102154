"""Calibration: the simulator's efficiency factors fitted from a `tidal profile` of a real device.

A profile (`tools.sim.profile`) holds times measured on one device: decode steps over batch
and context, prefills, training steps, and the device's own achievable peaks (a large
matmul's FLOP/s, a large copy's bytes/s). Each measured time is compared with what the
roofline of `tools.sim.costs` gives for the same work at those peaks with every efficiency
at 1 (the ideal time). Each section's points are fitted by a line, measured = fixed cost
+ ideal / factor (least squares): the factor is the fraction of peak the work reaches,
and the fixed cost what each step costs besides (kernel launches, the engine's Python),
which dominates a small model or a small batch. Without two distinct points, or where the
line is not physical (a negative fixed cost), the fixed cost is 0 and the factor the
median ratio ideal / measured. The factors:

- `decode_bandwidth`: from the decode steps (the roofline's max of reading the weights and
  KV cache, and the matmul FLOPs; a compute-bound point's ratio lands on the same factor);
- `prefill_compute`: from the prefills;
- `train_mfu`: from the training steps (6 x params x tokens FLOPs, 8 x for a point that
  recomputed activations: `model.gradient_checkpointing`, each point's `recompute`);

and the fixed costs `decode_step_overhead_s`, `prefill_overhead_s` and
`train_step_overhead_s` of `costs.Efficiency`. A profile's whole generate calls
(`generate`, optional) are set against what the simulator charges for the same call
(`costs.generate_s` with the factors above): what is left over, fitted by a line over
the calls' decode steps, is `generate_call_overhead_s` (its fixed part: the engine's own
work once a call) and an addition to `decode_step_overhead_s` (its slope: sampling and
the loop's work each step, which a bare forward pass leaves out); `ipc_setup_s` is the profile's weight export
and load less the copy the cost model charges anyway (on the profiled device, an `ipc` sync
costs what cloning and loading the weights did there; the handle exchange between
processes of an accelerator is not in it). A profile's `contention` (each role's work
beside the other's on one host) becomes `train_beside_rollout` and `rollout_beside_train`.

The assumption that carries a fit to the cluster's devices: software reaches the same
fraction of a device's peak on the cluster as on the profiled device. That is close for
the same engine on the same kind of device, and only a first guess across kinds (a CPU
profile calibrates the loop's overheads, not an accelerator's kernels). A prediction that
runs the engines at batches, contexts or step sizes beyond the profiled ones says so
(`extrapolations`).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping
from typing import Any

from tidal.tools.sim import costs
from tidal.tools.sim.costs import DEFAULT_EFFICIENCY, Efficiency, ModelShape
from tidal.tools.sim.hardware import Device

_IDEAL = Efficiency(train_mfu=1.0, decode_bandwidth=1.0, prefill_compute=1.0, network=1.0)
_FLOOR = 1e-4
"""The least a fitted factor may be (a factor of 0 would make every cost infinite)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Calibration:
    """Efficiency factors fitted from a profile, and the ranges the profile covered."""

    eff: Efficiency
    source: str
    """What was profiled: file, platform, model, date."""
    factors: dict[str, list[float]]
    """Each factor's per-point ratios (measured against the roofline), for reports."""
    max_decode_batch: int
    max_context: int
    """Per sequence, real tokens."""
    max_train_tokens: int
    """Per device and step."""


def profiled_device(profile: Mapping[str, Any]) -> Device:
    """The profiled device as a `Device` whose peaks are the measured ones (links unused)."""
    peak = profile["peak"]
    host = profile.get("host_device_bytes_per_s") or peak["bytes_per_s"]
    kind = profile["platform"]["kind"] if profile["platform"]["kind"] in ("npu", "cuda", "cpu") else "cpu"
    return Device(name="profiled", kind=kind, bf16_tflops=peak["flops"] / 1e12, hbm_gib=1024.0, hbm_gbps=peak["bytes_per_s"] / 1e9, scale_up_gbps=1.0, scale_out_gbps=1.0, pcie_gbps=host / 1e9, devices_per_node=1)


def profiled_model(profile: Mapping[str, Any]) -> ModelShape:
    m = profile["model"]
    return ModelShape(
        num_params=int(m["num_params"]),
        num_layers=int(m["num_layers"]),
        hidden_size=int(m["hidden_size"]),
        num_kv_heads=int(m["num_kv_heads"]),
        head_dim=int(m["head_dim"]),
        bytes_per_param=int(m["bytes_per_param"]),
        name=str(m.get("name", "profiled")),
    )


def _factor(ideal: list[float], measured: list[float], name: str, source: str) -> tuple[float, float]:
    """(efficiency, overhead seconds) with measured ~ overhead + ideal / efficiency, by least
    squares over the points. A small model's step is mostly fixed cost (kernel launches,
    Python), which a ratio alone would spread over the work and so under-predict large
    batches; the line separates the two. With one point, a flat or falling line, or a
    negative overhead, the overhead is 0 and the efficiency the median ratio (as a ratio
    fit). The efficiency stays in [`_FLOOR`, 1]; the overhead is then the mean remainder."""
    if not ideal:
        raise ValueError(f"{source}: the profile has no {name} points to fit")
    ratio = min(max(statistics.median(i / m for i, m in zip(ideal, measured)), _FLOOR), 1.0)
    if len(ideal) < 2 or len(set(ideal)) < 2:
        return ratio, 0.0
    slope, overhead = statistics.linear_regression(ideal, measured)
    if slope <= 0 or overhead < 0:
        return ratio, 0.0
    eff = min(max(1 / slope, _FLOOR), 1.0)
    overhead = max(statistics.mean(m - i / eff for i, m in zip(ideal, measured)), 0.0)
    return eff, overhead


def _contention(measured: Mapping[str, float] | None) -> dict[str, float]:
    """The slowdowns a profile measured (none: each role at full speed); one measured
    faster beside the other (timing noise) counts as 1."""
    if not measured:
        return {}
    return {"train_beside_rollout": max(1.0, float(measured["train"])), "rollout_beside_train": max(1.0, float(measured["rollout"]))}


def _ipc_setup_s(weights: Mapping[str, float], device: Device, decode_bandwidth: float) -> float:
    """An `ipc` weight sync's cost beside its copy: the profile's weight export and load,
    less the copy `costs.weight_sync_s` charges on its own."""
    copy_s = weights["bytes"] / (device.hbm_bytes_per_s * decode_bandwidth)
    return max(0.0, weights["export_s"] + weights["load_s"] - copy_s)


def _generate_overheads(calls: list[Mapping[str, Any]], model: ModelShape, device: Device, eff: Efficiency) -> Efficiency:
    """`eff` with the per-call and the extra per-step cost of the profile's whole generate
    calls: measured less `costs.generate_s` at `eff`, by least squares over the calls'
    steps (one point, or a line that is not physical: the mean remainder, per call)."""
    if not calls:
        return eff
    steps = [float(c["new_tokens"]) for c in calls]
    left = [c["seconds"] - costs.generate_s(model, device, tp=1, prompt_tokens=c["prompt"], response_tokens=[c["new_tokens"]] * c["batch"], slots=c["batch"], eff=eff) for c in calls]
    per_step, per_call = 0.0, statistics.mean(left)
    if len(set(steps)) > 1:
        slope, intercept = statistics.linear_regression(steps, left)
        if slope >= 0 and intercept >= 0:
            per_step, per_call = slope, intercept
    return dataclasses.replace(eff, generate_call_overhead_s=max(per_call, 0.0), decode_step_overhead_s=eff.decode_step_overhead_s + per_step)


def fit(profile: Mapping[str, Any], *, source: str) -> Calibration:
    """The efficiency factors and fixed per-step costs a profile measured (module docstring).

    Raises:
        ValueError: naming `source`, when a section has no points.
    """
    device, model = profiled_device(profile), profiled_model(profile)
    decode = [costs.decode_step_s(model, device, tp=1, batch=p["batch"], context_tokens=p["batch"] * p["context"], eff=_IDEAL) for p in profile["decode"]]
    prefill = [costs.prefill_s(model, device, tp=1, tokens=p["batch"] * p["context"], eff=_IDEAL) for p in profile["prefill"]]
    train = [costs.train_flops_per_token(model, recompute=bool(p.get("recompute", False))) * p["tokens"] / device.flops for p in profile["train"]]  # no "recompute" before 2026-11-29: off
    times = {key: [p["seconds"] for p in profile[key]] for key in ("decode", "prefill", "train")}
    decode_eff, decode_overhead = _factor(decode, times["decode"], "decode", source)
    prefill_eff, prefill_overhead = _factor(prefill, times["prefill"], "prefill", source)
    train_eff, train_overhead = _factor(train, times["train"], "train", source)
    eff = dataclasses.replace(
        DEFAULT_EFFICIENCY,
        decode_bandwidth=decode_eff,
        prefill_compute=prefill_eff,
        train_mfu=train_eff,
        decode_step_overhead_s=decode_overhead,
        prefill_overhead_s=prefill_overhead,
        train_step_overhead_s=train_overhead,
        ipc_setup_s=_ipc_setup_s(profile["weights"], device, decode_eff),
        **_contention(profile.get("contention")),
    )
    eff = _generate_overheads(profile.get("generate", []), model, device, eff)
    what = f"{source} ({profile['platform']['kind']}, {model.name}, {profile.get('date', 'undated')})"
    ratios = {k: [i / m for i, m in zip(ideal, times[section])] for k, ideal, section in (("decode_bandwidth", decode, "decode"), ("prefill_compute", prefill, "prefill"), ("train_mfu", train, "train"))}
    return Calibration(
        eff=eff,
        source=what,
        factors=ratios,
        max_decode_batch=max(p["batch"] for p in profile["decode"]),
        max_context=max(p["context"] for p in profile["decode"]),
        max_train_tokens=max(p["tokens"] for p in profile["train"]),
    )


def extrapolations(cal: Calibration, *, decode_batch: int, context: int, train_tokens: int) -> list[str]:
    """Where a prediction runs past what the profile measured (each a sentence)."""
    out = []
    if decode_batch > cal.max_decode_batch:
        out.append(f"decode batches of up to {decode_batch} sequences; the profile measured up to {cal.max_decode_batch}")
    if context > cal.max_context:
        out.append(f"contexts of up to {context} tokens a sequence; the profile measured up to {cal.max_context}")
    if train_tokens > cal.max_train_tokens:
        out.append(f"training steps of {train_tokens:,} tokens a device; the profile measured up to {cal.max_train_tokens:,}")
    return out
