"""Roofline cost models for the cluster simulator: seconds for decode, prefill, generation,
a training step and a weight sync, from a `ModelShape`, a `hardware.Device` and the
efficiency factors of `Efficiency`.

Every function is a closed formula over peak figures scaled by one efficiency factor, so
a reader can check a simulated duration by hand; what each one ignores:

- `decode_step_s`: max(memory, compute) + tensor-parallel communication. Memory is the
  weights' shard plus the KV cache read once per step; compute is 2 FLOPs per parameter
  per sequence (matmuls only: attention's score FLOPs, norms, sampling and the LM head's
  softmax are ignored, all small against the weights at decode). TP adds 2 ring
  all-reduces per layer (after attention and after the MLP) of batch x hidden activations
  over the scale-up link, each with `COLLECTIVE_LATENCY_S`; embeddings' sharding, CUDA/NPU
  graph launch gaps and the scheduler's own time are ignored.
- `prefill_s`: max(2 x params x tokens compute, one read of the weights) + the same TP
  all-reduces over tokens x hidden. The attention term quadratic in prompt length is
  ignored (below a few thousand tokens it is a few percent of the matmuls).
- `generate_s`: continuous batching of responses of different lengths with a slot limit
  (`decode_slots`) from KV capacity; see its docstring. Preemption and chunked prefill are
  not modelled.
- `train_step_s`: 6 x params x tokens FLOPs (forward + backward), 8 x with activation
  recomputation (`model.gradient_checkpointing`: the forward pass again in the backward),
  at the training MFU (the fraction of peak on the FLOPs executed), plus one ring all-reduce of the bf16 gradients
  over the slowest link; pipeline bubbles, optimizer step, and the extra traffic of
  FSDP's parameter all-gathers are ignored (the latter is folded into the MFU).
  `Efficiency.grad_overlap` says how much of the all-reduce hides under compute.
- `weight_sync_s`: one policy's weights (params x bytes) from trainer to rollout by one of
  `hal.transfer`'s transports; see its docstring.

All sizes are bytes, bandwidths bytes/s after scaling, results seconds.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Sequence

from tidal.tools.sim.hardware import Device

COLLECTIVE_LATENCY_S = 10e-6
"""Fixed cost of one small intra-node all-reduce (launch + synchronization). Assumption:
small-message all-reduce latency over NVLink/HCCS is on the order of 10 microseconds."""
NETWORK_LATENCY_S = 30e-6
"""Fixed cost of one inter-node collective or message (RDMA round trips). Assumption."""
IPC_SETUP_S = 0.02
"""Fixed cost of an `ipc` weight sync: exchanging and opening the buffer handles and the
engine's weight-reload call (`Efficiency.ipc_setup_s`'s default). Assumption: tens of
milliseconds."""
HOST_LATENCY_S = 5e-3
"""Fixed cost of a `host` weight sync: the manifest round trip and the first bucket's
device-to-host copy, which the pipeline cannot hide. Assumption."""
TRANSPORTS = ("ipc", "collective", "host")
"""The weight transports of `tidal.hal.transfer` (not imported: it loads torch)."""
MAX_NUM_SEQS = 256
"""Default cap on concurrent sequences of one engine (vLLM's `max_num_seqs` default)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Efficiency:
    """Fractions of peak a workload reaches; each in (0, 1]. Defaults are assumptions,
    typical of well-tuned dense-model runs, to be replaced by measured values."""

    train_mfu: float = 0.4
    """Model FLOPs utilization of a training step (FSDP/Megatron on dense models reach
    about 35-50% at long sequences; RL's short, padded batches sit at the low end)."""
    decode_bandwidth: float = 0.7
    """Fraction of HBM bandwidth a decode step reaches (weight and KV reads; small-batch
    GEMV kernels and paged attention reach about 60-80%). Also used for device-local copies."""
    prefill_compute: float = 0.5
    """Fraction of peak FLOPs of prefill and of compute-bound decode (large GEMMs, less
    attention and the engine's overheads)."""
    network: float = 0.8
    """Fraction of a link's peak a collective or transfer reaches (bus bandwidth)."""
    grad_overlap: float = 0.0
    """Fraction of the gradient all-reduce hidden under the backward pass, in [0, 1].
    Default none: pessimistic, and what a step with one gradient bucket gets."""
    decode_step_overhead_s: float = 0.0
    """Seconds every decode step takes beside its roofline time: kernel launches and the
    engine's own work, which a small model or a small batch is dominated by. Default
    none; `calibrate.fit` measures it with the factors above."""
    prefill_overhead_s: float = 0.0
    """The same for each prefill pass."""
    train_step_overhead_s: float = 0.0
    """The same for each training step (optimizer step, the loop's own work)."""
    generate_call_overhead_s: float = 0.0
    """Seconds each generate call takes beside its prefills and decode steps: building the
    batch, the first sampling, handing the rows back. Default none; `calibrate.fit`
    measures it from a profile's whole generate calls."""
    train_beside_rollout: float = 1.0
    """How many times longer the trainer's work takes while rollout works on the same host
    (a node both roles have devices on), >= 1. Default 1: devices of their own do not slow
    each other; on one CPU two stages share the cores, caches and the interpreter's lock
    (`tidal profile` measures it: `contention`)."""
    rollout_beside_train: float = 1.0
    """The same for rollout's work while the trainer works."""
    train_in_run: float = 1.0
    """How many times longer the trainer's work takes in a run than a profile of it alone
    measures, > 0: where the loop's own threads (the stages, the store, the workers'
    hand-offs) share the trainer's process and its interpreter lock, as in a one-process
    run on a few CPU cores. Default 1: an engine whose host keeps up with the loop.
    `tidal bench simulate-check` takes it from a real run: its time over a simulation of it."""
    rollout_in_run: float = 1.0
    """The same for rollout's work."""
    ipc_setup_s: float = IPC_SETUP_S
    """Seconds an `ipc` weight sync costs beside copying the weights: the buffer handles and
    the engine's weight reload. `calibrate.fit` takes it from a profile's weight export and
    load (where the device is the host, an ipc sync is just those: shared memory, no handles)."""

    def __post_init__(self) -> None:
        for f in ("train_mfu", "decode_bandwidth", "prefill_compute", "network"):
            value = getattr(self, f)
            if not 0 < value <= 1:
                raise ValueError(f"Efficiency.{f} must be in (0, 1], got {value!r}")
        for f in ("decode_step_overhead_s", "prefill_overhead_s", "train_step_overhead_s", "generate_call_overhead_s", "ipc_setup_s"):
            if not getattr(self, f) >= 0:
                raise ValueError(f"Efficiency.{f} must be >= 0 seconds, got {getattr(self, f)!r}")
        for f in ("train_beside_rollout", "rollout_beside_train"):
            if not getattr(self, f) >= 1:
                raise ValueError(f"Efficiency.{f} must be >= 1 (a slowdown), got {getattr(self, f)!r}")
        for f in ("train_in_run", "rollout_in_run"):
            if not 0 < getattr(self, f) < math.inf:
                raise ValueError(f"Efficiency.{f} must be > 0 (a factor on the profiled time), got {getattr(self, f)!r}")
        if not 0 <= self.grad_overlap <= 1:
            raise ValueError(f"Efficiency.grad_overlap must be in [0, 1], got {self.grad_overlap!r}")


DEFAULT_EFFICIENCY = Efficiency()

# Qwen2.5 technical report (arXiv:2412.15115, table 1) and each model's config.json on the
# Hugging Face hub (Qwen/Qwen2.5-<size>): layers, hidden size, KV heads, head dim; the
# parameter counts are the model cards' (embeddings included).
_QWEN2_5 = {
    "0.5b": (494_000_000, 24, 896, 2, 64),
    "1.5b": (1_540_000_000, 28, 1536, 2, 128),
    "3b": (3_090_000_000, 36, 2048, 2, 128),
    "7b": (7_610_000_000, 28, 3584, 4, 128),
    "14b": (14_700_000_000, 48, 5120, 8, 128),
    "32b": (32_500_000_000, 64, 5120, 8, 128),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelShape:
    """What the cost models need of a dense decoder-only model."""

    num_params: int
    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    bytes_per_param: int = 2
    """2 for bf16; the KV cache is assumed to be stored in the same dtype."""
    name: str = "custom"

    def __post_init__(self) -> None:
        for f in ("num_params", "num_layers", "hidden_size", "num_kv_heads", "head_dim", "bytes_per_param"):
            value = getattr(self, f)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model {self.name!r}: {f} must be an integer >= 1, got {value!r}")

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.bytes_per_param

    @classmethod
    def qwen2_5(cls, size: str) -> ModelShape:
        """Qwen2.5-`size` (`"0.5b"`, `"1.5b"`, `"3b"`, `"7b"`, `"14b"`, `"32b"`) in bf16."""
        key = size.lower()
        if key not in _QWEN2_5:
            raise ValueError(f"unknown Qwen2.5 size {size!r}; valid sizes: {', '.join(_QWEN2_5)}")
        params, layers, hidden, kv_heads, head_dim = _QWEN2_5[key]
        return cls(num_params=params, num_layers=layers, hidden_size=hidden, num_kv_heads=kv_heads, head_dim=head_dim, name=f"qwen2.5-{key}")


def kv_bytes_per_token(model: ModelShape) -> int:
    """KV cache bytes one token holds across all layers: K and V, each kv_heads x head_dim."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * model.bytes_per_param


def _kv_shards(model: ModelShape, tp: int) -> int:
    """How many ways TP splits the KV cache: by KV head, so ranks beyond the KV head count
    hold replicas (tp=8 on a model with 4 KV heads stores each head twice)."""
    return min(tp, model.num_kv_heads)


def _check_tp(tp: int, device: Device) -> None:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be an integer >= 1, got {tp!r}")
    if tp > device.devices_per_node:
        raise ValueError(f"tp={tp} spans more than one {device.name} node ({device.devices_per_node} devices): tensor parallelism stays on the scale-up link")


def _tp_allreduce_s(model: ModelShape, device: Device, *, tp: int, rows: int, eff: Efficiency) -> float:
    """2 ring all-reduces per layer of `rows` x hidden activations over the scale-up link."""
    if tp == 1:
        return 0.0
    nbytes = rows * model.hidden_size * model.bytes_per_param
    one = COLLECTIVE_LATENCY_S + 2 * (tp - 1) / tp * nbytes / (device.scale_up_gbps * 1e9 * eff.network)
    return 2 * model.num_layers * one


def decode_step_s(model: ModelShape, device: Device, *, tp: int, batch: int, context_tokens: int, eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """One decode step: one new token for each of `batch` sequences.

    Args:
        tp: tensor-parallel degree (devices of one engine, on one node).
        batch: sequences in the step.
        context_tokens: KV tokens of all `batch` sequences together, read once.
    """
    _check_tp(tp, device)
    if batch < 0 or context_tokens < 0:
        raise ValueError(f"batch and context_tokens must be >= 0, got {batch} and {context_tokens}")
    if batch == 0:
        return 0.0
    read = model.weight_bytes / tp + context_tokens * kv_bytes_per_token(model) / _kv_shards(model, tp)
    memory_s = read / (device.hbm_bytes_per_s * eff.decode_bandwidth)
    compute_s = 2 * model.num_params * batch / tp / (device.flops * eff.prefill_compute)
    return max(memory_s, compute_s) + _tp_allreduce_s(model, device, tp=tp, rows=batch, eff=eff) + eff.decode_step_overhead_s


def prefill_s(model: ModelShape, device: Device, *, tp: int, tokens: int, eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """Prefill of `tokens` prompt tokens (one or many prompts in one pass)."""
    _check_tp(tp, device)
    if tokens <= 0:
        return 0.0
    compute_s = 2 * model.num_params * tokens / tp / (device.flops * eff.prefill_compute)
    weights_s = model.weight_bytes / tp / (device.hbm_bytes_per_s * eff.decode_bandwidth)  # short prompts are memory-bound
    return max(compute_s, weights_s) + _tp_allreduce_s(model, device, tp=tp, rows=tokens, eff=eff) + eff.prefill_overhead_s


def max_concurrent_tokens(model: ModelShape, device: Device, *, tp: int, memory_fraction: float = 0.9) -> int:
    """KV tokens one engine of `tp` devices holds beside its weights shard.

    `memory_fraction` of each device's HBM is the engine's (vLLM's
    `gpu_memory_utilization`); activations and the runtime's workspace are ignored.

    Raises:
        ValueError: the weights shard alone does not fit.
    """
    _check_tp(tp, device)
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
    free = device.hbm_bytes * memory_fraction - model.weight_bytes / tp
    if free <= 0:
        raise ValueError(
            f"model {model.name!r} ({model.weight_bytes / 2**30:.1f} GiB of weights) does not fit {tp} x {device.name} "
            f"at memory_fraction={memory_fraction}: raise tp or memory_fraction"
        )
    per_token_per_device = kv_bytes_per_token(model) / _kv_shards(model, tp)
    return int(free // per_token_per_device)


def decode_slots(model: ModelShape, device: Device, *, tp: int, tokens_per_sequence: float, max_num_seqs: int = MAX_NUM_SEQS, memory_fraction: float = 0.9) -> int:
    """How many sequences one engine runs at once: its KV capacity over the tokens a
    sequence holds on average, capped by `max_num_seqs`; at least 1.

    Pass `tokens_per_sequence` = prompt + mean response length: a continuous-batching
    engine admits by current usage, and sequences at mixed progress hold about that.
    """
    capacity = max_concurrent_tokens(model, device, tp=tp, memory_fraction=memory_fraction)
    return max(1, min(max_num_seqs, int(capacity // max(tokens_per_sequence, 1))))


def generate_s(
    model: ModelShape,
    device: Device,
    *,
    tp: int,
    prompt_tokens: int | Sequence[int],
    response_tokens: Sequence[int],
    slots: int,
    eff: Efficiency = DEFAULT_EFFICIENCY,
) -> float:
    """Time for one engine to generate `response_tokens` (one length per response) under
    continuous batching with at most `slots` sequences running (`decode_slots`).

    Responses start in the given order; when one finishes the next waiting one joins, and
    its prompt is prefilled (one prefill per instant at which responses join). Every step
    advances all running sequences by one token, so the schedule is a list of segments
    between finish events in which the batch is fixed; each segment costs its step count
    times `decode_step_s` at the segment's average context. The batch shrinks as short
    responses end, and the last, long responses decode nearly alone: the long tail.

    The call itself costs `eff.generate_call_overhead_s` once. O(n log n) in the number of
    responses (a heap of finish steps), not per token.

    Args:
        prompt_tokens: the prompt length of every response, or one per response.
        response_tokens: tokens each response generates (0 allowed: prefill only).
        slots: the most sequences decoding at once, >= 1.
    """
    n = len(response_tokens)
    prompts = [prompt_tokens] * n if isinstance(prompt_tokens, int) else list(prompt_tokens)
    if len(prompts) != n:
        raise ValueError(f"prompt_tokens has {len(prompts)} lengths for {n} responses")
    if slots < 1:
        raise ValueError(f"slots must be >= 1, got {slots}")
    if any(x < 0 for x in response_tokens) or any(p < 0 for p in prompts):
        raise ValueError("prompt and response lengths must be >= 0")

    # Global step t: the number of decode steps the engine has run. A response that joins
    # at step s0 with prompt p holds p + (t - s0) tokens at step t and ends at s0 + length.
    total = eff.generate_call_overhead_s
    running: list[tuple[int, int]] = []  # heap of (finish step, index)
    sum_prompt = 0  # of the running responses
    sum_start = 0
    starts = [0] * n
    waiting = 0  # next response to join
    t = 0
    while waiting < n or running:
        joined = 0
        while waiting < n and len(running) < slots:
            i = waiting
            waiting += 1
            starts[i] = t
            joined += prompts[i]
            if response_tokens[i] == 0:
                continue  # prefilled, nothing to decode
            heapq.heappush(running, (t + response_tokens[i], i))
            sum_prompt += prompts[i]
            sum_start += t
        total += prefill_s(model, device, tp=tp, tokens=joined, eff=eff)
        if not running:
            continue
        end = running[0][0]
        batch = len(running)
        # average over steps t..end-1 of sum_i (p_i + step - s0_i)
        avg_context = sum_prompt + batch * (t + end - 1) / 2 - sum_start
        total += (end - t) * decode_step_s(model, device, tp=tp, batch=batch, context_tokens=math.ceil(avg_context), eff=eff)
        t = end
        while running and running[0][0] == t:
            _, i = heapq.heappop(running)
            sum_prompt -= prompts[i]
            sum_start -= starts[i]
    return total


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainShape:
    """How a train engine cuts a step's rows into micro-batches, as far as its cost goes
    (each engine's `_micro_batches`, over `engines.micro_batches.pack`)."""

    padded: bool = False
    """Each micro-batch padded to its width (`train.padding_free=false`, or an engine that
    always pads: megatron); else the sum of its rows' real tokens (padding-free)."""
    sorted_rows: bool = True
    """A rank's rows sorted by length before they are cut (the torch and megatron engines),
    else in the batch's order (fsdp, deepspeed)."""
    cropped: bool = True
    """A padded micro-batch is cut to its longest row; else it is as wide as the step's
    longest row (fsdp and deepspeed without a token budget)."""
    micro_batch_size: int = 64
    max_tokens_per_micro_batch: int | None = None
    recompute: bool = False
    """Activations recomputed in the backward pass (`model.gradient_checkpointing`): each
    token costs a forward pass more (`train_flops_per_token`)."""

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.max_tokens_per_micro_batch is not None and self.max_tokens_per_micro_batch < 1:
            raise ValueError(f"max_tokens_per_micro_batch must be >= 1 or None, got {self.max_tokens_per_micro_batch}")


def step_tokens(lengths: Sequence[int], *, ranks: int = 1, shape: TrainShape = TrainShape()) -> int:
    """Tokens one data-parallel step computes over rows of `lengths` (real tokens, prompt and
    response), counted as `ranks` times its busiest rank's: each rank takes the share of the
    rows the multi-rank engines give it (`engines.micro_batches.rank_shares`: even tokens,
    row counts within one) and the step ends with the slowest. A padded micro-batch costs its rows
    times its width (its longest row, or the step's with `shape.cropped` off); a padding-free
    one its rows' real tokens. Fewer rows than ranks leave ranks idle."""
    from tidal.engines.micro_batches import pack, rank_shares  # noqa: PLC0415 - the engines' own cuts; they import torch, this module does not

    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    lengths = [int(n) for n in lengths]
    if any(n < 0 for n in lengths):
        raise ValueError("row lengths must be >= 0")
    width = max(lengths, default=0)
    busiest = 0
    for share in rank_shares(lengths, ranks):
        rows = [lengths[i] for i in share]
        if not shape.padded:
            busiest = max(busiest, sum(rows))
            continue
        rows = sorted(rows) if shape.sorted_rows else rows
        total = 0
        for part in pack(rows, max_rows=shape.micro_batch_size, max_tokens=shape.max_tokens_per_micro_batch):
            total += (part.stop - part.start) * (max(rows[part]) if shape.cropped else width)
        busiest = max(busiest, total)
    return ranks * busiest


def train_flops_per_token(model: ModelShape, *, recompute: bool = False) -> float:
    """A training step's FLOPs per token: 2 x params forward and 4 x params backward, and
    with `recompute` (activation checkpointing) the forward once more in the backward."""
    return (8 if recompute else 6) * model.num_params


def _ring_allreduce_s(nbytes: float, *, ranks: int, gbps: float, eff: Efficiency, latency_s: float) -> float:
    if ranks <= 1:
        return 0.0
    return latency_s + 2 * (ranks - 1) / ranks * nbytes / (gbps * 1e9 * eff.network)


def train_step_s(
    model: ModelShape, device: Device, *, num_devices: int, tokens: int, eff: Efficiency = DEFAULT_EFFICIENCY, num_nodes: int = 1, recompute: bool = False
) -> float:
    """One optimizer step over `tokens` tokens (all ranks together), data parallel.

    compute = `train_flops_per_token` x tokens / (num_devices x peak x train_mfu), plus
    `eff.train_step_overhead_s` (a step of no tokens costs nothing); the gradients
    (params x bytes_per_param) are all-reduced by a ring over the slowest link its ranks
    cross: scale-out when the ranks span nodes, else scale-up. `eff.grad_overlap` of the
    all-reduce hides under compute; the step is never shorter than the all-reduce alone.
    """
    if num_devices < 1 or num_nodes < 1 or num_nodes > num_devices:
        raise ValueError(f"need num_devices >= num_nodes >= 1, got num_devices={num_devices}, num_nodes={num_nodes}")
    if tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")
    compute_s = train_flops_per_token(model, recompute=recompute) * tokens / (num_devices * device.flops * eff.train_mfu)
    if num_nodes > 1:
        comm_s = _ring_allreduce_s(model.weight_bytes, ranks=num_devices, gbps=device.scale_out_gbps, eff=eff, latency_s=NETWORK_LATENCY_S)
    else:
        comm_s = _ring_allreduce_s(model.weight_bytes, ranks=num_devices, gbps=device.scale_up_gbps, eff=eff, latency_s=COLLECTIVE_LATENCY_S)
    overhead_s = eff.train_step_overhead_s if tokens else 0.0
    return max(compute_s + (1 - eff.grad_overlap) * comm_s, comm_s) + overhead_s


TRAIN_STATE_BYTES_PER_PARAM = 16
"""Bytes a trainer holds on its devices per parameter (all devices together) with AdamW in
mixed precision: bf16 weights and gradients (2 + 2), fp32 master weights and two moments
(3 x 4). Activations are freed between steps. Assumption."""


def park_s(nbytes: float, device: Device, eff: Efficiency = DEFAULT_EFFICIENCY) -> float:
    """Seconds one device's `nbytes` of state take to move to host memory, or back, over its
    PCIe link (a role's devices each move their own at once): what a colocated seat's park
    or onload costs. At `eff.network` of the link, as the host transport's copies. Nothing
    where the device's memory is the host's (`Device.memory_is_host`)."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if device.memory_is_host:
        return 0.0
    return nbytes / (device.pcie_gbps * 1e9 * eff.network)


def weight_sync_s(
    model: ModelShape,
    *,
    transport: str,
    src: Device,
    dst: Device,
    num_nodes_between: int = 0,
    num_receivers: int = 1,
    network_gbps: float | None = None,
    eff: Efficiency = DEFAULT_EFFICIENCY,
) -> float:
    """One policy version's weights (params x bytes_per_param) from a trainer to rollout.

    - `ipc` (same node, colocated): `eff.ipc_setup_s` + one copy out of the shared buffer
      at the device's HBM bandwidth (x `decode_bandwidth`).
    - `collective` (same device kind): a pipelined broadcast, bytes / link + one latency
      per node it crosses, over scale-out when `num_nodes_between` > 0 else scale-up;
      its time does not grow with the number of receivers (each forwards as it receives).
    - `host` (any pair, e.g. NPU trainer -> GPU rollout): device -> pinned host over the
      source's PCIe, network, host -> device over the destination's PCIe. The buckets
      are pipelined, so the time is bytes over the slowest stage + `HOST_LATENCY_S`;
      the sender pushes every bucket to each receiver, so its network stage carries
      `num_receivers` copies. On one node (`num_nodes_between=0`) there is no network
      stage (the loopback fan-out's memory copies are ignored).

    Args:
        num_nodes_between: nodes the weights travel to beyond the sender's (0: one node).
        num_receivers: rollout engines that receive the weights (the host transport's fan-out).
        network_gbps: per-device network bandwidth between the nodes; default the lesser
            of the two devices' `scale_out_gbps`. The host transport runs over TCP on the
            host's NIC, which may be slower than the devices' RDMA NICs: pass it here.

    Raises:
        ValueError: an unknown transport, or one the pair of devices cannot use.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r}; valid transports: {', '.join(TRANSPORTS)}")
    if num_nodes_between < 0 or num_receivers < 1:
        raise ValueError(f"need num_nodes_between >= 0 and num_receivers >= 1, got {num_nodes_between} and {num_receivers}")
    nbytes = model.weight_bytes
    net_gbps = network_gbps if network_gbps is not None else min(src.scale_out_gbps, dst.scale_out_gbps)
    if transport == "ipc":
        if num_nodes_between or src.kind != dst.kind:
            raise ValueError(f"transport 'ipc' needs the trainer and rollout on one node and device kind, got {src.name} -> {dst.name} across {num_nodes_between} node(s)")
        return eff.ipc_setup_s + nbytes / (dst.hbm_bytes_per_s * eff.decode_bandwidth)
    if transport == "collective":
        if src.kind != dst.kind:
            raise ValueError(f"transport 'collective' needs one device kind on both sides, got {src.name} ({src.kind}) -> {dst.name} ({dst.kind}): use 'host'")
        if num_nodes_between:
            return num_nodes_between * NETWORK_LATENCY_S + nbytes / (net_gbps * 1e9 * eff.network)
        return COLLECTIVE_LATENCY_S + nbytes / (min(src.scale_up_gbps, dst.scale_up_gbps) * 1e9 * eff.network)
    stages = [src.pcie_gbps, dst.pcie_gbps]  # each receiver copies in over its own PCIe link
    if num_nodes_between:
        stages.append(net_gbps / num_receivers)
    return HOST_LATENCY_S + nbytes / (min(stages) * 1e9 * eff.network)
