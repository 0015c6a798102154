"""The weight transports by name: one registry in `tidal.hal.transfer`, every sender and
receiver satisfying the `WeightSender` / `WeightReceiver` protocols, and one wiring per
transport under `runtime: ray` (`flow.ray.wiring.make_wiring`)."""

from __future__ import annotations

import pytest

from tidal.flow.protocols import PostsWeights
from tidal.flow.ray.wiring import WIRINGS, make_wiring
from tidal.hal.transfer import TRANSPORTS, JoinsGroup, PlacesWeights, WeightReceiver, WeightSender, receiver_class, sender_class


def test_every_transport_has_a_sender_and_a_receiver_that_keep_the_protocols():
    for name in TRANSPORTS:
        sender, receiver = sender_class(name), receiver_class(name)
        assert issubclass(sender, WeightSender) and issubclass(receiver, WeightReceiver), name
        assert sender.__module__ == receiver.__module__ == f"tidal.hal.transfer.{name}"
    # the capabilities that set a transport apart are protocols too, not its name
    assert [n for n in TRANSPORTS if issubclass(sender_class(n), PlacesWeights)] == ["ipc"]
    assert [n for n in TRANSPORTS if issubclass(receiver_class(n), JoinsGroup)] == ["collective"]


def test_an_unknown_transport_is_refused_naming_the_known_ones():
    for lookup in (sender_class, receiver_class):
        with pytest.raises(ValueError, match="unknown weight transport 'nvlink'; transports: ipc, collective, host"):
            lookup("nvlink")
    with pytest.raises(ValueError, match="unknown weight transport 'nvlink'"):
        make_wiring("nvlink", None, host="127.0.0.1", token=None, bucket_bytes=1 << 20)


def test_every_transport_has_a_wiring_built_the_same_way():
    from tidal.hal import current_platform

    assert set(WIRINGS) == set(TRANSPORTS)
    for name in TRANSPORTS:
        wiring = make_wiring(name, current_platform(), host="127.0.0.1", token="t", bucket_bytes=1 << 20)
        try:
            assert isinstance(wiring, WIRINGS[name])
            assert isinstance(wiring, PostsWeights) == (name == "ipc")
        finally:
            wiring.close()
