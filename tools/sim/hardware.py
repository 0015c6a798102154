"""Accelerator profiles for the cluster simulator: the few numbers its cost models read.

Each profile is a datasheet's peak, not a measurement: the cost models (`tools.sim.costs`)
scale peaks by the efficiency factors of `costs.Efficiency`, so a profile stays a
citation and the assumptions about how much of it a workload reaches live in one place.

Units: TFLOPs are 1e12 floating-point operations per second (dense bf16, never the
"with sparsity" figure datasheets print first); bandwidths are GB/s = 1e9 bytes per
second in one direction (datasheets that quote bidirectional totals are halved); HBM
capacity is the datasheet figure, read as GiB (HBM stacks are sized in binary units, and
the capacity a device reports is within about 1% of it; `memory_fraction` in
`costs.max_concurrent_tokens` absorbs the rest and the runtime's reservations).

`scale_out_gbps` and `pcie_gbps` describe the server a device usually ships in (NIC per
device, host CPU's PCIe generation), not the chip alone; a cluster spec overrides them
(`tools.sim.cluster`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

KINDS = ("npu", "cuda", "cpu")
"""Device kinds, as `tidal.flow.placement.Resource.kind` spells them."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator's peak figures (see the module docstring for units)."""

    name: str
    """Lowercase registry name, also the tag its nodes carry (`"h100"`)."""
    kind: str
    """`npu` (Ascend), `cuda` (NVIDIA), or `cpu` (a host profiled by `tidal profile`)."""
    bf16_tflops: float
    """Dense bf16 matrix throughput."""
    hbm_gib: float
    """Device memory."""
    hbm_gbps: float
    """Device memory bandwidth."""
    scale_up_gbps: float
    """Intra-node link (HCCS, NVLink) per device, per direction."""
    scale_out_gbps: float
    """Inter-node network (RoCE, InfiniBand) per device, per direction."""
    pcie_gbps: float
    """Host <-> device copies, per direction."""
    devices_per_node: int
    """Devices in one server."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"device {self.name!r}: kind={self.kind!r} is not one of {', '.join(KINDS)}")
        for field in _NUMERIC:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"device {self.name!r}: {field} must be a number > 0, got {value!r}")
        if not isinstance(self.devices_per_node, int):
            raise ValueError(f"device {self.name!r}: devices_per_node must be an integer, got {self.devices_per_node!r}")

    @property
    def flops(self) -> float:
        """Peak dense bf16 FLOP/s."""
        return self.bf16_tflops * 1e12

    @property
    def memory_is_host(self) -> bool:
        """A host profiled as the device (`kind` cpu): its state sits in host memory already,
        so parking it moves nothing (as hal's CPU platform's `offload`)."""
        return self.kind == "cpu"

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gib * 2**30

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_gbps * 1e9


_NUMERIC = tuple(f.name for f in dataclasses.fields(Device) if f.name not in ("name", "kind"))
OVERRIDABLE = _NUMERIC
"""The fields `device(name, **overrides)` accepts: every figure, not the name or kind."""


ASCEND_910B = Device(
    name="910b",
    kind="npu",
    # Huawei publishes no per-chip bf16 figure; the 64 GB SKUs are reported at 313 (910B3)
    # to 414 (910B1) TFLOPS FP16, the 32 GB 910B4 at 280. Conservative: the lowest 64 GB SKU.
    bf16_tflops=313.0,
    # 64 GB HBM2e: Huawei Atlas 800T A2 datasheet (e.huawei.com, "Atlas 800T A2 training server").
    hbm_gib=64.0,
    # Not in Huawei's datasheets; 1.6 TB/s is the figure reported for the 64 GB SKUs
    # (third-party spec tables; the 910B4 has 0.8). Disputed: override when measured.
    hbm_gbps=1600.0,
    # HCCS full mesh of 8: 7 links x 56 GB/s = 392 GB/s per device (Atlas 800T A2
    # white paper). Whether that is per direction is not stated: conservative, halved.
    scale_up_gbps=196.0,
    # Atlas 800T A2: 8 x 200GE RoCE ports, one per NPU -> 25 GB/s per device.
    scale_out_gbps=25.0,
    # Host Kunpeng 920 CPUs are PCIe 4.0: x16 = 32 GB/s per direction (PCI-SIG Gen4 rate).
    pcie_gbps=32.0,
    devices_per_node=8,  # Atlas 800T A2: 8 NPUs per server
)

ASCEND_910C = Device(
    name="910c",
    kind="npu",
    # Two 910B-class dies in one package. "Serving Large Language Models on Huawei
    # CloudMatrix384" (Huawei, arXiv:2506.12708, sec. 3) gives 752 TFLOPS BF16 dense per
    # package; Huawei's 2025 roadmap slide says ~800. Conservative: the paper's 752.
    bf16_tflops=752.0,
    # 128 GB HBM at 3.2 TB/s (8 HBM2E stacks): arXiv:2506.12708, and Huawei's roadmap slide.
    hbm_gib=128.0,
    hbm_gbps=3200.0,
    # Unified Bus: the roadmap slide gives 784 GB/s per package (read as bidirectional,
    # both dies: 392 per direction); CloudMatrix384 analyses quote 196 GB/s per NPU die.
    # Disputed: conservative 196 GB/s per direction.
    scale_up_gbps=196.0,
    # RDMA plane of CloudMatrix384: up to 400 Gb/s per NPU (arXiv:2506.12708); outside a
    # supernode the per-device NIC is not public: conservative 200 Gb/s = 25 GB/s, as the 910B.
    scale_out_gbps=25.0,
    # Host link not public: conservative PCIe 4.0 x16 (Kunpeng 920 hosts), as the 910B.
    pcie_gbps=32.0,
    devices_per_node=8,  # CloudMatrix384 compute node: 8 NPUs (arXiv:2506.12708)
)

H100_SXM = Device(
    name="h100",
    kind="cuda",
    # NVIDIA H100 datasheet (nvidia.com/en-us/data-center/h100): BF16 1,979 TFLOPS with
    # sparsity -> 989 dense; 80 GB HBM3 at 3.35 TB/s (SXM).
    bf16_tflops=989.0,
    hbm_gib=80.0,
    hbm_gbps=3350.0,
    # NVLink 4: 900 GB/s bidirectional per GPU (same datasheet) -> 450 per direction.
    scale_up_gbps=450.0,
    # DGX H100 user guide: 8 x ConnectX-7 400 Gb/s InfiniBand, one per GPU -> 50 GB/s.
    scale_out_gbps=50.0,
    # PCIe Gen5: 128 GB/s bidirectional (datasheet) -> 64 per direction.
    pcie_gbps=64.0,
    devices_per_node=8,  # HGX / DGX H100: 8 GPUs
)

H200_SXM = Device(
    name="h200",
    kind="cuda",
    # NVIDIA H200 datasheet (nvidia.com/en-us/data-center/h200): same compute as H100
    # (BF16 1,979 with sparsity -> 989 dense), 141 GB HBM3e at 4.8 TB/s.
    bf16_tflops=989.0,
    hbm_gib=141.0,
    hbm_gbps=4800.0,
    scale_up_gbps=450.0,  # NVLink 4: 900 GB/s bidirectional (datasheet)
    scale_out_gbps=50.0,  # DGX H200: 8 x ConnectX-7 400 Gb/s, one per GPU
    pcie_gbps=64.0,  # PCIe Gen5: 128 GB/s bidirectional (datasheet)
    devices_per_node=8,  # HGX / DGX H200: 8 GPUs
)

H20 = Device(
    name="h20",
    kind="cuda",
    # NVIDIA publishes no H20 datasheet on its site; the figures widely reported from its
    # partner spec sheet (SemiAnalysis and press, Nov 2023): 148 TFLOPS BF16 dense, 96 GB
    # HBM3 at 4.0 TB/s, NVLink 900 GB/s, PCIe Gen5. (A later 141 GB variant exists.)
    bf16_tflops=148.0,
    hbm_gib=96.0,
    hbm_gbps=4000.0,
    scale_up_gbps=450.0,  # NVLink 900 GB/s bidirectional, reported as above
    # No reference server: NICs vary by vendor. Conservative 200 Gb/s per GPU.
    scale_out_gbps=25.0,
    pcie_gbps=64.0,  # PCIe Gen5 x16, 128 GB/s bidirectional
    devices_per_node=8,  # HGX H20 boards: 8 GPUs
)

DEVICES: Mapping[str, Device] = {d.name: d for d in (ASCEND_910B, ASCEND_910C, H100_SXM, H200_SXM, H20)}
"""Every profile by its lowercase name."""


def device(name: str, *, known: Mapping[str, Device] = DEVICES, **overrides: Any) -> Device:
    """The profile called `name` (any case), with `overrides` replacing its figures.

    Args:
        name: a key of `known` (default `DEVICES`), e.g. `"h100"`.
        known: the profiles by name (`DEVICES` and, say, a `tidal profile`'s device).
        **overrides: fields of `OVERRIDABLE`, e.g. `scale_out_gbps=25` for a cluster with
            200 Gb/s NICs.

    Raises:
        ValueError: the name is not a profile, an override names no figure, or a value is
            not a positive number.
    """
    key = str(name).lower()
    if key not in known:
        raise ValueError(f"unknown device {name!r}; valid devices: {', '.join(known)}")
    unknown = sorted(set(overrides) - set(OVERRIDABLE))
    if unknown:
        raise ValueError(f"device {key!r}: unknown override(s) {', '.join(unknown)}; valid overrides: {', '.join(OVERRIDABLE)}")
    return dataclasses.replace(known[key], **overrides)
