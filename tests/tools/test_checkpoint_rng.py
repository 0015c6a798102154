"""`tools.checkpoint.set_rng_state`: which refused RNG states fall back to the host generators."""

import logging
import random

import pytest
import torch

from tidal.tools.checkpoint import rng_state, set_rng_state


@pytest.mark.parametrize("without_device", [False, True], ids=["device_empty", "device_missing"])
def test_a_refused_host_state_is_raised_not_retried_as_a_device_mismatch(caplog, without_device):
    """A checkpoint with no device states whose host state the platform refuses (here a torch
    generator state of the wrong size) has nothing a host-only retry could drop: the error is
    raised as it is, every generator keeps its state, and nothing claims the device states
    were the problem."""
    state = rng_state()
    bad = {**state, "torch": torch.zeros(3, dtype=torch.uint8)}
    if without_device:
        del bad["device"]
    expected_python, expected_torch = random.random(), torch.rand(2)
    set_rng_state(state)
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError, match="RNG state not restored"):
        set_rng_state(bad)
    assert "device RNG states do not fit" not in caplog.text
    assert random.random() == expected_python and torch.equal(torch.rand(2), expected_torch)


def test_device_states_another_platform_saved_still_fall_back_to_the_host_generators(caplog):
    """The fallback stays for what it is for: device states this platform cannot take."""
    state = rng_state()
    expected_python = random.random()
    with caplog.at_level(logging.WARNING):
        set_rng_state({**state, "device": [torch.zeros(16, dtype=torch.uint8)]})
    assert random.random() == expected_python
    assert "device RNG states do not fit this platform" in caplog.text
