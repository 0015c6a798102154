"""The critics of `algorithm.advantage=gae` sharded over the trainer's ranks (`engines.led_critic`:
`fsdp_critic`, which the `megatron` backend holds too, and `deepspeed_critic` under ZeRO-2;
beside a ZeRO-3 policy the fsdp one, `critic.backend=fsdp`): two ranks led by rank 0, beside
the backend's policy engine, each follower's seats parking them between commands, held to the
torch critic (`engines.critic`)."""

from __future__ import annotations

import copy
import textwrap

import pytest
import torch

from tidal.engines.critic import Critic
from tidal.engines.tiny import CharTokenizer, build_tiny_qwen2
from tidal.flow.trajectory import TokenBatch

T = CharTokenizer()
MODEL = dict(seed=0, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=32)
CRITIC = dict(lr=1e-3, value_clip=0.2, micro_batch_size=2)
NUM_STEPS = 3

WORKER = textwrap.dedent(
    """
    import gc
    import os
    import sys
    from contextlib import contextmanager
    from pathlib import Path

    import torch

    torch.set_num_threads(1)

    from tidal.engines.fsdp_lead import stop_followers
    from tidal.engines.registry import TRAIN, critic_class, follower, load
    from tidal.engines.tiny import build_tiny_qwen2
    from tidal.flow.algorithms import PolicyLossConfig
    from tidal.flow.timeshare import Offloader
    from tidal.flow.trajectory import TokenBatch
    from tidal.hal import current_platform, select_platform

    rank, world, port, work = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    current_platform().init_process_group(rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}", timeout_s=120)
    data = torch.load(work / "data.pt", weights_only=False)
    backend, options = data["backend"], data["options"]
    if rank:
        fake = select_platform("fake:cpu:1").platform  # its offload copies for real: the shards really move
        parks = {}

        class Parked:
            # a seat whose guest takes the devices between any two commands, one per engine
            def __init__(self, engine):
                self.name = "critic" if hasattr(engine, "values") else "policy"
                if hasattr(engine, "park"):  # a DeepSpeed engine parks itself
                    self.moves = engine
                else:
                    modules = [m for m in (engine.model, getattr(engine, "reference", None)) if m is not None]
                    self.moves = Offloader(fake, torch.nn.ModuleList(modules), engine.optimizer, moved=engine.after_offload_move)
                self.park()

            def park(self):
                self.moves.park()
                parks[self.name] = parks.get(self.name, 0) + 1

            @contextmanager
            def turn(self):
                self.moves.unpark()
                try:
                    yield
                finally:
                    self.park()

            def close(self):
                self.moves.unpark()

        done = follower(backend)(Parked)
        torch.save({**done, "parks": parks}, work / f"follow{rank}.pt")
    else:
        batch, returns = TokenBatch(*data["batch"]), data["returns"]
        policy = load("train.backend", backend)(build_tiny_qwen2(data["vocab_size"], **data["model"]), lr=1e-3, micro_batch_size=2, rank0_leads=True, **options, **data["policy_options"])
        reference = data["policy_options"].get("kl_reference", False)  # logprobs under it: what a KL penalty in the reward reads
        first = {"logprobs": policy.logprobs(batch), **({"reference": policy.logprobs_under_reference(batch)} if reference else {})}
        Critic = critic_class(data["critic_backend"])
        critic_options = options if data["critic_backend"] == backend else {}  # zero_stage: the deepspeed critic's
        critic = Critic(build_tiny_qwen2(data["vocab_size"], **data["model"]), rank0_leads=True, **data["critic"], **critic_options)
        critic.load_state_dict(data["start"])  # no optimizer state yet
        values, metrics = [], []
        for _ in range(data["num_steps"]):
            values.append(critic.values(batch))
            policy.train_step(batch, data["advantages"], loss=PolicyLossConfig(), proximal_logprobs=policy.logprobs(batch))  # its commands between the critic's
            metrics.append(critic.train_step(batch, returns, values[-1] + data["offset"]))
        state = critic.state_dict()
        last = {"logprobs": policy.logprobs(batch), **({"reference": policy.logprobs_under_reference(batch)} if reference else {})}
        del critic  # as each follower drops its own before it builds the next
        gc.collect()
        again = Critic(build_tiny_qwen2(data["vocab_size"], **data["model"]), rank0_leads=True, **data["critic"], **critic_options)  # the followers replace theirs
        again.load_state_dict(state)
        resumed = again.train_step(batch, returns, again.values(batch))
        torch.save({"values": values, "metrics": metrics, "state": state, "resumed": resumed, "resumed_state": again.state_dict(), "version": policy.version, "first": first, "last": last}, work / "result.pt")
        stop_followers()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: see the comment above WORKER in test_fsdp_train.py
    """
)


def _returns(batch: TokenBatch) -> torch.Tensor:
    on = batch.loss_mask.bool()
    rows = torch.arange(len(batch), dtype=torch.float32)[:, None]
    return torch.where(on, 0.5 * rows - 0.1 * torch.arange(on.shape[1]), 0.0)


BACKENDS = {"fsdp": {}, "deepspeed-zero2": {"zero_stage": 2}, "deepspeed-zero3": {"zero_stage": 3}, "megatron": {}}
POLICY_OPTIONS = {name: {"kl_reference": True} for name in BACKENDS}
CRITIC_BACKEND = {"deepspeed-zero3": "fsdp"}
"""`critic.backend` where it is not the train backend's own: beside a ZeRO-3 policy the fsdp
critic (whose follower parks the policy between commands: ZeRO-3's gathers must stay in step)."""


@pytest.fixture(scope="module", params=sorted(BACKENDS))
def runs(request, tmp_path_factory, six_rows, spawn, write_data):
    """The two-rank run of each backend (see WORKER) and the torch critic's same steps."""
    backend, options = request.param.split("-")[0], BACKENDS[request.param]
    if backend in ("deepspeed", "megatron"):
        pytest.importorskip("deepspeed" if backend == "deepspeed" else "megatron.core")
    batch, advantages = six_rows
    reference = Critic(build_tiny_qwen2(T.vocab_size, **MODEL), **CRITIC)
    with torch.no_grad():
        torch.nn.init.normal_(reference.model.head.weight, generator=torch.Generator().manual_seed(1))  # values that are not all 0
    start = copy.deepcopy(reference.state_dict())  # on the host its tensors are the live ones, which the steps below change
    returns = _returns(batch)
    offset = 0.3 * torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(2)) * batch.loss_mask  # old values the steps' values differ from: value clipping takes part
    values, metrics = [], []
    for _ in range(NUM_STEPS):
        values.append(reference.values(batch))
        metrics.append(reference.train_step(batch, returns, values[-1] + offset))
    work = tmp_path_factory.mktemp(request.param)
    write_data(work, batch, advantages, backend=backend, critic_backend=CRITIC_BACKEND.get(request.param, backend), options=options, policy_options=POLICY_OPTIONS[request.param], returns=returns, offset=offset, start=start, vocab_size=T.vocab_size, model=MODEL, critic=CRITIC, num_steps=NUM_STEPS)
    spawn(work, WORKER)
    torch_state = copy.deepcopy(reference.state_dict())
    resumed = reference.train_step(batch, returns, reference.values(batch))
    return {
        "fsdp": torch.load(work / "result.pt", weights_only=False),
        "follower": torch.load(work / "follow1.pt"),
        "torch": {"values": values, "metrics": metrics, "state": torch_state, "resumed": resumed, "resumed_state": reference.state_dict()},
    }


def test_two_ranks_value_and_step_as_the_torch_critic_on_the_whole_batch(runs):
    fsdp, ref = runs["fsdp"], runs["torch"]
    for got, want in zip(fsdp["values"], ref["values"], strict=True):
        assert want.abs().max() > 0.01  # the values are not all 0
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    for got, want in zip(fsdp["metrics"], ref["metrics"], strict=True):
        assert set(got) == set(want)
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), key
    assert fsdp["metrics"][-1]["value_loss"] < fsdp["metrics"][0]["value_loss"]  # the values move toward the returns
    assert any(m["value_clipfrac"] > 0 for m in fsdp["metrics"])  # value clipping took part


def test_its_state_is_the_torch_critics_and_a_new_critic_resumes_from_it(runs):
    fsdp, ref = runs["fsdp"], runs["torch"]
    assert fsdp["state"]["model"].keys() == ref["state"]["model"].keys()
    for name, tensor in ref["state"]["model"].items():
        torch.testing.assert_close(fsdp["state"]["model"][name], tensor, atol=2e-5, rtol=1e-4, msg=name)
    assert fsdp["state"]["optimizer"]["state"].keys() == ref["state"]["optimizer"]["state"].keys()
    assert len(fsdp["state"]["optimizer"]["state"]) == sum(1 for _ in Critic(build_tiny_qwen2(T.vocab_size, **MODEL)).model.parameters())
    loaded = Critic(build_tiny_qwen2(T.vocab_size, **MODEL), **CRITIC)
    loaded.load_state_dict(fsdp["state"])  # the fsdp critic's checkpoint resumes a torch critic
    torch.testing.assert_close(loaded.model.head.weight, ref["state"]["model"]["head.weight"], atol=2e-5, rtol=1e-4)
    for key in ref["resumed"]:  # and the torch critic's a new fsdp critic, AdamW's moments and all
        assert fsdp["resumed"][key] == pytest.approx(ref["resumed"][key], rel=1e-4, abs=1e-5), key
    for name, tensor in ref["resumed_state"]["model"].items():
        torch.testing.assert_close(fsdp["resumed_state"]["model"][name], tensor, atol=2e-5, rtol=1e-4, msg=name)


def test_the_follower_runs_the_critic_beside_the_policy_each_in_its_own_seat(runs):
    follower = runs["follower"]
    assert runs["fsdp"]["version"] == NUM_STEPS  # the policy's steps went on between the critic's
    assert follower["engines"] == 1 and follower["steps"] == NUM_STEPS  # the critic is not counted as a policy engine
    assert follower["critic_steps"] == NUM_STEPS + 1  # its own, and the critic that replaced it resumed one
    parks = follower["parks"]
    assert parks["policy"] > NUM_STEPS and parks["critic"] > 2 * NUM_STEPS  # each engine parked after each of its commands


def test_logprobs_under_the_reference_come_from_every_rank_and_stay_the_first_weights(runs):
    """The policy's reference (`logprobs_under_reference`, led over both ranks: what
    `algorithm.kl_in_reward` reads) gives the first weights' logprobs before and after the
    policy's steps."""
    first, last = runs["fsdp"]["first"], runs["fsdp"]["last"]
    torch.testing.assert_close(first["reference"], first["logprobs"], atol=1e-5, rtol=0)
    assert (last["logprobs"] - first["logprobs"]).abs().max() > 1e-4  # the policy moved
    torch.testing.assert_close(last["reference"], first["logprobs"], atol=1e-5, rtol=0)  # its reference did not
