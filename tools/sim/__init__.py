"""tidal.tools.sim: the cost models of the cluster simulator (`tidal simulate`).

The simulator runs the real scheduler on a virtual clock with simulated engines; the
durations those engines report come from here:

- `hardware`: accelerator profiles (`Device`, `DEVICES`, `device`), each figure cited;
- `costs`: roofline cost models of decode, prefill, generation under continuous batching,
  training steps and weight syncs (`ModelShape`, `Efficiency`, `*_s` functions);
- `lengths`: response lengths, sampled (`LengthModel`) or replayed from a trace (`replay`);
- `cluster`: cluster spec files (`load_cluster`) turned into `flow.placement.Resource`s.

Pure Python: nothing here imports torch or a vendor library.
"""

from tidal.tools.sim.cluster import ClusterSpec, NodeGroup, load_cluster, parse_cluster
from tidal.tools.sim.costs import (
    DEFAULT_EFFICIENCY,
    Efficiency,
    ModelShape,
    decode_slots,
    decode_step_s,
    generate_s,
    kv_bytes_per_token,
    max_concurrent_tokens,
    prefill_s,
    train_step_s,
    weight_sync_s,
)
from tidal.tools.sim.hardware import DEVICES, Device, device
from tidal.tools.sim.lengths import LengthModel, replay

__all__ = [
    "DEFAULT_EFFICIENCY",
    "DEVICES",
    "ClusterSpec",
    "Device",
    "Efficiency",
    "LengthModel",
    "ModelShape",
    "NodeGroup",
    "decode_slots",
    "decode_step_s",
    "device",
    "generate_s",
    "kv_bytes_per_token",
    "load_cluster",
    "max_concurrent_tokens",
    "parse_cluster",
    "prefill_s",
    "replay",
    "train_step_s",
    "weight_sync_s",
]
