"""Shared devices at run time: where each actor sits, and turns taken across Ray processes."""

from __future__ import annotations

import time

import pytest

from tidal.flow.colocate import Sharing, Spot, TurnsProxy, spots
from tidal.flow.placement import PlacementError, Resource, Role, schedule
from tidal.flow.ray.placement import role_bundles
from tidal.flow.turns import Turns
from tidal.hal import select_platform

GPUS = [Resource(node="g0", kind="cuda", capacity=2), Resource(node="g1", kind="cuda", capacity=2)]


def test_colocated_rollout_sits_on_the_trainer_bundle_with_a_fraction_of_its_device():
    plan = schedule(GPUS[:1], [Role(name="train"), Role(name="rollout", colocate_with="train")])
    assert plan.layout == "colocated"
    placed = spots(plan)
    assert placed[("train", 0)] == Spot(group="train", bundle=0, resources={"GPU": 0.5}, turns=(0,))
    assert placed[("rollout", 0)] == Spot(group="train", bundle=0, resources={"GPU": 0.5}, turns=(0,))
    assert role_bundles(plan, {"GPU": 2}) == {"train": [{"GPU": 1.0}]}  # no bundle of rollout's own


def test_hybrid_and_multiplexed_mix_seats_on_the_trainer_and_devices_of_their_own():
    hybrid = schedule(GPUS[:1], [Role(name="train"), Role(name="rollout", count=2, colocate_with="train")])
    assert hybrid.layout == "hybrid"
    placed = spots(hybrid)
    assert placed[("rollout", 0)].group == "train" and placed[("rollout", 0)].turns == (0,)
    assert placed[("rollout", 1)] == Spot(group="rollout", bundle=0, resources={"GPU": 1.0}, turns=())
    assert role_bundles(hybrid, {"GPU": 2}) == {"train": [{"GPU": 1.0}], "rollout": [{"GPU": 1.0}]}

    multiplexed = schedule(GPUS[:1], [Role(name="train", lend_to="rollout"), Role(name="rollout")])
    assert multiplexed.layout == "multiplexed"
    placed = spots(multiplexed)
    assert placed[("rollout", 0)] == Spot(group="rollout", bundle=0, resources={"GPU": 1.0}, turns=())
    assert placed[("rollout", 1)] == Spot(group="train", bundle=0, resources={"GPU": 0.5}, turns=(0,))  # borrowed


def test_several_guests_split_one_device_and_a_multi_device_trainer_keeps_its_devices():
    three = spots(schedule([Resource(node="g0", kind="cuda", capacity=1)], [Role(name="train", lend_to="rollout"), Role(name="rollout", colocate_with="train")]))
    shares = [three[k].resources["GPU"] for k in (("train", 0), ("rollout", 0), ("rollout", 1))]
    assert shares == [0.3334, 0.3333, 0.3333]
    wide = spots(schedule(GPUS[:1], [Role(name="train", devices_each=2, lend_to="rollout"), Role(name="rollout", devices_each=2, colocate_with="train")]))
    assert wide[("train", 0)].resources == {"GPU": 2.0}
    assert wide[("rollout", 0)].resources == {} and wide[("rollout", 1)].resources == {} and wide[("rollout", 1)].turns == (0,)


@pytest.mark.parametrize(
    ("roles", "guests"),
    [
        ([Role(name="train", devices_each=2), Role(name="rollout", count=2, colocate_with="train")], "0 and 1"),  # colocated
        ([Role(name="train", devices_each=2), Role(name="rollout", count=3, colocate_with="train")], "0 and 1"),  # hybrid
        ([Role(name="train", devices_each=2, lend_to="rollout"), Role(name="rollout")], "1 and 2"),  # multiplexed
    ],
)
def test_guests_on_different_devices_of_one_multi_device_trainer_are_refused_naming_the_keys(roles, guests):
    """Such guests would each get all the trainer's devices and build on its first, and wait
    for each other at its one `Turns`: refused before anything starts."""
    plan = schedule([Resource(node="g0", kind="cuda", capacity=3)], roles)
    message = rf"rollout instances {guests} use different devices \(\[0\] and \[1\]\) of trainer instance 0's 2 on g0.*placement.rollout.devices_each=2.*placement.train.devices_each=1"
    with pytest.raises(PlacementError, match=message):
        spots(plan)
    with pytest.raises(PlacementError, match=message):
        role_bundles(plan, {"GPU": 3})


def test_every_rank_of_a_multi_rank_trainer_hosts_its_own_guest():
    plan = schedule([Resource(node="g0", kind="cuda", capacity=2)], [Role(name="train", count=2), Role(name="rollout", count=2, colocate_with="train")])
    assert plan.layout == "colocated" and [a.devices for a in plan.of("rollout")] == [a.devices for a in plan.of("train")]
    placed = spots(plan)
    for rank in (0, 1):  # each guest on its rank's bundle, half of that bundle's device each, at that rank's Turns
        assert placed[("train", rank)] == Spot(group="train", bundle=rank, resources={"GPU": 0.5}, turns=(rank,))
        assert placed[("rollout", rank)] == Spot(group="train", bundle=rank, resources={"GPU": 0.5}, turns=(rank,))
    assert role_bundles(plan, {"GPU": 2}) == {"train": [{"GPU": 1.0}, {"GPU": 1.0}]}
    # two nodes of two devices, a trainer rank per node: the second rank's guest is on g1, on its bundle
    wide = schedule(GPUS, [Role(name="train", count=2, devices_each=2), Role(name="rollout", count=2, devices_each=2, colocate_with="train")])
    placed = spots(wide)
    assert [wide.of("rollout")[i].node for i in (0, 1)] == ["g0", "g1"]
    assert placed[("rollout", 1)] == Spot(group="train", bundle=1, resources={}, turns=(1,)) and placed[("train", 1)].turns == (1,)


def test_start_turns_gives_each_shared_trainer_bundle_a_turns_actor(ray_session):
    import ray

    from tidal.flow.colocate import find_turns, start_turns, turns_actor_name
    from tidal.flow.ray.placement import placement_groups

    plan = schedule([Resource(node="box", kind="cpu", capacity=2)], [Role(name="train", count=2), Role(name="rollout", count=2, colocate_with="train")])
    placed = spots(plan)
    groups = placement_groups(plan)
    turns = start_turns(placed, groups, name="tidal-turns-test")
    try:
        assert sorted(turns) == [0, 1]
        assert find_turns([turns_actor_name("tidal-turns-test", 1)]) == [turns[1]]  # how a guest finds its seat
        ray.get(turns[1].acquire.remote("train"))  # rank 1's turn says nothing about rank 0's devices
        assert [ray.get(turns[rank].state.remote())["holder"] for rank in (0, 1)] == [None, "train"]
    finally:
        for actor in turns.values():
            ray.kill(actor)
        for pg in groups.values():
            ray.util.remove_placement_group(pg)


def test_a_guest_spanning_several_trainer_ranks_takes_all_their_turns():
    spanning = schedule(GPUS[:1], [Role(name="train", count=2), Role(name="rollout", devices_each=2, colocate_with="train")])
    placed = spots(spanning)
    # on rank 0's bundle, asking Ray for no device (one actor sits in one bundle): it gets both ranks' visible devices
    assert placed[("rollout", 0)] == Spot(group="train", bundle=0, resources={}, turns=(0, 1))
    assert [placed[("train", r)] for r in (0, 1)] == [Spot(group="train", bundle=r, resources={"GPU": 1.0}, turns=(r,)) for r in (0, 1)]


def test_shared_layouts_this_runtime_cannot_seat_are_named():
    guest_trainer = schedule(GPUS[:1], [Role(name="train", colocate_with="rollout"), Role(name="rollout")])
    with pytest.raises(PlacementError, match="role 'train' \\(colocated\\) cannot time-share devices under runtime=ray"):
        role_bundles(guest_trainer, {"GPU": 2})


def test_sharing_reports_handoffs_and_parks():
    import torch

    platform = select_platform("fake:cuda:1").platform

    class Engine:
        def __init__(self) -> None:
            self.model = torch.nn.Linear(4, 4)
            self.optimizer = torch.optim.AdamW(self.model.parameters())
            self.version = 0

        def sft_step(self, batch):
            return {}

        def load_weights(self, version, named_tensors):
            self.version = version

    sharing = Sharing(Turns(), platform)
    trainer, rollout = sharing.train(Engine()), sharing.rollout(Engine())
    try:
        trainer.sft_step(None)
        rollout.load_weights(1, [])
        trainer.sft_step(None)
        summary = sharing.summary()
        assert summary["handoffs"] == 3
        assert summary["seats"]["train"]["parks"] == 1 and summary["seats"]["rollout"]["parks"] == 1
        assert summary["seats"]["rollout"]["parked_bytes"] == 4 * 4 * 4 + 4 * 4  # weight and bias, float32
    finally:
        sharing.close()


def test_seats_in_two_processes_take_turns_through_a_turns_actor(ray_session):
    import ray

    from tidal.flow.colocate import TURNS_CONCURRENCY

    turns = ray.remote(num_cpus=0, max_concurrency=TURNS_CONCURRENCY)(Turns).remote()

    def wait_for(proxy, what, value):
        deadline = time.monotonic() + 30
        while proxy.state()[what] != value:
            assert time.monotonic() < deadline, proxy.state()
            time.sleep(0.02)

    @ray.remote(num_cpus=0)
    def other_process(handle, wait_for):
        from tidal.flow.colocate import TurnsProxy
        from tidal.flow.timeshare import Seat

        parked = []
        proxy = TurnsProxy(handle)
        seat = Seat(proxy, "rollout", park=lambda: parked.append("park"), unpark=lambda: parked.append("unpark"))
        try:
            with seat.turn():
                pass
            wait_for(proxy, "handoffs", 3)  # the trainer took its turn: our state was parked
            with seat.turn():
                pass
            return parked
        finally:
            seat.close()

    from tidal.flow.timeshare import Seat

    proxy, log = TurnsProxy(turns), []
    train = Seat(proxy, "train", park=lambda: log.append("park"), unpark=lambda: log.append("unpark"))
    try:
        with train.turn():
            pass
        ref = other_process.remote(turns, wait_for)
        wait_for(proxy, "resident", "rollout")  # our state was parked for the other process's turn
        with train.turn():  # ... and its state is parked for ours
            pass
        assert ray.get(ref, timeout=60) == ["park", "unpark"]
        assert log == ["park", "unpark", "park"] and proxy.state()["handoffs"] == 4
    finally:
        train.close()
    with pytest.raises(AttributeError):
        proxy.no_such_method
    ray.kill(turns)


def test_a_turns_proxy_reaches_every_method_a_seat_calls():
    """A seat under Ray reports a failed park through its proxy (`park_failed`): a method
    the proxy did not pass on raised AttributeError in the parking thread, and the seat
    waiting for the devices waited for ever."""
    public = {name for name, value in vars(Turns).items() if callable(value) and not name.startswith("_")}
    assert "park_failed" in public and public <= TurnsProxy._METHODS


def test_a_trainers_reference_policy_leaves_the_devices_with_its_weights():
    """With `kl_coef > 0` the torch engine keeps a frozen copy of the policy (`reference`) on
    its device. Only `model` and the optimizer were parked: a whole model's weights stayed on
    the devices through every rollout turn, and `parked_bytes` left them out."""
    import torch

    from tidal.engines.torch_train import TorchTrainEngine

    platform = select_platform("fake:cuda:1").platform
    engine = TorchTrainEngine(torch.nn.Linear(4, 4), kl_reference=True, platform=platform)
    reference = {p.data_ptr() for p in engine.reference.parameters()}

    class Guest:
        model = torch.nn.Linear(2, 2)

        def load_weights(self, version, named_tensors):
            pass

    sharing = Sharing(Turns(), platform)
    trainer, guest = sharing.train(engine), sharing.rollout(Guest())
    try:
        with trainer.seat.turn():
            pass
        guest.load_weights(1, [])  # the trainer parks
        assert reference.isdisjoint(p.data_ptr() for p in engine.reference.parameters())
        weights = (4 * 4 + 4) * 4  # float32 weight and bias
        assert sharing.summary()["seats"]["train"]["parked_bytes"] == 2 * weights  # the policy's and the reference's (no step taken: no gradients, no AdamW state)
        with trainer.seat.turn():
            assert all(torch.equal(p, q) for p, q in zip(engine.reference.parameters(), engine.model.parameters(), strict=True))
    finally:
        sharing.close()


def test_an_engine_that_parks_itself_is_parked_and_unparked_by_its_own_calls():
    """vLLM (sleep mode) and DeepSpeed (`offload_states`) free and take back their own memory:
    their seat calls `park` / `unpark` in turn, and moves no module."""
    import torch

    platform = select_platform("fake:cuda:1").platform
    calls = []

    class Trainer:
        def __init__(self) -> None:
            self.model = torch.nn.Linear(4, 4)
            self.version = 0

        def sft_step(self, batch):
            calls.append("train step")
            return {}

    class Sleepy:
        version = 0

        def park(self) -> None:
            calls.append("park")

        def unpark(self) -> None:
            calls.append("unpark")

        def load_weights(self, version, named_tensors):
            calls.append(f"load {version}")

    sharing = Sharing(Turns(), platform)
    trainer, rollout = sharing.train(Trainer()), sharing.rollout(Sleepy())
    try:
        trainer.sft_step(None)
        rollout.load_weights(1, [])
        trainer.sft_step(None)
        assert calls == ["train step", "load 1", "park", "train step"]  # the trainer's first turn parks nothing of the guest's yet
        rollout.load_weights(2, [])
        assert calls[-2:] == ["unpark", "load 2"]
        assert sharing.summary()["seats"]["rollout"] == {"parks": 1, "parked_bytes": 0}
    finally:
        sharing.close()
