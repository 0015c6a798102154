"""The simulator's cost models (tools/sim/costs.py, hardware.py) against hand-computed values."""

from __future__ import annotations

import math

import pytest

from tidal.tools.sim import costs
from tidal.tools.sim.costs import (
    COLLECTIVE_LATENCY_S,
    HOST_LATENCY_S,
    IPC_SETUP_S,
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
from tidal.tools.sim.hardware import DEVICES, device

EFF = Efficiency()
Q7 = ModelShape.qwen2_5("7b")
H100 = device("h100")
P7 = 7_610_000_000
W7 = P7 * 2  # bf16 weight bytes


def test_device_registry_and_overrides():
    assert set(DEVICES) == {"910b", "910c", "h100", "h200", "h20"}
    assert {d.kind for d in DEVICES.values()} == {"npu", "cuda"}
    assert H100.hbm_gbps == 3350 and H100.bf16_tflops == 989 and H100.devices_per_node == 8
    slow = device("H100", scale_out_gbps=12.5)  # any case
    assert slow.scale_out_gbps == 12.5 and slow.hbm_gbps == H100.hbm_gbps
    with pytest.raises(ValueError, match=r"'h800'.*910b, 910c, h100, h200, h20"):
        device("h800")
    with pytest.raises(ValueError, match=r"nvlink_gbps.*scale_up_gbps"):
        device("h100", nvlink_gbps=900)
    with pytest.raises(ValueError, match="hbm_gbps must be a number > 0"):
        device("910b", hbm_gbps=0)


def test_qwen_shapes_and_kv_bytes():
    assert (Q7.num_layers, Q7.hidden_size, Q7.num_kv_heads, Q7.head_dim, Q7.num_params) == (28, 3584, 4, 128, P7)
    assert kv_bytes_per_token(Q7) == 2 * 28 * 4 * 128 * 2 == 57_344
    assert kv_bytes_per_token(ModelShape.qwen2_5("32b")) == 2 * 64 * 8 * 128 * 2
    assert ModelShape.qwen2_5("0.5B").head_dim == 64
    with pytest.raises(ValueError, match=r"'70b'.*0.5b, 1.5b, 3b, 7b, 14b, 32b"):
        ModelShape.qwen2_5("70b")


def test_efficiency_bounds():
    with pytest.raises(ValueError, match="train_mfu"):
        Efficiency(train_mfu=0)
    with pytest.raises(ValueError, match="network"):
        Efficiency(network=1.5)
    with pytest.raises(ValueError, match="grad_overlap"):
        Efficiency(grad_overlap=-0.1)
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="train_in_run"):
            Efficiency(train_in_run=bad)
    assert Efficiency(rollout_in_run=0.9).rollout_in_run == 0.9  # a run may be quicker than its profile


def test_decode_at_batch_1_is_weight_read_bound():
    # 7.61B bf16 = 15.2 GB read once per step at 3.35 TB/s x 0.7
    assert decode_step_s(Q7, H100, tp=1, batch=1, context_tokens=0, eff=EFF) == pytest.approx(W7 / (3.35e12 * 0.7))
    peak = Efficiency(decode_bandwidth=1.0)
    assert decode_step_s(Q7, H100, tp=1, batch=1, context_tokens=0, eff=peak) == pytest.approx(4.54e-3, rel=1e-3)
    # the KV cache is read too: 10k tokens x 56 KiB
    with_kv = decode_step_s(Q7, H100, tp=1, batch=1, context_tokens=10_000, eff=EFF)
    assert with_kv == pytest.approx((W7 + 10_000 * 57_344) / (3.35e12 * 0.7))


def test_decode_becomes_compute_bound_at_large_batch():
    one = decode_step_s(Q7, H100, tp=1, batch=1, context_tokens=0, eff=EFF)
    # below the ridge (peak x 0.5 / (bw x 0.7) ~ 211 sequences) a bigger batch is free
    assert decode_step_s(Q7, H100, tp=1, batch=100, context_tokens=0, eff=EFF) == pytest.approx(one)
    big = decode_step_s(Q7, H100, tp=1, batch=2048, context_tokens=0, eff=EFF)
    assert big == pytest.approx(2 * P7 * 2048 / (989e12 * 0.5))
    assert big > 5 * one and big / 2048 < one / 100  # slower steps, far cheaper tokens


def test_tensor_parallel_halves_weight_time_and_adds_all_reduces():
    one = decode_step_s(Q7, H100, tp=1, batch=1, context_tokens=0, eff=EFF)
    two = decode_step_s(Q7, H100, tp=2, batch=1, context_tokens=0, eff=EFF)
    # 2 all-reduces per layer of 1 x 3584 bf16 activations, ring over NVLink (450 GB/s x 0.8)
    comm = 2 * 28 * (COLLECTIVE_LATENCY_S + 2 * (1 / 2) * 3584 * 2 / (450e9 * 0.8))
    assert two == pytest.approx(one / 2 + comm)
    assert comm > 0
    # KV is split by head: tp=8 on 4 KV heads stores each head twice (a quarter per device)
    kv_only = decode_step_s(Q7, H100, tp=8, batch=1, context_tokens=100_000, eff=EFF) - decode_step_s(Q7, H100, tp=8, batch=1, context_tokens=0, eff=EFF)
    assert kv_only == pytest.approx(100_000 * 57_344 / 4 / (3.35e12 * 0.7))
    with pytest.raises(ValueError, match="tp=16"):
        decode_step_s(Q7, H100, tp=16, batch=1, context_tokens=0, eff=EFF)


def test_prefill_is_compute_bound_with_a_weight_read_floor():
    assert prefill_s(Q7, H100, tp=1, tokens=8192, eff=EFF) == pytest.approx(2 * P7 * 8192 / (989e12 * 0.5))
    assert prefill_s(Q7, H100, tp=1, tokens=16, eff=EFF) == pytest.approx(W7 / (3.35e12 * 0.7))
    assert prefill_s(Q7, H100, tp=1, tokens=0, eff=EFF) == 0


def test_kv_capacity_after_weights():
    free = 80 * 2**30 * 0.9 - W7
    assert max_concurrent_tokens(Q7, H100, tp=1) == int(free // 57_344)
    # tp=2: half the weights per device, half the KV per token per device
    assert max_concurrent_tokens(Q7, H100, tp=2) == int((80 * 2**30 * 0.9 - W7 / 2) // (57_344 / 2))
    with pytest.raises(ValueError, match=r"qwen2.5-32b.*does not fit 1 x 910b"):
        max_concurrent_tokens(ModelShape.qwen2_5("32b"), device("910b"), tp=1)


def test_kv_capacity_limits_concurrency():
    q32 = ModelShape.qwen2_5("32b")
    capacity = max_concurrent_tokens(q32, H100, tp=1)  # ~47k tokens beside 65 GB of weights
    slots = decode_slots(q32, H100, tp=1, tokens_per_sequence=4096)
    assert slots == capacity // 4096 < 16
    assert decode_slots(Q7, H100, tp=1, tokens_per_sequence=100) == costs.MAX_NUM_SEQS
    lengths = [4000] * 64
    limited = generate_s(q32, H100, tp=1, prompt_tokens=96, response_tokens=lengths, slots=slots, eff=EFF)
    free = generate_s(q32, H100, tp=1, prompt_tokens=96, response_tokens=lengths, slots=64, eff=EFF)
    assert limited > 3 * free  # 64 responses in waves of `slots` instead of one batch


def test_generate_integrates_segments_by_hand():
    # responses of 2 and 4 tokens, prompts of 10: steps 0-1 run both (contexts 20 then 22,
    # average 21), steps 2-3 run the longer alone (12 then 13 tokens, average 12.5 -> 13)
    got = generate_s(Q7, H100, tp=1, prompt_tokens=10, response_tokens=[2, 4], slots=2, eff=EFF)
    step = decode_step_s
    want = prefill_s(Q7, H100, tp=1, tokens=20, eff=EFF) + 2 * step(Q7, H100, tp=1, batch=2, context_tokens=21, eff=EFF) + 2 * step(Q7, H100, tp=1, batch=1, context_tokens=13, eff=EFF)
    assert got == pytest.approx(want)


def test_generate_with_one_slot_runs_responses_one_after_another():
    both = generate_s(Q7, H100, tp=1, prompt_tokens=[50, 70], response_tokens=[30, 90], slots=1, eff=EFF)
    each = sum(generate_s(Q7, H100, tp=1, prompt_tokens=p, response_tokens=[n], slots=1, eff=EFF) for p, n in ((50, 30), (70, 90)))
    assert both == pytest.approx(each)


def test_long_tail_approaches_the_longest_response():
    lengths = [100] * 63 + [4000]
    mean = sum(lengths) // len(lengths)  # 160
    tail = generate_s(Q7, H100, tp=1, prompt_tokens=256, response_tokens=lengths, slots=64, eff=EFF)
    uniform = generate_s(Q7, H100, tp=1, prompt_tokens=256, response_tokens=[mean] * 64, slots=64, eff=EFF)
    longest_alone = 4000 * decode_step_s(Q7, H100, tp=1, batch=1, context_tokens=256, eff=EFF)
    assert longest_alone < tail < 1.1 * longest_alone
    assert tail > 10 * uniform


def test_generate_is_per_event_not_per_token(monkeypatch):
    calls = []
    real = costs.decode_step_s

    def counting(*args, **kwargs):
        calls.append(kwargs["batch"])
        return real(*args, **kwargs)

    monkeypatch.setattr(costs, "decode_step_s", counting)
    lengths = [1000 + (i * 7919) % 3000 for i in range(2000)]
    generate_s(Q7, H100, tp=1, prompt_tokens=128, response_tokens=lengths, slots=256, eff=EFF)
    assert 0 < len(calls) <= len(lengths) < sum(lengths) // 1000  # one call per finish event, not per token


def test_train_step_scales_with_devices_plus_a_collective():
    tokens = 1_000_000
    compute8 = 6 * P7 * tokens / (8 * 989e12 * 0.4)
    ring8 = COLLECTIVE_LATENCY_S + 2 * 7 / 8 * W7 / (450e9 * 0.8)  # NVLink on one node
    assert train_step_s(Q7, H100, num_devices=8, tokens=tokens, eff=EFF) == pytest.approx(compute8 + ring8)
    assert train_step_s(Q7, H100, num_devices=1, tokens=tokens, eff=EFF) == pytest.approx(8 * compute8)
    recomputed = train_step_s(Q7, H100, num_devices=8, tokens=tokens, eff=EFF, recompute=True)  # gradient checkpointing: a forward pass more
    assert recomputed == pytest.approx(8 / 6 * compute8 + ring8)
    two_nodes = train_step_s(Q7, H100, num_devices=16, tokens=tokens, eff=EFF, num_nodes=2)
    four_nodes = train_step_s(Q7, H100, num_devices=32, tokens=tokens, eff=EFF, num_nodes=4)
    comm2, comm4 = two_nodes - compute8 / 2, four_nodes - compute8 / 4
    assert comm2 == pytest.approx(costs.NETWORK_LATENCY_S + 2 * 15 / 16 * W7 / (50e9 * 0.8))  # InfiniBand
    assert comm4 > comm2 > 5 * ring8
    hidden = train_step_s(Q7, H100, num_devices=16, tokens=tokens, eff=Efficiency(grad_overlap=1.0), num_nodes=2)
    assert hidden == pytest.approx(compute8 / 2)
    with pytest.raises(ValueError, match="num_nodes"):
        train_step_s(Q7, H100, num_devices=2, tokens=tokens, eff=EFF, num_nodes=4)


def test_weight_sync_transports():
    npu = device("910b")
    host = weight_sync_s(Q7, transport="host", src=npu, dst=H100, num_nodes_between=1, eff=EFF)
    assert host == pytest.approx(HOST_LATENCY_S + W7 / (25e9 * 0.8))  # RoCE 25 < PCIe 32, 64
    fast_net = weight_sync_s(Q7, transport="host", src=npu, dst=H100, num_nodes_between=1, network_gbps=100, eff=EFF)
    assert fast_net == pytest.approx(HOST_LATENCY_S + W7 / (32e9 * 0.8))  # now the 910B's PCIe 4.0
    fan_out = weight_sync_s(Q7, transport="host", src=npu, dst=H100, num_nodes_between=1, num_receivers=4, eff=EFF)
    assert fan_out == pytest.approx(HOST_LATENCY_S + W7 / (25e9 / 4 * 0.8))
    ipc = weight_sync_s(Q7, transport="ipc", src=H100, dst=H100, eff=EFF)
    assert ipc == pytest.approx(IPC_SETUP_S + W7 / (3.35e12 * 0.7))
    nvlink = weight_sync_s(Q7, transport="collective", src=H100, dst=H100, eff=EFF)
    infiniband = weight_sync_s(Q7, transport="collective", src=H100, dst=H100, num_nodes_between=1, eff=EFF)
    assert ipc < nvlink < infiniband < host
    with pytest.raises(ValueError, match="collective.*use 'host'"):
        weight_sync_s(Q7, transport="collective", src=npu, dst=H100, num_nodes_between=1, eff=EFF)
    with pytest.raises(ValueError, match="ipc"):
        weight_sync_s(Q7, transport="ipc", src=H100, dst=H100, num_nodes_between=1, eff=EFF)
    with pytest.raises(ValueError, match=r"'rdma'.*ipc, collective, host"):
        weight_sync_s(Q7, transport="rdma", src=H100, dst=H100, eff=EFF)


def test_a_park_moves_one_devices_state_over_its_pcie_link():
    h100 = DEVICES["h100"]
    assert costs.park_s(8e9, h100) == pytest.approx(8e9 / (h100.pcie_gbps * 1e9 * costs.DEFAULT_EFFICIENCY.network))
    assert costs.park_s(0, h100) == 0.0
    with pytest.raises(ValueError, match="nbytes"):
        costs.park_s(-1, h100)


def test_a_park_on_a_host_profiled_as_the_device_moves_nothing():
    """hal's CPU platform parks nothing: the state is in host memory already."""
    import dataclasses

    host = dataclasses.replace(DEVICES["h100"], name="profiled", kind="cpu")
    assert host.memory_is_host and not DEVICES["h100"].memory_is_host
    assert costs.park_s(8e9, host) == 0.0


# The step's shape: padding and the ranks' shares ----------------------------------------
def test_a_padding_free_step_computes_its_busiest_ranks_real_tokens_on_every_rank():
    assert costs.step_tokens([10, 20, 30, 40]) == 100
    assert costs.step_tokens([10, 20, 30, 40], ranks=2) == 2 * 50  # the engines' token-even shares: [10, 40] and [20, 30]
    assert costs.step_tokens([10, 20, 30, 40, 400], ranks=2) == 2 * (400 + 20 + 10)  # row counts within one: the long row's rank takes the two shortest
    assert costs.step_tokens([10, 20], ranks=4) == 4 * 20  # fewer rows than ranks: two ranks idle, the step as long as the longest row
    assert costs.step_tokens([], ranks=3) == 0


def test_a_padded_step_costs_each_micro_batch_its_rows_times_its_width():
    lengths = [10, 100, 12, 90]
    free = costs.TrainShape(micro_batch_size=2)
    assert costs.step_tokens(lengths, shape=free) == 212  # padding-free: real tokens, however cut
    sorted_cropped = costs.TrainShape(padded=True, micro_batch_size=2)
    assert costs.step_tokens(lengths, shape=sorted_cropped) == 2 * 12 + 2 * 100  # [10, 12], [90, 100]
    in_order = costs.TrainShape(padded=True, sorted_rows=False, micro_batch_size=2)
    assert costs.step_tokens(lengths, shape=in_order) == 2 * 100 + 2 * 90  # [10, 100], [12, 90]
    batch_wide = costs.TrainShape(padded=True, sorted_rows=False, cropped=False, micro_batch_size=2)
    assert costs.step_tokens(lengths, shape=batch_wide) == 4 * 100  # every micro-batch as wide as the step's longest row
    budget = costs.TrainShape(padded=True, micro_batch_size=64, max_tokens_per_micro_batch=150)
    assert costs.step_tokens(lengths, shape=budget) == 2 * 12 + 90 + 100  # [10, 12], then 3 x 90 and 2 x 100 pass 150: [90], [100]
    assert costs.step_tokens(lengths, ranks=2, shape=sorted_cropped) == 2 * max(2 * 100, 2 * 90)  # [10, 100] and [12, 90], each sorted


def test_the_step_shape_refuses_what_no_engine_runs():
    with pytest.raises(ValueError, match="micro_batch_size"):
        costs.TrainShape(micro_batch_size=0)
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        costs.TrainShape(max_tokens_per_micro_batch=0)
    with pytest.raises(ValueError, match="ranks"):
        costs.step_tokens([1], ranks=0)
